//! Regression tests for the defects the adversarial sweep found in the engine (issue
//! "Hardening"): each fails on the code before the fix.

mod common;

use common::requests::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use dsv4::engine::{Event, EventCallback, EventKind, FinishReason, RequestSpec, ShutdownMode};
use dsv4::error::ErrorKind;
use dsv4::kv::cache::Tier;
use serde_json::json;

/// Runs `f` on a thread and fails the test if it has not returned within `limit` (the
/// deadlocks these tests guard against would otherwise hang the suite).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not return within {limit:?}"))
}

/// Defect 1: `submit` checked that the engine accepted and then sent; the engine thread could
/// finish its last receive in between, leaving an accepted request without a terminal event
/// (15 orphans in 300 shutdowns before the fix). 120 shutdowns under 4 submitting threads.
#[test]
fn every_request_accepted_while_another_thread_shuts_down_gets_one_terminal_event() {
    let prompt: Vec<u32> = common::ids("flash-like")[..8].to_vec();
    let mut accepted_total = 0;
    for round in 0..120 {
        let engine = Arc::new(engine_with(
            json!({"admission": {"max_queued_requests": 100000}}),
        ));
        let go = Arc::new(Barrier::new(5));
        let submitters: Vec<_> = (0..4)
            .map(|_| {
                let (engine, go, prompt) = (engine.clone(), go.clone(), prompt.clone());
                std::thread::spawn(move || {
                    go.wait();
                    let mut ids = Vec::new();
                    loop {
                        match engine.submit(greedy(&prompt, 1)) {
                            Ok(id) => ids.push(id),
                            Err(e) if e.kind() == ErrorKind::QueueFull => std::thread::yield_now(),
                            Err(e) => {
                                assert_eq!(e.kind(), ErrorKind::Shutdown, "{e}");
                                return ids;
                            }
                        }
                    }
                })
            })
            .collect();
        go.wait();
        // Vary the moment of the shutdown relative to the submits.
        std::thread::sleep(Duration::from_micros(50 * (round % 7)));
        engine
            .shutdown(ShutdownMode::Abort, Some(Duration::from_secs(30)))
            .unwrap();
        let ids: Vec<u64> = submitters
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        let mut terminals: HashMap<u64, usize> = HashMap::new();
        loop {
            let events = engine.poll(4096, Some(Duration::ZERO)).unwrap();
            if events.is_empty() {
                break;
            }
            for e in events.iter().filter(|e| e.is_terminal()) {
                *terminals.entry(e.request_id()).or_default() += 1;
            }
        }
        for id in &ids {
            assert_eq!(
                terminals.get(id),
                Some(&1),
                "round {round}: request {id} was accepted but got {:?} terminal events",
                terminals.get(id)
            );
        }
        assert_eq!(
            terminals.len(),
            ids.len(),
            "round {round}: terminals for unknown ids"
        );
        let m = engine.metrics();
        let ended: u64 = m.finished.iter().sum();
        assert_eq!(
            (m.requests, ended, m.queued, m.queued_tokens),
            (ids.len() as u64, ids.len() as u64, 0, 0),
            "round {round}: metrics out of balance"
        );
        accepted_total += ids.len();
    }
    assert!(accepted_total > 120, "the submitters raced the shutdowns");
}

/// Defect 2: the command channel was allocated for `max_queued_requests` entries up front
/// (4294967295 × 48 B: the process aborted).
#[test]
fn the_largest_queue_bound_allocates_nothing_up_front() {
    let engine = engine_with(json!({"admission": {"max_queued_requests": 4294967295u32}}));
    let prompt = &common::ids("flash-like")[..8];
    let id = engine.submit(greedy(prompt, 2)).unwrap();
    let events = collect(&engine, &[id]);
    assert_eq!(tokens_of(&events[&id]).len(), 2);
}

