//! The native renderer of the DeepSeek chat template against minijinja rendering the same
//! template text: random conversations (every role, unicode and whitespace, `</think>` pieces,
//! tool calls with nested JSON arguments, missing fields and fields of the wrong type, messages
//! that are not objects) must give the same prompt, or the same refusal word for word. Then
//! the reason the native renderer exists: 20,000 system messages render with allocations
//! linear in the request (minijinja copies the system prompt once per message).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use dsv4::error::ErrorKind;
use dsv4::tokenizer::ChatTemplate;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------------------------------------
// Bytes allocated by this thread: the measure of work that a timer would make flaky.

struct Counting;

thread_local! {
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

fn count(bytes: usize) {
    // try_with: a thread being torn down still allocates; it is not measured.
    let _ = ALLOCATED.try_with(|c| c.set(c.get().saturating_add(bytes)));
}

// SAFETY: every call is passed to System unchanged; counting touches only a const-initialised
// thread-local Cell, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// `f`'s result and the bytes this thread allocated running it.
fn allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.with(Cell::get);
    let out = f();
    (out, ALLOCATED.with(Cell::get) - before)
}

// ---------------------------------------------------------------------------------------------
// The templates.

fn config(path: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The checkpoints' configs whose template is rendered natively: the fixtures' and the built-in
/// tiny model's (the demo's).
fn configs() -> Vec<(&'static str, Value)> {
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("assets/tiny-model/tokenizer_config.json");
    vec![
        (
            "fixture",
            config(&common::fixture("tokenizer/tokenizer_config.json")),
        ),
        ("tiny model", config(&tiny)),
    ]
}

fn known_source() -> String {
    configs()[0].1["chat_template"]
        .as_str()
        .unwrap()
        .to_string()
}

/// `template` natively and with minijinja must agree: the same text, or the same kind and
/// message of error. Returns whether it rendered.
fn agree(template: &ChatTemplate, messages: &str, add: bool) -> Result<bool, TestCaseError> {
    let native = template.render(messages, add);
    let reference = template.render_with_minijinja(messages, add);
    match (native, reference) {
        (Ok(a), Ok(b)) => {
            prop_assert_eq!(a, b, "{}", messages);
            Ok(true)
        }
        (Err(a), Err(b)) => {
            prop_assert_eq!(a.kind(), b.kind(), "{}", messages);
            prop_assert_eq!(a.message(), b.message(), "{}", messages);
            Ok(false)
        }
        (a, b) => Err(TestCaseError::fail(format!(
            "{messages}: native {a:?}, minijinja {b:?}"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Conversations.

/// Text made of the pieces the template treats specially: `</think>` and its fragments, every
/// kind of whitespace on both sides of `.strip()` (U+001C..U+001F: Python strips them, Rust and
/// minijinja do not), special-token text, Jinja syntax, escapes; or any printable unicode.
fn text() -> BoxedStrategy<String> {
    let pieces = select(vec![
        "</think>",
        "</think",
        "think>",
        "<think>",
        " ",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "\u{b}",
        "\u{c}",
        "\u{1c}",
        "\u{1f}",
        "\u{85}",
        "\u{a0}",
        "\u{2003}",
        "\u{2028}",
        "\u{3000}",
        "\u{200b}",
        "\u{feff}",
        "é",
        "你好",
        "🦀",
        "<｜User｜>",
        "<｜end▁of▁sentence｜>",
        "{{ bos_token }}",
        "{% if x %}",
        "\\",
        "\"",
        "'",
        "\0",
        "a",
        "b c",
    ]);
    prop_oneof![
        3 => prop::collection::vec(pieces, 0..8).prop_map(|p| p.concat()),
        1 => "\\PC{0,24}",
    ]
    .boxed()
}

/// JSON of every kind, nested, with the numbers whose printing could differ between the
/// parsed value and minijinja's copy of it.
fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("JSON numbers are finite", |f| {
            serde_json::Number::from_f64(f).map(Value::Number)
        }),
        select(vec![
            "0",
            "-0",
            "-0.0",
            "1.0",
            "1e300",
            "1e-7",
            "5e-324",
            "0.1",
            "-9223372036854775808",
            "18446744073709551615",
            "123456789012345678901234567890",
        ])
        .prop_map(|n| serde_json::from_str::<Value>(n).unwrap()),
        text().prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((text(), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// A value for a field that should hold a string: usually one, sometimes missing (`None`) or
/// of another kind (containers holding `</think>` included, for the containment test).
fn field() -> BoxedStrategy<Option<Value>> {
    prop_oneof![
        12 => text().prop_map(|s| Some(Value::from(s))),
        1 => Just(None),
        1 => select(vec![
            json!(null),
            json!(true),
            json!(0),
            json!(1.5),
            json!([]),
            json!(["</think>"]),
            json!(["a </think> b"]),
            json!(["a", 1]),
            json!({}),
            json!({"</think>": 1}),
            json!({"a </think>": 1}),
            json!({"a": "b"}),
        ])
        .prop_map(Some),
    ]
    .boxed()
}

fn object(fields: Vec<(&str, Option<Value>)>) -> Value {
    let map: Map<String, Value> = fields
        .into_iter()
        .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
        .collect();
    Value::Object(map)
}

fn tool_call() -> BoxedStrategy<Value> {
    let arguments = prop_oneof![
        4 => json_value().prop_map(Some),
        // What OpenAI clients send: the arguments as a JSON string.
        1 => json_value().prop_map(|v| Some(Value::from(v.to_string()))),
        1 => Just(None),
    ];
    let function = prop_oneof![
        10 => (field(), arguments).prop_map(|(name, args)| Some(object(vec![
            ("name", name),
            ("arguments", args)
        ]))),
        1 => Just(None),
        1 => select(vec![json!(null), json!("f"), json!([1])]).prop_map(Some),
    ];
    let type_ = prop_oneof![
        8 => Just(Some(json!("function"))),
        2 => field(),
    ];
    prop_oneof![
        12 => (type_, function).prop_map(|(t, f)| object(vec![("type", t), ("function", f)])),
        1 => select(vec![json!(1), json!("x"), json!(null), json!([])]),
    ]
    .boxed()
}

fn tool_calls() -> BoxedStrategy<Value> {
    prop_oneof![
        10 => prop::collection::vec(tool_call(), 0..4).prop_map(Value::Array),
        1 => select(vec![
            json!(null),
            json!(""),
            json!("ab"),
            json!({}),
            json!({"k": 1}),
            json!(3),
            json!(false),
        ]),
    ]
    .boxed()
}

fn message() -> BoxedStrategy<Value> {
    let role = prop_oneof![
        20 => select(vec!["system", "user", "assistant", "tool"]).prop_map(|r| Some(json!(r))),
        1 => select(vec![
            Some(json!("wizard")),
            Some(json!("System")),
            Some(json!("")),
            None,
            Some(json!(null)),
            Some(json!(1)),
            Some(json!(["user"])),
        ]),
    ];
    let with_calls = prop_oneof![3 => Just(None), 1 => tool_calls().prop_map(Some)];
    prop_oneof![
        // Any role may carry tool_calls (only an assistant's are read); key order varies.
        30 => (role, field(), with_calls, any::<bool>()).prop_map(|(role, content, calls, first)| {
            if first {
                object(vec![("content", content), ("role", role), ("tool_calls", calls)])
            } else {
                object(vec![("role", role), ("content", content), ("tool_calls", calls)])
            }
        }),
        1 => select(vec![json!("user"), json!(null), json!(7), json!([{"role": "user"}])]),
    ]
    .boxed()
}

fn conversation() -> impl Strategy<Value = (Vec<Value>, bool)> {
    (prop::collection::vec(message(), 0..8), any::<bool>())
}

/// The special tokens a template may be built with: `bos_token` as `from_config` makes it, and
/// absent or of another kind (`ChatTemplate::new` takes any JSON).
fn special_tokens() -> impl Strategy<Value = Map<String, Value>> {
    select(vec![
        Some(json!("<｜begin▁of▁sentence｜>")),
        Some(json!("")),
        None,
        Some(json!(null)),
        Some(json!(5)),
        Some(json!(["a"])),
    ])
    .prop_map(|bos| {
        let mut m = Map::new();
        m.insert("eos_token".into(), json!("<｜end▁of▁sentence｜>"));
        if let Some(bos) = bos {
            m.insert("bos_token".into(), bos);
        }
        m
    })
}

// ---------------------------------------------------------------------------------------------
// Properties.

/// Runs `cases` random conversations through `check`; asserts that both outcomes were seen
/// often enough for the comparison to mean something.
fn run_cases<S: Strategy>(
    cases: u32,
    strategy: S,
    check: impl Fn(S::Value) -> Result<bool, TestCaseError>,
) {
    let rendered = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&strategy, |case| {
            let ok = check(case)?;
            let n = if ok { &rendered } else { &refused };
            n.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    let (ok, err) = (rendered.into_inner(), refused.into_inner());
    assert!(
        ok >= cases as usize / 4 && err >= cases as usize / 20,
        "{ok} rendered, {err} refused: the generator no longer covers both"
    );
}

#[test]
fn the_checkpoints_templates_render_natively() {
    for (name, doc) in configs() {
        let t = ChatTemplate::from_config(&doc).unwrap();
        assert!(t.is_native(), "{name}'s template is not recognised");
    }
    // One byte more and it is another template: minijinja renders it.
    let mut source = known_source();
    source.push(' ');
    assert!(!ChatTemplate::new(source, Map::new()).unwrap().is_native());
    let mut tokens = Map::new();
    tokens.insert("raise_exception".into(), json!("x"));
    assert!(!ChatTemplate::new(known_source(), tokens)
        .unwrap()
        .is_native());
}

#[test]
fn native_rendering_is_minijinjas_for_the_checkpoints_configs() {
    let templates: Vec<ChatTemplate> = configs()
        .iter()
        .map(|(_, doc)| ChatTemplate::from_config(doc).unwrap())
        .collect();
    run_cases(768, conversation(), |(messages, add)| {
        let json = Value::Array(messages).to_string();
        let mut ok = false;
        for t in &templates {
            ok = agree(t, &json, add)?;
        }
        Ok(ok)
    });
}

#[test]
fn native_rendering_is_minijinjas_for_any_bos_token() {
    let source = known_source();
    run_cases(
        256,
        (conversation(), special_tokens()),
        |((messages, add), tokens)| {
            let t = ChatTemplate::new(source.clone(), tokens).unwrap();
            prop_assert!(t.is_native());
            agree(&t, &Value::Array(messages).to_string(), add)
        },
    );
}

#[test]
fn refusals_match_minijinja_word_for_word() {
    // A few refusals spelled out, so a change of wording on either side shows here by name.
    let t = ChatTemplate::from_config(&configs()[0].1).unwrap();
    for (messages, says) in [
        (
            json!([{"role": "wizard", "content": "x"}]),
            "Conversation roles must be system, user, assistant or tool, not wizard",
        ),
        (
            json!([{"role": "system", "content": "a"}, {"role": "system", "content": 1}]),
            "tried to use + operator on unsupported types string and number (in chat_template:12)",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
            "undefined value (in chat_template:26)",
        ),
        (
            json!([{"role": "assistant", "content": null}]),
            "cannot perform a containment check on this value (in chat_template:33)",
        ),
        (
            json!([{"role": "assistant"}]),
            "undefined has no method named strip (in chat_template:36)",
        ),
    ] {
        let json = messages.to_string();
        let err = t.render(&json, true).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidArgument);
        assert!(err.message().contains(says), "{json}: {}", err.message());
        assert_eq!(
            err.message(),
            t.render_with_minijinja(&json, true).unwrap_err().message()
        );
    }
}

#[test]
fn arguments_nested_to_serde_jsons_limit_match() {
    // serde_json refuses more than 128 levels; both renderers print what it accepts.
    let t = ChatTemplate::from_config(&configs()[0].1).unwrap();
    let mut args = json!("leaf");
    for i in 0..120 {
        args = if i % 2 == 0 {
            json!([args, i])
        } else {
            json!({"k": args})
        };
    }
    let messages = json!([{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": args}}]}]);
    let json = messages.to_string();
    assert_eq!(
        t.render(&json, false).unwrap(),
        t.render_with_minijinja(&json, false).unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// Linear time.

/// Bytes a render may allocate per byte of request and prompt: parsing (serde_json's maps and
/// strings) and a doubling output string take a few. Concatenating the system prompt message by
/// message, as the template's Jinja does, takes about n/2 copies of it (thousands per byte
/// here).
const BYTES_PER_BYTE: usize = 24;

fn system_messages(n: usize) -> (Vec<String>, String) {
    let contents: Vec<String> = (0..n).map(|i| format!("rule {i}: be brief é")).collect();
    let mut messages: Vec<Value> = contents
        .iter()
        .map(|c| json!({"role": "system", "content": c}))
        .collect();
    messages.push(json!({"role": "user", "content": "hi"}));
    (contents, Value::Array(messages).to_string())
}

#[test]
fn twenty_thousand_system_messages_render_in_linear_work() {
    let t = ChatTemplate::from_config(&configs()[0].1).unwrap();
    for n in [0, 1, 2, 3, 50] {
        let (_, json) = system_messages(n);
        assert_eq!(
            t.render(&json, true).unwrap(),
            t.render_with_minijinja(&json, true).unwrap()
        );
    }
    let (contents, json) = system_messages(20_000);
    let (got, bytes) = allocated(|| t.render(&json, true).unwrap());
    let want = format!(
        "<｜begin▁of▁sentence｜>{}<｜User｜>hi<｜Assistant｜>",
        contents.join("\n\n")
    );
    assert_eq!(got, want);
    let bound = BYTES_PER_BYTE * (json.len() + want.len());
    assert!(
        bytes <= bound,
        "rendering allocated {bytes} bytes for a {} byte request, more than {bound}: not linear",
        json.len()
    );
}

#[test]
fn every_turn_renders_in_linear_work() {
    // Each role and branch, long contents cut at many </think>s, tool calls with arguments.
    let t = ChatTemplate::from_config(&configs()[0].1).unwrap();
    let thought = "step </think>".repeat(20);
    let turn = |i: usize| {
        vec![
            json!({"role": "system", "content": format!("s{i}")}),
            json!({"role": "user", "content": format!("question {i}")}),
            json!({"role": "assistant", "content": format!("{thought} answer {i} ")}),
            json!({"role": "assistant", "tool_calls": [{"type": "function", "function":
                {"name": "f", "arguments": {"i": i, "xs": [1.5, "é", {"k": null}]}}}]}),
            json!({"role": "tool", "content": format!("{{\"r\": {i}}}")}),
        ]
    };
    let small: Vec<Value> = (0..20).flat_map(turn).collect();
    let small = Value::Array(small).to_string();
    for add in [false, true] {
        assert_eq!(
            t.render(&small, add).unwrap(),
            t.render_with_minijinja(&small, add).unwrap()
        );
    }
    let big = Value::Array((0..4_000).flat_map(turn).collect()).to_string();
    let (got, bytes) = allocated(|| t.render(&big, true).unwrap());
    assert!(got.ends_with("<｜tool▁output▁end｜><｜Assistant｜><think>\n"));
    let bound = BYTES_PER_BYTE * (big.len() + got.len());
    assert!(
        bytes <= bound,
        "rendering allocated {bytes} bytes for a {} byte request, more than {bound}: not linear",
        big.len()
    );
}
