//! `make stress`: DSV4_STRESS_SECONDS (default 60) of concurrent load, then the books.
//!
//! One long-lived engine (HiCache on pools small enough for load-backs, evictions and
//! retractions) takes submits, polls, aborts, scoring calls, cache statistics, flushes of every
//! tier and metrics reads from six threads at once. Meanwhile another thread keeps creating small
//! engines, has four threads submit to each in a tight loop (and poll and abort), and shuts each
//! down, with an abort or a drain, while those threads are still submitting; then destroys it.
//!
//! The books of every engine must balance (common::books: exactly one terminal event per
//! accepted request, metrics counters equal to the client's counts of requests, outcomes,
//! refusals by reason and generated tokens, gauges back to zero); the long-lived engine's pools
//! must be back to their state at creation after a cache flush. The header says destroy joins
//! every thread the engine started: right after the long-lived engine is destroyed, and right
//! after each of 20 engines created and destroyed one at a time at the end, the process must have
//! the threads and open file descriptors it had before. Every failed check is collected and all
//! are reported together, with counts, so one run says everything that is wrong.
//!
//! Ignored by `cargo test` (it runs a minute). Alone in its binary: it counts the process's
//! threads and descriptors.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::books::{drain, fds_now, random_spec, threads_now, Books};
use dsv4::config::params::Params;
use dsv4::engine::{Engine, Rejection, RequestSpec, ShutdownMode};
use dsv4::error::ErrorKind;
use dsv4::kv::cache::Tier;
use serde_json::{json, Value};

type Problems = Arc<Mutex<Vec<String>>>;

fn stress_seconds() -> u64 {
    std::env::var("DSV4_STRESS_SECONDS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("DSV4_STRESS_SECONDS is a whole number of seconds")
        })
        .unwrap_or(60)
}

#[test]
#[ignore = "a minute of stress: `make stress` (DSV4_STRESS_SECONDS sets the duration)"]
fn books_balance_under_concurrent_calls_and_shutdowns() {
    let run_for = Duration::from_secs(stress_seconds());
    let (threads_before, fds_before) = (threads_now(), fds_now());
    let ids = Arc::new(common::ids("flash-like"));
    let problems: Problems = Arc::default();

    let churn = {
        let (ids, problems) = (ids.clone(), problems.clone());
        std::thread::spawn(move || churn(run_for, &ids, &problems))
    };
    let (long_lived, summary) = long_lived(run_for, &ids, &problems);
    let churned = churn.join().unwrap();
    // Every other engine is gone: the long-lived one's threads are the only ones to go.
    let mut found = Vec::new();
    destroyed(long_lived, (threads_before, fds_before), &mut found);
    let mut found: Vec<String> = found
        .into_iter()
        .map(|p| format!("the last of the concurrent engines destroyed: {p}"))
        .collect();
    let cycles = destroy_cycles(20, &ids, &mut found);
    problems.lock().unwrap().extend(found);

    let problems = problems.lock().unwrap();
    eprintln!("long-lived engine: {summary}");
    eprintln!("{churned}");
    eprintln!("{cycles}");
    assert!(
        problems.is_empty(),
        "{} failed checks:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// Destroys `engine` (its last reference) and checks at once that the process is back to
/// `before` (threads, open fds); if not, how long it takes to get there (at most 2 s).
fn destroyed(engine: Arc<Engine>, before: (usize, usize), found: &mut Vec<String>) -> bool {
    assert_eq!(Arc::strong_count(&engine), 1, "not the last reference");
    drop(engine);
    let right_after = (threads_now(), fds_now());
    if right_after == before {
        return true;
    }
    let waited = Instant::now();
    while (threads_now(), fds_now()) != before && waited.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let later = (threads_now(), fds_now());
    found.push(format!(
        "(threads, open fds): {before:?} before the engine, {right_after:?} right after destroy \
         returned, {}",
        if later == before {
            format!("back {} ms later", waited.elapsed().as_millis())
        } else {
            format!("{later:?} 2 s later")
        }
    ));
    false
}

/// `n` engines one at a time, nothing else running: create, generate, destroy, check the
/// process is back to its threads and fds at once. A one-line summary.
fn destroy_cycles(n: usize, ids: &[u32], found: &mut Vec<String>) -> String {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "8MiB", "max_running_requests": 4, "page_size": 128},
        "hicache": {"enabled": true, "ratio": 2.0, "write_policy": "write_through"}
    });
    let params = Params::from_value(&doc).unwrap();
    let mut leaky = 0;
    for i in 0..n {
        let before = (threads_now(), fds_now());
        let engine = Arc::new(Engine::create(params.clone()).unwrap());
        // 300 tokens: two full pages, backed up to the host tier (the copy thread starts).
        let id = engine
            .submit(common::requests::exact(&ids[..300], 3))
            .unwrap();
        let events = common::requests::collect(&engine, &[id]);
        common::requests::terminal(&events[&id]);
        let mut mine = Vec::new();
        if !destroyed(engine, before, &mut mine) {
            leaky += 1;
            found.extend(mine.into_iter().map(|p| format!("destroy cycle {i}: {p}")));
        }
    }
    format!("destroy cycles: {n}, the process not back at once after {leaky}")
}

