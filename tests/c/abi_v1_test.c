/* A client compiled against the frozen version-1 header (tests/c/abi_v1/dsv4.h, first on this
 * target's include path) runs against the current library: it submits requests of its size,
 * polls into 88-byte events, reads metrics of its size and receives events in push mode. The
 * structs sit right before an inaccessible page, so a library that reads or writes one byte
 * past the caller's struct_size kills the test (SIGSEGV, reported as such). Then a client of
 * a newer header than the library's: larger struct_size values are accepted, their unknown
 * bytes ignored on input and left untouched on output; garbage sizes are refused. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <dsv4.h>

#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "check.h"

/* Compiled against version 1 for real: the current header's dsv4_event is larger. */
_Static_assert(sizeof(dsv4_event) == 88, "abi_v1_test must include tests/c/abi_v1/dsv4.h");
_Static_assert(sizeof(dsv4_request) == 128, "version 1's dsv4_request is 128 bytes");
_Static_assert(sizeof(dsv4_metrics) == 504, "version 1's dsv4_metrics is 504 bytes");

static const char *PARAMS =
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 1, "
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \"page_size\": 128}}";

static const int32_t PROMPT[] = {5, 17, 300, 2, 9, 44, 81, 120};
static const int32_t NO_EOS_TOKENS[] = {1};
static const float NO_EOS_VALUES[] = {-1000.0f};
#define MAX_NEW 5

/* --- memory that ends at an inaccessible page ------------------------------------------------- */

static void on_segv(int sig) {
    static const char msg[] =
        "abi_v1_test: SIGSEGV: the library read or wrote past the caller's struct_size (into "
        "the guard page after the struct)\n";
    (void)sig;
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(2);
}

typedef struct {
    unsigned char *base;
    size_t len;
} region;

/* `size` bytes (zeroed) whose last byte is followed by a PROT_NONE page. */
static void *guarded(size_t size, region *r) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    r->len = ((size + page - 1) / page + 1) * page;
    void *base = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        perror("mmap");
        _exit(3);
    }
    r->base = base;
    if (mprotect(r->base + r->len - page, page, PROT_NONE) != 0) {
        perror("mprotect");
        _exit(3);
    }
    return r->base + r->len - page - size;
}

static void release(region *r) { munmap(r->base, r->len); }

static int all_bytes(const unsigned char *p, size_t n, unsigned char v) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

/* --- requests --------------------------------------------------------------------------------- */

static void set_fields(dsv4_request *r, uint64_t tag) {
    r->prompt = PROMPT;
    r->prompt_len = sizeof PROMPT / sizeof PROMPT[0];
    r->max_new_tokens = MAX_NEW;
    r->temperature = 0.0f;
    r->logit_bias_tokens = NO_EOS_TOKENS;
    r->logit_bias_values = NO_EOS_VALUES;
    r->logit_bias_len = 1;
    r->user_tag = tag;
}

/* Polls `id` to its terminal event into `cap` elements of `stride` bytes that end at a guard
 * page, checking each element and that the elements past the n returned are untouched; returns
 * the TOKEN events' tokens. */
static int poll_tokens(dsv4_engine *engine, uint64_t id, size_t stride, size_t cap,
                       int32_t *tokens) {
    region mem;
    unsigned char *raw = guarded(cap * stride, &mem);
    int n_tokens = 0, terminal = 0;
    for (int spins = 0; spins < 300 && !terminal; spins++) {
        memset(raw, 0xAB, cap * stride);
        uint32_t size = (uint32_t)stride;
        memcpy(raw, &size, sizeof size);
        size_t n = 0;
        CHECK_STATUS(dsv4_poll(engine, (dsv4_event *)(void *)raw, cap, &n, 100), DSV4_OK);
        CHECK(n <= cap);
        if (n > 0 && n < cap)
            CHECK(all_bytes(raw + n * stride, (cap - n) * stride, 0xAB));
        for (size_t i = 0; i < n && i < cap; i++) {
            const unsigned char *at = raw + i * stride;
            dsv4_event e;
            memcpy(&e, at, sizeof e);
            /* Version 1 gets exactly its 88 bytes; a larger element the library's size, and
             * the rest of the element keeps the caller's bytes. */
            if (stride == sizeof(dsv4_event)) {
                CHECK(e.struct_size == sizeof(dsv4_event));
            } else {
                CHECK(e.struct_size >= sizeof(dsv4_event) && e.struct_size < stride);
                if (e.struct_size < stride)
                    CHECK(all_bytes(at + e.struct_size, stride - e.struct_size, 0xAB));
            }
            CHECK(e.request_id == id);
            if (e.request_id != id) continue;
            if (e.kind == DSV4_EVENT_TOKEN) {
                if (n_tokens < MAX_NEW) tokens[n_tokens] = e.token;
                n_tokens++;
            } else {
                CHECK(e.kind == DSV4_EVENT_FINISHED);
                CHECK(e.finish_reason == DSV4_FINISH_LENGTH);
                CHECK(e.generated_tokens == MAX_NEW);
                terminal = 1;
            }
        }
    }
    CHECK(terminal);
    release(&mem);
    return n_tokens;
}

