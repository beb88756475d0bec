//! Rooms for the transfer benchmarks (`bench_transfer`, `bench_ucx`): engines of the tiny
//! model, prompts, prefill rooms computed and held, claims, and waiting for rooms to land.

use std::time::{Duration, Instant};

use dsv4::config::params::Params;
use dsv4::engine::{Engine, FinishReason, KvTransfer, Outcome, RequestSpec, SamplingParams};
use serde_json::json;

use super::pd::Pair;

/// An engine of the tiny model in `role`, PD over `transport` ("tcp" or "ucx").
pub fn engine(
    dir: &str,
    role: &str,
    transport: &str,
    running: u32,
    device: &str,
    max_queued: u32,
) -> Engine {
    let mut doc = json!({
        "model_path": dir, "threads": 2, "role": role,
        "kv": {"dtype": "fp8", "indexer_dtype": "fp4", "page_size": 128,
               "device_memory_bytes": device, "max_running_requests": running,
               "prefault": prefault()},
        "scheduler": {"chunked_prefill_tokens": 2048, "max_batch_tokens": 4096},
        "admission": {"max_queued_requests": max_queued, "queue_timeout_ms": 0},
    });
    if role != "unified" {
        // `ucx-am`: UCX with state bytes as active messages (`pd.ucx_rma = false`); `ucx`:
        // by RMA, even where UCX emulates puts with messages (its tcp transport); `-auth`
        // after any of them: between engines that authenticate (`pd.auth_key_file`; every
        // frame MACed, and an RMA-written room's bytes by the MAC in its DONE); `tcp-tls`:
        // TCP in TLS (`pd.tls`, the test certificates of tests/fixtures/tls) between engines
        // that also authenticate, bound to the session.
        let tls = transport.ends_with("-tls");
        let auth = transport.ends_with("-auth") || tls;
        let (transport, rma) = match transport.trim_end_matches("-auth").trim_end_matches("-tls") {
            "ucx-am" => ("ucx", false),
            t => (t, true),
        };
        doc["pd"] = json!({"transport": transport, "ucx_rma": rma, "ucx_rma_emulated": rma,
                           "listen": format!("{transport}://127.0.0.1:0")});
        if auth {
            doc["pd"]["auth_key_file"] = json!(bench_key_file());
        }
        if tls {
            let fixture =
                |f: &str| format!("{}/tests/fixtures/tls/{f}", env!("CARGO_MANIFEST_DIR"));
            doc["pd"]["tls"] = json!(true);
            if role == "prefill" {
                doc["pd"]["tls_cert_file"] = json!(fixture("prefill.pem"));
                doc["pd"]["tls_key_file"] = json!(fixture("prefill.key"));
            } else {
                doc["pd"]["tls_ca_file"] = json!(fixture("ca.pem"));
            }
        }
    }
    Engine::create(Params::from_value(&doc).expect("valid params")).expect("engine")
}

/// A key file both engines of an authenticating pair read (a fresh secret per process).
pub fn bench_key_file() -> String {
    let path = std::env::temp_dir().join(format!("dsv4-bench-{}.key", std::process::id()));
    if !path.exists() {
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", fastrand::u8(..)))
            .collect();
        std::fs::write(&path, secret + "\n").expect("write the bench's key file");
    }
    path.to_str().expect("a UTF-8 temp dir").to_string()
}

/// Whether the engines run with `kv.prefault`: the pools resident from the start, as a serving
/// engine runs them (lazily mapped, a room's first bytes into never used pages pay page
/// faults); `--prefault 0` measures lazy pools.
pub fn prefault() -> bool {
    super::agentic::arg("--prefault", 1.0) > 0.0
}

/// Greedy, EOS suppressed: every request costs the same.
pub fn spec(prompt: Vec<u32>, max_new: u32) -> RequestSpec {
    RequestSpec {
        prompt,
        max_new_tokens: max_new,
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    }
}

pub fn random_prompt(rng: &mut fastrand::Rng, vocab: u32, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.u32(16..vocab)).collect()
}

