// dsv4-router: one HTTP front end over dsv4-server instances in the prefill and decode roles.
//
//   dsv4-router --prefill URL [URL...] --decode URL [URL...] [--router-token-file FILE]
//               [--host 127.0.0.1] [--port 30080] [--timeout SECONDS] [--wait SECONDS]
//               [--http-threads N] [--retries 2] [--poll-ms 500] [--health-misses 3]
//
// For each request (POST /generate, /v1/completions, /v1/chat/completions, the bodies
// dsv4-server takes) it picks the least loaded prefill and decode server in rotation (each
// server's /metrics, polled every --poll-ms: requests queued and running, PD rooms in flight, KV
// usage; plus the calls the router has open to it), assigns a room from the kernel's CSPRNG, and
// sends the same body to both at once over kept-alive connections: to the prefill with the room,
// to the decode with the room and the prefill's endpoint (bootstrap_host/bootstrap_port, read
// from the prefill's /server_info at start), both with the X-DSV4-Router-Token the servers check
// before they honour those fields. A client's own PD fields are refused (400): only the router
// steers PD traffic. The client gets the decode's answer, streamed as it comes when it asked for
// a stream. When one side refuses or fails, the router aborts the other side's half (POST
// /abort_request) and answers with the failing side's status and body: a 429 from a prefill
// reaches the client as that 429 with Retry-After. A refusal with 429 or 503, or a server that
// does not answer, is first tried again (up to --retries times) on other servers, as long as
// nothing has reached the client. A stream whose decode breaks off ends with an error event in
// the endpoint's shape, then [DONE]. A server leaves the rotation after --health-misses failed
// /health polls in a row and comes back at its next answer.
//
// GET  /health         200 when every server answers its /health with 200, else 503; per server
// GET  /metrics        the router's counters, build info and resident memory
// GET  /server_info    the router's version and its servers, each with its /server_info model
// GET  /v1/models      OpenAI's model list (the decode servers' --served-model-name)
// GET  /model_info, /get_model_info, /get_server_info   SGLang's names (a decode server's model facts)
// POST /abort_request  {"rid"}: aborts the request the client sent with that rid, on both halves
// SIGTERM or SIGINT: stop accepting, let the requests in flight end, exit 0.
// docs/serving.md has the details.
#include <malloc.h>
#include <nlohmann/json.hpp>

#include "../http/http_client.hpp"
#include "../http/http_server.hpp"
#include "../http/rids.hpp"
#include "../http/serve.hpp"
#include "../http/trust.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using json = nlohmann::json;

namespace {

#ifndef DSV4_ROUTER_VERSION
#define DSV4_ROUTER_VERSION "unknown"
#endif

json error_json(int code, const std::string &status, const std::string &message) {
    return {{"error", {{"message", message}, {"status", status}, {"code", code}}}};
}

// One dsv4-server the router sends requests to.
struct backend {
    backend(const web::endpoint &where, std::string role)
        : url(where.url), role(std::move(role)), pool(where, std::chrono::seconds(10)) {}

    const std::string url;   // http://host:port
    const std::string role;  // "prefill" or "decode"
    // A prefill's PD endpoint, which the decode's half of a request names.
    std::string bootstrap_host;
    int bootstrap_port = 0;
    json model;  // its /server_info "model"
    std::string served_model_name;  // its /server_info "served_model_name" (its --served-model-name)
    // Kept-alive connections: reused for 10 s idle, under the servers' 15 s.
    web::connection_pool pool;
    std::atomic<uint64_t> requests{0};
    // In rotation: it answered /health with 200 at one of its last --health-misses polls.
    std::atomic<bool> up{true};
    int misses = 0;  // failed polls in a row (the poller's thread alone)
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

// A refusal worth trying on another server: queue full (429), unavailable (503: draining, or a
// PD room whose peer died), no answer (502).
bool retryable(int status) { return status == 429 || status == 502 || status == 503; }

// Client-facing text never names a room or an internal endpoint (the router's log does): room
// ids would let a client aim at another user's room, endpoints map the internal network.
std::string redact(const std::string &text) {
    static const std::regex endpoint(R"(([a-zA-Z][a-zA-Z0-9+.-]*://[^\s"',;()<>]*[^\s"',;()<>:.])|(\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b)|(\[[0-9a-fA-F:.]+\](:\d+)?))");
    static const std::regex room(R"(\b(room|rooms|bootstrap_room|pd_room)( |=|: ?)\d+)");
    std::string out = std::regex_replace(text, endpoint, "<internal endpoint>");
    return std::regex_replace(out, room, "$1$2<room>");
}

// A JSON error body with its message redacted; other bodies as they are.
std::string redact_body(const std::string &body) {
    json j = json::parse(body, nullptr, false);
    if (!j.is_object()) return body;
    bool changed = false;
    auto fix = [&](json &holder, const char *key) {
        if (holder.is_object() && holder.contains(key) && holder[key].is_string()) {
            std::string m = holder[key].get<std::string>(), r = redact(m);
            if (r != m) {
                holder[key] = r;
                changed = true;
            }
        }
    };
    if (j.contains("error")) fix(j["error"], "message");
    if (j.contains("meta_info") && j["meta_info"].is_object() && j["meta_info"].contains("finish_reason"))
        fix(j["meta_info"]["finish_reason"], "message");
    return changed ? j.dump() : body;
}

// The answer of one call to a server: its status (0: no answer), content type and body.
struct reply {
    int status = 0;
    std::string content_type = "application/json";
    std::string body;
};

void log_line(const std::string &line) {
    std::printf("dsv4-router: %s\n", line.c_str());
    std::fflush(stdout);
}

