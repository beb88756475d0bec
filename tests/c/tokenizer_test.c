/* The tokenizer, streaming detokenizer and chat template from C: NULLs, the buffer-size
 * conventions, statuses, and a case against the Python reference (ids and renderings copied
 * from tests/fixtures/tokenizer/reference.json, made by tests/reference/make_tokenizer.py).
 * Runs on flash-like/hf-f32-text (the hf-f32 weights with the tokenizer files) and on hf-f32
 * (no tokenizer files). */
#include <dsv4.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define PARAMS_FOR(dir)                                                                          \
    "{\"model_path\": \"" DSV4_REPO "/tests/fixtures/flash-like/" dir "\", \"threads\": 1, "     \
    "\"kv\": {\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \"page_size\": 128}}"

/* reference.json texts[5]: encode(text, add_special_tokens=True); the emoji are split across
 * ids, so streaming must hold bytes back. */
static const char *TEXT = "\xf0\x9f\xa6\x80 Rust \xf0\x9f\x9a\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd done";
static const int32_t IDS[] = {0,   273, 109, 232, 230, 59,  94,  92,  93,  230, 273,
                              258, 307, 249, 245, 273, 247, 131, 279, 287, 78};
enum { N_IDS = sizeof IDS / sizeof IDS[0] };
static const char *BOS = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";

/* reference.json chats[0]. */
static const char *MESSAGES =
    "[{\"role\": \"system\", \"content\": \"You are a helpful assistant.\"}, "
    "{\"role\": \"user\", \"content\": \"Hello! \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\xa6\x80\"}]";
static const char *RENDERED =
    "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>You are a helpful "
    "assistant.<\xef\xbd\x9cUser\xef\xbd\x9c>Hello! \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\xa6\x80"
    "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";

static void tokenize(const dsv4_engine *e) {
    size_t n = 0;
    int32_t ids[64];
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 1, NULL, 0, &n), DSV4_OK);
    CHECK(n == N_IDS);
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 1, ids, 2, &n), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(n == N_IDS);
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 1, ids, 64, &n), DSV4_OK);
    CHECK(n == N_IDS && memcmp(ids, IDS, sizeof IDS) == 0);
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 0, ids, 64, &n), DSV4_OK);
    CHECK(n == N_IDS - 1 && memcmp(ids, IDS + 1, sizeof IDS - sizeof IDS[0]) == 0);
    CHECK_STATUS(dsv4_tokenize(NULL, TEXT, 1, ids, 64, &n), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_tokenize(e, NULL, 1, ids, 64, &n), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 1, ids, 64, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_tokenize(e, TEXT, 1, NULL, 8, &n), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_tokenize(e, "\xff", 1, ids, 64, &n), DSV4_ERR_INVALID_ARGUMENT);
}