/// Polls the decode until `n` of its requests ended (draining the prefill too); how many ended
/// with `Length`.
pub fn wait_decode(pair: &Pair, n: usize) -> usize {
    let (mut ended, mut good) = (0, 0);
    while ended < n {
        pair.poll_prefill(Duration::ZERO);
        for e in pair
            .decode
            .poll(256, Some(Duration::from_millis(20)))
            .unwrap()
        {
            if e.is_terminal() {
                ended += 1;
                good += usize::from(e.finish_reason() == Some(FinishReason::Length));
            }
        }
    }
    good
}

/// Waits until the prefill's TRANSFERRED count reaches `n`.
pub fn wait_transferred(pair: &Pair, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while pair.prefill.metrics().finished(Outcome::Transferred) < n {
        assert!(Instant::now() < deadline, "prefill rooms never ended");
        pair.poll_prefill(Duration::from_millis(10));
    }
}

/// Submits `rooms` prefill requests of `prompt` and waits until each has computed its state
/// and holds its pages, waiting for its claim. Room ids continue `next`.
pub fn prefill_rooms(pair: &Pair, prompt: &[u32], rooms: usize, next: &mut u64) -> Vec<u64> {
    // Rooms transferred before release their pages once the gauges refresh: wait for none.
    let deadline = Instant::now() + Duration::from_secs(30);
    while pair.prefill.metrics().pd.pages_held > 0 {
        assert!(Instant::now() < deadline, "earlier rooms still hold pages");
        pair.poll_prefill(Duration::from_millis(5));
    }
    let ids: Vec<u64> = (0..rooms)
        .map(|_| {
            let mut s = spec(prompt.to_vec(), 1);
            s.pd_room = *next;
            *next += 1;
            s.pd_room
        })
        .collect();
    for &room in &ids {
        let mut s = spec(prompt.to_vec(), 1);
        s.pd_room = room;
        pair.prefill.submit(s).expect("prefill submit");
    }
    // A computed room holds its prompt's pages (pd_pages_held); the count settles when all are.
    let want = (rooms * prompt.len().div_ceil(128)) as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    while pair.prefill.metrics().pd.pages_held < want {
        assert!(
            Instant::now() < deadline,
            "prefill rooms not computed: {} of {want} pages held",
            pair.prefill.metrics().pd.pages_held
        );
        pair.poll_prefill(Duration::from_millis(10));
    }
    ids
}

/// The decode's twin of prefill room `room`.
pub fn claim(pair: &Pair, prompt: &[u32], room: u64, peer: &str) -> u64 {
    let mut s = spec(prompt.to_vec(), 1);
    s.pd_room = room;
    s.pd_peer = Some(peer.to_string());
    pair.decode.submit(s).expect("decode submit")
}

pub fn delta(after: KvTransfer, before: KvTransfer) -> KvTransfer {
    KvTransfer {
        requests: after.requests - before.requests,
        bytes: after.bytes - before.bytes,
        seconds: after.seconds - before.seconds,
        failures: after.failures - before.failures,
        early_bytes: after.early_bytes - before.early_bytes,
        rma_bytes: after.rma_bytes - before.rma_bytes,
    }
}

pub fn add(sum: &mut KvTransfer, x: KvTransfer) {
    sum.requests += x.requests;
    sum.bytes += x.bytes;
    sum.seconds += x.seconds;
    sum.failures += x.failures;
    sum.early_bytes += x.early_bytes;
    sum.rma_bytes += x.rma_bytes;
}

/// Claims the computed rooms `ids` all at once: the wall seconds from the first decode submit
/// to the last room landed, and the decode's counter delta.
pub fn at_once(pair: &Pair, prompt: &[u32], ids: &[u64], peer: &str) -> (f64, KvTransfer) {
    let (d0, done0) = (
        pair.decode.metrics().kv_transfer,
        pair.prefill.metrics().finished(Outcome::Transferred),
    );
    let start = Instant::now();
    for &room in ids {
        claim(pair, prompt, room, peer);
    }
    assert_eq!(wait_decode(pair, ids.len()), ids.len(), "a room failed");
    let wall = start.elapsed().as_secs_f64();
    wait_transferred(pair, done0 + ids.len() as u64);
    (wall, delta(pair.decode.metrics().kv_transfer, d0))
}
