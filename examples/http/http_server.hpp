// The HTTP/1.1 server under dsv4-server and dsv4-router: every connection, byte and second a
// client can hold is bounded. Requests are parsed by Boost.Beast's parser (header and body
// limits, chunked bodies, conflicting lengths); this file owns the sockets, so it can enforce
// what the parser cannot: a deadline for the whole request head (a slowloris client sending a
// byte every few seconds is cut at it), caps on connections in total and per client address, a
// body limit applied from Content-Length before a byte of the body is read, writes that give up
// on a client that stops reading, and a way for a handler to learn that its client left.
//
// One thread serves one connection for as long as it is open (a handler may block on the engine,
// and a stream writes as tokens come); threads start as connections are accepted and end with
// them, so a connection cap is also the thread cap. Requests on a connection are answered in
// order (pipelining).
#pragma once

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace web {

namespace bhttp = boost::beast::http;
using clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What one client may hold. Every field has a command-line flag in dsv4-server and
// dsv4-router (docs/serving.md lists them with these defaults).
struct limits {
    size_t max_connections = 4096;             // open at once, in total (and so threads)
    size_t max_connections_per_client = 1024;  // from one address (a router is one address)
    milliseconds head_timeout{10000};          // the whole request head, from its first byte
    milliseconds idle_timeout{15000};          // a kept-alive connection between requests
    milliseconds body_timeout{60000};          // the whole body, once its head is in
    milliseconds write_timeout{30000};         // a write the client does not take at all
    size_t max_head_bytes = 16 << 10;          // request line and headers
    size_t max_body_bytes = 8 << 20;           // Content-Length, or a chunked body as it comes
};

// A JSON error body, {"error": {"message", "status", "code"}}, with `message` escaped.
inline std::string error_body(int code, const std::string &status, const std::string &message) {
    std::string m;
    for (unsigned char c : message) {
        if (c == '"' || c == '\\') {
            m += '\\';
            m += static_cast<char>(c);
        } else if (c < 0x20 || c >= 0x80) {
            char buf[8];
            std::snprintf(buf, sizeof(buf), "\\u%04x", c < 0x80 ? c : 0xfffd);
            m += buf;
        } else {
            m += static_cast<char>(c);
        }
    }
    return "{\"error\":{\"message\":\"" + m + "\",\"status\":\"" + status + "\",\"code\":" + std::to_string(code) + "}}";
}

// The offset of the first byte of `s` that is not part of well-formed UTF-8 (RFC 3629: no
// overlong forms, no surrogates, nothing past U+10FFFF), or npos.
inline size_t utf8_error_offset(const std::string &s) {
    const auto *p = reinterpret_cast<const unsigned char *>(s.data());
    const size_t n = s.size();
    size_t i = 0;
    while (i < n) {
        const unsigned char c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        unsigned char lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
        if (c >= 0xc2 && c <= 0xdf) len = 2;
        else if (c == 0xe0) len = 3, lo = 0xa0;
        else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
        else if (c == 0xed) len = 3, hi = 0x9f;
        else if (c == 0xf0) len = 4, lo = 0x90;
        else if (c >= 0xf1 && c <= 0xf3) len = 4;
        else if (c == 0xf4) len = 4, hi = 0x8f;
        else return i;
        if (i + 1 >= n || p[i + 1] < lo || p[i + 1] > hi) return i;
        for (size_t k = 2; k < len; k++)
            if (i + k >= n || p[i + k] < 0x80 || p[i + k] > 0xbf) return i;
        i += len;
    }
    return std::string::npos;
}

// One request, its head and whole body.
struct request {
    std::string method, target, path;  // path: the target without its query
    bhttp::fields headers;
    std::string body;
    std::string client;  // the peer's address

    bool has(const char *name) const { return headers.find(name) != headers.end(); }
    std::string header(const char *name) const {
        auto it = headers.find(name);
        return it == headers.end() ? std::string() : std::string(it->value());
    }
};

// Reads and writes one connected socket with deadlines (poll before every call).
class socket_io {
public:
    explicit socket_io(int fd) : fd_(fd) {}

    // Appends what arrives by `deadline` to `buf` (at most `max` bytes): the count, 0 at the
    // peer's end of stream, -1 on an error or at the deadline (`timed_out` says which).
    ssize_t read_some(boost::beast::flat_buffer &buf, size_t max, clock::time_point deadline, bool &timed_out) {
        timed_out = false;
        if (!wait(POLLIN, deadline)) {
            timed_out = true;
            return -1;
        }
        auto space = buf.prepare(max);
        const ssize_t n = ::recv(fd_, space.data(), space.size(), 0);
        if (n > 0) buf.commit(static_cast<size_t>(n));
        return n;
    }

    // Writes all of `data`; false when the peer is gone or took nothing for `stall` (a client
    // that stopped reading).
    bool write_all(const char *data, size_t n, milliseconds stall) {
        while (n > 0) {
            if (!wait(POLLOUT, clock::now() + stall)) return false;
            const ssize_t k = ::send(fd_, data, n, MSG_NOSIGNAL);
            if (k < 0) {
                if (errno == EINTR || errno == EAGAIN) continue;
                return false;
            }
            data += k;
            n -= static_cast<size_t>(k);
        }
        return true;
    }

    bool write_all(const std::string &s, milliseconds stall) { return write_all(s.data(), s.size(), stall); }

    // The peer closed or reset its side (a client that left).
    bool peer_gone() const {
        pollfd p{fd_, POLLRDHUP, 0};
        return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
    }

    int fd() const { return fd_; }

    // Closes after an answer sent while the client may still be sending (a refused body): the
    // sending side first, then what still arrives is read and dropped, for at most `limit`, so
    // the close does not reset the connection and destroy the answer before the client reads it.
    void linger_close(milliseconds limit) {
        ::shutdown(fd_, SHUT_WR);
        const auto deadline = clock::now() + limit;
        char sink[16 << 10];
        while (wait(POLLIN, deadline)) {
            const ssize_t n = ::recv(fd_, sink, sizeof(sink), 0);
            if (n <= 0 && !(n < 0 && errno == EINTR)) break;
        }
    }

    bool linger = false;  // set by an answer that refused the request mid-way

private:
    bool wait(short events, clock::time_point deadline) {
        while (true) {
            const auto left = std::chrono::duration_cast<milliseconds>(deadline - clock::now()).count();
            if (left <= 0) return false;
            pollfd p{fd_, events, 0};
            const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
            if (r > 0) return true;  // ready, or an error the next call reports
            if (r < 0 && errno != EINTR) return false;
        }
    }

    int fd_;
};

// What a handler answers with: a whole response (send), or a stream (begin, write..., end).
class reply {
public:
    reply(socket_io &io, const limits &l, bool head_only) : io_(io), limits_(l), head_only_(head_only) {}

    void header(const std::string &name, const std::string &value) { headers_ += name + ": " + value + "\r\n"; }

    // The whole answer. A second call is ignored.
    void send(int status, const std::string &content_type, const std::string &body) {
        if (state_ != state::fresh) return;
        state_ = state::sent;
        std::string out = status_line(status) + headers_ + "Content-Type: " + content_type +
                          "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" + connection_header() + "\r\n";
        if (!head_only_) out += body;
        ok_ = io_.write_all(out, limits_.write_timeout);
        status_ = status;
    }

    void send_error(int code, const std::string &status, const std::string &message) {
        if (code == 429 || code == 503) header("Retry-After", "1");
        send(code, "application/json", error_body(code, status, message));
    }

    // A streamed answer (chunked transfer encoding): its head now, then write() each piece,
    // then end(). Each returns false once the client is gone or stopped reading.
    bool begin(int status, const std::string &content_type) {
        if (state_ != state::fresh) return false;
        state_ = state::streaming;
        status_ = status;
        ok_ = io_.write_all(status_line(status) + headers_ + "Content-Type: " + content_type +
                                "\r\nTransfer-Encoding: chunked\r\n" + connection_header() + "\r\n",
                            limits_.write_timeout);
        return ok_;
    }

    bool write(const std::string &piece) {
        if (state_ != state::streaming || !ok_) return false;
        if (piece.empty()) return true;
        char size[24];
        std::snprintf(size, sizeof(size), "%zx\r\n", piece.size());
        ok_ = io_.write_all(std::string(size) + piece + "\r\n", limits_.write_timeout);
        return ok_;
    }

    bool end() {
        if (state_ != state::streaming) return ok_;
        state_ = state::sent;
        if (ok_) ok_ = io_.write_all("0\r\n\r\n", limits_.write_timeout);
        return ok_;
    }

    // The client closed its side or reset: its answer can go nowhere (a handler waiting on a
    // long request checks this and gives up).
    bool client_gone() const { return !ok_ || io_.peer_gone(); }

    // Asks for the connection to close after this answer.
    void close_after() { close_ = true; }

    bool answered() const { return state_ != state::fresh; }
    bool streaming() const { return state_ == state::streaming; }
    bool ok() const { return ok_; }
    bool closes() const { return close_; }
    int status() const { return status_; }

private:
    enum class state { fresh, streaming, sent };

    static std::string status_line(int status) {
        return "HTTP/1.1 " + std::to_string(status) + " " + std::string(bhttp::obsolete_reason(bhttp::int_to_status(status))) + "\r\n";
    }
    std::string connection_header() const { return close_ ? "Connection: close\r\n" : ""; }

    socket_io &io_;
    const limits &limits_;
    const bool head_only_;
    std::string headers_;
    state state_ = state::fresh;
    bool ok_ = true, close_ = false;
    int status_ = 0;
};

// Connections held, in total and per client address; a slot is taken at accept and given back
// when the connection's thread ends.
class connection_caps {
public:
    explicit connection_caps(const limits &l) : limits_(l) {}

    // 0 when taken, else the status to refuse with (503: the server is full, 429: this client).
    int take(const std::string &client) {
        std::lock_guard<std::mutex> lock(mu_);
        if (total_ >= limits_.max_connections) return 503;
        size_t &mine = per_client_[client];
        if (mine >= limits_.max_connections_per_client) return 429;
        mine++;
        total_++;
        return 0;
    }

    void give_back(const std::string &client) {
        std::lock_guard<std::mutex> lock(mu_);
        total_--;
        auto it = per_client_.find(client);
        if (it != per_client_.end() && --it->second == 0) per_client_.erase(it);
        cv_.notify_all();
    }

    size_t open() const {
        std::lock_guard<std::mutex> lock(mu_);
        return total_;
    }

    // Waits until none is open, at most `limit`.
    bool wait_none(milliseconds limit) {
        std::unique_lock<std::mutex> lock(mu_);
        return cv_.wait_for(lock, limit, [this] { return total_ == 0; });
    }

private:
    const limits &limits_;
    mutable std::mutex mu_;
    std::condition_variable cv_;
    size_t total_ = 0;
    std::map<std::string, size_t> per_client_;
};

class server {
public:
    using handler = std::function<void(const request &, reply &)>;

    explicit server(limits l) : limits_(l), caps_(limits_) {}

    ~server() {
        stop();
        if (listen_fd_ >= 0) ::close(listen_fd_);
    }

    void get(const std::string &path, handler h) { routes_[{"GET", path}] = std::move(h); }
    void post(const std::string &path, handler h) { routes_[{"POST", path}] = std::move(h); }

    // Binds host:port (0: a free port) and listens with a backlog for bursts (the kernel's
    // net.core.somaxconn, at least 1024): the port, or -1 with `error` set.
    int bind(const std::string &host, int port, int backlog, std::string &error) {
        addrinfo hints{}, *found = nullptr;
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
        const std::string service = std::to_string(port);
        if (int e = getaddrinfo(host.c_str(), service.c_str(), &hints, &found); e != 0) {
            error = std::string("cannot resolve ") + host + ": " + gai_strerror(e);
            return -1;
        }
        for (addrinfo *a = found; a; a = a->ai_next) {
            const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
            if (fd < 0) continue;
            int yes = 1;
            // Address reuse only: SO_REUSEPORT would let a second server on the port silently
            // take half the connections.
            setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
            if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, backlog) == 0) {
                listen_fd_ = fd;
                break;
            }
            error = std::strerror(errno);
            ::close(fd);
        }
        freeaddrinfo(found);
        if (listen_fd_ < 0) {
            error = "cannot listen on " + host + ":" + service + " (" + (error.empty() ? "no address" : error) + ")";
            return -1;
        }
        sockaddr_storage addr{};
        socklen_t len = sizeof(addr);
        getsockname(listen_fd_, reinterpret_cast<sockaddr *>(&addr), &len);
        return ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6 *>(&addr)->sin6_port
                                                : reinterpret_cast<sockaddr_in *>(&addr)->sin_port);
    }

    // Accepts until stop(); then returns (connections still open finish on their threads:
    // wait_connections).
    void run() {
        running_ = true;
        while (!stopping_.load()) {
            pollfd p{listen_fd_, POLLIN, 0};
            if (::poll(&p, 1, 100) <= 0) continue;
            sockaddr_storage addr{};
            socklen_t len = sizeof(addr);
            const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr *>(&addr), &len, SOCK_CLOEXEC);
            if (fd < 0) {
                // Out of descriptors (EMFILE): back off instead of spinning on the ready socket.
                if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(milliseconds(10));
                continue;
            }
            start(fd, address_of(addr));
        }
        running_ = false;
    }

    // Stops accepting; connections between requests close at once, requests in flight finish.
    void stop() { stopping_ = true; }
    bool stopping() const { return stopping_.load(); }
    bool running() const { return running_.load(); }

    // Waits until every connection has closed, at most `limit`.
    bool wait_connections(milliseconds limit) { return caps_.wait_none(limit); }

    size_t connections() const { return caps_.open(); }
    const limits &limit() const { return limits_; }

