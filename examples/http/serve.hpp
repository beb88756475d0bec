// What dsv4-server and dsv4-router share around their HTTP server (http_server.hpp): the listen
// backlog, the open-files limit, the limit flags, the resident memory, the "listening on" line a
// supervisor (or a test) waits for, and serving until SIGTERM or SIGINT, which a thread of its
// own takes (sigwait) and answers with the program's drain, then stops the listener.
#pragma once

#include "http_server.hpp"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
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

// The listen backlog: the kernel's cap (net.core.somaxconn), at least 1024, so a burst of
// connections waits in the accept queue instead of being dropped or reset.
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
                     "%s: open files are limited to %llu (ulimit -n, hard limit): lower --max-connections "
                     "or raise the hard limit (LimitNOFILE= under systemd)\n",
                     name, static_cast<unsigned long long>(l.rlim_cur));
}

// The process's resident set in bytes (/proc/self/statm), 0 when unreadable.
inline uint64_t resident_bytes() {
    std::ifstream f("/proc/self/statm");
    uint64_t size = 0, resident = 0;
    f >> size >> resident;
    return resident * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

// Numeric options (the limits) by name: each sets a variable from its value.
class flags {
public:
    void size(const std::string &name, size_t &into) {
        setters_[name] = [&into, name](const std::string &v) -> std::string {
            char *end = nullptr;
            const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
            if (v.empty() || *end != '\0' || v[0] == '-' || n == 0) return name + " takes a positive integer, got " + v;
            into = static_cast<size_t>(n);
            return "";
        };
    }

    void millis(const std::string &name, std::chrono::milliseconds &into) {
        setters_[name] = [&into, name](const std::string &v) -> std::string {
            char *end = nullptr;
            const long long n = std::strtoll(v.c_str(), &end, 10);
            if (v.empty() || *end != '\0' || n <= 0) return name + " takes a positive number of milliseconds, got " + v;
            into = std::chrono::milliseconds(n);
            return "";
        };
    }

    bool known(const std::string &name) const { return setters_.count(name) > 0; }

    // Empty when set, else why not.
    std::string set(const std::string &name, const std::string &value) {
        auto it = setters_.find(name);
        return it == setters_.end() ? "unknown option " + name : it->second(value);
    }

private:
    std::map<std::string, std::function<std::string(const std::string &)>> setters_;
};

// The help lines of the flags limit_flags registers, for the binaries' --help texts (a macro: it
// joins their string literals).
#define SERVE_LIMITS_HELP \
    "limits (what one client may hold; docs/serving.md):\n" \
    "  --max-connections N      client connections open at once, in total; a thread each (4096)\n" \
    "  --max-connections-per-client N   from one address (1024)\n" \
    "  --head-timeout-ms MS     the whole request head, from its first byte (10000)\n" \
    "  --idle-timeout-ms MS     a kept-alive connection between requests (15000)\n" \
    "  --body-timeout-ms MS     the whole body once its head is in (60000)\n" \
    "  --write-timeout-ms MS    a client that takes none of an answer for this long is dropped (30000)\n" \
    "  --max-head-bytes N       request line and headers (16384)\n"

// The limits' flags (docs/serving.md, "Limits") that the server and the router share.
inline void limit_flags(flags &f, web::limits &l) {
    f.size("--max-connections", l.max_connections);
    f.size("--max-connections-per-client", l.max_connections_per_client);
    f.millis("--head-timeout-ms", l.head_timeout);
    f.millis("--idle-timeout-ms", l.idle_timeout);
    f.millis("--body-timeout-ms", l.body_timeout);
    f.millis("--write-timeout-ms", l.write_timeout);
    f.size("--max-head-bytes", l.max_head_bytes);
}

// Blocks SIGTERM and SIGINT in this thread and every thread it starts afterwards (the engine's,
// the connections'): call it first thing in main. Returns the set for until_signal.
inline sigset_t block_stop_signals() {
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    return signals;
}

// Serves until a signal arrives: then runs `refuse_new` (from then on new requests are refused),
// prints "NAME: SIGTERM: draining", runs `drain` (which waits for the requests in flight,
// streams included) and stops the listener.
inline void until_signal(web::server &http, const sigset_t &signals, const char *name,
                         const std::function<void()> &refuse_new, const std::function<void()> &drain) {
    std::atomic<bool> main_done{false};
    std::thread waiter([&] {
        int sig = 0;
        sigwait(&signals, &sig);
        if (main_done.load()) return;  // woken by main: the listener has already stopped
        refuse_new();
        std::printf("%s: %s: draining\n", name, sig == SIGTERM ? "SIGTERM" : "SIGINT");
        std::fflush(stdout);
        drain();
        http.stop();
    });
    http.run();
    if (!main_done.exchange(true) && !http.stopping()) pthread_kill(waiter.native_handle(), SIGTERM);
    waiter.join();
}

}  // namespace serve
