//! The request engine end to end on the flash-like fixture: generation, events, the prefix
//! cache on the request path, batch invariance, admission control, aborts, timeouts, shutdown.

mod common;

use common::requests::*;

use std::time::{Duration, Instant};

use dsv4::engine::{EventKind, FinishReason, RequestSpec, SamplingParams, ShutdownMode};
use dsv4::error::ErrorKind;
use serde_json::json;

#[test]
fn greedy_generation_matches_argmax_of_full_scoring_and_reuses_the_cache() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    let prompt = &ids[..260];
    let id = engine.submit(greedy(prompt, 20)).unwrap();
    let events = collect(&engine, &[id]);
    let got = tokens_of(&events[&id]);
    assert_eq!(got.len(), 20);
    let end = terminal(&events[&id]);
    assert_eq!(end.kind(), EventKind::Finished);
    assert_eq!(end.finish_reason(), Some(FinishReason::Length));
    assert_eq!(
        (end.stats().prompt_tokens, end.stats().generated_tokens),
        (260, 20)
    );
    assert_eq!(end.stats().cached_tokens_device, 0);
    assert!(end.stats().ttft_us > 0 && end.stats().elapsed_us >= end.stats().ttft_us);
    // Independent check: every generated token is the argmax of a full scoring pass.
    let mut seq: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    seq.extend(got.iter().map(|&t| t as i32));
    let logits = engine.score(&seq[..seq.len() - 1]).unwrap();
    let vocab = engine.vocab_size();
    for (k, &t) in got.iter().enumerate() {
        let row = prompt.len() - 1 + k;
        assert_eq!(
            argmax(&logits[row * vocab..(row + 1) * vocab]),
            t,
            "token {k}"
        );
    }
    // The same prompt again: served from the cache (snapshot at 256), same tokens.
    let id2 = engine.submit(greedy(prompt, 20)).unwrap();
    let events2 = collect(&engine, &[id2]);
    assert_eq!(tokens_of(&events2[&id2]), got);
    assert_eq!(terminal(&events2[&id2]).stats().cached_tokens_device, 256);
    engine.shutdown(ShutdownMode::Drain, None).unwrap();
}

#[test]
fn greedy_tokens_are_the_same_alone_and_among_fifteen_others() {
    let ids = common::ids("flash-like");
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            let start = (i * 17) % 40;
            ids[start..start + 5 + i * 16].to_vec()
        })
        .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            // A fresh engine each time: no cache hits, nothing else running.
            let engine = engine_with(json!({}));
            let id = engine.submit(greedy(p, 24)).unwrap();
            tokens_of(&collect(&engine, &[id])[&id])
        })
        .collect();
    let engine =
        engine_with(json!({"scheduler": {"chunked_prefill_tokens": 64, "max_batch_tokens": 96}}));
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| engine.submit(greedy(p, 24)).unwrap())
        .collect();
    let events = collect(&engine, &ids);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            tokens_of(&events[id]),
            alone[i],
            "request {i} (prompt {})",
            prompts[i].len()
        );
    }
}

#[test]
fn stop_tokens_eos_and_logprobs() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    let prompt = &ids[..50];
    let id = engine.submit(greedy(prompt, 12)).unwrap();
    let free = tokens_of(&collect(&engine, &[id])[&id]);
    // Stop at the 4th token's value: the stop token is the last TOKEN event.
    let stop = free[3];
    let first = free.iter().position(|&t| t == stop).unwrap();
    let mut spec = greedy(prompt, 12);
    spec.stop_tokens = vec![stop];
    spec.logprobs = true;
    spec.user_tag = 77;
    let id = engine.submit(spec).unwrap();
    let events = &collect(&engine, &[id])[&id];
    assert_eq!(tokens_of(events), free[..=first].to_vec());
    let end = terminal(events);
    assert_eq!(end.finish_reason(), Some(FinishReason::Stop));
    assert!(events.iter().all(|e| e.user_tag() == 77));
    for e in events.iter().filter(|e| e.kind() == EventKind::Token) {
        assert!(
            e.logprob() < 0.0 && e.logprob() > -20.0,
            "logprob {}",
            e.logprob()
        );
    }
    // A logit bias on EOS (id 1) makes it the greedy choice: STOP after one token.
    let mut spec = greedy(prompt, 12);
    spec.sampling.logit_bias = vec![(1, 1000.0)];
    let id = engine.submit(spec).unwrap();
    let events = &collect(&engine, &[id])[&id];
    assert_eq!(tokens_of(events), vec![1]);
    assert_eq!(terminal(events).finish_reason(), Some(FinishReason::Stop));
}

#[test]
fn seeded_sampling_repeats_and_different_seeds_differ() {
    let engine = engine_with(json!({}));
    let ids = common::ids("flash-like");
    let run = |seed: u64| {
        let spec = RequestSpec {
            prompt: ids[..30].to_vec(),
            max_new_tokens: 16,
            seed,
            sampling: SamplingParams {
                temperature: 1.5,
                ..SamplingParams::default()
            },
            ..RequestSpec::default()
        };
        let id = engine.submit(spec).unwrap();
        tokens_of(&collect(&engine, &[id])[&id])
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5), run(6));
}