private:
    static std::string address_of(const sockaddr_storage &addr) {
        char text[INET6_ADDRSTRLEN] = "?";
        if (addr.ss_family == AF_INET)
            inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in *>(&addr)->sin_addr, text, sizeof(text));
        else if (addr.ss_family == AF_INET6)
            inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6 *>(&addr)->sin6_addr, text, sizeof(text));
        return text;
    }

    // A refusal written without waiting (it fits any socket buffer), then the connection closed.
    static void refuse_at_once(int fd, int code, const std::string &message) {
        const std::string body = error_body(code, code == 429 ? "TOO_MANY_CONNECTIONS" : "SERVER_FULL", message);
        const std::string out = "HTTP/1.1 " + std::to_string(code) + " " +
                                std::string(bhttp::obsolete_reason(bhttp::int_to_status(code))) +
                                "\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: " +
                                std::to_string(body.size()) + "\r\n\r\n" + body;
        (void)::send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        ::close(fd);
    }

    void start(int fd, const std::string &client) {
        if (const int refused = caps_.take(client)) {
            refuse_at_once(fd, refused,
                           refused == 429 ? "this address holds " + std::to_string(limits_.max_connections_per_client) +
                                                " connections already (--max-connections-per-client)"
                                          : "the server holds " + std::to_string(limits_.max_connections) +
                                                " connections already (--max-connections)");
            return;
        }
        int one = 1;
        // A stream's events are small writes a token apart: Nagle's algorithm would hold each
        // back until the client's (delayed) ACK of the last, up to 40 ms.
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        try {
            std::thread([this, fd, client] {
                socket_io io(fd);
                serve(io, client);
                if (io.linger) io.linger_close(milliseconds(2000));
                ::close(fd);
                caps_.give_back(client);
            }).detach();
        } catch (const std::system_error &) {
            caps_.give_back(client);
            refuse_at_once(fd, 503, "the server cannot start a thread for this connection");
        }
    }

    // One connection: its requests, one after the other, until it closes, breaks a limit or
    // the server stops.
    void serve(socket_io &io, const std::string &client) {
        boost::beast::flat_buffer buf;
        bool first = true;
        while (!stopping_.load()) {
            // The wait for a request's first byte: the head deadline for a new connection, the
            // idle timeout between requests on a kept-alive one.
            const auto wait_until = clock::now() + (first ? limits_.head_timeout : limits_.idle_timeout);
            if (buf.size() == 0) {
                bool timed_out = false;
                ssize_t n = 0;
                // Woken every 250 ms to see whether the server stops.
                while (buf.size() == 0) {
                    const auto step = std::min(wait_until, clock::now() + milliseconds(250));
                    n = io.read_some(buf, 16 << 10, step, timed_out);
                    if (n > 0 || !timed_out || clock::now() >= wait_until || stopping_.load()) break;
                }
                if (n <= 0) {
                    if (timed_out && first && clock::now() >= wait_until && !stopping_.load())
                        refuse(io, 408, "REQUEST_TIMEOUT", "no request within " + seconds(limits_.head_timeout));
                    return;
                }
            }
            const auto head_deadline = (first ? wait_until : clock::now() + limits_.head_timeout);
            first = false;
            if (!one_request(io, buf, client, head_deadline)) return;
        }
    }

    static std::string seconds(milliseconds t) {
        char text[32];
        std::snprintf(text, sizeof(text), "%g s", static_cast<double>(t.count()) / 1000.0);
        return text;
    }

    // A refusal of the HTTP layer's own; the connection closes after it.
    void refuse(socket_io &io, int code, const std::string &status, const std::string &message) {
        io.linger = true;
        reply r(io, limits_, false);
        r.close_after();
        r.send_error(code, status, message);
    }

    // Reads one request (head by `head_deadline`, then its body), runs its handler and
    // answers; false when the connection must close.
    bool one_request(socket_io &io, boost::beast::flat_buffer &buf, const std::string &client,
                     clock::time_point head_deadline) {
        bhttp::request_parser<bhttp::string_body> parser;
        parser.header_limit(static_cast<std::uint32_t>(limits_.max_head_bytes));
        parser.body_limit(limits_.max_body_bytes);
        parser.eager(false);
        // The head.
        if (!feed(io, buf, parser, [&] { return parser.is_header_done(); }, head_deadline,
                  "the request head did not arrive whole within " + seconds(limits_.head_timeout)))
            return false;
        const auto &head = parser.get();
        request req;
        req.method = std::string(head.method_string());
        req.target = std::string(head.target());
        req.path = req.target.substr(0, req.target.find('?'));
        req.client = client;
        // Framing that a proxy in front could read differently (request smuggling): refused.
        if (head.count(bhttp::field::content_length) > 1)
            return refuse_framing(io, "more than one Content-Length header");
        if (head.count(bhttp::field::transfer_encoding) > 0) {
            if (head.count(bhttp::field::transfer_encoding) > 1 || !parser.chunked() ||
                !boost::beast::iequals(head[bhttp::field::transfer_encoding], "chunked"))
                return refuse_framing(io, "Transfer-Encoding other than a single \"chunked\"");
        }
        if (head.count(bhttp::field::range) > 0 && req.method != "GET" && req.method != "HEAD")
            return refuse_framing(io, "a Range header on " + req.method + " (ranges apply to GET only)");
        // The body: refused from Content-Length before any of it is read; a chunked one as it
        // comes (the parser's body limit).
        if (parser.content_length() && *parser.content_length() > limits_.max_body_bytes) {
            refuse(io, 413, "PAYLOAD_TOO_LARGE",
                   "the body is " + std::to_string(*parser.content_length()) + " bytes; at most " +
                       std::to_string(limits_.max_body_bytes) + " are accepted (--max-body-bytes)");
            return false;
        }
        if (boost::beast::iequals(head[bhttp::field::expect], "100-continue") && head.version() >= 11) {
            if (!io.write_all(std::string("HTTP/1.1 100 Continue\r\n\r\n"), limits_.write_timeout)) return false;
        }
        parser.eager(true);
        if (!feed(io, buf, parser, [&] { return parser.is_done(); }, clock::now() + limits_.body_timeout,
                  "the request body did not arrive whole within " + seconds(limits_.body_timeout)))
            return false;
        bhttp::request<bhttp::string_body> message = parser.release();
        const bool keep_alive = message.keep_alive();  // read before the headers move out
        req.headers = std::move(message.base());
        req.body = std::move(message.body());
        return dispatch(io, req, keep_alive);
    }

    // Reads into `parser` until `done()` (the head, then the body), by `deadline`: false (after
    // a 400/413/431, or a 408 with `late`) when the request is malformed, too large or late, or
    // the connection ended.
    template <typename Done>
    bool feed(socket_io &io, boost::beast::flat_buffer &buf, bhttp::request_parser<bhttp::string_body> &parser,
              Done done, clock::time_point deadline, const std::string &late) {
        boost::system::error_code ec;
        while (!done()) {
            if (buf.size() > 0) {
                const size_t used = parser.put(buf.data(), ec);
                buf.consume(used);
                if (ec == bhttp::error::need_more) ec = {};
                if (ec) return refuse_parse_error(io, ec);
                if (done()) break;
                if (used > 0) continue;
            }
            bool timed_out = false;
            const ssize_t n = io.read_some(buf, 64 << 10, deadline, timed_out);
            if (n <= 0) {
                if (timed_out) refuse(io, 408, "REQUEST_TIMEOUT", late);
                return false;
            }
        }
        return true;
    }

    bool refuse_framing(socket_io &io, const std::string &what) {
        refuse(io, 400, "BAD_REQUEST", "the request has " + what + ": refused (its length would be ambiguous)");
        return false;
    }

    bool refuse_parse_error(socket_io &io, const boost::system::error_code &ec) {
        if (ec == bhttp::error::header_limit)
            refuse(io, 431, "HEADER_TOO_LARGE",
                   "the request head is larger than " + std::to_string(limits_.max_head_bytes) + " bytes");
        else if (ec == bhttp::error::body_limit)
            refuse(io, 413, "PAYLOAD_TOO_LARGE",
                   "the body is larger than " + std::to_string(limits_.max_body_bytes) + " bytes (--max-body-bytes)");
        else
            refuse(io, 400, "BAD_REQUEST", "the request is not valid HTTP/1.1: " + ec.message());
        return false;
    }

    bool dispatch(socket_io &io, const request &req, bool keep_alive) {
        const bool head_only = req.method == "HEAD";
        reply r(io, limits_, head_only);
        if (!keep_alive || stopping_.load()) r.close_after();
        auto it = routes_.find({head_only ? std::string("GET") : req.method, req.path});
        if (it == routes_.end()) {
            bool other_method = false;
            for (const auto &route : routes_) other_method = other_method || route.first.second == req.path;
            if (other_method) r.send_error(405, "METHOD_NOT_ALLOWED", req.method + " is not allowed on " + req.path);
            else r.send_error(404, "NOT_FOUND", "no endpoint " + req.path);
        } else {
            try {
                it->second(req, r);
            } catch (const std::exception &e) {
                if (!r.answered()) r.send_error(500, "INTERNAL", std::string("the handler failed: ") + e.what());
            }
            if (!r.answered()) r.send_error(500, "INTERNAL", "the handler gave no answer");
            if (r.streaming()) r.end();
        }
        return r.ok() && !r.closes();
    }

    limits limits_;
    connection_caps caps_;
    std::map<std::pair<std::string, std::string>, handler> routes_;
    int listen_fd_ = -1;
    std::atomic<bool> stopping_{false}, running_{false};
};

}  // namespace web
