// dsv4.hpp — a header-only C++17 wrapper over dsv4.h: exceptions instead of status codes,
// std::string instead of (buf, cap, needed), enums instead of raw ints, an RAII engine, a
// request that owns its buffers, and per-request streams fed by one poller thread (the router).
// Installed next to dsv4.h.
#ifndef DSV4_HPP
#define DSV4_HPP

#include <dsv4.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dsv4 {

// DSV4_OK and DSV4_ERR_*.
enum class status : int32_t {
    ok = DSV4_OK,
    invalid_argument = DSV4_ERR_INVALID_ARGUMENT,
    config = DSV4_ERR_CONFIG,
    io = DSV4_ERR_IO,
    model_format = DSV4_ERR_MODEL_FORMAT,
    capacity = DSV4_ERR_CAPACITY,
    queue_full = DSV4_ERR_QUEUE_FULL,
    timeout = DSV4_ERR_TIMEOUT,
    aborted = DSV4_ERR_ABORTED,
    kv_transfer = DSV4_ERR_KV_TRANSFER,
    buffer_too_small = DSV4_ERR_BUFFER_TOO_SMALL,
    unsupported = DSV4_ERR_UNSUPPORTED,
    shutdown = DSV4_ERR_SHUTDOWN,
    not_found = DSV4_ERR_NOT_FOUND,
    internal = DSV4_ERR_INTERNAL,
};

// "DSV4_ERR_CONFIG", ... ("DSV4_STATUS_UNKNOWN" for other values).
inline const char *status_name(status s) noexcept {
    return dsv4_status_name(static_cast<dsv4_status>(s));
}

// DSV4_EVENT_*.
enum class event_kind : int32_t {
    token = DSV4_EVENT_TOKEN,
    finished = DSV4_EVENT_FINISHED,
    error = DSV4_EVENT_ERROR,
};

// DSV4_FINISH_*.
enum class finish_reason : int32_t {
    none = DSV4_FINISH_NONE,
    length = DSV4_FINISH_LENGTH,
    stop = DSV4_FINISH_STOP,
    aborted = DSV4_FINISH_ABORTED,
    timeout = DSV4_FINISH_TIMEOUT,
    transferred = DSV4_FINISH_TRANSFERRED,
};

// DSV4_SHUTDOWN_*.
enum class shutdown_mode : int32_t {
    drain = DSV4_SHUTDOWN_DRAIN,
    abort = DSV4_SHUTDOWN_ABORT,
};

// DSV4_LOG_*.
enum class log_level : int32_t {
    off = DSV4_LOG_OFF,
    error = DSV4_LOG_ERROR,
    warn = DSV4_LOG_WARN,
    info = DSV4_LOG_INFO,
    debug = DSV4_LOG_DEBUG,
    trace = DSV4_LOG_TRACE,
};

// The tiers dsv4_cache_flush takes.
enum class cache_tier { device, host, all };

// A failed dsv4 call: what() is dsv4_last_error() (or the event's message), status() the
// DSV4_ERR_* code as an enum, code() as the C int.
class error : public std::runtime_error {
public:
    error(dsv4_status code, const std::string &message)
        : std::runtime_error(message), code_(code) {}
    dsv4::status status() const noexcept { return static_cast<dsv4::status>(code_); }
    dsv4_status code() const noexcept { return code_; }
    const char *status_name() const noexcept { return dsv4_status_name(code_); }

private:
    dsv4_status code_;
};

