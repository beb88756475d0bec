// dsv4-router: one HTTP front end over dsv4-server instances in the prefill and decode roles.
//
//   dsv4-router --prefill URL [URL...] --decode URL [URL...] [--host 127.0.0.1] [--port 30080]
//               [--timeout SECONDS] [--wait SECONDS] [--http-threads N] [--retries 2] [--poll-ms 500]
//
// For each request (POST /generate, /v1/completions, /v1/chat/completions, the bodies
// dsv4-server takes) it picks the least loaded prefill and decode server in rotation (each
// server's /metrics, polled every --poll-ms: requests queued and running, PD rooms in flight, KV
// usage; plus the calls the router has open to it), assigns a room, and
// sends the same body to both at once: to the prefill with the room, to the decode with the
// room and the prefill's endpoint (bootstrap_host/bootstrap_port, read from the prefill's
// /server_info at start). The client gets the decode's answer, streamed as it comes when it
// asked for a stream. When one side refuses or fails, the router aborts the other side's half
// (POST /abort_request with the "rid" it gave both) and answers with the failing side's status
// and body: a 429 from a prefill reaches the client as that 429, not as a decode timeout. A
// refusal with 429 or 503, or a server that does not answer, is first tried again (up to
// --retries times) on other servers, as long as nothing has reached the client. A server whose
// /health fails (or that refuses connections) leaves the rotation until /health answers again.
//
// GET /health   200 when every server answers its /health with 200, else 503; per-server states
// GET /metrics  the router's own counters (requests by outcome, in flight, per server)
// SIGTERM or SIGINT: stop accepting, let the requests in flight end, exit 0.
// docs/serving.md has the details.
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "../http/serve.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using json = nlohmann::json;

namespace {

json error_json(int code, const std::string &status, const std::string &message) {
    return {{"error", {{"message", message}, {"status", status}, {"code", code}}}};
}

// One dsv4-server the router sends requests to.
struct backend {
    std::string url;   // http://host:port
    std::string role;  // "prefill" or "decode"
    // A prefill's PD endpoint, which the decode's half of a request names.
    std::string bootstrap_host;
    int bootstrap_port = 0;
    std::atomic<uint64_t> requests{0};
    // In rotation: its /health answered 200 at the last poll, and no call to it has failed to
    // connect since.
    mutable std::atomic<bool> up{true};  // taken out of rotation through const references too
    // Its load at the last poll of its /metrics: requests queued and running; on a prefill
    // also its computed rooms waiting for their claim (they hold pages but no longer run); on a
    // decode plus twice its KV usage (0..1), so the one with more pages free breaks ties (a
    // prefill's pages are mostly its prefix cache, which it evicts). The other room gauges
    // count requests already queued or running.
    std::atomic<double> polled_load{0.0};
    // Calls the router has open to it now (counted at once, between polls).
    std::atomic<int64_t> open_calls{0};

