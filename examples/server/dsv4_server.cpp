// dsv4-server: one dsv4 engine behind HTTP, on the C++ wrapper (bindings/cpp/dsv4.hpp).
//
//   dsv4-server --params FILE [--host 127.0.0.1] [--port 30000] [--http-threads N]
//               [--router-token-file FILE | --trust-pd-fields]
//
// GET  /health                200 when the engine is READY, 503 otherwise; {"state", "reason"}
// GET  /metrics               the Prometheus exposition (text/plain; version=0.0.4)
// GET  /server_info           version, role, model facts, resolved params, PD endpoint
// GET  /v1/models             OpenAI's model list: the checkpoint's name
// POST /generate              SGLang's native API: input_ids or text, sampling_params, stream
// POST /v1/completions        OpenAI completions: prompt as text or token ids, SSE streaming
// POST /v1/chat/completions   OpenAI chat: messages through the checkpoint's chat template
// POST /abort_request         {"rid"}: aborts the request submitted with that "rid"
//
// Refusals map to HTTP: QUEUE_FULL 429 (with Retry-After), CAPACITY 413, INVALID_ARGUMENT 400,
// UNSUPPORTED 400 (e.g. text on a checkpoint without a tokenizer), SHUTDOWN 503, KV_TRANSFER 503
// (a PD room failed: its peer died or refused; another pair may serve it), TIMEOUT 504, others
// 500; the body is {"error": {"message", "status", "code"}} with the library's message. A request
// that fails mid-stream ends its stream with an error event in the endpoint's own shape, then
// [DONE]. PD routing fields in a body (bootstrap_room, bootstrap_host, bootstrap_port, pd_room,
// pd_peer) are honoured only from the router (X-DSV4-Router-Token matching --router-token-file)
// or with --trust-pd-fields; otherwise the request is refused with 400 naming the field. A
// streaming client that disconnects aborts its request at the next token. SIGTERM or SIGINT
// drains: the health check turns 503 and new requests are refused while those in flight finish,
// then the server exits 0. docs/serving.md has the details.
#include <dsv4.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "../http/rids.hpp"
#include "../http/serve.hpp"
#include "../http/trust.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <cerrno>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

using json = nlohmann::json;

namespace {

// A request the HTTP layer refuses before the engine sees it.
struct bad_request : std::runtime_error {
    using std::runtime_error::runtime_error;
};

int http_status(dsv4::status s) {
    switch (s) {
    case dsv4::status::queue_full: return 429;
    case dsv4::status::capacity: return 413;
    case dsv4::status::invalid_argument:
    case dsv4::status::unsupported: return 400;
    case dsv4::status::shutdown: return 503;
    // A PD room that failed (its peer died, refused or could not hold the state): retryable on
    // another prefill/decode pair, so not a 500.
    case dsv4::status::kv_transfer: return 503;
    case dsv4::status::timeout: return 504;
    case dsv4::status::not_found: return 404;
    default: return 500;
    }
}

// The body of a refusal: {"error": {"message", "status", "code"}} (also a stream's last event).
json error_json(int code, const std::string &status, const std::string &message) {
    return {{"error", {{"message", message}, {"status", status}, {"code", code}}}};
}

void send_error(httplib::Response &res, int code, const std::string &status, const std::string &message) {
    res.status = code;
    if (code == 429) res.set_header("Retry-After", "1");
    res.set_content(error_json(code, status, message).dump(), "application/json");
}

// The sampling fields shared by the three generation APIs.
struct sampling {
    uint32_t max_new_tokens = 128;
    float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
    int32_t top_k = 0;
    std::optional<uint64_t> seed;
    bool ignore_eos = false;
    std::vector<std::string> stop;         // strings, matched as their token sequences
    std::vector<int32_t> stop_token_ids;
};

template <typename T>
T field(const json &j, const char *name, T fallback) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) return fallback;
    try {
        return it->get<T>();
    } catch (const json::exception &) {
        throw bad_request(std::string(name) + " has the wrong type: " + it->dump());
    }
}

