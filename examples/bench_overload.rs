//! Overload: requests offered at 10× the engine's measured capacity for 30 s against a bounded
//! queue. Prints admitted TTFT (p50/p99) next to the unloaded TTFT measured in the same
//! process, the latency of refused submits, and queue length and RSS sampled over time.
//! Targets: admitted p99 TTFT ≤ 3× unloaded; refusal p99 ≤ 100 µs; no growth.
//!
//!   cargo run --release --example bench_overload [-- --seconds 30 --factor 10]
//!
//! The queue bound is sized the way an operator should size it: capacity (requests/s) × the
//! queueing delay one is willing to add (here 1.5× the unloaded TTFT).

// Only its command-line, model and quantile helpers are used here.
#[allow(dead_code)]
#[path = "common/agentic.rs"]
mod agentic;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsv4::config::params::Params;
use dsv4::engine::{Engine, EventKind, RequestSpec, SamplingParams};
use dsv4::error::ErrorKind;
use serde_json::json;

const RUNNING: u32 = 8;

fn engine(dir: &str, max_queued: u32) -> Engine {
    let params = Params::from_value(&json!({
        "model_path": dir, "threads": 2,
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": "32MiB", "max_running_requests": RUNNING},
        "scheduler": {"chunked_prefill_tokens": 2048, "max_batch_tokens": 4096},
        "admission": {"max_queued_requests": max_queued, "queue_timeout_ms": 0},
    }))
    .expect("valid params");
    Engine::create(params).expect("engine")
}

