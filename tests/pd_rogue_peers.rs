//! Rogue PD peers written here from the frame format alone (16-byte header: kind, three zero
//! bytes, payload length u32 LE, room u64 LE; JSON control payloads), against engine processes
//! (examples/pd_node.rs) whose threads, descriptors and memory are read from /proc: floods of
//! connections, links that never read, frame headers that promise megabytes, claims and FAILs
//! for rooms other links hold, a prefill that lies about its counts. Each costs the engine a
//! bounded amount, ends within its bound, and leaves other rooms exact (docs/security.md).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::key_file;
use common::pd_node::{unified_tokens, with, Node, ONE_AT_A_TIME};
use serde_json::{json, Value};

const HELLO: u8 = 1;
const REFUSE: u8 = 2;
const CLAIM: u8 = 3;
const STATE: u8 = 4;
const ACK: u8 = 7;
const FAIL: u8 = 8;

fn frame(kind: u8, room: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![kind, 0, 0, 0];
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&room.to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// One frame off `s`: (kind, room, payload).
fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, u64, Vec<u8>)> {
    let mut h = [0u8; 16];
    s.read_exact(&mut h)?;
    let len = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
    let room = u64::from_le_bytes(h[8..16].try_into().unwrap());
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((h[0], room, payload))
}

fn proc_count(pid: &str, dir: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/{dir}")).map_or(0, |d| d.count())
}

fn rss_mib(pid: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

fn tcp_params(extra: Value) -> Value {
    let mut doc = with(json!({"pd": {"listen": "tcp://127.0.0.1:0"}}));
    common::requests::merge(&mut doc, extra);
    doc
}

fn addr_of(endpoint: &str) -> String {
    endpoint.trim_start_matches("tcp://").to_string()
}

/// A decode engine's HELLO as it sends it (the layout is the fixture model's): a decode process
/// is pointed at a listener here and its first frame kept. Returns the HELLO's JSON.
fn a_decode_hello() -> Value {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = format!("tcp://{}", listener.local_addr().unwrap());
    let mut d = Node::start("decode", "decode", tcp_params(json!({})), Some(&peer));
    d.submit(1, 2, &common::ids("flash-like")[..20]);
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (kind, _, payload) = read_frame(&mut s).unwrap();
    assert_eq!(kind, HELLO);
    drop(s);
    d.kill();
    serde_json::from_slice(&payload).unwrap()
}

/// A link to `addr` opened with `hello` (its HELLO answered with the prefill's).
fn link(addr: &str, hello: &Value) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame(HELLO, 0, &serde_json::to_vec(hello).unwrap()))
        .unwrap();
    let (kind, _, payload) = read_frame(&mut s).unwrap();
    assert_eq!(kind, HELLO, "{}", String::from_utf8_lossy(&payload));
    s
}

/// Whether the engine closed `s` within `within` (its reads end or fail).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    while Instant::now() < deadline {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return true,
        }
    }
    false
}