/// A spec that `submit` must refuse: an id outside the vocabulary (InvalidArgument) or a prompt
/// longer than any request can hold (Capacity).
fn refused_spec(rng: &mut fastrand::Rng, engine: &Engine, ids: &[u32]) -> RequestSpec {
    let mut spec = random_spec(rng, ids, false);
    if rng.bool() {
        spec.prompt[0] = engine.vocab_size() as u32;
    } else {
        let plan = engine.plan();
        let longest = plan.max_context_tokens.min(plan.device_tokens()) as usize;
        spec.prompt = ids.iter().copied().cycle().take(longest + 1).collect();
    }
    spec
}

/// Units in use per pool and tier, and the pages and snapshots the cache tree holds, from
/// cache_stats. (Not its node count: the tree keeps one root per cache salt ever seen.)
fn pool_usage(engine: &Engine) -> Value {
    let stats = engine.cache_stats().unwrap();
    let mut used = serde_json::Map::new();
    for (pool, tiers) in stats["pools"].as_object().unwrap() {
        for tier in ["device", "host"] {
            if let Some(u) = tiers.get(tier) {
                used.insert(format!("{pool}.{tier}"), u["used_units"].clone());
            }
        }
    }
    let mut tree = stats["tree"].clone();
    tree.as_object_mut().unwrap().remove("nodes");
    json!({"used_units": used, "tree": tree})
}

