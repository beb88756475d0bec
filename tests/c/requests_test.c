/* The request API from C: submit, poll, callbacks, abort, shutdown and destroy with requests
 * in flight, and every kind of bad input. Runs on the flash-like fixture (vocab 384, EOS 1). */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <dsv4.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* abi_v1_test.c fills the bytes past this size with garbage as a newer header's fields. */
_Static_assert(sizeof(dsv4_request) == 176, "dsv4_request of the current header: update abi_v1_test.c");

static const char *PARAMS =
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 2, "
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \"page_size\": 128}}";

static const int32_t PROMPT[] = {5, 17, 300, 2, 9, 44, 81, 120, 7, 66, 250, 3};
static const int32_t NO_EOS_TOKENS[] = {1};
static const float NO_EOS_VALUES[] = {-1000.0f};

static dsv4_engine *create(void) {
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS, &engine), DSV4_OK);
    return engine;
}

static dsv4_request request(uint32_t max_new) {
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    r.prompt = PROMPT;
    r.prompt_len = sizeof PROMPT / sizeof PROMPT[0];
    r.max_new_tokens = max_new;
    r.temperature = 0.0f;
    return r;
}

/* A request that only ends when aborted: EOS suppressed, a huge length. */
static dsv4_request endless(void) {
    dsv4_request r = request(1000000);
    r.logit_bias_tokens = NO_EOS_TOKENS;
    r.logit_bias_values = NO_EOS_VALUES;
    r.logit_bias_len = 1;
    return r;
}

/* Polls until `id` has its terminal event; returns it and counts TOKEN events. */
static dsv4_event wait_terminal(dsv4_engine *engine, uint64_t id, int *tokens) {
    dsv4_event events[16];
    dsv4_event last;
    memset(&last, 0, sizeof last);
    *tokens = 0;
    for (int spins = 0; spins < 2000; spins++) {
        size_t n = 0;
        events[0].struct_size = sizeof(dsv4_event);
        CHECK_STATUS(dsv4_poll(engine, events, 16, &n, 100), DSV4_OK);
        for (size_t i = 0; i < n; i++) {
            if (events[i].request_id != id) continue;
            if (events[i].kind == DSV4_EVENT_TOKEN) {
                (*tokens)++;
            } else {
                return events[i];
            }
        }
    }
    CHECK(!"no terminal event");
    return last;
}

