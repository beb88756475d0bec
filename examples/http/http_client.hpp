// dsv4-router's calls to its servers: kept-alive connections per server (a burst reuses them
// instead of opening, and leaving in TIME_WAIT, one per call), responses parsed by Boost.Beast,
// read as they arrive (a stream's events go to the client as they come), and every wait bounded
// and cancellable: a call whose client left is dropped within 100 ms, closing its connection,
// which the server sees as its client gone (it aborts the request).
#pragma once

#include "http_server.hpp"

#include <boost/beast/http/read.hpp>

#include <cstdint>
#include <limits>
#include <optional>

namespace web {

// A server's address, from "http://host:port".
struct endpoint {
    std::string url, host;
    int port = 80;

    static std::optional<endpoint> parse(const std::string &url) {
        const std::string scheme = "http://";
        if (url.rfind(scheme, 0) != 0) return std::nullopt;
        std::string rest = url.substr(scheme.size());
        if (!rest.empty() && rest.back() == '/') rest.pop_back();
        if (rest.find('/') != std::string::npos) return std::nullopt;
        endpoint e;
        e.url = url;
        const size_t colon = rest.rfind(':');
        if (colon != std::string::npos && rest.find(']', colon) == std::string::npos) {
            e.host = rest.substr(0, colon);
            e.port = std::atoi(rest.c_str() + colon + 1);
        } else {
            e.host = rest;
        }
        if (e.host.size() > 2 && e.host.front() == '[' && e.host.back() == ']') e.host = e.host.substr(1, e.host.size() - 2);
        if (e.host.empty() || e.port <= 0 || e.port > 65535) return std::nullopt;
        return e;
    }

    std::string host_header() const { return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port); }
};

// One connection to a server, with what it read past the last response.
struct upstream_connection {
    int fd = -1;
    boost::beast::flat_buffer buf;
    clock::time_point idle_since;
    bool reused = false;

    upstream_connection() = default;
    upstream_connection(const upstream_connection &) = delete;
    upstream_connection &operator=(const upstream_connection &) = delete;
    ~upstream_connection() {
        if (fd >= 0) ::close(fd);
    }
};

// How one call goes.
struct call_options {
    milliseconds connect_timeout{5000};
    milliseconds timeout{3600 * 1000};  // the whole call
    // Polled every 100 ms while the call waits: true drops the call (its client left).
    std::function<bool()> cancelled;
    // The response's status and headers as soon as they arrive.
    std::function<void(int status, const bhttp::fields &)> on_head;
    // Body bytes as they arrive (with on_head set); false drops the call. Without it the body
    // is collected into call_result::body.
    std::function<bool(const char *, size_t)> on_body;
};

struct call_result {
    int status = 0;  // 0: no response (see error)
    std::string content_type, body, error;
    bool cancelled = false;
    bool broken = false;  // the response broke off after its head
};

// Kept-alive connections to one server. Idle ones are reused for `max_idle` (under the
// server's own idle timeout, so the server does not close one as it is taken), at most 512.
class connection_pool {
public:
    connection_pool(endpoint e, milliseconds max_idle) : endpoint_(std::move(e)), max_idle_(max_idle) {}

    const endpoint &where() const { return endpoint_; }

    // An idle connection still open, or a new one (nullptr with `error` set).
    std::unique_ptr<upstream_connection> take(milliseconds connect_timeout, std::string &error) {
        while (true) {
            std::unique_ptr<upstream_connection> c;
            {
                std::lock_guard<std::mutex> lock(mu_);
                if (idle_.empty()) break;
                c = std::move(idle_.back());
                idle_.pop_back();
            }
            // Too old, or readable while idle (the server closed it, or sent what no request
            // asked for): not reused.
            pollfd p{c->fd, POLLIN | POLLRDHUP, 0};
            if (clock::now() - c->idle_since < max_idle_ && ::poll(&p, 1, 0) == 0) {
                c->reused = true;
                return c;
            }
        }
        return connect(connect_timeout, error);
    }

    void give_back(std::unique_ptr<upstream_connection> c) {
        c->idle_since = clock::now();
        c->buf.consume(c->buf.size());
        std::lock_guard<std::mutex> lock(mu_);
        if (idle_.size() < 512) idle_.push_back(std::move(c));
    }

    std::unique_ptr<upstream_connection> connect(milliseconds timeout, std::string &error) {
        addrinfo hints{}, *found = nullptr;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        const std::string service = std::to_string(endpoint_.port);
        if (int e = getaddrinfo(endpoint_.host.c_str(), service.c_str(), &hints, &found); e != 0) {
            error = std::string("cannot resolve the host: ") + gai_strerror(e);
            return nullptr;
        }
        std::unique_ptr<upstream_connection> c;
        error = "no address";
        for (addrinfo *a = found; a && !c; a = a->ai_next) {
            const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
            if (fd < 0) {
                error = std::strerror(errno);
                continue;
            }
            if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
                error = std::string("connection ") + std::strerror(errno);
                ::close(fd);
                continue;
            }
            pollfd p{fd, POLLOUT, 0};
            int so_error = 0;
            socklen_t len = sizeof(so_error);
            if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1 ||
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len) != 0 || so_error != 0) {
                error = so_error ? std::string("connection ") + std::strerror(so_error) : "connection timed out";
                ::close(fd);
                continue;
            }
            // Back to blocking: every wait is a poll with its own deadline.
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
            int one = 1;
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            c = std::make_unique<upstream_connection>();
            c->fd = fd;
        }
        freeaddrinfo(found);
        return c;
    }