inline void check(dsv4_status code) {
    if (code != DSV4_OK) throw error(code, dsv4_last_error());
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
        dsv4_status code = call(out.data(), out.size(), &needed);
        if (code == DSV4_ERR_BUFFER_TOO_SMALL) continue;
        check(code);
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

// The name of a finish reason ("stop", "length", ...; "unknown" for other values).
inline const char *finish_reason_name(finish_reason reason) noexcept {
    return dsv4_finish_reason_name(static_cast<int32_t>(reason));
}
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

// --- log callback --------------------------------------------------------------------------

// Receives dsv4's log records: level, the Rust module that wrote it ("dsv4::plan"), message.
// Process-global; called from any dsv4 thread, possibly several at once: it must be thread-safe
// and return quickly. An exception it throws is swallowed (it cannot cross the C ABI).
using log_fn = std::function<void(log_level, const char *target, const char *message)>;

namespace detail {
struct log_slot {
    std::mutex mutex;  // serialises set_log_callback calls, which swap `current`
    log_fn *current = nullptr;
};
// Never destroyed: a dsv4 thread may still log during static destruction, and a slot that is
// still reachable at exit is not a leak.
inline log_slot &log_state() {
    static log_slot *slot = new log_slot;
    return *slot;
}
inline void log_trampoline(void *user_data, int32_t level, const char *target,
                           const char *message) {
    try {
        (*static_cast<log_fn *>(user_data))(static_cast<log_level>(level), target, message);
    } catch (...) {
        // Unwinding into the library is undefined behaviour; the record is lost instead.
    }
}
}  // namespace detail

// Sends records up to `max_level` to `callback` (an empty callback or log_level::off stops
// logging). When it returns the previous callback is no longer running, so it is freed here.
// Do not call it from inside a log callback (dsv4_set_log_callback would deadlock).
inline void set_log_callback(log_level max_level, log_fn callback) {
    detail::log_slot &slot = detail::log_state();
    std::lock_guard<std::mutex> lock(slot.mutex);
    std::unique_ptr<log_fn> next;
    if (callback && max_level != log_level::off) next = std::make_unique<log_fn>(std::move(callback));
    check(dsv4_set_log_callback(static_cast<int32_t>(max_level),
                                next ? &detail::log_trampoline : nullptr, next.get()));
    delete slot.current;  // no longer called: dsv4_set_log_callback has returned
    slot.current = next.release();
}
inline void clear_log_callback() { set_log_callback(log_level::off, nullptr); }

// --- events --------------------------------------------------------------------------------

// One event, owned (the C event's message is copied, so it outlives the next poll).
struct event {
    uint64_t request_id = 0;
    uint64_t user_tag = 0;
    event_kind kind = event_kind::error;
    int32_t token = -1;                        // token events
    float logprob = 0.0f;                      // token events of requests with logprobs
    dsv4::finish_reason finish_reason = dsv4::finish_reason::none;  // finished events
    dsv4::status status = dsv4::status::ok;   // error events
    std::string message;                       // error events: the cause and the fix
    uint32_t prompt_tokens = 0;
    uint32_t cached_tokens_device = 0;
    uint32_t cached_tokens_host = 0;
    uint32_t generated_tokens = 0;
    uint64_t queue_us = 0;
    uint64_t ttft_us = 0;
    uint64_t elapsed_us = 0;

    bool terminal() const noexcept { return kind != event_kind::token; }

    // Copies a C event; `message` is read only if the library wrote that far.
    static event from_c(const dsv4_event &e) {
        event out;
        out.request_id = e.request_id;
        out.user_tag = e.user_tag;
        out.kind = static_cast<event_kind>(e.kind);
        out.token = e.token;
        out.logprob = e.logprob;
        out.finish_reason = static_cast<dsv4::finish_reason>(e.finish_reason);
        out.status = static_cast<dsv4::status>(e.status);
        if (e.struct_size >= offsetof(dsv4_event, message) + sizeof e.message && e.message)
            out.message = e.message;
        out.prompt_tokens = e.prompt_tokens;
        out.cached_tokens_device = e.cached_tokens_device;
        out.cached_tokens_host = e.cached_tokens_host;
        out.generated_tokens = e.generated_tokens;
        out.queue_us = e.queue_us;
        out.ttft_us = e.ttft_us;
        out.elapsed_us = e.elapsed_us;
        return out;
    }
};

// Receives events in push mode (engine::set_event_callback) on the engine thread, one at a
// time. It must not throw and must not wait for the engine: engine::score, cache_stats,
// cache_flush, set_event_callback and shutdown throw dsv4::error(invalid_argument) there;
// submit, abort, metrics, state and model_info are fine.
using event_fn = std::function<void(const event &)>;

// --- requests ------------------------------------------------------------------------------

// A generation request that owns its buffers: the prompt, stop tokens and sequences, logit
// biases, cache salt and PD peer are copied in, so a request built from temporaries is safe
// to submit later, and copies are independent. Setters chain:
//   auto r = dsv4::request({5, 17, 300}).max_new_tokens(8).temperature(0).ignore_eos(true);
// Defaults are the library's (dsv4_request_init): 128 new tokens, temperature 1, top_p 1.
class request {
public:
    explicit request(std::vector<int32_t> prompt) : prompt_(std::move(prompt)) {
        check(dsv4_request_init(&defaults_, sizeof defaults_));
    }
    request(std::initializer_list<int32_t> prompt) : request(std::vector<int32_t>(prompt)) {}

    request &max_new_tokens(uint32_t n) { defaults_.max_new_tokens = n; return *this; }
    request &temperature(float t) { defaults_.temperature = t; return *this; }
    request &top_k(int32_t k) { defaults_.top_k = k; return *this; }
    request &top_p(float p) { defaults_.top_p = p; return *this; }
    request &min_p(float p) { defaults_.min_p = p; return *this; }
    request &seed(uint64_t s) { defaults_.seed = s; return *this; }
    request &priority(int32_t p) { defaults_.priority = p; return *this; }
    // From submit, covering waiting and running; 0 = none. Outside 0..UINT32_MAX ms it throws
    // invalid_argument rather than wrap around into a different deadline.
    request &deadline(std::chrono::milliseconds d) {
        if (d.count() < 0 || static_cast<unsigned long long>(d.count()) > UINT32_MAX)
            throw error(DSV4_ERR_INVALID_ARGUMENT,
                        "request deadline " + std::to_string(d.count()) +
                            " ms is outside 0..4294967295 ms (0 = none)");
        defaults_.deadline_ms = static_cast<uint32_t>(d.count());
        return *this;
    }
    request &user_tag(uint64_t tag) { defaults_.user_tag = tag; return *this; }
    request &logprobs(bool on) { defaults_.logprobs = on ? 1 : 0; return *this; }
    request &ignore_eos(bool on) { defaults_.ignore_eos = on ? 1 : 0; return *this; }
    request &stop_tokens(std::vector<int32_t> tokens) { stop_tokens_ = std::move(tokens); return *this; }
    // Each sequence ends the request once the generated tokens end with it.
    request &stop_sequences(std::vector<std::vector<int32_t>> sequences) {
        stop_flat_.clear();
        stop_lens_.clear();
        for (const auto &seq : sequences) {
            stop_flat_.insert(stop_flat_.end(), seq.begin(), seq.end());
            stop_lens_.push_back(seq.size());
        }
        return *this;
    }
    // Adds `value` to the logit of `token` before sampling (appends; a later call for the same
    // token is passed on as given).
    request &logit_bias(int32_t token, float value) {
        bias_tokens_.push_back(token);
        bias_values_.push_back(value);
        return *this;
    }
    // Requests share cached prefixes only with the same salt; std::nullopt = none.
    request &cache_salt(std::optional<std::string> salt) { cache_salt_ = std::move(salt); return *this; }
    // PD roles: the room (both engines) and, on a decode engine, the prefill's endpoint.
    request &pd_room(uint64_t room) { defaults_.pd_room = room; return *this; }
    request &pd_peer(std::optional<std::string> endpoint) { pd_peer_ = std::move(endpoint); return *this; }

    const std::vector<int32_t> &prompt() const noexcept { return prompt_; }

    // The C struct, its pointers into this request: valid while this request lives and is not
    // modified. Deleted on a temporary, whose buffers die at the end of the statement
    // (`dsv4_request r = dsv4::request(v).c_request();` does not compile).
    dsv4_request c_request() const & {
        dsv4_request r = defaults_;
        r.prompt = prompt_.data();
        r.prompt_len = prompt_.size();
        r.stop_tokens = stop_tokens_.empty() ? nullptr : stop_tokens_.data();
        r.stop_tokens_len = stop_tokens_.size();
        r.stop_sequences = stop_flat_.empty() ? nullptr : stop_flat_.data();
        r.stop_sequence_lens = stop_lens_.empty() ? nullptr : stop_lens_.data();
        r.stop_sequences_len = stop_lens_.size();
        r.logit_bias_tokens = bias_tokens_.empty() ? nullptr : bias_tokens_.data();
        r.logit_bias_values = bias_values_.empty() ? nullptr : bias_values_.data();
        r.logit_bias_len = bias_tokens_.size();
        r.cache_salt = cache_salt_ ? cache_salt_->c_str() : nullptr;
        r.pd_peer = pd_peer_ ? pd_peer_->c_str() : nullptr;
        return r;
    }
    dsv4_request c_request() const && = delete;

private:
    dsv4_request defaults_;  // scalar fields; its pointers are filled by c_request()
    std::vector<int32_t> prompt_;
    std::vector<int32_t> stop_tokens_;
    std::vector<int32_t> stop_flat_;
    std::vector<size_t> stop_lens_;
    std::vector<int32_t> bias_tokens_;
    std::vector<float> bias_values_;
    std::optional<std::string> cache_salt_;
    std::optional<std::string> pd_peer_;
};

// --- the router ----------------------------------------------------------------------------

namespace detail {

// One tracked request: a stream's queue, or the callback its events go to (engine::submit
// with a callback). Guarded by the router's mutex.
struct stream_queue {
    std::deque<event> events;
    bool terminal_queued = false;
    std::shared_ptr<const event_fn> callback;  // set: events go here, never to `events`
};

// An event and the callback to call with it once the router's lock is released.
using delivery = std::pair<std::shared_ptr<const event_fn>, event>;

// The one consumer of an engine's events: a poller thread (poll mode) or the event callback
// (push mode) routes each event by request id to the queue of the stream that waits for it;
// events of other requests (engine::submit_detached, or dsv4_submit on engine::get()) go to
// the general queue read by engine::poll, or to the host's event callback. Shared by the
// engine and its streams, so a stream may outlive its engine.
class router {
public:
    explicit router(dsv4_engine *handle) : handle_(handle) {
        poller_ = std::thread([this] { run(); });
    }

    // Submits under the routing lock, so no event can be routed before its queue exists.
    // `callback`: the tracked request's events go to it instead of a queue.
    uint64_t submit(const dsv4_request &r, bool tracked, event_fn callback = nullptr) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_) throw error(DSV4_ERR_SHUTDOWN, "the engine is destroyed");
        uint64_t id = 0;
        check(dsv4_submit(handle_, &r, &id));
        if (tracked) {
            stream_queue &q = streams_[id];
            if (callback) q.callback = std::make_shared<const event_fn>(std::move(callback));
        }
        return id;
    }

    // Next event of a tracked request; nullopt once its terminal event was taken, or when
    // `deadline` passes first (then `timed_out` is set).
    std::optional<event> next(uint64_t id, const std::chrono::steady_clock::time_point *deadline,
                              bool *timed_out) {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            auto it = streams_.find(id);
            if (it == streams_.end()) return std::nullopt;
            if (!it->second.events.empty()) {
                event e = std::move(it->second.events.front());
                it->second.events.pop_front();
                if (e.terminal()) streams_.erase(it);
                return e;
            }
            if (deadline) {
                if (wake_.wait_until(lock, *deadline) == std::cv_status::timeout) {
                    auto again = streams_.find(id);
                    if (again == streams_.end() || again->second.events.empty()) {
                        if (timed_out) *timed_out = true;
                        return std::nullopt;
                    }
                }
            } else {
                wake_.wait(lock);
            }
        }
    }

    // Asks the engine to end a request (non-blocking); false if it had already ended.
    bool abort(uint64_t id) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (closed_) return false;
        dsv4_status code = dsv4_abort(handle_, id);
        if (code == DSV4_ERR_NOT_FOUND) return false;
        check(code);
        return true;
    }

    // A stream dropped before its terminal event: abort the request and route its remaining
    // events nowhere (not to the general queue), forgetting the id at its terminal event.
    // Never waits, so it is safe anywhere, also on the engine thread inside a callback.
    void abandon(uint64_t id) noexcept {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = streams_.find(id);
        if (it == streams_.end()) return;
        bool ended = it->second.terminal_queued;
        streams_.erase(it);
        if (ended || closed_) return;
        abandoned_.insert(id);
        (void)dsv4_abort(handle_, id);  // NOT_FOUND: the terminal event is on its way
    }

    std::vector<event> poll_general(size_t max, int32_t timeout_ms) {
        std::unique_lock<std::mutex> lock(mutex_);
        auto ready = [&] { return !general_.empty() || closed_ || drained_; };
        if (timeout_ms < 0) {
            wake_.wait(lock, ready);
        } else if (timeout_ms > 0) {
            wake_.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
        }
        std::vector<event> out;
        while (!general_.empty() && out.size() < (max == 0 ? 1 : max)) {
            out.push_back(std::move(general_.front()));
            general_.pop_front();
        }
        return out;
    }

    void set_callback(event_fn fn) {
        auto next = fn ? std::make_shared<const event_fn>(std::move(fn)) : nullptr;
        if (next) {
            std::shared_ptr<const event_fn> previous;
            {
                std::lock_guard<std::mutex> lock(mutex_);
                previous = std::exchange(callback_, next);
            }
            // Blocks until the engine thread switched; throws invalid_argument from a callback.
            // The trampoline is the same for every host callback; only callback_ changes.
            dsv4_status code = dsv4_set_event_callback(handle_, &router::on_event, this, nullptr);
            if (code != DSV4_OK) {
                std::string message = dsv4_last_error();
                std::lock_guard<std::mutex> lock(mutex_);
                callback_ = previous;  // still the installed one (e.g. refused in a callback)
                throw error(code, message);
            }
        } else {
            check(dsv4_set_event_callback(handle_, nullptr, nullptr, nullptr));
            // Back to polling: the trampoline no longer runs, the poller takes over.
            std::lock_guard<std::mutex> lock(mutex_);
            callback_ = nullptr;
        }
    }

    // Engine destruction, after dsv4_engine_shutdown(abort) returned: every request has its
    // terminal event queued (poll mode) or delivered (push mode). The poller takes what is left
    // and stops; then no call on the handle is made from here again (it is about to be freed).
    void close() noexcept {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stopping_ = true;
        }
        if (poller_.joinable()) poller_.join();
        std::vector<delivery> late;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            closed_ = true;
            // A request whose terminal event never came (the engine failed to stop) still ends.
            for (auto it = streams_.begin(); it != streams_.end();) {
                if (it->second.terminal_queued) {
                    ++it;
                    continue;
                }
                event e;
                e.request_id = it->first;
                e.kind = event_kind::error;
                e.status = status::shutdown;
                e.message = "the engine was destroyed before this request ended";
                if (it->second.callback) {
                    late.emplace_back(it->second.callback, std::move(e));
                    it = streams_.erase(it);
                    continue;
                }
                it->second.events.push_back(std::move(e));
                it->second.terminal_queued = true;
                ++it;
            }
            abandoned_.clear();
            wake_.notify_all();
        }
        deliver(late);
    }

    ~router() {
        if (poller_.joinable()) close();
    }

    router(const router &) = delete;
    router &operator=(const router &) = delete;