#[test]
fn admission_refuses_at_once_and_names_the_limit() {
    let engine = engine_with(json!({
        "kv": {"max_running_requests": 1},
        "admission": {"max_queued_requests": 2, "max_queued_tokens": 300}
    }));
    let ids = common::ids("flash-like");
    // One runs (long), two wait; the fourth is refused by request count.
    let a = engine.submit(endless(&ids[..20])).unwrap();
    // Wait until it runs (its first token).
    while engine
        .poll(8, Some(Duration::from_millis(500)))
        .unwrap()
        .is_empty()
    {}
    let b = engine.submit(greedy(&ids[..100], 4)).unwrap();
    let c = engine.submit(greedy(&ids[..100], 4)).unwrap();
    let e = engine.submit(greedy(&ids[..10], 4)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QueueFull);
    assert!(
        e.message().contains("admission.max_queued_requests = 2"),
        "{e}"
    );
    engine.abort(c).unwrap();
    let c_events = collect(&engine, &[c]);
    // Queued tokens: 100 waiting; 250 more would pass 300.
    let e = engine.submit(greedy(&ids[..250], 4)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QueueFull);
    assert!(
        e.message().contains("admission.max_queued_tokens = 300"),
        "{e}"
    );
    // Longer than any request can be: capacity, at submit.
    let long: Vec<u32> = ids.iter().cycle().take(5000).copied().collect();
    let e = engine.submit(greedy(&long, 4)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert!(e.message().contains("shorten it"), "{e}");
    // Bad fields.
    let e = engine.submit(greedy(&[], 4)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    let e = engine.submit(greedy(&[5, 100_000], 4)).unwrap_err();
    assert!(e.message().contains("token id 100000 at index 1"), "{e}");
    engine.abort(a).unwrap();
    let events = collect(&engine, &[a, b]);
    assert_eq!(
        terminal(&events[&a]).finish_reason(),
        Some(FinishReason::Aborted)
    );
    assert_eq!(
        terminal(&c_events[&c]).finish_reason(),
        Some(FinishReason::Aborted)
    );
    assert_eq!(
        terminal(&events[&b]).finish_reason(),
        Some(FinishReason::Length)
    );
    assert_eq!(engine.abort(a).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(engine.abort(999).unwrap_err().kind(), ErrorKind::NotFound);
}

#[test]
fn queue_timeouts_and_deadlines_end_requests_with_timeout() {
    let engine = engine_with(json!({
        "kv": {"max_running_requests": 1},
        "admission": {"queue_timeout_ms": 300}
    }));
    let ids = common::ids("flash-like");
    let long = engine.submit(endless(&ids[..20])).unwrap();
    let waiting = engine.submit(greedy(&ids[..20], 4)).unwrap();
    let events = collect(&engine, &[waiting]);
    let end = terminal(&events[&waiting]);
    assert_eq!(end.finish_reason(), Some(FinishReason::Timeout));
    assert_eq!(end.stats().generated_tokens, 0);
    engine.abort(long).unwrap();
    collect(&engine, &[long]);
    // A running request past its deadline.
    let mut spec = endless(&ids[..20]);
    spec.deadline_ms = 400;
    let id = engine.submit(spec).unwrap();
    let events = collect(&engine, &[id]);
    let end = terminal(&events[&id]);
    assert_eq!(end.finish_reason(), Some(FinishReason::Timeout));
    assert!(end.stats().generated_tokens > 0);
    assert!(end.stats().elapsed_us >= 400_000);
}

#[test]
fn shutdown_drain_finishes_and_abort_ends_everything() {
    let ids = common::ids("flash-like");
    let engine = engine_with(json!({}));
    let a = engine.submit(greedy(&ids[..20], 8)).unwrap();
    engine.shutdown(ShutdownMode::Drain, None).unwrap();
    let e = engine.submit(greedy(&ids[..20], 8)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Shutdown);
    // Terminal events stay pollable after shutdown.
    let events = collect(&engine, &[a]);
    assert_eq!(
        terminal(&events[&a]).finish_reason(),
        Some(FinishReason::Length)
    );
    assert_eq!(tokens_of(&events[&a]).len(), 8);
    assert!(
        engine.poll(8, None).unwrap().is_empty(),
        "poll on a stopped engine returns"
    );

    let engine = engine_with(json!({"kv": {"max_running_requests": 2}}));
    let running: Vec<u64> = (0..5)
        .map(|i| engine.submit(endless(&ids[i..i + 20])).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    engine
        .shutdown(ShutdownMode::Abort, Some(Duration::from_secs(30)))
        .unwrap();
    let events = collect(&engine, &running);
    for id in &running {
        assert_eq!(
            terminal(&events[id]).finish_reason(),
            Some(FinishReason::Aborted)
        );
    }
}

#[test]
fn higher_priority_runs_first_then_first_come_first_served() {
    let engine = engine_with(json!({"kv": {"max_running_requests": 1}}));
    let ids = common::ids("flash-like");
    let blocker = engine.submit(endless(&ids[..20])).unwrap();
    // Wait until it runs, then queue three behind it.
    while engine
        .poll(8, Some(Duration::from_millis(500)))
        .unwrap()
        .is_empty()
    {}
    let low_first = engine.submit(greedy(&ids[..30], 2)).unwrap();
    let low_second = engine.submit(greedy(&ids[..31], 2)).unwrap();
    let mut urgent = greedy(&ids[..32], 2);
    urgent.priority = 5;
    let urgent = engine.submit(urgent).unwrap();
    engine.abort(blocker).unwrap();
    let mut order = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while order.len() < 3 && Instant::now() < deadline {
        for e in engine.poll(64, Some(Duration::from_millis(100))).unwrap() {
            if e.is_terminal() && e.request_id() != blocker {
                order.push(e.request_id());
            }
        }
    }
    assert_eq!(order, vec![urgent, low_first, low_second]);
}
