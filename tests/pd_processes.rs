//! Prefill and decode engines in processes of their own, on both transports (tcp and ucx) (examples/pd_node.rs, driven over its
//! stdin/stdout, tests/common/pd_node.rs): a pair's tokens equal a unified engine's, and when
//! one side is killed with SIGKILL while rooms are in flight, every room on the survivor ends
//! with an error within the heartbeat deadline and its pools return to empty; a frozen
//! (SIGSTOP) prefill is declared dead by its missed heartbeats; a room aborted mid-transfer on
//! either side ends on the other with an `aborted` KV transfer error, and both sides' pools
//! return to empty.
//!
//! After changing the example, `cargo test --test pd_processes` alone does not rebuild it: run
//! `cargo build --example pd_node` (or a plain `cargo test`) first.

mod common;

use std::time::{Duration, Instant};

use common::pd_node::{
    assert_lost_peer, claim_early, claim_early_with, rooms_match, unified_tokens, Node,
    ONE_AT_A_TIME,
};
use common::requests::merge;
use serde_json::{json, Value};

on_both_transports! {

/// [`common::pd_node::base`] on this module's transport.
fn base() -> Value {
    with(json!({}))
}

/// [`common::pd_node::with`] on this module's transport.
fn with(extra: Value) -> Value {
    let mut doc = common::pd_node::with(extra);
    let t = TRANSPORT;
    merge(
        &mut doc,
        json!({"pd": {"transport": t, "listen": format!("{t}://127.0.0.1:0")}}),
    );
    doc
}

#[test]
fn a_prefill_and_a_decode_process_are_bit_equal_to_a_unified_engine() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let lens = [3usize, 64, 129, 300];
    let max_new = 10;
    let want = unified_tokens(base(), &ids, &lens, max_new);
    let mut p = Node::start("prefill", "prefill", base(), None);
    let peer = p.endpoint.clone();
    assert!(peer.starts_with(&format!("{TRANSPORT}://")), "{peer}");
    let mut d = Node::start("decode", "decode", base(), Some(&peer));
    rooms_match(&mut p, &mut d, &ids, &lens, max_new, &want);
    d.quit();
    p.quit();
    eprintln!("bit-equal pair: {:.2} s", started.elapsed().as_secs_f64());
}

#[test]
fn killing_the_prefill_ends_every_room_on_the_decode() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    // Dead after 3 missed 100 ms heartbeats; nothing else times out during the test.
    let pd = with(
        json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": 3,
                                "bootstrap_timeout_ms": 30000, "transfer_timeout_ms": 30000}}),
    );
    let mut p = Node::start("prefill", "prefill", pd.clone(), None);
    let peer = p.endpoint.clone();
    let mut d = Node::start("decode", "decode", pd, Some(&peer));
    let rooms: Vec<(u64, &[u32])> = vec![
        (1, &ids[..100]),
        (2, &ids[..200]),
        (3, &ids[..300]),
        (4, &ids[..250]),
    ];
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    let killed = Instant::now();
    p.kill();
    let room_ids: Vec<u64> = rooms.iter().map(|r| r.0).collect();
    d.wait_ends(&room_ids, Duration::from_secs(3));
    let took = killed.elapsed();
    assert_lost_peer(&d, &room_ids);
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the failures");
    d.quit();
    eprintln!(
        "prefill killed: decode rooms failed in {:.0} ms (test {:.2} s)",
        took.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn killing_the_decode_ends_every_room_on_the_prefill() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    // The prefill declares a silent decode dead after 3 s: long enough for the test to give it
    // its requests while the decode is frozen; the kill ends the connection well before.
    let pd = |misses: u32| {
        with(
            json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": misses,
                           "bootstrap_timeout_ms": 30000, "transfer_timeout_ms": 30000}}),
        )
    };
    let mut p = Node::start("prefill", "prefill", pd(30), None);
    let peer = p.endpoint.clone();
    let mut d = Node::start("decode", "decode", pd(3), Some(&peer));
    let rooms: Vec<(u64, &[u32])> = vec![
        (1, &ids[..100]),
        (2, &ids[..200]),
        (3, &ids[..300]),
        (4, &ids[..250]),
    ];
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    // Frozen, the decode acknowledges nothing: the prefill's rooms take their early claims
    // and stay in flight until the kill. Rooms 1 and 2 get a second to compute their state
    // and send it into the connection; rooms 3 and 4 are still computing at the kill.
    d.stop();
    p.submit(1, 4, rooms[0].1);
    p.submit(2, 4, rooms[1].1);
    std::thread::sleep(Duration::from_secs(1));
    p.submit(3, 4, rooms[2].1);
    p.submit(4, 4, rooms[3].1);
    let killed = Instant::now();
    d.kill();
    let room_ids: Vec<u64> = rooms.iter().map(|r| r.0).collect();
    p.wait_ends(&room_ids, Duration::from_secs(3));
    let took = killed.elapsed();
    assert_lost_peer(&p, &room_ids);
    for room in [1, 2] {
        let end = p.end_of(room).unwrap();
        assert!(end.contains("phase transferring"), "{end}");
    }
    assert_eq!(p.usage(), (0, 0), "the prefill's pools after the failures");
    p.quit();
    eprintln!(
        "decode killed: prefill rooms failed in {:.0} ms (test {:.2} s)",
        took.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn a_frozen_prefill_is_dead_after_its_missed_heartbeats() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let pd = with(
        json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": 3,
                                "bootstrap_timeout_ms": 30000, "transfer_timeout_ms": 30000}}),
    );
    let mut p = Node::start("prefill", "prefill", pd.clone(), None);
    let peer = p.endpoint.clone();
    let mut d = Node::start("decode", "decode", pd, Some(&peer));
    let rooms: Vec<(u64, &[u32])> = vec![(1, &ids[..100]), (2, &ids[..300])];
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    // SIGSTOP: the connection stays open, only the heartbeats stop.
    let frozen = Instant::now();
    p.stop();
    d.wait_ends(&[1, 2], Duration::from_secs(3));
    let took = frozen.elapsed();
    for room in [1, 2] {
        let end = d.end_of(room).unwrap();
        assert!(
            end.starts_with(&format!("error {room} KvTransfer "))
                && end.contains("heartbeat intervals missed")
                && end.contains("peer_dead"),
            "room {room}: {end}"
        );
    }
    // Dead once silent for 3 intervals of 100 ms, counted from the last heartbeat heard (at
    // most an interval before the freeze).
    assert!(took >= Duration::from_millis(200), "dead after {took:?}");
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the failures");
    p.kill();
    d.quit();
    eprintln!(
        "prefill frozen: decode rooms failed in {:.0} ms (test {:.2} s)",
        took.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

/// Both sides of the abort tests: nothing times out and neither side declares the other dead
/// while the other is frozen for a second (each one's peer is dead after 50 missed 100 ms
/// heartbeats, 5 s; a writer blocked on a frozen reader gives up after as long).
fn abort_params() -> Value {
    with(
        json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": 50,
                        "bootstrap_timeout_ms": 30000, "transfer_timeout_ms": 30000}}),
    )
}

