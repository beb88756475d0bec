// dsv4-server: one dsv4 engine behind HTTP, on the C++ wrapper (bindings/cpp/dsv4.hpp).
//
//   dsv4-server --params FILE [--host 127.0.0.1] [--port 30000]
//
// GET  /health                200 when the engine is READY, 503 otherwise; {"state", "reason"}
// GET  /metrics               the Prometheus exposition (text/plain; version=0.0.4)
// GET  /server_info           version, role, model facts, resolved params, PD endpoint
// POST /generate              SGLang's native API: input_ids or text, sampling_params, stream
// POST /v1/completions        OpenAI completions: prompt as text or token ids, SSE streaming
// POST /v1/chat/completions   OpenAI chat: messages through the checkpoint's chat template
// POST /abort_request         {"rid"}: aborts the request submitted with that "rid"
//
// Refusals map to HTTP: QUEUE_FULL 429 (with Retry-After), CAPACITY 413, INVALID_ARGUMENT 400,
// UNSUPPORTED 400 (e.g. text on a checkpoint without a tokenizer), SHUTDOWN 503, others 500;
// the body is {"error": {"message", "status", "code"}} with the library's message. A streaming
// client that disconnects aborts its request at the next token. SIGTERM or SIGINT drains: the
// health check turns 503 and new requests are refused while those in flight finish, then the
// server exits 0. docs/serving.md has the details.
#include <dsv4.hpp>

#include <httplib.h>
#include <nlohmann/json.hpp>

#include "../http/serve.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <cstdio>
#include <cstdlib>
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

// The PD and request-id fields every generation API takes (SGLang's names): "bootstrap_room",
// the prefill's endpoint as "bootstrap_host" + "bootstrap_port" (or "pd_peer",
// tcp://host:port), and "rid", the caller's id for POST /abort_request.
void routing_fields(const json &j, job &jb) {
    if (j.contains("bootstrap_room")) jb.request.pd_room(field<uint64_t>(j, "bootstrap_room", 0));
    if (j.contains("pd_peer")) {
        jb.request.pd_peer(field<std::string>(j, "pd_peer", ""));
    } else if (j.contains("bootstrap_host")) {
        jb.request.pd_peer("tcp://" + field<std::string>(j, "bootstrap_host", "") + ":" +
                           std::to_string(field<int>(j, "bootstrap_port", 0)));
    }
    jb.rid = field<std::string>(j, "rid", "");
    if (jb.rid.size() > 256) throw bad_request("rid is longer than 256 bytes: use a shorter id");
}

// Requests by their caller's "rid", so POST /abort_request can reach them. An abort may arrive
// before its request (a router aborts the decode's half when the prefill refuses, and the two
// race): such a rid is remembered for a minute and its request is answered as aborted without
// running. Rids that ended recently are remembered too, so a late abort of one (a router's,
// after its request finished) is not taken for an early one.
class rid_registry {
public:
    // True (and forgotten) when `rid` was aborted before its request came.
    bool aborted_before(const std::string &rid) {
        std::lock_guard<std::mutex> lock(mu_);
        return early_.erase(rid) > 0;
    }

    // Registers a submitted request; false when the rid was aborted meanwhile (the caller
    // aborts the request then).
    bool add(const std::string &rid, uint64_t id) {
        std::lock_guard<std::mutex> lock(mu_);
        if (early_.erase(rid)) return false;
        if (!live_.emplace(rid, id).second) throw bad_request("rid " + rid + " is already in flight: pick another");
        return true;
    }

    void remove(const std::string &rid) {
        std::lock_guard<std::mutex> lock(mu_);
        live_.erase(rid);
        remember(ended_, rid);
    }

    // The request's id, or nothing (then the rid is remembered as aborted early, unless its
    // request already ended).
    std::optional<uint64_t> take_for_abort(const std::string &rid) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = live_.find(rid);
        if (it != live_.end()) return it->second;
        if (!ended_.count(rid)) remember(early_, rid);
        return std::nullopt;
    }