std::vector<std::string> stop_strings(const json &j) {
    auto it = j.find("stop");
    if (it == j.end() || it->is_null()) return {};
    if (it->is_string()) return {it->get<std::string>()};
    if (it->is_array()) {
        std::vector<std::string> out;
        for (const json &s : *it) {
            if (!s.is_string()) throw bad_request("stop must be a string or a list of strings");
            out.push_back(s.get<std::string>());
        }
        return out;
    }
    throw bad_request("stop must be a string or a list of strings");
}

std::vector<int32_t> ids_of(const json &j, const char *name) {
    if (!j.is_array()) throw bad_request(std::string(name) + " must be a list of token ids");
    std::vector<int32_t> ids;
    for (const json &v : j) {
        if (!v.is_number_integer()) throw bad_request(std::string(name) + " must hold integers");
        int64_t id = v.get<int64_t>();
        if (id < 0 || id > INT32_MAX) throw bad_request(std::string(name) + " holds an id out of range: " + v.dump());
        ids.push_back(static_cast<int32_t>(id));
    }
    return ids;
}

// How one request is served: the request, whether its answer streams, and the caller's id.
struct job {
    dsv4::request request{std::vector<int32_t>{}};
    bool stream = false;
    std::string rid;
    uint32_t prompt_tokens = 0;
};

// Whether a request's PD routing fields are honoured (see trust.hpp).
enum class pd_trust { refused, router_token, trusted };

// Refuses a body with a PD routing field unless `why_untrusted` is empty (they are honoured),
// naming the field and why. Checked before any work on the body.
void refuse_pd_fields(const json &j, const std::string &why_untrusted) {
    if (why_untrusted.empty()) return;
    for (const char *name : serve::kPdFields) {
        auto it = j.find(name);
        if (it != j.end() && !it->is_null())
            throw bad_request(std::string(name) + " is a PD routing field: " + why_untrusted);
    }
}

// The PD and request-id fields every generation API takes (SGLang's names): "bootstrap_room"
// (or "pd_room"), the prefill's endpoint as "bootstrap_host" + "bootstrap_port" (or "pd_peer",
// tcp://host:port), and "rid", the caller's id for POST /abort_request.
void routing_fields(const json &j, job &jb) {
    auto present = [&](const char *name) { return j.contains(name) && !j[name].is_null(); };
    if (present("bootstrap_room")) jb.request.pd_room(field<uint64_t>(j, "bootstrap_room", 0));
    else if (present("pd_room")) jb.request.pd_room(field<uint64_t>(j, "pd_room", 0));
    if (present("pd_peer")) {
        jb.request.pd_peer(field<std::string>(j, "pd_peer", ""));
    } else if (present("bootstrap_host")) {
        jb.request.pd_peer("tcp://" + field<std::string>(j, "bootstrap_host", "") + ":" +
                           std::to_string(field<int>(j, "bootstrap_port", 0)));
    }
    jb.rid = field<std::string>(j, "rid", "");
    if (jb.rid.size() > serve::kMaxRidBytes) throw bad_request("rid is longer than 256 bytes: use a shorter id");
}

using rid_registry = serve::rid_registry<uint64_t>;

dsv4::request build(const dsv4::engine &engine, std::vector<int32_t> prompt, const sampling &s) {
    dsv4::request r(std::move(prompt));
    r.max_new_tokens(s.max_new_tokens).temperature(s.temperature).top_p(s.top_p).top_k(s.top_k).min_p(s.min_p)
        .ignore_eos(s.ignore_eos);
    if (s.seed) r.seed(*s.seed);
    if (!s.stop_token_ids.empty()) r.stop_tokens(s.stop_token_ids);
    if (!s.stop.empty()) {
        std::vector<std::vector<int32_t>> seqs;
        for (const std::string &text : s.stop) {
            std::vector<int32_t> ids = engine.tokenize(text, false);
            if (ids.empty()) throw bad_request("an empty stop string matches nothing: drop it");
            seqs.push_back(std::move(ids));
        }
        r.stop_sequences(std::move(seqs));
    }
    return r;
}

