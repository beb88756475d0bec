//! What a host needs beyond requests: the engine state through a shutdown, the model facts,
//! the resolved params, `ignore_eos` and stop token sequences. On the flash-like fixture
//! (vocab 384, EOS 1, no tokenizer files).

mod common;

use common::requests::*;

use std::time::Duration;

use dsv4::config::params::Params;
use dsv4::engine::{EngineState, FinishReason, RequestSpec, ShutdownMode};
use dsv4::error::ErrorKind;
use serde_json::json;

#[test]
fn the_state_goes_ready_then_draining_then_stopped() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    assert_eq!(
        engine.state(),
        (EngineState::Ready, "ready: 0 requests in flight".into())
    );
    let id = engine.submit(endless(&ids[..20])).unwrap();
    let (state, reason) = engine.state();
    assert_eq!(
        (state, reason.as_str()),
        (EngineState::Ready, "ready: 1 request in flight")
    );
    // A drain that cannot finish in 0 ms: the engine is draining, refuses submits, and says
    // how many requests it still waits for.
    let e = engine
        .shutdown(ShutdownMode::Drain, Some(Duration::ZERO))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert_eq!(
        engine.state(),
        (
            EngineState::Draining,
            "shutting down (drain): 1 request still running".into()
        )
    );
    let refused = engine.submit(greedy(&ids[..5], 2)).unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Shutdown);
    assert_eq!(engine.state().0, EngineState::Draining);
    // An abort overrides the drain; once the thread has stopped the state says so.
    engine.shutdown(ShutdownMode::Abort, None).unwrap();
    let (state, reason) = engine.state();
    assert_eq!(state, EngineState::Stopped, "{reason}");
    assert!(reason.contains("stopped"), "{reason}");
    let events = collect(&engine, &[id]);
    assert_eq!(
        terminal(&events[&id]).finish_reason(),
        Some(FinishReason::Aborted)
    );
}

#[test]
fn a_drain_that_completes_ends_stopped() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    let id = engine.submit(exact(&ids[..10], 3)).unwrap();
    engine.shutdown(ShutdownMode::Drain, None).unwrap();
    assert_eq!(engine.state().0, EngineState::Stopped);
    let events = collect(&engine, &[id]);
    assert_eq!(tokens_of(&events[&id]).len(), 3);
}

#[test]
fn model_info_has_the_facts_a_server_needs() {
    let engine = engine_with(json!({"kv": {"max_context_tokens": 1000}}));
    let info = engine.model_info();
    assert_eq!(info["vocab_size"], json!(384));
    assert_eq!(info["vocab_size"], json!(engine.vocab_size()));
    assert_eq!(info["eos_token_ids"], json!([1]));
    assert!(info.get("bos_token_id").is_some(), "{info}");
    assert_eq!(info["context_limit"], json!(1000));
    assert!(info["max_position_embeddings"].as_u64().unwrap() > 0);
    // The fixture has neither tokenizer.json nor tokenizer_config.json.
    assert_eq!(info["has_tokenizer"], json!(false));
    assert_eq!(info["has_chat_template"], json!(false));
}

