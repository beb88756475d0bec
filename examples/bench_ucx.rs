//! `make bench-ucx`: PD room transfer over the ucx transport against `ucx_perftest` (package
//! ucx-utils) and against the tcp transport, in one run.
//!
//! A prefill engine computes R rooms of one long prompt and holds them; the decode claims them
//! all at once (1 new token: landing the state ends the request) and the wall time from the
//! first decode submit to the last room landed is one round. Each round is run on a ucx pair
//! and on a tcp pair, and `ucx_perftest -t ucp_put_bw` moves the same bytes as RMA puts of the
//! same size (wire::DATA_CHUNK, 256 KiB: one DATA frame's worth each) between two processes over
//! the same UCX transports — over UCX the engines write each room's state by RMA straight into
//! the decode's pools (checked: every byte counts as RMA bytes). Each ratio is the median
//! round's.
//!
//! UCX_TLS is the same for the engines and ucx_perftest: `--tls` (default `tcp`). Both engines
//! live in this one process, where UCX would otherwise pick shared memory between its two
//! workers; `tcp` measures the network path a prefill and a decode on two hosts take.
//!
//! Last line: `ratios ucx_vs_perftest=… ucx_vs_tcp_transport=…` (goal: ucx_vs_perftest ≥ 0.8).
//!
//!   cargo run --release --example bench_ucx [-- --rooms 32 --prompt 8000 --rounds 9 --tls tcp]

#[allow(dead_code)]
#[path = "common/agentic.rs"]
mod agentic;
#[allow(dead_code)]
#[path = "common/pd.rs"]
mod pd;
#[allow(dead_code)]
#[path = "common/rooms.rs"]
mod rooms;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsv4::engine::KvTransfer;
use dsv4::pd::wire::DATA_CHUNK;
use pd::Pair;
use rooms::*;