    double load() const { return polled_load.load() + static_cast<double>(open_calls.load()); }
};

// The load a server's exposition shows (see backend::polled_load); every sample of a series
// counts (a server may add labels of its own).
double load_of(const std::string &exposition, bool decode) {
    double load = 0.0;
    std::istringstream lines(exposition);
    std::string line;
    while (std::getline(lines, line)) {
        if (line.empty() || line[0] == '#') continue;
        const size_t name_end = line.find_first_of("{ ");
        const size_t value_at = line.rfind(' ');
        if (name_end == std::string::npos || value_at == std::string::npos) continue;
        const std::string name = line.substr(0, name_end);
        const double v = std::strtod(line.c_str() + value_at + 1, nullptr);
        if (name == "dsv4_num_queue_reqs" || name == "dsv4_num_running_reqs" ||
            (!decode && name == "dsv4_num_prefill_bootstrap_queue_reqs"))
            load += v;
        else if (decode && name == "dsv4_token_usage")
            load += 2.0 * v;
    }
    return load;
}

// A refusal worth trying on another server: queue full (429), draining (503), no answer (502).
bool retryable(int status) { return status == 429 || status == 502 || status == 503; }

// The answer of one call to a server: its status (0: no answer), content type and body.
struct reply {
    int status = 0;
    std::string content_type = "application/json";
    std::string body;
};

std::unique_ptr<httplib::Client> client(const std::string &url, time_t timeout_s) {
    auto c = std::make_unique<httplib::Client>(url);
    c->set_connection_timeout(5);
    c->set_read_timeout(timeout_s);
    c->set_write_timeout(timeout_s);
    return c;
}

// A body for "the server did not answer": 502, naming the server and why.
reply unreachable(const backend &b, const std::string &why) {
    reply r;
    r.status = 502;
    r.body = error_json(502, "BAD_GATEWAY", b.role + " server " + b.url + " did not answer: " + why).dump();
    return r;
}

reply post(const backend &b, const std::string &path, const std::string &body, time_t timeout_s) {
    auto c = client(b.url, timeout_s);
    httplib::Result res = c->Post(path.c_str(), body, "application/json");
    if (!res) return unreachable(b, httplib::to_string(res.error()));
    reply r;
    r.status = res->status;
    r.content_type = res->get_header_value("Content-Type");
    r.body = res->body;
    return r;
}

// Aborts a request's half on a server by the rid the router gave it; best effort (the server
// remembers an abort that arrives before its request).
void abort_on(const backend &b, const std::string &rid) {
    auto c = client(b.url, 5);
    (void)c->Post("/abort_request", json{{"rid", rid}}.dump(), "application/json");
}

// One routed request: what the prefill and the decode answered, the decode's body as it
// arrives, shared by the two calls' threads and the client's handler.
struct exchange {
    std::mutex mu;
    std::condition_variable cv;
    bool prefill_done = false;
    reply prefill;
    bool decode_headers = false, decode_done = false;
    // The decode's answer broke off after its headers (the server died mid-answer).
    bool decode_broken = false;
    reply decode;                     // status and content type; body only when not streamed
    std::deque<std::string> chunks;   // the decode's body, streamed
    bool client_gone = false;

    bool prefill_failed() const { return prefill_done && prefill.status != 200; }
    bool decode_failed() const { return decode_done && decode.status != 200; }
};

class router {
public:
    router(std::vector<std::unique_ptr<backend>> prefills, std::vector<std::unique_ptr<backend>> decodes,
           time_t timeout_s, int retries, std::chrono::milliseconds poll)
        : prefills_(std::move(prefills)), decodes_(std::move(decodes)), timeout_s_(timeout_s), retries_(retries) {
        // Rooms from a random 63-bit start, so two routers (or a restarted one) in front of the
        // same servers do not hand out the same rooms.
        std::random_device rd;
        next_room_ = ((static_cast<uint64_t>(rd()) << 32) ^ rd()) & (UINT64_MAX >> 2);
        poll_once();  // health and loads known before the first request
        poller_ = std::thread([this, poll] { poll_loop(poll); });
    }

    ~router() {
        {
            std::lock_guard<std::mutex> lock(poll_mu_);
            polling_ = false;
        }
        poll_cv_.notify_all();
        poller_.join();
    }

    void routes(httplib::Server &http) {
        for (const char *path : {"/generate", "/v1/completions", "/v1/chat/completions"}) {
            std::string p = path;
            http.Post(path, [this, p](const httplib::Request &req, httplib::Response &res) { forward(p, req, res); });
        }
        http.Get("/health", [this](const httplib::Request &, httplib::Response &res) { health(res); });
        http.Get("/metrics", [this](const httplib::Request &, httplib::Response &res) {
            res.set_content(metrics(), "text/plain; version=0.0.4");
        });
    }

    // SIGTERM: new requests get 503; waits (at most `limit`) for the streams still open.
    void stop_accepting(std::chrono::seconds limit) {
        stopping_ = true;
        (void)streams_.wait(limit);
    }

    // Waits until the calls to servers have ended (the last aborts), at most `limit`; false if
    // some have not (their threads use this router: the caller must not destroy it then).
    bool drain(std::chrono::seconds limit) { return serve::wait_for_zero(in_flight_, limit); }

private:
    enum outcome { ok, refused_prefill, refused_decode, bad_request, n_outcomes };