static void detokenize(const dsv4_engine *e) {
    size_t needed = 0;
    char buf[256];
    size_t want = strlen(BOS) + strlen(TEXT) + 1;
    CHECK_STATUS(dsv4_detokenize(e, IDS, N_IDS, NULL, 0, &needed), DSV4_OK);
    CHECK(needed == want);
    memset(buf, 'x', sizeof buf);
    CHECK_STATUS(dsv4_detokenize(e, IDS, N_IDS, buf, 4, &needed), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK(buf[0] == 'x');
    CHECK_STATUS(dsv4_detokenize(e, IDS, N_IDS, buf, sizeof buf, &needed), DSV4_OK);
    CHECK(strncmp(buf, BOS, strlen(BOS)) == 0 && strcmp(buf + strlen(BOS), TEXT) == 0);
    CHECK_STATUS(dsv4_detokenize(e, NULL, 0, buf, sizeof buf, &needed), DSV4_OK);
    CHECK(needed == 1 && buf[0] == '\0');
    CHECK_STATUS(dsv4_detokenize(e, NULL, 3, buf, sizeof buf, &needed), DSV4_ERR_INVALID_ARGUMENT);
    const int32_t bad[] = {5, 384};
    CHECK_STATUS(dsv4_detokenize(e, bad, 2, buf, sizeof buf, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "384") != NULL);
    CHECK_STATUS(dsv4_detokenize(NULL, IDS, N_IDS, buf, sizeof buf, &needed),
                 DSV4_ERR_INVALID_ARGUMENT);
}

static void stream(const dsv4_engine *e) {
    dsv4_detokenizer *d = (dsv4_detokenizer *)1;
    CHECK_STATUS(dsv4_detokenizer_create(NULL, &d), DSV4_ERR_INVALID_ARGUMENT);
    CHECK(d == NULL);
    CHECK_STATUS(dsv4_detokenizer_create(e, NULL), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_detokenizer_create(e, &d), DSV4_OK);
    CHECK(d != NULL);
    char out[256] = "", piece[64];
    size_t needed = 0;
    int empty = 0;
    for (int i = 0; i < N_IDS; i++) {
        /* A one-byte buffer is too small for any piece but "": the retry with the same id must
         * neither lose nor repeat text. */
        dsv4_status s = dsv4_detokenizer_feed(d, IDS[i], piece, 1, &needed);
        if (s == DSV4_ERR_BUFFER_TOO_SMALL) {
            CHECK(needed > 1);
            CHECK_STATUS(dsv4_detokenizer_feed(d, IDS[i], piece, sizeof piece, &needed), DSV4_OK);
        } else {
            CHECK(s == DSV4_OK && needed == 1);
            empty++;
        }
        strcat(out, piece);
    }
    CHECK(empty > 0); /* ids inside an emoji returned nothing */
    CHECK(strncmp(out, BOS, strlen(BOS)) == 0 && strcmp(out + strlen(BOS), TEXT) == 0);
    CHECK_STATUS(dsv4_detokenizer_feed(d, 9999, piece, sizeof piece, &needed),
                 DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_detokenizer_feed(NULL, 5, piece, sizeof piece, &needed),
                 DSV4_ERR_INVALID_ARGUMENT);
    dsv4_detokenizer_destroy(d);
    dsv4_detokenizer_destroy(NULL);
}

static void chat(const dsv4_engine *e) {
    size_t needed = 0;
    char buf[512];
    CHECK_STATUS(dsv4_chat_apply(e, MESSAGES, 1, NULL, 0, &needed), DSV4_OK);
    CHECK(needed == strlen(RENDERED) + 1);
    CHECK_STATUS(dsv4_chat_apply(e, MESSAGES, 1, buf, 8, &needed), DSV4_ERR_BUFFER_TOO_SMALL);
    CHECK_STATUS(dsv4_chat_apply(e, MESSAGES, 1, buf, sizeof buf, &needed), DSV4_OK);
    CHECK(strcmp(buf, RENDERED) == 0);
    CHECK_STATUS(dsv4_chat_apply(e, "{", 1, buf, sizeof buf, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_chat_apply(e, "[{\"role\": \"wizard\", \"content\": \"x\"}]", 1, buf,
                                 sizeof buf, &needed),
                 DSV4_ERR_INVALID_ARGUMENT);
    CHECK(strstr(dsv4_last_error(), "not wizard") != NULL);
    CHECK_STATUS(dsv4_chat_apply(e, NULL, 1, buf, sizeof buf, &needed), DSV4_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(dsv4_chat_apply(NULL, MESSAGES, 1, buf, sizeof buf, &needed),
                 DSV4_ERR_INVALID_ARGUMENT);
}

static void without_files(const dsv4_engine *e) {
    size_t n = 0;
    char buf[64];
    dsv4_detokenizer *d = NULL;
    CHECK_STATUS(dsv4_tokenize(e, "hi", 1, NULL, 0, &n), DSV4_ERR_UNSUPPORTED);
    CHECK(strstr(dsv4_last_error(), "no tokenizer.json") != NULL);
    CHECK(strstr(dsv4_last_error(), "pass token ids") != NULL);
    CHECK_STATUS(dsv4_detokenize(e, IDS, N_IDS, buf, sizeof buf, &n), DSV4_ERR_UNSUPPORTED);
    CHECK_STATUS(dsv4_detokenizer_create(e, &d), DSV4_ERR_UNSUPPORTED);
    CHECK(d == NULL);
    CHECK_STATUS(dsv4_chat_apply(e, MESSAGES, 1, buf, sizeof buf, &n), DSV4_ERR_UNSUPPORTED);
    CHECK(strstr(dsv4_last_error(), "no tokenizer_config.json") != NULL);
}

int main(void) {
    dsv4_engine *e = NULL;
    CHECK_STATUS(dsv4_engine_create(PARAMS_FOR("hf-f32-text"), &e), DSV4_OK);
    if (e == NULL) return 1;
    tokenize(e);
    detokenize(e);
    stream(e);
    /* A detokenizer keeps the tokenizer alive: it may outlive its engine. */
    dsv4_detokenizer *d = NULL;
    CHECK_STATUS(dsv4_detokenizer_create(e, &d), DSV4_OK);
    chat(e);
    dsv4_engine_destroy(e);
    char piece[64];
    size_t needed = 0;
    CHECK_STATUS(dsv4_detokenizer_feed(d, 2, piece, sizeof piece, &needed), DSV4_OK);
    dsv4_detokenizer_destroy(d);

    CHECK_STATUS(dsv4_engine_create(PARAMS_FOR("hf-f32"), &e), DSV4_OK);
    if (e == NULL) return 1;
    without_files(e);
    dsv4_engine_destroy(e);
    if (failures) fprintf(stderr, "%d checks failed\n", failures);
    else printf("tokenizer_test: all checks passed\n");
    return failures ? 1 : 0;
}