private:
    // Calls each callback with its event, in order; outside the router's lock (a callback
    // may submit). An exception from a host callback is dropped: it must not end the poller
    // (or unwind into the engine thread) and cost other requests their events.
    static void deliver(std::vector<delivery> &calls) noexcept {
        for (auto &call : calls) {
            try {
                (*call.first)(call.second);
            } catch (...) {
            }
        }
        calls.clear();
    }

    // Routes one event; returns the callback to call with it (outside the lock), if any: the
    // request's own, or the host's event callback in push mode.
    std::shared_ptr<const event_fn> route_locked(event &&e, bool push_mode) {
        auto it = streams_.find(e.request_id);
        if (it != streams_.end()) {
            if (it->second.callback) {
                std::shared_ptr<const event_fn> fn = it->second.callback;
                if (e.terminal()) streams_.erase(it);
                return fn;
            }
            if (e.terminal()) it->second.terminal_queued = true;
            it->second.events.push_back(std::move(e));
            return nullptr;
        }
        auto gone = abandoned_.find(e.request_id);
        if (gone != abandoned_.end()) {
            if (e.terminal()) abandoned_.erase(gone);
            return nullptr;
        }
        if (push_mode && callback_) return callback_;
        general_.push_back(std::move(e));
        return nullptr;
    }

    static void on_event(const dsv4_event *c_event, void *user_data) {
        auto *self = static_cast<router *>(user_data);
        try {
            event e = event::from_c(*c_event);
            std::shared_ptr<const event_fn> fn;
            {
                std::lock_guard<std::mutex> lock(self->mutex_);
                fn = self->route_locked(event(e), true);
                self->wake_.notify_all();
            }
            // Outside the lock: the host callback may call engine::submit, which takes it.
            if (fn) (*fn)(e);
        } catch (...) {
            // Unwinding into the engine thread is undefined behaviour: the event is lost.
        }
    }

    void run() {
        constexpr size_t cap = 64;
        std::vector<dsv4_event> buf(cap);
        // The engine thread has ended (shut down or failed): every event is queued, and
        // dsv4_poll returns at once from then on, so drain with poll(0) and stop rather than
        // spin until the engine is destroyed.
        bool ended = false;
        for (;;) {
            bool stopping;
            {
                std::lock_guard<std::mutex> lock(mutex_);
                stopping = stopping_ || ended;
            }
            buf[0].struct_size = sizeof(dsv4_event);
            size_t n = 0;
            // Stopping: the engine has shut down, so poll(0) drains what is queued.
            dsv4_status code = dsv4_poll(handle_, buf.data(), cap, &n, stopping ? 0 : 100);
            if (code != DSV4_OK) {
                // UNSUPPORTED: an event callback is set and routes events itself. Wait a
                // little (or until stopping) rather than spin.
                std::unique_lock<std::mutex> lock(mutex_);
                if (stopping_) return;
                wake_.wait_for(lock, std::chrono::milliseconds(50));
                continue;
            }
            if (n == 0) {
                if (stopping) {
                    // Nothing more will come: a general poll waiting forever returns now.
                    std::lock_guard<std::mutex> lock(mutex_);
                    drained_ = true;
                    wake_.notify_all();
                    return;
                }
                // The engine's state is set before its event queue closes, so once it reads
                // STOPPED or FAILED one more poll(0) takes whatever is left.
                int32_t state = DSV4_STATE_READY;
                ended = dsv4_engine_state(handle_, &state, nullptr, 0, nullptr) == DSV4_OK &&
                        (state == DSV4_STATE_STOPPED || state == DSV4_STATE_FAILED);
                continue;
            }
            std::vector<delivery> calls;
            {
                std::lock_guard<std::mutex> lock(mutex_);
                for (size_t i = 0; i < n; i++) {
                    event e = event::from_c(buf[i]);
                    std::shared_ptr<const event_fn> fn = route_locked(event(e), false);
                    if (fn) calls.emplace_back(std::move(fn), std::move(e));
                }
                wake_.notify_all();
            }
            deliver(calls);
        }
    }

    dsv4_engine *handle_;
    std::mutex mutex_;
    std::condition_variable wake_;  // a queue got an event, or the router closed
    std::unordered_map<uint64_t, stream_queue> streams_;
    std::unordered_set<uint64_t> abandoned_;
    std::deque<event> general_;
    std::shared_ptr<const event_fn> callback_;
    bool stopping_ = false;
    bool closed_ = false;
    bool drained_ = false;  // the engine ended and the poller took its last event
    std::thread poller_;
};

}  // namespace detail