// OpenAI's finish_reason: "stop" or "length" (an abort or timeout reads as "abort").
const char *openai_finish(dsv4::finish_reason r) {
    switch (r) {
    case dsv4::finish_reason::stop: return "stop";
    case dsv4::finish_reason::length: return "length";
    default: return "abort";
    }
}

std::string sse(const json &j) { return "data: " + j.dump() + "\n\n"; }

enum class api { sglang, completions, chat };

class server {
public:
    server(dsv4::engine &engine, pd_trust trust, std::string router_token)
        : engine_(engine), trust_(trust), router_token_(std::move(router_token)) {
        const json info = json::parse(engine_.model_info());
        has_tokenizer_ = info.value("has_tokenizer", false);
        model_name_ = info.value("name", std::string("dsv4"));
    }

    void routes(httplib::Server &http) {
        http.Get("/health", [this](const httplib::Request &, httplib::Response &res) {
            dsv4::engine_state s = engine_.state();
            const char *names[] = {"loading", "ready", "draining", "stopped", "failed"};
            const int code = static_cast<int>(s.state);
            res.status = s.state == dsv4::state::ready ? 200 : 503;
            res.set_content(json{{"state", code >= 0 && code < 5 ? names[code] : "unknown"}, {"reason", s.reason}}.dump(),
                            "application/json");
        });
        // What a router needs to know about this server: its role and, in a PD role, the
        // endpoint a decode request names as its prefill (`bootstrap_host`/`bootstrap_port`).
        // `pd_fields` says whom the PD routing fields are taken from ("trusted": anyone,
        // "router_token": the router, "refused": no one); with an X-DSV4-Router-Token header,
        // `router_token` says whether it is this server's ("accepted" or "rejected"), so a router
        // checks its token at start instead of at its first request.
        http.Get("/server_info", [this](const httplib::Request &req, httplib::Response &res) {
            const json params = json::parse(engine_.params_resolved());
            const char *trust_names[] = {"refused", "router_token", "trusted"};
            json out = {{"version", dsv4::version()},
                        {"role", params.value("role", std::string("unified"))},
                        {"model", json::parse(engine_.model_info())},
                        {"params", params},
                        {"pd_fields", trust_names[static_cast<int>(trust_)]}};
            if (req.has_header(serve::kRouterTokenHeader))
                out["router_token"] = token_matches(req) ? "accepted" : "rejected";
            if (out["role"] != "unified") {
                const std::string endpoint = engine_.pd_endpoint();  // tcp://host:port
                out["pd_endpoint"] = endpoint;
                const size_t colon = endpoint.rfind(':');
                out["bootstrap_host"] = endpoint.substr(6, colon - 6);
                out["bootstrap_port"] = std::stoi(endpoint.substr(colon + 1));
            }
            res.set_content(out.dump(), "application/json");
        });
        http.Get("/metrics", [this](const httplib::Request &, httplib::Response &res) {
            res.set_content(engine_.prometheus(), "text/plain; version=0.0.4");
        });
        // OpenAI's model discovery: the one model this server runs.
        http.Get("/v1/models", [this](const httplib::Request &, httplib::Response &res) {
            const json model = {{"id", model_name_}, {"object", "model"}, {"created", started_}, {"owned_by", "dsv4"}};
            res.set_content(json{{"object", "list"}, {"data", json::array({model})}}.dump(), "application/json");
        });
        http.Post("/generate", [this](const httplib::Request &req, httplib::Response &res) {
            guarded(res, [&] { generate(req, res); });
        });
        http.Post("/v1/completions", [this](const httplib::Request &req, httplib::Response &res) {
            guarded(res, [&] { openai(req, res, false); });
        });
        http.Post("/v1/chat/completions", [this](const httplib::Request &req, httplib::Response &res) {
            guarded(res, [&] { openai(req, res, true); });
        });
        // SGLang's abort: {"rid"} → {"aborted": true} when that request was in flight. An
        // unknown rid answers false and is aborted if it arrives within a minute.
        http.Post("/abort_request", [this](const httplib::Request &req, httplib::Response &res) {
            guarded(res, [&] {
                const json j = body(req);
                const std::string rid = field<std::string>(j, "rid", "");
                if (rid.empty()) throw bad_request("pass the rid of the request to abort");
                if (rid.size() > serve::kMaxRidBytes) throw bad_request("rid is longer than 256 bytes: no request has it");
                std::optional<uint64_t> id = rids_.take_for_abort(rid);
                bool aborted = false;
                if (id) {
                    try {
                        engine_.abort(*id);
                        aborted = true;
                    } catch (const dsv4::error &e) {
                        if (e.status() != dsv4::status::not_found) throw;  // already ending
                    }
                }
                res.set_content(json{{"aborted", aborted}}.dump(), "application/json");
            });
        });
    }

private:
    bool token_matches(const httplib::Request &req) const {
        return !router_token_.empty() &&
               serve::same_secret(req.get_header_value(serve::kRouterTokenHeader), router_token_);
    }