    void count(outcome o) { outcomes_[o].fetch_add(1); }

    // Starts `f` on a detached thread; if the thread cannot start, takes back its counts and
    // rethrows (httplib answers 500).
    template <typename F>
    void start_or_uncount(backend &b, F &&f) {
        try {
            std::thread(std::forward<F>(f)).detach();
        } catch (...) {
            b.open_calls.fetch_sub(1);
            in_flight_.fetch_sub(1);
            throw;
        }
    }

    void forward(const std::string &path, const httplib::Request &req, httplib::Response &res) {
        if (stopping_.load()) {
            res.status = 503;
            res.set_content(error_json(503, "DSV4_ERR_SHUTDOWN", "the router is shutting down (SIGTERM)").dump(),
                            "application/json");
            return;
        }
        json j;
        try {
            j = json::parse(req.body);
        } catch (const json::exception &e) {
            count(bad_request);
            res.status = 400;
            res.set_content(error_json(400, "DSV4_ERR_INVALID_ARGUMENT", std::string("the body is not valid JSON: ") + e.what()).dump(),
                            "application/json");
            return;
        }
        if (!j.is_object() || (j.contains("stream") && !j["stream"].is_boolean())) {
            count(bad_request);
            res.status = 400;
            res.set_content(error_json(400, "DSV4_ERR_INVALID_ARGUMENT", "the body must be a JSON object whose stream is a boolean").dump(),
                            "application/json");
            return;
        }
        const bool stream = j.value("stream", false);
        // Tries on other servers while a server refuses with 429 / 503 or does not answer and
        // nothing has reached the client yet.
        std::vector<const backend *> refused;
        reply last;
        outcome last_outcome = refused_decode;
        for (int attempt = 0;; attempt++) {
            backend *p = pick(prefills_, next_prefill_, refused, attempt == 0);
            backend *d = pick(decodes_, next_decode_, refused, attempt == 0);
            if (!p || !d) {
                // Every server of a role refused this request (or is down): the last answer.
                count(last_outcome);
                send(res, last.status ? last : unreachable_all(!p ? "prefill" : "decode"));
                return;
            }
            outcome_of_try t = try_once(path, j, stream, *p, *d);
            if (t.x) {  // a stream whose headers came: it is the client's now
                count(ok);
                stream_to(res, t.x);
                return;
            }
            if (t.refused_by && retryable(t.r.status) && attempt < retries_) {
                refused.push_back(t.refused_by);
                if (t.r.status == 502) mark_down(*t.refused_by, "a call did not connect or broke off");
                retries_total_.fetch_add(1);
                last = std::move(t.r);
                last_outcome = t.refused_by->role == "prefill" ? refused_prefill : refused_decode;
                continue;
            }
            count(t.r.status == 200 ? ok : (t.refused_by && t.refused_by->role == "prefill" ? refused_prefill : refused_decode));
            send(res, t.r);
            return;
        }
    }

    // What one try of a request came to: a stream for the client (`x`), or an answer `r`, with
    // the server that refused or failed it (`refused_by`).
    struct outcome_of_try {
        std::shared_ptr<exchange> x;
        reply r;
        const backend *refused_by = nullptr;
    };

    // The least loaded server of `group` in rotation and not in `refused` (ties: round robin);
    // on a first try, a server out of rotation when none is in (its last poll may be stale).
    backend *pick(std::vector<std::unique_ptr<backend>> &group, std::atomic<uint64_t> &turn,
                  const std::vector<const backend *> &refused, bool first) {
        const size_t n = group.size(), start = turn.fetch_add(1);
        for (bool need_up : {true, false}) {
            if (!need_up && !first) break;
            backend *best = nullptr;
            for (size_t k = 0; k < n; k++) {
                backend *b = group[(start + k) % n].get();
                if (need_up && !b->up.load()) continue;
                if (std::find(refused.begin(), refused.end(), b) != refused.end()) continue;
                if (!best || b->load() < best->load()) best = b;
            }
            if (best) return best;
        }
        return nullptr;
    }