// The events of one request (engine::submit), in order: token events, then exactly one
// terminal event (finished or error), after which next() returns std::nullopt. Move-only.
// Dropping a stream before its terminal event aborts the request without waiting (its later
// events are discarded); call abort() and read to the end to wait until it has ended. A stream
// may outlive its engine: destroying the engine ends the request (aborted), and the stream
// still yields that terminal event. One thread at a time per stream.
class stream {
public:
    stream(stream &&other) noexcept
        : router_(std::move(other.router_)), id_(other.id_), done_(other.done_) {}
    stream &operator=(stream &&other) noexcept {
        if (this != &other) {
            release();
            router_ = std::move(other.router_);
            id_ = other.id_;
            done_ = other.done_;
        }
        return *this;
    }
    stream(const stream &) = delete;
    stream &operator=(const stream &) = delete;
    ~stream() { release(); }

    uint64_t id() const noexcept { return id_; }
    // True once the terminal event was returned.
    bool done() const noexcept { return done_ || !router_; }

    // The next event, waiting as long as it takes; std::nullopt after the terminal one.
    std::optional<event> next() {
        if (done()) return std::nullopt;
        std::optional<event> e = router_->next(id_, nullptr, nullptr);
        if (!e || e->terminal()) done_ = true;
        return e;
    }