private:
    const endpoint endpoint_;
    const milliseconds max_idle_;
    std::mutex mu_;
    std::vector<std::unique_ptr<upstream_connection>> idle_;
};

namespace detail {

// Waits for `events` on `fd` until `deadline`, waking every 100 ms for `cancelled`: 1 ready,
// 0 deadline, -1 cancelled.
inline int wait(int fd, short events, clock::time_point deadline, const std::function<bool()> &cancelled) {
    while (true) {
        if (cancelled && cancelled()) return -1;
        const auto now = clock::now();
        if (now >= deadline) return 0;
        const auto step = std::min<long long>(100, std::chrono::duration_cast<milliseconds>(deadline - now).count() + 1);
        pollfd p{fd, events, 0};
        const int r = ::poll(&p, 1, static_cast<int>(step));
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return 1;  // the next call reports the error
    }
}

}  // namespace detail

// One request to a server over a pooled connection. A connection that was reused and broke
// before any byte of the answer (the server closed it as it was taken) is tried once more on a
// new one: the server never saw that request.
inline call_result call(connection_pool &pool, const std::string &method, const std::string &target,
                        const std::vector<std::pair<std::string, std::string>> &headers, const std::string &body,
                        const call_options &o) {
    const auto deadline = clock::now() + o.timeout;
    std::string head = method + " " + target + " HTTP/1.1\r\nHost: " + pool.where().host_header() + "\r\n";
    for (const auto &h : headers) head += h.first + ": " + h.second + "\r\n";
    head += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
    const std::string out = head + body;
    for (int attempt = 0;; attempt++) {
        call_result r;
        std::unique_ptr<upstream_connection> c = pool.take(o.connect_timeout, r.error);
        if (!c) return r;
        const bool reused = c->reused;
        // The request.
        const char *p = out.data();
        size_t left = out.size();
        bool sent = true;
        while (left > 0) {
            const int w = detail::wait(c->fd, POLLOUT, deadline, o.cancelled);
            if (w <= 0) {
                r.cancelled = w < 0;
                r.error = w < 0 ? "cancelled" : "timed out";
                return r;
            }
            const ssize_t k = ::send(c->fd, p, left, MSG_NOSIGNAL);
            if (k < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                sent = false;
                r.error = std::string("write ") + std::strerror(errno);
                break;
            }
            p += k;
            left -= static_cast<size_t>(k);
        }
        // The answer.
        bhttp::response_parser<bhttp::string_body> parser;
        // No limit: the servers are ours (and Beast 1.74 compares a length with boost::none as
        // greater, so none would refuse every body).
        parser.body_limit(std::numeric_limits<std::uint64_t>::max());
        parser.header_limit(64 << 10);
        parser.eager(true);
        bool any_byte = false, head_seen = false, dropped = false;
        boost::system::error_code ec;
        while (sent && !parser.is_done()) {
            if (c->buf.size() > 0) {
                const size_t used = parser.put(c->buf.data(), ec);
                c->buf.consume(used);
                if (ec == bhttp::error::need_more) ec = {};
                if (ec) {
                    r.error = "a malformed answer: " + ec.message();
                    break;
                }
                if (parser.is_header_done() && !head_seen) {
                    head_seen = true;
                    r.status = static_cast<int>(parser.get().result_int());
                    r.content_type = std::string(parser.get()[bhttp::field::content_type]);
                    if (o.on_head) o.on_head(r.status, parser.get().base());
                }
                if (head_seen && o.on_body && !parser.get().body().empty()) {
                    std::string &b = parser.get().body();
                    if (!o.on_body(b.data(), b.size())) {
                        dropped = true;
                        r.cancelled = true;
                        r.error = "cancelled";
                        break;
                    }
                    b.clear();
                }
                if (parser.is_done()) break;
                if (used > 0) continue;
            }
            const int w = detail::wait(c->fd, POLLIN, deadline, o.cancelled);
            if (w <= 0) {
                r.cancelled = w < 0;
                r.error = w < 0 ? "cancelled" : "timed out";
                dropped = true;
                break;
            }
            auto space = c->buf.prepare(64 << 10);
            const ssize_t n = ::recv(c->fd, space.data(), space.size(), 0);
            if (n <= 0) {
                if (n == 0 && !head_seen && !any_byte) r.error = "closed the connection";
                else if (n == 0) r.error = "the answer broke off";
                else r.error = std::string("read ") + std::strerror(errno);
                // End of stream where the answer has no length: the parser decides.
                if (n == 0 && head_seen) {
                    parser.put_eof(ec);
                    if (!ec && parser.is_done()) break;
                }
                break;
            }
            any_byte = true;
            c->buf.commit(static_cast<size_t>(n));
        }
        if (parser.is_done() && !dropped) {
            if (!o.on_body) r.body = std::move(parser.get().body());
            r.error.clear();
            if (parser.get().keep_alive()) pool.give_back(std::move(c));
            return r;
        }
        if (!head_seen && !any_byte && reused && !r.cancelled && attempt == 0 && clock::now() < deadline) continue;
        if (head_seen && !dropped) r.broken = true;
        if (!head_seen) r.status = 0;
        return r;
    }
}

}  // namespace web
