// dsv4.hpp — a header-only C++17 wrapper over dsv4.h: exceptions instead of status codes,
// std::string instead of (buf, cap, needed), an RAII engine. Installed next to dsv4.h.
#ifndef DSV4_HPP
#define DSV4_HPP

#include <dsv4.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace dsv4 {

// A failed dsv4 call: what() is dsv4_last_error(), status() the DSV4_ERR_* code.
class error : public std::runtime_error {
public:
    error(dsv4_status status, const char *message)
        : std::runtime_error(message), status_(status) {}
    dsv4_status status() const noexcept { return status_; }
    const char *status_name() const noexcept { return dsv4_status_name(status_); }

private:
    dsv4_status status_;
};

inline void check(dsv4_status status) {
    if (status != DSV4_OK) throw error(status, dsv4_last_error());
}

namespace detail {
// Calls a (buf, cap, needed) function until its output fits (reports with live readings can
// grow between the size query and the call that fills the buffer).
template <typename Call>
std::string read_text(Call call) {
    size_t needed = 0;
    check(call(nullptr, 0, &needed));
    for (;;) {
        std::string out(needed, '\0');
        dsv4_status status = call(out.data(), out.size(), &needed);
        if (status == DSV4_ERR_BUFFER_TOO_SMALL) continue;
        check(status);
        out.resize(needed - 1);
        return out;
    }
}
}  // namespace detail

inline const char *version() noexcept { return dsv4_version(); }

// The full default params document (JSON).
inline std::string default_params() {
    return detail::read_text(
        [](char *buf, size_t cap, size_t *needed) { return dsv4_params_default(buf, cap, needed); });
}

// Validates params JSON and returns the resolved document; throws dsv4::error listing every
// problem otherwise.
inline std::string validate_params(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_params_validate(params_json.c_str(), buf, cap, needed);
    });
}

// The memory plan as JSON.
inline std::string plan(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_plan(params_json.c_str(), buf, cap, needed);
    });
}

// The memory plan as a table.
inline std::string plan_text(const std::string &params_json) {
    return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
        return dsv4_plan_text(params_json.c_str(), buf, cap, needed);
    });
}

// The name of a DSV4_FINISH_* value ("stop", "length", ...; "unknown" for other values).
inline const char *finish_reason_name(int32_t reason) noexcept {
    return dsv4_finish_reason_name(reason);
}

// DSV4_STATE_*: where an engine stands (engine::state).
enum class state : int32_t {
    loading = DSV4_STATE_LOADING,  // never reported by an engine handle (it exists once loaded)
    ready = DSV4_STATE_READY,
    draining = DSV4_STATE_DRAINING,
    stopped = DSV4_STATE_STOPPED,
    failed = DSV4_STATE_FAILED,
};

// A state and the sentence that explains it (for a health endpoint or a log).
struct engine_state {
    dsv4::state state;
    std::string reason;
};

// A request with the library's defaults (struct_size set); fill in the fields you need
// (sampling, stop_tokens, cache_salt, ...; pd_room and pd_peer for prefill / decode engines, see
// engine::pd_endpoint). The pointers it holds (prompt, stop_tokens, logit biases, cache_salt,
// pd_peer) are read during engine::submit only.
inline dsv4_request request(const std::vector<int32_t> &prompt) {
    dsv4_request r;
    check(dsv4_request_init(&r, sizeof r));
    r.prompt = prompt.data();
    r.prompt_len = prompt.size();
    return r;
}

// An engine (RAII, move-only). Thread-safe like the handle it wraps; the destructor aborts what
// is in flight and joins the engine's threads (see dsv4_engine_destroy).
class engine {
public:
    explicit engine(const std::string &params_json) {
        check(dsv4_engine_create(params_json.c_str(), &handle_));
    }
    engine(engine &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    engine &operator=(engine &&other) noexcept {
        if (this != &other) {
            dsv4_engine_destroy(handle_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }
    engine(const engine &) = delete;
    engine &operator=(const engine &) = delete;
    ~engine() { dsv4_engine_destroy(handle_); }

    dsv4_engine *get() const noexcept { return handle_; }

    // Accepted → the request id; refused → dsv4::error (DSV4_ERR_QUEUE_FULL, _CAPACITY, ...).
    uint64_t submit(const dsv4_request &r) const {
        uint64_t id = 0;
        check(dsv4_submit(handle_, &r, &id));
        return id;
    }

    // Up to `max` events, waiting up to `timeout_ms` (-1: until one arrives) for the first.
    std::vector<dsv4_event> poll(size_t max, int32_t timeout_ms) const {
        std::vector<dsv4_event> out(max == 0 ? 1 : max);
        out[0].struct_size = sizeof(dsv4_event);
        size_t n = 0;
        check(dsv4_poll(handle_, out.data(), out.size(), &n, timeout_ms));
        out.resize(n);
        return out;
    }

    void abort(uint64_t request_id) const { check(dsv4_abort(handle_, request_id)); }

    void shutdown(int32_t mode = DSV4_SHUTDOWN_DRAIN, int32_t timeout_ms = -1) const {
        check(dsv4_engine_shutdown(handle_, mode, timeout_ms));
    }

    // Logits of every position of one fresh sequence, [tokens.size(), vocab] row-major.
    std::vector<float> score(const std::vector<int32_t> &tokens, size_t vocab) const {
        std::vector<float> out(tokens.size() * vocab);
        check(dsv4_score(handle_, tokens.data(), tokens.size(), out.data(), out.size()));
        return out;
    }

    // Where the engine stands and why; also on a shut-down or failed engine. Never blocks.
    engine_state state() const {
        int32_t code = -1;
        std::string reason = detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_engine_state(handle_, &code, buf, cap, needed);
        });
        return {static_cast<dsv4::state>(code), std::move(reason)};
    }

    // The params this engine runs with, every default filled in (JSON).
    std::string params_resolved() const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_params_resolved(handle_, buf, cap, needed);
        });
    }

    // JSON: configuration, parameter count, resident bytes, and the facts a server needs
    // (vocab_size, bos_token_id, eos_token_ids, context_limit, has_tokenizer,
    // has_chat_template).
    std::string model_info() const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_model_info(handle_, buf, cap, needed);
        });
    }

    // The address PD peers reach this engine at, "tcp://host:port" (pd.advertise, else the
    // address pd.listen bound): a prefill engine's endpoint is what decode requests carry as
    // dsv4_request.pd_peer. Throws DSV4_ERR_INVALID_ARGUMENT in the unified role, which has
    // none.
    std::string pd_endpoint() const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_pd_endpoint(handle_, buf, cap, needed);
        });
    }

    // Counters, latency sums and gauges (struct dsv4_metrics, this header's version).
    dsv4_metrics metrics() const {
        dsv4_metrics m{};
        m.struct_size = sizeof m;
        check(dsv4_metrics_get(handle_, &m));
        return m;
    }

    // The Prometheus text exposition (serve as text/plain; version=0.0.4).
    std::string prometheus() const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_metrics_prometheus(handle_, buf, cap, needed);
        });
    }

private:
    dsv4_engine *handle_ = nullptr;
};

}  // namespace dsv4

#endif  // DSV4_HPP
