//! Prefill and decode engines in one process over loopback, on both transports (tcp and ucx):
//! the pair's tokens and log-probabilities are bit-equal to a unified engine's, and every
//! failure ends the request on both sides with an error, leaving the pools as they were.

mod common;

use common::requests::*;

#[allow(unused_imports)]
use std::collections::HashMap;
use std::time::{Duration, Instant};

use dsv4::engine::{Engine, Event, EventKind, FinishReason, RequestSpec, SamplingParams};
#[allow(unused_imports)]
use dsv4::error::ErrorKind;
use serde_json::{json, Value};

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

on_both_transports! {

fn prefill(extra: Value) -> Engine {
    let mut doc = common::pd_doc("prefill", TRANSPORT);
    merge(&mut doc, extra);
    engine_with(doc)
}

fn decode(extra: Value) -> Engine {
    let mut doc = common::pd_doc("decode", TRANSPORT);
    merge(&mut doc, extra);
    engine_with(doc)
}

/// A decode that takes states by RMA over UCX, emulated puts included
/// ([`common::with_emulated_rma`]).
fn rma_decode(extra: Value) -> Engine {
    decode(common::with_emulated_rma(extra))
}

/// Runs `s` through the pair (room `room`) and returns the prefill's and the decode's events.
fn through(p: &Engine, d: &Engine, s: &RequestSpec, room: u64) -> (Vec<Event>, Vec<Event>) {
    let endpoint = p.pd_endpoint().unwrap();
    assert!(endpoint.starts_with(&format!("{TRANSPORT}://")), "{endpoint}");
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
    let d = rma_decode(chunked);
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
    // Both sides count every room and the same bytes; nothing failed, nothing is held.
    let (mp, md) = (p.metrics(), d.metrics());
    assert_eq!(mp.kv_transfer.requests, room);
    assert_eq!(md.kv_transfer.requests, room);
    assert!(mp.kv_transfer.bytes > 0);
    assert_eq!(mp.kv_transfer.bytes, md.kv_transfer.bytes);
    // Over UCX every byte was written by RMA into the decode's pools (no DATA frames: the
    // decode refuses them for a room claimed so); over TCP none.
    let rma = if TRANSPORT == "ucx" {
        mp.kv_transfer.bytes
    } else {
        0
    };
    assert_eq!((mp.kv_transfer.rma_bytes, md.kv_transfer.rma_bytes), (rma, rma));
    assert_eq!((mp.kv_transfer.failures, md.kv_transfer.failures), (0, 0));
    assert_eq!(mp.finished(dsv4::engine::Outcome::Transferred), room);
    assert_eq!((mp.pd.pages_held, md.pd.pages_held), (0, 0));
    assert_eq!((mp.pd.peers, md.pd.peers), (1, 1));
    assert_eq!(mp.queued + md.queued, 0);
    // Every room is observed once in each side's histograms; the rooms' bytes add up to the
    // byte counter; a longer prompt never carries fewer bytes, so the nine rooms spread over
    // more than one byte bucket.
    for (m, side) in [(&mp, "prefill"), (&md, "decode")] {
        assert_eq!(m.pd.side, side);
        for h in [&m.transfer_latency, &m.transfer_bytes, &m.claim_wait] {
            assert_eq!(h.count, room, "{side}");
        }
        assert_eq!(m.transfer_bytes.sum, m.kv_transfer.bytes as f64);
        assert!(m.transfer_bytes.counts.iter().filter(|&&c| c > 0).count() >= 2);
        assert!((m.transfer_latency.sum - m.kv_transfer.seconds).abs() < 1e-9);
    }
    let text = p.prometheus();
    assert!(text.contains(&format!(
        "dsv4_kv_transfer_claim_wait_seconds_count{{side=\"prefill\"}} {room}"
    )));
    assert!(!unified.prometheus().contains("kv_transfer_latency_seconds"));
}

/// Waits for the terminal event of each of `ids`, within `limit`.
pub fn ends_within(engine: &Engine, ids: &[u64], limit: Duration) -> HashMap<u64, Vec<Event>> {
    let start = Instant::now();
    let out = collect(engine, ids);
    assert!(
        start.elapsed() < limit,
        "ended after {:?}, expected within {limit:?}",
        start.elapsed()
    );
    out
}

/// Device pages and slots in use once cached prefixes are dropped.
/// Device pages and slots still in use once the engine settled (every caller expects none).
/// Over UCX a decode frees a failed room's pages only once its prefill confirmed that its RMA
/// writes stopped, a round trip after the request ended: waited for here, up to 2 s.
fn in_use(engine: &Engine) -> (usize, usize) {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let u = engine.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
        if (u.pages, u.slots) == (0, 0) || Instant::now() >= deadline {
            return (u.pages, u.slots);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn error_of(events: &[Event]) -> (ErrorKind, String) {
    let t = terminal(events);
    assert_eq!(t.kind(), EventKind::Error, "{events:?}");
    (t.error_kind().unwrap(), t.message().unwrap().to_string())
}

#[test]
fn a_room_nobody_claims_times_out_and_frees_its_pages() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({"pd": {"bootstrap_timeout_ms": 300}}));
    let id = p.submit(pd(&spec(&ids[..200], false, 4), 7, None)).unwrap();
    let events = ends_within(&p, &[id], Duration::from_secs(5));
    let (kind, message) = error_of(&events[&id]);
    assert_eq!(kind, ErrorKind::Timeout, "{message}");
    assert!(message.contains("room 7"), "{message}");
    assert!(
        message.contains("pd.bootstrap_timeout_ms = 300"),
        "{message}"
    );
    assert_eq!(in_use(&p), (0, 0));
    let m = p.metrics();
    assert_eq!(m.pd.failures[0], 1);
    assert_eq!(m.kv_transfer.failures, 1);
    let text = p.prometheus();
    assert!(
        text.contains("dsv4_kv_transfer_failures_total{reason=\"timeout\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("dsv4_num_prefill_bootstrap_queue_reqs 0"),
        "{text}"
    );
}

#[test]
fn a_decode_whose_peer_does_not_exist_fails_at_once() {
    let ids = common::ids("flash-like");
    let d = decode(json!({}));
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let peer = format!("{TRANSPORT}://127.0.0.1:{port}");
    let id = d
        .submit(pd(&spec(&ids[..50], false, 4), 3, Some(&peer)))
        .unwrap();
    let events = ends_within(&d, &[id], Duration::from_secs(5));
    let (kind, message) = error_of(&events[&id]);
    assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
    assert!(
        message.contains(&peer) && message.contains("room 3"),
        "{message}"
    );
    assert!(message.contains("peer_dead"), "{message}");
    assert_eq!(in_use(&d), (0, 0));
    // Bad PD fields are refused at submit, each named.
    let bad = |s: RequestSpec| d.submit(s).unwrap_err();
    let s = spec(&ids[..5], false, 4);
    let e = bad(pd(&s, 0, Some(&peer)));
    assert!(e.message().contains("pd_room is 0"), "{e}");
    let e = bad(pd(&s, 4, None));
    assert!(e.message().contains("pd_peer is not set"), "{e}");
    let e = bad(pd(&s, 4, Some("http://x:1")));
    assert!(e.message().contains("tcp://"), "{e}");
}

#[test]
fn a_second_live_request_in_one_room_is_refused() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({}));
    let s = spec(&ids[..20], false, 4);
    let first = p.submit(pd(&s, 11, None)).unwrap();
    let e = p.submit(pd(&s, 11, None)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("pd_room 11 is already in use"), "{e}");
    p.abort(first).unwrap();
    let ev = collect(&p, &[first]);
    assert_eq!(
        terminal(&ev[&first]).finish_reason(),
        Some(FinishReason::Aborted)
    );
    // The room is free again once its request ended.
    let again = p.submit(pd(&s, 11, None)).unwrap();
    p.abort(again).unwrap();
    collect(&p, &[again]);
}

