//! Prefill and decode engines in one process over TCP loopback: the pair's tokens and
//! log-probabilities are bit-equal to a unified engine's, and every failure ends the request
//! on both sides with an error, leaving the pools as they were (issue "PD 1").

mod common;

use common::requests::*;

#[allow(unused_imports)]
use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, FinishReason, RequestSpec, SamplingParams};
#[allow(unused_imports)]
use dsv4::error::ErrorKind;
use serde_json::{json, Value};

fn prefill(extra: Value) -> Engine {
    let mut doc = json!({"role": "prefill", "pd": {"listen": "tcp://127.0.0.1:0"}});
    merge(&mut doc, extra);
    engine_with(doc)
}

fn decode(extra: Value) -> Engine {
    let mut doc = json!({"role": "decode", "pd": {"listen": "tcp://127.0.0.1:0"}});
    merge(&mut doc, extra);
    engine_with(doc)
}

fn spec(prompt: &[u32], sampled: bool, max_new: u32) -> RequestSpec {
    RequestSpec {
        prompt: prompt.to_vec(),
        max_new_tokens: max_new,
        logprobs: true,
        seed: 99,
        sampling: SamplingParams {
            temperature: if sampled { 3.0 } else { 0.0 },
            // EOS suppressed: every run generates max_new tokens.
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

fn pd(s: &RequestSpec, room: u64, peer: Option<&str>) -> RequestSpec {
    RequestSpec {
        pd_room: room,
        pd_peer: peer.map(str::to_string),
        ..s.clone()
    }
}

/// (token, logprob bits) of a request's TOKEN events.
fn stream(events: &[Event]) -> Vec<(u32, u32)> {
    events
        .iter()
        .filter(|e| e.kind() == EventKind::Token)
        .map(|e| (e.token_id().unwrap(), e.logprob().to_bits()))
        .collect()
}

/// Runs `s` through the pair (room `room`) and returns the prefill's and the decode's events.
fn through(p: &Engine, d: &Engine, s: &RequestSpec, room: u64) -> (Vec<Event>, Vec<Event>) {
    let endpoint = p.pd_endpoint().unwrap();
    let pid = p.submit(pd(s, room, None)).unwrap();
    let did = d.submit(pd(s, room, Some(&endpoint))).unwrap();
    let mut from_d = collect(d, &[did]);
    let mut from_p = collect(p, &[pid]);
    (from_p.remove(&pid).unwrap(), from_d.remove(&did).unwrap())
}

#[test]
fn a_prefill_decode_pair_is_bit_equal_to_a_unified_engine() {
    let ids = common::ids("flash-like");
    let chunked = json!({"scheduler": {"chunked_prefill_tokens": 64}});
    let unified = engine_with(chunked.clone());
    let p = prefill(chunked.clone());
    let d = decode(chunked);
    // Prompt lengths: 1, inside the SWA window, around the 128-token page and compression
    // group, two pages, and past them.
    let mut room = 0;
    for (len, sampled) in [
        (1, false),
        (5, true),
        (20, false),
        (127, true),
        (128, false),
        (129, true),
        (200, false),
        (256, true),
        (300, false),
    ] {
        room += 1;
        let s = spec(&ids[..len], sampled, 12);
        let uid = unified.submit(s.clone()).unwrap();
        let want = collect(&unified, &[uid]).remove(&uid).unwrap();
        let (from_p, from_d) = through(&p, &d, &s, room);
        // The prefill emits no TOKEN event and finishes TRANSFERRED.
        assert_eq!(from_p.len(), 1, "prompt {len}: {from_p:?}");
        assert_eq!(
            terminal(&from_p).finish_reason(),
            Some(FinishReason::Transferred),
            "prompt {len}: {from_p:?}"
        );
        assert_eq!(
            stream(&from_d),
            stream(&want),
            "prompt {len} (sampled: {sampled})"
        );
        assert_eq!(
            terminal(&from_d).finish_reason(),
            Some(FinishReason::Length)
        );
        assert_eq!(stream(&from_d).len(), 12);
    }
}
