/* What a host needs besides requests, from C: the engine state through a shutdown, finish
 * reason names, the resolved params, the model facts, ignore_eos and stop sequences. Runs on the
 * flash-like fixture (vocab 384, EOS 1, no tokenizer files). */
#include <dsv4.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static const char *PARAMS =
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", \"threads\": 2, "
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \"page_size\": 128}}";

static const int32_t PROMPT[] = {5, 17, 300, 2, 9, 44, 81, 120, 7, 66, 250, 3};
enum { MAX_NEW = 12 };

static dsv4_request request(uint32_t max_new, int32_t eos_bias_token, const float *bias) {
    dsv4_request r;
    CHECK_STATUS(dsv4_request_init(&r, sizeof r), DSV4_OK);
    r.prompt = PROMPT;
    r.prompt_len = sizeof PROMPT / sizeof PROMPT[0];
    r.max_new_tokens = max_new;
    r.temperature = 0.0f;
    static int32_t token;
    token = eos_bias_token;
    r.logit_bias_tokens = &token;
    r.logit_bias_values = bias;
    r.logit_bias_len = 1;
    return r;
}

static const float NO_EOS[] = {-1000.0f};
static const float ALL_EOS[] = {1000.0f};

/* Runs `r` to its end: the tokens (up to MAX_NEW) and the terminal event. */
static dsv4_event run(dsv4_engine *engine, const dsv4_request *r, int32_t *tokens, int *n) {
    dsv4_event events[16], end;
    memset(&end, 0, sizeof end);
    uint64_t id = 0;
    *n = 0;
    CHECK_STATUS(dsv4_submit(engine, r, &id), DSV4_OK);
    for (int spins = 0; spins < 2000; spins++) {
        size_t got = 0;
        events[0].struct_size = sizeof(dsv4_event);
        CHECK_STATUS(dsv4_poll(engine, events, 16, &got, 100), DSV4_OK);
        for (size_t i = 0; i < got; i++) {
            if (events[i].request_id != id) continue;
            if (events[i].kind == DSV4_EVENT_TOKEN) {
                if (*n < MAX_NEW) tokens[*n] = events[i].token;
                (*n)++;
            } else {
                return events[i];
            }
        }
    }
    CHECK(!"no terminal event");
    return end;
}

static void test_finish_reason_names(void) {
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_NONE), "none") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_LENGTH), "length") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_STOP), "stop") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_ABORTED), "aborted") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_TIMEOUT), "timeout") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(DSV4_FINISH_TRANSFERRED), "transferred") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(-1), "unknown") == 0);
    CHECK(strcmp(dsv4_finish_reason_name(6), "unknown") == 0);
}

static void test_state_through_a_shutdown(dsv4_engine *engine) {
    int32_t state = -1;
    size_t needed = 0;
    char reason[256];
    CHECK_STATUS(dsv4_engine_state(engine, &state, reason, sizeof reason, &needed), DSV4_OK);
    CHECK(state == DSV4_STATE_READY);
    CHECK(strcmp(reason, "ready: 0 requests in flight") == 0);
    CHECK(needed == strlen(reason) + 1);
    /* The state alone, the size alone, a small buffer (untouched; the state still written). */
    state = -1;
    CHECK_STATUS(dsv4_engine_state(engine, &state, NULL, 0, NULL), DSV4_OK);
    CHECK(state == DSV4_STATE_READY);
    needed = 0;
    CHECK_STATUS(dsv4_engine_state(engine, &state, NULL, 0, &needed), DSV4_OK);
    CHECK(needed == strlen("ready: 0 requests in flight") + 1);
    char small[4] = {'x', 'x', 'x', 'x'};
    state = -1;
    CHECK_STATUS(dsv4_engine_state(engine, &state, small, sizeof small, &needed),
                 DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(state == DSV4_STATE_READY && small[0] == 'x' && small[3] == 'x');
    CHECK_STATUS(dsv4_engine_state(NULL, &state, NULL, 0, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "engine is NULL") != NULL);
    CHECK_STATUS(dsv4_engine_state(engine, NULL, NULL, 0, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "state is NULL") != NULL);
    CHECK_STATUS(dsv4_engine_state(engine, &state, NULL, 8, &needed), DSV4_ERR_INVALID_ARGUMENT);

    /* A request that runs until aborted, then a drain that cannot finish at once. */
    dsv4_request r = request(1000000, 1, NO_EOS);
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_OK);
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_DRAIN, 0), DSV4_ERR_TIMEOUT);
    CHECK_STATUS(dsv4_engine_state(engine, &state, reason, sizeof reason, NULL), DSV4_OK);
    CHECK(state == DSV4_STATE_DRAINING);
    CHECK(strcmp(reason, "shutting down (drain): 1 request still running") == 0);
    CHECK_STATUS(dsv4_engine_shutdown(engine, DSV4_SHUTDOWN_ABORT, -1), DSV4_OK);
    CHECK_STATUS(dsv4_engine_state(engine, &state, reason, sizeof reason, NULL), DSV4_OK);
    CHECK(state == DSV4_STATE_STOPPED);
    CHECK(strstr(reason, "stopped") != NULL);
}