#[test]
fn floods_of_connections_and_links_hold_bounded_threads_and_descriptors() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let hello = a_decode_hello();
    let params = tcp_params(json!({"pd": {"max_handshakes": 8, "max_links": 4,
        "handshake_timeout_ms": 1000}}));
    let p = Node::start("prefill", "prefill", params, None);
    let (pid, addr) = (p.pid(), addr_of(&p.endpoint));
    std::thread::sleep(Duration::from_millis(300));
    let (threads0, fds0) = (proc_count(&pid, "task"), proc_count(&pid, "fd"));

    // 300 connections that never say HELLO: at most pd.max_handshakes wait, each a thread.
    let mut silent: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(400));
    let (threads, fds) = (proc_count(&pid, "task"), proc_count(&pid, "fd"));
    assert!(threads <= threads0 + 8, "{threads0} -> {threads} threads");
    assert!(fds <= fds0 + 8, "{fds0} -> {fds} descriptors");
    // All are closed within pd.handshake_timeout_ms (1 s) of their accept.
    let start = Instant::now();
    for s in &mut silent {
        assert!(closed_within(s, Duration::from_secs(5)), "still open");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    drop(silent);

    // 50 peers that complete the handshake: pd.max_links (4) get a link (two threads each), the
    // others a refusal naming the limit.
    let mut links = Vec::new();
    let mut refused = 0;
    for _ in 0..50 {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&frame(HELLO, 0, &serde_json::to_vec(&hello).unwrap()))
            .unwrap();
        let (kind, _, payload) = read_frame(&mut s).unwrap();
        match kind {
            HELLO => links.push(s),
            REFUSE => {
                let text = String::from_utf8_lossy(&payload).to_string();
                assert!(text.contains("pd.max_links = 4"), "{text}");
                refused += 1;
            }
            k => panic!("frame kind {k}"),
        }
    }
    assert_eq!((links.len(), refused), (4, 46));
    std::thread::sleep(Duration::from_millis(200));
    let (threads, fds) = (proc_count(&pid, "task"), proc_count(&pid, "fd"));
    // A link: a reader and a writer thread, its socket open three times (reader, writer, the
    // link's own handle).
    assert!(
        threads <= threads0 + 2 * 4 + 2,
        "{threads0} -> {threads} threads"
    );
    assert!(fds <= fds0 + 3 * 4 + 2, "{fds0} -> {fds} descriptors");
    drop(links);
    p.quit();
}

#[test]
fn a_peer_that_reads_nothing_is_dropped_and_shutdown_does_not_wait_for_it() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut hello = a_decode_hello();
    // It claims it beats once in 31 years: believed as once a minute.
    hello["heartbeat_interval_ms"] = json!(1_000_000_000_000u64);
    let params = tcp_params(json!({"pd": {"max_outbox_bytes": 1 << 20}}));
    let p = Node::start("prefill", "prefill", params, None);
    let (pid, addr) = (p.pid(), addr_of(&p.endpoint));
    std::thread::sleep(Duration::from_millis(300));
    let rss0 = rss_mib(&pid);

    // Unparsable claims, each answered with a FAIL it never reads: its outbox fills to
    // pd.max_outbox_bytes and it is dropped.
    let mut s = link(&addr, &hello);
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let burst: Vec<u8> = (0..4096u64).flat_map(|r| frame(CLAIM, r, b"{}")).collect();
    let start = Instant::now();
    let mut sent = 0usize;
    let dropped = loop {
        if start.elapsed() > Duration::from_secs(20) {
            break false;
        }
        match s.write_all(&burst) {
            Ok(()) => sent += burst.len(),
            Err(_) => break true,
        }
    };
    let rss = rss_mib(&pid);
    assert!(dropped, "still connected after {sent} bytes of claims");
    assert!(rss < rss0 + 48.0, "RSS {rss0:.0} -> {rss:.0} MiB");
    drop(s);

    // Another that stops reading with the prefill's socket full: the engine's shutdown waits
    // for it at most its grace (2 s), not the 31 years × misses its HELLO asked for.
    let p2 = Node::start("prefill", "prefill", tcp_params(json!({})), None);
    let mut s = link(&addr_of(&p2.endpoint), &hello);
    s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let some: Vec<u8> = (0..100_000u64)
        .flat_map(|r| frame(CLAIM, r, b"{}"))
        .collect();
    let _ = s.write_all(&some);
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    p2.quit();
    let took = start.elapsed();
    eprintln!("shutdown with a peer that reads nothing: {took:?}");
    assert!(took < Duration::from_secs(6), "shutdown took {took:?}");
    drop(s);
    p.quit();
}

#[test]
fn frame_headers_that_promise_megabytes_cost_nothing_until_the_bytes_come() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let hello = a_decode_hello();
    let p = Node::start(
        "prefill",
        "prefill",
        tcp_params(json!({"pd": {"max_links": 32}})),
        None,
    );
    let (pid, addr) = (p.pid(), addr_of(&p.endpoint));
    std::thread::sleep(Duration::from_millis(300));
    let rss0 = rss_mib(&pid);
    // 20 links, each with a CLAIM header announcing 16 MiB and 10 bytes of it.
    let mut links = Vec::new();
    for room in 0..20u64 {
        let mut s = link(&addr, &hello);
        let mut head = frame(CLAIM, room, &[]);
        head[4..8].copy_from_slice(&(16u32 << 20).to_le_bytes());
        s.write_all(&head).unwrap();
        s.write_all(b"{\"request_").unwrap();
        links.push(s);
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss = rss_mib(&pid);
    // Before: each header allocated and zeroed its 16 MiB (+320 MiB here).
    assert!(rss < rss0 + 40.0, "RSS {rss0:.0} -> {rss:.0} MiB");
    drop(links);
    p.quit();
}