    reply unreachable_all(const std::string &role) const {
        reply r;
        r.status = 502;
        r.body = error_json(502, "BAD_GATEWAY", "no " + role + " server is in rotation (every /health failed): see the router's /health").dump();
        return r;
    }

    outcome_of_try try_once(const std::string &path, const json &j, bool stream, backend &p, backend &d) {
        p.requests.fetch_add(1);
        d.requests.fetch_add(1);
        const uint64_t room = next_room_.fetch_add(1) & (UINT64_MAX >> 1);
        const std::string rid = "dsv4-router-" + std::to_string(room);
        json pj = j, dj = j;
        pj["bootstrap_room"] = dj["bootstrap_room"] = room;
        pj["rid"] = dj["rid"] = rid;
        pj["stream"] = false;  // its answer is only "transferred"
        dj["bootstrap_host"] = p.bootstrap_host;
        dj["bootstrap_port"] = p.bootstrap_port;

        auto x = std::make_shared<exchange>();
        const time_t timeout = timeout_s_;
        // Counted as each starts: a thread that fails to start (httplib answers 500) leaves
        // no count behind.
        in_flight_.fetch_add(1);
        p.open_calls.fetch_add(1);
        start_or_uncount(p, [this, x, &p, &d, path, rid, body = pj.dump(), timeout] {
            reply r = post(p, path, body, timeout);
            const bool failed = r.status != 200;
            {
                std::lock_guard<std::mutex> lock(x->mu);
                x->prefill = std::move(r);
                x->prefill_done = true;
            }
            x->cv.notify_all();
            if (failed) abort_on(d, rid);  // else the decode waits for its room until the timeout
            p.open_calls.fetch_sub(1);
            in_flight_.fetch_sub(1);
        });
        in_flight_.fetch_add(1);
        d.open_calls.fetch_add(1);
        start_or_uncount(d, [this, x, &p, &d, path, rid, body = dj.dump(), timeout, stream] {
            call_decode(*x, d, path, body, timeout, stream);
            bool failed;
            {
                std::lock_guard<std::mutex> lock(x->mu);
                failed = x->decode.status != 200 || x->decode_broken;
            }
            if (failed) abort_on(p, rid);  // else the prefill holds the room's pages until the timeout
            d.open_calls.fetch_sub(1);
            in_flight_.fetch_sub(1);
        });

        outcome_of_try t;
        std::unique_lock<std::mutex> lock(x->mu);
        // The prefill's answer comes when its room has been handed over, about when the decode's
        // first token does; waiting for it lets a refusal on either side reach the client as
        // its status (or be tried elsewhere), not as a broken stream.
        x->cv.wait(lock, [&] { return x->prefill_done || x->decode_failed(); });
        if (x->prefill_failed()) {
            // At once: the decode's half is being aborted by the prefill's thread (which, with
            // the decode's, holds `x` until it ends).
            t.r = x->prefill;
            t.refused_by = &p;
            return t;
        }
        if (x->decode_failed() || !stream) {
            x->cv.wait(lock, [&] { return x->decode_done; });
            if (x->decode_broken) {
                t.r = unreachable(d, "the answer broke off");
                t.refused_by = &d;
            } else {
                t.r = x->decode;
                if (t.r.status != 200) t.refused_by = &d;
            }
            return t;
        }
        x->cv.wait(lock, [&] { return x->decode_headers || x->decode_done; });
        if (x->decode.status != 200) {
            x->cv.wait(lock, [&] { return x->decode_done; });
            t.r = x->decode;
            t.refused_by = &d;
            return t;
        }
        t.x = x;
        return t;
    }

