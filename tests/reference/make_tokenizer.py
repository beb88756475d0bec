#!/usr/bin/env python3
"""A small DeepSeek-style tokenizer and chat template for the fixtures, and the reference outputs
dsv4's tokenizer tests compare against, computed by Hugging Face `tokenizers` and `transformers`.

Writes tests/fixtures/tokenizer/:

  tokenizer.json          byte-level BPE with 384 ids (the flash-like fixture's vocab_size):
                          DeepSeek's special tokens first, BOS <｜begin▁of▁sentence｜> = 0 and
                          EOS <｜end▁of▁sentence｜> = 1 as config.json names them; DeepSeek V3's
                          pre-tokenizer structure (digit, CJK and look-ahead regex splits, then
                          ByteLevel) and a post-processor that adds BOS.
  tokenizer_config.json   bos/eos as AddedToken objects (as DeepSeek ships them) and a shortened
                          DeepSeek-V3 chat_template with its real structure: system prompts
                          gathered first, BOS, user/assistant turns, reasoning cut at </think>,
                          tool calls through tojson, raise_exception on an unknown role,
                          add_generation_prompt.
  reference.json          per text: ids with and without special tokens (`encode`), the decode of
                          those ids (`decode(..., skip_special_tokens=False)`); per conversation:
                          `apply_chat_template(..., tokenize=False)` or the error it raised.

With --vocab-size 4096 --corpus docs/*.md README.md --out assets/tiny-model --reference
tests/fixtures/tiny-tokenizer-reference.json it makes the built-in tiny model's tokenizer (the
demo's; `dsv4::model::tiny` writes it next to the weights), trained on the repo's docs as they
were then.

Not run by `make test` (the outputs are committed). Needs tokenizers and transformers (torch is
not needed):

    python -m venv /tmp/v && /tmp/v/bin/pip install tokenizers transformers
    /tmp/v/bin/python tests/reference/make_tokenizer.py --out tests/fixtures/tokenizer
"""

import argparse
import json
import os

import jinja2  # noqa: F401  (apply_chat_template needs it; without it every chat is an "error")
import tokenizers
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 384
SPECIAL = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜▁pad▁｜>",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "You are a helpful assistant. Answer the question in one sentence, please.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers like 12345 and 3.14159 appear in text; so do dates such as 2024-06-01.",
    "日本語のテキストと中文测试，还有한국어도 있습니다。",
    "Emoji: 🦀🚀👍🏽 and accents: café, naïve, señor, Ærøskøbing.",
    "<think>Let me think about this step by step.</think>The answer is 42.",
]

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, café naïve",
    "日本語のテキスト",
    "中文测试，还有한국어",
    "🦀 Rust 🚀👍🏽 done",
    "  leading and trailing  \n\n\ttabs\r\n   ",
    "numbers 1234567 and 3.14",
    "<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>",
    "Ω≈ç√∫ — “quotes” ‘single’ …",
    "",
]

CONVERSATIONS = [
    {
        "name": "system_and_user",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello! 你好 🦀"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "multi_turn_with_reasoning",
        "messages": [
            {"role": "user", "content": "What is 6 x 7?"},
            {"role": "assistant", "content": "<think>6 times 7 is 42.</think>42."},
            {"role": "user", "content": "And 6 x 8?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "no_generation_prompt",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use English."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ],
        "add_generation_prompt": False,
    },
    {
        "name": "tool_call",
        "messages": [
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Zürich", "unit": "°C", "note": "a \"quoted\" <tag> & 'x'"},
                        },
                    }
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21}"},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "unknown_role",
        "messages": [{"role": "wizard", "content": "abracadabra"}],
        "add_generation_prompt": True,
    },
]

