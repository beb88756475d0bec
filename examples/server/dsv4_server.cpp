// dsv4-server: one dsv4 engine behind HTTP, on the C++ wrapper (bindings/cpp/dsv4.hpp). This
// file is the engine glue; the HTTP plumbing (connections, limits, parsing) is
// examples/http/http_server.hpp.
//
//   dsv4-server --params FILE [--host 127.0.0.1] [--port 30000]
//               [--router-token-file FILE | --trust-pd-fields] [limits: --help]
//
// GET  /health                200 when the engine is READY, 503 otherwise; {"state", "reason"}
// GET  /metrics               the Prometheus exposition (text/plain; version=0.0.4)
// GET  /server_info           version, role, model facts, resolved params, PD endpoint
// GET  /v1/models             OpenAI's model list: --served-model-name, else the checkpoint's name
// GET  /model_info, /get_model_info   SGLang's: model_path, tokenizer_path, is_generation
// GET  /get_server_info       SGLang's name for /server_info
// POST /generate              SGLang's native API: input_ids or text, sampling_params, stream
// POST /v1/completions        OpenAI completions: prompt as text or token ids, SSE streaming
// POST /v1/chat/completions   OpenAI chat: messages through the checkpoint's chat template
// POST /abort_request         {"rid"}: aborts the request submitted with that "rid"
//
// Refusals map to HTTP: QUEUE_FULL 429 (with Retry-After), CAPACITY 413, INVALID_ARGUMENT 400,
// UNSUPPORTED 400 (e.g. text on a checkpoint without a tokenizer), SHUTDOWN 503, KV_TRANSFER 503
// (a PD room failed: its peer died or refused; another pair may serve it), TIMEOUT 504, others
// 500; the body is {"error": {"message", "status", "code"}} with the library's message. Every
// field is checked before any work: a body that is not UTF-8 (400 naming the byte), an integer
// out of its range (400 naming the field and the range), a prompt longer than the context could
// hold (413, before tokenizing). A request that fails mid-stream ends its stream with an error
// event in the endpoint's own shape, then [DONE]. PD routing fields in a body (bootstrap_room,
// bootstrap_host, bootstrap_port, pd_room, pd_peer) are honoured only from the router
// (X-DSV4-Router-Token matching --router-token-file) or with --trust-pd-fields; otherwise the
// request is refused with 400 naming the field. A client that disconnects aborts its request
// (streaming or not). SIGTERM or SIGINT drains: the health check turns 503 and new requests are
// refused while those in flight finish, then the server exits 0. docs/serving.md has the details.
#include <dsv4.hpp>

#include <nlohmann/json.hpp>

#include "../http/http_server.hpp"
#include "../http/rids.hpp"
#include "../http/serve.hpp"
#include "../http/trust.hpp"

#include <algorithm>
#include <initializer_list>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using json = nlohmann::json;

namespace {

// A request the HTTP layer refuses before the engine sees it: 400, or `code` (413: too large).
struct bad_request : std::runtime_error {
    explicit bad_request(const std::string &what, int code = 400) : std::runtime_error(what), code(code) {}
    int code;
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
// OpenAI's error object (`type`, `param` as its SDK reads them) with the library's status.
json error_json(int code, const std::string &status, const std::string &message) {
    const char *type = code == 429 ? "rate_limit_error" : code < 500 ? "invalid_request_error" : "server_error";
    return {{"error", {{"message", message}, {"type", type}, {"param", nullptr}, {"code", code}, {"status", status}}}};
}

// What the body's fields may hold: the model's context and vocabulary, the text and message
// bounds (from the command line).
struct field_limits {
    int64_t context = 0;     // tokens a request's prompt + output may take (model_info context_limit)
    int64_t vocab = 0;       // token ids are below it
    size_t max_text_bytes = 0;
    size_t max_messages = 0;
};

// A field that is absent or null.
bool absent(const json &j, const char *name) {
    auto it = j.find(name);
    return it == j.end() || it->is_null();
}

// An integer field within [lo, hi] (`fallback` when absent); anything else is a 400 naming the
// field and the range: a float, a string, a negative or overflowing number.
int64_t int_field(const json &j, const char *name, int64_t lo, int64_t hi, int64_t fallback) {
    if (absent(j, name)) return fallback;
    const json &v = j.at(name);
    const std::string range = "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    if (!v.is_number_integer())
        throw bad_request(std::string(name) + " must be an integer in " + range + ", got " + v.dump());
    // JSON parses a non-negative number as unsigned: both bounds apply to it too.
    const bool inside = v.is_number_unsigned()
                            ? v.get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                                  (lo <= 0 || v.get<uint64_t>() >= static_cast<uint64_t>(lo))
                            : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
    if (!inside) throw bad_request(std::string(name) + " = " + v.dump() + " is outside " + range);
    return v.get<int64_t>();
}

// An unsigned 64-bit field (seeds, rooms): 0 .. 2^64-1.
std::optional<uint64_t> u64_field(const json &j, const char *name) {
    if (absent(j, name)) return std::nullopt;
    const json &v = j.at(name);
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
        throw bad_request(std::string(name) + " must be an integer in [0, 18446744073709551615], got " + v.dump());
    return v.get<uint64_t>();
}

// A finite number within [lo, hi].
float float_field(const json &j, const char *name, double lo, double hi, float fallback) {
    if (absent(j, name)) return fallback;
    const json &v = j.at(name);
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < lo || v.get<double>() > hi) {
        char range[64];
        std::snprintf(range, sizeof(range), "[%g, %g]", lo, hi);
        throw bad_request(std::string(name) + " must be a number in " + range + ", got " + v.dump());
    }
    return v.get<float>();
}

bool bool_field(const json &j, const char *name, bool fallback) {
    if (absent(j, name)) return fallback;
    if (!j.at(name).is_boolean()) throw bad_request(std::string(name) + " must be true or false, got " + j.at(name).dump());
    return j.at(name).get<bool>();
}

std::string string_field(const json &j, const char *name, size_t max_bytes) {
    if (absent(j, name)) return "";
    const json &v = j.at(name);
    if (!v.is_string()) throw bad_request(std::string(name) + " must be a string, got " + v.dump().substr(0, 64));
    const std::string &s = v.get_ref<const std::string &>();
    if (s.size() > max_bytes) throw bad_request(std::string(name) + " is longer than " + std::to_string(max_bytes) + " bytes");
    return s;
}

// The token id at `i` of the array `ids` (named `name`), within [0, last].
int32_t token_id_at(const json &ids, size_t i, int64_t last, const char *name) {
    const json &v = ids[i];
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0) ||
        (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(last) : v.get<int64_t>() > last))
        throw bad_request(std::string(name) + "[" + std::to_string(i) + "] = " + v.dump().substr(0, 32) +
                          " is not a token id in [0, " + std::to_string(last) + "]");
    return static_cast<int32_t>(v.get<int64_t>());
}

