//! Two hosts on one machine: a prefill process in one network namespace and a decode process in
//! another, joined only by a veth pair (10.231.0.1 ↔ 10.231.0.2), as a prefill and a decode on
//! two hosts are; on both transports. Over UCX the processes are limited to UCX's tcp transport
//! on the veth (`UCX_TLS=tcp`, `UCX_NET_DEVICES`): left to itself UCX would see two processes
//! of one machine and use shared memory, which two hosts do not have. The pair's tokens equal a unified engine's and both sides count every room
//! transferred; a kill -9 of either side ends every room on the survivor with a lost-peer error
//! and leaves its pools empty. Delay, loss and reordering come from the fault-injecting
//! wrappers (`tc netem` is not available here): over tcp the fault proxy
//! (tests/common/fault_proxy.rs) runs on the decode's host as a middlebox, over ucx each
//! process's UCX thread injects them (`DSV4_UCX_FAULTS`). Engines hold a `pd.auth_key_file`
//! (beyond loopback they need one) except behind the reordering proxy; one TCP pair runs in TLS.
//!
//! Creating namespaces needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2, so the tests are
//! ignored in a plain `cargo test`; `make test-netns` (part of `make test`) runs them with
//! `--ignored`, and there they fail, never skip, when the namespaces cannot be made. Each test
//! makes its own namespaces (named after the process and the test) and deletes them when it
//! ends, passing or failing.

mod common;