#[test]
fn claims_acks_and_fails_for_rooms_other_links_hold_change_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let want = unified_tokens(with(json!({})), &ids, &[60], 6);
    let hello = a_decode_hello();
    let mut p = Node::start("prefill", "prefill", tcp_params(json!({})), None);
    let endpoint = p.endpoint.clone();
    let mut d = Node::start("decode", "decode", tcp_params(json!({})), Some(&endpoint));
    let mut rogue = link(&addr_of(&endpoint), &hello);
    let fail = serde_json::to_vec(&json!({"reason": "aborted", "message": "rogue"})).unwrap();

    // Room 1: registered on the prefill, claimed by nobody yet. A FAIL or ACK for it from a
    // link that does not hold it is dropped.
    p.submit(1, 6, &ids[..60]);
    rogue.write_all(&frame(FAIL, 1, &fail)).unwrap();
    rogue.write_all(&frame(ACK, 1, &[])).unwrap();
    // Room 2: the decode claims it first (before its prefill request exists); a second claim
    // from another link is refused, and its FAIL changes nothing.
    d.submit(2, 6, &ids[..60]);
    p.wait_metrics(Duration::from_secs(10), "the early claim", |m| {
        m["early_claims"] == 1
    });
    let claim = json!({"request_hash": 1, "prompt_tokens": 60, "slot": 0, "pages": [0]});
    rogue
        .write_all(&frame(CLAIM, 2, &serde_json::to_vec(&claim).unwrap()))
        .unwrap();
    let (kind, room, payload) = read_frame(&mut rogue).unwrap();
    let text = String::from_utf8_lossy(&payload).to_string();
    assert_eq!((kind, room), (FAIL, 2), "{text}");
    assert!(text.contains("claimed by another decode engine"), "{text}");
    rogue.write_all(&frame(FAIL, 2, &fail)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    p.submit(2, 6, &ids[..60]);
    d.submit(1, 6, &ids[..60]);
    d.wait_ends(&[1, 2], Duration::from_secs(60));
    p.wait_ends(&[1, 2], Duration::from_secs(10));
    for room in [1, 2] {
        assert_eq!(
            p.end_of(room).unwrap(),
            &format!("finished {room} Transferred")
        );
        assert_eq!(d.end_of(room).unwrap(), &format!("finished {room} Length"));
        assert_eq!(d.tokens(room), want[&60], "room {room}");
    }
    drop(rogue);
    d.quit();
    p.quit();
}

#[test]
fn a_decode_checks_the_counts_a_prefill_sends() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    // A prefill that answers with the decode's own layout and lies in its STATE frame.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = format!("tcp://{}", listener.local_addr().unwrap());
    let mut d = Node::start("decode", "decode", tcp_params(json!({})), Some(&peer));
    d.submit(7, 4, &ids[..41]);
    let (mut s, _) = listener.accept().unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (kind, _, payload) = read_frame(&mut s).unwrap();
    assert_eq!(kind, HELLO);
    let mut hello: Value = serde_json::from_slice(&payload).unwrap();
    hello["side"] = json!("prefill");
    hello["endpoint"] = json!(peer);
    s.write_all(&frame(HELLO, 0, &serde_json::to_vec(&hello).unwrap()))
        .unwrap();
    let (kind, room, payload) = read_frame(&mut s).unwrap();
    assert_eq!((kind, room), (CLAIM, 7));
    let claim: Value = serde_json::from_slice(&payload).unwrap();
    let header = json!({
        "state": {"position": 41, "last_token": 5, "rng": null,
                  "pages": claim["pages"].as_array().unwrap().len(), "bytes": 4096},
        "first_logprob": 0.0,
        "cached_tokens_device": u32::MAX,
        "cached_tokens_host": 0,
    });
    s.write_all(&frame(STATE, 7, &serde_json::to_vec(&header).unwrap()))
        .unwrap();
    d.wait_ends(&[7], Duration::from_secs(10));
    let end = d.end_of(7).unwrap().clone();
    assert!(end.starts_with("error 7 KvTransfer"), "{end}");
    assert!(
        end.contains("= 4294967295 exceeds the state's 41 tokens"),
        "{end}"
    );
    assert_eq!(d.usage(), (0, 0));
    drop(s);
    d.quit();
}

