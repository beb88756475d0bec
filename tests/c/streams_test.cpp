// The C++ wrapper's hosting surface: per-request streams routed by one poller, the request
// that owns its buffers, event and log callbacks, cache stats / flush, enums and errors. Runs
// on the flash-like fixture (vocab 384, EOS 1); run under valgrind by `make test-valgrind`.
#include <dsv4.hpp>

#include "check.h"

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <cstdio>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

// The dangling pattern of the old wrapper (a C struct pointing into a temporary's buffers)
// does not compile: the C struct can only be taken from a request that outlives the statement.
template <typename T, typename = void>
struct has_c_request : std::false_type {};
template <typename T>
struct has_c_request<T, std::void_t<decltype(std::declval<T>().c_request())>> : std::true_type {};
static_assert(has_c_request<const dsv4::request &>::value, "an lvalue request gives its C struct");
static_assert(!has_c_request<dsv4::request &&>::value, "a temporary request must not");
static_assert(!std::is_constructible_v<dsv4_request, dsv4::request &&>, "no conversion");
static_assert(!std::is_constructible_v<dsv4_request, const std::vector<int32_t> &>, "no C struct from a vector");
// Streams are move-only.
static_assert(!std::is_copy_constructible_v<dsv4::stream> && std::is_move_constructible_v<dsv4::stream>);
static_assert(static_cast<int32_t>(dsv4::finish_reason::transferred) == DSV4_FINISH_TRANSFERRED);
static_assert(static_cast<int32_t>(dsv4::status::not_found) == DSV4_ERR_NOT_FOUND);

static const std::string PARAMS =
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 2, "
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \"page_size\": 128}}";

// Built from a temporary vector: the request keeps its own copy.
static dsv4::request make_request(int32_t first, uint32_t max_new, uint64_t tag) {
    return dsv4::request(std::vector<int32_t>{first, 17, 300, 2, 9, 44, 81, 120})
        .max_new_tokens(max_new)
        .temperature(0.0f)
        .ignore_eos(true)
        .user_tag(tag);
}

// A request that only ends when aborted (or at the context limit, far away).
static dsv4::request endless(uint64_t tag) { return make_request(5, 1000000, tag); }

// Reads a stream to its end; checks that every event is its own, token events count up, and
// exactly one terminal event comes last. Returns the terminal event.
// `generated`: token events already read from it.
static dsv4::event drain(dsv4::stream &s, uint64_t tag, std::vector<int32_t> *tokens,
                         uint32_t generated = 0) {
    dsv4::event last;
    int terminals = 0;
    for (const dsv4::event &e : s) {
        CHECK(e.request_id == s.id());
        CHECK(e.user_tag == tag);
        if (e.kind == dsv4::event_kind::token) {
            CHECK(terminals == 0);
            CHECK(e.generated_tokens == ++generated);
            if (tokens) tokens->push_back(e.token);
        } else {
            terminals++;
        }
        last = e;
    }
    CHECK(terminals == 1);
    CHECK(s.done());
    CHECK(!s.next());
    return last;
}

// Several streams on one engine, each read by its own thread: each gets exactly its events.
static void test_concurrent_streams(dsv4::engine &engine) {
    const uint32_t lengths[] = {3, 7, 5, 9, 4, 6};
    std::vector<dsv4::stream> streams;
    for (size_t i = 0; i < 6; i++)
        streams.push_back(engine.submit(make_request(int32_t(5 + i), lengths[i], 100 + i)));
    std::vector<std::vector<int32_t>> tokens(6);
    std::vector<dsv4::event> ends(6);
    std::vector<std::thread> readers;
    for (size_t i = 0; i < 6; i++)
        readers.emplace_back([&, i] { ends[i] = drain(streams[i], 100 + i, &tokens[i]); });
    for (auto &t : readers) t.join();
    for (size_t i = 0; i < 6; i++) {
        CHECK(ends[i].kind == dsv4::event_kind::finished);
        CHECK(ends[i].finish_reason == dsv4::finish_reason::length);
        CHECK(tokens[i].size() == lengths[i]);
        CHECK(ends[i].generated_tokens == lengths[i]);
        CHECK(ends[i].prompt_tokens == 8);
    }
    // Greedy on the same prompt: a stream read alone gives the same tokens as in the crowd.
    dsv4::stream again = engine.submit(make_request(5, lengths[0], 100));
    std::vector<int32_t> alone;
    drain(again, 100, &alone);
    CHECK(alone == tokens[0]);
}