    // The next event, waiting at most `timeout`: std::nullopt on a timeout (done() false) or
    // after the terminal event (done() true).
    std::optional<event> next_for(std::chrono::milliseconds timeout) {
        if (done()) return std::nullopt;
        auto deadline = std::chrono::steady_clock::now() + timeout;
        std::optional<event> e = router_->next(id_, &deadline, nullptr);
        if (e && e->terminal()) done_ = true;
        return e;
    }

    // Asks the engine to end the request (non-blocking): it ends with finished/aborted unless
    // it was already ending. Keep reading to see its terminal event.
    void abort() {
        if (!done()) router_->abort(id_);
    }

    // Range-for over the remaining events (an input iterator: one pass).
    class iterator {
    public:
        using iterator_category = std::input_iterator_tag;
        using value_type = event;
        using difference_type = std::ptrdiff_t;
        using pointer = const event *;
        using reference = const event &;
        iterator() = default;
        explicit iterator(stream *s) : stream_(s) { ++*this; }
        reference operator*() const { return *current_; }
        pointer operator->() const { return &*current_; }
        iterator &operator++() {
            current_ = stream_->next();
            if (!current_) stream_ = nullptr;
            return *this;
        }
        bool operator==(const iterator &other) const { return stream_ == other.stream_; }
        bool operator!=(const iterator &other) const { return stream_ != other.stream_; }

