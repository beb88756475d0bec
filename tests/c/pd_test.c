/* Prefill/decode disaggregation through the C API alone: a prefill and a decode engine in one
 * process, joined over TCP on 127.0.0.1. A greedy request through the pair gives the tokens a
 * unified engine gives; the prefill's request ends TRANSFERRED without a token; a decode whose
 * peer is a closed port ends with DSV4_ERR_KV_TRANSFER (peer_dead); bad PD fields are refused;
 * the metrics count what happened. Runs on the flash-like fixture (vocab 384, EOS 1). */
#define _POSIX_C_SOURCE 200809L
#include <dsv4.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

#define MODEL "\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 2, " \
              "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, "    \
              "\"page_size\": 128}"
/* Generous deadlines: the test also runs under valgrind, whose slowdown must not make a peer
 * look dead (30 missed 1 s heartbeats) or a room late. */
#define PD "\"pd\": {\"listen\": \"tcp://127.0.0.1:0\", \"heartbeat_interval_ms\": 1000, "      \
           "\"heartbeat_misses\": 30, \"bootstrap_timeout_ms\": 120000, "                      \
           "\"transfer_timeout_ms\": 120000}"

static const char *UNIFIED = "{" MODEL "}";
static const char *PREFILL = "{" MODEL ", \"role\": \"prefill\", " PD "}";
static const char *DECODE = "{" MODEL ", \"role\": \"decode\", " PD "}";

/* 150 tokens: two pages of 128, the second partly filled. */
#define PROMPT_LEN 150
#define MAX_NEW 8
static int32_t PROMPT[PROMPT_LEN];
static const int32_t NO_EOS_TOKENS[] = {1};
static const float NO_EOS_VALUES[] = {-1000.0f};

static dsv4_engine *create(const char *params) {
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(params, &engine), DSV4_OK);
    return engine;
}

/* Greedy, EOS suppressed: exactly MAX_NEW tokens. The same on every engine of a room. */
static dsv4_request request(uint64_t room, const char *peer) {
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    r.prompt = PROMPT;
    r.prompt_len = PROMPT_LEN;
    r.max_new_tokens = MAX_NEW;
    r.temperature = 0.0f;
    r.seed = 7;
    r.logit_bias_tokens = NO_EOS_TOKENS;
    r.logit_bias_values = NO_EOS_VALUES;
    r.logit_bias_len = 1;
    r.pd_room = room;
    r.pd_peer = peer;
    return r;
}

/* What one request produced: its TOKEN events' ids and its terminal event. */
typedef struct {
    int tokens[64];
    int n_tokens;
    int events;
    dsv4_event end;
    char message[1024];
} outcome;

/* Polls `engine` until request `id` has its terminal event (at most ~120 s). */
static outcome wait_request(dsv4_engine *engine, uint64_t id) {
    outcome o;
    memset(&o, 0, sizeof o);
    dsv4_event events[16];
    for (int spins = 0; spins < 1200; spins++) {
        size_t n = 0;
        events[0].struct_size = sizeof(dsv4_event);
        CHECK_STATUS(dsv4_poll(engine, events, 16, &n, 100), DSV4_OK);
        for (size_t i = 0; i < n; i++) {
            if (events[i].request_id != id) continue;
            o.events++;
            if (events[i].kind == DSV4_EVENT_TOKEN) {
                if (o.n_tokens < 64) o.tokens[o.n_tokens] = events[i].token;
                o.n_tokens++;
                continue;
            }
            o.end = events[i];
            /* The message lives until the next poll on this thread: copied. */
            if (events[i].message) snprintf(o.message, sizeof o.message, "%s", events[i].message);
            o.end.message = NULL;
            return o;
        }
    }
    CHECK(!"no terminal event");
    return o;
}

/* A port on 127.0.0.1 that nothing listens on: bound, read back, closed. */
static int closed_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    if (fd < 0) return 9;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
    CHECK(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
    close(fd);
    return ntohs(a.sin_port);
}