// A stream dropped before its end aborts its request; the others run on unharmed.
static void test_drop_early(dsv4::engine &engine) {
    const uint64_t aborted_before = engine.metrics().aborted_total;
    dsv4::stream keep = engine.submit(make_request(7, 6, 1));
    {
        dsv4::stream dropped = engine.submit(endless(2));
        for (int i = 0; i < 2; i++) {
            std::optional<dsv4::event> e = dropped.next();
            CHECK(e && e->kind == dsv4::event_kind::token);
        }
    }  // dropped here: aborted without waiting
    std::vector<int32_t> tokens;
    dsv4::event end = drain(keep, 1, &tokens);
    CHECK(end.finish_reason == dsv4::finish_reason::length && tokens.size() == 6);
    // The abort lands: the engine counts it and nothing is left in flight. The dropped
    // request's later events went nowhere (not to the general queue).
    bool landed = false;
    for (int i = 0; i < 600 && !landed; i++) {
        landed = engine.metrics().aborted_total == aborted_before + 1 &&
                 engine.metrics().num_running_reqs == 0;
        if (!landed) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(landed);
    CHECK(engine.poll(16, 0).empty());

    // abort() and reading on: the terminal event says aborted.
    dsv4::stream s = engine.submit(endless(3));
    CHECK(s.next().has_value());
    s.abort();
    dsv4::event last = drain(s, 3, nullptr, 1);
    CHECK(last.kind == dsv4::event_kind::finished);
    CHECK(last.finish_reason == dsv4::finish_reason::aborted);
    s.abort();  // after the end: nothing to do, no throw

    // A moved stream carries on; the moved-from one is done and its drop aborts nothing.
    dsv4::stream a = engine.submit(make_request(9, 2, 4));
    dsv4::stream b = std::move(a);
    CHECK(a.done());
    CHECK(drain(b, 4, nullptr).finish_reason == dsv4::finish_reason::length);
}

// The request owns its buffers: built from temporaries, copied, its source gone, it submits
// what it was given (valgrind sees no read of freed memory).
static void test_request_owns_buffers(dsv4::engine &engine) {
    std::optional<dsv4::request> r;
    {
        std::vector<int32_t> prompt = {5, 17, 300, 2, 9};
        dsv4::request built(prompt);
        built.stop_tokens(std::vector<int32_t>{383})
            .stop_sequences({{382, 381}, {380}})
            .logit_bias(1, -1000.0f)
            .cache_salt(std::string("tenant-a"))
            .priority(3)
            .deadline(std::chrono::milliseconds(600000))
            .seed(7)
            .top_k(0)
            .top_p(1.0f)
            .min_p(0.0f)
            .logprobs(true)
            .max_new_tokens(4)
            .temperature(0.0f)
            .user_tag(77);
        prompt.assign(5, -1);  // the request has its own copy
        r = built;             // a copy, then the original dies
    }
    const dsv4_request c = r->c_request();
    CHECK(c.prompt_len == 5 && c.prompt[0] == 5 && c.prompt[4] == 9);
    CHECK(c.stop_tokens_len == 1 && c.stop_tokens[0] == 383);
    CHECK(c.stop_sequences_len == 2 && c.stop_sequence_lens[0] == 2 && c.stop_sequences[2] == 380);
    CHECK(c.logit_bias_len == 1 && c.logit_bias_values[0] == -1000.0f);
    CHECK(std::string(c.cache_salt) == "tenant-a" && c.pd_peer == nullptr && c.pd_room == 0);
    CHECK(c.priority == 3 && c.deadline_ms == 600000 && c.seed == 7 && c.logprobs == 1);
    CHECK(c.ignore_eos == 0 && c.struct_size == sizeof(dsv4_request));
    dsv4::stream s = engine.submit(*r);
    r.reset();  // submit copied everything
    size_t tokens = 0;
    for (const dsv4::event &e : s) {
        CHECK(e.user_tag == 77 && e.prompt_tokens == 5);
        if (e.kind == dsv4::event_kind::token) {
            tokens++;
            CHECK(e.logprob <= 0.0f);
            CHECK(e.token != 1);  // the bias suppresses EOS
        } else {
            CHECK(e.kind == dsv4::event_kind::finished);
        }
    }
    CHECK(tokens >= 1 && tokens <= 4);

    // PD fields are carried, and a unified engine refuses them with the library's message.
    dsv4::request pd = dsv4::request({5, 17}).pd_room(7).pd_peer(std::string("tcp://127.0.0.1:1"));
    CHECK(pd.c_request().pd_room == 7 && std::string(pd.c_request().pd_peer) == "tcp://127.0.0.1:1");
    try {
        engine.submit(pd);
        CHECK(!"pd_room accepted by a unified engine");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::invalid_argument);
        CHECK(std::string(e.what()).find("pd_room") != std::string::npos);
    }
    // A deadline that does not fit the C field is refused, not wrapped around.
    try {
        dsv4::request({5}).deadline(std::chrono::milliseconds(-1));
        CHECK(!"negative deadline accepted");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::invalid_argument);
    }
    // An empty prompt is refused at submit, with no stream.
    try {
        engine.submit(dsv4::request(std::vector<int32_t>{}));
        CHECK(!"empty prompt accepted");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::invalid_argument && e.code() == DSV4_ERR_INVALID_ARGUMENT);
        CHECK(std::string(e.status_name()) == "DSV4_ERR_INVALID_ARGUMENT");
        CHECK(e.what()[0] != '\0');
    }
}

