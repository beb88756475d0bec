//! Authentication over the ucx transport, against engine processes (examples/pd_node.rs) and
//! rogue UCX peers written here from the message format alone (an active message of id 0
//! whose header is a sequence number u64 LE then the 16-byte frame header — kind, three zero
//! bytes, payload length u32 LE, room u64 LE — and whose data is the JSON payload):
//! engines holding a common secret (one of them rotating) move rooms exact both by RMA (the
//! DONE's MAC checked over the written bytes) and by messages; strangers get one generic
//! refusal; a decode sends its HELLO (the remote keys of its pools) only to a prefill that
//! proved it holds the secret; a byte flipped in an RMA write fails its room on the MAC; and
//! connections that never finish their handshake are bounded (`pd.max_handshakes`).
//!
//! After changing the example, run `cargo build --example pd_node` first (a plain `cargo
//! test` does).

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::key_file;
use common::pd_node::{rooms_match, rooms_match_from, unified_tokens, Node, ONE_AT_A_TIME};
use common::requests::merge;
use dsv4::pd::ucx::{Context, Endpoint, Listener, Worker};
use serde_json::{json, Value};

const HELLO: u8 = 1;
const REFUSE: u8 = 2;
const CLAIM: u8 = 3;
const AUTH: u8 = 11;
const PROOF: u8 = 12;

const OLD: &str = "3f1c0d5e9a7b2468ace013579bdf2468ace013579bdf2468ace013579bdf0000";
const NEW: &str = "77aa11bb22cc33dd44ee55ff6677889900aabbccddeeff001122334455667788";

fn ucx(extra: Value) -> Value {
    common::pd_node::over("ucx", extra)
}

fn keyed(file: &str, extra: Value) -> Value {
    let mut doc = ucx(extra);
    merge(&mut doc, json!({"pd": {"auth_key_file": file}}));
    doc
}

const ENV: [(&str, &str); 2] = [("UCX_TLS", "tcp"), ("PD_NODE_LOG", "warn")];

fn start(name: &'static str, role: &str, params: Value, peer: Option<&str>) -> Node {
    Node::start_in(None, &ENV, name, role, params, peer)
}

fn addr_of(endpoint: &str) -> SocketAddr {
    endpoint.trim_start_matches("ucx://").parse().unwrap()
}

/// A UCX peer of our own: a worker on UCX's tcp transport.
struct Rogue {
    worker: Worker,
    _ctx: Arc<Context>,
}

impl Rogue {
    fn new() -> Rogue {
        let ctx = Context::new(None, Some("tcp")).unwrap_or_else(|e| panic!("{e}"));
        let worker = Worker::new(&ctx).unwrap();
        worker.receive(0, 256, 1 << 20).unwrap();
        Rogue { worker, _ctx: ctx }
    }

