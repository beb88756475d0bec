//! PD links over TLS (`pd.tls`), against engine processes (examples/pd_node.rs) and relays
//! written here: rooms through a relay that records every byte are exact, and the recording
//! holds nothing of the protocol in the clear; a decode without TLS, one trusting another CA,
//! and a TLS decode against a prefill without it are each told the fix; and a relay that holds
//! the prefill's certificate and terminates TLS towards both engines relays rooms between
//! engines without a key but cannot pass the challenge-response along between engines with
//! one (its proofs cover the TLS session: tests/fixtures/tls has the certificates).
//!
//! After changing the example, run `cargo build --example pd_node` first (a plain `cargo
//! test` does).

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::key_file;
use common::pd_node::{rooms_match, unified_tokens, Node, ONE_AT_A_TIME};
use common::requests::merge;
use dsv4::pd::tls::{Session, Tls};
use serde_json::{json, Value};

const KEY: &str = "3f1c0d5e9a7b2468ace013579bdf2468ace013579bdf2468ace013579bdf0000";

use common::tls_fixture as fixture;

fn tcp(extra: Value) -> Value {
    common::pd_node::over("tcp", extra)
}

fn prefill_tls(extra: Value) -> Value {
    let mut doc = tcp(extra);
    merge(
        &mut doc,
        json!({"pd": {"tls": true, "tls_cert_file": fixture("prefill.pem"),
                      "tls_key_file": fixture("prefill.key")}}),
    );
    doc
}

fn decode_tls(ca: &str, extra: Value) -> Value {
    let mut doc = tcp(extra);
    merge(
        &mut doc,
        json!({"pd": {"tls": true, "tls_ca_file": fixture(ca)}}),
    );
    doc
}

fn addr_of(endpoint: &str) -> SocketAddr {
    endpoint.trim_start_matches("tcp://").parse().unwrap()
}

/// A TCP relay to `target` on a free loopback port that keeps every byte it passes.
struct Recorder {
    addr: SocketAddr,
    bytes: Arc<Mutex<Vec<u8>>>,
}

impl Recorder {
    fn start(target: SocketAddr) -> Recorder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let kept = bytes.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let server = TcpStream::connect(target).unwrap();
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let kept = kept.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 << 10];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            kept.lock().unwrap().extend_from_slice(&buf[..n]);
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Recorder { addr, bytes }
    }

    fn contains(&self, needle: &[u8]) -> bool {
        self.bytes
            .lock()
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
    }
}

#[test]
fn over_tls_rooms_are_exact_and_the_wire_shows_nothing_of_the_protocol() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let lens = [40usize, 300];
    let want = unified_tokens(common::pd_node::base(), &ids, &lens, 6);
    let keyed = json!({"pd": {"auth_key_file": key_file("k", &[KEY])}});
    let mut p = Node::start("prefill", "prefill", prefill_tls(keyed.clone()), None);
    let recorder = Recorder::start(addr_of(&p.endpoint));
    // The decode reaches the prefill through the recorder, at the name its certificate has.
    let peer = format!("tcp://{}", recorder.addr);
    let mut d = Node::start("decode", "decode", decode_tls("ca.pem", keyed), Some(&peer));
    rooms_match(&mut p, &mut d, &ids, &lens, 6, &want);
    let recorded = recorder.bytes.lock().unwrap().len();
    assert!(
        recorded > 100_000,
        "the states went through: {recorded} bytes"
    );
    // TLS records (22: the handshake), and nothing a frame would show in the clear: the
    // HELLO's protocol name, the AUTH's field, the claim's.
    assert_eq!(
        recorder.bytes.lock().unwrap()[0],
        22,
        "a TLS handshake record"
    );
    for clear in [
        &b"dsv4-pd"[..],
        b"nonce",
        b"request_hash",
        b"heartbeat_interval_ms",
    ] {
        assert!(
            !recorder.contains(clear),
            "{} in the clear",
            String::from_utf8_lossy(clear)
        );
    }
    d.quit();
    p.quit();
}