// Detached requests: their events go to poll(), or to the event callback in push mode, while
// streams keep getting their own.
static void test_detached_and_callbacks(dsv4::engine &engine) {
    uint64_t id = engine.submit_detached(make_request(11, 3, 9));
    int tokens = 0, terminals = 0;
    for (int spins = 0; spins < 600 && terminals == 0; spins++) {
        for (const dsv4::event &e : engine.poll(16, 100)) {
            CHECK(e.request_id == id && e.user_tag == 9);
            if (e.terminal()) terminals++; else tokens++;
        }
    }
    CHECK(tokens == 3 && terminals == 1);
    try {
        engine.abort(id);  // already ended
        CHECK(!"abort of an ended request succeeded");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::not_found);
    }

    std::atomic<int> cb_tokens{0}, cb_terminals{0}, cb_foreign{0};
    std::atomic<int32_t> refused{0};
    engine.set_event_callback([&](const dsv4::event &e) {
        if (e.user_tag != 11) cb_foreign++;  // only the detached request's events come here
        if (e.terminal()) {
            // Waiting for the engine thread from the engine thread is refused, not a deadlock.
            try {
                engine.cache_stats();
            } catch (const dsv4::error &err) {
                refused = static_cast<int32_t>(err.status());
            }
            cb_terminals++;
        } else {
            cb_tokens++;
        }
    });
    dsv4::stream s = engine.submit(make_request(12, 4, 10));
    engine.submit_detached(make_request(13, 5, 11));
    std::vector<int32_t> stream_tokens;
    drain(s, 10, &stream_tokens);
    CHECK(stream_tokens.size() == 4);
    for (int i = 0; i < 600 && cb_terminals.load() == 0; i++)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    engine.clear_event_callback();
    CHECK(cb_tokens.load() == 5 && cb_terminals.load() == 1);
    CHECK(cb_foreign.load() == 0);  // the stream's events never reached the callback
    CHECK(refused.load() == static_cast<int32_t>(dsv4::status::invalid_argument));
    CHECK(engine.poll(16, 0).empty());
    // Back to polling: streams still work.
    dsv4::stream after = engine.submit(make_request(14, 2, 12));
    CHECK(drain(after, 12, nullptr).finish_reason == dsv4::finish_reason::length);
}

