//! Prefill/decode over TCP loopback against the same work on one unified engine, and the
//! transferred state bytes against raw TCP, all in this process:
//!
//! 1. a unified engine runs R requests (fresh random prompts of P tokens, 4 tokens each);
//! 2. a prefill and a decode engine run the same requests, each through a room;
//! 3. the state bytes the pair moved are sent once more over a bare loopback socket.
//!
//! Prints wall times, the pair's overhead ratio (the two engines share this machine's cores,
//! so the ratio is an upper bound of what the split costs), the bytes per request, and the
//! transfer throughput against raw TCP's.
//!
//!   cargo run --release --example bench_pd [-- --requests 32 --prompt 1024]

#[allow(dead_code)]
#[path = "common/agentic.rs"]
mod agentic;

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use dsv4::config::params::Params;
use dsv4::engine::{Engine, FinishReason, RequestSpec, SamplingParams};
use serde_json::json;

fn engine(dir: &str, role: &str) -> Engine {
    let mut doc = json!({
        "model_path": dir, "threads": 2, "role": role,
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": "64MiB", "max_running_requests": 8},
        "scheduler": {"chunked_prefill_tokens": 2048, "max_batch_tokens": 4096},
        "admission": {"max_queued_requests": 4096, "max_queued_tokens": 1u64 << 40,
                      "queue_timeout_ms": 0},
    });
    if role != "unified" {
        doc["pd"] = json!({"listen": "tcp://127.0.0.1:0"});
    }
    Engine::create(Params::from_value(&doc).expect("valid params")).expect("engine")
}

fn specs(n: usize, prompt: usize, vocab: u32) -> Vec<RequestSpec> {
    let mut rng = fastrand::Rng::with_seed(7);
    (0..n)
        .map(|_| RequestSpec {
            prompt: (0..prompt).map(|_| rng.u32(16..vocab)).collect(),
            max_new_tokens: 4,
            sampling: SamplingParams {
                temperature: 0.0,
                logit_bias: vec![(1, -1000.0)],
                ..SamplingParams::default()
            },
            ..RequestSpec::default()
        })
        .collect()
}

/// Waits for the terminal events of `ids`; returns how many ended with `want`.
fn wait(engine: &Engine, ids: &[u64], want: FinishReason) -> usize {
    let mut left: HashSet<u64> = ids.iter().copied().collect();
    let mut good = 0;
    while !left.is_empty() {
        for e in engine.poll(256, Some(Duration::from_millis(50))).unwrap() {
            if e.is_terminal() && left.remove(&e.request_id()) && e.finish_reason() == Some(want) {
                good += 1;
            }
        }
    }
    good
}

/// Seconds to move `bytes` over a loopback socket in 256 KiB writes.
fn raw_tcp(bytes: usize) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < bytes {
            got += s.read(&mut buf).unwrap();
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let chunk = vec![7u8; 256 << 10];
    let start = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        s.write_all(&chunk[..n]).unwrap();
        sent += n;
    }
    reader.join().unwrap();
    start.elapsed().as_secs_f64()
}

fn main() {
    let requests = agentic::arg("--requests", 32.0) as usize;
    let prompt = agentic::arg("--prompt", 1024.0) as usize;
    let (dir, _) = agentic::tiny_model().expect("the tiny checkpoint");
    let dir = dir.to_str().unwrap().to_string();

    let unified = engine(&dir, "unified");
    let vocab = unified.vocab_size() as u32;
    let work = specs(requests, prompt, vocab);
    let start = Instant::now();
    let ids: Vec<u64> = work
        .iter()
        .map(|s| unified.submit(s.clone()).unwrap())
        .collect();
    assert_eq!(wait(&unified, &ids, FinishReason::Length), requests);
    let t_unified = start.elapsed().as_secs_f64();
    drop(unified);

    let p = engine(&dir, "prefill");
    let d = engine(&dir, "decode");
    let peer = p.pd_endpoint().unwrap();
    let start = Instant::now();
    let mut pids = Vec::new();
    let mut dids = Vec::new();
    for (i, s) in work.iter().enumerate() {
        let room = i as u64 + 1;
        let mut on_d = s.clone();
        on_d.pd_room = room;
        on_d.pd_peer = Some(peer.clone());
        dids.push(d.submit(on_d).unwrap());
        let mut on_p = s.clone();
        on_p.pd_room = room;
        pids.push(p.submit(on_p).unwrap());
    }
    assert_eq!(wait(&d, &dids, FinishReason::Length), requests);
    let t_pd = start.elapsed().as_secs_f64();
    assert_eq!(wait(&p, &pids, FinishReason::Transferred), requests);
    let m = d.metrics();
    let bytes = m.kv_transfer.bytes as usize;
    let t_raw = raw_tcp(bytes);

    println!("bench_pd: {requests} requests, {prompt}-token prompts, 4 tokens each (tiny model)");
    println!("  unified engine       {t_unified:8.3} s");
    println!(
        "  prefill + decode     {t_pd:8.3} s   ratio {:.2} (both engines share this machine)",
        t_pd / t_unified
    );
    println!(
        "  state transferred    {:.1} MiB ({:.0} KiB per request), {} failures",
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 / requests as f64 / 1024.0,
        m.kv_transfer.failures
    );
    println!(
        "  raw TCP, same bytes  {t_raw:8.4} s   ({:.2} GB/s)",
        bytes as f64 / t_raw / 1e9
    );
    println!(
        "  claim → done, mean   {:8.2} ms per room (includes the prefill computing it)",
        m.kv_transfer.seconds / requests as f64 * 1e3
    );
}
