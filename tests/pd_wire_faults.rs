//! A man-in-the-middle proxy between a decode and a prefill engine (tests/common/fault_proxy.rs,
//! which parses only the 16-byte frame header) corrupts one thing on the way: a flipped state byte, a dropped DATA frame, a DONE frame
//! that claims a different length. Each must fail the room on both engines with the named
//! reason and leave both pools empty: nothing truncated, nothing imported (issue "PD 1").

mod common;

use common::requests::*;

use std::time::{Duration, Instant};

use common::fault_proxy::{At, Dir, Fault, FaultProxy, Plan, Rule, CLAIM, DATA, DONE};
use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;
use serde_json::json;

/// The DONE frame's JSON with one byte more than was sent.
fn one_byte_more(payload: &[u8]) -> Vec<u8> {
    let mut done: serde_json::Value = serde_json::from_slice(payload).unwrap();
    done["bytes"] = (done["bytes"].as_u64().unwrap() + 1).into();
    serde_json::to_vec(&done).unwrap()
}

/// The CLAIM frame's JSON naming another slot: a different destination for the same room.
fn another_slot(payload: &[u8]) -> Vec<u8> {
    let mut claim: serde_json::Value = serde_json::from_slice(payload).unwrap();
    claim["slot"] = (claim["slot"].as_u64().unwrap() + 1).into();
    serde_json::to_vec(&claim).unwrap()
}

/// A proxy to `prefill` that applies `fault` to the `nth` frame of `kind` going to the decode.
fn proxy(prefill: &str, kind: u8, nth: usize, fault: Fault) -> FaultProxy {
    proxy_toward(Dir::ToDecode, prefill, kind, nth, fault)
}

/// A proxy to `prefill` that applies `fault` to the `nth` frame of `kind` going `dir`.
fn proxy_toward(dir: Dir, prefill: &str, kind: u8, nth: usize, fault: Fault) -> FaultProxy {
    let rule = Rule {
        dir,
        kind: Some(kind),
        room: None,
        nth,
        fault,
    };
    FaultProxy::start(
        prefill,
        Plan {
            rules: vec![rule],
            chances: vec![],
        },
        0,
    )
}

fn pd_engine(role: &str) -> Engine {
    engine_with(json!({"role": role, "pd": {"listen": "tcp://127.0.0.1:0"}}))
}