static void test_submit_and_poll_of_version_1(dsv4_engine *engine, int32_t *tokens) {
    region mem;
    dsv4_request *r = guarded(sizeof(dsv4_request), &mem);
    CHECK_STATUS(dsv4_request_init(r, sizeof *r), DSV4_OK);
    CHECK(r->struct_size == sizeof(dsv4_request));
    CHECK(r->max_new_tokens == 128 && r->temperature == 1.0f && r->top_p == 1.0f);
    set_fields(r, 7);
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, r, &id), DSV4_OK);
    release(&mem);
    /* One element, right before the guard page: every event is written there. */
    CHECK(poll_tokens(engine, id, sizeof(dsv4_event), 1, tokens) == MAX_NEW);
}

/* sizeof(dsv4_request) in the current header (version 2: pd_room and pd_peer appended;
 * version 3: the stop sequences and ignore_eos);
 * requests_test.c, built against that header, asserts the same value. */
#define LIBRARY_REQUEST_SIZE 176

/* The largest request a newer header may have: its bytes past what the library knows hold
 * garbage (fields the library cannot know) and are ignored: the same tokens as version 1. */
static void test_a_newer_request_is_accepted_and_its_unknown_bytes_ignored(
    dsv4_engine *engine, const int32_t *v1_tokens) {
    enum { NEWER = 1024 };
    region mem;
    unsigned char *raw = guarded(NEWER, &mem);
    memset(raw, 0x5A, NEWER);
    dsv4_request *r = (dsv4_request *)(void *)raw;
    CHECK_STATUS(dsv4_request_init(r, NEWER), DSV4_OK);
    CHECK(r->struct_size == NEWER);
    CHECK(r->max_new_tokens == 128 && r->temperature == 1.0f);
    /* dsv4_request_init zeroes what it does not know, up to the size it was given. */
    CHECK(all_bytes(raw + sizeof(dsv4_request), NEWER - sizeof(dsv4_request), 0));
    set_fields(r, 8);
    /* Fields appended since version 1 keep the defaults dsv4_request_init wrote (zeros). */
    memset(raw + LIBRARY_REQUEST_SIZE, 0x5A, NEWER - LIBRARY_REQUEST_SIZE);
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, r, &id), DSV4_OK);
    release(&mem);
    int32_t tokens[MAX_NEW] = {0};
    CHECK(poll_tokens(engine, id, sizeof(dsv4_event), 4, tokens) == MAX_NEW);
    CHECK(memcmp(tokens, v1_tokens, sizeof tokens) == 0);

    /* One byte more than any dsv4_request, and an uninitialised size, are refused. */
    dsv4_request small;
    CHECK_STATUS(dsv4_request_init(&small, sizeof small), DSV4_OK);
    set_fields(&small, 9);
    uint32_t bad[] = {NEWER + 1, 0xdeadbeefu};
    for (size_t k = 0; k < 2; k++) {
        small.struct_size = bad[k];
        CHECK_STATUS(dsv4_submit(engine, &small, &id), DSV4_ERR_INVALID_ARGUMENT);
        char expected[64];
        snprintf(expected, sizeof expected, "request->struct_size = %u is larger", bad[k]);
        CHECK(strstr(dsv4_last_error(), expected) != NULL);
        CHECK(strstr(dsv4_last_error(), "dsv4_request_init(&r, sizeof r)") != NULL);
    }
    CHECK_STATUS(dsv4_request_init(&small, NEWER + 1), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "struct_size = 1025 is larger than any dsv4_request") != NULL);
}

static void test_poll_into_larger_elements(dsv4_engine *engine, const int32_t *v1_tokens) {
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    set_fields(&r, 10);
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    int32_t tokens[MAX_NEW] = {0};
    CHECK(poll_tokens(engine, id, 256, 4, tokens) == MAX_NEW);
    CHECK(memcmp(tokens, v1_tokens, sizeof tokens) == 0);
    /* The largest element size is accepted, one byte more is not. */
    static unsigned char big[2 * 1024 + 8];
    uint32_t size = 1024;
    memcpy(big, &size, sizeof size);
    size_t n = 0;
    CHECK_STATUS(dsv4_poll(engine, (dsv4_event *)(void *)big, 2, &n, 0), DSV4_OK);
    CHECK(n == 0);
    size = 1025;
    memcpy(big, &size, sizeof size);
    CHECK_STATUS(dsv4_poll(engine, (dsv4_event *)(void *)big, 2, &n, 0), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "events[0].struct_size = 1025 is larger than any dsv4_event") !=
          NULL);
}

/* --- push mode -------------------------------------------------------------------------------- */

typedef struct {
    atomic_int events, bad, terminals;
} pushed;