int main(void) {
    for (int i = 0; i < PROMPT_LEN; i++) PROMPT[i] = 2 + (i * 37 + 11) % 380;

    dsv4_engine *unified = create(UNIFIED);
    dsv4_engine *prefill = create(PREFILL);
    dsv4_engine *decode = create(DECODE);
    if (!unified || !prefill || !decode) {
        fprintf(stderr, "engine creation failed\n");
        return 1;
    }

    /* The prefill's endpoint: a size query, a too-small buffer, then the text. */
    size_t needed = 0;
    CHECK_STATUS(dsv4_pd_endpoint(prefill, NULL, 0, &needed), DSV4_OK);
    CHECK(needed > strlen("tcp://127.0.0.1:") + 1);
    char small[4] = "abc";
    size_t again = 0;
    CHECK_STATUS(dsv4_pd_endpoint(prefill, small, sizeof small, &again), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(again == needed && strcmp(small, "abc") == 0);
    char *endpoint = malloc(needed);
    CHECK(endpoint != NULL);
    if (!endpoint) return 1;
    CHECK_STATUS(dsv4_pd_endpoint(prefill, endpoint, needed, &again), DSV4_OK);
    CHECK(again == needed && strlen(endpoint) + 1 == needed);
    CHECK(strncmp(endpoint, "tcp://127.0.0.1:", 16) == 0 && atoi(endpoint + 16) > 0);
    /* The decode has one too (it listens, though nothing connects to it). */
    CHECK_STATUS(dsv4_pd_endpoint(decode, NULL, 0, &again), DSV4_OK);

    /* The unified engine's tokens. */
    dsv4_request r = request(0, NULL);
    uint64_t uid = 0;
    CHECK_STATUS(dsv4_submit(unified, &r, &uid), DSV4_OK);
    outcome want = wait_request(unified, uid);
    CHECK(want.end.kind == DSV4_EVENT_FINISHED && want.end.finish_reason == DSV4_FINISH_LENGTH);
    CHECK(want.n_tokens == MAX_NEW);

    /* Room 1 through the pair: the same request to both, the decode naming the prefill. The
     * decode's comes first, and the prefill's once the claim is held there: a claim arriving
     * on a connection still being set up, for a room whose state is already computed, fails
     * the room on the prefill as if the decode were gone and the decode is never told (a race
     * in src/pd/node.rs add_link), which this test is not about. */
    dsv4_request rp = request(1, NULL);
    dsv4_request rd = request(1, endpoint);
    uint64_t pid = 0, did = 0;
    CHECK_STATUS(dsv4_submit(decode, &rd, &did), DSV4_OK);
    int claimed = 0;
    for (int spins = 0; spins < 2400 && !claimed; spins++) {
        dsv4_metrics m;
        memset(&m, 0, sizeof m);
        m.struct_size = sizeof m;
        CHECK_STATUS(dsv4_metrics_get(prefill, &m), DSV4_OK);
        claimed = m.pd_peers == 1 && m.pd_early_claims == 1;
        struct timespec ts = {0, 50 * 1000 * 1000};
        if (!claimed) nanosleep(&ts, NULL);
    }
    CHECK(claimed);
    CHECK_STATUS(dsv4_submit(prefill, &rp, &pid), DSV4_OK);
    outcome got = wait_request(decode, did);
    CHECK(got.end.kind == DSV4_EVENT_FINISHED);
    CHECK(got.end.finish_reason == DSV4_FINISH_LENGTH);
    CHECK(got.end.status == DSV4_OK);
    CHECK(got.n_tokens == MAX_NEW && got.events == MAX_NEW + 1);
    CHECK(got.end.generated_tokens == MAX_NEW);
    CHECK(got.end.prompt_tokens == PROMPT_LEN);
    CHECK(memcmp(got.tokens, want.tokens, sizeof(int) * MAX_NEW) == 0);
    for (int i = 0; i < MAX_NEW && i < got.n_tokens; i++) {
        if (got.tokens[i] != want.tokens[i]) {
            fprintf(stderr, "token %d: pair %d, unified %d\n", i, got.tokens[i], want.tokens[i]);
        }
    }
    outcome sent = wait_request(prefill, pid);
    CHECK(sent.events == 1 && sent.n_tokens == 0); /* the prefill emits no token */
    CHECK(sent.end.kind == DSV4_EVENT_FINISHED);
    CHECK(sent.end.finish_reason == DSV4_FINISH_TRANSFERRED);
    CHECK(sent.end.status == DSV4_OK);
    CHECK(sent.end.prompt_tokens == PROMPT_LEN);
    /* Nothing more for either request. */
    dsv4_event extra[4];
    size_t n = 0;
    extra[0].struct_size = sizeof(dsv4_event);
    CHECK_STATUS(dsv4_poll(prefill, extra, 4, &n, 50), DSV4_OK);
    CHECK(n == 0);
    extra[0].struct_size = sizeof(dsv4_event);
    CHECK_STATUS(dsv4_poll(decode, extra, 4, &n, 50), DSV4_OK);
    CHECK(n == 0);

    /* pd_room 0 on a PD engine is refused, on either side. */
    uint64_t id = 0;
    dsv4_request bad = request(0, NULL);
    CHECK_STATUS(dsv4_submit(prefill, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "pd_room") != NULL);
    bad = request(0, endpoint);
    CHECK_STATUS(dsv4_submit(decode, &bad, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "pd_room") != NULL);

    /* The same room twice on one engine while the first is live: refused; the first is then
     * aborted (it waited for a claim that never comes). */
    dsv4_request twice = request(2, NULL);
    uint64_t first = 0;
    CHECK_STATUS(dsv4_submit(prefill, &twice, &first), DSV4_OK);
    CHECK_STATUS(dsv4_submit(prefill, &twice, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "pd_room 2 is already in use") != NULL);
    CHECK_STATUS(dsv4_abort(prefill, first), DSV4_OK);
    outcome aborted = wait_request(prefill, first);
    CHECK(aborted.end.kind == DSV4_EVENT_FINISHED);
    CHECK(aborted.end.finish_reason == DSV4_FINISH_ABORTED);
    CHECK(aborted.n_tokens == 0);

    /* A decode whose peer is a closed port: the claim cannot connect. */
    char dead[64];
    snprintf(dead, sizeof dead, "tcp://127.0.0.1:%d", closed_port());
    dsv4_request lost = request(3, dead);
    uint64_t lid = 0;
    CHECK_STATUS(dsv4_submit(decode, &lost, &lid), DSV4_OK);
    outcome failed = wait_request(decode, lid);
    CHECK(failed.end.kind == DSV4_EVENT_ERROR);
    CHECK(failed.end.status == DSV4_ERR_KV_TRANSFER);
    CHECK(failed.n_tokens == 0);
    CHECK(strstr(failed.message, "peer_dead") != NULL);
    CHECK(strstr(failed.message, dead) != NULL);
    if (!strstr(failed.message, "peer_dead")) fprintf(stderr, "message: %s\n", failed.message);

    /* The books: one room transferred on each side; nothing left in flight. */
    dsv4_metrics mp, md;
    memset(&mp, 0, sizeof mp);
    memset(&md, 0, sizeof md);
    mp.struct_size = sizeof mp;
    md.struct_size = sizeof md;
    CHECK_STATUS(dsv4_metrics_get(prefill, &mp), DSV4_OK);
    CHECK_STATUS(dsv4_metrics_get(decode, &md), DSV4_OK);
    CHECK(mp.struct_size == sizeof mp && md.struct_size == sizeof md);
    CHECK(mp.kv_transfer_requests_total == 1);
    CHECK(md.kv_transfer_requests_total == 1);
    CHECK(mp.kv_transfer_bytes_total > 0 && mp.kv_transfer_bytes_total == md.kv_transfer_bytes_total);
    CHECK(mp.num_prefill_bootstrap_queue_reqs == 0 && md.num_prefill_bootstrap_queue_reqs == 0);
    CHECK(mp.num_prefill_inflight_queue_reqs == 0);
    CHECK(md.num_decode_prealloc_queue_reqs == 0 && md.num_decode_transfer_queue_reqs == 0);
    CHECK(mp.pd_pages_held == 0 && md.pd_pages_held == 0);
    CHECK(mp.pd_early_claims == 0);
    /* The prefill's room 2 failed as aborted; the decode's room 3 as peer_dead. */
    CHECK(mp.kv_transfer_failures_total == 1 && mp.kv_transfer_failures_aborted_total == 1);
    CHECK(md.kv_transfer_failures_total == 1 && md.kv_transfer_failures_peer_dead_total == 1);
    CHECK(mp.num_running_reqs == 0 && md.num_running_reqs == 0);
    CHECK(mp.num_queue_reqs == 0 && md.num_queue_reqs == 0);
    CHECK(md.finished_length_total == 1 && mp.finished_length_total == 0);
    CHECK(mp.aborted_total == 1 && md.failed_total == 1);
    /* dsv4_metrics has no counter of TRANSFERRED ends; the exposition does. */
    size_t size = 0;
    CHECK_STATUS(dsv4_metrics_prometheus(prefill, NULL, 0, &size), DSV4_OK);
    char *text = malloc(size);
    CHECK(text != NULL);
    if (text) {
        CHECK_STATUS(dsv4_metrics_prometheus(prefill, text, size, &size), DSV4_OK);
        CHECK(strstr(text, "\ndsv4_num_finished_requests_total{finish_reason=\"transferred\"} 1\n") != NULL);
        CHECK(strstr(text, "\ndsv4_kv_transfer_requests_total 1\n") != NULL);
        free(text);
    }

    free(endpoint);
    dsv4_engine_destroy(decode);
    dsv4_engine_destroy(prefill);
    dsv4_engine_destroy(unified);
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("pd_test: all checks passed\n");
    return failures ? 1 : 0;
}
