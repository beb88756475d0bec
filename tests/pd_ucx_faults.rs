//! Faults on a UCX link between a prefill and a decode process (examples/pd_node.rs): UCX
//! owns its wire, so where the TCP tests put a proxy on the byte stream
//! (tests/pd_wire_faults.rs) the UCX thread injects them itself (`DSV4_UCX_FAULTS`,
//! src/pd/ucx_faults.rs). Messages delayed at random (so they overtake each other) still give
//! rooms bit-equal to a unified engine; a lost message stalls the link until the peer is
//! declared dead and every room ends `peer_dead` on both sides; a byte flipped in an RMA
//! write fails that room with `checksum` on both sides while the next room lands. Pools end
//! empty on both sides every time. UCX runs on its tcp transport (`UCX_TLS=tcp`), whose puts
//! UCX emulates with messages: a decode then takes states as active messages unless
//! `pd.ucx_rma_emulated` forces RMA (the tests of RMA writes set it).
//!
//! After changing the example, run `cargo build --example pd_node` first (a plain `cargo
//! test` does).

mod common;

use std::time::{Duration, Instant};

use common::pd_node::{assert_lost_peer, rooms_match, unified_tokens, Node, ONE_AT_A_TIME};
use serde_json::{json, Value};

fn ucx(extra: Value) -> Value {
    common::pd_node::over("ucx", extra)
}

/// [`ucx`] with RMA over UCX's tcp transport (emulated puts) forced.
fn ucx_rma(extra: Value) -> Value {
    common::with_emulated_rma(ucx(extra))
}

/// The environment of an engine process injecting `faults`.
fn env(faults: &str) -> Vec<(&'static str, String)> {
    vec![
        ("UCX_TLS", "tcp".to_string()),
        ("PD_NODE_LOG", "warn".to_string()),
        ("DSV4_UCX_FAULTS", faults.to_string()),
    ]
}

fn start(name: &'static str, role: &str, faults: &str, params: Value, peer: Option<&str>) -> Node {
    let e = env(faults);
    let e: Vec<(&str, &str)> = e.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Node::start_in(None, &e, name, role, params, peer)
}

fn logged(node: &Node, what: &str) -> bool {
    node.seen
        .iter()
        .any(|l| l.starts_with("stderr:") && l.contains(what))
}

#[test]
fn messages_delayed_and_reordered_at_random_still_give_bit_equal_rooms() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [3usize, 129, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 10);
    let mut p = start(
        "prefill",
        "prefill",
        "delay_ms=4,seed=7",
        ucx(json!({})),
        None,
    );
    let peer = p.endpoint.clone();
    let mut d = start(
        "decode",
        "decode",
        "delay_ms=4,seed=8",
        ucx_rma(json!({})),
        Some(&peer),
    );
    rooms_match(&mut p, &mut d, &ids, &lens, 10, &want);
    let (pm, dm) = (p.metrics(), d.metrics());
    assert_eq!((pm["failures"], dm["failures"]), (0, 0));
    assert_eq!(dm["rma_bytes"], dm["bytes"], "the states went by RMA");
    assert!(logged(&p, "injects faults") && logged(&d, "injects faults"));
    d.quit();
    p.quit();
}

#[test]
fn a_lost_message_stalls_the_link_until_the_peer_is_declared_dead_on_both_sides() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let fast = json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": 5}});
    let mut p = start("prefill", "prefill", "", ucx(fast.clone()), None);
    let peer = p.endpoint.clone();
    // The decode loses the prefill's second message (the first after its HELLO answer):
    // every later frame, heartbeats included, waits behind the gap.
    let mut d = start("decode", "decode", "lose=2", ucx(fast), Some(&peer));
    let rooms = [1u64, 2];
    for &room in &rooms {
        p.submit(room, 4, &ids[..200]);
        d.submit(room, 4, &ids[..200]);
    }
    d.wait_ends(&rooms, Duration::from_secs(20));
    p.wait_ends(&rooms, Duration::from_secs(20));
    assert_lost_peer(&d, &rooms);
    assert_lost_peer(&p, &rooms);
    assert_eq!(p.usage(), (0, 0), "the prefill's pools");
    assert_eq!(d.usage(), (0, 0), "the decode's pools");
    assert!(logged(&d, "lost message 2 on purpose"), "{:?}", d.seen);
    d.quit();
    p.quit();
    eprintln!("lost message: {:.2} s", started.elapsed().as_secs_f64());
}

#[test]
fn a_byte_flipped_in_an_rma_write_fails_that_room_with_checksum_on_both_sides() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(common::pd_node::base(), &ids, &[150], 6);
    // The prefill's first RMA write (room 1's first bytes) carries a flipped byte.
    let mut p = start("prefill", "prefill", "flip_put=1", ucx(json!({})), None);
    let peer = p.endpoint.clone();
    let mut d = start("decode", "decode", "", ucx_rma(json!({})), Some(&peer));
    p.submit(1, 6, &ids[..150]);
    d.submit(1, 6, &ids[..150]);
    d.wait_ends(&[1], Duration::from_secs(20));
    p.wait_ends(&[1], Duration::from_secs(20));
    for node in [&d, &p] {
        let end = node.end_of(1).unwrap();
        assert!(
            end.starts_with("error 1 KvTransfer ") && end.contains("checksum"),
            "{}: {end}",
            node.name
        );
    }
    assert!(
        d.tokens(1).is_empty(),
        "nothing decoded from a corrupt state"
    );
    // The next room's bytes are written intact and land.
    p.submit(2, 6, &ids[..150]);
    d.submit(2, 6, &ids[..150]);
    d.wait_ends(&[2], Duration::from_secs(20));
    p.wait_ends(&[2], Duration::from_secs(20));
    assert_eq!(d.end_of(2).unwrap(), "finished 2 Length");
    assert_eq!(d.tokens(2), want[&150]);
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.usage() != (0, 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(d.usage(), (0, 0), "the decode's pools");
    assert_eq!(p.usage(), (0, 0), "the prefill's pools");
    d.quit();
    p.quit();
}

/// Over UCX's tcp transport a put is emulated: the target's worker answers each one, and
/// libucp 1.13 aborts the target's process when that answer cannot go back to an origin
/// whose endpoint failed (a prefill that died mid-transfer). So by default a decode checks
/// its endpoint's lanes and takes states as active messages where no lane does RMA: nothing
/// is written by RMA, the rooms are bit-equal, and the decode says why in its log.
#[test]
fn over_tcp_a_decode_takes_states_as_messages_not_emulated_puts() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [40usize, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 6);
    let mut p = start("prefill", "prefill", "", ucx(json!({})), None);
    let peer = p.endpoint.clone();
    let env = [("UCX_TLS", "tcp"), ("PD_NODE_LOG", "info")];
    let mut d = Node::start_in(None, &env, "decode", "decode", ucx(json!({})), Some(&peer));
    rooms_match(&mut p, &mut d, &ids, &lens, 6, &want);
    let (pm, dm) = (p.metrics(), d.metrics());
    assert_eq!((pm["failures"], dm["failures"]), (0, 0));
    assert!(dm["bytes"] > 0);
    assert_eq!((pm["rma_bytes"], dm["rma_bytes"]), (0, 0), "no RMA write");
    assert!(
        logged(&d, "has no RMA lane (its transports: ") && logged(&d, "tcp/"),
        "{:?}",
        d.seen
    );
    d.quit();
    p.quit();
}