// The sampling fields shared by the three generation APIs.
struct sampling {
    uint32_t max_new_tokens = 128;
    float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
    int32_t top_k = 0;
    std::optional<uint64_t> seed;
    bool ignore_eos = false;
    std::vector<std::string> stop;  // strings, matched as their token sequences
    std::vector<int32_t> stop_token_ids;
};

// Sampling from `s` (SGLang's sampling_params, or an OpenAI body) with every field checked. The
// output length is the first of `max_names` present (chat: max_completion_tokens, then
// max_tokens), at most the context.
sampling sampling_of(const json &s, const field_limits &l, std::initializer_list<const char *> max_names) {
    sampling out;
    int64_t max_new = std::min<int64_t>(128, l.context);
    for (const char *name : max_names) {
        if (absent(s, name)) continue;
        max_new = int_field(s, name, 1, l.context, max_new);
        break;
    }
    out.max_new_tokens = static_cast<uint32_t>(max_new);
    out.temperature = float_field(s, "temperature", 0.0, 100.0, 1.0f);
    out.top_p = float_field(s, "top_p", 0.0, 1.0, 1.0f);
    out.min_p = float_field(s, "min_p", 0.0, 1.0, 0.0f);
    out.top_k = static_cast<int32_t>(std::max<int64_t>(0, int_field(s, "top_k", -1, l.vocab, -1)));  // -1: off
    out.seed = u64_field(s, "seed");
    out.ignore_eos = bool_field(s, "ignore_eos", false);
    if (!absent(s, "stop")) {
        const json &st = s.at("stop");
        auto add = [&](const json &v) {
            if (!v.is_string()) throw bad_request("stop must be a string or a list of strings");
            if (v.get_ref<const std::string &>().size() > 4096) throw bad_request("a stop string is longer than 4096 bytes");
            out.stop.push_back(v.get<std::string>());
        };
        if (st.is_array()) {
            if (st.size() > 64) throw bad_request("stop holds " + std::to_string(st.size()) + " strings; at most 64");
            for (const json &v : st) add(v);
        } else {
            add(st);
        }
    }
    if (!absent(s, "stop_token_ids")) {
        const json &ids = s.at("stop_token_ids");
        if (!ids.is_array() || ids.size() > 1024) throw bad_request("stop_token_ids must be a list of at most 1024 token ids");
        for (size_t i = 0; i < ids.size(); i++)
            out.stop_token_ids.push_back(token_id_at(ids, i, l.vocab - 1, "stop_token_ids"));
    }
    return out;
}

// Token ids from a JSON array, its length checked against the context before any is read.
std::vector<int32_t> ids_of(const json &j, const char *name, const field_limits &l) {
    if (!j.is_array()) throw bad_request(std::string(name) + " must be a list of token ids");
    if (static_cast<int64_t>(j.size()) >= l.context)
        throw bad_request(std::string(name) + " holds " + std::to_string(j.size()) + " ids; the context holds " +
                              std::to_string(l.context) + " tokens, output included",
                          413);
    std::vector<int32_t> ids;
    ids.reserve(j.size());
    for (size_t i = 0; i < j.size(); i++) ids.push_back(token_id_at(j, i, l.vocab - 1, name));
    return ids;
}