#[test]
fn an_abort_on_either_side_ends_the_room_on_both() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({}));
    let d = decode(json!({}));
    let endpoint = p.pd_endpoint().unwrap();
    let s = spec(&ids[..200], false, 4);
    let aborted = |engine: &Engine, id: u64| {
        engine.abort(id).unwrap();
        let ev = ends_within(engine, &[id], Duration::from_secs(5));
        assert_eq!(
            terminal(&ev[&id]).finish_reason(),
            Some(FinishReason::Aborted)
        );
    };
    let failed_for_abort = |events: &[Event], room: u64| {
        let (kind, message) = error_of(events);
        assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
        assert!(message.contains("aborted"), "{message}");
        assert!(message.contains(&format!("room {room}")), "{message}");
    };
    // Aborted on the prefill while it waits for its claim: the decode's claim is refused.
    let pid = p.submit(pd(&s, 21, None)).unwrap();
    aborted(&p, pid);
    let did = d.submit(pd(&s, 21, Some(&endpoint))).unwrap();
    failed_for_abort(&ends_within(&d, &[did], Duration::from_secs(5))[&did], 21);
    // Aborted on the decode after it claimed, before the prefill has the request: the
    // request fails there as soon as it arrives.
    let did = d.submit(pd(&s, 22, Some(&endpoint))).unwrap();
    let start = Instant::now();
    while p.metrics().pd.early_claims == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the claim never arrived"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    aborted(&d, did);
    std::thread::sleep(Duration::from_millis(100));
    let pid = p.submit(pd(&s, 22, None)).unwrap();
    failed_for_abort(&ends_within(&p, &[pid], Duration::from_secs(5))[&pid], 22);
    assert_eq!(in_use(&p), (0, 0));
    assert_eq!(in_use(&d), (0, 0));
}