    // Empty when this request's PD routing fields are honoured, else why not.
    std::string why_untrusted(const httplib::Request &req) const {
        switch (trust_) {
        case pd_trust::trusted: return "";
        case pd_trust::router_token:
            if (token_matches(req)) return "";
            return req.has_header(serve::kRouterTokenHeader)
                       ? "the request's X-DSV4-Router-Token is not this server's --router-token-file token"
                       : "this server takes PD fields only from its router (X-DSV4-Router-Token); send the request "
                         "through dsv4-router, or drop the field";
        case pd_trust::refused: break;
        }
        return "this server takes no PD fields from requests; start it with --router-token-file FILE (the file "
               "dsv4-router is given) or, behind a router you trust, --trust-pd-fields";
    }

    template <typename F>
    void guarded(httplib::Response &res, F &&f) {
        try {
            f();
        } catch (const dsv4::error &e) {
            send_error(res, http_status(e.status()), e.status_name(), e.what());
        } catch (const bad_request &e) {
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", e.what());
        } catch (const json::exception &e) {
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", std::string("the body is not valid JSON: ") + e.what());
        }
    }

    json body(const httplib::Request &req) {
        json j = json::parse(req.body);
        if (!j.is_object()) throw bad_request("the body must be a JSON object");
        return j;
    }

    // POST /generate (SGLang): {"input_ids" | "text", "sampling_params", "stream",
    // "bootstrap_room", "bootstrap_host" + "bootstrap_port" (or "pd_peer"), "rid"}.
    void generate(const httplib::Request &http_req, httplib::Response &res) {
        const json j = body(http_req);
        refuse_pd_fields(j, why_untrusted(http_req));
        const json sp = j.value("sampling_params", json::object());
        if (!sp.is_object()) throw bad_request("sampling_params must be an object");
        sampling s;
        s.max_new_tokens = field<uint32_t>(sp, "max_new_tokens", 128);
        s.temperature = field<float>(sp, "temperature", 1.0f);
        s.top_p = field<float>(sp, "top_p", 1.0f);
        s.top_k = std::max(0, field<int32_t>(sp, "top_k", -1));  // SGLang's -1: off
        s.min_p = field<float>(sp, "min_p", 0.0f);
        s.ignore_eos = field<bool>(sp, "ignore_eos", false);
        if (sp.contains("seed") && !sp["seed"].is_null()) s.seed = field<uint64_t>(sp, "seed", 0);
        s.stop = stop_strings(sp);
        if (sp.contains("stop_token_ids")) s.stop_token_ids = ids_of(sp["stop_token_ids"], "stop_token_ids");

        std::vector<int32_t> prompt;
        if (j.contains("input_ids")) {
            prompt = ids_of(j["input_ids"], "input_ids");
        } else if (j.contains("text")) {
            if (!j["text"].is_string()) throw bad_request("text must be a string");
            prompt = engine_.tokenize(j["text"].get<std::string>(), true);
        } else {
            throw bad_request("pass input_ids (token ids) or text");
        }
        answer(j, std::move(prompt), s, res, api::sglang);
    }