// "The server did not answer": 502 for the client (naming the role only), the server in the log.
reply unreachable(const backend &b, const std::string &why, const std::string &rid) {
    log_line(b.role + " server " + b.url + " did not answer (" + why + ") for rid " + rid);
    reply r;
    r.status = 502;
    r.body = error_json(502, "BAD_GATEWAY", "the " + b.role + " server did not answer (" + why +
                                                "); the router's log names it")
                 .dump();
    return r;
}

// One routed request's halves: what the prefill and the decode answered, the decode's body as
// it arrives (whole server-sent events when streamed), shared by the two calls' threads and the
// client's handler.
struct exchange {
    std::mutex mu;
    std::condition_variable cv;
    bool prefill_done = false;
    reply prefill;
    bool decode_headers = false, decode_done = false;
    // The decode's answer broke off after its headers (the server died mid-answer).
    bool decode_broken = false;
    reply decode;                     // status and content type; body only when not streamed
    std::deque<std::string> events;   // the decode's body, streamed: whole events
    std::string partial;              // the bytes of an event not yet whole
    std::string last_event;           // the last whole event (for an error event's shape)
    bool client_gone = false;

    bool prefill_failed() const { return prefill_done && prefill.status != 200; }
    bool decode_failed() const { return decode_done && decode.status != 200; }

    // The client left: both calls drop their connections (their servers abort the halves).
    void drop() {
        std::lock_guard<std::mutex> lock(mu);
        client_gone = true;
    }
    bool dropped() {
        std::lock_guard<std::mutex> lock(mu);
        return client_gone;
    }

    // Streamed bytes from the decode: whole events ("...\n\n") go out, the rest waits.
    void add_stream_bytes(const char *data, size_t n) {
        partial.append(data, n);
        size_t start = 0, end;
        while ((end = partial.find("\n\n", start)) != std::string::npos) {
            std::string event = partial.substr(start, end + 2 - start);
            if (event.find("\"error\"") != std::string::npos || event.find("\"abort\"") != std::string::npos)
                event = redact_event(event);
            if (event.rfind("data: [DONE]", 0) != 0) last_event = event;
            events.push_back(std::move(event));
            start = end + 2;
        }
        partial.erase(0, start);
    }

    static std::string redact_event(const std::string &event) {
        const std::string prefix = "data: ";
        if (event.rfind(prefix, 0) != 0) return event;
        return prefix + redact_body(event.substr(prefix.size(), event.size() - prefix.size() - 2)) + "\n\n";
    }
};

// Where a client's request went, for POST /abort_request: the servers of its current try and
// the rid it carries there.
struct route {
    backend *prefill = nullptr, *decode = nullptr;
    std::string rid;
};

class router {
public:
    router(std::vector<std::unique_ptr<backend>> prefills, std::vector<std::unique_ptr<backend>> decodes,
           std::string token, time_t timeout_s, int retries, std::chrono::milliseconds poll, int health_misses)
        : prefills_(std::move(prefills)), decodes_(std::move(decodes)), token_(std::move(token)), timeout_s_(timeout_s),
          retries_(retries), health_misses_(health_misses) {
        // Health and loads known before the first request; then each server on its own thread
        // (a server slow to answer delays no other's poll).
        for (auto *group : {&prefills_, &decodes_})
            for (auto &b : *group) poll_once(*b);
        for (auto *group : {&prefills_, &decodes_})
            for (auto &b : *group) pollers_.emplace_back([this, b = b.get(), poll] { poll_loop(*b, poll); });
        pollers_.emplace_back([this, poll] { trim_loop(poll); });
    }

    ~router() {
        {
            std::lock_guard<std::mutex> lock(poll_mu_);
            polling_ = false;
        }
        poll_cv_.notify_all();
        for (auto &t : pollers_) t.join();
    }

    void routes(web::server &http) {
        for (const char *path : {"/generate", "/v1/completions", "/v1/chat/completions"}) {
            std::string p = path;
            http.post(path, [this, p](const web::request &req, web::reply &res) {
                handling_.fetch_add(1);
                forward(p, req, res);
                handling_.fetch_sub(1);
            });
        }
        http.get("/health", [this](const web::request &, web::reply &res) { health(res); });
        http.get("/metrics", [this](const web::request &, web::reply &res) {
            res.send(200, "text/plain; version=0.0.4", metrics());
        });
        http.get("/server_info", [this](const web::request &, web::reply &res) { server_info(res); });
        // SGLang's name for it, and its model facts, which the decode servers hold: SGLang's
        // router and tools ask there.
        http.get("/get_server_info", [this](const web::request &, web::reply &res) { server_info(res); });
        for (const char *path : {"/model_info", "/get_model_info"})
            http.get(path, [this, path](const web::request &, web::reply &res) { model_info(res, path); });
        http.get("/v1/models", [this](const web::request &, web::reply &res) { models(res); });
        http.post("/abort_request", [this](const web::request &req, web::reply &res) { abort(req, res); });
    }

    // SIGTERM: new requests get 503 from now on.
    void refuse_new() { stopping_ = true; }

    // Waits (at most `limit`) for the requests still open, their streams included.
    void wait_requests(std::chrono::seconds limit) { (void)serve::wait_for_zero(handling_, limit); }

    // Waits until the calls to servers have ended (the last aborts), at most `limit`; false if
    // some have not (their threads use this router: the caller must not destroy it then).
    bool drain(std::chrono::seconds limit) { return serve::wait_for_zero(in_flight_, limit); }

private:
    enum outcome { ok, refused_prefill, refused_decode, bad_request, client_gone, n_outcomes };