#[test]
fn engines_with_different_layouts_refuse_each_other_naming_both() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({}));
    let d = decode(json!({"kv": {"page_size": 256}}));
    let endpoint = p.pd_endpoint().unwrap();
    let s = spec(&ids[..30], false, 4);
    let pid = p.submit(pd(&s, 5, None)).unwrap();
    let did = d.submit(pd(&s, 5, Some(&endpoint))).unwrap();
    let from_d = ends_within(&d, &[did], Duration::from_secs(5));
    let (kind, message) = error_of(&from_d[&did]);
    assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
    assert!(message.contains("layout"), "{message}");
    // Both sides' values, each side named.
    assert!(message.contains("page_size: 128 vs 256"), "{message}");
    assert!(
        message.contains(&format!(
            "values: Prefill engine {endpoint} vs Decode engine"
        )),
        "{message}"
    );
    p.abort(pid).unwrap();
    collect(&p, &[pid]);
    assert_eq!(in_use(&d), (0, 0));
}

#[test]
fn a_request_that_differs_between_the_engines_fails_the_room() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({}));
    let d = decode(json!({}));
    let endpoint = p.pd_endpoint().unwrap();
    let pid = p.submit(pd(&spec(&ids[..30], false, 4), 9, None)).unwrap();
    let did = d
        .submit(pd(&spec(&ids[1..31], false, 4), 9, Some(&endpoint)))
        .unwrap();
    let from_p = ends_within(&p, &[pid], Duration::from_secs(5));
    let from_d = ends_within(&d, &[did], Duration::from_secs(5));
    for events in [&from_p[&pid], &from_d[&did]] {
        let (kind, message) = error_of(events);
        assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
        assert!(message.contains("request hash"), "{message}");
    }
    assert_eq!(in_use(&p), (0, 0));
    assert_eq!(in_use(&d), (0, 0));
}