    private:
        stream *stream_ = nullptr;
        std::optional<event> current_;
    };
    iterator begin() { return iterator(this); }
    iterator end() { return iterator(); }

private:
    friend class engine;
    stream(std::shared_ptr<detail::router> r, uint64_t id) : router_(std::move(r)), id_(id) {}
    void release() noexcept {
        if (router_ && !done_) router_->abandon(id_);
        router_.reset();
    }

    std::shared_ptr<detail::router> router_;
    uint64_t id_ = 0;
    bool done_ = false;
};

// An engine (RAII, move-only). Thread-safe like the handle it wraps. It runs one poller
// thread that routes events to streams (see stream). The destructor ends what is in flight
// (every stream gets its terminal event), stops the poller, then frees the engine.
class engine {
public:
    explicit engine(const std::string &params_json) {
        check(dsv4_engine_create(params_json.c_str(), &handle_));
        try {
            router_ = std::make_shared<detail::router>(handle_);
        } catch (...) {
            dsv4_engine_destroy(handle_);
            throw;
        }
    }
    engine(engine &&other) noexcept
        : handle_(std::exchange(other.handle_, nullptr)), router_(std::move(other.router_)) {}
    engine &operator=(engine &&other) noexcept {
        if (this != &other) {
            destroy();
            handle_ = std::exchange(other.handle_, nullptr);
            router_ = std::move(other.router_);
        }
        return *this;
    }
    engine(const engine &) = delete;
    engine &operator=(const engine &) = delete;
    ~engine() { destroy(); }

