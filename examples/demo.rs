//! `make demo`: the built-in tiny DeepSeek V4 model served on the CPU backend under an agentic
//! workload — a long shared system prompt, many users, multi-turn conversations — with HiCache
//! on and a deliberately small device pool, so prefixes move between the device and host tiers.
//! Prints a summary and an excerpt of the Prometheus exposition. Then the same conversations
//! through a prefill engine and a decode engine (PD disaggregation over TCP loopback, both in
//! this process): TTFT, transfer rate and room counts, against the unified run.
//!
//!   cargo run --release --example demo [-- --users N --turns N]
//!
//! The tiny checkpoint (official naming, FP8/FP4 weights) is written once to
//! $DSV4_DEMO_MODEL_DIR, else $XDG_CACHE_HOME/dsv4/tiny-model, else ~/.cache/dsv4/tiny-model.

#[path = "common/agentic.rs"]
mod agentic;
#[allow(dead_code)]
#[path = "common/pd.rs"]
mod pd;

use std::io::{IsTerminal, Write};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use agentic::{quantile_ms, replay, Report, Workload};
use dsv4::config::params::Params;
use dsv4::engine::{Engine, EventKind, Outcome, Rejection, RequestSpec, SamplingParams};
use dsv4::error::Error;
use pd::Pair;
use serde_json::json;