#[test]
fn engines_that_disagree_on_tls_are_each_told_the_fix() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let p = Node::start("prefill", "prefill", prefill_tls(json!({})), None);
    let endpoint = p.endpoint.clone();
    let cases = [
        (decode_tls("other-ca.pem", json!({})), "pd.tls_ca_file"),
        (
            tcp(json!({})),
            "set pd.tls and pd.tls_ca_file on the decode too",
        ),
    ];
    for (room, (params, says)) in (1u64..).zip(cases) {
        let mut d = Node::start("decode", "decode", params, Some(&endpoint));
        d.submit(room, 6, &ids[..60]);
        d.wait_ends(&[room], Duration::from_secs(20));
        let end = d.end_of(room).unwrap().clone();
        assert!(
            end.starts_with(&format!("error {room} KvTransfer")),
            "{end}"
        );
        assert!(end.contains(says), "{says}: {end}");
        d.quit();
    }
    p.quit();
    // A TLS decode against a prefill without TLS.
    let p = Node::start("prefill", "prefill", tcp(json!({})), None);
    let endpoint = p.endpoint.clone();
    let mut d = Node::start(
        "decode",
        "decode",
        decode_tls("ca.pem", json!({})),
        Some(&endpoint),
    );
    d.submit(9, 6, &ids[..60]);
    d.wait_ends(&[9], Duration::from_secs(20));
    let end = d.end_of(9).unwrap().clone();
    assert!(end.contains("give both engines pd.tls"), "{end}");
    d.quit();
    p.quit();
}

/// A relay that holds the prefill's certificate and key and terminates TLS towards each
/// engine: a session with the decode, another with the prefill, plaintext in between.
fn terminating_relay(target: SocketAddr, stop: Arc<AtomicBool>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let as_prefill = Tls::server(&fixture("prefill.pem"), &fixture("prefill.key")).unwrap();
    let as_decode = Tls::client(&fixture("ca.pem")).unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let Ok((client, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            client.set_nonblocking(false).unwrap();
            let poll = Some(Duration::from_millis(20));
            client.set_read_timeout(poll).unwrap();
            let server = TcpStream::connect(target).unwrap();
            server.set_read_timeout(poll).unwrap();
            let deadline = Instant::now() + Duration::from_secs(5);
            let Ok(outer) = as_prefill.accept(client, deadline, &|| false) else {
                continue;
            };
            let inner = as_decode
                .connect(server, "127.0.0.1", deadline, &|| false)
                .unwrap();
            for (from, to) in [(outer.clone(), inner.clone()), (inner, outer)] {
                let stop = stop.clone();
                std::thread::spawn(move || pump(&from, &to, &stop));
            }
        }
    });
    addr
}

/// Plaintext from one session into the other until either ends.
fn pump(from: &Session, to: &Session, stop: &AtomicBool) {
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(Ordering::SeqCst) {
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.send(&[&buf[..n]]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.socket().shutdown(std::net::Shutdown::Both);
    let _ = from.socket().shutdown(std::net::Shutdown::Both);
}

#[test]
fn a_relay_with_the_prefills_certificate_cannot_pass_the_challenge_response_along() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(common::pd_node::base(), &ids, &[60], 6);
    let stop = Arc::new(AtomicBool::new(false));
    // Without a key the relay reads and passes everything: the rooms land (the relay works).
    let mut p = Node::start("prefill", "prefill", prefill_tls(json!({})), None);
    let relay = terminating_relay(addr_of(&p.endpoint), stop.clone());
    let peer = format!("tcp://{relay}");
    let mut d = Node::start(
        "decode",
        "decode",
        decode_tls("ca.pem", json!({})),
        Some(&peer),
    );
    rooms_match(&mut p, &mut d, &ids, &[60], 6, &want);
    d.quit();
    p.quit();
    // With a key on both engines the same relay gets nowhere: each side's proof covers its
    // own TLS session, which the other side's is not.
    let keyed = json!({"pd": {"auth_key_file": key_file("k", &[KEY])}});
    let logged = [("PD_NODE_LOG", "warn")];
    let mut p = Node::start_in(
        None,
        &logged,
        "prefill",
        "prefill",
        prefill_tls(keyed.clone()),
        None,
    );
    let relay = terminating_relay(addr_of(&p.endpoint), stop.clone());
    let peer = format!("tcp://{relay}");
    let mut d = Node::start("decode", "decode", decode_tls("ca.pem", keyed), Some(&peer));
    d.submit(1, 6, &ids[..60]);
    d.wait_ends(&[1], Duration::from_secs(20));
    let end = d.end_of(1).unwrap().clone();
    assert!(end.starts_with("error 1 KvTransfer"), "{end}");
    assert!(end.contains("the connection was refused"), "{end}");
    p.wait_until(Duration::from_secs(5), "the refusal logged", |seen| {
        seen.iter().any(|l| l.contains("it did not authenticate"))
    });
    stop.store(true, Ordering::SeqCst);
    d.quit();
    p.quit();
}
