/*
 * dsv4-serve-demo: what a C server does with dsv4, on a model directory (the tiny test model
 * by default): create an engine, absorb a burst of requests that share a system prompt,
 * refuse what does not fit the admission limits at once, stream tokens, report prefix-cache
 * hits and latencies, drain and shut down.
 *
 *   dsv4-serve-demo MODEL_DIR
 *
 * Exit status (also in --help): 0 when every accepted request finished, 1 otherwise (or when
 * the engine could not be created), 2 on usage errors.
 */
#include <dsv4.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUESTS 12
#define SYSTEM_LEN 300

static void usage(FILE *to, const char *program) {
    fprintf(to,
            "usage: %s MODEL_DIR\n"
            "\n"
            "Serves %d requests sharing a system prompt on the model in MODEL_DIR (CPU\n"
            "backend): one to fill the prefix cache, then a burst; admission refusals,\n"
            "streaming, prefix-cache hits, latencies, drain.\n"
            "\n"
            "exit status:\n"
            "  0  every accepted request finished\n"
            "  1  a request did not finish, or the engine could not be created\n"
            "  2  usage error\n",
            program, REQUESTS);
}

int main(int argc, char **argv) {
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout, argv[0]);
        return 0;
    }
    if (argc != 2 || argv[1][0] == '-') {
        usage(stderr, argv[0]);
        return 2;
    }
    char params[1024];
    snprintf(params, sizeof params,
             "{\"model_path\": \"%s\", \"threads\": 2,"
             " \"kv\": {\"device_memory_bytes\": \"64MiB\", \"max_running_requests\": 4,"
             "          \"page_size\": 128},"
             " \"admission\": {\"max_queued_requests\": 6},"
             " \"scheduler\": {\"chunked_prefill_tokens\": 128, \"max_batch_tokens\": 256}}",
             argv[1]);
    dsv4_engine *engine = NULL;
    if (dsv4_engine_create(params, &engine) != DSV4_OK) {
        fprintf(stderr, "engine: %s\n", dsv4_last_error());
        return 1;
    }
    /* A shared 300-token "system prompt", then a short question per request. */
    int32_t prompt[SYSTEM_LEN + 8];
    for (int i = 0; i < SYSTEM_LEN; i++) prompt[i] = 2 + (i * 37) % 380;
    uint64_t ids[REQUESTS];
    int accepted = 0, refused = 0;
    for (int r = 0; r < REQUESTS; r++) {
        for (int i = 0; i < 8; i++) prompt[SYSTEM_LEN + i] = 2 + (r * 11 + i * 5) % 380;
        dsv4_request req;
        dsv4_request_init(&req, sizeof req);
        req.prompt = prompt;
        req.prompt_len = SYSTEM_LEN + 8;
        req.max_new_tokens = 16;
        req.temperature = r % 2 ? 0.8f : 0.0f;
        req.seed = 1000 + (uint64_t)r;
        req.user_tag = (uint64_t)r;
        dsv4_status s = dsv4_submit(engine, &req, &ids[accepted]);
        if (s == DSV4_OK) {
            accepted++;
        } else {
            refused++;
            if (refused == 1) printf("refused at once: %s: %s\n", dsv4_status_name(s), dsv4_last_error());
        }
        if (r == 0) {
            /* Let the first request populate the prefix cache before the burst. */
            dsv4_event ev[32];
            size_t n = 0;
            int done = 0;
            while (!done) {
                ev[0].struct_size = sizeof(dsv4_event);
                if (dsv4_poll(engine, ev, 32, &n, -1) != DSV4_OK) break;
                for (size_t i = 0; i < n; i++) {
                    if (ev[i].kind != DSV4_EVENT_TOKEN) {
                        printf("request %2llu: %u prompt tokens, %u cached, %u generated, ttft %.1f ms\n",
                               (unsigned long long)ev[i].user_tag, ev[i].prompt_tokens,
                               ev[i].cached_tokens_device, ev[i].generated_tokens,
                               ev[i].ttft_us / 1000.0);
                        done = 1;
                    }
                }
            }
        }
    }
    printf("burst of %d: %d accepted, %d refused (4 run at once, admission.max_queued_requests = 6)\n",
           REQUESTS - 1, accepted - 1, refused);
    int finished = 1, hits = 0;
    static const char *reasons[] = {"none", "length", "stop", "aborted", "timeout",
                                    "transferred"};
    while (finished < accepted) {
        dsv4_event ev[64];
        size_t n = 0;
        ev[0].struct_size = sizeof(dsv4_event);
        if (dsv4_poll(engine, ev, 64, &n, 10000) != DSV4_OK || n == 0) break;
        for (size_t i = 0; i < n; i++) {
            if (ev[i].kind == DSV4_EVENT_TOKEN) continue;
            finished += ev[i].kind == DSV4_EVENT_FINISHED;
            hits += ev[i].cached_tokens_device > 0;
            printf("request %2llu: %s, %u prompt tokens, %u cached, %u generated, queue %.1f ms, "
                   "ttft %.1f ms\n",
                   (unsigned long long)ev[i].user_tag, reasons[ev[i].finish_reason],
                   ev[i].prompt_tokens, ev[i].cached_tokens_device, ev[i].generated_tokens,
                   ev[i].queue_us / 1000.0, ev[i].ttft_us / 1000.0);
        }
    }
    dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_DRAIN, -1);
    dsv4_engine_destroy(engine);
    printf("served %d of %d accepted requests; %d reused the cached system prompt\n", finished,
           accepted, hits);
    return finished == accepted ? 0 : 1;
}