// A text to tokenize, its length bounded before the tokenizer sees it (a text longer than
// --max-text-bytes cannot fit the context at any plausible bytes per token).
const std::string &bounded_text(const std::string &s, const char *name, const field_limits &l) {
    if (s.size() > l.max_text_bytes)
        throw bad_request(std::string(name) + " is " + std::to_string(s.size()) + " bytes; at most " +
                              std::to_string(l.max_text_bytes) + " are tokenized (--max-text-bytes; by default the " +
                              "context's " + std::to_string(l.context) + " tokens at 8 bytes each)",
                          413);
    return s;
}

const std::string &text_of(const json &j, const char *name, const field_limits &l) {
    if (!j.is_string()) throw bad_request(std::string(name) + " must be a string");
    return bounded_text(j.get_ref<const std::string &>(), name, l);
}

// How one request is served: the request, whether its answer streams, and the caller's id.
struct job {
    dsv4::request request{std::vector<int32_t>{}};
    bool stream = false;
    bool include_usage = false;  // OpenAI's stream_options.include_usage: a usage chunk at the end
    std::string rid;
    uint32_t prompt_tokens = 0;
};

// Whether a request's PD routing fields are honoured (see trust.hpp).
enum class pd_trust { refused, router_token, trusted };

// Refuses a body with a PD routing field unless `why_untrusted` is empty (they are honoured),
// naming the field and why. Checked before any work on the body.
void refuse_pd_fields(const json &j, const std::string &why_untrusted) {
    if (why_untrusted.empty()) return;
    for (const char *name : serve::kPdFields)
        if (!absent(j, name)) throw bad_request(std::string(name) + " is a PD routing field: " + why_untrusted);
}

// Fields that would change the output and are not supported: a 400 naming them, never a
// silent answer to another question. Each is refused only at a value that asks for something
// (n = 1, echo = false, a penalty of 0 are what is done anyway). Inert fields (user, metadata,
// store, service_tier, parallel_tool_calls, ...) are accepted and ignored.
void refuse_unsupported(const json &j, const char *where) {
    auto asks = [&](const char *name, auto &&is_default) {
        auto it = j.find(name);
        if (it == j.end() || it->is_null() || is_default(*it)) return;
        throw bad_request(std::string(name) + " = " + it->dump() + " in " + where +
                          " is not supported by this server: drop it (docs/serving.md lists what is)");
    };
    auto one = [](const json &v) { return v.is_number() && v.get<double>() == 1; };
    auto zero = [](const json &v) { return v.is_number() && v.get<double>() == 0; };
    auto no = [](const json &v) { return v.is_boolean() && !v.get<bool>(); };
    auto empty = [](const json &v) { return (v.is_array() || v.is_object() || v.is_string()) && v.empty(); };
    asks("n", one);
    asks("best_of", one);
    asks("echo", no);
    asks("suffix", empty);
    asks("tools", empty);
    asks("functions", empty);
    asks("tool_choice", [](const json &v) { return v.is_string() && v.get<std::string>() == "none"; });
    asks("response_format", [](const json &v) { return v.is_object() && v.value("type", std::string()) == "text"; });
    asks("logprobs", [&](const json &v) { return no(v) || zero(v); });
    asks("top_logprobs", zero);
    asks("return_logprob", no);
    asks("frequency_penalty", zero);
    asks("presence_penalty", zero);
    asks("repetition_penalty", one);
}