    // POST /v1/completions and /v1/chat/completions.
    void openai(const httplib::Request &http_req, httplib::Response &res, bool chat) {
        const json j = body(http_req);
        refuse_pd_fields(j, why_untrusted(http_req));
        sampling s;
        s.max_new_tokens = field<uint32_t>(j, chat ? "max_completion_tokens" : "max_tokens",
                                           field<uint32_t>(j, "max_tokens", 128));
        s.temperature = field<float>(j, "temperature", 1.0f);
        s.top_p = field<float>(j, "top_p", 1.0f);
        s.top_k = std::max(0, field<int32_t>(j, "top_k", -1));
        if (j.contains("seed") && !j["seed"].is_null()) s.seed = field<uint64_t>(j, "seed", 0);
        s.ignore_eos = field<bool>(j, "ignore_eos", false);
        s.stop = stop_strings(j);
        std::vector<int32_t> prompt;
        if (chat) {
            if (!j.contains("messages") || !j["messages"].is_array())
                throw bad_request("messages must be a list of {role, content}");
            // The template writes the BOS token itself.
            prompt = engine_.tokenize(engine_.chat_apply(j["messages"].dump(), true), false);
        } else {
            const json p = j.value("prompt", json());
            if (p.is_string()) {
                prompt = engine_.tokenize(p.get<std::string>(), true);
            } else if (p.is_array()) {
                prompt = ids_of(p, "prompt");
            } else {
                throw bad_request("prompt must be a string or a list of token ids");
            }
        }
        answer(j, std::move(prompt), s, res, chat ? api::chat : api::completions);
    }

    // A request from its prompt, sampling and the body's routing fields and "stream".
    void answer(const json &j, std::vector<int32_t> prompt, const sampling &s, httplib::Response &res, api a) {
        job jb;
        jb.prompt_tokens = static_cast<uint32_t>(prompt.size());
        jb.request = build(engine_, std::move(prompt), s);
        routing_fields(j, jb);
        jb.stream = field<bool>(j, "stream", false);
        run(std::move(jb), res, a);
    }

    // What one finished (or streamed) request reports.
    struct outcome {
        std::vector<int32_t> ids;
        std::string text;
        dsv4::event last;
    };

    json final_json(api a, const outcome &o, const std::string &id) const {
        if (a == api::sglang) {
            json meta = {{"prompt_tokens", o.last.prompt_tokens},
                         {"completion_tokens", o.ids.size()},
                         {"cached_tokens", o.last.cached_tokens_device + o.last.cached_tokens_host},
                         {"finish_reason", {{"type", dsv4::finish_reason_name(o.last.finish_reason)}}}};
            json out = {{"output_ids", o.ids}, {"meta_info", meta}};
            if (has_tokenizer_) out["text"] = o.text;
            return out;
        }
        json usage = {{"prompt_tokens", o.last.prompt_tokens},
                      {"completion_tokens", o.ids.size()},
                      {"total_tokens", o.last.prompt_tokens + o.ids.size()}};
        json choice = {{"index", 0}, {"finish_reason", openai_finish(o.last.finish_reason)}};
        if (a == api::chat) choice["message"] = {{"role", "assistant"}, {"content", o.text}};
        else choice["text"] = o.text;
        return {{"id", id},
                {"object", a == api::chat ? "chat.completion" : "text_completion"},
                {"created", std::time(nullptr)},
                {"model", model_name_},
                {"choices", json::array({choice})},
                {"usage", usage}};
    }

    using rid_entry = serve::rid_entry<uint64_t>;

