/* Regression tests from the adversarial sweep, through the C API: calls from callbacks that
 * used to deadlock, a poll(-1) that shutdown never woke, an uninitialised struct_size used as
 * a stride, a queue bound that aborted the process, logit biases summing to +inf, and an
 * event array of the frozen version-1 size written past its end. Each hang is bounded: the
 * test fails (instead of hanging) when a call does not return in time. */
#define _GNU_SOURCE /* pthread_getname_np, nanosleep */
#include <dsv4.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define PARAMS_WITH(extra)                                                                  \
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 1, " \
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, "             \
    "\"page_size\": 128}" extra "}"

static const int32_t PROMPT[] = {5, 17, 300, 2, 9, 44, 81, 120};
static const int32_t NO_EOS_TOKENS[] = {1};
static const float NO_EOS_VALUES[] = {-1000.0f};

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static dsv4_request endless(void) {
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    r.prompt = PROMPT;
    r.prompt_len = sizeof PROMPT / sizeof PROMPT[0];
    r.max_new_tokens = 1000000;
    r.temperature = 0.0f;
    r.logit_bias_tokens = NO_EOS_TOKENS;
    r.logit_bias_values = NO_EOS_VALUES;
    r.logit_bias_len = 1;
    return r;
}

/* Waits (bounded) for `flag` to become non-zero; returns whether it did. */
static int wait_flag(atomic_int *flag, long ms) {
    for (long waited = 0; waited < ms; waited += 5) {
        if (atomic_load(flag)) return 1;
        sleep_ms(5);
    }
    return atomic_load(flag) != 0;
}

/* --- blocking calls from an event callback ---------------------------------------------- */

struct from_callback {
    dsv4_engine *engine;
    atomic_int done;
    atomic_int terminals;
    dsv4_status score, stats, flush, set_cb, shutdown, abort_status;
};

static void calling_back(const dsv4_event *e, void *user_data) {
    struct from_callback *s = user_data;
    if (e->kind != DSV4_EVENT_TOKEN) {
        atomic_fetch_add(&s->terminals, 1);
        return;
    }
    if (atomic_load(&s->done)) return;
    int32_t tokens[] = {1, 2, 3};
    float logits[3 * 384];
    char buf[64];
    size_t needed = 0;
    s->score = dsv4_score(s->engine, tokens, 3, logits, sizeof logits / sizeof logits[0]);
    s->stats = dsv4_cache_stats(s->engine, buf, sizeof buf, &needed);
    s->flush = dsv4_cache_flush(s->engine, "all");
    s->set_cb = dsv4_set_event_callback(s->engine, NULL, NULL, NULL);
    s->shutdown = dsv4_engine_shutdown(s->engine, DSV4_SHUTDOWN_DRAIN, 0);
    s->abort_status = dsv4_abort(s->engine, e->request_id);
    atomic_store(&s->done, 1);
}

static void test_blocking_calls_from_an_event_callback_are_refused(void) {
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS_WITH(""), &engine), DSV4_OK);
    if (!engine) return;
    struct from_callback s;
    memset(&s, 0, sizeof s);
    s.engine = engine;
    CHECK_STATUS(dsv4_set_event_callback(engine, calling_back, &s, NULL), DSV4_OK);
    dsv4_request r = endless();
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    CHECK(wait_flag(&s.done, 30000));
    CHECK(wait_flag(&s.terminals, 30000));
    CHECK_STATUS(s.score, DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(s.stats, DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(s.flush, DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(s.set_cb, DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(s.shutdown, DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(s.abort_status, DSV4_OK);
    /* From this thread the same calls work. */
    char buf[8192];
    size_t needed = 0;
    CHECK_STATUS(dsv4_cache_stats(engine, buf, sizeof buf, &needed), DSV4_OK);
    dsv4_engine_destroy(engine);
}

/* --- a log callback on a dsv4 thread ------------------------------------------------------ */

static dsv4_engine *log_engine;
static atomic_int log_tried;
static atomic_int log_status;

static void logging_back(void *user_data, int32_t level, const char *target, const char *message) {
    (void)user_data;
    (void)level;
    (void)target;
    (void)message;
    char name[32] = {0};
    pthread_getname_np(pthread_self(), name, sizeof name);
    /* Only records written on one of dsv4's threads: the host thread may call anything. */
    if (strncmp(name, "dsv4-", 5) != 0 || !log_engine || atomic_load(&log_tried)) return;
    char buf[16];
    size_t needed = 0;
    atomic_store(&log_status, dsv4_cache_stats(log_engine, buf, sizeof buf, &needed));
    atomic_store(&log_tried, 1);
}

static void test_blocking_calls_from_a_log_callback_on_the_engine_thread_are_refused(void) {
    CHECK_STATUS(dsv4_set_log_callback(DSV4_LOG_TRACE, logging_back, NULL), DSV4_OK);
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS_WITH(""), &engine), DSV4_OK);
    if (!engine) return;
    log_engine = engine;
    dsv4_request r = endless();
    r.max_new_tokens = 4;
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    /* The engine thread logs when a request is shut down mid-flight. */
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_ABORT, 30000), DSV4_OK);
    CHECK(wait_flag(&log_tried, 30000));
    CHECK_STATUS((dsv4_status)atomic_load(&log_status), DSV4_ERR_INVALID_ARGUMENT);
    log_engine = NULL;
    CHECK_STATUS(dsv4_set_log_callback(DSV4_LOG_OFF, NULL, NULL), DSV4_OK);
    dsv4_engine_destroy(engine);
}