    dsv4_engine *get() const noexcept { return handle_; }

    // Submits a request and returns the stream of its events. Refused → dsv4::error
    // (queue_full, capacity, invalid_argument, shutdown), with no stream.
    stream submit(const request &r) const {
        return stream(router_, router_->submit(r.c_request(), true));
    }

    // Submits a request whose events go to `on_event`, in order, ending with exactly one
    // terminal event (a synthesized shutdown error if the engine is destroyed first). It runs
    // on the wrapper's poller thread, or on the engine thread while an event callback is set,
    // so keep it short: every request's events wait while it runs. An exception it throws is
    // dropped. Returns the request's id (for abort()). Throws like submit(request); an empty
    // `on_event` is invalid_argument.
    uint64_t submit(const request &r, event_fn on_event) const {
        if (!on_event) throw error(DSV4_ERR_INVALID_ARGUMENT, "submit: on_event is empty: pass a callable");
        return router_->submit(r.c_request(), true, std::move(on_event));
    }

    // Submits a request whose events go to poll() (or the event callback); returns its id.
    uint64_t submit_detached(const request &r) const {
        return router_->submit(r.c_request(), false);
    }

    // Events of detached requests: up to `max`, waiting up to `timeout_ms` (-1: until one
    // arrives, or the engine has stopped and every event is taken, or it is destroyed) for
    // the first.
    std::vector<event> poll(size_t max, int32_t timeout_ms) const {
        return router_->poll_general(max, timeout_ms);
    }

    // Push mode: events of detached requests go to `callback` on the engine thread (streams
    // still get theirs); an empty callback returns to poll(). Blocks until the engine thread
    // switched; the previous callback no longer runs when it returns. From a callback: throws
    // invalid_argument.
    void set_event_callback(event_fn callback) const { router_->set_callback(std::move(callback)); }
    void clear_event_callback() const { router_->set_callback(nullptr); }

    // Ends a request by id (finished/aborted); not_found if it is unknown or already ended.
    void abort(uint64_t request_id) const { check(dsv4_abort(handle_, request_id)); }

