//! Operating the engine: metrics against a known workload, retraction when the pools run out
//! during decode (output unchanged), longest-prefix-first scheduling, the prefix cache off.

mod common;

use std::time::Duration;

use common::requests::*;
use dsv4::config::params::Params;
use dsv4::engine::{Engine, EventKind, FinishReason, Outcome, Rejection, RequestSpec};
use dsv4::error::ErrorKind;
use serde_json::json;

#[test]
fn metrics_match_a_known_workload() {
    let engine = engine_with(json!({"admission": {"max_queued_requests": 3}}));
    let ids = common::ids("flash-like");
    let before = engine.metrics();
    assert_eq!(before.pools.device_slots.total, 16);
    assert!(before.pools.device_pages.total > 0 && before.pools.device_pages.used == 0);
    assert_eq!(before.requests, 0);

    // A burst: some accepted, the rest refused by max_queued_requests = 3.
    let mut accepted = Vec::new();
    let mut queue_full = 0;
    for k in 0..12 {
        match engine.submit(exact(&ids[k * 10..k * 10 + 140], 5)) {
            Ok(id) => accepted.push(id),
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::QueueFull);
                queue_full += 1;
            }
        }
    }
    assert!(queue_full > 0 && accepted.len() >= 3);
    let events = collect(&engine, &accepted);
    // A repeat of the first prompt hits the cache (128 tokens: one page snapshot).
    let repeat = engine.submit(exact(&ids[..140], 5)).unwrap();
    let mut all = collect(&engine, &[repeat]);
    all.extend(events);
    // An invalid request and an aborted one.
    let bad = engine.submit(exact(&[u32::MAX - 1], 1)).unwrap_err();
    assert_eq!(bad.kind(), ErrorKind::InvalidArgument);
    let long = engine.submit(exact(&ids[200..260], 100_000)).unwrap();
    let mut seen = Vec::new();
    while seen.is_empty() {
        seen = engine.poll(64, Some(Duration::from_secs(30))).unwrap();
    }
    engine.abort(long).unwrap();
    let mut rest = collect(&engine, &[long]);
    seen.append(rest.get_mut(&long).unwrap());
    all.insert(long, seen);

    let m = engine.metrics();
    let ran: Vec<&Vec<dsv4::engine::Event>> = all.values().collect();
    let terminals: Vec<_> = ran.iter().map(|e| terminal(e)).collect();
    let tokens: usize = ran.iter().map(|e| tokens_of(e).len()).sum();
    let prompt: u64 = terminals
        .iter()
        .map(|t| u64::from(t.stats().prompt_tokens))
        .sum();
    let cached: u64 = terminals
        .iter()
        .map(|t| u64::from(t.stats().cached_tokens_device))
        .sum();
    assert_eq!(m.requests, accepted.len() as u64 + 2);
    assert_eq!(m.rejected(Rejection::QueueFull), queue_full);
    assert_eq!(m.rejected(Rejection::InvalidArgument), 1);
    assert_eq!(m.rejected(Rejection::Capacity), 0);
    assert_eq!(m.finished(Outcome::Length), accepted.len() as u64 + 1);
    assert_eq!(m.finished(Outcome::Aborted), 1);
    assert_eq!(m.finished(Outcome::Stop) + m.finished(Outcome::Error), 0);
    assert_eq!(m.generation_tokens, tokens as u64);
    assert_eq!(m.prompt_tokens, prompt);
    assert_eq!(m.cached_tokens_device, cached);
    assert_eq!(terminal(&all[&repeat]).stats().cached_tokens_device, 128);
    assert_eq!(m.cached_tokens_host, 0);
    let ran_count = terminals.len() as u64;
    assert_eq!(m.ttft.count, ran_count);
    assert_eq!(m.queue_time.count, ran_count);
    assert_eq!(m.e2e.count, ran_count);
    assert_eq!(m.itl.count, tokens as u64 - ran_count);
    let ttft_sum: f64 = terminals
        .iter()
        .map(|t| t.stats().ttft_us as f64 * 1e-6)
        .sum();
    assert!(
        (m.ttft.sum - ttft_sum).abs() < 1e-3 * ran_count as f64,
        "{} vs {ttft_sum}",
        m.ttft.sum
    );
    assert!(m.forward_steps > 0 && m.forward_tokens >= prompt - cached);
    assert_eq!(m.step_time.count, m.forward_steps);
    assert_eq!(
        (m.running, m.queued, m.queued_tokens, m.loading),
        (0, 0, 0, 0)
    );
    assert_eq!(m.retractions, 0);
    // Finished sequences stay cached: pages in use are the tree's.
    assert!(m.pools.device_pages.used > 0);
    assert_eq!(m.pools.device_slots.used, 0);
    assert!(
        (m.token_usage() - m.pools.device_pages.used as f64 / m.pools.device_pages.total as f64)
            .abs()
            < 1e-12
    );
    assert_eq!(m.cache.device_hits, 1);
    // The exposition carries the same numbers.
    let text = engine.prometheus();
    for line in [
        format!("dsv4_num_requests_total {}", m.requests),
        format!("dsv4_generation_tokens_total {}", m.generation_tokens),
        format!("dsv4_num_rejected_requests_total{{reason=\"queue_full\"}} {queue_full}"),
        format!("dsv4_cached_tokens_total{{cache_source=\"device\"}} {cached}"),
        format!("dsv4_time_to_first_token_seconds_count {ran_count}"),
        "dsv4_num_aborted_requests_total 1".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing `{line}` in\n{text}"
        );
    }
}

