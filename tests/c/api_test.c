/* The C API conventions, exercised from C: fixed status values, names, version macros, the
 * thread-local last error, NULL handling, the (buf, cap, needed) pattern, validation messages,
 * the log callback and concurrent calls. Built against both dsv4::shared and dsv4::static. */
#include <dsv4.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* The values external code relies on. */
_Static_assert(DSV4_OK == 0, "ok");
_Static_assert(DSV4_ERR_INVALID_ARGUMENT == -1, "");
_Static_assert(DSV4_ERR_CONFIG == -2, "");
_Static_assert(DSV4_ERR_IO == -3, "");
_Static_assert(DSV4_ERR_MODEL_FORMAT == -4, "");
_Static_assert(DSV4_ERR_CAPACITY == -5, "");
_Static_assert(DSV4_ERR_QUEUE_FULL == -6, "");
_Static_assert(DSV4_ERR_TIMEOUT == -7, "");
_Static_assert(DSV4_ERR_ABORTED == -8, "");
_Static_assert(DSV4_ERR_KV_TRANSFER == -9, "");
_Static_assert(DSV4_ERR_BUFFER_TOO_SMALL == -10, "");
_Static_assert(DSV4_ERR_UNSUPPORTED == -11, "");
_Static_assert(DSV4_ERR_SHUTDOWN == -12, "");
_Static_assert(DSV4_ERR_NOT_FOUND == -13, "");
_Static_assert(DSV4_ERR_INTERNAL == -99, "");

static const char *FLASH = "{\"model_path\": \"" DSV4_REPO "/configs/deepseek-v4-flash\", "
                           "\"backend\": \"cuda\", \"kv\": {\"device_memory_bytes\": \"4GiB\", "
                           "\"max_running_requests\": 8}, \"hicache\": {\"enabled\": true, "
                           "\"size_bytes\": \"150GB\"}}";

static void test_names_and_version(void) {
    const dsv4_status all[] = {DSV4_OK,
                               DSV4_ERR_INVALID_ARGUMENT,
                               DSV4_ERR_CONFIG,
                               DSV4_ERR_IO,
                               DSV4_ERR_MODEL_FORMAT,
                               DSV4_ERR_CAPACITY,
                               DSV4_ERR_QUEUE_FULL,
                               DSV4_ERR_TIMEOUT,
                               DSV4_ERR_ABORTED,
                               DSV4_ERR_KV_TRANSFER,
                               DSV4_ERR_BUFFER_TOO_SMALL,
                               DSV4_ERR_UNSUPPORTED,
                               DSV4_ERR_SHUTDOWN,
                               DSV4_ERR_NOT_FOUND,
                               DSV4_ERR_INTERNAL};
    const char *names[] = {"DSV4_OK",
                           "DSV4_ERR_INVALID_ARGUMENT",
                           "DSV4_ERR_CONFIG",
                           "DSV4_ERR_IO",
                           "DSV4_ERR_MODEL_FORMAT",
                           "DSV4_ERR_CAPACITY",
                           "DSV4_ERR_QUEUE_FULL",
                           "DSV4_ERR_TIMEOUT",
                           "DSV4_ERR_ABORTED",
                           "DSV4_ERR_KV_TRANSFER",
                           "DSV4_ERR_BUFFER_TOO_SMALL",
                           "DSV4_ERR_UNSUPPORTED",
                           "DSV4_ERR_SHUTDOWN",
                           "DSV4_ERR_NOT_FOUND",
                           "DSV4_ERR_INTERNAL"};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        CHECK(strcmp(dsv4_status_name(all[i]), names[i]) == 0);
    CHECK(strcmp(dsv4_status_name(12345), "DSV4_STATUS_UNKNOWN") == 0);

    char macros[64];
    snprintf(macros, sizeof macros, "%d.%d.%d", DSV4_VERSION_MAJOR, DSV4_VERSION_MINOR,
             DSV4_VERSION_PATCH);
    CHECK(strcmp(macros, DSV4_VERSION_STRING) == 0);
    CHECK(strcmp(dsv4_version(), DSV4_VERSION_STRING) == 0);
    CHECK(strcmp(dsv4_version(), DSV4_CARGO_VERSION) == 0); /* from the installed package */
}