// What a per-request callback saw. Guarded by its own mutex; `done` wakes the test.
struct seen {
    std::mutex m;
    std::condition_variable done;
    std::vector<dsv4::event> events;
    int terminals = 0;

    dsv4::event_fn recorder() {
        return [this](const dsv4::event &e) {
            std::lock_guard<std::mutex> lock(m);
            events.push_back(e);
            if (e.terminal()) terminals++;
            done.notify_all();
        };
    }
    bool wait_end() {
        std::unique_lock<std::mutex> lock(m);
        return done.wait_for(lock, std::chrono::seconds(120), [&] { return terminals > 0; });
    }
    // Token events count up, one terminal event comes last; returns the tokens.
    std::vector<int32_t> check_order(uint64_t id, uint64_t tag) {
        std::lock_guard<std::mutex> lock(m);
        std::vector<int32_t> tokens;
        CHECK(terminals == 1 && !events.empty() && events.back().terminal());
        for (size_t i = 0; i < events.size(); i++) {
            CHECK(events[i].request_id == id && events[i].user_tag == tag);
            if (i + 1 < events.size()) {
                CHECK(events[i].kind == dsv4::event_kind::token);
                CHECK(events[i].generated_tokens == i + 1);
                tokens.push_back(events[i].token);
            }
        }
        return tokens;
    }
};

// submit(request, callback): each request's events reach its callback in order with one
// terminal event, next to streams; a throwing callback costs nobody their events; a callback
// may submit; push mode (an event callback set) delivers them on the engine thread.
static void test_request_callbacks(dsv4::engine &engine) {
    seen a, b, thrower;
    dsv4::stream s = engine.submit(make_request(21, 5, 30));
    uint64_t ida = engine.submit(make_request(22, 6, 31), a.recorder());
    uint64_t idb = engine.submit(make_request(21, 5, 32), b.recorder());
    std::atomic<int> thrown{0};
    auto record = thrower.recorder();
    uint64_t idt = engine.submit(make_request(23, 3, 33), [&](const dsv4::event &e) {
        record(e);
        thrown++;
        throw std::runtime_error("a host callback that throws");
    });
    std::vector<int32_t> streamed;
    drain(s, 30, &streamed);
    CHECK(a.wait_end() && b.wait_end() && thrower.wait_end());
    CHECK(a.check_order(ida, 31).size() == 6);
    // Greedy on the same prompt: the callback got the stream's tokens.
    CHECK(b.check_order(idb, 32) == streamed);
    CHECK(thrower.check_order(idt, 33).size() == 3 && thrown.load() == 4);

    // A callback that submits (from the poller thread): no deadlock, and the inner one ends.
    seen inner;
    std::atomic<uint64_t> inner_id{0};
    seen outer;
    auto outer_record = outer.recorder();
    uint64_t ido = engine.submit(make_request(24, 2, 34), [&](const dsv4::event &e) {
        if (e.terminal()) inner_id = engine.submit(make_request(25, 2, 35), inner.recorder());
        outer_record(e);
    });
    CHECK(outer.wait_end() && inner.wait_end());
    outer.check_order(ido, 34);
    inner.check_order(inner_id.load(), 35);

    // Push mode: request callbacks still get their own events; the host callback none of them.
    std::atomic<int> foreign{0};
    engine.set_event_callback([&](const dsv4::event &) { foreign++; });
    seen pushed;
    uint64_t idp = engine.submit(make_request(26, 4, 36), pushed.recorder());
    CHECK(pushed.wait_end());
    engine.clear_event_callback();
    CHECK(pushed.check_order(idp, 36).size() == 4);
    CHECK(foreign.load() == 0);

    try {
        engine.submit(make_request(5, 1, 0), dsv4::event_fn());
        CHECK(!"an empty callback accepted");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::invalid_argument);
    }
}

static void test_cache(dsv4::engine &engine) {
    const std::string stats = engine.cache_stats();
    CHECK(stats.front() == '{' && stats.find("\"device\"") != std::string::npos);
    engine.cache_flush(dsv4::cache_tier::device);
    engine.cache_flush();
    CHECK(engine.state().state == dsv4::state::ready);
}