#[test]
fn with_a_key_peers_authenticate_and_strangers_learn_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const OLD: &str = "3f1c0d5e9a7b2468ace013579bdf2468ace013579bdf2468ace013579bdf0000";
    const NEW: &str = "77aa11bb22cc33dd44ee55ff6677889900aabbccddeeff001122334455667788";
    let ids = common::ids("flash-like");
    let want = unified_tokens(with(json!({})), &ids, &[60], 6);
    let hello = a_decode_hello();
    let keyed = |f: &str| tcp_params(json!({"pd": {"auth_key_file": f}}));
    // Rotating: the prefill signs with the old secret, the decode already with the new one.
    let mut p = Node::start(
        "prefill",
        "prefill",
        keyed(&key_file("p", &[OLD, NEW])),
        None,
    );
    let endpoint = p.endpoint.clone();
    let mut d = Node::start(
        "decode",
        "decode",
        keyed(&key_file("d", &[NEW, OLD])),
        Some(&endpoint),
    );
    assert_eq!(p.metrics().get("peers"), Some(&0));

    // Strangers: a HELLO (with a layout that matches), an AUTH with a proof under another
    // secret, garbage. Each gets the same refusal, no field of ours, and is closed.
    let addr = addr_of(&endpoint);
    let refused = |s: &mut TcpStream| {
        let (kind, _, payload) = read_frame(s).unwrap();
        assert_eq!(kind, REFUSE);
        let r: Value = serde_json::from_slice(&payload).unwrap();
        assert_eq!(r["message"], "the connection was refused", "{r}");
        assert!(closed_within(s, Duration::from_secs(2)));
    };
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame(HELLO, 0, &serde_json::to_vec(&hello).unwrap()))
        .unwrap();
    refused(&mut s);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let nonce = json!({"nonce": "ab".repeat(32)});
    s.write_all(&frame(11, 0, &serde_json::to_vec(&nonce).unwrap()))
        .unwrap();
    let (kind, _, _) = read_frame(&mut s).unwrap();
    assert_eq!(kind, 11, "the prefill's own nonce");
    let proof = json!({"proof": "cd".repeat(32)});
    s.write_all(&frame(12, 0, &serde_json::to_vec(&proof).unwrap()))
        .unwrap();
    refused(&mut s);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&frame(CLAIM, 1, b"{}")).unwrap();
    refused(&mut s);

    // The engines' own rooms are exact, several at once on the link.
    let rooms: Vec<u64> = (1..=8).collect();
    for &room in &rooms {
        p.submit(room, 6, &ids[..60]);
    }
    for &room in &rooms {
        d.submit(room, 6, &ids[..60]);
    }
    d.wait_ends(&rooms, Duration::from_secs(60));
    p.wait_ends(&rooms, Duration::from_secs(10));
    for &room in &rooms {
        assert_eq!(
            p.end_of(room).unwrap(),
            &format!("finished {room} Transferred")
        );
        assert_eq!(d.end_of(room).unwrap(), &format!("finished {room} Length"));
        assert_eq!(d.tokens(room), want[&60]);
    }

    // A decode with another secret, and one with none: each told how to fix it.
    let other = "0000111122223333444455556666777788889999aaaabbbbccccddddeeeeffff";
    let mut wrong = Node::start(
        "decode",
        "decode",
        keyed(&key_file("w", &[other])),
        Some(&endpoint),
    );
    let mut none = Node::start("decode", "decode", tcp_params(json!({})), Some(&endpoint));
    for n in [&mut wrong, &mut none] {
        n.submit(20, 6, &ids[..60]);
        n.wait_ends(&[20], Duration::from_secs(20));
        let end = n.end_of(20).unwrap().clone();
        assert!(end.starts_with("error 20 KvTransfer"), "{end}");
        assert!(end.contains("the connection was refused"), "{end}");
        assert!(end.contains("pd.auth_key_file"), "{end}");
        assert!(!end.contains(OLD) && !end.contains(NEW), "{end}");
    }
    wrong.quit();
    none.quit();
    d.quit();
    p.quit();
}

