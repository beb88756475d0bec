//! The demo's agentic workload (shared system prompt, multi-turn conversations) served three
//! ways on the built-in tiny model: prefix cache off, prefix cache on the device only, and
//! with HiCache (same small device pool plus a host tier). Prints throughput and TTFT side by
//! side and the ratios against the cache-off baseline run in the same process.
//!
//!   cargo run --release --example bench_prefix [-- --users N --turns N]

#[path = "common/agentic.rs"]
mod agentic;

use agentic::{quantile_ms, replay, Report, Workload};
use dsv4::config::params::Params;
use dsv4::engine::Engine;
use serde_json::{json, Value};

fn run(dir: &str, w: &Workload, kv_extra: Value, hicache: Value) -> Report {
    let mut kv = json!({"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
                        "device_memory_bytes": "3MiB", "max_running_requests": 8,
                        "snapshot_fraction": 0.3});
    for (k, v) in kv_extra.as_object().expect("an object") {
        kv[k] = v.clone();
    }
    let params = Params::from_value(&json!({
        "model_path": dir, "threads": 2, "kv": kv, "hicache": hicache,
        "scheduler": {"chunked_prefill_tokens": 512, "max_batch_tokens": 1024},
        "admission": {"max_queued_requests": 8},
    }))
    .expect("valid params");
    let engine = Engine::create(params).expect("engine");
    replay(&engine, w, |_, _| {})
}

fn main() {
    let (dir, _) = agentic::tiny_model().expect("tiny checkpoint");
    let dir = dir.to_str().expect("UTF-8 path").to_string();
    let w = Workload::demo();
    println!(
        "agentic workload: {} users × {} turns, {}-token system prompt, {}-token messages, {} new \
         tokens; tiny model, 2 threads, 3 MiB device KV (fp8 / fp4 rows), 8 running",
        w.users, w.turns, w.system_tokens, w.message_tokens, w.max_new_tokens
    );
    let runs = [
        (
            "prefix cache off",
            run(&dir, &w, json!({"prefix_cache": false}), json!({})),
        ),
        ("device only", run(&dir, &w, json!({}), json!({}))),
        (
            "HiCache (ratio 6)",
            run(&dir, &w, json!({}), json!({"enabled": true, "ratio": 6.0})),
        ),
    ];
    println!(
        "{:<20} {:>9} {:>12} {:>13} {:>13} {:>13} {:>9} {:>9}",
        "",
        "wall s",
        "gen tok/s",
        "prompt tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "cached %",
        "host %"
    );
    for (name, r) in &runs {
        let pct = |x: u64| 100.0 * x as f64 / r.prompt_tokens.max(1) as f64;
        println!(
            "{:<20} {:>9.2} {:>12.0} {:>13.0} {:>13.1} {:>13.1} {:>9.1} {:>9.1}",
            name,
            r.wall.as_secs_f64(),
            r.tokens_per_s(),
            r.prompt_tokens_per_s(),
            quantile_ms(&r.ttft_us, 0.5),
            quantile_ms(&r.ttft_us, 0.99),
            pct(r.cached_device + r.cached_host),
            pct(r.cached_host)
        );
        assert_eq!(r.errors, 0, "{name}: requests failed");
    }
    let base = &runs[0].1;
    let ratio = |r: &Report| r.tokens_per_s() / base.tokens_per_s();
    let ttft =
        |r: &Report| quantile_ms(&base.ttft_us, 0.5) / quantile_ms(&r.ttft_us, 0.5).max(1e-3);
    println!(
        "ratios vs cache off: throughput device_only={:.2} hicache={:.2}; TTFT p50 speed-up \
         device_only={:.2} hicache={:.2}",
        ratio(&runs[1].1),
        ratio(&runs[2].1),
        ttft(&runs[1].1),
        ttft(&runs[2].1)
    );
}