    /// Sends frame `kind` as message `seq` on `ep` and waits until it is out.
    fn say(&self, ep: &Endpoint, seq: u64, kind: u8, room: u64, payload: &[u8]) {
        let mut header = seq.to_le_bytes().to_vec();
        header.extend_from_slice(&[kind, 0, 0, 0]);
        header.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        header.extend_from_slice(&room.to_le_bytes());
        let mut req = ep.send(0, header, Vec::from(payload)).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            self.worker.progress();
            if let Some(r) = req.poll() {
                r.unwrap();
                return;
            }
            assert!(Instant::now() < deadline, "a send did not complete");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// The next frame received (kind, header length, payload) within `within`, or `None`.
    fn hear(&self, within: Duration) -> Option<(u8, usize, Vec<u8>)> {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            self.worker.progress();
            if let Some(m) = self.worker.take_message() {
                return Some((m.header[8], m.header.len(), m.data));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        None
    }

    /// Whether the peer ended the endpoint within `within`.
    fn closed_within(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            self.worker.progress();
            if !self.worker.take_errors().is_empty() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }
}

/// A decode's HELLO with a layout a prefill can read from its REFUSE messages.
fn a_decode_hello() -> Value {
    json!({
        "protocol": "dsv4-pd", "version": 5, "side": "decode",
        "endpoint": "ucx://127.0.0.1:1",
        "layout": {"model": "x", "layers": 1, "pools": []},
        "heartbeat_interval_ms": 1000, "rma_keys": []
    })
}

#[test]
fn with_a_key_ucx_peers_authenticate_and_strangers_learn_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [40usize, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 6);
    // Rotating: the prefill signs with the old secret, the decodes already with the new one.
    let mut p = start(
        "prefill",
        "prefill",
        keyed(&key_file("p", &[OLD, NEW]), json!({})),
        None,
    );
    let endpoint = p.endpoint.clone();
    let d_keys = key_file("d", &[NEW, OLD]);
    // By RMA (each room's DONE carries the MAC over the written bytes), then by messages.
    let by_rma = common::with_emulated_rma(keyed(&d_keys, json!({})));
    let mut d = start("decode", "decode", by_rma, Some(&endpoint));
    rooms_match(&mut p, &mut d, &ids, &lens, 6, &want);
    assert!(d.metrics()["rma_bytes"] > 0, "the states went by RMA");
    d.quit();
    let mut d = start(
        "decode",
        "decode",
        keyed(&d_keys, json!({})),
        Some(&endpoint),
    );
    rooms_match_from(11, &mut p, &mut d, &ids, &lens, 6, &want);
    assert_eq!(d.metrics()["rma_bytes"], 0, "the states went as messages");
    assert_eq!(d.metrics()["failures"], 0);

    // Strangers: a HELLO (with a layout), an AUTH with a proof under no secret, a CLAIM. Each
    // gets the same refusal, unsealed and with nothing of ours in it, and is closed.
    let addr = addr_of(&endpoint);
    let refused = |r: &Rogue| {
        let (kind, header, payload) = r.hear(Duration::from_secs(10)).expect("an answer");
        assert_eq!((kind, header), (REFUSE, 24));
        let said: Value = serde_json::from_slice(&payload).unwrap();
        assert_eq!(said["message"], "the connection was refused", "{said}");
        assert!(r.closed_within(Duration::from_secs(5)), "closed");
    };
    let r = Rogue::new();
    let ep = r.worker.connect(addr).unwrap();
    let hello = serde_json::to_vec(&a_decode_hello()).unwrap();
    r.say(&ep, 0, HELLO, 0, &hello);
    refused(&r);
    let r = Rogue::new();
    let ep = r.worker.connect(addr).unwrap();
    let nonce = serde_json::to_vec(&json!({"nonce": "ab".repeat(32)})).unwrap();
    r.say(&ep, 0, AUTH, 0, &nonce);
    let (kind, _, _) = r.hear(Duration::from_secs(10)).expect("its nonce");
    assert_eq!(kind, AUTH, "the prefill's own nonce");
    let proof = serde_json::to_vec(&json!({"proof": "cd".repeat(32)})).unwrap();
    r.say(&ep, 1, PROOF, 0, &proof);
    refused(&r);
    let r = Rogue::new();
    let ep = r.worker.connect(addr).unwrap();
    r.say(&ep, 0, CLAIM, 1, b"{}");
    refused(&r);
    // A HELLO sent ahead of its turn, before any proof: it would be held until the keys came,
    // then handed on unchecked. The connection is closed instead.
    let r = Rogue::new();
    let ep = r.worker.connect(addr).unwrap();
    r.say(&ep, 0, AUTH, 0, &nonce);
    r.say(&ep, 2, HELLO, 0, &hello);
    assert!(r.closed_within(Duration::from_secs(5)), "closed");
    p.wait_until(Duration::from_secs(5), "the refusals logged", |seen| {
        let said = |what: &str| seen.iter().filter(|l| l.contains(what)).count();
        said("refused a UCX connection: it did not authenticate") == 3
            && said("message 2 arrived before message 1 of its handshake") == 1
    });

    // A decode with another secret, and one with none: each told how to fix it.
    let other = "0000111122223333444455556666777788889999aaaabbbbccccddddeeeeffff";
    let wrong = keyed(&key_file("w", &[other]), json!({}));
    for params in [wrong, ucx(json!({}))] {
        let mut n = start("decode", "decode", params, Some(&endpoint));
        n.submit(20, 6, &ids[..60]);
        n.wait_ends(&[20], Duration::from_secs(20));
        let end = n.end_of(20).unwrap().clone();
        assert!(end.starts_with("error 20 KvTransfer"), "{end}");
        assert!(end.contains("the connection was refused"), "{end}");
        assert!(end.contains("pd.auth_key_file"), "{end}");
        assert!(!end.contains(OLD) && !end.contains(NEW), "{end}");
        n.quit();
    }
    // A prefill without a key tells a keyed decode why.
    let bare = start("prefill", "prefill", ucx(json!({})), None);
    let bare_endpoint = bare.endpoint.clone();
    let mut n = start(
        "decode",
        "decode",
        keyed(&d_keys, json!({})),
        Some(&bare_endpoint),
    );
    n.submit(21, 6, &ids[..60]);
    n.wait_ends(&[21], Duration::from_secs(20));
    let end = n.end_of(21).unwrap().clone();
    assert!(end.contains("holds no pd.auth_key_file"), "{end}");
    n.quit();
    bare.quit();
    d.quit();
    p.quit();
}

#[test]
fn a_decode_sends_its_remote_keys_only_to_a_prefill_that_proves_it_holds_the_secret() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    // A rogue prefill: it answers the decode's AUTH with a nonce of its own, then with a
    // proof it cannot have made, and records everything the decode sends.
    let r = Rogue::new();
    let listener: Listener = r.worker.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let endpoint = format!("ucx://{}", listener.local_addr());
    let params = common::with_emulated_rma(keyed(&key_file("d", &[NEW]), json!({})));
    let mut d = start("decode", "decode", params, Some(&endpoint));
    d.submit(1, 6, &ids[..60]);
    let deadline = Instant::now() + Duration::from_secs(20);
    let ep = loop {
        r.worker.progress();
        if let Some(ep) = r.worker.accept() {
            break ep.unwrap();
        }
        assert!(Instant::now() < deadline, "the decode did not connect");
        std::thread::sleep(Duration::from_millis(1));
    };
    let (kind, _, payload) = r.hear(Duration::from_secs(10)).expect("the decode's AUTH");
    assert_eq!(kind, AUTH);
    let theirs: Value = serde_json::from_slice(&payload).unwrap();
    assert_eq!(theirs["nonce"].as_str().unwrap().len(), 64, "{theirs}");
    let nonce = serde_json::to_vec(&json!({"nonce": "ab".repeat(32)})).unwrap();
    r.say(&ep, 0, AUTH, 0, &nonce);
    let (kind, _, _) = r.hear(Duration::from_secs(10)).expect("the decode's PROOF");
    assert_eq!(kind, PROOF);
    let proof = serde_json::to_vec(&json!({"proof": "cd".repeat(32)})).unwrap();
    r.say(&ep, 1, PROOF, 0, &proof);
    d.wait_ends(&[1], Duration::from_secs(20));
    let end = d.end_of(1).unwrap().clone();
    assert!(end.starts_with("error 1 KvTransfer"), "{end}");
    assert!(end.contains("did not authenticate"), "{end}");
    // Nothing more came: no HELLO, so none of the decode's remote keys.
    if let Some((kind, _, payload)) = r.hear(Duration::from_millis(500)) {
        panic!(
            "the decode sent a frame of kind {kind} to an unproven prefill: {}",
            String::from_utf8_lossy(&payload)
        );
    }
    d.quit();
    drop(listener);
}

