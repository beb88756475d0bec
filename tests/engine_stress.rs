//! Stress: 8 threads submit, poll and abort for several seconds, once on roomy pools and once
//! with HiCache on pools small enough for load-backs, evictions and retractions (threads also
//! flush the device tier). Every accepted id gets exactly one terminal event; afterwards the
//! metrics match the client's books and the admission counters are back to zero, with the cache
//! flushed no page, slot or snapshot is in use, and destroying the engine leaves no thread
//! behind. (Alone in its binary: it counts threads.)

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::books::{drain, random_spec, threads_now, Books};
use dsv4::config::params::Params;
use dsv4::engine::{Engine, EventKind, MetricsSnapshot, Rejection, ShutdownMode};
use dsv4::error::ErrorKind;
use serde_json::json;

#[test]
fn eight_threads_submit_poll_and_abort() {
    let before = threads_now();
    let base = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "8MiB", "max_running_requests": 6, "page_size": 128},
        "admission": {"max_queued_requests": 12, "max_queued_tokens": 3000, "queue_timeout_ms": 1500},
        "scheduler": {"chunked_prefill_tokens": 96, "max_batch_tokens": 160}
    });
    stress(base.clone(), false);
    let mut tight = base;
    tight["kv"]["device_memory_bytes"] = json!(1500 * 1024);
    tight["kv"]["snapshot_fraction"] = json!(0.4);
    tight["hicache"] = json!({"enabled": true, "ratio": 4.0});
    let m = stress(tight, true);
    assert!(m.cache.loadbacks > 0, "no load-back: {:?}", m.cache);
    let deadline = Instant::now() + Duration::from_secs(5);
    while threads_now() > before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(threads_now(), before, "threads left behind");
}

/// `tight`: prompts share a few starting points (so prefixes hit) and threads flush the device
/// tier now and then (so hits come from the host).
fn stress(doc: serde_json::Value, tight: bool) -> MetricsSnapshot {
    let engine = Arc::new(Engine::create(Params::from_value(&doc).unwrap()).unwrap());
    let ids = Arc::new(common::ids("flash-like"));
    let books = Arc::new(Mutex::new(Books::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let run_for = Duration::from_secs(4);
    let workers: Vec<_> = (0..8u64)
        .map(|w| {
            let (engine, ids, books, stop) =
                (engine.clone(), ids.clone(), books.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(w + 1);
                let mut mine: Vec<u64> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match rng.u32(0..10) {
                        0..=3 => {
                            let result = engine.submit(random_spec(&mut rng, &ids, tight));
                            if let Err(e) = &result {
                                assert!(
                                    matches!(e.kind(), ErrorKind::QueueFull),
                                    "unexpected refusal: {e}"
                                );
                            }
                            mine.extend(books.lock().unwrap().submitted(&result));
                        }
                        9 if tight && rng.u32(0..8) == 0 => {
                            engine.flush_cache(dsv4::kv::cache::Tier::Device).unwrap();
                        }
                        4..=5 if !mine.is_empty() => {
                            let id = mine[rng.usize(0..mine.len())];
                            match engine.abort(id) {
                                Ok(()) => {}
                                Err(e) => assert_eq!(e.kind(), ErrorKind::NotFound, "{e}"),
                            }
                        }
                        _ => {
                            let events = engine.poll(32, Some(Duration::from_millis(20))).unwrap();
                            let mut b = books.lock().unwrap();
                            for e in &events {
                                assert!(e.is_terminal() || e.kind() == EventKind::Token);
                                b.event(e);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(run_for);
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    // Let every accepted request end (they are short), collecting their events.
    assert!(
        drain(&engine, &books, Duration::from_secs(120)),
        "{} requests never ended",
        books.lock().unwrap().pending()
    );
    // Nothing is left in use once the cache lets go of its prefixes.
    let usage = engine.flush_cache(dsv4::kv::cache::Tier::All).unwrap();
    assert_eq!(
        (usage.pages, usage.slots, usage.snapshots),
        (0, 0, 0),
        "{usage:?}"
    );
    engine
        .shutdown(ShutdownMode::Drain, Some(Duration::from_secs(30)))
        .unwrap();
    assert!(
        engine.poll(16, Some(Duration::ZERO)).unwrap().is_empty(),
        "events after the end"
    );
    let b = books.lock().unwrap();
    assert!(
        b.accepted.len() > 50,
        "only {} requests accepted",
        b.accepted.len()
    );
    eprintln!(
        "{} accepted, {} refused (queue full), {} tokens streamed",
        b.accepted.len(),
        b.refused[Rejection::QueueFull as usize],
        b.tokens_total()
    );
    // One terminal event per accepted id, the engine's books agree with the client's and the
    // admission counters are back to 0.
    let m = engine.metrics();
    let problems = b.problems(&m);
    assert!(
        problems.is_empty(),
        "the books do not balance: {problems:#?}"
    );
    eprintln!(
        "retractions {}, load-backs {}",
        m.retractions, m.cache.loadbacks
    );
    drop(b);
    assert_eq!(
        engine
            .flush_cache(dsv4::kv::cache::Tier::All)
            .unwrap_err()
            .kind(),
        ErrorKind::Shutdown
    );
    m
}