fn main() {
    if let Err(e) = run() {
        eprintln!("demo failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> dsv4::error::Result<()> {
    let t = Instant::now();
    let (dir, wrote) = agentic::tiny_model()?;
    println!(
        "model: built-in tiny DeepSeek V4 (6 layers: SWA, CSA, HCA; hash and scored MoE; FP8 \
         + FP4 weights) at {} ({}, {:.2} s)",
        dir.display(),
        if wrote { "written" } else { "reused" },
        t.elapsed().as_secs_f64()
    );
    let params = Params::from_value(&json!({
        "model_path": dir.to_str().expect("a UTF-8 path"),
        "threads": 2,
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": "3MiB", "max_running_requests": 8, "snapshot_fraction": 0.3},
        "scheduler": {"chunked_prefill_tokens": 512, "max_batch_tokens": 1024},
        "hicache": {"enabled": true, "ratio": 6.0, "write_policy": "write_through"},
        "admission": {"max_queued_requests": 8},
        "metrics": {"labels": {"engine": "demo"}},
    }))?;
    let t = Instant::now();
    let engine = Engine::create(params)?;
    let m = engine.metrics();
    let units = |u: &dsv4::engine::Units| {
        format!(
            "{} units ({:.1} MiB)",
            u.total,
            u.total_bytes as f64 / 1048576.0
        )
    };
    println!(
        "engine: cpu backend, 2 threads, fp8 KV + fp4 indexer rows, created in {:.2} s",
        t.elapsed().as_secs_f64()
    );
    println!(
        "  device: pages {}, slots {}, snapshots {}",
        units(&m.pools.device_pages),
        units(&m.pools.device_slots),
        units(&m.pools.device_snapshots)
    );
    println!(
        "  host (HiCache ratio 6, write_through): pages {}, snapshots {}",
        units(&m.pools.host_pages),
        units(&m.pools.host_snapshots)
    );
    let w = Workload::demo();
    println!(
        "workload: {} users × {} turns, shared {}-token system prompt, {}-token messages, up to \
         {} new tokens; admission.max_queued_requests = 8 (a refused user retries 50 ms later)",
        w.users, w.turns, w.system_tokens, w.message_tokens, w.max_new_tokens
    );
    let report = replay(&engine, &w, progress_bar());
    let m = engine.metrics();
    println!("summary ({:.1} s):", report.wall.as_secs_f64());
    println!(
        "  requests        {} finished ({} length, {} stop), {} errors; {} submits refused \
         at once (queue full) and retried",
        report.requests,
        m.finished(Outcome::Length),
        m.finished(Outcome::Stop),
        report.errors,
        m.rejected(Rejection::QueueFull)
    );
    println!(
        "  TTFT            p50 {:.1} ms   p99 {:.1} ms",
        quantile_ms(&report.ttft_us, 0.5),
        quantile_ms(&report.ttft_us, 0.99)
    );
    println!(
        "  ITL             p50 {:.1} ms   p99 {:.1} ms",
        quantile_ms(&report.itl_us, 0.5),
        quantile_ms(&report.itl_us, 0.99)
    );
    println!(
        "  throughput      {:.0} generated tokens/s, {:.0} prompt tokens/s",
        report.tokens_per_s(),
        report.prompt_tokens_per_s()
    );
    let pct = |x: u64| 100.0 * x as f64 / report.prompt_tokens.max(1) as f64;
    println!(
        "  cached prompt   {} of {} tokens: device {} ({:.0} %), host {} ({:.0} %)",
        report.cached_device + report.cached_host,
        report.prompt_tokens,
        report.cached_device,
        pct(report.cached_device),
        report.cached_host,
        pct(report.cached_host)
    );
    let c = &m.cache;
    println!(
        "  HiCache         {} load-backs ({:.1} MiB), {} backups ({:.1} MiB), {} device \
         evictions kept on host, {} host evictions",
        c.loadbacks,
        c.loadback_bytes as f64 / 1048576.0,
        c.backups,
        c.backup_bytes as f64 / 1048576.0,
        c.evicted_to_host,
        c.host_evictions
    );
    println!("  retractions     {}", m.retractions);
    assert_eq!(
        report.cached_device + report.cached_host,
        m.cached_tokens_device + m.cached_tokens_host,
        "events and metrics agree"
    );
    println!("prometheus excerpt (dsv4_metrics_prometheus):");
    let text = engine.prometheus();
    let wanted = [
        "dsv4_num_requests_total",
        "dsv4_num_rejected_requests_total{engine=\"demo\",reason=\"queue_full\"}",
        "dsv4_cached_tokens_total",
        "dsv4_generation_tokens_total",
        "dsv4_hicache_loadback_bytes_total",
        "dsv4_time_to_first_token_seconds_count",
        "dsv4_time_to_first_token_seconds_sum",
        "dsv4_token_usage",
    ];
    for line in text.lines() {
        if !line.starts_with('#') && wanted.iter().any(|w| line.starts_with(w)) {
            println!("  {line}");
        }
    }
    if report.errors > 0 {
        return Err(Error::internal(format!(
            "{} requests ended with an error",
            report.errors
        )));
    }
    text_section(&engine)?;
    drop(engine);
    pd_section(dir.to_str().expect("a UTF-8 path"), &w, &report)
}

/// Text in and out: the checkpoint's chat template and tokenizer (`dsv4_chat_apply`,
/// `dsv4_tokenize`, `dsv4_detokenizer_*`) around one greedy request.
fn text_section(engine: &Engine) -> dsv4::error::Result<()> {
    let text = engine.text();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What does HiCache keep on the host?"},
    ]);
    let prompt = text.chat_apply(&messages.to_string(), true)?;
    // The template writes the BOS token itself, so the tokenizer adds nothing.
    let ids = text.tokenize(&prompt, false)?;
    println!("text (chat template + tokenizer from the checkpoint's files):");
    println!("  prompt  {prompt:?} = {} tokens", ids.len());
    let id = engine.submit(RequestSpec {
        prompt: ids,
        max_new_tokens: 24,
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    })?;
    let mut detokenizer = text.detokenizer()?;
    let mut answer = String::new();
    let mut reason = None;
    while reason.is_none() {
        for e in engine.poll(64, Some(Duration::from_secs(10)))? {
            if e.request_id() != id {
                continue;
            }
            match e.kind() {
                EventKind::Token => {
                    let token = e.token_id().expect("a token event has a token");
                    answer.push_str(&detokenizer.feed(token as i32)?);
                }
                _ => reason = Some(e.finish_reason()),
            }
        }
    }
    println!(
        "  answer  {answer:?} (streamed piece by piece; {:?}; random weights, so no sense)",
        reason.flatten()
    );
    Ok(())
}

/// A progress bar for `replay`: redrawn in place on a terminal, a line per quarter in a log.
fn progress_bar() -> impl FnMut(usize, usize) {
    let tty = std::io::stdout().is_terminal();
    move |done, total| {
        let width = 40;
        let filled = done * width / total;
        let bar = format!(
            "  [{}{}] {done}/{total} requests",
            "#".repeat(filled),
            ".".repeat(width - filled)
        );
        if tty {
            print!("\r{bar}");
            let _ = std::io::stdout().flush();
            if done == total {
                println!();
            }
        } else if (done * 4).is_multiple_of(total) || done == total {
            println!("{bar}");
        }
    }
}

