// The C++ wrapper's tokenizer, streaming detokenizer and chat template against the Python
// reference (ids and rendering from tests/fixtures/tokenizer/reference.json, made by
// tests/reference/make_tokenizer.py; the same case tokenizer_test.c checks through the C API),
// and the error a checkpoint without tokenizer files gives.
#include <dsv4.hpp>

#include "check.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

static std::string params_for(const char *dir) {
    return std::string("{\"model_path\": \"") + DSV4_REPO + "/tests/fixtures/flash-like/" + dir +
           "\", \"threads\": 1, \"kv\": {\"device_memory_bytes\": \"32MiB\", "
           "\"max_running_requests\": 4, \"page_size\": 128}}";
}

// reference.json texts[5], encode(text, add_special_tokens=True): emoji split across ids.
static const std::string TEXT =
    "\xf0\x9f\xa6\x80 Rust \xf0\x9f\x9a\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd done";
static const std::vector<int32_t> IDS = {0,   273, 109, 232, 230, 59,  94,  92,  93,  230, 273,
                                         258, 307, 249, 245, 273, 247, 131, 279, 287, 78};
static const std::string BOS =
    "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
// reference.json chats[0], add_generation_prompt=True.
static const std::string MESSAGES =
    "[{\"role\": \"system\", \"content\": \"You are a helpful assistant.\"}, "
    "{\"role\": \"user\", \"content\": \"Hello! \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\xa6\x80\"}]";
static const std::string RENDERED =
    "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>You are a helpful "
    "assistant.<\xef\xbd\x9cUser\xef\xbd\x9c>Hello! \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\xa6\x80"
    "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>";

static_assert(!std::is_copy_constructible_v<dsv4::detokenizer>, "one detokenizer per stream");

int main() {
    {
        dsv4::engine e(params_for("hf-f32-text"));
        CHECK(e.tokenize(TEXT) == IDS);
        CHECK(e.tokenize(TEXT, false) == std::vector<int32_t>(IDS.begin() + 1, IDS.end()));
        CHECK(e.tokenize("").empty() == false);  // the BOS alone
        CHECK(e.detokenize(IDS) == BOS + TEXT);
        CHECK(e.detokenize({}).empty());
        // Streamed one id at a time, the pieces are the whole text; some ids end inside an
        // emoji and give nothing until it completes.
        dsv4::detokenizer d(e);
        std::string streamed;
        int empty_pieces = 0;
        for (int32_t id : IDS) {
            std::string piece = d.feed(id);
            empty_pieces += piece.empty();
            streamed += piece;
        }
        CHECK(streamed == BOS + TEXT);
        CHECK(empty_pieces > 0);
        dsv4::detokenizer moved = std::move(d);
        CHECK(moved.feed(IDS[0]) == BOS);  // the moved-to handle streams on
        CHECK(e.chat_apply(MESSAGES) == RENDERED);
        try {
            e.chat_apply("{\"not\": \"a list\"}");
            CHECK(false);
        } catch (const dsv4::error &err) {
            CHECK(err.status() == dsv4::status::invalid_argument);
        }
        try {
            e.detokenize({1 << 30});
            CHECK(false);
        } catch (const dsv4::error &err) {
            CHECK(err.status() == dsv4::status::invalid_argument);
        }
    }
    {
        dsv4::engine e(params_for("hf-f32"));
        try {
            e.tokenize(TEXT);
            CHECK(false);
        } catch (const dsv4::error &err) {
            CHECK(err.status() == dsv4::status::unsupported);
            CHECK(std::string(err.what()).find("tokenizer.json") != std::string::npos);
        }
        try {
            dsv4::detokenizer d(e);
            CHECK(false);
        } catch (const dsv4::error &err) {
            CHECK(err.status() == dsv4::status::unsupported);
        }
    }
    if (failures) {
        std::fprintf(stderr, "text_cpp_test: %d failures\n", failures);
        return 1;
    }
    std::printf("text_cpp_test: ok\n");
    return 0;
}