struct CallsFromCallback {
    engine: Mutex<Option<Arc<dsv4::engine::Engine>>>,
    /// (call, error kind) for each blocking call tried from the callback.
    results: Mutex<Vec<(&'static str, ErrorKind)>>,
    tried: AtomicBool,
    prompt: Vec<u32>,
    submitted: Mutex<Vec<u64>>,
}

impl EventCallback for CallsFromCallback {
    fn deliver(&self, event: &Event) {
        if event.kind() != EventKind::Token || self.tried.swap(true, Ordering::SeqCst) {
            return;
        }
        let engine = self.engine.lock().unwrap().clone().unwrap();
        let mut results = self.results.lock().unwrap();
        let kind =
            |r: Result<(), dsv4::Error>| r.map_or_else(|e| e.kind(), |_| ErrorKind::Internal);
        results.push(("score", kind(engine.score(&[1, 2, 3]).map(|_| ()))));
        results.push(("cache_stats", kind(engine.cache_stats().map(|_| ()))));
        results.push((
            "cache_flush",
            kind(engine.flush_cache(Tier::All).map(|_| ())),
        ));
        results.push(("set_callback", kind(engine.set_callback(None))));
        results.push((
            "shutdown",
            kind(engine.shutdown(ShutdownMode::Drain, Some(Duration::ZERO))),
        ));
        // Non-blocking calls work from a callback.
        let id = engine.submit(greedy(&self.prompt, 1)).unwrap();
        self.submitted.lock().unwrap().push(id);
        engine.abort(event.request_id()).unwrap();
        let _ = engine.metrics();
    }
}

/// Defect 3: from an event callback, score / cache_stats / cache_flush waited on their own
/// thread forever. Now they are refused with INVALID_ARGUMENT; submit and abort work.
#[test]
fn blocking_calls_from_an_event_callback_are_refused_and_the_others_work() {
    let engine = Arc::new(engine_with(json!({})));
    let prompt = common::ids("flash-like")[..8].to_vec();
    let cb = Arc::new(CallsFromCallback {
        engine: Mutex::new(Some(engine.clone())),
        results: Mutex::default(),
        tried: AtomicBool::new(false),
        prompt: prompt.clone(),
        submitted: Mutex::default(),
    });
    engine.set_callback(Some(cb.clone())).unwrap();
    let e2 = engine.clone();
    let id = within(Duration::from_secs(60), "the callback's calls", move || {
        let id = e2.submit(endless(&prompt)).unwrap();
        let start = Instant::now();
        while e2.metrics().finished.iter().sum::<u64>() < 2 {
            assert!(
                start.elapsed() < Duration::from_secs(50),
                "requests did not end"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        id
    });
    let results = cb.results.lock().unwrap().clone();
    assert_eq!(
        results,
        vec![
            ("score", ErrorKind::InvalidArgument),
            ("cache_stats", ErrorKind::InvalidArgument),
            ("cache_flush", ErrorKind::InvalidArgument),
            ("set_callback", ErrorKind::InvalidArgument),
            ("shutdown", ErrorKind::InvalidArgument),
        ]
    );
    assert_eq!(cb.submitted.lock().unwrap().len(), 1);
    let m = engine.metrics();
    assert_eq!(m.requests, 2);
    assert!(id > 0);
    // The engine still answers the same calls from an ordinary thread.
    engine.cache_stats().unwrap();
    *cb.engine.lock().unwrap() = None;
}

/// Blocks the engine thread inside the callback until released.
struct Gate {
    entered: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl EventCallback for Gate {
    fn deliver(&self, _: &Event) {
        if let Some(tx) = self.entered.lock().unwrap().take() {
            let _ = tx.send(());
            let _ = self.release.lock().unwrap().recv();
        }
    }
}

/// Defect 3 (abort): `dsv4_abort` used a blocking send into a bounded channel; with the engine
/// thread busy, the 1025th queued command stalled. 5000 aborts while the engine thread is held
/// inside a callback all return at once.
#[test]
fn abort_never_blocks_even_while_the_engine_thread_is_busy() {
    let engine = Arc::new(engine_with(
        json!({"admission": {"max_queued_requests": 10000}}),
    ));
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    engine
        .set_callback(Some(Arc::new(Gate {
            entered: Mutex::new(Some(entered_tx)),
            release: Mutex::new(release_rx),
        })))
        .unwrap();
    let prompt = common::ids("flash-like")[..8].to_vec();
    let first = engine.submit(endless(&prompt)).unwrap();
    entered.recv_timeout(Duration::from_secs(30)).unwrap();
    // The engine thread is now parked in the callback.
    let ids: Vec<u64> = (0..2000)
        .map(|_| engine.submit(endless(&prompt)).unwrap())
        .collect();
    let e2 = engine.clone();
    within(Duration::from_secs(10), "5000 aborts", move || {
        for round in 0..3 {
            for &id in ids.iter().skip(round * 300) {
                e2.abort(id).unwrap();
            }
        }
        e2.abort(first).unwrap();
    });
    release.send(()).unwrap();
    engine
        .shutdown(ShutdownMode::Drain, Some(Duration::from_secs(60)))
        .unwrap();
    let m = engine.metrics();
    assert_eq!(m.requests, 2001);
    assert_eq!(m.finished.iter().sum::<u64>(), 2001);
}

/// Defect 4: `poll(-1)` was never woken by a shutdown of an idle engine, nor by setting a
/// callback.
#[test]
fn a_waiting_poll_returns_on_shutdown_and_on_a_callback_being_set() {
    let engine = Arc::new(engine_with(json!({})));
    let e2 = engine.clone();
    let poller = std::thread::spawn(move || e2.poll(16, None));
    std::thread::sleep(Duration::from_millis(100));
    engine
        .set_callback(Some(Arc::new(Gate {
            entered: Mutex::new(None),
            release: Mutex::new(mpsc::channel().1),
        })))
        .unwrap();
    let got = within(
        Duration::from_secs(10),
        "poll after set_callback",
        move || poller.join().unwrap(),
    );
    assert_eq!(got.unwrap_err().kind(), ErrorKind::Unsupported);
    engine.set_callback(None).unwrap();

    let e2 = engine.clone();
    let poller = std::thread::spawn(move || e2.poll(16, None));
    std::thread::sleep(Duration::from_millis(100));
    engine.shutdown(ShutdownMode::Drain, None).unwrap();
    let got = within(Duration::from_secs(10), "poll after shutdown", move || {
        poller.join().unwrap()
    });
    assert!(got.unwrap().is_empty());
}

/// Defect 6 (bias): two logit_bias entries for one token that sum to +inf were accepted and
/// the request finished normally with garbage.
#[test]
fn logit_bias_entries_that_sum_past_the_limit_are_refused() {
    let engine = engine_with(json!({}));
    let mut spec: RequestSpec = greedy(&common::ids("flash-like")[..8], 4);
    spec.sampling.logit_bias = vec![(5, 3e38), (5, 3e38)];
    let e = engine.submit(spec.clone()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(
        e.message().contains("logit_bias for token 5 adds up to"),
        "{e}"
    );
    spec.sampling.logit_bias = vec![(5, 6e5), (5, -6e5), (7, 1e6)];
    engine.submit(spec).unwrap();
}

/// Unpolled events are bounded: a host that stops polling pauses its requests instead of
/// growing the queue; no token is lost and the tokens are those of an unpaused run.
#[test]
fn unpolled_events_stay_bounded_and_paused_requests_lose_nothing() {
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| common::ids("flash-like")[i * 10..i * 10 + 20].to_vec())
        .collect();
    let free = {
        let engine = engine_with(json!({}));
        let ids: Vec<u64> = prompts
            .iter()
            .map(|p| engine.submit(exact(p, 60)).unwrap())
            .collect();
        let events = collect(&engine, &ids);
        ids.iter().map(|id| events[id].clone()).collect::<Vec<_>>()
    };
    let engine = engine_with(json!({"admission": {"max_unpolled_events": 8}}));
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| engine.submit(exact(p, 60)).unwrap())
        .collect();
    let mut events: HashMap<u64, Vec<Event>> = HashMap::new();
    let mut most = 0;
    let mut ended = 0;
    let start = Instant::now();
    while ended < ids.len() {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "requests did not end"
        );
        // A slow host: the engine has ample time to run ahead between polls.
        std::thread::sleep(Duration::from_millis(150));
        let got = engine.poll(100_000, Some(Duration::ZERO)).unwrap();
        let tokens = got.iter().filter(|e| e.kind() == EventKind::Token).count();
        most = most.max(tokens);
        for e in got {
            ended += usize::from(e.is_terminal());
            events.entry(e.request_id()).or_default().push(e);
        }
    }
    // 8 queued + at most one step's token for each of the 4 running requests.
    assert!(
        most <= 8 + 4,
        "{most} token events were unpolled with a limit of 8"
    );
    assert!(most >= 8, "the limit was reached ({most})");
    for (id, alone) in ids.iter().zip(&free) {
        let got = &events[id];
        let numbers: Vec<u32> = got
            .iter()
            .filter(|e| e.kind() == EventKind::Token)
            .map(|e| e.stats().generated_tokens)
            .collect();
        assert_eq!(
            numbers,
            (1..=60).collect::<Vec<u32>>(),
            "request {id}: gaps"
        );
        assert_eq!(tokens_of(got), tokens_of(alone));
        assert_eq!(terminal(got).finish_reason(), Some(FinishReason::Length));
    }
}