/// The same conversations through a prefill + decode pair over TCP loopback.
fn pd_section(dir: &str, w: &Workload, unified: &Report) -> dsv4::error::Result<()> {
    println!();
    println!(
        "== The same workload disaggregated: a prefill and a decode engine over TCP loopback =="
    );
    let t = Instant::now();
    // The prefill keeps the unified engine's cache, HiCache and admission settings: it serves
    // the prompts, so it is where the shared system prompt and earlier turns hit the cache.
    let prefill = Engine::create(Params::from_value(&json!({
        "model_path": dir, "threads": 2, "role": "prefill",
        "pd": {"listen": "tcp://127.0.0.1:0"},
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": "3MiB", "max_running_requests": 8, "snapshot_fraction": 0.3},
        "scheduler": {"chunked_prefill_tokens": 512, "max_batch_tokens": 1024},
        "hicache": {"enabled": true, "ratio": 6.0, "write_policy": "write_through"},
        "admission": {"max_queued_requests": 8},
        "metrics": {"labels": {"engine": "demo-prefill"}},
    }))?)?;
    // The decode takes every prompt's state whole (it does not use its own prefix cache for a
    // PD request), so no HiCache. Its queue covers the rooms whose state has not landed, at
    // most what the prefill holds (8 running + 8 queued): with 16 it never refuses a request
    // the prefill took, and the prefill's refusals are the ones users retry.
    let decode = Engine::create(Params::from_value(&json!({
        "model_path": dir, "threads": 2, "role": "decode",
        "pd": {"listen": "tcp://127.0.0.1:0"},
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": "3MiB", "max_running_requests": 8},
        "scheduler": {"chunked_prefill_tokens": 512, "max_batch_tokens": 1024},
        "admission": {"max_queued_requests": 16},
        "metrics": {"labels": {"engine": "demo-decode"}},
    }))?)?;
    let pair = Pair::new(prefill, decode)?;
    println!(
        "engines: prefill at {} (HiCache as above), decode (3 MiB device KV), 2 threads each \
         on this machine's cores, created in {:.2} s",
        pair.prefill.pd_endpoint()?,
        t.elapsed().as_secs_f64()
    );
    let report = replay(&pair, w, progress_bar());
    // The last prefill requests end when their ACK arrives, just after the decode's events.
    let deadline = Instant::now() + std::time::Duration::from_secs(5);
    let mut pm = pair.prefill.metrics();
    let ended = |pm: &dsv4::engine::MetricsSnapshot| {
        pm.finished(Outcome::Transferred) + pair.prefill_errors.load(Ordering::Relaxed) as u64
    };
    while ended(&pm) < report.requests as u64 && Instant::now() < deadline {
        pair.poll_prefill(std::time::Duration::from_millis(20));
        pm = pair.prefill.metrics();
    }
    let dm = pair.decode.metrics();
    let prefill_errors = pair.prefill_errors.load(Ordering::Relaxed);
    println!("summary ({:.1} s):", report.wall.as_secs_f64());
    println!(
        "  requests        {} finished on the decode, {} errors ({} on the prefill); {} \
         TRANSFERRED on the prefill; {} submits refused at once (prefill queue full) and retried",
        report.requests,
        report.errors,
        prefill_errors,
        pm.finished(Outcome::Transferred),
        pm.rejected(Rejection::QueueFull)
    );
    let (p50, p99) = (
        quantile_ms(&report.ttft_us, 0.5),
        quantile_ms(&report.ttft_us, 0.99),
    );
    println!("  TTFT (decode)   p50 {p50:.1} ms   p99 {p99:.1} ms   (submit → first TOKEN event)");
    println!(
        "  ITL             p50 {:.1} ms   p99 {:.1} ms",
        quantile_ms(&report.itl_us, 0.5),
        quantile_ms(&report.itl_us, 0.99)
    );
    println!(
        "  rooms (claim → done includes the prefill computing a prompt claimed before it ran):"
    );
    for line in pd::room_lines("prefill", &pm)
        .into_iter()
        .chain(pd::room_lines("decode", &dm))
    {
        println!("    {line}");
    }
    let (u50, u99) = (
        quantile_ms(&unified.ttft_us, 0.5),
        quantile_ms(&unified.ttft_us, 0.99),
    );
    println!(
        "  vs unified      TTFT p50 {:.2}×, p99 {:.2}×; wall {:.2}× ({:.1} s vs {:.1} s); \
         generated tokens/s {:.2}×",
        p50 / u50,
        p99 / u99,
        report.wall.as_secs_f64() / unified.wall.as_secs_f64(),
        report.wall.as_secs_f64(),
        unified.wall.as_secs_f64(),
        report.tokens_per_s() / unified.tokens_per_s()
    );
    if let Some(e) = pair.first_prefill_error.lock().unwrap().as_ref() {
        println!("  first prefill error: {e}");
    }
    if report.errors > 0 || prefill_errors > 0 {
        return Err(Error::internal(format!(
            "PD: {} requests ended with an error on the decode, {prefill_errors} on the prefill",
            report.errors
        )));
    }
    Ok(())
}