static void test_null_arguments(void) {
    char buf[16];
    size_t needed = 0;
    CHECK(strcmp(dsv4_last_error(), "") == 0); /* nothing failed on this thread yet */
    CHECK_STATUS(dsv4_plan(NULL, buf, sizeof buf, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "params_json is NULL") != NULL);
    CHECK_STATUS(dsv4_plan_text(NULL, NULL, 0, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_params_validate(NULL, NULL, 0, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_params_default(NULL, 0, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_params_default(NULL, 10, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "buf is NULL but cap is 10") != NULL);
}

static void test_output_buffers(void) {
    size_t needed = 0;
    CHECK_STATUS(dsv4_params_default(NULL, 0, &needed), DSV4_OK);
    CHECK(needed > 100);
    char *small = malloc(needed - 1);
    memset(small, 'x', needed - 1);
    CHECK_STATUS(dsv4_params_default(small, needed - 1, &needed), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(small[0] == 'x' && small[needed - 2] == 'x'); /* untouched */
    free(small);
    char *exact = malloc(needed);
    CHECK_STATUS(dsv4_params_default(exact, needed, &needed), DSV4_OK);
    CHECK(strlen(exact) + 1 == needed);
    CHECK(strstr(exact, "\"page_size\": 256") != NULL);
    CHECK(strstr(exact, "\"write_policy\": \"write_through\"") != NULL);
    free(exact);
}

static void test_validation_messages(void) {
    size_t needed = 0;
    CHECK_STATUS(dsv4_params_validate("{\"hicache\": {\"write_polcy\": 1}, \"kv\": {\"page_size\": "
                                      "100}, \"backend\": \"gpu\"}",
                                      NULL, 0, &needed),
                 DSV4_ERR_CONFIG);
    const char *e = dsv4_last_error();
    CHECK(strstr(e, "3 problems in params") != NULL);
    CHECK(strstr(e, "unknown key `hicache.write_polcy` — did you mean `hicache.write_policy`?"));
    CHECK(strstr(e, "`kv.page_size` = 100 is below the minimum 128 tokens: use a multiple of 128") != NULL);
    CHECK(strstr(e, "`backend` = \"gpu\" is not one of cpu, cuda") != NULL);
    CHECK_STATUS(dsv4_params_validate("{\"kv\": ", NULL, 0, &needed), DSV4_ERR_CONFIG);
    CHECK(strstr(dsv4_last_error(), "not valid JSON") != NULL);
    CHECK_STATUS(dsv4_params_validate("{\"model_path\": \"\xff\"}", NULL, 0, &needed),
                 DSV4_ERR_CONFIG);
    CHECK(strstr(dsv4_last_error(), "not valid UTF-8") != NULL);
    CHECK_STATUS(dsv4_plan("{\"model_path\": \"/nonexistent/dsv4-model\"}", NULL, 0, &needed),
                 DSV4_ERR_IO);
    CHECK(strstr(dsv4_last_error(), "does not exist") != NULL);
    /* A good document resolves sizes to bytes. */
    char out[8192];
    CHECK_STATUS(dsv4_params_validate("{\"hicache\": {\"size_bytes\": \"150GB\"}}", out,
                                      sizeof out, &needed),
                 DSV4_OK);
    CHECK(strstr(out, "\"size_bytes\": 150000000000") != NULL);
}

static int log_records = 0;
static int saw_plan_record = 0;

static void on_log(void *user_data, int32_t level, const char *target, const char *message) {
    CHECK(user_data == &log_records);
    CHECK(level >= DSV4_LOG_ERROR && level <= DSV4_LOG_INFO);
    CHECK(strncmp(target, "dsv4", 4) == 0);
    if (strstr(message, "planned")) saw_plan_record = 1;
    log_records++;
}

static void test_log_callback(void) {
    size_t needed = 0;
    CHECK_STATUS(dsv4_set_log_callback(9, on_log, &log_records), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_set_log_callback(DSV4_LOG_INFO, on_log, &log_records), DSV4_OK);
    CHECK_STATUS(dsv4_plan(FLASH, NULL, 0, &needed), DSV4_OK);
    CHECK(saw_plan_record);
    CHECK_STATUS(dsv4_set_log_callback(DSV4_LOG_OFF, NULL, NULL), DSV4_OK);
    int before = log_records;
    CHECK_STATUS(dsv4_plan(FLASH, NULL, 0, &needed), DSV4_OK);
    CHECK(log_records == before);
}

static void *plan_in_thread(void *arg) {
    (void)arg;
    for (int i = 0; i < 5; i++) {
        size_t needed = 0;
        if (dsv4_plan(FLASH, NULL, 0, &needed) != DSV4_OK) return (void *)1;
        char *buf = malloc(needed + 256);
        dsv4_status s = dsv4_plan(FLASH, buf, needed + 256, &needed);
        int ok = s == DSV4_OK && strstr(buf, "\"c4_kv\"") != NULL;
        free(buf);
        if (!ok) return (void *)1;
        /* Each thread's last error is its own. */
        if (dsv4_plan(NULL, NULL, 0, &needed) != DSV4_ERR_INVALID_ARGUMENT) return (void *)1;
        if (!strstr(dsv4_last_error(), "params_json is NULL")) return (void *)1;
    }
    return NULL;
}

static void test_concurrent_calls(void) {
    pthread_t threads[4];
    for (int i = 0; i < 4; i++) CHECK(pthread_create(&threads[i], NULL, plan_in_thread, NULL) == 0);
    for (int i = 0; i < 4; i++) {
        void *result = NULL;
        pthread_join(threads[i], &result);
        CHECK(result == NULL);
    }
}

static void test_engine(void) {
    const char *params = "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/hf-f32\", "
                         "\"threads\": 2, \"kv\": {\"device_memory_bytes\": \"256MiB\"}}";
    dsv4_engine *engine = (dsv4_engine *)&failures; /* must be overwritten with NULL on failure */
    CHECK_STATUS(dsv4_engine_create(NULL, &engine), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(engine == NULL);
    CHECK_STATUS(dsv4_engine_create(params, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_engine_create("{\"model_path\": \"/nonexistent\"}", &engine), DSV4_ERR_IO);
    CHECK(engine == NULL);
    CHECK_STATUS(dsv4_engine_create("{\"backend\": \"cuda\", \"model_path\": \"" DSV4_REPO
                                    "/tests/fixtures/flash-like/hf-f32\", \"kv\": "
                                    "{\"device_memory_bytes\": \"1GiB\", \"dtype\": \"f32\", "
                                    "\"indexer_dtype\": \"f32\"}}",
                                    &engine),
                 DSV4_ERR_UNSUPPORTED);
    CHECK(strstr(dsv4_last_error(), "`backend` = cuda") != NULL);
    CHECK(strstr(dsv4_last_error(), "use backend = cpu") != NULL);
    CHECK_STATUS(dsv4_engine_create(params, &engine), DSV4_OK);
    if (!engine) return;

    size_t needed = 0;
    CHECK_STATUS(dsv4_model_info(engine, NULL, 0, &needed), DSV4_OK);
    char *info = malloc(needed);
    CHECK_STATUS(dsv4_model_info(engine, info, needed, &needed), DSV4_OK);
    CHECK(strstr(info, "\"vocab_size\": 384") != NULL);
    free(info);

    const int32_t tokens[] = {5, 17, 300, 2, 9};
    const size_t vocab = 384, n = sizeof tokens / sizeof tokens[0];
    float *logits = malloc(sizeof(float) * n * vocab);
    CHECK_STATUS(dsv4_score(engine, tokens, n, logits, n * vocab), DSV4_OK);
    int finite = 1;
    for (size_t i = 0; i < n * vocab; i++) finite &= logits[i] == logits[i] && logits[i] < 1e30f;
    CHECK(finite);
    /* Causal: the first two positions do not depend on later tokens. */
    float *prefix = malloc(sizeof(float) * 2 * vocab);
    CHECK_STATUS(dsv4_score(engine, tokens, 2, prefix, 2 * vocab), DSV4_OK);
    float max_diff = 0;
    for (size_t i = 0; i < 2 * vocab; i++) {
        float d = prefix[i] - logits[i];
        if (d < 0) d = -d;
        if (d > max_diff) max_diff = d;
    }
    CHECK(max_diff < 1e-4f);
    free(prefix);

    CHECK_STATUS(dsv4_score(NULL, tokens, n, logits, n * vocab), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_score(engine, NULL, n, logits, n * vocab), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_score(engine, tokens, 0, logits, n * vocab), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_score(engine, tokens, n, logits, n * vocab - 1), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(strstr(dsv4_last_error(), "1920 are needed") != NULL);
    const int32_t bad[] = {1, 2, 999};
    CHECK_STATUS(dsv4_score(engine, bad, 3, logits, n * vocab), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "token id 999 at position 2") != NULL);
    free(logits);
    dsv4_engine_destroy(engine);
    dsv4_engine_destroy(NULL);
}

int main(void) {
    test_names_and_version();
    test_null_arguments();
    test_output_buffers();
    test_validation_messages();
    test_log_callback();
    test_concurrent_calls();
    test_engine();
    if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
    else printf("api_test: all checks passed\n");
    return failures ? 1 : 0;
}