static void on_event(const dsv4_event *e, void *user_data) {
    pushed *p = user_data;
    atomic_fetch_add(&p->events, 1);
    /* The library's own event: at least version 1, its fields where version 1 has them. */
    if (e->struct_size < sizeof(dsv4_event) || e->user_tag != 11 || e->prompt_tokens != 8)
        atomic_fetch_add(&p->bad, 1);
    if (e->kind != DSV4_EVENT_TOKEN) atomic_fetch_add(&p->terminals, 1);
}

static void test_push_mode(dsv4_engine *engine) {
    pushed p;
    atomic_init(&p.events, 0);
    atomic_init(&p.bad, 0);
    atomic_init(&p.terminals, 0);
    CHECK_STATUS(dsv4_set_event_callback(engine, on_event, &p, NULL), DSV4_OK);
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    set_fields(&r, 11);
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    for (int i = 0; i < 3000 && atomic_load(&p.terminals) == 0; i++) {
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK_STATUS(dsv4_set_event_callback(engine, NULL, NULL, NULL), DSV4_OK);
    CHECK(atomic_load(&p.terminals) == 1);
    CHECK(atomic_load(&p.events) == MAX_NEW + 1);
    CHECK(atomic_load(&p.bad) == 0);
}

/* --- metrics ---------------------------------------------------------------------------------- */

static void test_metrics(dsv4_engine *engine, uint64_t requests) {
    /* Version 1's size, ending at a guard page. */
    region mem;
    dsv4_metrics *m = guarded(sizeof(dsv4_metrics), &mem);
    m->struct_size = sizeof(dsv4_metrics);
    CHECK_STATUS(dsv4_metrics_get(engine, m), DSV4_OK);
    CHECK(m->struct_size == sizeof(dsv4_metrics));
    CHECK(m->requests_total == requests);
    CHECK(m->finished_length_total == requests);
    CHECK(m->generation_tokens_total == requests * MAX_NEW);
    CHECK(m->device_slots.total == 4);
    CHECK(m->queue_count == requests);
    release(&mem);

    /* Version 1's size followed by bytes that are not the caller's struct: untouched. */
    unsigned char raw[sizeof(dsv4_metrics) + 64];
    memset(raw, 0xAB, sizeof raw);
    uint32_t size = sizeof(dsv4_metrics);
    memcpy(raw, &size, sizeof size);
    CHECK_STATUS(dsv4_metrics_get(engine, (dsv4_metrics *)(void *)raw), DSV4_OK);
    CHECK(all_bytes(raw + sizeof(dsv4_metrics), 64, 0xAB));
    dsv4_metrics v1;
    memcpy(&v1, raw, sizeof v1);
    CHECK(v1.struct_size == sizeof(dsv4_metrics) && v1.requests_total == requests);

    /* A newer header's larger struct (the largest accepted): the library writes what it knows,
     * says how much, and leaves the rest. */
    enum { NEWER = 4096 };
    unsigned char *big = guarded(NEWER, &mem);
    memset(big, 0xAB, NEWER);
    size = NEWER;
    memcpy(big, &size, sizeof size);
    CHECK_STATUS(dsv4_metrics_get(engine, (dsv4_metrics *)(void *)big), DSV4_OK);
    memcpy(&size, big, sizeof size);
    CHECK(size >= sizeof(dsv4_metrics) && size < NEWER);
    if (size < NEWER) CHECK(all_bytes(big + size, NEWER - size, 0xAB));
    memcpy(&v1, big, sizeof v1);
    CHECK(v1.requests_total == requests && v1.queue_count == requests);
    release(&mem);

    /* One byte more, or garbage: refused, naming the field and the fix; nothing written. */
    uint32_t bad[] = {NEWER + 1, 0xdeadbeefu};
    for (size_t k = 0; k < 2; k++) {
        memset(raw, 0xAB, sizeof raw);
        memcpy(raw, &bad[k], sizeof bad[k]);
        CHECK_STATUS(dsv4_metrics_get(engine, (dsv4_metrics *)(void *)raw),
                     DSV4_ERR_INVALID_ARGUMENT);
        char expected[64];
        snprintf(expected, sizeof expected, "out->struct_size = %u is larger", bad[k]);
        CHECK(strstr(dsv4_last_error(), expected) != NULL);
        CHECK(strstr(dsv4_last_error(), "sizeof(dsv4_metrics)") != NULL);
        CHECK(all_bytes(raw + sizeof bad[k], sizeof raw - sizeof bad[k], 0xAB));
    }
}

int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_segv;
    sigaction(SIGSEGV, &sa, NULL);

    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS, &engine), DSV4_OK);
    if (engine) {
        int32_t v1_tokens[MAX_NEW] = {0};
        test_submit_and_poll_of_version_1(engine, v1_tokens);
        test_a_newer_request_is_accepted_and_its_unknown_bytes_ignored(engine, v1_tokens);
        test_poll_into_larger_elements(engine, v1_tokens);
        test_push_mode(engine);
        test_metrics(engine, 4);
        dsv4_engine_destroy(engine);
    }
    if (failures) {
        fprintf(stderr, "abi_v1_test: %d checks failed\n", failures);
        return 1;
    }
    printf("abi_v1_test: ok\n");
    return 0;
}
