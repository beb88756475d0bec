// What dsv4-server and dsv4-router share around httplib: a connection-per-thread pool that grows
// with the connections open (so /health never waits behind generations), a listening socket
// whose backlog takes a burst, the "listening on" line a supervisor (or a test) waits for, and
// serving until SIGTERM or SIGINT, which a thread of its own takes (sigwait) and answers with the
// program's drain, then stops the listener.
#pragma once

#include <httplib.h>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
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

// httplib serves a connection on one thread for as long as it is open (a stream for its whole
// length, a kept-alive connection between its requests). A fixed pool therefore fills with
// generations, and every later connection, /health's included, waits unseen in the pool's
// queue: a router polling /health then takes a busy server for a dead one. This pool starts a
// thread whenever a connection comes and none is idle, up to `max_threads` (past it, connections
// queue), and lets a thread idle for `idle` end, keeping `warm` of them.
class elastic_pool final : public httplib::TaskQueue {
public:
    elastic_pool(size_t max_threads, size_t warm, std::chrono::seconds idle)
        : max_(std::max<size_t>(max_threads, 1)), warm_(warm), idle_limit_(idle) {}

    ~elastic_pool() override { shutdown(); }

    void enqueue(std::function<void()> fn) override {
        std::unique_lock<std::mutex> lock(mu_);
        jobs_.push_back(std::move(fn));
        // Each idle thread takes one queued job when woken (under the lock), so the queue is
        // served at once while it is no longer than the idle threads.
        if (jobs_.size() <= idle_ || threads_ >= max_) {
            lock.unlock();
            cv_.notify_one();
            return;
        }
        threads_++;
        try {
            std::thread([this] { work(); }).detach();
        } catch (const std::system_error &) {
            // No thread to be had (RLIMIT_NPROC, memory): the job waits for a running one.
            threads_--;
            if (threads_ == 0) std::fprintf(stderr, "http: cannot start a thread for a connection; it waits\n");
        }
    }

    // Every queued connection is served, then the threads end (httplib calls this once its
    // listener has stopped).
    void shutdown() override {
        std::unique_lock<std::mutex> lock(mu_);
        stopping_ = true;
        cv_.notify_all();
        done_.wait(lock, [this] { return threads_ == 0; });
    }

    size_t threads() const {
        std::lock_guard<std::mutex> lock(mu_);
        return threads_;
    }

private:
    void work() {
        std::unique_lock<std::mutex> lock(mu_);
        while (true) {
            if (jobs_.empty()) {
                if (stopping_) break;
                idle_++;
                const bool woken = cv_.wait_for(lock, idle_limit_, [this] { return !jobs_.empty() || stopping_; });
                idle_--;
                if (!woken && threads_ > warm_) break;
                continue;
            }
            std::function<void()> fn = std::move(jobs_.front());
            jobs_.pop_front();
            lock.unlock();
            fn();
            fn = nullptr;  // the connection's captures go before the next wait
            lock.lock();
        }
        threads_--;
        // Notified under the lock: once shutdown() sees 0 it may destroy the pool, and this
        // thread touches nothing of it after the unlock.
        done_.notify_all();
    }

    const size_t max_, warm_;
    const std::chrono::seconds idle_limit_;
    mutable std::mutex mu_;
    std::condition_variable cv_, done_;
    std::deque<std::function<void()>> jobs_;
    size_t threads_ = 0, idle_ = 0;
    bool stopping_ = false;
};

// The listen backlog: the kernel's cap (net.core.somaxconn), at least 1024. httplib listens with
// a backlog of 5, so a burst of connections overflows the accept queue and clients see resets.
inline int listen_backlog() {
    int somaxconn = 0;
    std::ifstream f("/proc/sys/net/core/somaxconn");
    f >> somaxconn;
    return std::max(somaxconn, 1024);
}

// Raises the soft limit on open files to the hard one. The usual soft default is 1024 (systemd's
// too), and a burst needs a descriptor per client connection, per connection to a server and
// per kept-alive one: at 1024 a router in front of a PD pair ran out under 500 concurrent
// requests, and its calls failed as "did not answer: Read". Says so on stderr when even the hard
// limit is under `wanted`.
inline void raise_open_files_limit(const char *name, rlim_t wanted) {
    rlimit l{};
    if (getrlimit(RLIMIT_NOFILE, &l) != 0) return;
    if (l.rlim_cur < l.rlim_max) {
        l.rlim_cur = l.rlim_max;
        setrlimit(RLIMIT_NOFILE, &l);
        getrlimit(RLIMIT_NOFILE, &l);
    }
    if (l.rlim_cur != RLIM_INFINITY && l.rlim_cur < wanted)
        std::fprintf(stderr,
                     "%s: open files are limited to %llu (ulimit -n, hard limit): a burst of more connections "
                     "than about a third of that fails; raise the hard limit (LimitNOFILE= under systemd)\n",
                     name, static_cast<unsigned long long>(l.rlim_cur));
}

// The process's resident set in bytes (/proc/self/statm), 0 when unreadable.
inline uint64_t resident_bytes() {
    std::ifstream f("/proc/self/statm");
    uint64_t size = 0, resident = 0;
    f >> size >> resident;
    return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// How a program's HTTP server is set up: the elastic pool, kept-alive connections (a router
// reuses its connections to a server across requests), and a listening socket with address
// reuse only (httplib's default also sets SO_REUSEPORT, which would let a second server on the
// same port silently take half the connections).
struct options {
    size_t max_threads = 4096;
    size_t warm_threads = 8;
    std::chrono::seconds idle_thread{30};
    time_t keep_alive_s = 15;
    size_t keep_alive_requests = 100000;
};

class listener {
public:
    explicit listener(httplib::Server &http, const options &o = {}) : http_(http) {
        http.new_task_queue = [o] { return new elastic_pool(o.max_threads, o.warm_threads, o.idle_thread); };
        // Server-sent events are small writes a token apart: without TCP_NODELAY, Nagle's
        // algorithm holds one back until the client's (delayed) ACK of the last, up to 40 ms.
        http.set_tcp_nodelay(true);
        http.set_keep_alive_timeout(o.keep_alive_s);
        http.set_keep_alive_max_count(o.keep_alive_requests);
        http.set_socket_options([this](socket_t sock) {
            int yes = 1;
            setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
            socket_ = sock;
        });
    }

    // Binds host:port (0: any free port) and listens with listen_backlog(): the port, or -1 with
    // the reason on stderr.
    int bind(const char *name, const std::string &host, int port) {
        const int bound = port == 0 ? http_.bind_to_any_port(host) : (http_.bind_to_port(host, port) ? port : -1);
        if (bound < 0) {
            std::fprintf(stderr, "%s: cannot listen on %s:%d (in use, or not an address here)\n", name, host.c_str(), port);
            return -1;
        }
        // listen() again on the bound socket only changes its backlog (Linux).
        const int backlog = listen_backlog();
        if (socket_ < 0 || ::listen(socket_, backlog) != 0) {
            std::fprintf(stderr, "%s: cannot set the listen backlog to %d\n", name, backlog);
            return -1;
        }
        return bound;
    }

private:
    httplib::Server &http_;
    socket_t socket_ = -1;
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