#[test]
fn prefill_side_cache_hits_and_host_load_backs_stay_bit_equal() {
    let ids = common::ids("flash-like");
    let unified = engine_with(json!({}));
    let p = prefill(
        json!({"hicache": {"enabled": true, "ratio": 2.0, "write_policy": "write_through"}}),
    );
    let d = decode(json!({}));
    for sampled in [false, true] {
        let s = spec(&ids[..300], sampled, 8);
        let uid = unified.submit(s.clone()).unwrap();
        let want = stream(&collect(&unified, &[uid])[&uid]);
        let room = if sampled { 100 } else { 200 };
        let cached = |events: &[Event]| {
            let st = terminal(events).stats();
            (st.cached_tokens_device, st.cached_tokens_host)
        };
        // Cold, then a device hit on the prefill, then (device tier flushed) a host load-back.
        let (_, cold) = through(&p, &d, &s, room + 1);
        assert_eq!(stream(&cold), want, "cold");
        let (_, hit) = through(&p, &d, &s, room + 2);
        assert_eq!(stream(&hit), want, "device hit");
        assert_eq!(cached(&hit), (256, 0));
        p.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
        let (_, host) = through(&p, &d, &s, room + 3);
        assert_eq!(stream(&host), want, "host load-back");
        assert_eq!(cached(&host), (0, 256));
        p.flush_cache(dsv4::kv::cache::Tier::All).unwrap();
    }
    assert_eq!(in_use(&p), (0, 0));
    assert_eq!(in_use(&d), (0, 0));
}

#[test]
fn admission_covers_unclaimed_rooms_on_the_prefill_and_reservations_on_the_decode() {
    let ids = common::ids("flash-like");
    let limits = json!({"admission": {"max_queued_requests": 2}});
    let p = prefill(limits.clone());
    let s = spec(&ids[..40], false, 4);
    // Two rooms prefill and wait for claims that never come: the third is refused at once.
    let a = p.submit(pd(&s, 1, None)).unwrap();
    let b = p.submit(pd(&s, 2, None)).unwrap();
    let start = Instant::now();
    while p.metrics().pd.pages_held < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "never prefilled");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.metrics().queued, 0, "both left the queue");
    let e = p.submit(pd(&s, 3, None)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QueueFull, "{e}");
    assert!(
        e.message().contains("admission.max_queued_requests = 2"),
        "{e}"
    );
    for id in [a, b] {
        p.abort(id).unwrap();
    }
    collect(&p, &[a, b]);
    // A decode's reservations (claimed, the prefill never sending) count until they land.
    let d = decode(limits);
    let endpoint = p.pd_endpoint().unwrap();
    let x = d.submit(pd(&s, 4, Some(&endpoint))).unwrap();
    let y = d.submit(pd(&s, 5, Some(&endpoint))).unwrap();
    let start = Instant::now();
    while d.metrics().pd.decode_transfer < 2 {
        assert!(start.elapsed() < Duration::from_secs(10), "never claimed");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(d.metrics().queued, 2);
    let e = d.submit(pd(&s, 6, Some(&endpoint))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QueueFull, "{e}");
    for id in [x, y] {
        d.abort(id).unwrap();
    }
    collect(&d, &[x, y]);
    assert_eq!(d.metrics().queued, 0);
    assert_eq!(in_use(&d), (0, 0));
    // pd.max_rooms bounds the rooms in flight.
    let few = prefill(json!({"pd": {"max_rooms": 1}}));
    let first = few.submit(pd(&s, 7, None)).unwrap();
    let e = few.submit(pd(&s, 8, None)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::QueueFull, "{e}");
    assert!(e.message().contains("pd.max_rooms = 1"), "{e}");
    few.abort(first).unwrap();
    collect(&few, &[first]);
}

#[test]
fn a_claimed_room_that_never_gets_its_state_times_out_on_the_decode() {
    let ids = common::ids("flash-like");
    let p = prefill(json!({}));
    let d = decode(json!({"pd": {"transfer_timeout_ms": 400, "heartbeat_interval_ms": 50}}));
    let endpoint = p.pd_endpoint().unwrap();
    let did = d
        .submit(pd(&spec(&ids[..60], false, 4), 31, Some(&endpoint)))
        .unwrap();
    let from_d = ends_within(&d, &[did], Duration::from_secs(5));
    let (kind, message) = error_of(&from_d[&did]);
    assert_eq!(kind, ErrorKind::Timeout, "{message}");
    assert!(
        message.contains("pd.transfer_timeout_ms = 400"),
        "{message}"
    );
    assert!(message.contains("phase claimed"), "{message}");
    assert_eq!(in_use(&d), (0, 0));
    // The prefill dropped the early claim when the decode failed the room: a late request
    // for the room fails at once instead of waiting for its bootstrap timeout.
    let pid = p.submit(pd(&spec(&ids[..60], false, 4), 31, None)).unwrap();
    let from_p = ends_within(&p, &[pid], Duration::from_secs(5));
    let (_, message) = error_of(&from_p[&pid]);
    assert!(message.contains("timeout"), "{message}");
}

