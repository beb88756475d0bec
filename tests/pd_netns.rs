//! Two hosts on one machine: a prefill process in one network namespace and a decode process in
//! another, joined only by a veth pair (10.231.0.1 ↔ 10.231.0.2), as a prefill and a decode on
//! two hosts are; on both transports. Over UCX the processes are limited to UCX's tcp transport
//! on the veth (`UCX_TLS=tcp`, `UCX_NET_DEVICES`): left to itself UCX would see two processes
//! of one machine and use shared memory, which two hosts do not have. The pair's tokens equal a unified engine's and both sides count every room
//! transferred; a kill -9 of either side ends every room on the survivor with a lost-peer error
//! and leaves its pools empty.
//!
//! Creating namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2, so the tests are
//! ignored in a plain `cargo test`; `make test-netns` (part of `make test`) runs them with
//! `--ignored`, and there they fail, never skip, when the namespaces cannot be made. Each test
//! makes its own namespaces (named after the process and the test) and deletes them when it
//! ends, passing or failing.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::pd_node::{
    assert_lost_peer, claim_early, rooms_match, unified_tokens, with, Node, ONE_AT_A_TIME,
};
use serde_json::{json, Value};

const PREFILL_ADDR: &str = "10.231.0.1";
const DECODE_ADDR: &str = "10.231.0.2";