    // A stream's last event for a request that failed mid-stream, in the endpoint's shape:
    // SGLang's final answer with finish_reason {"type": "abort", "message", "status_code"} (what
    // SGLang's own server sends), OpenAI's {"error": {...}}.
    json error_chunk(api a, const outcome &o) const {
        const int code = http_status(o.last.status);
        const char *status = dsv4_status_name(static_cast<int32_t>(o.last.status));
        if (a != api::sglang) return error_json(code, status, o.last.message);
        json meta = {{"prompt_tokens", o.last.prompt_tokens},
                     {"completion_tokens", o.ids.size()},
                     {"finish_reason", {{"type", "abort"}, {"message", o.last.message}, {"status_code", code}, {"status", status}}}};
        json out = {{"output_ids", o.ids}, {"meta_info", meta}};
        if (has_tokenizer_) out["text"] = o.text;
        return out;
    }

    // A stream's last event: SGLang's final answer, or OpenAI's chunk with the finish reason
    // and the usage.
    json last_chunk(api a, const outcome &o, const std::string &id) const {
        if (a == api::sglang) return final_json(a, o, id);
        json choice = {{"index", 0}, {"finish_reason", openai_finish(o.last.finish_reason)}};
        if (a == api::chat) choice["delta"] = json::object();
        else choice["text"] = "";
        return {{"id", id},
                {"object", a == api::chat ? "chat.completion.chunk" : "text_completion"},
                {"model", model_name_},
                {"choices", json::array({choice})},
                {"usage", final_json(api::completions, o, id)["usage"]}};
    }

    // A request whose rid was aborted before it came: answered as aborted, never submitted (a
    // PD decode's half must not claim its room).
    void answer_aborted(const job &jb, httplib::Response &res, api a) {
        outcome o;
        o.last.kind = dsv4::event_kind::finished;
        o.last.finish_reason = dsv4::finish_reason::aborted;
        o.last.prompt_tokens = jb.prompt_tokens;
        const std::string id = "cmpl-aborted";
        if (!jb.stream) {
            res.set_content(final_json(a, o, id).dump(), "application/json");
            return;
        }
        res.set_header("Cache-Control", "no-cache");
        res.set_content(sse(last_chunk(a, o, id)) + "data: [DONE]\n\n", "text/event-stream");
    }

    void run(job jb, httplib::Response &res, api a) {
        if (!jb.rid.empty() && rids_.aborted_before(jb.rid)) {
            answer_aborted(jb, res, a);
            return;
        }
        auto stream = std::make_shared<dsv4::stream>(engine_.submit(jb.request));
        const std::string id = "cmpl-" + std::to_string(stream->id());
        std::shared_ptr<rid_entry> rid;
        if (!jb.rid.empty()) {
            switch (rids_.add(jb.rid, stream->id())) {
            case rid_registry::added::ok: rid = std::make_shared<rid_entry>(rids_, jb.rid); break;
            case rid_registry::added::aborted_early: stream->abort(); break;  // between the check and the submit
            case rid_registry::added::in_flight:
                stream->abort();
                throw bad_request("rid " + jb.rid + " is already in flight: pick another");
            }
        }
        std::shared_ptr<dsv4::detokenizer> detok;
        if (has_tokenizer_) detok = std::make_shared<dsv4::detokenizer>(engine_);
        if (!jb.stream) {
            outcome o;
            for (const dsv4::event &e : *stream) {
                if (e.kind == dsv4::event_kind::token) {
                    o.ids.push_back(e.token);
                    if (detok) o.text += detok->feed(e.token);
                } else {
                    o.last = e;
                }
            }
            if (o.last.kind == dsv4::event_kind::error) {
                send_error(res, http_status(o.last.status), dsv4_status_name(static_cast<int32_t>(o.last.status)),
                           o.last.message);
                return;
            }
            res.set_content(final_json(a, o, id).dump(), "application/json");
            return;
        }
        // Server-sent events: one per token (SGLang: the text and ids so far; OpenAI: the
        // piece), the final one with the finish reason, then [DONE]. A write that fails (the
        // client went away) drops the stream, which aborts the request.
        auto state = std::make_shared<outcome>();
        auto done = std::make_shared<bool>(false);
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [this, stream, detok, state, done, a, id, rid](size_t, httplib::DataSink &sink) mutable {
                if (*done) {
                    sink.done();
                    return true;
                }
                std::optional<dsv4::event> e = stream->next();
                if (!e) {
                    *done = true;
                    sink.done();
                    return true;
                }
                std::string chunk;
                if (e->kind == dsv4::event_kind::token) {
                    state->ids.push_back(e->token);
                    std::string piece = detok ? detok->feed(e->token) : "";
                    state->text += piece;
                    if (a == api::sglang) {
                        json out = {{"output_ids", state->ids},
                                    {"meta_info", {{"completion_tokens", state->ids.size()}, {"finish_reason", nullptr}}}};
                        if (detok) out["text"] = state->text;
                        chunk = sse(out);
                    } else {
                        json delta = a == api::chat ? json{{"index", 0}, {"delta", {{"content", piece}}}, {"finish_reason", nullptr}}
                                                    : json{{"index", 0}, {"text", piece}, {"finish_reason", nullptr}};
                        chunk = sse({{"id", id},
                                     {"object", a == api::chat ? "chat.completion.chunk" : "text_completion"},
                                     {"model", model_name_},
                                     {"choices", json::array({delta})}});
                    }
                } else {
                    state->last = *e;
                    if (e->kind == dsv4::event_kind::error) {
                        chunk = sse(error_chunk(a, *state));
                    } else {
                        chunk = sse(last_chunk(a, *state, id));
                    }
                    chunk += "data: [DONE]\n\n";
                }
                if (!sink.write(chunk.data(), chunk.size())) return false;  // gone: abort
                return true;
            },
            streams_.open());
    }