static void test_generate_and_bad_input(void) {
    dsv4_engine *engine = create();
    if (!engine) return;
    dsv4_request r = request(6);
    r.user_tag = 42;
    r.logprobs = 1;
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    CHECK(id != 0);
    int tokens = 0;
    dsv4_event end = wait_terminal(engine, id, &tokens);
    CHECK(end.kind == DSV4_EVENT_FINISHED);
    CHECK(end.finish_reason == DSV4_FINISH_LENGTH || end.finish_reason == DSV4_FINISH_STOP);
    CHECK(end.user_tag == 42);
    CHECK(end.prompt_tokens == 12);
    CHECK((int)end.generated_tokens == tokens && tokens >= 1 && tokens <= 6);
    CHECK(end.struct_size == sizeof(dsv4_event));
    /* Abort of a finished or unknown id. */
    CHECK_STATUS(dsv4_abort(engine, id), DSV4_ERR_NOT_FOUND);
    CHECK_STATUS(dsv4_abort(engine, 987654), DSV4_ERR_NOT_FOUND);

    /* Bad requests: nothing accepted, no event. */
    CHECK_STATUS(dsv4_submit(NULL, &r, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_submit(engine, NULL, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_submit(engine, &r, NULL), DSV4_ERR_INVALID_ARGUMENT);
    dsv4_request bad = request(4);
    bad.prompt_len = 0;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "the prompt is empty") != NULL);
    bad = request(4);
    bad.prompt = NULL;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    const int32_t oov[] = {3, 384};
    bad = request(4);
    bad.prompt = oov;
    bad.prompt_len = 2;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "token id 384 at index 1") != NULL);
    bad = request(4);
    bad.struct_size = 8;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "smaller than version 1") != NULL);
    CHECK_STATUS(dsv4_request_init(&bad, 4), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_request_init(NULL, sizeof bad), DSV4_ERR_INVALID_ARGUMENT);
    bad = request(4);
    bad.top_p = 0.0f;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);

    /* PD fields: dsv4_request_init leaves them unset, and a unified engine refuses them. */
    bad = request(4);
    CHECK(bad.pd_room == 0 && bad.pd_peer == NULL);
    bad.pd_room = 7;
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "pd_room = 7") != NULL);
    CHECK(strstr(dsv4_last_error(), "unified") != NULL);
    bad = request(4);
    bad.pd_peer = "tcp://127.0.0.1:9";
    CHECK_STATUS(dsv4_submit(engine, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "tcp://127.0.0.1:9") != NULL);
    /* ... and has no PD endpoint (a size query included); nothing is written. */
    char endpoint[64] = "untouched";
    size_t endpoint_size = 0;
    CHECK_STATUS(dsv4_pd_endpoint(engine, endpoint, sizeof endpoint, &endpoint_size),
                 DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "role") != NULL);
    CHECK(strcmp(endpoint, "untouched") == 0);
    CHECK_STATUS(dsv4_pd_endpoint(engine, NULL, 0, &endpoint_size), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "role") != NULL);
    CHECK_STATUS(dsv4_pd_endpoint(NULL, endpoint, sizeof endpoint, &endpoint_size),
                 DSV4_ERR_INVALID_ARGUMENT);

    /* Poll: cap 0, NULLs, a too-small element size; nothing is pending: timeout → OK, 0. */
    dsv4_event events[4];
    size_t n = 99;
    events[0].struct_size = sizeof(dsv4_event);
    CHECK_STATUS(dsv4_poll(engine, events, 0, &n, 0), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_poll(engine, NULL, 4, &n, 0), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_poll(engine, events, 4, NULL, 0), DSV4_ERR_INVALID_ARGUMENT);
    events[0].struct_size = 12;
    CHECK_STATUS(dsv4_poll(engine, events, 4, &n, 0), DSV4_ERR_INVALID_ARGUMENT);
    events[0].struct_size = sizeof(dsv4_event);
    CHECK_STATUS(dsv4_poll(engine, events, 4, &n, 20), DSV4_OK);
    CHECK(n == 0);

    /* Cache statistics and flushes. */
    size_t needed = 0;
    CHECK_STATUS(dsv4_cache_stats(engine, NULL, 0, &needed), DSV4_OK);
    char *stats = malloc(needed);
    CHECK_STATUS(dsv4_cache_stats(engine, stats, needed, &needed), DSV4_OK);
    CHECK(strstr(stats, "\"c4_kv\"") != NULL && strstr(stats, "\"hit_tokens\"") != NULL);
    free(stats);
    CHECK_STATUS(dsv4_cache_flush(engine, "device"), DSV4_OK);
    CHECK_STATUS(dsv4_cache_flush(engine, "disk"), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_cache_flush(engine, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_cache_stats(NULL, NULL, 0, &needed), DSV4_ERR_INVALID_ARGUMENT);

    /* Shutdown: later submits are refused; a bad mode is refused. */
    CHECK_STATUS(dsv4_engine_shutdown(engine, 7, -1), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_DRAIN, -1), DSV4_OK);
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_ERR_SHUTDOWN);
    CHECK_STATUS(dsv4_poll(engine, events, 4, &n, -1), DSV4_OK); /* returns on a stopped engine */
    CHECK(n == 0);
    dsv4_engine_destroy(engine);
}

/* Push mode. */
typedef struct {
    pthread_mutex_t lock;
    int tokens, terminals, aborted, dropped;
    uint64_t last_id;
} counter;