/// Seconds `ucx_perftest -t ucp_put_bw` takes to move `messages` puts of `size`
/// bytes between a server and a client process on loopback (its own measured loop, from its
/// "Final:" line's overall bandwidth; process start-up is not counted).
fn perftest(messages: usize, size: usize) -> f64 {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let args = |extra: &[&str]| {
        let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        v.extend(
            [
                "-t",
                "ucp_put_bw",
                "-s",
                &size.to_string(),
                "-n",
                &messages.to_string(),
                "-w",
                "16",
                "-p",
                &port.to_string(),
            ]
            .map(String::from),
        );
        v
    };
    let mut server = Command::new("ucx_perftest")
        .args(args(&[]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("ucx_perftest (package ucx-utils: make deps installs it)");
    let deadline = Instant::now() + Duration::from_secs(20);
    let out = loop {
        let out = Command::new("ucx_perftest")
            .args(args(&["127.0.0.1"]))
            .output()
            .expect("ucx_perftest client");
        if out.status.success() {
            break out;
        }
        // The server is not listening yet: try again.
        assert!(
            Instant::now() < deadline,
            "ucx_perftest failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("Final:"))
        .unwrap_or_else(|| panic!("no Final: line in ucx_perftest's output:\n{text}"));
    // Final: iterations, overhead 50%ile, average, overall (µs), bandwidth average, overall
    // (MiB/s), message rate average, overall.
    let fields: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let mib_s = fields[5];
    (messages * size) as f64 / (mib_s * 1048576.0)
}

/// One round on `pair`: `rooms` rooms computed, then claimed at once; the wall seconds.
fn round(pair: &Pair, prompt: &[u32], rooms: usize, next: &mut u64, sum: &mut KvTransfer) -> f64 {
    let peer = pair.prefill.pd_endpoint().unwrap();
    let ids = prefill_rooms(pair, prompt, rooms, next);
    let (wall, d) = at_once(pair, prompt, &ids, &peer);
    assert_eq!(d.failures, 0, "a room failed");
    add(sum, d);
    wall
}

fn main() {
    let rooms = agentic::arg("--rooms", 32.0) as usize;
    let long = agentic::arg("--prompt", 8000.0) as usize;
    let rounds = agentic::arg("--rounds", 9.0) as usize;
    let tls = std::env::args()
        .skip_while(|a| a != "--tls")
        .nth(1)
        .unwrap_or_else(|| "tcp".into());
    // Before any UCX context exists in this process (and inherited by ucx_perftest).
    std::env::set_var("UCX_TLS", &tls);
    let (dir, _) = agentic::tiny_model().expect("the tiny checkpoint");
    let dir = dir.to_str().unwrap().to_string();
    let running = rooms.max(8) as u32;
    let pair_on = |t: &str| {
        Pair::new(
            engine(&dir, "prefill", t, running, "256MiB", 4096),
            engine(&dir, "decode", t, running, "256MiB", 4096),
        )
        .expect("pair")
    };
    let (ucx, tcp) = (pair_on("ucx"), pair_on("tcp"));
    let vocab = ucx.prefill.vocab_size() as u32;
    let mut rng = fastrand::Rng::with_seed(3);
    let prompt = random_prompt(&mut rng, vocab, long);
    let mut next = 1u64;
    // Warm-up on both: the prompt into each prefill's cache, the links open, the decodes'
    // destination pages touched once.
    // One room first: the rooms of a round then hit the prefix cache instead of all computing
    // the prompt at once.
    let mut warm = KvTransfer::default();
    for pair in [&ucx, &tcp] {
        round(pair, &prompt, 1, &mut next, &mut KvTransfer::default());
        round(pair, &prompt, rooms, &mut next, &mut warm);
    }
    let room_bytes = (warm.bytes / warm.requests) as usize;
    let messages = (rooms * room_bytes).div_ceil(DATA_CHUNK);
    perftest(messages, DATA_CHUNK);

    let (mut vs_perf, mut vs_tcp) = (Vec::new(), Vec::new());
    let (mut t_ucx, mut t_tcp, mut t_perf) = (0.0, 0.0, 0.0);
    let (mut d_ucx, mut d_tcp) = (KvTransfer::default(), KvTransfer::default());
    for _ in 0..rounds {
        let u = round(&ucx, &prompt, rooms, &mut next, &mut d_ucx);
        let t = round(&tcp, &prompt, rooms, &mut next, &mut d_tcp);
        let p = perftest(messages, DATA_CHUNK);
        vs_perf.push(p / u);
        vs_tcp.push(t / u);
        (t_ucx, t_tcp, t_perf) = (t_ucx + u, t_tcp + t, t_perf + p);
    }
    assert_eq!(
        d_ucx.rma_bytes, d_ucx.bytes,
        "over ucx every byte is written by RMA"
    );
    let listed = |r: &[f64]| {
        r.iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (perf_list, tcp_list) = (listed(&vs_perf), listed(&vs_tcp));
    let ucx_vs_perftest = agentic::quantile(&mut vs_perf, 0.5);
    let ucx_vs_tcp = agentic::quantile(&mut vs_tcp, 0.5);
    let per_round = |t: f64| 1e3 * t / rounds as f64;
    let bytes = (messages * DATA_CHUNK) as u64 * rounds as u64;
    println!(
        "bench_ucx: tiny model, 2 threads per engine, UCX_TLS={tls}, {} cores; {rounds} rounds of \
         {rooms} rooms of a {long}-token prompt claimed at once ({:.0} KiB per room, {:.1} MiB a \
         round)",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        room_bytes as f64 / 1024.0,
        (rooms * room_bytes) as f64 / 1048576.0
    );
    println!(
        "  PD over ucx            {:7.2} ms a round  {:7.3} GB/s",
        per_round(t_ucx),
        pd::gbps(d_ucx.bytes, t_ucx)
    );
    println!(
        "  PD over tcp            {:7.2} ms a round  {:7.3} GB/s",
        per_round(t_tcp),
        pd::gbps(d_tcp.bytes, t_tcp)
    );
    println!(
        "  ucx_perftest ucp_put_bw {:6.2} ms a round  {:7.3} GB/s   ({messages} puts of {} KiB \
         a round, two processes)",
        per_round(t_perf),
        pd::gbps(bytes, t_perf),
        DATA_CHUNK / 1024
    );
    println!("  ucx vs ucx_perftest: {ucx_vs_perftest:.2}× (rounds: {perf_list}; goal ≥ 0.8)");
    println!("  ucx vs tcp transport: {ucx_vs_tcp:.2}× (rounds: {tcp_list})");
    println!("ratios ucx_vs_perftest={ucx_vs_perftest:.2} ucx_vs_tcp_transport={ucx_vs_tcp:.2}");
}