public:
    // SIGTERM: after the engine drained, its streams' last chunks still have to go out.
    bool wait_streams(std::chrono::milliseconds limit) const { return streams_.wait(limit); }

private:
    dsv4::engine &engine_;
    const pd_trust trust_;
    const std::string router_token_;
    const std::time_t started_ = std::time(nullptr);
    rid_registry rids_;
    serve::streams streams_;
    bool has_tokenizer_ = false;
    std::string model_name_;
};

std::string read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read --params " + path + ": " + std::strerror(errno));
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

// The params with a relative "model_path" looked up next to the params file first (so a params
// file and its checkpoint move together, e.g. the installed share/dsv4/examples), then in the
// working directory, as before.
std::string with_model_path_resolved(const std::string &text, const std::string &params_path) {
    json p = json::parse(text, nullptr, false);
    if (!p.is_object() || !p.contains("model_path") || !p["model_path"].is_string()) return text;
    const std::filesystem::path model = p["model_path"].get<std::string>();
    if (model.empty() || model.is_absolute()) return text;
    const std::filesystem::path beside = std::filesystem::path(params_path).parent_path() / model;
    std::error_code ec;
    if (!std::filesystem::exists(beside, ec)) return text;
    p["model_path"] = beside.lexically_normal().string();
    return p.dump();
}

const char *kUsage =
    "usage: dsv4-server --params FILE [--host H] [--port P] [--http-threads N]\n"
    "                   [--router-token-file FILE | --trust-pd-fields]\n";

const char *kHelp =
    "dsv4-server: one dsv4 engine behind HTTP (SGLang's /generate, OpenAI's /v1/completions and\n"
    "/v1/chat/completions, /health, /metrics, /server_info, /v1/models, /abort_request).\n\n"
    "  --params FILE            the engine's params (JSON, docs/params.md); a relative model_path\n"
    "                           is looked up next to FILE first, then in the working directory\n"
    "  --host H                 address to listen on (127.0.0.1)\n"
    "  --port P                 port (30000; 0 picks a free one, named on the \"listening\" line)\n"
    "  --http-threads N         most connections served at once (4096); a thread each, started\n"
    "                           as connections come and ended when idle for 30 s\n"
    "  --router-token-file FILE honour PD routing fields (bootstrap_room/host/port, pd_room,\n"
    "                           pd_peer) from requests whose X-DSV4-Router-Token header holds the\n"
    "                           token in FILE: give dsv4-router the same file\n"
    "  --trust-pd-fields        honour PD routing fields from every request (only behind a router\n"
    "                           that strips them from its clients, such as SGLang's)\n"
    "  --help                   this text\n\n"
    "At start it prints the memory plan, then \"dsv4-server: listening on http://H:P\".\n"
    "Without either PD option a body with a PD routing field is refused (400).\n"
    "SIGTERM or SIGINT drains (503 for new requests, those in flight finish) and exits 0.\n"
    "Exit status: 0 stopped by a signal, 1 failed (params refused, port taken), 2 usage.\n";