#[test]
fn tokenizer_files_are_reported_when_usable() {
    // A copy of the fixture's directory (config.json and weights linked) with the files added.
    let src = common::fixture("flash-like/hf-f32");
    let dir = std::env::temp_dir().join(format!("dsv4-hosting-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::os::unix::fs::symlink(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let create = |dir: &std::path::Path| {
        let doc = json!({
            "model_path": dir.to_str().unwrap(), "threads": 1,
            "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
        });
        dsv4::engine::Engine::create(Params::from_value(&doc).unwrap()).unwrap()
    };
    let facts = |e: &dsv4::engine::Engine| {
        let info = e.model_info();
        (
            info["has_tokenizer"].clone(),
            info["has_chat_template"].clone(),
        )
    };
    // A file that is there but unusable is not a tokenizer: the text calls say why.
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let engine = create(&dir);
    assert_eq!(facts(&engine), (json!(false), json!(false)));
    let err = engine.text().tokenize("hi", false).unwrap_err();
    assert!(
        err.message().contains("could not be loaded"),
        "{}",
        err.message()
    );
    // The fixture's own tokenizer (384 ids, as many as the model's rows).
    let tokenizer = common::fixture("tokenizer/tokenizer.json");
    std::fs::copy(&tokenizer, dir.join("tokenizer.json")).unwrap();
    // A config without a template: tokenizer yes, template no.
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"bos_token": "<s>"}"#).unwrap();
    assert_eq!(facts(&create(&dir)), (json!(true), json!(false)));
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}"#,
    )
    .unwrap();
    assert_eq!(facts(&create(&dir)).1, json!(true));
    // Malformed JSON is no template (and a warning), not a failed create.
    std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
    assert_eq!(facts(&create(&dir)).1, json!(false));
    // Another model's tokenizer (the tiny model's 4096 ids for 384 embedding rows) would make
    // prompts index past the embedding: refused by name, and the engine still serves ids.
    let tiny = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/tiny-model");
    std::fs::copy(tiny.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let engine = create(&dir);
    assert_eq!(facts(&engine).0, json!(false));
    let err = engine.text().tokenize("hi", false).unwrap_err();
    assert!(
        err.message()
            .contains("4096 ids but the model's vocab_size is 384"),
        "{}",
        err.message()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resolved_params_parse_back_to_the_same_params() {
    let engine = engine_with(json!({"scheduler": {"chunked_prefill_tokens": 64}}));
    let resolved = engine.params().to_json_value();
    assert_eq!(resolved["scheduler"]["chunked_prefill_tokens"], json!(64));
    // Every default is filled in: the document has every top-level key of the defaults.
    for key in dsv4::config::params::defaults_document().keys() {
        assert!(resolved.get(key).is_some(), "missing {key}");
    }
    let again = Params::from_value(&resolved).unwrap();
    assert_eq!(&again, engine.params());
    assert_eq!(again.to_json_value(), resolved);
}

#[test]
fn ignore_eos_generates_past_the_eos() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    // A bias that makes EOS (id 1) the greedy choice every time.
    let mut spec = greedy(&ids[..30], 6);
    spec.sampling.logit_bias = vec![(1, 1000.0)];
    let id = engine.submit(spec.clone()).unwrap();
    let events = &collect(&engine, &[id])[&id];
    assert_eq!(tokens_of(events), vec![1]);
    assert_eq!(terminal(events).finish_reason(), Some(FinishReason::Stop));
    spec.ignore_eos = true;
    let id = engine.submit(spec.clone()).unwrap();
    let events = &collect(&engine, &[id])[&id];
    assert_eq!(tokens_of(events), vec![1; 6]);
    assert_eq!(terminal(events).finish_reason(), Some(FinishReason::Length));
    // A stop token still stops a request that ignores EOS, even when it is the EOS id.
    spec.stop_tokens = vec![1];
    let id = engine.submit(spec).unwrap();
    let events = &collect(&engine, &[id])[&id];
    assert_eq!(tokens_of(events), vec![1]);
    assert_eq!(terminal(events).finish_reason(), Some(FinishReason::Stop));
}

/// Where greedy output `free` stops under `seqs`: the index of the token that completes the
/// first match (matches lie in the generated tokens only).
fn expected_stop(free: &[u32], seqs: &[Vec<u32>]) -> Option<usize> {
    (0..free.len()).find(|&i| seqs.iter().any(|s| free[..=i].ends_with(s)))
}

#[test]
fn stop_sequences_of_one_two_and_three_tokens() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    let prompt = &ids[..40];
    let n = 16;
    let id = engine.submit(exact(prompt, n)).unwrap();
    let free = tokens_of(&collect(&engine, &[id])[&id]);
    assert_eq!(free.len(), n as usize);
    // A token the free run never produces: a sequence ending in it never matches.
    let absent = (2..384u32).find(|t| !free.contains(t)).unwrap();
    let run = |seqs: Vec<Vec<u32>>| {
        let mut spec: RequestSpec = exact(prompt, n);
        spec.stop_sequences = seqs;
        let id = engine.submit(spec).unwrap();
        let events = collect(&engine, &[id]).remove(&id).unwrap();
        (tokens_of(&events), terminal(&events).finish_reason())
    };
    let cases: Vec<(&str, Vec<Vec<u32>>)> = vec![
        ("one token", vec![vec![free[3]]]),
        ("two tokens", vec![vec![free[4], free[5]]]),
        ("three tokens", vec![vec![free[6], free[7], free[8]]]),
        // Its first token matches at 2, then the next token differs: no stop there.
        ("partial then fail", vec![vec![free[2], absent]]),
        // The partial one never completes; the other stops the request later.
        (
            "partial, then another matches",
            vec![vec![free[2], absent], vec![free[9], free[10]]],
        ),
        // A sequence across the prompt's end does not match: generated tokens only.
        (
            "straddling the prompt",
            vec![vec![*prompt.last().unwrap(), free[0]]],
        ),
    ];
    for (what, seqs) in cases {
        let (tokens, reason) = run(seqs.clone());
        match expected_stop(&free, &seqs) {
            Some(i) => {
                assert_eq!(tokens, free[..=i].to_vec(), "{what}");
                assert_eq!(reason, Some(FinishReason::Stop), "{what}");
            }
            None => {
                assert_eq!(tokens, free, "{what}");
                assert_eq!(reason, Some(FinishReason::Length), "{what}");
            }
        }
    }
    // The partial case really continues past the partial match, and the straddling one past
    // token 0 (unless the pair recurs later, which the expectation above accounts for).
    assert_eq!(expected_stop(&free, &[vec![free[2], absent]]), None);
    assert!(expected_stop(&free, &[vec![free[6], free[7], free[8]]]).unwrap() >= 8);
}

#[test]
fn bad_stop_sequences_are_refused_naming_the_fix() {
    let engine = engine_with(json!({}));
    let mut spec = greedy(&[5, 6], 4);
    spec.stop_sequences = vec![vec![3], vec![]];
    let e = engine.submit(spec.clone()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("stop sequence 1 is empty"), "{e}");
    spec.stop_sequences = vec![vec![3, 999]];
    let e = engine.submit(spec.clone()).unwrap_err();
    assert!(
        e.message()
            .contains("stop sequence 0: token id 999 at index 1 is outside the vocabulary"),
        "{e}"
    );
    spec.stop_sequences = vec![vec![3; 3000], vec![4; 3000]];
    let e = engine.submit(spec).unwrap_err();
    assert!(e.message().contains("hold 6000 tokens together"), "{e}");
}