#[test]
fn a_retracted_request_is_recomputed_and_its_output_is_unchanged() {
    let ids = common::ids("flash-like");
    let prompts: Vec<&[u32]> = (0..4).map(|k| &ids[k * 40..k * 40 + 100]).collect();
    let mut sampled = exact(prompts[3], 300);
    sampled.sampling.temperature = 0.8;
    sampled.seed = 42;
    let specs = |k: usize| {
        if k == 3 {
            sampled.clone()
        } else {
            exact(prompts[k], 300)
        }
    };
    // Reference: one at a time on roomy pools.
    let roomy = engine_with(json!({}));
    let mut want = Vec::new();
    for k in 0..4 {
        let id = roomy.submit(specs(k)).unwrap();
        want.push(tokens_of(&collect(&roomy, &[id])[&id]));
    }
    drop(roomy);

    // 10 pages of 128 tokens; four requests reaching 400 tokens (4 pages) each.
    let tight =
        engine_with(json!({"kv": {"device_memory_bytes": 1100 * 1024, "max_running_requests": 4}}));
    assert_eq!(tight.metrics().pools.device_pages.total, 10);
    let got_ids: Vec<u64> = (0..4).map(|k| tight.submit(specs(k)).unwrap()).collect();
    let events = collect(&tight, &got_ids);
    let m = tight.metrics();
    assert!(m.retractions > 0, "the pools never ran out");
    for (k, id) in got_ids.iter().enumerate() {
        let e = &events[id];
        assert_eq!(tokens_of(e), want[k], "request {k}");
        let end = terminal(e);
        assert_eq!(
            (end.kind(), end.finish_reason()),
            (EventKind::Finished, Some(FinishReason::Length))
        );
        assert_eq!(end.stats().generated_tokens, 300);
        // Token events are numbered without gaps or repeats across the retraction.
        let counts: Vec<u32> = e
            .iter()
            .filter(|e| e.kind() == EventKind::Token)
            .map(|e| e.stats().generated_tokens)
            .collect();
        assert_eq!(counts, (1..=300).collect::<Vec<u32>>());
    }
    assert_eq!(m.finished(Outcome::Length), 4);
    assert_eq!(m.generation_tokens, 1200);
    assert_eq!(
        m.prompt_tokens, 400,
        "a recomputation does not count its prompt again"
    );
    assert_eq!(m.queue_time.count, 4);
    assert_eq!(
        tight
            .prometheus()
            .lines()
            .filter(|l| *l == format!("dsv4_num_retractions_total {}", m.retractions))
            .count(),
        1
    );
    // Nothing leaked: once the cache is flushed, no page, slot or snapshot is in use.
    let usage = tight.flush_cache(dsv4::kv::cache::Tier::All).unwrap();
    assert_eq!((usage.pages, usage.slots, usage.snapshots), (0, 0, 0));
}

/// Order in which `ids` produced their first token (events arrive in engine order).
fn first_token_order(engine: &Engine, ids: &[u64]) -> Vec<u64> {
    let (mut order, mut ended) = (Vec::new(), 0);
    while ended < ids.len() {
        for e in engine.poll(64, Some(Duration::from_secs(30))).unwrap() {
            if !ids.contains(&e.request_id()) {
                continue;
            }
            if e.kind() == EventKind::Token && !order.contains(&e.request_id()) {
                order.push(e.request_id());
            }
            ended += usize::from(e.is_terminal());
        }
    }
    order
}