/* --- poll(-1) and shutdown ------------------------------------------------------------------ */

struct poller {
    dsv4_engine *engine;
    atomic_int returned;
    dsv4_status status;
    size_t n;
};

static void ignore_event(const dsv4_event *e, void *user_data) {
    (void)e;
    (void)user_data;
}

static void *poll_forever(void *arg) {
    struct poller *p = arg;
    dsv4_event events[4];
    events[0].struct_size = sizeof(dsv4_event);
    p->status = dsv4_poll(p->engine, events, 4, &p->n, -1);
    atomic_store(&p->returned, 1);
    return NULL;
}

static void test_poll_forever_returns_on_shutdown_and_on_a_callback(void) {
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS_WITH(""), &engine), DSV4_OK);
    if (!engine) return;
    struct poller p;
    memset(&p, 0, sizeof p);
    p.engine = engine;
    pthread_t t;
    pthread_create(&t, NULL, poll_forever, &p);
    sleep_ms(100);
    CHECK_STATUS(dsv4_set_event_callback(engine, ignore_event, NULL, NULL), DSV4_OK);
    CHECK(wait_flag(&p.returned, 10000));
    if (!atomic_load(&p.returned)) return; /* would hang in join */
    pthread_join(t, NULL);
    CHECK_STATUS(p.status, DSV4_ERR_UNSUPPORTED);
    CHECK_STATUS(dsv4_set_event_callback(engine, NULL, NULL, NULL), DSV4_OK);

    memset(&p, 0, sizeof p);
    p.engine = engine;
    p.n = 99;
    pthread_create(&t, NULL, poll_forever, &p);
    sleep_ms(100);
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_DRAIN, -1), DSV4_OK);
    CHECK(wait_flag(&p.returned, 10000));
    if (!atomic_load(&p.returned)) return;
    pthread_join(t, NULL);
    CHECK_STATUS(p.status, DSV4_OK);
    CHECK(p.n == 0);
    dsv4_engine_destroy(engine);
}

/* --- the event array's element size --------------------------------------------------------- */

/* dsv4_event as version 1 of the header had it (up to elapsed_us): 88 bytes. */
#define EVENT_V1_SIZE 88

static void test_poll_stride_is_bounded_and_old_elements_are_not_overrun(void) {
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS_WITH(""), &engine), DSV4_OK);
    if (!engine) return;
    dsv4_event events[2];
    size_t n = 0;
    events[0].struct_size = 0xdeadbeefu; /* uninitialised garbage */
    CHECK_STATUS(dsv4_poll(engine, events, 2, &n, 0), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "struct_size") != NULL);

    dsv4_request r = endless();
    r.max_new_tokens = 3;
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    /* Four version-1 elements, then guard bytes that must stay untouched. */
    unsigned char raw[4 * EVENT_V1_SIZE + 64];
    memset(raw, 0xAB, sizeof raw);
    int terminal = 0, tokens = 0;
    for (int spins = 0; spins < 300 && !terminal; spins++) {
        uint32_t v1 = EVENT_V1_SIZE;
        memcpy(raw, &v1, sizeof v1);
        CHECK_STATUS(dsv4_poll(engine, (dsv4_event *)(void *)raw, 4, &n, 100), DSV4_OK);
        for (size_t i = 0; i < n; i++) {
            dsv4_event e;
            memset(&e, 0, sizeof e);
            memcpy(&e, raw + i * EVENT_V1_SIZE, EVENT_V1_SIZE);
            CHECK(e.struct_size == EVENT_V1_SIZE);
            CHECK(e.request_id == id);
            if (e.kind == DSV4_EVENT_TOKEN) tokens++;
            else terminal = 1;
        }
        for (size_t i = 4 * EVENT_V1_SIZE; i < sizeof raw; i++) {
            if (raw[i] != 0xAB) {
                CHECK(!"dsv4_poll wrote past the caller's version-1 elements");
                break;
            }
        }
    }
    CHECK(terminal);
    CHECK(tokens == 3);
    dsv4_engine_destroy(engine);
}

/* --- params and request values ---------------------------------------------------------------- */

static void test_the_largest_queue_bound_and_summed_biases(void) {
    dsv4_engine *engine = NULL;
    /* Used to allocate 48 B x 4294967295 up front and abort the process. */
    CHECK_STATUS(dsv4_engine_create(
                     PARAMS_WITH(", \"admission\": {\"max_queued_requests\": 4294967295}"), &engine),
                 DSV4_OK);
    if (!engine) return;
    dsv4_request r = endless();
    static const int32_t twice[] = {5, 5};
    static const float huge[] = {3e38f, 3e38f};
    r.logit_bias_tokens = twice;
    r.logit_bias_values = huge;
    r.logit_bias_len = 2;
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "logit_bias for token 5 adds up to") != NULL);
    dsv4_engine_destroy(engine);
}

int main(void) {
    test_blocking_calls_from_an_event_callback_are_refused();
    test_blocking_calls_from_a_log_callback_on_the_engine_thread_are_refused();
    test_poll_forever_returns_on_shutdown_and_on_a_callback();
    test_poll_stride_is_bounded_and_old_elements_are_not_overrun();
    test_the_largest_queue_bound_and_summed_biases();
    if (failures) {
        fprintf(stderr, "callbacks_test: %d checks failed\n", failures);
        return 1;
    }
    printf("callbacks_test: all checks passed\n");
    return 0;
}