    void count(outcome o) { outcomes_[o].fetch_add(1); }

    static void send_error(web::reply &res, int code, const std::string &status, const std::string &message) {
        if (code == 429 || code == 503) res.header("Retry-After", "1");
        res.send(code, "application/json", error_json(code, status, message).dump());
    }

    static void send(web::reply &res, const reply &r) {
        if (r.status == 429 || r.status == 503) res.header("Retry-After", "1");
        res.send(r.status, r.content_type.empty() ? "application/json" : r.content_type,
                 r.status == 200 ? r.body : redact_body(r.body));
    }

    // The headers of every call: the JSON body's type and the router's token.
    std::vector<std::pair<std::string, std::string>> call_headers() const {
        std::vector<std::pair<std::string, std::string>> h{{"Content-Type", "application/json"}};
        if (!token_.empty()) h.emplace_back(serve::kRouterTokenHeader, token_);
        return h;
    }

    // One call to a server over a kept-alive connection: the whole reply (a 502 body when it
    // did not answer), dropped once `cancelled` says so.
    reply post(backend &b, const std::string &path, const std::string &body, time_t timeout_s, const std::string &rid,
               std::function<bool()> cancelled = nullptr) {
        web::call_options o;
        o.timeout = std::chrono::seconds(timeout_s);
        o.cancelled = std::move(cancelled);
        web::call_result res = web::call(b.pool, "POST", path, call_headers(), body, o);
        if (res.status == 0 || res.broken) return unreachable(b, res.cancelled ? "cancelled" : res.error, rid);
        reply r;
        r.status = res.status;
        r.content_type = res.content_type;
        r.body = std::move(res.body);
        return r;
    }

    web::call_result get(backend &b, const char *path, time_t timeout_s) {
        web::call_options o;
        o.timeout = std::chrono::seconds(timeout_s);
        o.connect_timeout = std::chrono::seconds(timeout_s);
        return web::call(b.pool, "GET", path, call_headers(), "", o);
    }

    // Aborts a request's half on a server by its rid; true when the server had it in flight
    // (best effort: the server remembers an abort that arrives before its request).
    bool abort_on(backend &b, const std::string &rid) {
        const reply r = post(b, "/abort_request", json{{"rid", rid}}.dump(), 5, rid);
        const json j = json::parse(r.body, nullptr, false);
        return r.status == 200 && j.is_object() && j.value("aborted", false);
    }

    // Starts `f` on a detached thread; if the thread cannot start, takes back its counts and
    // rethrows (the HTTP layer answers 500).
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

    // The reason a client body is refused before any server sees it, or empty.
    static std::string refusal(const json &j) {
        if (!j.is_object() || (j.contains("stream") && !j["stream"].is_boolean()))
            return "the body must be a JSON object whose stream is a boolean";
        for (const char *name : serve::kPdFields)
            if (j.contains(name) && !j[name].is_null())
                return std::string(name) + " is a PD routing field: dsv4-router assigns rooms and prefill endpoints " +
                       "itself; drop it from the request";
        if (j.contains("rid") && !j["rid"].is_null()) {
            if (!j["rid"].is_string()) return "rid must be a string";
            if (j["rid"].get<std::string>().size() > kMaxClientRid)
                return "rid is longer than " + std::to_string(kMaxClientRid) +
                       " bytes (the router appends a retry's mark to it): use a shorter id";
        }
        return "";
    }