// The PD and request-id fields every generation API takes (SGLang's names): "bootstrap_room"
// (or "pd_room"), the prefill's endpoint as "bootstrap_host" + "bootstrap_port" (or "pd_peer",
// tcp://host:port), and "rid", the caller's id for POST /abort_request. SGLang's router sends
// one body to both halves of a pair: on a prefill (`prefill`) the bootstrap host and port name
// this very engine and are ignored; a decode needs both, or its room would wait out its
// timeout on a peer that cannot be.
void routing_fields(const json &j, job &jb, bool prefill) {
    if (auto room = u64_field(j, "bootstrap_room")) jb.request.pd_room(*room);
    else if (auto pd_room = u64_field(j, "pd_room")) jb.request.pd_room(*pd_room);
    const bool host = !absent(j, "bootstrap_host"), port = !absent(j, "bootstrap_port");
    if (!absent(j, "pd_peer")) {
        jb.request.pd_peer(string_field(j, "pd_peer", 1024));
    } else if (prefill) {
        // Checked for shape only: a bad value is still the caller's error.
        if (host) string_field(j, "bootstrap_host", 1024);
        if (port) int_field(j, "bootstrap_port", 1, 65535, 0);
    } else if (host != port) {
        throw bad_request(std::string(host ? "bootstrap_host without bootstrap_port" : "bootstrap_port without bootstrap_host") +
                          ": a decode needs both to reach its prefill (bootstrap_host and bootstrap_port in the prefill "
                          "server's /server_info)");
    } else if (host) {
        jb.request.pd_peer("tcp://" + string_field(j, "bootstrap_host", 1024) + ":" +
                           std::to_string(int_field(j, "bootstrap_port", 1, 65535, 0)));
    }
    jb.rid = string_field(j, "rid", serve::kMaxRidBytes);
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
    server(dsv4::engine &engine, pd_trust trust, std::string router_token, size_t max_text_bytes, size_t max_messages,
           const std::string &served_model_name)
        : engine_(engine), trust_(trust), router_token_(std::move(router_token)) {
        const json info = json::parse(engine_.model_info());
        has_tokenizer_ = info.value("has_tokenizer", false);
        model_name_ = served_model_name.empty() ? info.value("name", std::string("dsv4")) : served_model_name;
        limits_.context = info.value("context_limit", int64_t{4096});
        limits_.vocab = info.value("vocab_size", int64_t{1});
        limits_.max_text_bytes = max_text_bytes ? max_text_bytes : static_cast<size_t>(limits_.context) * 8;
        limits_.max_messages = max_messages;
        prefill_ = json::parse(engine_.params_resolved()).value("role", std::string()) == "prefill";
    }

    const field_limits &limits() const { return limits_; }

    void routes(web::server &http) {
        http.get("/health", [this](const web::request &, web::reply &res) {
            dsv4::engine_state s = engine_.state();
            const char *names[] = {"loading", "ready", "draining", "stopped", "failed"};
            int code = static_cast<int>(s.state);
            if (draining_.load() && s.state == dsv4::state::ready) {
                code = 2;  // SIGTERM came; the engine's drain is about to begin
                s.reason = "SIGTERM: draining";
            }
            res.send(code == 1 ? 200 : 503, "application/json",
                     json{{"state", code >= 0 && code < 5 ? names[code] : "unknown"}, {"reason", s.reason}}.dump());
        });
        // What a router needs to know about this server: its role and, in a PD role, the
        // endpoint a decode request names as its prefill (`bootstrap_host`/`bootstrap_port`).
        // `pd_fields` says whom the PD routing fields are taken from ("trusted": anyone,
        // "router_token": the router, "refused": no one); with an X-DSV4-Router-Token header,
        // `router_token` says whether it is this server's ("accepted" or "rejected"), so a router
        // checks its token at start instead of at its first request.
        http.get("/server_info", [this](const web::request &req, web::reply &res) { server_info(req, res); });
        // SGLang's name for it: its router and tools ask there.
        http.get("/get_server_info", [this](const web::request &req, web::reply &res) { server_info(req, res); });
        // SGLang's model facts, under both its names: where the weights and the tokenizer are
        // (the checkpoint directory holds both), and that the model generates.
        for (const char *path : {"/model_info", "/get_model_info"}) {
            http.get(path, [this](const web::request &, web::reply &res) {
                const std::string dir = json::parse(engine_.params_resolved()).value("model_path", std::string());
                res.send(200, "application/json",
                         json{{"model_path", dir}, {"tokenizer_path", dir}, {"is_generation", true},
                              {"served_model_name", model_name_}}
                             .dump());
            });
        }
        http.get("/metrics", [this](const web::request &, web::reply &res) {
            res.send(200, "text/plain; version=0.0.4", engine_.prometheus());
        });
        // OpenAI's model discovery: the one model this server runs.
        http.get("/v1/models", [this](const web::request &, web::reply &res) {
            const json model = {{"id", model_name_}, {"object", "model"}, {"created", started_}, {"owned_by", "dsv4"}};
            res.send(200, "application/json", json{{"object", "list"}, {"data", json::array({model})}}.dump());
        });
        http.post("/generate", [this](const web::request &req, web::reply &res) {
            guarded(res, [&] { generate(req, res); });
        });
        http.post("/v1/completions", [this](const web::request &req, web::reply &res) {
            guarded(res, [&] { openai(req, res, false); });
        });
        http.post("/v1/chat/completions", [this](const web::request &req, web::reply &res) {
            guarded(res, [&] { openai(req, res, true); });
        });
        // SGLang's abort: {"rid"} → {"aborted": true} when that request was in flight. An
        // unknown rid answers false and is aborted if it arrives within a minute.
        http.post("/abort_request", [this](const web::request &req, web::reply &res) {
            guarded(res, [&] {
                const json j = body(req);
                const std::string rid = string_field(j, "rid", serve::kMaxRidBytes);
                if (rid.empty()) throw bad_request("pass the rid of the request to abort");
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
                res.send(200, "application/json", json{{"aborted", aborted}}.dump());
            }, false);
        });
    }

    // SIGTERM: from now on new requests get 503 (the engine's drain refuses them too once it
    // began); /health says "draining".
    void refuse_new() { draining_ = true; }

    // SIGTERM: after the engine drained, its streams' last events still have to go out.
    bool wait_requests(std::chrono::milliseconds limit) const { return serve::wait_for_zero(in_flight_, limit); }

private:
    bool token_matches(const web::request &req) const {
        return !router_token_.empty() && serve::same_secret(req.header(serve::kRouterTokenHeader), router_token_);
    }

    // Empty when this request's PD routing fields are honoured, else why not.
    std::string why_untrusted(const web::request &req) const {
        switch (trust_) {
        case pd_trust::trusted: return "";
        case pd_trust::router_token:
            if (token_matches(req)) return "";
            return req.has(serve::kRouterTokenHeader)
                       ? "the request's X-DSV4-Router-Token is not this server's --router-token-file token"
                       : "this server takes PD fields only from its router (X-DSV4-Router-Token); send the request "
                         "through dsv4-router, or drop the field";
        case pd_trust::refused: break;
        }
        return "this server takes no PD fields from requests; start it with --router-token-file FILE (the file "
               "dsv4-router is given) or, behind a router you trust, --trust-pd-fields";
    }

    static void send_error(web::reply &res, int code, const std::string &status, const std::string &message) {
        if (code == 429 || code == 503) res.header("Retry-After", "1");
        res.send(code, "application/json", error_json(code, status, message).dump());
    }

    // Runs a request's handler, its refusals as HTTP errors. New generations are refused while
    // draining (`generation`); aborts are not.
    template <typename F>
    void guarded(web::reply &res, F &&f, bool generation = true) {
        if (generation && draining_.load()) {
            send_error(res, 503, "DSV4_ERR_SHUTDOWN", "the server is shutting down (SIGTERM): send the request elsewhere");
            return;
        }
        in_flight_.fetch_add(1);
        try {
            f();
        } catch (const dsv4::error &e) {
            send_error(res, http_status(e.status()), e.status_name(), e.what());
        } catch (const bad_request &e) {
            send_error(res, e.code, e.code == 413 ? "DSV4_ERR_CAPACITY" : "DSV4_ERR_INVALID_ARGUMENT", e.what());
        } catch (const json::exception &e) {
            send_error(res, 400, "DSV4_ERR_INVALID_ARGUMENT", std::string("the body is not valid JSON: ") + e.what());
        }
        in_flight_.fetch_sub(1);
    }

    // The body as a JSON object: UTF-8 checked first (the 400 names the first bad byte, and no
    // message quotes it: JSON output cannot hold it).
    static json body(const web::request &req) {
        const size_t bad = web::utf8_error_offset(req.body);
        if (bad != std::string::npos)
            throw bad_request("the body is not valid UTF-8: byte " + std::to_string(bad) + " (0x" + hex(req.body[bad]) +
                              ") starts no valid sequence");
        json j = json::parse(req.body);
        if (!j.is_object()) throw bad_request("the body must be a JSON object");
        return j;
    }

    static std::string hex(char c) {
        char buf[4];
        std::snprintf(buf, sizeof(buf), "%02x", static_cast<unsigned char>(c));
        return buf;
    }

    // POST /generate (SGLang): {"input_ids" | "text", "sampling_params", "stream",
    // "bootstrap_room", "bootstrap_host" + "bootstrap_port" (or "pd_peer"), "rid"}.
    void generate(const web::request &http_req, web::reply &res) {
        const json j = body(http_req);
        refuse_pd_fields(j, why_untrusted(http_req));
        const json sp = j.value("sampling_params", json::object());
        if (!sp.is_object()) throw bad_request("sampling_params must be an object");
        refuse_unsupported(j, "the request");
        refuse_unsupported(sp, "sampling_params");
        sampling s = sampling_of(sp, limits_, {"max_new_tokens"});
        std::vector<int32_t> prompt;
        if (!absent(j, "input_ids")) {
            prompt = ids_of(j["input_ids"], "input_ids", limits_);
        } else if (!absent(j, "text")) {
            prompt = engine_.tokenize(text_of(j["text"], "text", limits_), true);
        } else {
            throw bad_request("pass input_ids (token ids) or text");
        }
        answer(j, std::move(prompt), s, res, api::sglang);
    }

    // OpenAI chat messages, bounded in count and bytes before the template renders them.
    json messages_of(const json &j) const {
        if (absent(j, "messages") || !j["messages"].is_array())
            throw bad_request("messages must be a list of {role, content}");
        const json &m = j["messages"];
        if (m.size() > limits_.max_messages)
            throw bad_request("messages holds " + std::to_string(m.size()) + " messages; at most " +
                                  std::to_string(limits_.max_messages) + " are accepted (--max-messages)",
                              413);
        size_t bytes = 0;
        json out = json::array();
        for (const json &msg : m) {
            if (!msg.is_object()) throw bad_request("each message must be an object {role, content}");
            json copy = msg;
            auto c = copy.find("content");
            // OpenAI's content parts: the text parts joined by newlines (as vLLM and SGLang
            // join them); a part of another kind (an image) is refused by name.
            if (c != copy.end() && c->is_array()) {
                std::string text;
                for (const json &part : *c) {
                    const std::string kind = part.is_object() ? part.value("type", std::string()) : std::string();
                    if (kind != "text" || !part.contains("text") || !part["text"].is_string())
                        throw bad_request("a content part of type \"" + kind +
                                          "\" is not supported: send text parts ({\"type\": \"text\", \"text\": ...})");
                    if (!text.empty()) text += "\n";
                    text += part["text"].get<std::string>();
                    if (text.size() > limits_.max_text_bytes) break;  // refused below
                }
                *c = text;
            }
            if (c != copy.end() && c->is_string()) bytes += c->get_ref<const std::string &>().size();
            out.push_back(std::move(copy));
        }
        if (bytes > limits_.max_text_bytes)
            throw bad_request("the messages' contents are " + std::to_string(bytes) + " bytes; at most " +
                                  std::to_string(limits_.max_text_bytes) + " are rendered (--max-text-bytes)",
                              413);
        return out;
    }

    // POST /v1/completions and /v1/chat/completions.
    void openai(const web::request &http_req, web::reply &res, bool chat) {
        const json j = body(http_req);
        refuse_pd_fields(j, why_untrusted(http_req));
        refuse_unsupported(j, "the request");
        sampling s = chat ? sampling_of(j, limits_, {"max_completion_tokens", "max_tokens"})
                          : sampling_of(j, limits_, {"max_tokens"});
        std::vector<int32_t> prompt;
        if (chat) {
            const json messages = messages_of(j);
            // The template writes the BOS token itself.
            const std::string text = engine_.chat_apply(messages.dump(), true);
            prompt = engine_.tokenize(bounded_text(text, "the rendered chat", limits_), false);
        } else {
            const json p = j.value("prompt", json());
            if (p.is_string()) prompt = engine_.tokenize(text_of(p, "prompt", limits_), true);
            else if (p.is_array()) prompt = ids_of(p, "prompt", limits_);
            else throw bad_request("prompt must be a string or a list of token ids");
        }
        answer(j, std::move(prompt), s, res, chat ? api::chat : api::completions);
    }

    // What a router needs to know about this server (GET /server_info, /get_server_info).
    void server_info(const web::request &req, web::reply &res) {
        const json params = json::parse(engine_.params_resolved());
        const char *trust_names[] = {"refused", "router_token", "trusted"};
        json out = {{"version", dsv4::version()},
                    {"role", params.value("role", std::string("unified"))},
                    {"model", json::parse(engine_.model_info())},
                    {"params", params},
                    {"pd_fields", trust_names[static_cast<int>(trust_)]},
                    {"served_model_name", model_name_}};
        if (req.has(serve::kRouterTokenHeader)) out["router_token"] = token_matches(req) ? "accepted" : "rejected";
        if (out["role"] != "unified") {
            const std::string endpoint = engine_.pd_endpoint();  // tcp://host:port
            out["pd_endpoint"] = endpoint;
            const size_t colon = endpoint.rfind(':');
            out["bootstrap_host"] = endpoint.substr(6, colon - 6);
            out["bootstrap_port"] = std::stoi(endpoint.substr(colon + 1));
        }
        res.send(200, "application/json", out.dump());
    }

    // A request from its prompt, sampling and the body's routing fields and "stream".
    void answer(const json &j, std::vector<int32_t> prompt, const sampling &s, web::reply &res, api a) {
        job jb;
        jb.prompt_tokens = static_cast<uint32_t>(prompt.size());
        jb.request = build(engine_, std::move(prompt), s);
        routing_fields(j, jb, prefill_);
        jb.stream = bool_field(j, "stream", false);
        if (!absent(j, "stream_options")) {
            const json &so = j["stream_options"];
            if (!so.is_object()) throw bad_request("stream_options must be an object {\"include_usage\": bool}");
            jb.include_usage = bool_field(so, "include_usage", false);
        }
        run(std::move(jb), res, a);
    }

    // What one finished (or streamed) request reports.
    struct outcome {
        std::vector<int32_t> ids;
        std::string text;
        dsv4::event last;
        std::time_t created = std::time(nullptr);  // OpenAI's `created`, the same on every chunk
    };

    json final_json(api a, const outcome &o, const std::string &id) const {
        if (a == api::sglang) {
            json meta = {{"prompt_tokens", o.last.prompt_tokens},
                         {"completion_tokens", o.ids.size()},
                         {"cached_tokens", o.last.cached_tokens_device + o.last.cached_tokens_host},
                         {"finish_reason", {{"type", dsv4::finish_reason_name(o.last.finish_reason)}}},
                         {"id", id}};
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
                {"created", o.created},
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

    // An OpenAI stream chunk of request `id` with `choices`.
    json chunk_json(api a, const outcome &o, const std::string &id, json choices) const {
        return {{"id", id},
                {"object", a == api::chat ? "chat.completion.chunk" : "text_completion"},
                {"created", o.created},
                {"model", model_name_},
                {"choices", std::move(choices)}};
    }

    // A stream's last events: SGLang's final answer, or OpenAI's chunk with the finish reason
    // and, with stream_options.include_usage, a chunk of its own with the usage and no
    // choices (as OpenAI sends it); then [DONE].
    std::string last_events(api a, const outcome &o, const std::string &id, bool include_usage) const {
        if (a == api::sglang) return sse(final_json(a, o, id)) + "data: [DONE]\n\n";
        json choice = {{"index", 0}, {"finish_reason", openai_finish(o.last.finish_reason)}};
        if (a == api::chat) choice["delta"] = json::object();
        else choice["text"] = "";
        std::string out = sse(chunk_json(a, o, id, json::array({choice})));
        if (include_usage) {
            json usage = chunk_json(a, o, id, json::array());
            usage["usage"] = final_json(api::completions, o, id)["usage"];
            out += sse(usage);
        }
        return out + "data: [DONE]\n\n";
    }

    // A request whose rid was aborted before it came: answered as aborted, never submitted (a
    // PD decode's half must not claim its room).
    void answer_aborted(const job &jb, web::reply &res, api a) {
        outcome o;
        o.last.kind = dsv4::event_kind::finished;
        o.last.finish_reason = dsv4::finish_reason::aborted;
        o.last.prompt_tokens = jb.prompt_tokens;
        const std::string id = "cmpl-aborted";
        if (!jb.stream) {
            res.send(200, "application/json", final_json(a, o, id).dump());
            return;
        }
        res.header("Cache-Control", "no-cache");
        res.send(200, "text/event-stream", last_events(a, o, id, jb.include_usage));
    }

    // One token event into `o`: the piece of text it completes.
    std::string take_token(outcome &o, dsv4::detokenizer *detok, const dsv4::event &e) const {
        o.ids.push_back(e.token);
        std::string piece = detok ? detok->feed(e.token) : "";
        o.text += piece;
        return piece;
    }

    void run(job jb, web::reply &res, api a) {
        if (!jb.rid.empty() && rids_.aborted_before(jb.rid)) {
            answer_aborted(jb, res, a);
            return;
        }
        dsv4::stream stream = engine_.submit(jb.request);
        // OpenAI's prefixes: chat completions' ids begin chatcmpl-, completions' cmpl-.
        const std::string id = (a == api::chat ? "chatcmpl-" : "cmpl-") + std::to_string(stream.id());
        std::unique_ptr<rid_entry> rid;
        if (!jb.rid.empty()) {
            switch (rids_.add(jb.rid, stream.id())) {
            case rid_registry::added::ok: rid = std::make_unique<rid_entry>(rids_, jb.rid); break;
            case rid_registry::added::aborted_early: stream.abort(); break;  // between the check and the submit
            case rid_registry::added::in_flight:
                stream.abort();
                throw bad_request("rid " + jb.rid + " is already in flight: pick another");
            }
        }
        std::unique_ptr<dsv4::detokenizer> detok;
        if (has_tokenizer_) detok = std::make_unique<dsv4::detokenizer>(engine_);
        outcome o;
        if (!jb.stream) {
            // The events as they come, and every 100 ms a look at the client: one that left
            // aborts its request (nothing would read its answer).
            auto look = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
            bool aborted = false;
            while (true) {
                std::optional<dsv4::event> e = stream.next_for(std::chrono::milliseconds(100));
                if (!aborted && std::chrono::steady_clock::now() >= look) {
                    look += std::chrono::milliseconds(100);
                    if (res.client_gone()) {
                        stream.abort();
                        aborted = true;
                    }
                }
                if (!e) {
                    if (stream.done()) break;
                    continue;
                }
                if (e->kind == dsv4::event_kind::token) take_token(o, detok.get(), *e);
                else o.last = *e;
            }
            if (o.last.kind == dsv4::event_kind::error) {
                send_error(res, http_status(o.last.status), dsv4_status_name(static_cast<int32_t>(o.last.status)),
                           o.last.message);
                return;
            }
            res.send(200, "application/json", final_json(a, o, id).dump());
            return;
        }
        // Server-sent events: one per token (SGLang: the text and ids so far; OpenAI: the
        // piece), the final one with the finish reason, then [DONE]. A write that fails (the
        // client went away, or stopped reading for the write timeout) aborts the request.
        res.header("Cache-Control", "no-cache");
        // OpenAI's chat stream opens with the assistant's role.
        const std::string opening =
            a == api::chat ? sse(chunk_json(a, o, id, json::array({{{"index", 0},
                                                                    {"delta", {{"role", "assistant"}, {"content", ""}}},
                                                                    {"finish_reason", nullptr}}})))
                           : std::string();
        if (!res.begin(200, "text/event-stream") || (!opening.empty() && !res.write(opening))) {
            stream.abort();
            while (stream.next()) {
            }
            return;
        }
        while (std::optional<dsv4::event> e = stream.next()) {
            std::string chunk;
            if (e->kind == dsv4::event_kind::token) {
                const std::string piece = take_token(o, detok.get(), *e);
                if (a == api::sglang) {
                    json out = {{"output_ids", o.ids},
                                {"meta_info", {{"completion_tokens", o.ids.size()}, {"finish_reason", nullptr}}}};
                    if (detok) out["text"] = o.text;
                    chunk = sse(out);
                } else if (piece.empty()) {
                    continue;  // a character not complete yet: OpenAI sends no empty pieces
                } else {
                    json delta = a == api::chat ? json{{"index", 0}, {"delta", {{"content", piece}}}, {"finish_reason", nullptr}}
                                                : json{{"index", 0}, {"text", piece}, {"finish_reason", nullptr}};
                    chunk = sse(chunk_json(a, o, id, json::array({delta})));
                }
            } else {
                o.last = *e;
                chunk = e->kind == dsv4::event_kind::error ? sse(error_chunk(a, o)) + "data: [DONE]\n\n"
                                                           : last_events(a, o, id, jb.include_usage);
            }
            if (!res.write(chunk)) {
                stream.abort();  // gone; the remaining events are drained by the stream's end
                while (stream.next()) {
                }
                return;
            }
        }
        res.end();
    }

    dsv4::engine &engine_;
    const pd_trust trust_;
    const std::string router_token_;
    const std::time_t started_ = std::time(nullptr);
    field_limits limits_;
    rid_registry rids_;
    std::atomic<int> in_flight_{0};
    std::atomic<bool> draining_{false};
    bool has_tokenizer_ = false;
    bool prefill_ = false;  // the engine's role is prefill
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
    "usage: dsv4-server --params FILE [--host H] [--port P]\n"
    "                   [--router-token-file FILE | --trust-pd-fields] [limits: see --help]\n";

const char *kHelp =
    "dsv4-server: one dsv4 engine behind HTTP (SGLang's /generate, OpenAI's /v1/completions and\n"
    "/v1/chat/completions, /health, /metrics, /server_info, /v1/models, /abort_request, and SGLang's\n"
    "/model_info, /get_model_info, /get_server_info).\n\n"
    "  --params FILE            the engine's params (JSON, docs/params.md); a relative model_path\n"
    "                           is looked up next to FILE first, then in the working directory\n"
    "  --host H                 address to listen on (127.0.0.1)\n"
    "  --port P                 port (30000; 0 picks a free one, named on the \"listening\" line)\n"
    "  --router-token-file FILE honour PD routing fields (bootstrap_room/host/port, pd_room,\n"
    "                           pd_peer) from requests whose X-DSV4-Router-Token header holds the\n"
    "                           token in FILE: give dsv4-router the same file\n"
    "  --trust-pd-fields        honour PD routing fields from every request (only behind a router\n"
    "                           that strips them from its clients, such as SGLang's)\n"
    "  --served-model-name NAME the model's id in /v1/models, responses and /model_info (the\n"
    "                           checkpoint's name)\n"
    SERVE_LIMITS_HELP
    "  --max-body-bytes N       a request body (16 x the context's tokens, at least 1 MiB)\n"
    "  --max-text-bytes N       a text to tokenize or chat to render (8 x the context's tokens)\n"
    "  --max-messages N         messages of a chat (4096)\n"
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
    std::string params_path, host = "127.0.0.1", token_file, served_model_name;
    int port = 30000;
    bool trust_pd_fields = false;
    web::limits limits;
    size_t max_body = 0, max_text = 0, max_messages = 4096;
    serve::flags flags;
    serve::limit_flags(flags, limits);
    flags.size("--max-body-bytes", max_body);
    flags.size("--max-text-bytes", max_text);
    flags.size("--max-messages", max_messages);
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
        const std::string v = argv[++i];
        if (a == "--params") params_path = v;
        else if (a == "--host") host = v;
        else if (a == "--port") port = std::atoi(v.c_str());
        else if (a == "--router-token-file") token_file = v;
        else if (a == "--served-model-name") served_model_name = v;
        else if (a == "--http-threads") flags.set("--max-connections", v);  // the name before the limits had flags
        else if (!flags.known(a)) return usage("unknown option " + a);
        else if (std::string why = flags.set(a, v); !why.empty()) return usage(why);
    }
    if (params_path.empty()) return usage("--params is required");
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");
    if (trust_pd_fields && !token_file.empty())
        return usage("--trust-pd-fields and --router-token-file exclude each other: the first trusts every request");

    // SIGTERM and SIGINT are taken by a thread of their own, so they are blocked in every
    // thread, the engine's and the HTTP connections' included: block them before any starts.
    const sigset_t signals = serve::block_stop_signals();
    // A connection each, plus the engine's own (PD links, the checkpoint's files).
    serve::raise_open_files_limit("dsv4-server", static_cast<rlim_t>(limits.max_connections) + 256);

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
        server routes(engine, trust, token, max_text, max_messages, served_model_name);
        limits.max_body_bytes =
            max_body ? max_body : std::max<size_t>(1 << 20, static_cast<size_t>(routes.limits().context) * 16);
        web::server http(limits);
        routes.routes(http);
        std::string error;
        const int bound = http.bind(host, port, serve::listen_backlog(), error);
        if (bound < 0) {
            std::fprintf(stderr, "dsv4-server: %s\n", error.c_str());
            return 1;
        }
        // The line a supervisor (or a test) waits for.
        std::printf("dsv4-server: listening on http://%s:%d\n", host.c_str(), bound);
        std::fflush(stdout);
        serve::until_signal(http, signals, "dsv4-server", [&] { routes.refuse_new(); }, [&] {
            try {
                engine.shutdown(dsv4::shutdown_mode::drain);  // new requests get 503 meanwhile
            } catch (const dsv4::error &e) {
                std::fprintf(stderr, "dsv4-server: drain failed: %s\n", e.what());
            }
            if (!routes.wait_requests(std::chrono::seconds(30)))
                std::fprintf(stderr, "dsv4-server: requests still open 30 s after the drain; stopping anyway\n");
        });
        if (!http.wait_connections(std::chrono::seconds(5)))
            std::fprintf(stderr, "dsv4-server: connections still open 5 s after the listener stopped\n");
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