static void test_log_callback() {
    std::atomic<int> records{0};
    std::atomic<bool> saw_plan{false};
    dsv4::set_log_callback(dsv4::log_level::info,
                           [&](dsv4::log_level level, const char *target, const char *message) {
                               if (level >= dsv4::log_level::error && level <= dsv4::log_level::info &&
                                   std::string(target).rfind("dsv4", 0) == 0)
                                   records++;
                               if (std::string(message).find("planned") != std::string::npos)
                                   saw_plan = true;
                           });
    dsv4::plan(PARAMS);
    CHECK(saw_plan.load());
    CHECK(records.load() > 0);
    dsv4::clear_log_callback();  // the lambda's captures may die after this returns
    const int before = records.load();
    dsv4::plan(PARAMS);
    CHECK(records.load() == before);
    try {
        dsv4::set_log_callback(static_cast<dsv4::log_level>(9), [](dsv4::log_level, const char *, const char *) {});
        CHECK(!"log level 9 accepted");
    } catch (const dsv4::error &e) {
        CHECK(e.status() == dsv4::status::invalid_argument);
    }
}

static double cpu_seconds() {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           double(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// A shut-down engine that is not yet destroyed costs nothing: its poller took the last event
// and stopped (it used to spin on dsv4_poll, which returns at once once the engine has
// stopped), and a general poll that waits for ever returns instead of hanging.
static void test_idle_after_shutdown(dsv4::engine &engine) {
    CHECK(engine.state().state == dsv4::state::stopped);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the poller notices
    const double cpu_before = cpu_seconds();
    const auto wall_before = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    const double cpu = cpu_seconds() - cpu_before;
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_before).count();
    // A spinning thread burns about `wall`; an idle process next to nothing.
    if (!(cpu < 0.5 * wall)) std::fprintf(stderr, "idle engine used %.3f s CPU in %.3f s\n", cpu, wall);
    CHECK(cpu < 0.5 * wall);
    CHECK(engine.poll(16, -1).empty());
}

// Destroying the engine with streams unread: each still yields its (aborted) terminal event,
// and the poller is joined without a deadlock.
static void test_destroy_with_streams() {
    std::vector<dsv4::stream> streams;
    seen cb;
    {
        dsv4::engine engine(PARAMS);
        streams.push_back(engine.submit(endless(20)));
        streams.push_back(engine.submit(endless(21)));
        engine.submit(endless(22), cb.recorder());
        CHECK(streams[0].next().has_value());
    }
    // The callback's request ended (aborted) before the engine was gone.
    {
        std::lock_guard<std::mutex> lock(cb.m);
        CHECK(cb.terminals == 1 && cb.events.back().terminal());
        CHECK(cb.events.back().finish_reason == dsv4::finish_reason::aborted);
    }
    for (size_t i = 0; i < streams.size(); i++) {
        dsv4::event last = drain(streams[i], 20 + i, nullptr, i == 0 ? 1 : 0);
        CHECK(last.terminal());
    }
}

int main() {
    try {
        test_log_callback();
        dsv4::engine engine(PARAMS);
        test_concurrent_streams(engine);
        test_drop_early(engine);
        test_request_owns_buffers(engine);
        test_detached_and_callbacks(engine);
        test_request_callbacks(engine);
        test_cache(engine);
        engine.shutdown(dsv4::shutdown_mode::drain);
        test_idle_after_shutdown(engine);
        try {
            engine.submit(make_request(5, 1, 0));
            CHECK(!"submit after shutdown accepted");
        } catch (const dsv4::error &e) {
            CHECK(e.status() == dsv4::status::shutdown);
        }
        test_destroy_with_streams();
    } catch (const dsv4::error &e) {
        std::fprintf(stderr, "unexpected dsv4::error %s: %s\n", e.status_name(), e.what());
        return 1;
    }
    if (failures) std::fprintf(stderr, "%d checks failed\n", failures);
    else std::printf("streams_test: all passed\n");
    return failures ? 1 : 0;
}
