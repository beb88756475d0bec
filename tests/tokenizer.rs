//! The tokenizer and chat template against the independent reference: ids, decodes and chat
//! renderings that Hugging Face `tokenizers` and `transformers.apply_chat_template` produced on
//! the same files (tests/reference/make_tokenizer.py → tests/fixtures/tokenizer/reference.json).
//! The engine-level tests use flash-like/hf-f32-text: the hf-f32 weights plus those files.

mod common;

use dsv4::config::params::Params;
use dsv4::engine::Engine;
use dsv4::error::{ErrorKind, Result};
use dsv4::tokenizer::{ChatTemplate, TextCodec};
use serde_json::{json, Value};

fn read_json(path: &std::path::Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn reference() -> Value {
    read_json(&common::fixture("tokenizer/reference.json"))
}

fn codec() -> TextCodec {
    TextCodec::load(&common::fixture("tokenizer"), 384)
}

/// Each tokenizer with its reference: the fixtures' (384 ids) and the built-in tiny model's
/// (4096 ids, what the demo serves text with), both made by tests/reference/make_tokenizer.py.
fn suites() -> Vec<(TextCodec, Value)> {
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-model");
    vec![
        (codec(), reference()),
        (
            TextCodec::load(&tiny, 4096),
            read_json(&common::fixture("tiny-tokenizer-reference.json")),
        ),
    ]
}

fn ids(v: &Value) -> Vec<i32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap() as i32)
        .collect()
}

fn texts() -> Vec<Value> {
    reference()["texts"].as_array().unwrap().clone()
}

#[test]
fn tokenize_matches_python_tokenizers() {
    for (codec, reference) in suites() {
        tokenize_matches(&codec, &reference);
    }
}

fn tokenize_matches(codec: &TextCodec, reference: &Value) {
    for case in reference["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let plain: Vec<i32> = codec
            .tokenize(text, false)
            .unwrap()
            .iter()
            .map(|&i| i as i32)
            .collect();
        assert_eq!(
            plain,
            ids(&case["ids"]),
            "encode({text:?}, add_special_tokens=False)"
        );
        let special: Vec<i32> = codec
            .tokenize(text, true)
            .unwrap()
            .iter()
            .map(|&i| i as i32)
            .collect();
        assert_eq!(
            special,
            ids(&case["ids_with_special"]),
            "encode({text:?}, add_special_tokens=True)"
        );
    }
}