/// Six threads call everything on one engine for `run_for`; then every request is let end, the
/// cache is flushed and the books, pools and shutdown are checked. The engine (shut down, not
/// destroyed) and a one-line summary.
fn long_lived(
    run_for: Duration,
    ids: &Arc<Vec<u32>>,
    problems: &Problems,
) -> (Arc<Engine>, String) {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": 1500 * 1024, "max_running_requests": 6, "page_size": 128,
               "snapshot_fraction": 0.4},
        "hicache": {"enabled": true, "ratio": 4.0},
        "admission": {"max_queued_requests": 12, "max_queued_tokens": 3000, "queue_timeout_ms": 1500},
        "scheduler": {"chunked_prefill_tokens": 96, "max_batch_tokens": 160}
    });
    let engine = Arc::new(Engine::create(Params::from_value(&doc).unwrap()).unwrap());
    let baseline_usage = engine.flush_cache(Tier::All).unwrap();
    let baseline_pools = pool_usage(&engine);
    let baseline_gauges = engine.metrics().pools;
    let books = Arc::new(Mutex::new(Books::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(Mutex::new([0u64; 4])); // scores, cache_stats, flushes, metrics reads
    let workers: Vec<_> = (0..6u64)
        .map(|w| {
            let (engine, ids, books, stop, problems, calls) = (
                engine.clone(),
                ids.clone(),
                books.clone(),
                stop.clone(),
                problems.clone(),
                calls.clone(),
            );
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(100 + w);
                let mut mine: Vec<u64> = Vec::new();
                let problem = |p: String| problems.lock().unwrap().push(format!("long-lived: {p}"));
                while !stop.load(Ordering::Relaxed) {
                    match rng.u32(0..20) {
                        0..=6 => {
                            let spec = if rng.u32(0..15) == 0 {
                                refused_spec(&mut rng, &engine, &ids)
                            } else {
                                random_spec(&mut rng, &ids, true)
                            };
                            let result = engine.submit(spec);
                            mine.extend(books.lock().unwrap().submitted(&result));
                        }
                        7..=8 if !mine.is_empty() => {
                            let id = mine[rng.usize(0..mine.len())];
                            if let Err(e) = engine.abort(id) {
                                if e.kind() != ErrorKind::NotFound {
                                    problem(format!("abort({id}): {e}"));
                                }
                            }
                        }
                        9 => {
                            let len = rng.usize(1..64);
                            let start = rng.usize(0..100);
                            let tokens: Vec<i32> =
                                ids[start..start + len].iter().map(|&t| t as i32).collect();
                            match engine.score(&tokens) {
                                Ok(logits) if logits.len() == len * engine.vocab_size() => {}
                                Ok(logits) => problem(format!(
                                    "score of {len} tokens gave {} logits",
                                    logits.len()
                                )),
                                // Scoring does not wait for room: with the pools held by
                                // running requests it is refused.
                                Err(e) if e.kind() == ErrorKind::Capacity => {}
                                Err(e) => problem(format!("score of {len} tokens: {e}")),
                            }
                            calls.lock().unwrap()[0] += 1;
                        }
                        10 => {
                            match engine.cache_stats() {
                                Ok(s) if s["pools"].is_object() => {}
                                Ok(s) => problem(format!("cache_stats without pools: {s}")),
                                Err(e) => problem(format!("cache_stats: {e}")),
                            }
                            calls.lock().unwrap()[1] += 1;
                        }
                        11 if rng.u32(0..3) == 0 => {
                            let tier = [Tier::Device, Tier::Host, Tier::All][rng.usize(0..3)];
                            if let Err(e) = engine.flush_cache(tier) {
                                problem(format!("flush_cache({tier:?}): {e}"));
                            }
                            calls.lock().unwrap()[2] += 1;
                        }
                        12 => {
                            // Counters only grow; nothing ends that was not accepted.
                            let m = engine.metrics();
                            let ended: u64 = m.finished.iter().sum();
                            if ended > m.requests {
                                problem(format!("{ended} ended of {} accepted", m.requests));
                            }
                            calls.lock().unwrap()[3] += 1;
                        }
                        _ => {
                            let events = engine.poll(32, Some(Duration::from_millis(20))).unwrap();
                            let mut b = books.lock().unwrap();
                            for e in &events {
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
    let mut found = Vec::new();
    if !drain(&engine, &books, Duration::from_secs(120)) {
        found.push("requests still running 120 s after the load stopped".to_string());
    }
    // With every request ended and the cache flushed, the pools are as they were at creation.
    let usage = engine.flush_cache(Tier::All).unwrap();
    if usage != baseline_usage {
        found.push(format!(
            "device units in use after a flush: {usage:?}, at creation {baseline_usage:?}"
        ));
    }
    let pools = pool_usage(&engine);
    if pools != baseline_pools {
        found.push(format!(
            "cache_stats after a flush: {pools}, at creation {baseline_pools}"
        ));
    }
    let gauges = engine.metrics().pools;
    if gauges != baseline_gauges {
        found.push(format!(
            "pool gauges after a flush: {gauges:?}, at creation {baseline_gauges:?}"
        ));
    }
    if let Err(e) = engine.shutdown(ShutdownMode::Drain, Some(Duration::from_secs(30))) {
        found.push(format!("drain shutdown of an idle engine: {e}"));
    }
    let late = engine.poll(16, Some(Duration::ZERO)).unwrap();
    if !late.is_empty() {
        found.push(format!(
            "{} events after the end: {:?}",
            late.len(),
            late[0]
        ));
    }
    let m = engine.metrics();
    let b = books.lock().unwrap();
    found.extend(b.problems(&m));
    let calls = *calls.lock().unwrap();
    let summary = format!(
        "{} accepted, {} refused ({} queue full), {} tokens, {} load-backs, {} retractions; \
         {} scores, {} cache_stats, {} flushes, {} metrics reads",
        b.accepted.len(),
        b.refusals(),
        b.refused[Rejection::QueueFull as usize],
        b.tokens_total(),
        m.cache.loadbacks,
        m.retractions,
        calls[0],
        calls[1],
        calls[2],
        calls[3],
    );
    // A load that never got past admission checks little. (Load-backs are only counted: the
    // churn's spinning submitters can starve this engine of them; engine_stress requires them.)
    if b.accepted.len() < 50 {
        found.push(format!("too little load to judge: {summary}"));
    }
    drop(b);
    problems
        .lock()
        .unwrap()
        .extend(found.into_iter().map(|p| format!("long-lived: {p}")));
    (engine, summary)
}

/// Small engines, one after another for `run_for`: four threads submit in a tight loop (and
/// poll and abort); after 5 to 150 ms the engine is shut down (abort, or one time in four drain)
/// while they still submit, its remaining events are collected, its books checked, and it is
/// destroyed. A one-line summary.
fn churn(run_for: Duration, ids: &Arc<Vec<u32>>, problems: &Problems) -> String {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 1,
        "kv": {"device_memory_bytes": "8MiB", "max_running_requests": 4, "page_size": 128},
        "admission": {"max_queued_requests": 8}
    });
    let params = Params::from_value(&doc).unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    let started = Instant::now();
    let (mut engines, mut accepted, mut refused_shutdown, mut unbalanced) = (0, 0, 0, 0);
    while started.elapsed() < run_for {
        let engine = Arc::new(Engine::create(params.clone()).unwrap());
        let books = Arc::new(Mutex::new(Books::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let submitters: Vec<_> = (0..4u64)
            .map(|t| {
                let (engine, ids, books, stop) =
                    (engine.clone(), ids.clone(), books.clone(), stop.clone());
                let seed = engines * 4 + t;
                std::thread::spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(seed);
                    let mut mine = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match rng.u32(0..8) {
                            0..=5 => {
                                let mut spec = random_spec(&mut rng, &ids, false);
                                spec.prompt.truncate(rng.usize(1..8));
                                spec.max_new_tokens = rng.u32(1..4);
                                // Validating a long stop list keeps a submit between its
                                // "accepting?" check and its send for tens of microseconds,
                                // long enough for the engine thread to finish meanwhile.
                                spec.stop_tokens = vec![383; rng.usize(0..20_000)];
                                let result = engine.submit(spec);
                                mine.extend(books.lock().unwrap().submitted(&result));
                            }
                            6 if !mine.is_empty() => {
                                let _ = engine.abort(mine[rng.usize(0..mine.len())]);
                            }
                            _ => {
                                let events = engine.poll(64, Some(Duration::ZERO)).unwrap();
                                let mut b = books.lock().unwrap();
                                for e in &events {
                                    b.event(e);
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(rng.u64(5..150)));
        let mode = if rng.u32(0..4) > 0 {
            ShutdownMode::Abort
        } else {
            ShutdownMode::Drain
        };
        let mut found = Vec::new();
        match engine.shutdown(mode, Some(Duration::from_secs(20))) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::Timeout => {
                found.push(format!("{mode:?} shutdown still running after 20 s"));
                if let Err(e) = engine.shutdown(ShutdownMode::Abort, None) {
                    found.push(format!("abort shutdown after a drain timed out: {e}"));
                }
            }
            Err(e) => found.push(format!("{mode:?} shutdown: {e}")),
        }
        // Submits keep coming for a moment after the shutdown returned (all refused).
        std::thread::sleep(Duration::from_millis(5));
        stop.store(true, Ordering::Relaxed);
        for s in submitters {
            s.join().unwrap();
        }
        // The engine thread has ended: every event it will ever emit is waiting.
        loop {
            let events = engine.poll(256, Some(Duration::ZERO)).unwrap();
            if events.is_empty() {
                break;
            }
            let mut b = books.lock().unwrap();
            for e in &events {
                b.event(e);
            }
        }
        let b = books.lock().unwrap();
        found.extend(b.problems(&engine.metrics()));
        accepted += b.accepted.len();
        refused_shutdown += b.refused[Rejection::Shutdown as usize];
        if !found.is_empty() {
            unbalanced += 1;
            problems.lock().unwrap().extend(
                found
                    .into_iter()
                    .map(|p| format!("engine {engines} ({mode:?} shutdown): {p}")),
            );
        }
        drop(b);
        drop(engine); // the last reference: destroyed while the long-lived engine runs
        engines += 1;
    }
    if engines < 10 {
        problems.lock().unwrap().push(format!(
            "only {engines} engines created and shut down: too few to judge"
        ));
    }
    format!(
        "churn: {engines} engines shut down under load, {accepted} requests accepted, \
         {refused_shutdown} submits refused as shut down; books unbalanced in {unbalanced}"
    )
}