int usage(const std::string &why) {
    std::fprintf(stderr, "dsv4-server: %s\n%s(--help says more)\n", why.c_str(), kUsage);
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    std::string params_path, host = "127.0.0.1", token_file;
    int port = 30000, threads = 4096;
    bool trust_pd_fields = false;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--help" || a == "-h") {
            std::fputs(kHelp, stdout);
            return 0;
        }
        if (a == "--trust-pd-fields") {
            trust_pd_fields = true;
            continue;
        }
        if (i + 1 >= argc) return usage("missing the value of " + a);
        if (a == "--params") params_path = argv[++i];
        else if (a == "--host") host = argv[++i];
        else if (a == "--port") port = std::atoi(argv[++i]);
        else if (a == "--http-threads") threads = std::atoi(argv[++i]);
        else if (a == "--router-token-file") token_file = argv[++i];
        else return usage("unknown option " + a);
    }
    if (params_path.empty()) return usage("--params is required");
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");
    if (threads <= 0) return usage("--http-threads must be positive");
    if (trust_pd_fields && !token_file.empty())
        return usage("--trust-pd-fields and --router-token-file exclude each other: the first trusts every request");

    // SIGTERM and SIGINT are taken by a thread of their own, so they are blocked in every
    // thread, the engine's and the HTTP pool's included: block them before any starts.
    const sigset_t signals = serve::block_stop_signals();
    // A connection each, plus the engine's own (PD links, the checkpoint's files).
    serve::raise_open_files_limit("dsv4-server", static_cast<rlim_t>(threads) + 256);

    try {
        const std::string token = token_file.empty() ? "" : serve::read_token_file(token_file);
        const pd_trust trust = trust_pd_fields ? pd_trust::trusted : token.empty() ? pd_trust::refused : pd_trust::router_token;
        const std::string params = with_model_path_resolved(read_file(params_path), params_path);
        // The plan first, where an operator looks: every pool's device and host bytes, HiCache
        // per NUMA node and its effective ratio. A refused plan is the engine's error below.
        try {
            std::istringstream plan(dsv4::plan_text(params));
            for (std::string line; std::getline(plan, line);) std::printf("dsv4-server: plan: %s\n", line.c_str());
            std::fflush(stdout);
        } catch (const dsv4::error &) {
        }
        dsv4::engine engine(params);
        server routes(engine, trust, token);
        httplib::Server http;
        serve::options o;
        o.max_threads = static_cast<size_t>(threads);
        serve::listener listener(http, o);
        routes.routes(http);
        const int bound = listener.bind("dsv4-server", host, port);
        if (bound < 0) return 1;
        // The line a supervisor (or a test) waits for.
        std::printf("dsv4-server: listening on http://%s:%d\n", host.c_str(), bound);
        std::fflush(stdout);
        const bool ok = serve::until_signal(http, signals, "dsv4-server", [&] {
            try {
                engine.shutdown(dsv4::shutdown_mode::drain);  // new requests get 503 meanwhile
            } catch (const dsv4::error &e) {
                std::fprintf(stderr, "dsv4-server: drain failed: %s\n", e.what());
            }
            if (!routes.wait_streams(std::chrono::seconds(30)))
                std::fprintf(stderr, "dsv4-server: streams still open 30 s after the drain; stopping anyway\n");
        });
        if (!ok) return 1;
        std::printf("dsv4-server: stopped\n");
        return 0;
    } catch (const dsv4::error &e) {
        std::fprintf(stderr, "dsv4-server: %s: %s\n", e.status_name(), e.what());
        return 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "dsv4-server: %s\n", e.what());
        return 1;
    }
}