static void on_event(const dsv4_event *e, void *user_data) {
    counter *c = user_data;
    pthread_mutex_lock(&c->lock);
    if (e->kind == DSV4_EVENT_TOKEN) c->tokens++;
    else {
        c->terminals++;
        if (e->finish_reason == DSV4_FINISH_ABORTED) c->aborted++;
    }
    c->last_id = e->request_id;
    pthread_mutex_unlock(&c->lock);
}

static void on_drop(void *user_data) {
    counter *c = user_data;
    pthread_mutex_lock(&c->lock);
    c->dropped++;
    pthread_mutex_unlock(&c->lock);
}

static int terminals(counter *c) {
    pthread_mutex_lock(&c->lock);
    int t = c->terminals;
    pthread_mutex_unlock(&c->lock);
    return t;
}

static void test_callbacks(void) {
    dsv4_engine *engine = create();
    if (!engine) return;
    counter c;
    memset(&c, 0, sizeof c);
    pthread_mutex_init(&c.lock, NULL);
    /* One event queued before the callback is set is delivered to it. */
    dsv4_request r = request(3);
    uint64_t first = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &first), DSV4_OK);
    CHECK_STATUS(dsv4_set_event_callback(engine, on_event, &c, on_drop), DSV4_OK);
    dsv4_event events[2];
    size_t n = 0;
    events[0].struct_size = sizeof(dsv4_event);
    CHECK_STATUS(dsv4_poll(engine, events, 2, &n, 0), DSV4_ERR_UNSUPPORTED);
    CHECK(strstr(dsv4_last_error(), "callback is set") != NULL);
    for (int i = 0; i < 200 && terminals(&c) < 1; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK(terminals(&c) == 1);
    /* Back to polling: on_drop runs once. */
    CHECK_STATUS(dsv4_set_event_callback(engine, NULL, NULL, NULL), DSV4_OK);
    CHECK(c.dropped == 1);
    CHECK_STATUS(dsv4_poll(engine, events, 2, &n, 0), DSV4_OK);
    /* Destroy with requests in flight in callback mode: each gets its terminal event. */
    CHECK_STATUS(dsv4_set_event_callback(engine, on_event, &c, on_drop), DSV4_OK);
    dsv4_request e = endless();
    uint64_t ids[6];
    for (int i = 0; i < 6; i++) CHECK_STATUS(dsv4_submit(engine, &e, &ids[i]), DSV4_OK);
    struct timespec ts = {0, 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    dsv4_engine_destroy(engine);
    CHECK(c.terminals == 7);
    CHECK(c.aborted == 6);
    CHECK(c.dropped == 2);
    pthread_mutex_destroy(&c.lock);
}

static void test_destroy_in_flight_poll_mode(void) {
    dsv4_engine *engine = create();
    if (!engine) return;
    dsv4_request e = endless();
    uint64_t id = 0;
    for (int i = 0; i < 6; i++) CHECK_STATUS(dsv4_submit(engine, &e, &id), DSV4_OK);
    /* Abort one explicitly, then destroy with the rest running and events unpolled. */
    CHECK_STATUS(dsv4_abort(engine, id), DSV4_OK);
    dsv4_engine_destroy(engine);
}

static void test_shutdown_abort(void) {
    dsv4_engine *engine = create();
    if (!engine) return;
    dsv4_request e = endless();
    uint64_t ids[3];
    for (int i = 0; i < 3; i++) CHECK_STATUS(dsv4_submit(engine, &e, &ids[i]), DSV4_OK);
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_ABORT, 10000), DSV4_OK);
    /* The terminal events stay pollable after shutdown. */
    int aborted[3] = {0, 0, 0};
    dsv4_event events[64];
    size_t n = 0;
    do {
        events[0].struct_size = sizeof(dsv4_event);
        CHECK_STATUS(dsv4_poll(engine, events, 64, &n, 0), DSV4_OK);
        for (size_t i = 0; i < n; i++) {
            for (int k = 0; k < 3; k++) {
                if (events[i].request_id == ids[k] && events[i].kind != DSV4_EVENT_TOKEN) {
                    CHECK(events[i].kind == DSV4_EVENT_FINISHED);
                    CHECK(events[i].finish_reason == DSV4_FINISH_ABORTED);
                    aborted[k]++;
                }
            }
        }
    } while (n > 0);
    for (int k = 0; k < 3; k++) CHECK(aborted[k] == 1);
    CHECK_STATUS(dsv4_abort(engine, ids[0]), DSV4_ERR_NOT_FOUND);
    dsv4_engine_destroy(engine);
}