/// A greedy request whose prompt is long enough for several 256 KiB DATA frames.
fn long_greedy() -> RequestSpec {
    let ids = common::ids("flash-like");
    RequestSpec {
        prompt: ids.iter().copied().cycle().take(700).collect(),
        max_new_tokens: 4,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

/// `spec` as room `room` on the prefill `p` and on the decode `d` (which reaches the prefill
/// through `via`): the two request ids.
fn submit_room(p: &Engine, d: &Engine, spec: &RequestSpec, room: u64, via: String) -> (u64, u64) {
    let pid = p
        .submit(RequestSpec {
            pd_room: room,
            ..spec.clone()
        })
        .unwrap();
    let did = d
        .submit(RequestSpec {
            pd_room: room,
            pd_peer: Some(via),
            ..spec.clone()
        })
        .unwrap();
    (pid, did)
}

fn error_of(events: &[Event]) -> (ErrorKind, String) {
    let t = terminal(events);
    assert_eq!(t.kind(), EventKind::Error, "{events:?}");
    (t.error_kind().unwrap(), t.message().unwrap().to_string())
}

#[test]
fn corrupted_dropped_or_misstated_state_bytes_fail_the_room_on_both_sides() {
    let spec = long_greedy();
    let flip = Fault::Corrupt {
        at: At::Payload(8 + 1000),
        mask: 0x40,
    };
    for (room, (kind, nth, fault), reason) in [
        (1, (DATA, 2, flip), "checksum"),
        (2, (DATA, 2, Fault::Drop), "mismatch"),
        (3, (DONE, 1, Fault::Rewrite(one_byte_more)), "mismatch"),
    ] {
        let p = pd_engine("prefill");
        let d = pd_engine("decode");
        let proxy = proxy(&p.pd_endpoint().unwrap(), kind, nth, fault);
        let (pid, did) = submit_room(&p, &d, &spec, room, proxy.addr().to_string());
        let start = Instant::now();
        let from_d = collect(&d, &[did]);
        let from_p = collect(&p, &[pid]);
        assert!(start.elapsed() < Duration::from_secs(10));
        // The fault was applied, once.
        assert_eq!(proxy.log().len(), 1, "{}", proxy.report());
        for (side, events) in [("decode", &from_d[&did]), ("prefill", &from_p[&pid])] {
            let (kind, message) = error_of(events);
            assert_eq!(kind, ErrorKind::KvTransfer, "{side}: {message}");
            assert!(
                message.contains(&format!("({reason})")),
                "{side}: {message}"
            );
            assert!(
                message.contains(&format!("room {room}")),
                "{side}: {message}"
            );
        }
        // No TOKEN reached the host: nothing was imported.
        assert!(from_d[&did].iter().all(|e| e.kind() != EventKind::Token));
        for e in [&p, &d] {
            let u = e.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
            assert_eq!((u.pages, u.slots), (0, 0));
        }
        let m = d.metrics();
        let i = [
            "timeout",
            "peer_dead",
            "aborted",
            "layout",
            "mismatch",
            "checksum",
            "capacity",
        ]
        .iter()
        .position(|r| *r == reason)
        .unwrap();
        assert_eq!(m.pd.failures[i], 1, "{reason}");
    }
}

/// The decode receives a room's bytes straight into the destination pages (CPU pools): an
/// abort while a DATA frame is being read into them ends the request at once, but its pages
/// stay taken until the read is over, so no late byte lands in pages another request got.
/// The next room through the same link is still exact.
#[test]
fn an_abort_mid_frame_keeps_the_destination_until_the_reader_is_done_with_it() {
    let spec = long_greedy();
    let p = pd_engine("prefill");
    let d = pd_engine("decode");
    let pause = Duration::from_millis(1500);
    let stall = Fault::Stall { after: 4096, pause };
    let proxy = proxy(&p.pd_endpoint().unwrap(), DATA, 1, stall);
    let (pid, did) = submit_room(&p, &d, &spec, 1, proxy.addr().to_string());
    let start = Instant::now();
    while proxy.log().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no DATA frame came"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // The decode's reader has the frame's first 4 KiB and waits for the rest.
    std::thread::sleep(Duration::from_millis(100));
    d.abort(did).unwrap();
    let from_d = collect(&d, &[did]);
    assert_eq!(
        terminal(&from_d[&did]).finish_reason(),
        Some(dsv4::engine::FinishReason::Aborted)
    );
    let m = d.metrics();
    assert!(
        start.elapsed() < pause,
        "the abort waited for the stalled frame ({:?}): {}",
        start.elapsed(),
        proxy.report()
    );
    // Ended, but its destination is still the reader's.
    assert!(m.pd.pages_held > 0, "{:?}", m.pd);
    assert_eq!(m.pools.device_pages.used, m.pd.pages_held);
    // The rest of the frame arrives: the pages go back.
    let start = Instant::now();
    loop {
        let m = d.metrics();
        if m.pools.device_pages.used == 0 && m.pd.pages_held == 0 {
            break;
        }
        assert!(
            start.elapsed() < pause + Duration::from_secs(10),
            "the destination was never released: {:?} {:?}",
            m.pools.device_pages,
            m.pd
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (kind, message) = error_of(&collect(&p, &[pid])[&pid]);
    assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
    assert!(message.contains("(aborted)"), "{message}");
    // The next room over the same connection lands whole and decodes what a unified engine
    // does.
    let (pid, did) = submit_room(&p, &d, &spec, 2, proxy.addr().to_string());
    let got = tokens_of(&collect(&d, &[did])[&did]);
    collect(&p, &[pid]);
    let u = engine_with(json!({}));
    let uid = u.submit(spec.clone()).unwrap();
    assert_eq!(got, tokens_of(&collect(&u, &[uid])[&uid]));
    assert_eq!(proxy.connections(), 1, "{}", proxy.report());
    for e in [&p, &d] {
        e.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
        let m = e.metrics();
        assert_eq!((m.pools.device_pages.used, m.pd.pages_held), (0, 0));
    }
}

/// A claim the prefill took, sent again on its connection (a relay repeating a frame), changes
/// nothing: both sides end the room once, successfully, and the decode's tokens are a unified
/// engine's. (The prefill used to fail the room for it, racing the transfer the first claim
/// had started: the decode could land the state and finish first, so the two sides disagreed.)
/// A second claim that differs (another slot) fails the room on the prefill (`mismatch`); the
/// decode fails it too unless the state had landed there first.
#[test]
fn a_repeated_claim_changes_nothing_and_a_different_second_claim_fails_the_room() {
    let spec = long_greedy();
    let unified = engine_with(json!({}));
    let uid = unified.submit(spec.clone()).unwrap();
    let want = tokens_of(&collect(&unified, &[uid])[&uid]);
    assert_eq!(want.len(), 4);
    for (room, fault) in [(1, Fault::Duplicate), (2, Fault::Repeat(another_slot))] {
        let p = pd_engine("prefill");
        let d = pd_engine("decode");
        let proxy = proxy_toward(Dir::ToPrefill, &p.pd_endpoint().unwrap(), CLAIM, 1, fault);
        let (pid, did) = submit_room(&p, &d, &spec, room, proxy.addr().to_string());
        let from_d = collect(&d, &[did]);
        let from_p = collect(&p, &[pid]);
        assert_eq!(proxy.log().len(), 1, "{}", proxy.report());
        let (ended_p, ended_d) = (terminal(&from_p[&pid]), terminal(&from_d[&did]));
        if room == 1 {
            for (side, t) in [("prefill", ended_p), ("decode", ended_d)] {
                assert_ne!(
                    t.kind(),
                    EventKind::Error,
                    "{side}: {t:?}\n{}",
                    proxy.report()
                );
            }
            assert_eq!(tokens_of(&from_d[&did]), want);
        } else {
            let (kind, message) = error_of(&from_p[&pid]);
            assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
            assert!(
                message.contains("a second claim arrived") && message.contains("(mismatch)"),
                "{message}"
            );
            if ended_d.kind() == EventKind::Error {
                let (kind, message) = error_of(&from_d[&did]);
                assert_eq!(kind, ErrorKind::KvTransfer, "{message}");
                assert!(message.contains("(mismatch)"), "{message}");
            } else {
                // The state landed before the FAIL did: it is the prefill's, exactly.
                assert_eq!(tokens_of(&from_d[&did]), want);
            }
        }
        for e in [&p, &d] {
            let u = e.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
            assert_eq!((u.pages, u.slots), (0, 0));
        }
    }
}