/// A room both sides end, then both pools empty: the pair still works after an abort.
fn one_more_room(p: &mut Node, d: &mut Node, room: u64, prompt: &[u32]) {
    p.submit(room, 3, prompt);
    d.submit(room, 3, prompt);
    d.wait_ends(&[room], Duration::from_secs(10));
    p.wait_ends(&[room], Duration::from_secs(5));
    assert_eq!(
        p.end_of(room).unwrap(),
        &format!("finished {room} Transferred")
    );
    assert_eq!(d.end_of(room).unwrap(), &format!("finished {room} Length"));
    assert_eq!(d.tokens(room).len(), 3);
}

#[test]
fn aborting_on_the_prefill_mid_transfer_fails_the_room_on_the_decode() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let mut p = Node::start("prefill", "prefill", abort_params(), None);
    let peer = p.endpoint.clone();
    let mut d = Node::start("decode", "decode", abort_params(), Some(&peer));
    let prompt = &ids[..300];
    // Long enough that a decode whose state landed before the FAIL is read is still decoding
    // when it is.
    let max_new = 200;
    claim_early_with(&mut p, &mut d, &[(1, prompt)], max_new, (9, &ids[..5]));
    // The decode, frozen, reads nothing: whatever the prefill sends stays in the connection,
    // and the room waits on the prefill for the decode's ACK.
    d.stop();
    p.submit(1, max_new, prompt);
    // Computed and handed to the room (its pages held while in flight), claimed: going out.
    let m = p.wait_metrics(Duration::from_secs(5), "room 1 in flight", |m| {
        m["prefill_inflight"] == 1 && m["pages_held"] > 0 && m["early_claims"] == 0
    });
    assert_eq!(m["prefill_bootstrap"], 0, "{m:?}");
    // The link's writer gets the bytes into the socket (or as far as a frozen reader lets it).
    std::thread::sleep(Duration::from_millis(200));
    assert!(p.end_of(1).is_none(), "room 1 ended early: {:?}", p.seen);
    p.abort(1);
    p.wait_ends(&[1], Duration::from_secs(3));
    assert_eq!(p.end_of(1).unwrap(), "finished 1 Aborted");
    assert!(p.tokens(1).is_empty(), "the prefill emits no token");
    let m = p.metrics();
    assert_eq!(
        (m["prefill_inflight"], m["pages_held"]),
        (0, 0),
        "after the abort: {m:?}"
    );
    assert_eq!(p.usage(), (0, 0), "the prefill's pools after the abort");
    // Thawed, the decode reads the state (all of it, or what went out before the abort) and
    // then the FAIL: its request ends with the prefill's abort, whether the state landed
    // first (it then emitted tokens) or not.
    let thawed = Instant::now();
    d.cont();
    d.wait_ends(&[1], Duration::from_secs(5));
    let took = thawed.elapsed();
    let end = d.end_of(1).unwrap().clone();
    assert!(
        end.starts_with("error 1 KvTransfer ") && end.contains("aborted"),
        "decode: {end}"
    );
    let landed = d.tokens(1).len();
    assert!(
        landed < max_new as usize,
        "the decode finished room 1: {:?}",
        d.seen
    );
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the failure");
    let m = d.metrics();
    assert_eq!(
        (m["decode_transfer"], m["pages_held"]),
        (0, 0),
        "decode: {m:?}"
    );
    let books = format!(
        "prefill transfers={} failures={}, decode transfers={} failures={}",
        p.metrics()["transfers"],
        p.metrics()["failures"],
        m["transfers"],
        m["failures"]
    );
    one_more_room(&mut p, &mut d, 2, &ids[..130]);
    assert_eq!(p.usage(), (0, 0));
    assert_eq!(d.usage(), (0, 0));
    d.quit();
    p.quit();
    eprintln!(
        "aborted on the prefill: the decode's room failed {:.0} ms after the thaw, {landed} \
         token(s) first ({end}; {books}) (test {:.2} s)",
        took.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn aborting_on_the_decode_while_claimed_fails_the_room_on_the_prefill() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let mut p = Node::start("prefill", "prefill", abort_params(), None);
    let peer = p.endpoint.clone();
    // Over UCX by RMA (emulated over UCX's tcp transport here): the hold below is RMA's.
    let rma = common::with_emulated_rma(abort_params());
    let mut d = Node::start("decode", "decode", rma, Some(&peer));
    let prompt = &ids[..300];
    claim_early(&mut p, &mut d, &[(1, prompt)], (9, &ids[..5]));
    let m = d.metrics();
    assert_eq!(
        (m["decode_transfer"], m["pages_held"] > 0),
        (1, true),
        "room 1 claimed on the decode: {m:?}"
    );
    // Frozen, the prefill reads nothing: the decode's FAIL waits in the connection.
    p.stop();
    let aborted = Instant::now();
    d.abort(1);
    d.wait_ends(&[1], Duration::from_secs(2));
    let took = aborted.elapsed();
    assert_eq!(d.end_of(1).unwrap(), "finished 1 Aborted");
    assert!(d.tokens(1).is_empty());
    if TRANSPORT == "ucx" {
        // The claim named the decode's pool memory for RMA writes: the destination stays
        // held until the (frozen) prefill confirms it wrote nothing more into it.
        assert_ne!(d.usage(), (0, 0), "the decode freed pages the prefill may write");
    } else {
        assert_eq!(d.usage(), (0, 0), "the decode's pools after the abort");
    }
    let m = d.metrics();
    assert_eq!(m["decode_transfer"], 0, "decode: {m:?}");
    // The room's request reaches the prefill only now, with the FAIL already waiting: on the
    // thaw it ends with the decode's abort (whichever the prefill reads first) and never
    // transfers.
    let tokens: Vec<String> = prompt.iter().map(u32::to_string).collect();
    p.send(&format!("submit 1 4 {}", tokens.join(",")));
    let thawed = Instant::now();
    p.cont();
    p.wait_ends(&[1], Duration::from_secs(5));
    let failed_in = thawed.elapsed();
    assert!(
        p.seen.iter().any(|l| l.starts_with("accepted 1 ")),
        "{:?}",
        p.seen
    );
    let end = p.end_of(1).unwrap().clone();
    assert!(
        end.starts_with("error 1 KvTransfer ") && end.contains("aborted"),
        "prefill: {end}"
    );
    assert!(p.tokens(1).is_empty());
    assert_eq!(p.usage(), (0, 0), "the prefill's pools after the failure");
    // Thawed, the prefill answered the decode's FAIL (over UCX: FLUSHED): the destination
    // is free.
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.usage() != (0, 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the thaw");
    assert_eq!(d.metrics()["pages_held"], 0);
    let m = p.metrics();
    assert_eq!(
        (
            m["prefill_inflight"],
            m["prefill_bootstrap"],
            m["early_claims"],
            m["pages_held"]
        ),
        (0, 0, 0, 0),
        "prefill: {m:?}"
    );
    one_more_room(&mut p, &mut d, 2, &ids[..130]);
    assert_eq!(p.usage(), (0, 0));
    assert_eq!(d.usage(), (0, 0));
    d.quit();
    p.quit();
    eprintln!(
        "aborted on the decode: finished there in {:.0} ms; the prefill's request failed {:.0} \
         ms after the thaw ({end}) (test {:.2} s)",
        took.as_secs_f64() * 1e3,
        failed_in.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64()
    );
}

}