    void shutdown(shutdown_mode mode = shutdown_mode::drain, int32_t timeout_ms = -1) const {
        check(dsv4_engine_shutdown(handle_, static_cast<int32_t>(mode), timeout_ms));
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

    // The prefix cache per pool and tier, hits, load-backs, backups, evictions (JSON,
    // docs/hicache.md). Waits for the engine thread: throws invalid_argument in a callback.
    std::string cache_stats() const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_cache_stats(handle_, buf, cap, needed);
        });
    }

    // Drops every unlocked cached prefix from a tier. Waits for the engine thread: throws
    // invalid_argument in a callback.
    void cache_flush(cache_tier tier = cache_tier::all) const {
        const char *name = tier == cache_tier::device ? "device"
                           : tier == cache_tier::host ? "host"
                                                      : "all";
        check(dsv4_cache_flush(handle_, name));
    }

    // The checkpoint's tokenizer (tokenizer.json), as Hugging Face tokenizers' encode(text,
    // add_special_tokens). Throws unsupported for a checkpoint without one. Never waits for the
    // engine thread.
    std::vector<int32_t> tokenize(const std::string &text, bool add_special = true) const {
        for (;;) {
            size_t n = 0;
            check(dsv4_tokenize(handle_, text.c_str(), add_special, nullptr, 0, &n));
            std::vector<int32_t> ids(n);
            dsv4_status code =
                dsv4_tokenize(handle_, text.c_str(), add_special, ids.data(), ids.size(), &n);
            if (code == DSV4_ERR_BUFFER_TOO_SMALL) continue;
            check(code);
            ids.resize(n);
            return ids;
        }
    }

    // The text of `ids`, special tokens included (decode(ids, skip_special_tokens=False)).
    std::string detokenize(const std::vector<int32_t> &ids) const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_detokenize(handle_, ids.data(), ids.size(), buf, cap, needed);
        });
    }

    // tokenizer_config.json's chat template rendered for `messages_json` (a JSON array of
    // {"role", "content"} objects), as transformers' apply_chat_template(tokenize=False).
    std::string chat_apply(const std::string &messages_json,
                           bool add_generation_prompt = true) const {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_chat_apply(handle_, messages_json.c_str(), add_generation_prompt, buf,
                                   cap, needed);
        });
    }

    // The address PD peers reach this engine at, "tcp://host:port" (pd.advertise, else the
    // address pd.listen bound): a prefill engine's endpoint is what decode requests carry as
    // request::pd_peer. Throws invalid_argument in the unified role, which has none.
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
    // Order matters: the shutdown queues (or delivers) every request's terminal event, the
    // router's poller takes them and stops, and only then is the handle freed, so no thread of
    // this wrapper touches a freed handle and every stream sees its end.
    void destroy() noexcept {
        if (!handle_) return;
        (void)dsv4_engine_shutdown(handle_, DSV4_SHUTDOWN_ABORT, -1);
        if (router_) router_->close();
        dsv4_engine_destroy(std::exchange(handle_, nullptr));
        router_.reset();
    }

    dsv4_engine *handle_ = nullptr;
    std::shared_ptr<detail::router> router_;
};

// Streaming text for one request's tokens: feed() each id as it arrives and append what it
// returns; the pieces concatenate to detokenize() of all the ids (bytes of a character split
// across ids are held back until it completes). Move-only; one per stream; may outlive its
// engine. Throws unsupported for a checkpoint without tokenizer.json.
class detokenizer {
public:
    explicit detokenizer(const engine &e) { check(dsv4_detokenizer_create(e.get(), &handle_)); }
    detokenizer(detokenizer &&other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
    detokenizer &operator=(detokenizer &&other) noexcept {
        if (this != &other) {
            dsv4_detokenizer_destroy(handle_);
            handle_ = std::exchange(other.handle_, nullptr);
        }
        return *this;
    }
    detokenizer(const detokenizer &) = delete;
    detokenizer &operator=(const detokenizer &) = delete;
    ~detokenizer() { dsv4_detokenizer_destroy(handle_); }

    // The text `token` completes (often empty). A failed call leaves the stream unchanged.
    std::string feed(int32_t token) {
        return detail::read_text([&](char *buf, size_t cap, size_t *needed) {
            return dsv4_detokenizer_feed(handle_, token, buf, cap, needed);
        });
    }

private:
    dsv4_detokenizer *handle_ = nullptr;
};

}  // namespace dsv4

#endif  // DSV4_HPP