use std::os::fd::AsRawFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::fault_proxy::{Chance, Dir, Fault, FaultProxy, Plan, Rule, DATA, STATE};

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
        let p = self.node(transport, "prefill", prefill, "", None);
        let peer = p.endpoint.clone();
        let d = self.node(transport, "decode", decode, "", Some(&peer));
        (p, d)
    }

    /// A pair whose frames suffer faults on the way: over tcp through a fault proxy following
    /// `plan` on the decode's host (returned; the decode's peer), over ucx from each process's
    /// UCX thread (`DSV4_UCX_FAULTS`: `faults.0` on the prefill, `faults.1` on the decode).
    fn faulty_pair(
        &self,
        transport: &str,
        params: Value,
        faults: (&str, &str),
        plan: Plan,
    ) -> (Node, Node, Option<FaultProxy>) {
        let (pf, df) = if transport == "ucx" { faults } else { ("", "") };
        let mut params = params;
        if transport == "tcp" {
            // The proxy reorders frames: no MAC would verify. UCX's faults happen inside the
            // engines, under the keys.
            common::requests::merge(&mut params, json!({"pd": {"insecure_no_auth": true}}));
        }
        let p = self.node(transport, "prefill", params.clone(), pf, None);
        let proxy = (transport == "tcp").then(|| {
            let target = p.endpoint.clone();
            on_host(&self.decode, move || FaultProxy::start(&target, plan, 5))
        });
        let peer = proxy
            .as_ref()
            .map_or(p.endpoint.clone(), |x| x.addr().to_string());
        let d = self.node(transport, "decode", params, df, Some(&peer));
        (p, d, proxy)
    }

    /// The `role` process on its host, over `transport` (listening on its veth address),
    /// injecting `ucx_faults` when not empty.
    fn node(
        &self,
        t: &str,
        role: &'static str,
        params: Value,
        ucx_faults: &str,
        peer: Option<&str>,
    ) -> Node {
        let (ns, addr) = match role {
            "prefill" => (&self.prefill, PREFILL_ADDR),
            _ => (&self.decode, DECODE_ADDR),
        };
        let mut doc = params;
        common::requests::merge(
            &mut doc,
            json!({"pd": {"transport": t, "listen": format!("{t}://{addr}:0")}}),
        );
        // Beyond loopback an engine needs a key: both hosts share one, unless the test relays
        // frames through a fault proxy that reorders them (on an authenticated link any
        // change on the way takes the link down: tests/pd_rogue_peers.rs).
        let insecure = doc["pd"]["insecure_no_auth"] == json!(true);
        let auth = if !insecure {
            json!({"pd": {"auth_key_file": self.key_file()}})
        } else {
            json!({"pd": {"insecure_no_auth": true}})
        };
        common::requests::merge(&mut doc, auth);
        let dev = self.dev(ns);
        let mut env = vec![("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", dev.as_str())];
        if !ucx_faults.is_empty() {
            // Warnings on stderr: the thread says it injects faults, and which.
            env.extend([("DSV4_UCX_FAULTS", ucx_faults), ("PD_NODE_LOG", "warn")]);
        }
        let node = Node::start_in(Some(ns), &env, role, role, doc, peer);
        assert!(
            node.endpoint.starts_with(&format!("{t}://{addr}:")),
            "the {role} listens on {}",
            node.endpoint
        );
        node
    }

    /// The secret both hosts' engines hold (a file written once per test).
    fn key_file(&self) -> String {
        let path = std::env::temp_dir().join(format!(
            "dsv4-netns-{}-{}.key",
            self.tag,
            std::process::id()
        ));
        std::fs::write(
            &path,
            "5d41402abc4b2a76b9719d911017c5925d41402abc4b2a76b9719d911017c592\n",
        )
        .unwrap();
        path.to_str().unwrap().to_string()
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

/// Runs `f` on a thread inside network namespace `ns`, so that what it opens (sockets, and the
/// threads it starts) lives on that host: the TCP fault proxy as a middlebox there.
fn on_host<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    std::thread::spawn(move || {
        // SAFETY: setns with a namespace file descriptor that stays open across the call; it
        // moves this thread alone (a network namespace may change per thread).
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
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
    // Over UCX the decode takes the states by RMA, emulated over UCX's tcp transport here.
    let rma = common::with_emulated_rma(common::pd_node::base());
    let (mut p, mut d) = hosts.pair(TRANSPORT, common::pd_node::base(), rma);
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
fn frames_delayed_and_reordered_between_the_hosts_still_give_bit_equal_rooms() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [3usize, 129, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 10);
    let hosts = Hosts::new(&format!("dl{}", &TRANSPORT[..1]));
    // tcp: a third of the frames each way held 3 ms (those behind wait: TCP keeps order), and
    // every STATE frame sent after its room's next frame. ucx: every message handed on after a
    // random 0-4 ms, so messages overtake each other.
    let delay = |dir| Chance {
        dir,
        kinds: vec![],
        p: 0.3,
        fault: Fault::Delay(Duration::from_millis(3)),
    };
    let plan = Plan {
        rules: vec![],
        chances: vec![
            Chance {
                dir: Dir::ToDecode,
                kinds: vec![STATE],
                p: 1.0,
                fault: Fault::Reorder,
            },
            delay(Dir::ToDecode),
            delay(Dir::ToPrefill),
        ],
    };
    let faults = ("delay_ms=4,seed=7", "delay_ms=4,seed=8");
    let (mut p, mut d, proxy) = hosts.faulty_pair(TRANSPORT, common::pd_node::base(), faults, plan);
    rooms_match(&mut p, &mut d, &ids, &lens, 10, &want);
    let (pm, dm) = (p.metrics(), d.metrics());
    assert_eq!((pm["failures"], dm["failures"]), (0, 0));
    match &proxy {
        Some(proxy) => {
            let log = proxy.log();
            assert!(
                log.iter().any(|a| a.kind == STATE) && log.len() > lens.len(),
                "{}",
                proxy.report()
            );
        }
        None => assert!(
            d.seen.iter().any(|l| l.contains("injects faults")),
            "{:?}",
            d.seen
        ),
    }
    d.quit();
    p.quit();
}

#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn a_frame_lost_between_the_hosts_fails_its_rooms_on_both_sides_and_later_rooms_land() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(common::pd_node::base(), &ids, &[200], 4);
    let hosts = Hosts::new(&format!("lo{}", &TRANSPORT[..1]));
    // tcp: room 1's first DATA frame never reaches the decode (TCP itself never loses one: a
    // middlebox or a bug would). ucx: the decode loses the prefill's fourth message (the
    // first after its AUTH, PROOF and HELLO), and everything after it waits behind the gap
    // until the prefill is declared dead.
    let plan = Plan {
        rules: vec![Rule {
            dir: Dir::ToDecode,
            kind: Some(DATA),
            room: Some(1),
            nth: 1,
            fault: Fault::Drop,
        }],
        chances: vec![],
    };
    let (mut p, mut d, proxy) = hosts.faulty_pair(TRANSPORT, fast_death(), ("", "lose=4"), plan);
    for room in [1, 2] {
        p.submit(room, 4, &ids[..200]);
        d.submit(room, 4, &ids[..200]);
    }
    d.wait_ends(&[1, 2], Duration::from_secs(20));
    p.wait_ends(&[1, 2], Duration::from_secs(20));
    let lost: &[u64] = if proxy.is_some() { &[1] } else { &[1, 2] };
    for node in [&d, &p] {
        for &room in lost {
            let end = node.end_of(room).unwrap();
            let reason = if proxy.is_some() { "mismatch" } else { "peer_dead" };
            assert!(
                end.starts_with(&format!("error {room} KvTransfer ")) && end.contains(reason),
                "{}: room {room}: {end}",
                node.name
            );
        }
    }
    // Rooms after the loss land whole (over ucx on a new connection).
    let later: Vec<u64> = (1..=4).filter(|r| !lost.contains(r)).collect();
    for &room in later.iter().filter(|&&r| r > 2) {
        p.submit(room, 4, &ids[..200]);
        d.submit(room, 4, &ids[..200]);
    }
    d.wait_ends(&later, Duration::from_secs(20));
    p.wait_ends(&later, Duration::from_secs(20));
    for &room in &later {
        assert_eq!(d.end_of(room).unwrap(), &format!("finished {room} Length"));
        assert_eq!(d.tokens(room), want[&200], "room {room}");
    }
    d.wait_metrics(Duration::from_secs(5), "the decode's pools empty", |m| {
        m["pages_held"] == 0 && m["decode_transfer"] == 0
    });
    assert_eq!(d.usage(), (0, 0), "the decode's pools");
    assert_eq!(p.usage(), (0, 0), "the prefill's pools");
    d.quit();
    p.quit();
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

/// A pair on two hosts in TLS (`pd.tls`, the test certificates, which name the prefill host's
/// address), with the key: the decode checks the prefill's certificate for the address its
/// `pd_peer` names, and the rooms are bit-equal to a unified engine's. TCP only (TLS is).
#[test]
#[ignore = "needs root to make network namespaces: run by `make test-netns`"]
fn in_tls_a_pair_on_two_hosts_is_bit_equal_to_a_unified_engine() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [64usize, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 6);
    let hosts = Hosts::new("tlst");
    let tls = common::tls_fixture;
    let mut prefill = common::pd_node::base();
    common::requests::merge(
        &mut prefill,
        json!({"pd": {"tls": true, "tls_cert_file": tls("prefill.pem"),
                      "tls_key_file": tls("prefill.key")}}),
    );
    let mut decode = common::pd_node::base();
    common::requests::merge(
        &mut decode,
        json!({"pd": {"tls": true, "tls_ca_file": tls("ca.pem")}}),
    );
    let (mut p, mut d) = hosts.pair("tcp", prefill, decode);
    rooms_match(&mut p, &mut d, &ids, &lens, 6, &want);
    assert_eq!(d.metrics()["failures"], 0);
    d.quit();
    p.quit();
}