/// A fresh random prompt (no cache hits between requests), EOS suppressed: every request
/// costs the same.
fn spec(rng: &mut fastrand::Rng, vocab: u32, prompt: usize, max_new: u32) -> RequestSpec {
    RequestSpec {
        prompt: (0..prompt).map(|_| rng.u32(16..vocab)).collect(),
        max_new_tokens: max_new,
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    pages * 4096.0 / 1048576.0
}

/// Waits for the terminal events of `n` requests; TTFTs in ms.
fn drain(engine: &Engine, n: usize) -> Vec<f64> {
    let (mut ttft, mut ended) = (Vec::new(), 0);
    while ended < n {
        for e in engine.poll(256, Some(Duration::from_millis(50))).unwrap() {
            if e.kind() == EventKind::Token && e.stats().generated_tokens == 1 {
                ttft.push(e.stats().ttft_us as f64 / 1000.0);
            }
            ended += usize::from(e.is_terminal());
        }
    }
    ttft
}

fn main() {
    let seconds = agentic::arg("--seconds", 30.0);
    let prompt = agentic::arg("--prompt", 1024.0) as usize;
    let max_new = agentic::arg("--max-new", 16.0) as u32;
    let factor = agentic::arg("--factor", 10.0);
    let (dir, _) = agentic::tiny_model().expect("tiny checkpoint");
    let dir = dir.to_str().expect("UTF-8 path").to_string();
    let mut rng = fastrand::Rng::with_seed(1);

    // 1. Unloaded TTFT: one request at a time.
    let e = engine(&dir, 1024);
    let vocab = e.vocab_size() as u32;
    let mut unloaded = Vec::new();
    for _ in 0..30 {
        e.submit(spec(&mut rng, vocab, prompt, max_new)).unwrap();
        unloaded.extend(drain(&e, 1));
    }
    let unloaded_p50 = agentic::quantile(&mut unloaded, 0.5);
    let unloaded_p99 = agentic::quantile(&mut unloaded, 0.99);

    // 2. Capacity: the running set kept full for 5 s.
    let start = Instant::now();
    for _ in 0..RUNNING {
        e.submit(spec(&mut rng, vocab, prompt, max_new)).unwrap();
    }
    let mut done = 0usize;
    while start.elapsed() < Duration::from_secs(5) {
        for ev in e.poll(256, Some(Duration::from_millis(20))).unwrap() {
            if ev.is_terminal() {
                done += 1;
                e.submit(spec(&mut rng, vocab, prompt, max_new)).unwrap();
            }
        }
    }
    let capacity = done as f64 / start.elapsed().as_secs_f64();
    drop(e);
    let max_queued = ((capacity * 1.5 * unloaded_p50 / 1000.0).floor() as u32).max(1);
    println!(
        "tiny model, 2 threads, {RUNNING} running, {prompt}-token prompts, {max_new} new tokens"
    );
    println!(
        "unloaded TTFT p50 {unloaded_p50:.1} ms p99 {unloaded_p99:.1} ms; capacity {capacity:.1} \
         req/s; admission.max_queued_requests = {max_queued}"
    );

    // 3. 10x offered load.
    let engine = Arc::new(engine(&dir, max_queued));
    let stop = Arc::new(AtomicBool::new(false));
    let admitted_ttft = Arc::new(Mutex::new(Vec::new()));
    let poller = {
        let (engine, stop, out) = (engine.clone(), stop.clone(), admitted_ttft.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                for e in engine.poll(512, Some(Duration::from_millis(20))).unwrap() {
                    if e.kind() == EventKind::Token && e.stats().generated_tokens == 1 {
                        out.lock().unwrap().push(e.stats().ttft_us as f64 / 1000.0);
                    }
                }
            }
        })
    };
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (engine, stop, samples) = (engine.clone(), stop.clone(), samples.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let m = engine.metrics();
                samples
                    .lock()
                    .unwrap()
                    .push((t0.elapsed().as_secs_f64(), m.queued, rss_mib()));
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let rate = capacity * factor;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let (mut accepted, mut refused) = (0u64, 0u64);
    let mut refusal_us = Vec::new();
    let start = Instant::now();
    let mut next = start;
    // Prompts are drawn ahead of the clock so the submit timing measures only the engine.
    let mut prepared = spec(&mut rng, vocab, prompt, max_new);
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
        }
        next += interval;
        let t = Instant::now();
        let result = engine.submit(prepared);
        let took = t.elapsed();
        match result {
            Ok(_) => accepted += 1,
            Err(e) if e.kind() == ErrorKind::QueueFull => {
                refused += 1;
                refusal_us.push(took.as_secs_f64() * 1e6);
            }
            Err(e) => panic!("submit: {e}"),
        }
        prepared = spec(&mut rng, vocab, prompt, max_new);
    }
    let offered_s = start.elapsed().as_secs_f64();
    engine
        .shutdown(dsv4::engine::ShutdownMode::Drain, None)
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    poller.join().unwrap();
    sampler.join().unwrap();

    let mut ttft = admitted_ttft.lock().unwrap().clone();
    let (p50, p99) = (
        agentic::quantile(&mut ttft, 0.5),
        agentic::quantile(&mut ttft, 0.99),
    );
    let (r50, r99) = (
        agentic::quantile(&mut refusal_us, 0.5),
        agentic::quantile(&mut refusal_us, 0.99),
    );
    println!(
        "offered {:.0} req/s ({factor}x) for {offered_s:.0} s: {accepted} admitted ({:.1} req/s), \
         {refused} refused ({:.1} %)",
        rate,
        accepted as f64 / offered_s,
        100.0 * refused as f64 / (accepted + refused) as f64
    );
    println!(
        "admitted TTFT p50 {p50:.1} ms p99 {p99:.1} ms (unloaded p50 {unloaded_p50:.1} ms): \
         p99/unloaded = {:.2} (target <= 3)",
        p99 / unloaded_p50
    );
    println!("refusal latency p50 {r50:.1} us p99 {r99:.1} us (target <= 100 us)");
    let samples = samples.lock().unwrap().clone();
    let line: Vec<String> = samples
        .iter()
        .step_by((samples.len() / 12).max(1))
        .map(|(t, q, rss)| format!("{t:.0}s q={q} rss={rss:.0}MiB"))
        .collect();
    println!("queue and RSS over time: {}", line.join(", "));
    let quarter = (samples.len() / 4).max(1);
    let mean = |s: &[(f64, u64, f64)]| s.iter().map(|x| x.2).sum::<f64>() / s.len() as f64;
    let max_q = samples.iter().map(|s| s.1).max().unwrap_or(0);
    println!(
        "queue max {max_q} (bound {max_queued}); RSS first quarter {:.1} MiB, last quarter {:.1} \
         MiB",
        mean(&samples[..quarter]),
        mean(&samples[samples.len() - quarter..])
    );
}