    void stream_to(httplib::Response &res, const std::shared_ptr<exchange> &x) {
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            x->decode.content_type.empty() ? "text/event-stream" : x->decode.content_type,
            [x](size_t, httplib::DataSink &sink) {
                std::unique_lock<std::mutex> lock(x->mu);
                x->cv.wait(lock, [&] { return !x->chunks.empty() || x->decode_done; });
                if (x->chunks.empty()) {
                    if (x->decode_broken) return false;  // the client sees the stream break too
                    sink.done();
                    return true;
                }
                std::string chunk = std::move(x->chunks.front());
                x->chunks.pop_front();
                lock.unlock();
                if (!sink.write(chunk.data(), chunk.size())) {
                    // The client went away: the decode call stops reading and closes its
                    // connection, and the server aborts the request at its next write.
                    std::lock_guard<std::mutex> relock(x->mu);
                    x->client_gone = true;
                    return false;
                }
                return true;
            },
            streams_.open());
    }

    // Takes a server out of rotation until its /health answers again.
    void mark_down(const backend &b, const std::string &why) {
        if (b.up.exchange(false)) {
            std::printf("dsv4-router: %s server %s out of rotation: %s\n", b.role.c_str(), b.url.c_str(), why.c_str());
            std::fflush(stdout);
        }
    }

    // poll_once every `every`, until the router goes.
    void poll_loop(std::chrono::milliseconds every) {
        std::unique_lock<std::mutex> lock(poll_mu_);
        while (polling_) {
            poll_cv_.wait_for(lock, every, [this] { return !polling_; });
            if (!polling_) break;
            lock.unlock();
            poll_once();
            lock.lock();
        }
    }

    // Each server's /health (in or out of rotation) and /metrics (its load).
    void poll_once() {
        for (const auto *group : {&prefills_, &decodes_}) {
            for (const auto &b : *group) {
                auto c = client(b->url, 1);
                c->set_connection_timeout(1);
                httplib::Result h = c->Get("/health");
                if (!h || h->status != 200) {
                    mark_down(*b, h ? "/health answered " + std::to_string(h->status) : "/health: " + httplib::to_string(h.error()));
                    continue;
                }
                if (httplib::Result m = c->Get("/metrics"); m && m->status == 200)
                    b->polled_load = load_of(m->body, b->role == "decode");
                if (!b->up.exchange(true)) {
                    std::printf("dsv4-router: %s server %s back in rotation\n", b->role.c_str(), b->url.c_str());
                    std::fflush(stdout);
                }
            }
        }
    }

    // The decode's half: its status as soon as the headers come, then its body, streamed into
    // the exchange's chunks when the client streams (else whole into decode.body).
    void call_decode(exchange &x, const backend &d, const std::string &path, const std::string &body,
                     time_t timeout, bool stream) {
        auto c = client(d.url, timeout);
        httplib::Request req;
        req.method = "POST";
        req.path = path;
        req.body = body;
        req.set_header("Content-Type", "application/json");
        req.response_handler = [&](const httplib::Response &r) {
            {
                std::lock_guard<std::mutex> lock(x.mu);
                x.decode.status = r.status;
                x.decode.content_type = r.get_header_value("Content-Type");
                x.decode_headers = true;
            }
            x.cv.notify_all();
            return true;
        };
        req.content_receiver = [&](const char *data, size_t n, uint64_t, uint64_t) {
            {
                std::lock_guard<std::mutex> lock(x.mu);
                if (x.client_gone) return false;
                if (stream && x.decode.status == 200) x.chunks.emplace_back(data, n);
                else x.decode.body.append(data, n);
            }
            x.cv.notify_all();
            return true;
        };
        httplib::Response res;
        httplib::Error err = httplib::Error::Success;
        const bool answered = c->send(req, res, err);
        std::lock_guard<std::mutex> lock(x.mu);
        if (!answered && !x.decode_headers) x.decode = unreachable(d, httplib::to_string(err));
        // Cut off after the headers, not by us (a client that left cancels the call).
        else if (!answered && !x.client_gone) x.decode_broken = true;
        x.decode_done = true;
        x.cv.notify_all();
    }

    static void send(httplib::Response &res, const reply &r) {
        res.status = r.status;
        if (r.status == 429) res.set_header("Retry-After", "1");
        res.set_content(r.body, r.content_type.empty() ? "application/json" : r.content_type);
    }