    void forward(const std::string &path, const web::request &req, web::reply &res) {
        if (stopping_.load()) {
            send_error(res, 503, "DSV4_ERR_SHUTDOWN", "the router is shutting down (SIGTERM)");
            return;
        }
        if (const size_t bad = web::utf8_error_offset(req.body); bad != std::string::npos) {
            count(bad_request);
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT",
                       "the body is not valid UTF-8: byte " + std::to_string(bad) + " starts no valid sequence");
            return;
        }
        json j = json::parse(req.body, nullptr, false);
        if (j.is_discarded()) {
            count(bad_request);
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", "the body is not valid JSON");
            return;
        }
        if (const std::string why = refusal(j); !why.empty()) {
            count(bad_request);
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", why);
            return;
        }
        const bool stream = j.value("stream", false);
        // The client's rid names the request on both halves (a generated one when it gave none),
        // so POST /abort_request here reaches them.
        const bool client_rid = j.contains("rid") && j["rid"].is_string() && !j["rid"].get<std::string>().empty();
        const std::string rid = client_rid ? j["rid"].get<std::string>() : "dsv4-router-" + hex(serve::random_u64());
        std::shared_ptr<serve::rid_entry<route>> entry;
        switch (rids_.add(rid, route{})) {
        case serve::rid_registry<route>::added::ok: entry = std::make_shared<serve::rid_entry<route>>(rids_, rid); break;
        case serve::rid_registry<route>::added::in_flight:
            count(bad_request);
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", "rid " + rid + " is already in flight: pick another");
            return;
        case serve::rid_registry<route>::added::aborted_early: break;  // not remembered here
        }
        // Tries on other servers while a server refuses with 429 / 503 or does not answer and
        // nothing has reached the client yet.
        std::vector<const backend *> refused;
        reply last;
        outcome last_outcome = refused_decode;
        for (int attempt = 0;; attempt++) {
            backend *p = pick(prefills_, next_prefill_, refused, attempt == 0);
            backend *d = pick(decodes_, next_decode_, refused, attempt == 0);
            if (!p || !d) {
                // Every server of a role refused this request (or is out of rotation).
                count(last_outcome);
                if (last.status) send(res, last);
                else send_error(res, 503, "DSV4_ERR_SHUTDOWN",
                                std::string("no ") + (!p ? "prefill" : "decode") +
                                    " server is in rotation (their /health polls failed): see the router's /health");
                return;
            }
            if (attempt > 0) retries_total_.fetch_add(1);  // a retry only once it goes out
            // A retry's halves carry a rid of their own: an abort of the failed try's halves may
            // reach a server after the retry's request and must not abort that.
            const std::string try_rid = attempt == 0 ? rid : rid + "~retry" + std::to_string(attempt);
            rids_.update(rid, route{p, d, try_rid});
            outcome_of_try t = try_once(path, j, stream, *p, *d, try_rid, res);
            if (t.client_gone) {  // both halves are being dropped and aborted
                count(client_gone);
                return;
            }
            if (t.x) {  // a stream whose headers came: it is the client's now
                count(ok);
                stream_to(res, *t.x, path == "/generate");
                return;
            }
            if (t.refused_by && retryable(t.r.status) && attempt < retries_) {
                refused.push_back(t.refused_by);
                last = std::move(t.r);
                last_outcome = t.refused_by->role == "prefill" ? refused_prefill : refused_decode;
                continue;
            }
            count(t.r.status == 200 ? ok : (t.refused_by && t.refused_by->role == "prefill" ? refused_prefill : refused_decode));
            send(res, t.r);
            return;
        }
    }

    static std::string hex(uint64_t v) {
        char buf[17];
        std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
        return buf;
    }

    // What one try of a request came to: a stream for the client (`x`), or an answer `r`, with
    // the server that refused or failed it (`refused_by`).
    struct outcome_of_try {
        std::shared_ptr<exchange> x;
        reply r;
        const backend *refused_by = nullptr;
        bool client_gone = false;
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

    outcome_of_try try_once(const std::string &path, const json &j, bool stream, backend &p, backend &d,
                            const std::string &rid, web::reply &client) {
        p.requests.fetch_add(1);
        d.requests.fetch_add(1);
        tries_total_.fetch_add(1);
        // Unpredictable rooms: a room id is what a PD peer claims, so a guessable one would let
        // whoever reaches a prefill's PD port aim at another user's room.
        uint64_t room = 0;
        while (room == 0) room = serve::random_u64() >> 1;
        json pj = j, dj = j;
        pj["bootstrap_room"] = dj["bootstrap_room"] = room;
        pj["rid"] = dj["rid"] = rid;
        pj["stream"] = false;  // its answer is only "transferred"
        dj["bootstrap_host"] = p.bootstrap_host;
        dj["bootstrap_port"] = p.bootstrap_port;

        auto x = std::make_shared<exchange>();
        const time_t timeout = timeout_s_;
        // Counted as each starts: a thread that fails to start (the HTTP layer answers 500)
        // leaves no count behind.
        in_flight_.fetch_add(1);
        p.open_calls.fetch_add(1);
        start_or_uncount(p, [this, x, &p, &d, path, rid, room, body = pj.dump(), timeout] {
            reply r = post(p, path, body, timeout, rid, [x] { return x->dropped(); });
            const bool failed = r.status != 200;
            if (failed && r.status != 429 && r.status != 0)
                log_line("prefill " + p.url + " answered " + std::to_string(r.status) + " for rid " + rid + " (room " +
                         std::to_string(room) + "): " + r.body);
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
        start_or_uncount(d, [this, x, &p, &d, path, rid, room, body = dj.dump(), timeout, stream] {
            call_decode(*x, d, path, body, timeout, stream, rid);
            bool failed;
            {
                std::lock_guard<std::mutex> lock(x->mu);
                failed = x->decode.status != 200 || x->decode_broken;
                if (failed && x->decode.status != 429 && x->decode.status != 502)
                    log_line("decode " + d.url + " answered " + std::to_string(x->decode.status) +
                             (x->decode_broken ? " and broke off" : "") + " for rid " + rid + " (room " +
                             std::to_string(room) + ")" + (x->decode.body.empty() ? "" : ": " + x->decode.body));
            }
            if (failed) abort_on(p, rid);  // else the prefill holds the room's pages until the timeout
            d.open_calls.fetch_sub(1);
            in_flight_.fetch_sub(1);
        });

        outcome_of_try t;
        std::unique_lock<std::mutex> lock(x->mu);
        // Waits for `ready`, looking at the client every 100 ms: one that left drops both calls
        // (their servers see their client gone and abort the halves).
        auto wait = [&](auto ready) {
            while (!x->cv.wait_for(lock, std::chrono::milliseconds(100), ready)) {
                lock.unlock();
                const bool gone = client.client_gone();
                lock.lock();
                if (gone) {
                    x->client_gone = true;
                    return false;
                }
            }
            return true;
        };
        // The prefill's answer comes when its room has been handed over, about when the decode's
        // first token does; waiting for it lets a refusal on either side reach the client as
        // its status (or be tried elsewhere), not as a broken stream.
        if (!wait([&] { return x->prefill_done || x->decode_failed(); })) {
            t.client_gone = true;
            return t;
        }
        if (x->prefill_failed()) {
            // At once: the decode's half is being aborted by the prefill's thread (which, with
            // the decode's, holds `x` until it ends).
            t.r = x->prefill;
            t.refused_by = &p;
            return t;
        }
        if (x->decode_failed() || !stream) {
            if (!wait([&] { return x->decode_done; })) {
                t.client_gone = true;
                return t;
            }
            if (x->decode_broken) {
                lock.unlock();
                t.r = unreachable(d, "the answer broke off", rid);
                t.refused_by = &d;
            } else {
                t.r = x->decode;
                if (t.r.status != 200) t.refused_by = &d;
            }
            return t;
        }
        if (!wait([&] { return x->decode_headers || x->decode_done; })) {
            t.client_gone = true;
            return t;
        }
        if (x->decode.status != 200) {
            if (!wait([&] { return x->decode_done; })) {
                t.client_gone = true;
                return t;
            }
            t.r = x->decode;
            t.refused_by = &d;
            return t;
        }
        t.x = x;
        return t;
    }

    // The event that ends a stream whose decode broke off, in the endpoint's shape: SGLang's
    // native API ends with finish_reason {"type": "abort", "message"} on the output so far (its
    // events are cumulative), OpenAI's with an error object.
    static std::string broken_stream_event(const exchange &x, bool sglang) {
        const std::string message =
            "the decode server stopped answering mid-stream; the output is incomplete (the router's log names the server)";
        if (!sglang) return "data: " + error_json(502, "BAD_GATEWAY", message).dump() + "\n\n";
        json last = json::object();
        if (x.last_event.rfind("data: ", 0) == 0) {
            last = json::parse(x.last_event.substr(6), nullptr, false);
            if (!last.is_object()) last = json::object();
        }
        if (!last.contains("output_ids")) last["output_ids"] = json::array();
        if (!last.contains("meta_info") || !last["meta_info"].is_object()) last["meta_info"] = json::object();
        last["meta_info"]["finish_reason"] = {{"type", "abort"}, {"message", message}, {"status_code", 502}};
        return "data: " + last.dump() + "\n\n";
    }

    // The decode's events to the client as they come, whole; a decode that breaks off ends the
    // stream with an error event and [DONE]; a client that leaves drops the decode's call.
    void stream_to(web::reply &res, exchange &x, bool sglang) {
        res.header("Cache-Control", "no-cache");
        if (!res.begin(200, x.decode.content_type.empty() ? "text/event-stream" : x.decode.content_type)) {
            x.drop();
            return;
        }
        while (true) {
            std::unique_lock<std::mutex> lock(x.mu);
            if (!x.cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return !x.events.empty() || x.decode_done; })) {
                lock.unlock();
                if (res.client_gone()) {
                    x.drop();
                    return;
                }
                continue;
            }
            std::string chunk;
            bool ended = false;
            if (!x.events.empty()) {
                chunk = std::move(x.events.front());
                x.events.pop_front();
            } else if (x.decode_broken) {
                // The server died mid-answer: the client gets an ending, not a cut.
                broken_streams_.fetch_add(1);
                chunk = broken_stream_event(x, sglang) + "data: [DONE]\n\n";
                ended = true;
            } else {
                chunk = std::move(x.partial);  // a body that was not events
                x.partial.clear();
                ended = true;
            }
            lock.unlock();
            if (!res.write(chunk)) {
                x.drop();
                return;
            }
            if (ended) {
                res.end();
                return;
            }
        }
    }

    // Polls one server's /health (and /metrics for its load) every `every`, until the router
    // goes: out of rotation after --health-misses failed polls in a row, back at the next answer.
    void poll_loop(backend &b, std::chrono::milliseconds every) {
        std::unique_lock<std::mutex> lock(poll_mu_);
        while (true) {
            poll_cv_.wait_for(lock, every, [this] { return !polling_; });
            if (!polling_) break;
            lock.unlock();
            poll_once(b);
            lock.lock();
        }
    }

    // Every `every`: once a burst is over (no call open, some since the last look), malloc's
    // free pages go back to the kernel. A burst's request bodies, parsed and copied for both
    // halves, come from a dozen per-thread heaps that keep their freed memory otherwise, and the
    // router's resident memory would step up with each burst of a new size.
    void trim_loop(std::chrono::milliseconds every) {
        uint64_t seen = 0;
        std::unique_lock<std::mutex> lock(poll_mu_);
        while (true) {
            poll_cv_.wait_for(lock, every, [this] { return !polling_; });
            if (!polling_) break;
            const uint64_t tries = tries_total_.load();
            if (tries != seen && in_flight_.load() == 0) {
                seen = tries;
                malloc_trim(0);
            }
        }
    }

    void poll_once(backend &b) {
        const web::call_result h = get(b, "/health", kPollTimeoutS);
        if (h.status != 200) {
            b.misses++;
            if (b.misses >= health_misses_ && b.up.exchange(false))
                log_line(b.role + " server " + b.url + " out of rotation: " + std::to_string(b.misses) +
                         " /health polls failed in a row, the last " +
                         (h.status ? "answered " + std::to_string(h.status) : h.error));
            return;
        }
        b.misses = 0;
        if (const web::call_result m = get(b, "/metrics", kPollTimeoutS); m.status == 200)
            b.polled_load = load_of(m.body, b.role == "decode");
        if (!b.up.exchange(true)) log_line(b.role + " server " + b.url + " back in rotation");
    }

    // The decode's half: its status as soon as the headers come, then its body, streamed into
    // the exchange's events when the client streams (else whole into decode.body); dropped when
    // the client leaves.
    void call_decode(exchange &x, backend &d, const std::string &path, const std::string &body, time_t timeout,
                     bool stream, const std::string &rid) {
        web::call_options o;
        o.timeout = std::chrono::seconds(timeout);
        o.cancelled = [&x] { return x.dropped(); };
        o.on_head = [&](int status, const web::bhttp::fields &headers) {
            {
                std::lock_guard<std::mutex> lock(x.mu);
                x.decode.status = status;
                auto ct = headers.find(web::bhttp::field::content_type);
                x.decode.content_type = ct == headers.end() ? "" : std::string(ct->value());
                x.decode_headers = true;
            }
            x.cv.notify_all();
        };
        o.on_body = [&](const char *data, size_t n) {
            {
                std::lock_guard<std::mutex> lock(x.mu);
                if (x.client_gone) return false;
                if (stream && x.decode.status == 200) x.add_stream_bytes(data, n);
                else x.decode.body.append(data, n);
            }
            x.cv.notify_all();
            return true;
        };
        const web::call_result r = web::call(d.pool, "POST", path, call_headers(), body, o);
        const bool headers = r.status != 0;
        reply failed;
        if (!headers) failed = unreachable(d, r.cancelled ? "cancelled" : r.error, rid);
        std::lock_guard<std::mutex> lock(x.mu);
        if (!headers) x.decode = failed;
        // Cut off after the headers, not by us (a client that left drops the call).
        else if (r.broken && !x.client_gone) x.decode_broken = true;
        else if (!r.error.empty() && !r.cancelled) x.decode_broken = true;
        x.decode_done = true;
        x.cv.notify_all();
    }

    // POST /abort_request {"rid"}: the request the client sent with that rid, aborted on the two
    // servers its current try went to. {"aborted": false} when no such request is in flight.
    void abort(const web::request &req, web::reply &res) {
        const json j = json::parse(req.body, nullptr, false);
        if (!j.is_object() || !j.contains("rid") || !j["rid"].is_string() || j["rid"].get<std::string>().empty()) {
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", "pass {\"rid\": ...}, the rid of the request to abort");
            return;
        }
        const std::string rid = j["rid"].get<std::string>();
        if (rid.size() > kMaxClientRid) {
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", "rid is longer than 240 bytes: no request has it");
            return;
        }
        std::optional<route> r = rids_.take_for_abort(rid, false);
        bool aborted = false;
        if (r && r->prefill && r->decode) {
            // Both halves: the decode's ends the client's answer, the prefill's frees its room.
            const bool d = abort_on(*r->decode, r->rid), p = abort_on(*r->prefill, r->rid);
            aborted = d || p;
        }
        res.send(200, "application/json", json{{"aborted", aborted}}.dump());
    }

    void health(web::reply &res) {
        bool all = true;
        json out = json::object();
        for (auto *group : {&prefills_, &decodes_}) {
            for (auto &b : *group) {
                const web::call_result r = get(*b, "/health", kPollTimeoutS);
                json state = r.status ? json::parse(r.body, nullptr, false) : json();
                const bool up = r.status == 200;
                all = all && up;
                out[b->role].push_back({{"url", b->url},
                                        {"status", r.status},
                                        {"in_rotation", b->up.load()},
                                        {"state", state.is_object() ? state.value("state", "unknown") : std::string("unreachable")}});
            }
        }
        res.send(all ? 200 : 503, "application/json", out.dump());
    }

    void server_info(web::reply &res) const {
        json out = {{"version", DSV4_ROUTER_VERSION}, {"role", "router"}, {"model", first_model()}};
        for (const auto *group : {&prefills_, &decodes_})
            for (const auto &b : *group)
                out[b->role + "_servers"].push_back({{"url", b->url}, {"in_rotation", b->up.load()}});
        res.send(200, "application/json", out.dump());
    }

    json first_model() const { return decodes_.front()->model; }

    // A decode server's answer to `path` (the model facts), from the first that gives one.
    void model_info(web::reply &res, const char *path) {
        for (auto &b : decodes_) {
            const web::call_result r = get(*b, path, kPollTimeoutS);
            if (r.status == 200) {
                res.send(200, "application/json", r.body);
                return;
            }
        }
        send_error(res, 503, "DSV4_ERR_UNAVAILABLE", std::string("no decode server answered ") + path);
    }

    void models(web::reply &res) const {
        const json model = {{"id", decodes_.front()->served_model_name},
                            {"object", "model"},
                            {"created", static_cast<int64_t>(started_)},
                            {"owned_by", "dsv4"}};
        res.send(200, "application/json", json{{"object", "list"}, {"data", json::array({model})}}.dump());
    }

    std::string metrics() const {
        static const char *names[] = {"ok", "refused_by_prefill", "refused_by_decode", "bad_request", "client_gone"};
        std::ostringstream m;
        m << "# HELP dsv4_build_info The router's version (role \"router\"; servers export their own).\n"
             "# TYPE dsv4_build_info gauge\ndsv4_build_info{version=\""
          << DSV4_ROUTER_VERSION << "\",backend=\"none\",role=\"router\"} 1\n";
        m << "# HELP dsv4_process_resident_memory_bytes The router process's resident set.\n"
             "# TYPE dsv4_process_resident_memory_bytes gauge\ndsv4_process_resident_memory_bytes "
          << serve::resident_bytes() << "\n";
        m << "# HELP dsv4_router_requests_total Requests routed, by outcome (refused: the server's error status "
             "reached the client; client_gone: it left before its answer, both halves dropped).\n"
             "# TYPE dsv4_router_requests_total counter\n";
        for (int o = 0; o < n_outcomes; o++)
            m << "dsv4_router_requests_total{outcome=\"" << names[o] << "\"} " << outcomes_[o].load() << "\n";
        m << "# HELP dsv4_router_calls_in_flight Calls to servers not yet answered (two per request).\n"
             "# TYPE dsv4_router_calls_in_flight gauge\ndsv4_router_calls_in_flight "
          << in_flight_.load() << "\n";
        m << "# HELP dsv4_router_retries_total Requests sent again to other servers after a 429, 503 or no answer.\n"
             "# TYPE dsv4_router_retries_total counter\ndsv4_router_retries_total "
          << retries_total_.load() << "\n";
        m << "# HELP dsv4_router_broken_streams_total Streams whose decode broke off mid-answer, ended with an "
             "error event.\n# TYPE dsv4_router_broken_streams_total counter\ndsv4_router_broken_streams_total "
          << broken_streams_.load() << "\n";
        auto per_server = [&](const char *name, const char *type, const char *help, auto value) {
            m << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
            for (const auto *group : {&prefills_, &decodes_})
                for (const auto &b : *group)
                    m << name << "{role=\"" << b->role << "\",url=\"" << b->url << "\"} " << value(*b) << "\n";
        };
        per_server("dsv4_router_server_requests_total", "counter", "Requests sent to each server (tries included).",
                   [](const backend &b) { return static_cast<double>(b.requests.load()); });
        per_server("dsv4_router_server_up", "gauge",
                   "1 while a server is in rotation (it answered /health at one of its last --health-misses polls).",
                   [](const backend &b) { return b.up.load() ? 1.0 : 0.0; });
        per_server("dsv4_router_server_load", "gauge",
                   "The load the router picks by: queued + running requests (+ rooms awaiting a claim on a prefill, + 2 x KV usage on a decode) at the last poll, plus its open calls.",
                   [](const backend &b) { return b.load(); });
        return m.str();
    }

    static constexpr size_t kMaxClientRid = serve::kMaxRidBytes - 16;
    static constexpr time_t kPollTimeoutS = 2;

    std::vector<std::unique_ptr<backend>> prefills_, decodes_;
    const std::string token_;
    const time_t timeout_s_;
    const int retries_, health_misses_;
    const std::time_t started_ = std::time(nullptr);
    std::atomic<int64_t> in_flight_{0};
    std::atomic<bool> stopping_{false};
    std::atomic<int64_t> handling_{0};  // client requests being answered, streams included
    serve::rid_registry<route> rids_;
    std::atomic<uint64_t> outcomes_[n_outcomes] = {};
    std::atomic<uint64_t> retries_total_{0}, broken_streams_{0}, tries_total_{0}, next_prefill_{0}, next_decode_{0};
    std::mutex poll_mu_;
    std::condition_variable poll_cv_;
    bool polling_ = true;
    std::vector<std::thread> pollers_;  // last: started once the rest is built
};