/* Metrics after a known workload: two finished requests and one refused submit. */
static void test_metrics(void) {
    dsv4_engine *engine = create();
    dsv4_metrics m;
    memset(&m, 0, sizeof m);
    CHECK_STATUS(dsv4_metrics_get(engine, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_metrics_get(NULL, &m), DSV4_ERR_INVALID_ARGUMENT);
    m.struct_size = 8; /* older than version 1 */
    CHECK_STATUS(dsv4_metrics_get(engine, &m), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "sizeof(dsv4_metrics)") != NULL);

    int generated = 0;
    for (int k = 0; k < 2; k++) {
        dsv4_request r = request(6);
        r.logit_bias_tokens = NO_EOS_TOKENS;
        r.logit_bias_values = NO_EOS_VALUES;
        uint64_t id = 0;
        CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
        int tokens = 0;
        wait_terminal(engine, id, &tokens);
        generated += tokens;
    }
    dsv4_request bad = request(4);
    bad.prompt_len = 0;
    uint64_t ignored = 0;
    CHECK_STATUS(dsv4_submit(engine, &bad, &ignored), DSV4_ERR_INVALID_ARGUMENT);

    m.struct_size = sizeof m;
    CHECK_STATUS(dsv4_metrics_get(engine, &m), DSV4_OK);
    CHECK(m.struct_size == sizeof m);
    CHECK(m.requests_total == 2);
    CHECK(m.finished_length_total == 2);
    CHECK(m.rejected_invalid_total == 1);
    CHECK(m.generation_tokens_total == (uint64_t)generated && generated == 12);
    CHECK(m.prompt_tokens_total == 2 * sizeof PROMPT / sizeof PROMPT[0]);
    CHECK(m.ttft_count == 2 && m.itl_count == 10 && m.e2e_count == 2);
    CHECK(m.num_running_reqs == 0 && m.num_queue_reqs == 0);
    CHECK(m.device_slots.total == 4 && m.device_slots.used == 0);
    CHECK(m.device_pages.total > 0 && m.device_pages.total_bytes > m.device_pages.total);

    size_t needed = 0;
    CHECK_STATUS(dsv4_metrics_prometheus(engine, NULL, 0, &needed), DSV4_OK); /* a size query */
    CHECK(needed > 1000);
    char small[16];
    CHECK_STATUS(dsv4_metrics_prometheus(engine, small, sizeof small, &needed), DSV4_ERR_BUFFER_TOO_SMALL);
    char *text = malloc(needed);
    CHECK(text != NULL);
    const size_t asked = needed;
    CHECK_STATUS(dsv4_metrics_prometheus(engine, text, needed, &needed), DSV4_OK);
    /* The size query leaves headroom for values that change between calls (free memory, the
     * stall clock); a successful call reports what it wrote. */
    CHECK(needed == strlen(text) + 1 && asked >= needed + 200);
    CHECK(strstr(text, "\ndsv4_generation_tokens_total 12\n") != NULL);
    CHECK(strstr(text, "dsv4_num_rejected_requests_total{reason=\"invalid_argument\"} 1\n") != NULL);
    free(text);
    dsv4_engine_destroy(engine);
}

int main(void) {
    test_generate_and_bad_input();
    test_callbacks();
    test_destroy_in_flight_poll_mode();
    test_shutdown_abort();
    test_metrics();
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("requests_test: all checks passed\n");
    return failures ? 1 : 0;
}