    void health(httplib::Response &res) const {
        bool all = true;
        json out = json::object();
        for (const auto *group : {&prefills_, &decodes_}) {
            for (const auto &b : *group) {
                auto c = client(b->url, 2);
                httplib::Result r = c->Get("/health");
                json state = r ? json::parse(r->body, nullptr, false) : json();
                const bool up = r && r->status == 200;
                all = all && up;
                out[b->role].push_back({{"url", b->url},
                                        {"status", r ? r->status : 0},
                                        {"state", state.is_object() ? state.value("state", "unknown") : std::string("unreachable")}});
            }
        }
        res.status = all ? 200 : 503;
        res.set_content(out.dump(), "application/json");
    }

    std::string metrics() const {
        static const char *names[] = {"ok", "refused_by_prefill", "refused_by_decode", "bad_request"};
        std::ostringstream m;
        m << "# HELP dsv4_router_requests_total Requests routed, by outcome (refused: the server's error status "
             "reached the client).\n# TYPE dsv4_router_requests_total counter\n";
        for (int o = 0; o < n_outcomes; o++)
            m << "dsv4_router_requests_total{outcome=\"" << names[o] << "\"} " << outcomes_[o].load() << "\n";
        m << "# HELP dsv4_router_calls_in_flight Calls to servers not yet answered (two per request).\n"
             "# TYPE dsv4_router_calls_in_flight gauge\ndsv4_router_calls_in_flight "
          << in_flight_.load() << "\n";
        m << "# HELP dsv4_router_retries_total Requests tried again on another server after a 429, 503 or no answer.\n"
             "# TYPE dsv4_router_retries_total counter\ndsv4_router_retries_total "
          << retries_total_.load() << "\n";
        auto per_server = [&](const char *name, const char *type, const char *help, auto value) {
            m << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
            for (const auto *group : {&prefills_, &decodes_})
                for (const auto &b : *group)
                    m << name << "{role=\"" << b->role << "\",url=\"" << b->url << "\"} " << value(*b) << "\n";
        };
        per_server("dsv4_router_server_requests_total", "counter", "Requests sent to each server (tries included).",
                   [](const backend &b) { return static_cast<double>(b.requests.load()); });
        per_server("dsv4_router_server_up", "gauge", "1 while a server is in rotation (its /health answers 200).",
                   [](const backend &b) { return b.up.load() ? 1.0 : 0.0; });
        per_server("dsv4_router_server_load", "gauge",
                   "The load the router picks by: queued + running requests (+ rooms awaiting a claim on a prefill, + 2 x KV usage on a decode) at the last poll, plus its open calls.",
                   [](const backend &b) { return b.load(); });
        return m.str();
    }

    std::vector<std::unique_ptr<backend>> prefills_, decodes_;
    time_t timeout_s_;
    std::atomic<uint64_t> next_room_{0};
    std::atomic<int64_t> in_flight_{0};
    std::atomic<bool> stopping_{false};
    serve::streams streams_;
    std::atomic<uint64_t> outcomes_[n_outcomes] = {};
    int retries_;
    std::atomic<uint64_t> retries_total_{0}, next_prefill_{0}, next_decode_{0};
    std::mutex poll_mu_;
    std::condition_variable poll_cv_;
    bool polling_ = true;
    std::thread poller_;  // last: started once the rest is built
};