#[test]
fn on_an_authenticated_link_a_byte_flipped_in_an_rma_write_fails_the_room_on_its_mac() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(common::pd_node::base(), &ids, &[150], 6);
    let file = key_file("k", &[NEW]);
    let env = [("UCX_TLS", "tcp"), ("DSV4_UCX_FAULTS", "flip_put=1")];
    let mut p = Node::start_in(
        None,
        &env,
        "prefill",
        "prefill",
        keyed(&file, json!({})),
        None,
    );
    let peer = p.endpoint.clone();
    let params = common::with_emulated_rma(keyed(&file, json!({})));
    let mut d = start("decode", "decode", params, Some(&peer));
    p.submit(1, 6, &ids[..150]);
    d.submit(1, 6, &ids[..150]);
    d.wait_ends(&[1], Duration::from_secs(20));
    p.wait_ends(&[1], Duration::from_secs(20));
    let end = d.end_of(1).unwrap().clone();
    assert!(
        end.starts_with("error 1 KvTransfer ") && end.contains("checksum"),
        "{end}"
    );
    assert!(
        end.contains("do not verify under the link's key (MAC)"),
        "{end}"
    );
    assert!(
        d.tokens(1).is_empty(),
        "nothing decoded from a corrupt state"
    );
    // The next room's bytes are written intact and land.
    p.submit(2, 6, &ids[..150]);
    d.submit(2, 6, &ids[..150]);
    d.wait_ends(&[2], Duration::from_secs(20));
    assert_eq!(d.end_of(2).unwrap(), "finished 2 Length");
    assert_eq!(d.tokens(2), want[&150]);
    d.quit();
    p.quit();
}