private:
    using clock = std::chrono::steady_clock;
    using recent = std::unordered_map<std::string, clock::time_point>;
    static constexpr size_t kMax = 4096;

    // Adds `rid` to `set`, dropping what is older than a minute and, when still full, the
    // oldest entry (never the new one).
    static void remember(recent &set, const std::string &rid) {
        const auto now = clock::now();
        for (auto it = set.begin(); it != set.end();) it = now - it->second > std::chrono::seconds(60) ? set.erase(it) : std::next(it);
        if (set.size() >= kMax) {
            auto oldest = std::min_element(set.begin(), set.end(),
                                           [](const auto &a, const auto &b) { return a.second < b.second; });
            set.erase(oldest);
        }
        set[rid] = now;
    }

    std::mutex mu_;
    std::unordered_map<std::string, uint64_t> live_;
    recent early_, ended_;
};

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
    server(dsv4::engine &engine) : engine_(engine) {
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
        http.Get("/server_info", [this](const httplib::Request &, httplib::Response &res) {
            const json params = json::parse(engine_.params_resolved());
            json out = {{"version", dsv4::version()},
                        {"role", params.value("role", std::string("unified"))},
                        {"model", json::parse(engine_.model_info())},
                        {"params", params}};
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
        serve(j, std::move(prompt), s, res, api::sglang);
    }

    // POST /v1/completions and /v1/chat/completions.
    void openai(const httplib::Request &http_req, httplib::Response &res, bool chat) {
        const json j = body(http_req);
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
        serve(j, std::move(prompt), s, res, chat ? api::chat : api::completions);
    }

    // A request from its prompt, sampling and the body's routing fields and "stream".
    void serve(const json &j, std::vector<int32_t> prompt, const sampling &s, httplib::Response &res, api a) {
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

    // Keeps a request's rid registered while its answer is being produced.
    struct rid_entry {
        rid_entry(rid_registry &registry, std::string rid) : registry(registry), rid(std::move(rid)) {}
        rid_entry(const rid_entry &) = delete;
        rid_entry &operator=(const rid_entry &) = delete;
        ~rid_entry() { registry.remove(rid); }
        rid_registry &registry;
        std::string rid;
    };

    // A request whose rid was aborted before it came: answered as aborted, never submitted (a
    // PD decode's half must not claim its room).
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
            bool fresh;
            try {
                fresh = rids_.add(jb.rid, stream->id());
            } catch (...) {
                stream->abort();
                throw;
            }
            if (fresh) rid = std::make_shared<rid_entry>(rids_, jb.rid);
            else stream->abort();  // aborted between the check above and the submit
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
                        chunk = sse(error_json(http_status(e->status),
                                               dsv4_status_name(static_cast<int32_t>(e->status)), e->message));
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
    rid_registry rids_;
    serve::streams streams_;
    bool has_tokenizer_ = false;
    std::string model_name_;
};

std::string read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot read --params " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

int usage(const char *why) {
    std::fprintf(stderr, "dsv4-server: %s\nusage: dsv4-server --params FILE [--host H] [--port P] [--http-threads N]\n", why);
    return 2;
}

}  // namespace

int main(int argc, char **argv) {
    std::string params_path, host = "127.0.0.1";
    int port = 30000, threads = 0;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (i + 1 >= argc) return usage(("missing the value of " + a).c_str());
        if (a == "--params") params_path = argv[++i];
        else if (a == "--host") host = argv[++i];
        else if (a == "--port") port = std::atoi(argv[++i]);
        else if (a == "--http-threads") threads = std::atoi(argv[++i]);
        else return usage(("unknown option " + a).c_str());
    }
    if (params_path.empty()) return usage("--params is required");
    if (port < 0 || port > 65535) return usage("--port must be 0..65535");

    // SIGTERM and SIGINT are taken by a thread of their own, so they are blocked in every
    // thread, the engine's and the HTTP pool's included: block them before any starts.
    const sigset_t signals = serve::block_stop_signals();

    try {
        dsv4::engine engine(read_file(params_path));
        server routes(engine);
        httplib::Server http;
        // A connection holds a thread for its request's length (a stream for all of it), so the
        // pool covers every request admission control lets in, running or queued, with room to
        // answer the rest: a burst past the queue gets its 429 at once instead of waiting unseen
        // in httplib's own queue (its default pool is 8 threads).
        if (threads <= 0) {
            const json p = json::parse(engine.params_resolved());
            const int64_t want = p["kv"].value("max_running_requests", int64_t{32}) +
                                 p["admission"].value("max_queued_requests", int64_t{256}) + 16;
            // httplib starts every thread up front: a huge queue gets 4096 (the rest wait in
            // httplib's queue; --http-threads sets more).
            threads = static_cast<int>(std::min<int64_t>(want, 4096));
        }
        http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
        routes.routes(http);
        const int bound = serve::bind(http, "dsv4-server", host, port);
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