#[test]
fn heartbeats_keep_a_busy_link_alive() {
    // Heartbeats every 50 ms, dead after 6 silent intervals, while two engines compute on a
    // loaded machine and long prompts' states move: the peers never look dead. (That control
    // frames overtake bulk data is asserted exactly in the link's unit tests.)
    let ids = common::ids("flash-like");
    let fast = json!({"pd": {"heartbeat_interval_ms": 50, "heartbeat_misses": 6}});
    let p = prefill(fast.clone());
    let d = decode(fast);
    let endpoint = p.pd_endpoint().unwrap();
    let long: Vec<u32> = ids.iter().copied().cycle().take(700).collect();
    let s = spec(&long, false, 2);
    let mut pids = Vec::new();
    let mut dids = Vec::new();
    for room in 1..=6 {
        pids.push(p.submit(pd(&s, room, None)).unwrap());
        dids.push(d.submit(pd(&s, room, Some(&endpoint))).unwrap());
    }
    let from_d = collect(&d, &dids);
    let from_p = collect(&p, &pids);
    for id in &dids {
        assert_eq!(
            terminal(&from_d[id]).finish_reason(),
            Some(FinishReason::Length),
            "{:?}",
            from_d[id]
        );
    }
    for id in &pids {
        assert_eq!(
            terminal(&from_p[id]).finish_reason(),
            Some(FinishReason::Transferred)
        );
    }
    assert_eq!(d.metrics().pd.failures.iter().sum::<u64>(), 0);
}