// Reads a server's /server_info until it answers (servers may still be loading), checks its
// role, and takes a prefill's PD endpoint.
std::unique_ptr<backend> discover(const std::string &url, const std::string &role, int wait_s) {
    auto b = std::make_unique<backend>();
    b->url = url;
    b->role = role;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
    std::string why;
    while (true) {
        auto c = client(url, 10);
        httplib::Result r = c->Get("/server_info");
        if (r && r->status == 200) {
            const json info = json::parse(r->body, nullptr, false);
            const std::string got = info.is_object() ? info.value("role", std::string("?")) : "?";
            if (got != role)
                throw std::runtime_error(url + " is a " + got + " server, but was given as --" + role +
                                         ": start it with \"role\": \"" + role + "\" in its params");
            if (role == "prefill") {
                b->bootstrap_host = info.value("bootstrap_host", std::string());
                b->bootstrap_port = info.value("bootstrap_port", 0);
            }
            return b;
        }
        why = r ? "status " + std::to_string(r->status) : httplib::to_string(r.error());
        if (std::chrono::steady_clock::now() > deadline)
            throw std::runtime_error(url + "/server_info did not answer within " + std::to_string(wait_s) +
                                     " s (" + why + "): is a dsv4-server running there? (--wait sets how long to wait)");
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
}

int usage(const char *why) {
    std::fprintf(stderr,
                 "dsv4-router: %s\nusage: dsv4-router --prefill URL [URL...] --decode URL [URL...] [--host H] "
                 "[--port P] [--timeout S] [--wait S] [--http-threads N] [--retries N] [--poll-ms MS]\n",
                 why);
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    std::vector<std::string> prefill_urls, decode_urls;
    std::string host = "127.0.0.1";
    int port = 30080, wait_s = 60, threads = 256, retries = 2, poll_ms = 500;
    long timeout_s = 3600;
    std::vector<std::string> *list = nullptr;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--prefill") { list = &prefill_urls; continue; }
        if (a == "--decode") { list = &decode_urls; continue; }
        if (a.rfind("--", 0) != 0) {
            if (!list) return usage(("unexpected argument " + a).c_str());
            list->push_back(a);
            continue;
        }
        list = nullptr;
        if (i + 1 >= argc) return usage(("missing the value of " + a).c_str());
        const char *v = argv[++i];
        if (a == "--host") host = v;
        else if (a == "--port") port = std::atoi(v);
        else if (a == "--timeout") timeout_s = std::atol(v);
        else if (a == "--wait") wait_s = std::atoi(v);
        else if (a == "--http-threads") threads = std::atoi(v);
        else if (a == "--retries") retries = std::atoi(v);
        else if (a == "--poll-ms") poll_ms = std::atoi(v);
        else return usage(("unknown option " + a).c_str());
    }
    if (prefill_urls.empty() || decode_urls.empty()) return usage("pass at least one --prefill and one --decode URL");
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");
    if (timeout_s <= 0 || wait_s < 0 || threads <= 0 || retries < 0 || poll_ms <= 0)
        return usage("--timeout, --http-threads and --poll-ms must be positive, --retries and --wait not negative");

    const sigset_t signals = serve::block_stop_signals();

    try {
        std::vector<std::unique_ptr<backend>> prefills, decodes;
        for (const std::string &u : prefill_urls) prefills.push_back(discover(u, "prefill", wait_s));
        for (const std::string &u : decode_urls) decodes.push_back(discover(u, "decode", wait_s));
        router r(std::move(prefills), std::move(decodes), static_cast<time_t>(timeout_s), retries,
                 std::chrono::milliseconds(poll_ms));
        httplib::Server http;
        // A thread per open request (a stream holds one for its length): more than a server's
        // running + queued requests, so a burst reaches the servers' admission control (and
        // its 429s) instead of waiting unseen in the router.
        http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
        r.routes(http);
        const int bound = serve::bind(http, "dsv4-router", host, port);
        if (bound < 0) return 1;
        std::printf("dsv4-router: %zu prefill, %zu decode; listening on http://%s:%d\n", prefill_urls.size(),
                    decode_urls.size(), host.c_str(), bound);
        std::fflush(stdout);
        // On a signal: refuse new requests and let the streams finish before the listener stops
        // (it waits for the other requests in flight); then the calls they left (aborts).
        const bool ok = serve::until_signal(http, signals, "dsv4-router",
                                            [&] { r.stop_accepting(std::chrono::seconds(timeout_s)); });
        if (!r.drain(std::chrono::seconds(timeout_s))) {
            // Their threads use the router: leave without destroying it.
            std::fprintf(stderr, "dsv4-router: calls to servers still open after --timeout %ld s; exiting\n", timeout_s);
            std::fflush(stderr);
            std::_Exit(1);
        }
        if (!ok) return 1;
        std::printf("dsv4-router: stopped\n");
        return 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "dsv4-router: %s\n", e.what());
        return 1;
    }
}