#[test]
fn on_an_authenticated_link_a_frame_changed_on_the_way_takes_the_link_down() {
    use common::fault_proxy::{At, Dir, Fault, FaultProxy, Plan, Rule, DATA, DONE};
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    const KEY: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
    let ids = common::ids("flash-like");
    let keyed = || tcp_params(json!({"pd": {"auth_key_file": key_file("k", &[KEY])}}));
    // A flipped bit in a DATA frame's bytes, a dropped DONE: over TCP without a key the first
    // is the CRC's to catch and the second the deadline's; here the next MAC check fails.
    let faults = [
        (
            DATA,
            Fault::Corrupt {
                at: At::Payload(100),
                mask: 0x01,
            },
        ),
        (DONE, Fault::Drop),
    ];
    for (room, (kind, fault)) in (1u64..).zip(faults) {
        let mut p = Node::start("prefill", "prefill", keyed(), None);
        let rule = Rule {
            dir: Dir::ToDecode,
            kind: Some(kind),
            room: None,
            nth: 1,
            fault,
        };
        let proxy = FaultProxy::start_sealed(
            &p.endpoint,
            Plan {
                rules: vec![rule],
                chances: vec![],
            },
            0,
        );
        let mut d = Node::start("decode", "decode", keyed(), Some(proxy.addr()));
        p.submit(room, 6, &ids[..300]);
        d.submit(room, 6, &ids[..300]);
        d.wait_ends(&[room], Duration::from_secs(20));
        p.wait_ends(&[room], Duration::from_secs(20));
        assert_eq!(proxy.log().len(), 1, "{}", proxy.report());
        let end = d.end_of(room).unwrap().clone();
        assert!(
            end.starts_with(&format!("error {room} KvTransfer")),
            "{end}"
        );
        assert!(
            end.contains("does not verify under the link's key"),
            "{end}"
        );
        assert!(p
            .end_of(room)
            .unwrap()
            .starts_with(&format!("error {room} ")));
        assert_eq!(d.usage(), (0, 0));
        d.quit();
        p.quit();
    }
}

#[test]
fn a_decode_points_only_at_the_prefills_it_allows() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ids = common::ids("flash-like");
    let mut p = Node::start("prefill", "prefill", tcp_params(json!({})), None);
    let endpoint = p.endpoint.clone();
    let port = endpoint.rsplit(':').next().unwrap().to_string();
    let only = |allowed: Value| tcp_params(json!({"pd": {"allowed_peers": allowed}}));
    // Another host: a request naming this prefill is refused at submit, naming the list.
    let mut d = Node::start(
        "decode",
        "decode",
        only(json!(["10.9.9.9"])),
        Some(&endpoint),
    );
    let tokens: Vec<String> = ids[..20].iter().map(u32::to_string).collect();
    d.send(&format!("submit 1 2 {}", tokens.join(",")));
    let line = d.wait_line(Duration::from_secs(10), |l| l.starts_with("refused 1 "));
    assert!(line.contains("InvalidArgument"), "{line}");
    assert!(
        line.contains("is not in pd.allowed_peers (10.9.9.9)"),
        "{line}"
    );
    d.quit();
    // The prefill's host and port: allowed, and the room lands.
    let mut d = Node::start(
        "decode",
        "decode",
        only(json!(["10.9.9.9", format!("127.0.0.1:{port}")])),
        Some(&endpoint),
    );
    p.submit(2, 2, &ids[..20]);
    d.submit(2, 2, &ids[..20]);
    d.wait_ends(&[2], Duration::from_secs(30));
    assert_eq!(d.end_of(2).unwrap(), "finished 2 Length");
    d.quit();
    p.quit();
}