static void test_params_resolved_and_model_info(dsv4_engine *engine) {
    size_t needed = 0;
    CHECK_STATUS(dsv4_params_resolved(engine, NULL, 0, &needed), DSV4_OK);
    CHECK(needed > 1);
    char *text = malloc(needed);
    if (!text) return;
    CHECK_STATUS(dsv4_params_resolved(engine, text, needed - 1, NULL), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(dsv4_params_resolved(engine, text, needed, NULL), DSV4_OK);
    CHECK(strstr(text, "\"max_running_requests\": 4") != NULL);
    /* Validating the resolved params gives them back unchanged. */
    size_t again_size = 0;
    CHECK_STATUS(dsv4_params_validate(text, NULL, 0, &again_size), DSV4_OK);
    CHECK(again_size == needed);
    char *again = malloc(again_size);
    if (again) {
        CHECK_STATUS(dsv4_params_validate(text, again, again_size, NULL), DSV4_OK);
        CHECK(strcmp(text, again) == 0);
        free(again);
    }
    free(text);
    CHECK_STATUS(dsv4_params_resolved(NULL, NULL, 0, &needed), DSV4_ERR_INVALID_ARGUMENT);

    char info[8192];
    CHECK_STATUS(dsv4_model_info(engine, info, sizeof info, NULL), DSV4_OK);
    CHECK(strstr(info, "\"vocab_size\": 384") != NULL);
    CHECK(strstr(info, "\"eos_token_ids\": [\n    1\n  ]") != NULL);
    CHECK(strstr(info, "\"bos_token_id\":") != NULL);
    CHECK(strstr(info, "\"context_limit\":") != NULL);
    CHECK(strstr(info, "\"has_tokenizer\": false") != NULL);
    CHECK(strstr(info, "\"has_chat_template\": false") != NULL);
}

static void test_ignore_eos_and_stop_sequences(dsv4_engine *engine) {
    int32_t tokens[MAX_NEW];
    int n = 0;
    /* EOS forced: one token and STOP; with ignore_eos, MAX_NEW EOS tokens and LENGTH. */
    dsv4_request r = request(MAX_NEW, 1, ALL_EOS);
    dsv4_event end = run(engine, &r, tokens, &n);
    CHECK(n == 1 && tokens[0] == 1 && end.finish_reason == DSV4_FINISH_STOP);
    r.ignore_eos = 1;
    end = run(engine, &r, tokens, &n);
    CHECK(n == MAX_NEW && tokens[MAX_NEW - 1] == 1 && end.finish_reason == DSV4_FINISH_LENGTH);

    /* The free run (EOS suppressed), then stop sequences taken from it. */
    int32_t free_run[MAX_NEW];
    r = request(MAX_NEW, 1, NO_EOS);
    end = run(engine, &r, free_run, &n);
    CHECK(n == MAX_NEW && end.finish_reason == DSV4_FINISH_LENGTH);
    /* Two sequences, flattened: {free[5], free[6]} (two tokens), then a single token that the
     * run never produces. The first match ends at the first index i >= 1 where the pair
     * occurs. */
    int expect = -1;
    for (int i = 1; i < MAX_NEW && expect < 0; i++)
        if (free_run[i - 1] == free_run[5] && free_run[i] == free_run[6]) expect = i;
    const int32_t flat[] = {free_run[5], free_run[6], 383};
    int absent = 1;
    for (int i = 0; i < MAX_NEW; i++) absent &= free_run[i] != 383;
    const size_t lens[] = {2, 1};
    r.stop_sequences = flat;
    r.stop_sequence_lens = lens;
    r.stop_sequences_len = 2;
    end = run(engine, &r, tokens, &n);
    if (absent) {
        CHECK(n == expect + 1);
        CHECK(memcmp(tokens, free_run, sizeof(int32_t) * (size_t)(expect + 1)) == 0);
        CHECK(end.finish_reason == DSV4_FINISH_STOP);
    }
    /* Bad shapes are refused at submit, naming the field. */
    const size_t zero[] = {2, 0};
    r.stop_sequence_lens = zero;
    uint64_t id = 0;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "stop_sequence_lens[1] is 0") != NULL);
    r.stop_sequence_lens = NULL;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "stop_sequence_lens is NULL") != NULL);
    const size_t past_vocab[] = {1};
    const int32_t big[] = {384};
    r.stop_sequences = big;
    r.stop_sequence_lens = past_vocab;
    r.stop_sequences_len = 1;
    CHECK_STATUS(dsv4_submit(engine, &r, &id), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "outside the vocabulary") != NULL);
}

int main(void) {
    test_finish_reason_names();
    dsv4_engine *engine = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS, &engine), DSV4_OK);
    if (engine) {
        test_params_resolved_and_model_info(engine);
        test_ignore_eos_and_stop_sequences(engine);
        test_state_through_a_shutdown(engine);
        dsv4_engine_destroy(engine);
    }
    if (failures) {
        fprintf(stderr, "hosting_test: %d check(s) failed\n", failures);
        return 1;
    }
    printf("hosting_test: ok\n");
    return 0;
}