#[test]
fn ucx_connections_past_max_handshakes_are_closed_at_once_and_late_ones_time_out() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(common::pd_node::base(), &ids, &[60], 6);
    let file = key_file("k", &[NEW]);
    let bounds = json!({"pd": {"max_handshakes": 2, "handshake_timeout_ms": 1500}});
    let mut p = start("prefill", "prefill", keyed(&file, bounds), None);
    let addr = addr_of(&p.endpoint);
    // Four connections that say nothing: two wait in their handshake, two are closed at once.
    let r = Rogue::new();
    let eps: Vec<Endpoint> = (0..4).map(|_| r.worker.connect(addr).unwrap()).collect();
    let started = Instant::now();
    let mut closed = 0;
    while closed < 2 && started.elapsed() < Duration::from_secs(1) {
        r.worker.progress();
        closed += r.worker.take_errors().len();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(closed, 2, "two closed within a second");
    // The other two, once the handshake timeout passed.
    while closed < 4 && started.elapsed() < Duration::from_secs(5) {
        r.worker.progress();
        closed += r.worker.take_errors().len();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(closed, 4, "all closed after pd.handshake_timeout_ms");
    assert!(
        started.elapsed() >= Duration::from_millis(1400),
        "{:?}",
        started.elapsed()
    );
    p.wait_until(Duration::from_secs(5), "the log", |seen| {
        seen.iter().any(|l| l.contains("pd.max_handshakes = 2"))
    });
    drop(eps);
    // The engine still serves a decode that holds the secret.
    let peer = p.endpoint.clone();
    let mut d = start("decode", "decode", keyed(&file, json!({})), Some(&peer));
    rooms_match(&mut p, &mut d, &ids, &[60], 6, &want);
    d.quit();
    p.quit();
}

#[test]
fn on_an_authenticated_link_a_message_changed_on_the_way_takes_the_link_down() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let file = key_file("k", &[NEW]);
    // The decode's UCX thread flips a byte of the first message of room 1 it receives (the
    // STATE frame) before it is checked.
    let env = [
        ("UCX_TLS", "tcp"),
        ("DSV4_UCX_FAULTS", "flip_message_room=1"),
    ];
    let mut p = start("prefill", "prefill", keyed(&file, json!({})), None);
    let peer = p.endpoint.clone();
    let mut d = Node::start_in(
        None,
        &env,
        "decode",
        "decode",
        keyed(&file, json!({})),
        Some(&peer),
    );
    p.submit(1, 6, &ids[..150]);
    d.submit(1, 6, &ids[..150]);
    d.wait_ends(&[1], Duration::from_secs(20));
    p.wait_ends(&[1], Duration::from_secs(20));
    let end = d.end_of(1).unwrap().clone();
    assert!(end.starts_with("error 1 KvTransfer"), "{end}");
    assert!(
        end.contains("does not verify under the connection's key"),
        "{end}"
    );
    assert!(p.end_of(1).unwrap().starts_with("error 1 "));
    assert!(d.tokens(1).is_empty());
    assert_eq!(d.usage(), (0, 0));
    d.quit();
    p.quit();
}