// Reads a server's /server_info until it answers (servers may still be loading), checks its
// role and that it takes this router's PD fields, and takes a prefill's PD endpoint.
std::unique_ptr<backend> discover(const std::string &url, const std::string &role, int wait_s, const std::string &token,
                                  const std::string &token_file) {
    const std::optional<web::endpoint> where = web::endpoint::parse(url);
    if (!where) throw std::runtime_error(url + " is not a server URL: give http://host:port");
    auto b = std::make_unique<backend>(*where, role);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
    std::vector<std::pair<std::string, std::string>> headers;
    if (!token.empty()) headers.emplace_back(serve::kRouterTokenHeader, token);
    web::call_options o;
    o.connect_timeout = std::chrono::seconds(2);
    o.timeout = std::chrono::seconds(10);
    while (true) {
        const web::call_result r = web::call(b->pool, "GET", "/server_info", headers, "", o);
        if (r.status == 200) {
            const json info = json::parse(r.body, nullptr, false);
            const std::string got = info.is_object() ? info.value("role", std::string("?")) : "?";
            if (got != role)
                throw std::runtime_error(url + " is a " + got + " server, but was given as --" + role +
                                         ": start it with \"role\": \"" + role + "\" in its params");
            const std::string fields = info.value("pd_fields", std::string("trusted"));
            if (fields == "refused")
                throw std::runtime_error(url + " takes no PD fields from requests: start it with --router-token-file FILE "
                                               "and give this router the same file (or --trust-pd-fields there)");
            if (fields == "router_token" && token.empty())
                throw std::runtime_error(url + " takes PD fields only with its router token: pass --router-token-file "
                                               "with the file that server was given");
            if (fields == "router_token" && info.value("router_token", std::string()) != "accepted")
                throw std::runtime_error(url + " rejects the token in --router-token-file " + token_file +
                                         ": give both the same file");
            b->model = info.value("model", json::object());
            b->served_model_name = info.value("served_model_name", b->model.value("name", std::string("dsv4")));
            if (role == "prefill") {
                b->bootstrap_host = info.value("bootstrap_host", std::string());
                b->bootstrap_port = info.value("bootstrap_port", 0);
            }
            return b;
        }
        const std::string why = r.status ? "status " + std::to_string(r.status) : r.error;
        if (std::chrono::steady_clock::now() > deadline)
            throw std::runtime_error(url + "/server_info did not answer within " + std::to_string(wait_s) +
                                     " s (" + why + "): is a dsv4-server running there? (--wait sets how long to wait)");
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
}

const char *kUsage =
    "usage: dsv4-router --prefill URL [URL...] --decode URL [URL...] [--router-token-file FILE]\n"
    "                   [--host H] [--port P] [--timeout S] [--wait S] [--retries N] [--poll-ms MS]\n"
    "                   [--health-misses N] [limits: see --help]\n";

const char *kHelp =
    "dsv4-router: one HTTP front end over dsv4-server instances in the prefill and decode roles.\n"
    "Each request goes to the least loaded prefill and decode server in rotation, with a room of\n"
    "its own; the client gets the decode's answer.\n\n"
    "  --prefill URL...         prefill servers (http://host:port)\n"
    "  --decode URL...          decode servers\n"
    "  --router-token-file FILE the token the servers were given with --router-token-file: sent as\n"
    "                           X-DSV4-Router-Token so they honour the router's PD fields\n"
    "  --host H                 address to listen on (127.0.0.1)\n"
    "  --port P                 port (30080; 0 picks a free one, named on the \"listening\" line)\n"
    "  --timeout S              longest call to a server (3600)\n"
    "  --wait S                 how long to wait at start for servers still loading (60)\n"
    "  --retries N              tries on other servers after a 429, 503 or no answer, while\n"
    "                           nothing has reached the client (2)\n"
    "  --poll-ms MS             how often each server's /health and /metrics are polled (500)\n"
    "  --health-misses N        failed /health polls in a row that take a server out of\n"
    "                           rotation (3); one answer puts it back\n"
    SERVE_LIMITS_HELP
    "  --max-body-bytes N       a request body (16777216)\n"
    "  --help                   this text\n\n"
    "Endpoints: POST /generate, /v1/completions, /v1/chat/completions, /abort_request;\n"
    "GET /health, /metrics, /server_info, /v1/models.\n"
    "Exit status: 0 stopped by a signal, 1 failed (a server missing or misconfigured), 2 usage.\n";

int usage(const std::string &why) {
    std::fprintf(stderr, "dsv4-router: %s\n%s(--help says more)\n", why.c_str(), kUsage);
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    std::vector<std::string> prefill_urls, decode_urls;
    std::string host = "127.0.0.1", token_file;
    int port = 30080, wait_s = 60, retries = 2, poll_ms = 500, health_misses = 3;
    long timeout_s = 3600;
    web::limits limits;
    limits.max_body_bytes = 16 << 20;
    serve::flags flags;
    serve::limit_flags(flags, limits);
    flags.size("--max-body-bytes", limits.max_body_bytes);
    std::vector<std::string> *list = nullptr;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--help" || a == "-h") {
            std::fputs(kHelp, stdout);
            return 0;
        }
        if (a == "--prefill") { list = &prefill_urls; continue; }
        if (a == "--decode") { list = &decode_urls; continue; }
        if (a.rfind("--", 0) != 0) {
            if (!list) return usage("unexpected argument " + a);
            list->push_back(a);
            continue;
        }
        list = nullptr;
        if (i + 1 >= argc) return usage("missing the value of " + a);
        const std::string v = argv[++i];
        if (a == "--host") host = v;
        else if (a == "--port") port = std::atoi(v.c_str());
        else if (a == "--timeout") timeout_s = std::atol(v.c_str());
        else if (a == "--wait") wait_s = std::atoi(v.c_str());
        else if (a == "--retries") retries = std::atoi(v.c_str());
        else if (a == "--poll-ms") poll_ms = std::atoi(v.c_str());
        else if (a == "--health-misses") health_misses = std::atoi(v.c_str());
        else if (a == "--router-token-file") token_file = v;
        else if (a == "--http-threads") flags.set("--max-connections", v);  // the name before the limits had flags
        else if (!flags.known(a)) return usage("unknown option " + a);
        else if (std::string why = flags.set(a, v); !why.empty()) return usage(why);
    }
    if (prefill_urls.empty() || decode_urls.empty()) return usage("pass at least one --prefill and one --decode URL");
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");
    if (timeout_s <= 0 || wait_s < 0 || retries < 0 || poll_ms <= 0 || health_misses <= 0)
        return usage("--timeout, --poll-ms and --health-misses must be positive, --retries and --wait not negative");

    const sigset_t signals = serve::block_stop_signals();
    // A client's connection and one to each of its two servers per request in flight.
    serve::raise_open_files_limit("dsv4-router", 3 * static_cast<rlim_t>(limits.max_connections) + 256);

    try {
        const std::string token = token_file.empty() ? "" : serve::read_token_file(token_file);
        std::vector<std::unique_ptr<backend>> prefills, decodes;
        for (const std::string &u : prefill_urls) prefills.push_back(discover(u, "prefill", wait_s, token, token_file));
        for (const std::string &u : decode_urls) decodes.push_back(discover(u, "decode", wait_s, token, token_file));
        router r(std::move(prefills), std::move(decodes), token, static_cast<time_t>(timeout_s), retries,
                 std::chrono::milliseconds(poll_ms), health_misses);
        web::server http(limits);
        r.routes(http);
        std::string error;
        const int bound = http.bind(host, port, serve::listen_backlog(), error);
        if (bound < 0) {
            std::fprintf(stderr, "dsv4-router: %s\n", error.c_str());
            return 1;
        }
        std::printf("dsv4-router: %zu prefill, %zu decode; listening on http://%s:%d\n", prefill_urls.size(),
                    decode_urls.size(), host.c_str(), bound);
        std::fflush(stdout);
        // On a signal: refuse new requests and let the streams finish before the listener stops;
        // then the calls they left (aborts).
        serve::until_signal(http, signals, "dsv4-router", [&] { r.refuse_new(); },
                            [&] { r.wait_requests(std::chrono::seconds(timeout_s)); });
        (void)http.wait_connections(std::chrono::seconds(5));
        if (!r.drain(std::chrono::seconds(timeout_s))) {
            // Their threads use the router: leave without destroying it.
            std::fprintf(stderr, "dsv4-router: calls to servers still open after --timeout %ld s; exiting\n", timeout_s);
            std::fflush(stderr);
            std::_Exit(1);
        }
        std::printf("dsv4-router: stopped\n");
        return 0;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "dsv4-router: %s\n", e.what());
        return 1;
    }
}