/// Overlap: with the decode's claim in before the prefill computes, the prompt's complete
/// pages go out chunk by chunk while the rest computes; the tokens are still a unified
/// engine's, bit for bit, and both sides count the same early bytes (less than the whole: the
/// last partial page and the per-request state go at hand-over).
#[test]
fn complete_pages_go_out_while_the_prompt_computes() {
    let ids = common::ids("flash-like");
    let chunked = json!({"scheduler": {"chunked_prefill_tokens": 64}});
    let unified = engine_with(chunked.clone());
    let p = prefill(chunked.clone());
    let d = rma_decode(chunked);
    let endpoint = p.pd_endpoint().unwrap();
    for (room, sampled) in [(1, false), (2, true)] {
        // A prompt of its own per room: a prefix-cache hit would leave nothing to overlap.
        let prompt: Vec<u32> = ids
            .iter()
            .copied()
            .cycle()
            .skip(room as usize)
            .take(700)
            .collect();
        let s = spec(&prompt, sampled, 6);
        let uid = unified.submit(s.clone()).unwrap();
        let want = collect(&unified, &[uid]).remove(&uid).unwrap();
        let before = p.metrics().kv_transfer.early_bytes;
        // The decode first: its claim waits on the prefill before the prompt computes.
        let did = d.submit(pd(&s, room, Some(&endpoint))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while p.metrics().pd.early_claims == 0 {
            assert!(
                Instant::now() < deadline,
                "the decode's claim never reached the prefill"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        let pid = p.submit(pd(&s, room, None)).unwrap();
        let from_d = collect(&d, &[did]).remove(&did).unwrap();
        let from_p = collect(&p, &[pid]).remove(&pid).unwrap();
        assert_eq!(
            terminal(&from_p).finish_reason(),
            Some(FinishReason::Transferred)
        );
        assert_eq!(stream(&from_d), stream(&want), "room {room}");
        assert!(
            p.metrics().kv_transfer.early_bytes > before,
            "room {room}: nothing went early"
        );
    }
    let (mp, md) = (p.metrics(), d.metrics());
    if TRANSPORT == "tcp" {
        assert_eq!(mp.kv_transfer.early_bytes, md.kv_transfer.early_bytes);
    } else {
        // Written by RMA, early pages land without the decode seeing them.
        assert_eq!(md.kv_transfer.early_bytes, 0);
        assert_eq!(md.kv_transfer.rma_bytes, md.kv_transfer.bytes);
    }
    assert!(mp.kv_transfer.early_bytes < mp.kv_transfer.bytes);
    assert_eq!((mp.kv_transfer.failures, md.kv_transfer.failures), (0, 0));
    assert_eq!((mp.pd.pages_held, md.pd.pages_held), (0, 0));
}

}

/// `pd.ucx_rma = false` on a UCX decode: the state goes as active messages (nothing is
/// written by RMA) and the output is still bit-equal to a unified engine's.
#[test]
fn a_ucx_decode_without_rma_receives_data_frames_bit_equal() {
    let ids = common::ids("flash-like");
    let unified = engine_with(json!({}));
    let p = engine_with(common::pd_doc("prefill", "ucx"));
    let mut doc = common::pd_doc("decode", "ucx");
    merge(&mut doc, json!({"pd": {"ucx_rma": false}}));
    let d = engine_with(doc);
    let endpoint = p.pd_endpoint().unwrap();
    for (room, len) in [(1u64, 40usize), (2, 300)] {
        let s = spec(&ids[..len], true, 8);
        let uid = unified.submit(s.clone()).unwrap();
        let want = collect(&unified, &[uid]).remove(&uid).unwrap();
        let pid = p.submit(pd(&s, room, None)).unwrap();
        let did = d.submit(pd(&s, room, Some(&endpoint))).unwrap();
        let from_d = collect(&d, &[did]).remove(&did).unwrap();
        collect(&p, &[pid]);
        assert_eq!(stream(&from_d), stream(&want), "prompt {len}");
    }
    let (mp, md) = (p.metrics(), d.metrics());
    assert_eq!((mp.kv_transfer.requests, md.kv_transfer.requests), (2, 2));
    assert!(md.kv_transfer.bytes > 0);
    assert_eq!((mp.kv_transfer.rma_bytes, md.kv_transfer.rma_bytes), (0, 0));
}

/// An engine on the ucx transport where libucp cannot be loaded is refused at creation with
/// `Unsupported`, naming the package; the params checks name a scheme that does not match the
/// transport; a decode on one transport refuses a peer on the other at its claim.
#[test]
fn the_ucx_transport_is_refused_clearly_where_it_cannot_work() {
    use dsv4::config::params::Params;
    let mut doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 16, "page_size": 128},
        "role": "prefill",
        "pd": {"transport": "ucx", "ucx_library": "/nonexistent/libucp.so.0"},
    });
    let Err(e) = Engine::create(Params::from_value(&doc).unwrap()) else {
        panic!("an engine started without libucp");
    };
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(
        e.message().contains("pd.transport = \"ucx\"")
            && e.message().contains("/nonexistent/libucp.so.0")
            && e.message().contains("apt install libucx0"),
        "{e}"
    );
    merge(
        &mut doc,
        json!({"pd": {"listen": "tcp://127.0.0.1:0", "ucx_library": null}}),
    );
    let e = Params::from_value(&doc).unwrap_err();
    assert!(
        e.message().contains(
            "`pd.listen` = tcp://127.0.0.1:0 does not match `pd.transport` = \"ucx\": use \
             ucx://HOST:PORT"
        ),
        "{e}"
    );
    // A ucx decode given a tcp prefill: the room fails with the mismatch named.
    let p = engine_with(common::pd_doc("prefill", "tcp"));
    let d = engine_with(common::pd_doc("decode", "ucx"));
    let ids = common::ids("flash-like");
    let peer = p.pd_endpoint().unwrap();
    let id = d
        .submit(pd(&spec(&ids[..20], false, 4), 5, Some(&peer)))
        .unwrap();
    let events = tcp::ends_within(&d, &[id], Duration::from_secs(5));
    let (kind, message) = tcp::error_of(&events[&id]);
    assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
    assert!(
        message.contains("is a tcp endpoint but this engine's pd.transport is \"ucx\""),
        "{message}"
    );
}