/// Runs `ip args...`; fails the test with what it printed and how to fix it.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip` ({e}): install iproute2"));
    assert!(
        out.status.success(),
        "`ip {}` failed ({}): {}these tests need root (CAP_SYS_ADMIN and CAP_NET_ADMIN) to make \
         network namespaces",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two network namespaces joined by a veth pair, each with its loopback up; deleted on drop
/// (deleting a namespace deletes its end of the veth, and with it the other end).
struct Hosts {
    prefill: String,
    decode: String,
    tag: String,
}

impl Hosts {
    fn new(tag: &str) -> Hosts {
        let pid = std::process::id();
        let hosts = Hosts {
            prefill: format!("dsv4-{tag}-p{pid}"),
            decode: format!("dsv4-{tag}-d{pid}"),
            tag: tag.to_string(),
        };
        // Left over from a killed run with the same pid: gone first (errors ignored).
        for ns in [&hosts.prefill, &hosts.decode] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        ip(&["netns", "add", &hosts.prefill]);
        ip(&["netns", "add", &hosts.decode]);
        // Interface names hold at most 15 bytes: made in the prefill's namespace, so two tests
        // running at once cannot collide on them.
        let (vp, vd) = (format!("vp{tag}"), format!("vd{tag}"));
        ip(&[
            "-n",
            &hosts.prefill,
            "link",
            "add",
            &vp,
            "type",
            "veth",
            "peer",
            "name",
            &vd,
        ]);
        ip(&[
            "-n",
            &hosts.prefill,
            "link",
            "set",
            &vd,
            "netns",
            &hosts.decode,
        ]);
        for (ns, dev, addr) in [
            (&hosts.prefill, &vp, PREFILL_ADDR),
            (&hosts.decode, &vd, DECODE_ADDR),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// The prefill on `transport`, listening on its veth address only; and the decode,
    /// continuing its rooms.
    fn pair(&self, transport: &str, prefill: Value, decode: Value) -> (Node, Node) {
        let t = transport;
        let mut pp = prefill;
        common::requests::merge(
            &mut pp,
            json!({"pd": {"transport": t, "listen": format!("{t}://{PREFILL_ADDR}:0")}}),
        );
        let (vp, vd) = (self.dev(&self.prefill), self.dev(&self.decode));
        let pe = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", vp.as_str())];
        let de = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", vd.as_str())];
        let p = Node::start_in(Some(&self.prefill), &pe, "prefill", "prefill", pp, None);
        assert!(
            p.endpoint.starts_with(&format!("{t}://{PREFILL_ADDR}:")),
            "the prefill listens on {}",
            p.endpoint
        );
        let mut dp = decode;
        common::requests::merge(
            &mut dp,
            json!({"pd": {"transport": t, "listen": format!("{t}://{DECODE_ADDR}:0")}}),
        );
        let peer = p.endpoint.clone();
        let d = Node::start_in(Some(&self.decode), &de, "decode", "decode", dp, Some(&peer));
        (p, d)
    }

    /// The veth end inside namespace `ns`.
    fn dev(&self, ns: &str) -> String {
        let tag = &self.tag;
        if ns == self.prefill {
            format!("vp{tag}")
        } else {
            format!("vd{tag}")
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.prefill, &self.decode] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

on_both_transports! {

/// Dead after 3 missed 100 ms heartbeats; nothing else times out during a test.
fn fast_death() -> Value {
    with(
        json!({"pd": {"heartbeat_interval_ms": 100, "heartbeat_misses": 3,
                       "bootstrap_timeout_ms": 30000, "transfer_timeout_ms": 30000}}),
    )
}

#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn a_pair_on_two_hosts_is_bit_equal_to_a_unified_engine_and_counts_its_transfers() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let started = Instant::now();
    let ids = common::ids("flash-like");
    let lens = [3usize, 64, 129, 256, 300];
    let max_new = 10;
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, max_new);
    let hosts = Hosts::new(&format!("eq{}", &TRANSPORT[..1]));
    let (mut p, mut d) = hosts.pair(TRANSPORT, common::pd_node::base(), common::pd_node::base());
    rooms_match(&mut p, &mut d, &ids, &lens, max_new, &want);
    let n = lens.len() as u64;
    // Both sides count each room once as a transfer, none as a failure, over one connection.
    let (pm, dm) = (p.metrics(), d.metrics());
    assert_eq!(
        (pm["transfers"], pm["failures"], pm["peers"]),
        (n, 0, 1),
        "prefill: {pm:?}"
    );
    assert_eq!(
        (dm["transfers"], dm["failures"], dm["peers"]),
        (n, 0, 1),
        "decode: {dm:?}"
    );
    // Over UCX the prefill wrote every state byte into the decode host's pools by RMA.
    assert!(pm["bytes"] > 0);
    let rma = if TRANSPORT == "ucx" { pm["bytes"] } else { 0 };
    assert_eq!((pm["rma_bytes"], dm["rma_bytes"]), (rma, rma), "{pm:?} {dm:?}");
    d.quit();
    p.quit();
    eprintln!(
        "bit-equal pair across namespaces: {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

/// Four rooms claimed early on the decode (their states not computed yet on the prefill).
fn four_rooms(ids: &[u32]) -> Vec<(u64, &[u32])> {
    vec![
        (1, &ids[..100]),
        (2, &ids[..200]),
        (3, &ids[..300]),
        (4, &ids[..250]),
    ]
}

#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn killing_the_prefill_host_ends_every_room_on_the_decode_host() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let hosts = Hosts::new(&format!("kp{}", &TRANSPORT[..1]));
    let (mut p, mut d) = hosts.pair(TRANSPORT, fast_death(), fast_death());
    let rooms = four_rooms(&ids);
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    let killed = Instant::now();
    p.kill();
    let room_ids: Vec<u64> = rooms.iter().map(|r| r.0).collect();
    d.wait_ends(&room_ids, Duration::from_secs(3));
    let took = killed.elapsed();
    assert_lost_peer(&d, &room_ids);
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the failures");
    let m = d.metrics();
    assert_eq!(
        (m["transfers"], m["failures"], m["decode_transfer"]),
        (1, 4, 0),
        "decode: the probe transferred, the four rooms failed: {m:?}"
    );
    d.quit();
    eprintln!(
        "prefill host killed: decode rooms failed in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
}

#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn killing_the_decode_host_ends_every_room_on_the_prefill_host() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let hosts = Hosts::new(&format!("kd{}", &TRANSPORT[..1]));
    let (mut p, mut d) = hosts.pair(TRANSPORT, fast_death(), fast_death());
    let rooms = four_rooms(&ids);
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    // The prefill computes the rooms and sends what it can; the decode dies meanwhile.
    for &(room, prompt) in &rooms {
        p.submit(room, 4, prompt);
    }
    let killed = Instant::now();
    d.kill();
    let room_ids: Vec<u64> = rooms.iter().map(|r| r.0).collect();
    p.wait_ends(&room_ids, Duration::from_secs(5));
    let took = killed.elapsed();
    // A room the decode finished before the kill may have transferred; every other one is
    // lost with its peer, and none is left in flight.
    let lost: Vec<u64> = room_ids
        .iter()
        .copied()
        .filter(|&r| p.end_of(r).unwrap() != &format!("finished {r} Transferred"))
        .collect();
    assert_lost_peer(&p, &lost);
    assert_eq!(p.usage(), (0, 0), "the prefill's pools after the failures");
    let m = p.metrics();
    assert_eq!(
        (
            m["prefill_inflight"],
            m["prefill_bootstrap"],
            m["pages_held"]
        ),
        (0, 0, 0),
        "prefill: {m:?}"
    );
    assert_eq!(
        (m["transfers"], m["failures"]),
        (1 + (4 - lost.len() as u64), lost.len() as u64),
        "prefill: {m:?}"
    );
    p.quit();
    eprintln!(
        "decode host killed: {} prefill room(s) failed in {:.0} ms",
        lost.len(),
        took.as_secs_f64() * 1e3
    );
}

#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn cutting_the_wire_between_the_hosts_ends_every_room_on_both_by_missed_heartbeats() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let hosts = Hosts::new(&format!("cw{}", &TRANSPORT[..1]));
    let (mut p, mut d) = hosts.pair(TRANSPORT, fast_death(), fast_death());
    let rooms = four_rooms(&ids);
    claim_early(&mut p, &mut d, &rooms, (9, &ids[..5]));
    // The link goes down under both processes: no FIN, no RST, nothing more arrives (a
    // cable pulled, a switch gone); only the heartbeats' silence tells.
    let cut = Instant::now();
    ip(&["-n", &hosts.prefill, "link", "set", &hosts.dev(&hosts.prefill), "down"]);
    let room_ids: Vec<u64> = rooms.iter().map(|r| r.0).collect();
    d.wait_ends(&room_ids, Duration::from_secs(3));
    let took = cut.elapsed();
    for &room in &room_ids {
        let end = d.end_of(room).unwrap();
        assert!(
            end.starts_with(&format!("error {room} KvTransfer "))
                && end.contains("heartbeat intervals missed")
                && end.contains("peer_dead"),
            "decode room {room}: {end}"
        );
    }
    // 3 missed intervals of 100 ms, counted from the last heartbeat heard.
    assert!(took >= Duration::from_millis(200), "dead after {took:?}");
    assert_eq!(d.usage(), (0, 0), "the decode's pools after the cut");
    // The prefill held the rooms' early claims on that link: it declares the decode dead the
    // same way and drops the link with the claims that came on it.
    p.wait_metrics(Duration::from_secs(3), "the link declared dead", |m| {
        m["peers"] == 0 && m["early_claims"] == 0
    });
    assert_eq!(p.usage(), (0, 0), "the prefill's pools after the cut");
    d.quit();
    p.quit();
    eprintln!(
        "wire cut: decode rooms failed in {:.0} ms",
        took.as_secs_f64() * 1e3
    );
}

}
