// What dsv4-server and dsv4-router share around httplib: binding, the "listening on" line a
// supervisor (or a test) waits for, and serving until SIGTERM or SIGINT, which a thread of its
// own takes (sigwait) and answers with the program's drain, then stops the listener.
#pragma once

#include <httplib.h>

#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace serve {

// Waits until `count` reads 0, polling every 10 ms, at most `limit`; false if it has not.
template <typename T>
bool wait_for_zero(const std::atomic<T> &count, std::chrono::milliseconds limit) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (count.load() > 0) {
        if (std::chrono::steady_clock::now() >= deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
}

// Streamed responses still open, so a drain can wait for their last chunk: httplib's stop()
// ends a chunked response where it is, without its terminating chunk.
class streams {
public:
    // The resource releaser to pass to set_chunked_content_provider: the stream counts as open
    // until httplib is done with the response (written whole, or the client gone).
    httplib::ContentProviderResourceReleaser open() {
        open_.fetch_add(1);
        auto once = std::make_shared<std::atomic<bool>>(false);  // Response is copyable
        return [this, once](bool) {
            if (!once->exchange(true)) open_.fetch_sub(1);
        };
    }

    // Waits until none is open, at most `limit`; false if some still are.
    bool wait(std::chrono::milliseconds limit) const { return wait_for_zero(open_, limit); }

private:
    std::atomic<int> open_{0};
};

// Blocks SIGTERM and SIGINT in this thread and every thread it starts afterwards (the engine's,
// httplib's pool): call it first thing in main. Returns the set for serve_until_signal.
inline sigset_t block_stop_signals() {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    return signals;
}

// Binds `http` to host:port (0: any free port): the port, or -1 with the reason on stderr.
inline int bind(httplib::Server &http, const char *name, const std::string &host, int port) {
    const int bound = port == 0 ? http.bind_to_any_port(host) : (http.bind_to_port(host, port) ? port : -1);
    if (bound < 0)
        std::fprintf(stderr, "%s: cannot listen on %s:%d (in use, or not an address here)\n", name, host.c_str(), port);
    return bound;
}

// Serves until the listener ends on its own (false: it failed) or a signal arrives: then
// prints "NAME: SIGTERM: draining", runs `drain` (which refuses new requests and waits for
// those in flight, streams included: see `streams`) and stops the listener. True when stopped
// by a signal or cleanly.
inline bool until_signal(httplib::Server &http, const sigset_t &signals, const char *name,
                         const std::function<void()> &drain) {
    std::atomic<bool> signalled{false}, main_done{false};
    std::thread waiter([&] {
        int sig = 0;
        sigwait(&signals, &sig);
        if (main_done.load()) return;  // woken by main: the listener has already stopped
        signalled = true;
        std::printf("%s: %s: draining\n", name, sig == SIGTERM ? "SIGTERM" : "SIGINT");
        std::fflush(stdout);
        drain();
        // A signal right after the "listening" line may come before the listener runs, when
        // stop() would do nothing.
        while (!http.is_running() && !main_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        http.stop();
    });
    const bool listened = http.listen_after_bind();
    if (!signalled.load()) {
        // The listener ended on its own: wake the signal thread (it waits for a signal).
        main_done = true;
        pthread_kill(waiter.native_handle(), SIGTERM);
    }
    waiter.join();
    if (!listened && !signalled.load()) {
        std::fprintf(stderr, "%s: the listener failed\n", name);
        return false;
    }
    return true;
}

}  // namespace serve