/// Warms the cache with `warm`, then holds the single running slot with an endless request
/// while `specs` queue up; releases it and returns the order the queued requests ran in.
fn run_order(extra: serde_json::Value, warm: &[u32], specs: Vec<RequestSpec>) -> Vec<usize> {
    let mut doc = json!({"kv": {"max_running_requests": 1}});
    merge(&mut doc, extra);
    let engine = engine_with(doc);
    let w = engine.submit(exact(warm, 1)).unwrap();
    collect(&engine, &[w]);
    let ids = common::ids("flash-like");
    let blocker = engine.submit(exact(&ids[250..258], 100_000)).unwrap();
    loop {
        let e = engine.poll(1, Some(Duration::from_secs(30))).unwrap();
        if e.iter()
            .any(|e| e.request_id() == blocker && e.kind() == EventKind::Token)
        {
            break;
        }
    }
    let queued: Vec<u64> = specs
        .into_iter()
        .map(|s| engine.submit(s).unwrap())
        .collect();
    // Everything is in the engine's queue before the slot frees up.
    while engine.metrics().queued < queued.len() as u64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(50));
    engine.abort(blocker).unwrap();
    let order = first_token_order(&engine, &queued);
    order
        .iter()
        .map(|id| queued.iter().position(|q| q == id).unwrap())
        .collect()
}

#[test]
fn lpm_runs_the_longest_cached_prefix_first_and_falls_back_to_fcfs() {
    let ids = common::ids("flash-like");
    let warm = &ids[..300];
    let cold_a = &ids[150..190];
    let cold_b = &ids[200..240];
    // Shares the warm prompt's first 256 tokens (two pages, snapshot at the last boundary).
    let mut hot: Vec<u32> = warm[..256].to_vec();
    hot.extend_from_slice(&ids[260..270]);
    let mut urgent = exact(cold_b, 2);
    urgent.priority = 5;
    let specs = || vec![exact(cold_a, 2), exact(&hot, 2), urgent.clone()];

    // fcfs: priority, then arrival.
    assert_eq!(run_order(json!({}), warm, specs()), vec![2, 0, 1]);
    // lpm: the cached prefix first; among the cold ones priority breaks the tie.
    let lpm = json!({"scheduler": {"policy": "lpm"}});
    assert_eq!(run_order(lpm, warm, specs()), vec![1, 2, 0]);
    // Above lpm_max_waiting the queue is fcfs again (checked at every admission: 3 and then
    // 2 requests wait here).
    let capped = json!({"scheduler": {"policy": "lpm", "lpm_max_waiting": 1}});
    assert_eq!(run_order(capped, warm, specs()), vec![2, 0, 1]);
}

#[test]
fn prefaulted_pools_serve_the_same_tokens() {
    // `kv.prefault` only makes the pool memory resident at start (its residency is checked in
    // backend::cpu::pool's tests); requests must not see a difference.
    let ids = common::ids("flash-like");
    let prompt = &ids[..300];
    let run = |extra| {
        let engine = engine_with(extra);
        let a = engine.submit(exact(prompt, 8)).unwrap();
        tokens_of(&collect(&engine, &[a])[&a])
    };
    let lazy = run(json!({}));
    assert_eq!(lazy.len(), 8);
    assert_eq!(run(json!({"kv": {"prefault": true}})), lazy);
    let e = Params::from_value(&json!({"kv": {"prefault": "yes"}})).unwrap_err();
    assert!(e.message().contains("`kv.prefault`"), "{e}");
}

#[test]
fn with_the_prefix_cache_off_every_prompt_is_computed() {
    let engine = engine_with(json!({"kv": {"prefix_cache": false}}));
    let ids = common::ids("flash-like");
    let prompt = &ids[..300];
    let a = engine.submit(exact(prompt, 8)).unwrap();
    let ea = collect(&engine, &[a]);
    let b = engine.submit(exact(prompt, 8)).unwrap();
    let eb = collect(&engine, &[b]);
    assert_eq!(tokens_of(&ea[&a]), tokens_of(&eb[&b]));
    assert_eq!(terminal(&eb[&b]).stats().cached_tokens_device, 0);
    let m = engine.metrics();
    assert_eq!(
        (
            m.cached_tokens_device,
            m.cache.hits,
            m.cache.snapshots_taken
        ),
        (0, 0, 0)
    );
    assert_eq!(
        m.pools.device_pages.used, 0,
        "nothing is kept after a request ends"
    );

    let doc = json!({"kv": {"prefix_cache": false}, "hicache": {"enabled": true}});
    let e = Params::from_value(&doc).unwrap_err();
    assert!(
        e.message()
            .contains("`hicache.enabled` is true but `kv.prefix_cache` is false"),
        "{e}"
    );
}
