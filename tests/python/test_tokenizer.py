"""Tokenize, detokenize, streaming detokenization and the chat template from Python, against
the reference Hugging Face tokenizers and transformers produced on the same files
(tests/reference/make_tokenizer.py -> tests/fixtures/tokenizer/reference.json)."""

import json
from pathlib import Path

import pytest

import dsv4

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = json.loads((FIXTURES / "tokenizer" / "reference.json").read_text(encoding="utf-8"))


def params(model_dir):
    return {"model_path": str(FIXTURES / "flash-like" / model_dir), "threads": 1,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128}}


@pytest.fixture(scope="module")
def engine():
    with dsv4.Engine(params("hf-f32-text")) as e:
        yield e


@pytest.mark.parametrize("case", REFERENCE["texts"], ids=lambda c: repr(c["text"][:12]))
def test_tokenize_and_detokenize_match_the_reference(engine, case):
    assert engine.tokenize(case["text"], add_special=False) == case["ids"]
    assert engine.tokenize(case["text"]) == case["ids_with_special"]
    assert engine.detokenize(case["ids"]) == case["decoded"]
    assert engine.detokenize(case["ids_with_special"]) == case["decoded_with_special"]


@pytest.mark.parametrize("case", REFERENCE["texts"], ids=lambda c: repr(c["text"][:12]))
def test_streamed_pieces_concatenate_to_the_reference(engine, case):
    with engine.detokenizer() as d:
        pieces = [d.feed(t) for t in case["ids_with_special"]]
    assert "".join(pieces) == case["decoded_with_special"]


@pytest.mark.parametrize("chat", REFERENCE["chats"], ids=lambda c: c["name"])
def test_chat_renderings_match_transformers(engine, chat):
    if "rendered" in chat:
        assert engine.chat_apply(chat["messages"], chat["add_generation_prompt"]) \
            == chat["rendered"]
    else:
        with pytest.raises(dsv4.InvalidArgument, match=chat["error"]):
            engine.chat_apply(chat["messages"], chat["add_generation_prompt"])


def test_bad_ids_and_closed_detokenizers_raise(engine):
    with pytest.raises(dsv4.InvalidArgument, match="outside the tokenizer's vocabulary"):
        engine.detokenize([5, 384])
    d = engine.detokenizer()
    d.close()
    with pytest.raises(dsv4.InvalidArgument, match="closed"):
        d.feed(5)


def test_a_checkpoint_without_the_files_says_to_pass_ids():
    with dsv4.Engine(params("hf-f32")) as e:
        with pytest.raises(dsv4.Unsupported, match="no tokenizer.json.*pass token ids"):
            e.tokenize("hi")
        with pytest.raises(dsv4.Unsupported, match="no tokenizer.json"):
            e.detokenizer()
        with pytest.raises(dsv4.Unsupported, match="no tokenizer_config.json"):
            e.chat_apply([{"role": "user", "content": "hi"}])
