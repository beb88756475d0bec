//! An idle PD engine's listener sleeps until a peer connects or the engine is destroyed. It
//! used to wake every 10 ms to look at the shutdown flag: 100 wake-ups a second per idle
//! engine, and up to 10 ms before a decode's first connection was taken. One test in its own
//! process, so no other engine's listener is counted.

mod common;

use std::time::{Duration, Instant};

use common::requests::*;
use serde_json::json;

/// Voluntary context switches of each live thread named `name` (proc(5): a blocked thread's
/// every wake-up is one).
fn switches(name: &str) -> Vec<(String, u64)> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let comm = std::fs::read_to_string(dir.join("comm")).ok()?;
            if comm.trim() != name {
                return None;
            }
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let n = status
                .lines()
                .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))?
                .trim()
                .parse()
                .ok()?;
            Some((dir.file_name()?.to_string_lossy().into_owned(), n))
        })
        .collect()
}

#[test]
fn an_idle_listener_sleeps_takes_a_connection_at_once_and_ends_with_its_engine() {
    let prefill = engine_with(json!({"role": "prefill", "pd": {"listen": "tcp://127.0.0.1:0"}}));
    let decode = engine_with(json!({"role": "decode", "pd": {"listen": "tcp://127.0.0.1:0"}}));
    // A thread names itself once it runs: on a busy machine the second listener may not have
    // yet when its engine is returned (a clean-clone CI run saw one of two).
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut listeners = switches("dsv4-pd-listen");
    while listeners.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        listeners = switches("dsv4-pd-listen");
    }
    assert_eq!(listeners.len(), 2, "one listener per engine: {listeners:?}");
    std::thread::sleep(Duration::from_millis(500));
    let after = switches("dsv4-pd-listen");
    for ((tid, before), (_, now)) in listeners.iter().zip(&after) {
        // Polling every 10 ms made ~50 here.
        assert!(
            now - before <= 2,
            "listener {tid} woke {} times in 500 ms while idle",
            now - before
        );
    }
    // A room through the pair: the prefill's listener takes the decode's connection.
    let prompt = common::ids("flash-like")[..200].to_vec();
    let spec = |peer: Option<String>| {
        let mut s = greedy(&prompt, 2);
        s.pd_room = 7;
        s.pd_peer = peer;
        s
    };
    let p = prefill.submit(spec(None)).unwrap();
    let start = Instant::now();
    let d = decode
        .submit(spec(Some(prefill.pd_endpoint().unwrap())))
        .unwrap();
    let got = tokens_of(&collect(&decode, &[d])[&d]);
    collect(&prefill, &[p]);
    assert_eq!(got.len(), 2, "the room decoded");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the room took {:?}",
        start.elapsed()
    );
    // Destroying wakes the listener: it returns promptly, with the listener gone.
    let start = Instant::now();
    drop(prefill);
    drop(decode);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "destroy took {:?}",
        start.elapsed()
    );
    assert!(
        switches("dsv4-pd-listen").is_empty(),
        "a listener outlived its engine"
    );
}