#[test]
fn detokenize_matches_python_tokenizers() {
    for (codec, reference) in suites() {
        for case in reference["texts"].as_array().unwrap() {
            detokenize_matches(&codec, case);
        }
    }
    let codec = codec();
    let err = codec.detokenize(&[5, 384]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(
        err.message().contains("token id 384 at index 1"),
        "{}",
        err.message()
    );
    assert_eq!(
        codec.detokenize(&[-1]).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

fn detokenize_matches(codec: &TextCodec, case: &Value) {
    assert_eq!(
        codec.detokenize(&ids(&case["ids"])).unwrap(),
        case["decoded"].as_str().unwrap()
    );
    assert_eq!(
        codec.detokenize(&ids(&case["ids_with_special"])).unwrap(),
        case["decoded_with_special"].as_str().unwrap()
    );
}

#[test]
fn streamed_pieces_concatenate_to_the_reference_text() {
    for (codec, reference) in suites() {
        streamed_pieces_concatenate(&codec, &reference);
    }
}

fn streamed_pieces_concatenate(codec: &TextCodec, reference: &Value) {
    let mut held_back = 0;
    for case in reference["texts"].as_array().unwrap() {
        for key in ["ids", "ids_with_special"] {
            let mut d = codec.detokenizer().unwrap();
            let mut streamed = String::new();
            for id in ids(&case[key]) {
                let piece = d.feed(id).unwrap();
                held_back += usize::from(piece.is_empty());
                streamed.push_str(&piece);
            }
            let want = if key == "ids" {
                "decoded"
            } else {
                "decoded_with_special"
            };
            assert_eq!(
                streamed,
                case[want].as_str().unwrap(),
                "{key} of {:?}",
                case["text"]
            );
            assert!(
                !streamed.contains('\u{FFFD}'),
                "no piece ever shows a split character"
            );
        }
    }
    // The reference has ids that end inside a character (the script asserts it): some feeds
    // must have returned nothing and waited for the rest of the character.
    assert!(held_back > 0);
}

#[test]
fn a_rejected_id_leaves_the_stream_unchanged() {
    let codec = codec();
    let case = &texts()[5]; // emoji
    let mut d = codec.detokenizer().unwrap();
    let mut streamed = String::new();
    for id in ids(&case["ids"]) {
        assert_eq!(d.feed(9999).unwrap_err().kind(), ErrorKind::InvalidArgument);
        streamed.push_str(&d.feed(id).unwrap());
    }
    assert_eq!(streamed, case["decoded"].as_str().unwrap());
}

#[test]
fn chat_renderings_match_transformers() {
    for (codec, reference) in suites() {
        chat_renderings_match(&reference, |m, add| codec.chat_apply(m, add));
    }
    let codec = codec();
    let err = codec.chat_apply("{\"role\": \"user\"}", true).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(err.message().contains("not a JSON array"));
}

/// The checkpoints' template is rendered natively (tests/chat_template_property.rs compares that
/// with minijinja); both renderers must also give what transformers gave.
#[test]
fn native_and_minijinja_renderings_match_transformers() {
    let config = read_json(&common::fixture("tokenizer/tokenizer_config.json"));
    let template = ChatTemplate::from_config(&config).unwrap();
    assert!(template.is_native());
    let reference = reference();
    chat_renderings_match(&reference, |m, add| template.render(m, add));
    chat_renderings_match(&reference, |m, add| template.render_with_minijinja(m, add));
}

fn chat_renderings_match(reference: &Value, render: impl Fn(&str, bool) -> Result<String>) {
    for chat in reference["chats"].as_array().unwrap() {
        let messages = chat["messages"].to_string();
        let add = chat["add_generation_prompt"].as_bool().unwrap();
        let got = render(&messages, add);
        match (chat.get("rendered"), got) {
            (Some(want), Ok(text)) => assert_eq!(text, want.as_str().unwrap(), "{}", chat["name"]),
            (None, Err(e)) => {
                assert_eq!(e.kind(), ErrorKind::InvalidArgument);
                let want = chat["error"].as_str().unwrap();
                assert!(
                    e.message().contains(want),
                    "{}: {} lacks {want:?}",
                    chat["name"],
                    e.message()
                );
            }
            (want, got) => panic!("{}: expected {want:?}, got {got:?}", chat["name"]),
        }
    }
}

fn engine(dir: &str) -> Engine {
    let doc = json!({
        "model_path": common::fixture(dir).to_str().unwrap(), "threads": 1,
        "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
    });
    Engine::create(Params::from_value(&doc).unwrap()).unwrap()
}

#[test]
fn the_engine_loads_the_checkpoint_tokenizer() {
    let engine = engine("flash-like/hf-f32-text");
    let info = engine.model_info();
    assert_eq!(
        (&info["has_tokenizer"], &info["has_chat_template"]),
        (&json!(true), &json!(true))
    );
    let case = &texts()[2];
    let got: Vec<i32> = engine
        .text()
        .tokenize(case["text"].as_str().unwrap(), true)
        .unwrap()
        .iter()
        .map(|&i| i as i32)
        .collect();
    assert_eq!(got, ids(&case["ids_with_special"]));
}

#[test]
fn a_checkpoint_without_the_files_says_to_pass_ids() {
    let engine = engine("flash-like/hf-f32");
    let text = engine.text();
    for err in [
        text.tokenize("hi", true).unwrap_err(),
        text.detokenize(&[1]).unwrap_err(),
        text.detokenizer().err().unwrap(),
    ] {
        assert_eq!(err.kind(), ErrorKind::Unsupported);
        assert!(
            err.message()
                .contains("this checkpoint has no tokenizer.json"),
            "{}",
            err.message()
        );
        assert!(
            err.message().contains("pass token ids"),
            "{}",
            err.message()
        );
    }
    let err = text.chat_apply("[]", true).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(
        err.message().contains("no tokenizer_config.json"),
        "{}",
        err.message()
    );
}

#[test]
fn a_broken_tokenizer_file_is_reported_by_the_text_calls() {
    let dir = std::env::temp_dir().join(format!("dsv4-tok-broken-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for %}"}"#,
    )
    .unwrap();
    let codec = TextCodec::load(&dir, 384);
    let err = codec.tokenize("hi", false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported);
    assert!(
        err.message().contains("could not be loaded"),
        "{}",
        err.message()
    );
    let err = codec.chat_apply("[]", false).unwrap_err();
    assert!(
        err.message().contains("does not compile"),
        "{}",
        err.message()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