CHAT_TEMPLATE = """{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}
{% set ns = namespace(is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Conversation roles must be system, user, assistant or tool, not ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}
        {%- if ns.is_first_sp %}
            {% set ns.system_prompt = ns.system_prompt + message['content'] %}
            {% set ns.is_first_sp = false %}
        {%- else %}
            {% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- set ns.is_tool = false -%}
        {{'<｜User｜>' + message['content']}}
    {%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' in message %}
        {%- set ns.is_tool = false -%}
        {{'<｜Assistant｜><｜tool▁calls▁begin｜>'}}
        {%- for tool in message['tool_calls'] %}
            {{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n```json\\n' + (tool['function']['arguments'] | tojson) + '\\n```<｜tool▁call▁end｜>'}}
        {%- endfor %}
        {{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
    {%- endif %}
    {%- if message['role'] == 'assistant' and 'tool_calls' not in message %}
        {%- set ns.is_tool = false -%}
        {% set content = message['content'] %}
        {% if '</think>' in content %}
            {% set content = content.split('</think>')[-1] %}
        {% endif %}
        {{'<｜Assistant｜>' + content.strip() + '<｜end▁of▁sentence｜>'}}
    {%- endif %}
    {%- if message['role'] == 'tool' %}
        {%- set ns.is_tool = true -%}
        {{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
    {%- endif %}
{%- endfor -%}
{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}
{% if add_generation_prompt and ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}
"""


def build_tokenizer(vocab_size: int, corpus: list) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # DeepSeek V3's pre-tokenizer: digits in runs of up to 3, CJK runs, a GPT-style split with a
    # look-ahead (needs fancy-regex in Rust), then byte-level without its own regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[一-龥\u3040-ゟ゠-ヿ]+"), behavior="isolated"),
            pre_tokenizers.Split(
                Regex(r"[\r\n]|\s?[A-Za-zµÀ-ÖØ-öø-ƺ]+|\s?[!-/:-~！-／：-～‘-‟　-。]+|\s+$|\s+(?!\S)|\s"),
                behavior="isolated",
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4 + corpus, trainer=trainer)
    bos = SPECIAL[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
    )
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), "add --corpus text")
    assert tok.token_to_id(SPECIAL[0]) == 0 and tok.token_to_id(SPECIAL[1]) == 1
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                    help="ids in all (the model's vocab_size)")
    ap.add_argument("--corpus", nargs="*", default=[],
                    help="more training text (files), for vocabularies the built-in corpus "
                         "cannot fill")
    ap.add_argument("--reference", help="where reference.json goes (default: --out)")
    args = ap.parse_args()
    out = args.out
    os.makedirs(out, exist_ok=True)
    corpus = []
    for path in args.corpus:
        with open(path, encoding="utf-8") as f:
            corpus.extend(p for p in f.read().split("\n\n") if p.strip())
    tok = build_tokenizer(args.vocab_size, corpus)
    tok.save(os.path.join(out, "tokenizer.json"))

    def added(content: str) -> dict:
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True,
                "rstrip": False, "single_word": False}

    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": added(SPECIAL[0]),
        "eos_token": added(SPECIAL[1]),
        "pad_token": added(SPECIAL[-1]),
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 4096,
        "tokenizer_class": "LlamaTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")

    # Reload from the written files, as a user of the checkpoint would.
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(out, "tokenizer.json"),
        bos_token=SPECIAL[0], eos_token=SPECIAL[1], pad_token=SPECIAL[-1],
        chat_template=CHAT_TEMPLATE,
    )
    texts = []
    splits = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        # Ids whose own decode is not valid UTF-8 split a multi-byte character across tokens.
        splits += sum("\ufffd" in tok.decode([i], skip_special_tokens=False) for i in ids)
        texts.append({
            "text": text,
            "ids": ids,
            "ids_with_special": ids_special,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_with_special": tok.decode(ids_special, skip_special_tokens=False),
        })
    assert splits > 0, "no case splits a multi-byte character across ids: add one"
    chats = []
    for conv in CONVERSATIONS:
        entry = {k: conv[k] for k in ("name", "messages", "add_generation_prompt")}
        try:
            entry["rendered"] = hf.apply_chat_template(
                conv["messages"], tokenize=False, add_generation_prompt=conv["add_generation_prompt"]
            )
        except Exception as e:  # transformers raises jinja2's TemplateError
            entry["error"] = str(e)
        chats.append(entry)
    ref = {
        "generated_by": f"tokenizers {tokenizers.__version__}, transformers {transformers.__version__}",
        "vocab_size": args.vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "texts": texts,
        "chats": chats,
    }
    reference = args.reference or os.path.join(out, "reference.json")
    with open(reference, "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
