//! Helpers of the request-engine tests: an engine on the flash-like fixture, greedy specs,
//! event collection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dsv4::config::params::Params;
use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams};
use serde_json::{json, Value};

pub fn engine_with(extra: Value) -> Engine {
    let mut doc = json!({
        "model_path": super::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 16, "page_size": 128},
    });
    merge(&mut doc, extra);
    Engine::create(Params::from_value(&doc).unwrap()).unwrap()
}

pub fn merge(doc: &mut Value, extra: Value) {
    if let (Value::Object(d), Value::Object(e)) = (doc, extra) {
        for (k, v) in e {
            match d.get_mut(&k) {
                Some(slot @ Value::Object(_)) if v.is_object() => merge(slot, v),
                _ => {
                    d.insert(k, v);
                }
            }
        }
    }
}

pub fn greedy(prompt: &[u32], max_new: u32) -> RequestSpec {
    RequestSpec {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

/// A request that runs until aborted (or its deadline): EOS suppressed, no length limit in
/// practice.
pub fn endless(prompt: &[u32]) -> RequestSpec {
    exact(prompt, 100_000)
}

/// Greedy with EOS (token 1) suppressed: runs exactly `max_new` tokens.
pub fn exact(prompt: &[u32], max_new: u32) -> RequestSpec {
    let mut spec = greedy(prompt, max_new);
    spec.sampling.logit_bias = vec![(1, -1000.0)];
    spec
}

/// Polls until every id in `ids` has its terminal event; returns all events by id.
pub fn collect(engine: &Engine, ids: &[u64]) -> HashMap<u64, Vec<Event>> {
    let mut out: HashMap<u64, Vec<Event>> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut done = 0;
    while done < ids.len() {
        assert!(Instant::now() < deadline, "events did not arrive");
        for e in engine.poll(64, Some(Duration::from_millis(200))).unwrap() {
            if e.is_terminal() {
                done += 1;
            }
            out.entry(e.request_id()).or_default().push(e);
        }
    }
    out
}

pub fn tokens_of(events: &[Event]) -> Vec<u32> {
    events.iter().filter_map(Event::token_id).collect()
}

pub fn terminal(events: &[Event]) -> &Event {
    let t: Vec<&Event> = events.iter().filter(|e| e.is_terminal()).collect();
    assert_eq!(t.len(), 1, "exactly one terminal event");
    assert!(
        std::ptr::eq(t[0], events.last().unwrap()),
        "terminal event last"
    );
    t[0]
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
        .unwrap()
        .0 as u32
}

/// (token, logprob bits) of a request's TOKEN events.
#[allow(dead_code)]
pub fn stream(events: &[Event]) -> Vec<(u32, u32)> {
    events
        .iter()
        .filter(|e| e.kind() == EventKind::Token)
        .map(|e| (e.token_id().unwrap(), e.logprob().to_bits()))
        .collect()
}

/// The same tokens, with log-probabilities within 1e-4: for rooms run concurrently, as the CPU
/// kernels' last bits depend on how many sequences share a forward pass (a reference run alone
/// is bit-equal only at equal batching).
#[allow(dead_code)]
pub fn same_stream(got: &[(u32, u32)], want: &[(u32, u32)]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g.0 == w.0 && (f32::from_bits(g.1) - f32::from_bits(w.1)).abs() <= 1e-4)
}
