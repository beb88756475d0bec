//! A request's sequence exported mid-generation from one engine and imported into a second
//! engine with the same params continues exactly: tokens and log-probabilities bit-equal to the
//! uninterrupted run (issue "Redesign 1", sequence state; what PD's transfer builds on).

mod common;

use common::requests::*;

use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;
use serde_json::json;

/// Polls `engine` until `id` has `n` TOKEN events (or ended); returns its events so far.
fn events_until(engine: &Engine, id: u64, n: usize, out: &mut Vec<Event>) {
    let start = Instant::now();
    while out.iter().filter(|e| e.kind() == EventKind::Token).count() < n
        && !out.iter().any(|e| e.is_terminal())
    {
        assert!(start.elapsed() < Duration::from_secs(60), "no progress");
        out.extend(
            engine
                .poll(64, Some(Duration::from_millis(20)))
                .unwrap()
                .into_iter()
                .filter(|e| e.request_id() == id),
        );
    }
}

fn finish(engine: &Engine, id: u64, out: &mut Vec<Event>) {
    let mut all = collect(engine, &[id]);
    out.append(all.get_mut(&id).unwrap());
}

fn spec(prompt: &[u32], sampled: bool) -> RequestSpec {
    RequestSpec {
        prompt: prompt.to_vec(),
        max_new_tokens: 40,
        logprobs: true,
        seed: 1234,
        sampling: SamplingParams {
            temperature: if sampled { 5.0 } else { 0.0 },
            // EOS suppressed: every run is exactly 40 tokens.
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

#[test]
fn an_exported_sequence_continues_bit_equal_on_another_engine() {
    let ids = common::ids("flash-like");
    let params = json!({"scheduler": {"chunked_prefill_tokens": 64}});
    // Prompt lengths: inside the SWA window, mid-page, on a page boundary, mid compression group.
    for (len, sampled) in [
        (5, false),
        (20, true),
        (127, false),
        (128, true),
        (200, false),
        (300, true),
    ] {
        let a = engine_with(params.clone());
        let b = engine_with(params.clone());
        let id = a.submit(spec(&ids[..len], sampled)).unwrap();
        let mut from_a = Vec::new();
        events_until(&a, id, 3, &mut from_a);
        let exported = a.export_sequence(id).unwrap();
        let g = exported.generated;
        assert!(
            (3..40).contains(&g),
            "prompt {len}: exported after {g} tokens"
        );
        assert_eq!(exported.state.position, len + g - 1);
        finish(&a, id, &mut from_a);
        let id_b = b
            .submit_imported(spec(&ids[..len], sampled), exported)
            .unwrap();
        let mut from_b = Vec::new();
        finish(&b, id_b, &mut from_b);
        let tokens = |evs: &[Event]| -> Vec<(u32, Option<u32>, u32)> {
            evs.iter()
                .filter(|e| e.kind() == EventKind::Token)
                .map(|e| {
                    (
                        e.stats().generated_tokens,
                        e.token_id(),
                        e.logprob().to_bits(),
                    )
                })
                .collect()
        };
        let a_tokens = tokens(&from_a);
        assert_eq!(a_tokens.len(), 40, "prompt {len}");
        assert_eq!(
            tokens(&from_b),
            a_tokens[g..].to_vec(),
            "prompt {len}, exported after {g} tokens: engine B differs from the uninterrupted run"
        );
        assert_eq!(terminal(&from_b).stats().generated_tokens, 40);
        assert_eq!(b.metrics().pools.device_slots.used, 0);
    }
}

#[test]
fn exports_of_requests_not_decoding_and_mismatched_imports_are_refused() {
    let ids = common::ids("flash-like");
    let a = engine_with(json!({}));
    let e = a.export_sequence(12345).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let id = a.submit(spec(&ids[..50], false)).unwrap();
    let mut evs = Vec::new();
    events_until(&a, id, 2, &mut evs);
    let exported = a.export_sequence(id).unwrap();
    // Another prompt: refused at submit, nothing queued.
    let e = a
        .submit_imported(spec(&ids[1..51], false), exported.clone())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.message()
            .contains("do not begin with the request's prompt"),
        "{e}"
    );
    // Another layout (bf16 KV rows): accepted, then ends with an ERROR naming the layouts.
    let b = engine_with(json!({"kv": {"dtype": "bf16"}}));
    let id_b = b
        .submit_imported(spec(&ids[..50], false), exported)
        .unwrap();
    let mut from_b = Vec::new();
    finish(&b, id_b, &mut from_b);
    let end = terminal(&from_b);
    assert_eq!(end.kind(), EventKind::Error);
    assert_eq!(end.error_kind(), Some(ErrorKind::InvalidArgument));
    assert!(from_b.iter().all(|e| e.kind() != EventKind::Token));
    let m = b.metrics();
    assert_eq!(
        (m.queued, m.queued_tokens, m.pools.device_pages.used),
        (0, 0, 0)
    );
}
