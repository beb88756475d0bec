//! `make bench-ucx`: PD room transfer over the ucx transport against `ucx_perftest` (package
//! ucx-utils) and against the tcp transport, in one run.
//!
//! A prefill engine computes R rooms of one long prompt and holds them; the decode claims them
//! all at once (1 new token: landing the state ends the request) and the wall time from the
//! first decode submit to the last room landed is one round. Each round is run on five pairs:
//! ucx with state bytes written by RMA into the decode's pools (the default; checked: every
//! byte counts as RMA bytes), ucx with them sent as active messages (`pd.ucx_rma = false`),
//! tcp, and the two ucx pairs again between engines that authenticate (`pd.auth_key_file`). `ucx_perftest` moves the same bytes in the same 256 KiB pieces (wire::DATA_CHUNK)
//! between two processes over the same UCX transports, as puts (`ucp_put_bw`, the baseline of
//! the RMA pair) and as active messages (`ucp_am_bw`, that of the AM pair). Each ratio is the
//! median round's.
//!
//! UCX_TLS is the same for the engines and ucx_perftest: `--tls` (default `tcp`). Both engines
//! live in this one process, where UCX would otherwise pick shared memory between its two
//! workers; `tcp` measures the network path a prefill and a decode on two hosts take.
//!
//! Last line: `ratios ucx_rma_vs_put_perftest=… ucx_am_vs_am_perftest=… ucx_vs_tcp_transport=…
//! ucx_rma_auth_vs_plain=… ucx_am_auth_vs_plain=…` (the last two: the same transfers between
//! engines holding a `pd.auth_key_file`, against the pairs without; goal ≥ 0.9) (goal: ≥ 0.8
//! against perftest).
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

/// Seconds `ucx_perftest -t <test>` (`ucp_put_bw`, `ucp_am_bw`) takes to move `messages` puts or
/// active messages of `size` bytes between a server and a client process on loopback (its own measured loop, from its
/// "Final:" line's overall bandwidth; process start-up is not counted).
fn perftest(test: &str, messages: usize, size: usize) -> f64 {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let args = |extra: &[&str]| {
        let mut v: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        v.extend(
            [
                "-t",
                test,
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
    let (rma, am, tcp) = (pair_on("ucx"), pair_on("ucx-am"), pair_on("tcp"));
    let (rma_auth, am_auth) = (pair_on("ucx-auth"), pair_on("ucx-am-auth"));
    let vocab = rma.prefill.vocab_size() as u32;
    let mut rng = fastrand::Rng::with_seed(3);
    let prompt = random_prompt(&mut rng, vocab, long);
    let mut next = 1u64;
    // Warm-up on each: the prompt into each prefill's cache, the links open, the decodes'
    // destination pages touched once.
    // One room first: the rooms of a round then hit the prefix cache instead of all computing
    // the prompt at once.
    let mut warm = KvTransfer::default();
    for pair in [&rma, &am, &tcp, &rma_auth, &am_auth] {
        round(pair, &prompt, 1, &mut next, &mut KvTransfer::default());
        round(pair, &prompt, rooms, &mut next, &mut warm);
    }
    let room_bytes = (warm.bytes / warm.requests) as usize;
    let messages = (rooms * room_bytes).div_ceil(DATA_CHUNK);
    perftest("ucp_put_bw", messages, DATA_CHUNK);
    perftest("ucp_am_bw", messages, DATA_CHUNK);

    // Per round: seconds of the rma, am and tcp pairs, then of ucp_put_bw and ucp_am_bw,
    // then of the authenticated rma and am pairs.
    let mut t: Vec<[f64; 7]> = Vec::new();
    let mut d = [KvTransfer::default(); 5];
    for _ in 0..rounds {
        let r = round(&rma, &prompt, rooms, &mut next, &mut d[0]);
        let a = round(&am, &prompt, rooms, &mut next, &mut d[1]);
        let c = round(&tcp, &prompt, rooms, &mut next, &mut d[2]);
        let put = perftest("ucp_put_bw", messages, DATA_CHUNK);
        let amp = perftest("ucp_am_bw", messages, DATA_CHUNK);
        let ra = round(&rma_auth, &prompt, rooms, &mut next, &mut d[3]);
        let aa = round(&am_auth, &prompt, rooms, &mut next, &mut d[4]);
        t.push([r, a, c, put, amp, ra, aa]);
    }
    for (i, what) in [(0, "rma"), (3, "authenticated rma")] {
        assert_eq!(
            d[i].rma_bytes, d[i].bytes,
            "the {what} pair writes every byte by RMA"
        );
    }
    for (i, what) in [(1, "am"), (4, "authenticated am")] {
        assert_eq!(d[i].rma_bytes, 0, "the {what} pair writes nothing by RMA");
    }
    // The median round's ratio of column `base` to column `of` (> 1: `of` is faster).
    let ratio = |of: usize, base: usize| {
        let mut r: Vec<f64> = t.iter().map(|x| x[base] / x[of]).collect();
        let listed = r
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(", ");
        (agentic::quantile(&mut r, 0.5), listed)
    };
    let median_ms = |col: usize| {
        let mut v: Vec<f64> = t.iter().map(|x| x[col] * 1e3).collect();
        agentic::quantile(&mut v, 0.5)
    };
    let mb = (rooms * room_bytes) as f64;
    println!(
        "bench_ucx: tiny model, 2 threads per engine, UCX_TLS={tls}, {} cores; {rounds} rounds of \
         {rooms} rooms of a {long}-token prompt claimed at once ({:.0} KiB per room, {:.1} MiB a \
         round); median round",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        room_bytes as f64 / 1024.0,
        mb / 1048576.0
    );
    let line = |name: &str, col: usize| {
        let ms = median_ms(col);
        println!("  {name:<28} {ms:7.2} ms  {:7.3} GB/s", mb / ms / 1e6);
    };
    line("PD over ucx, RMA", 0);
    line("PD over ucx, active messages", 1);
    line("PD over tcp", 2);
    line("ucx_perftest ucp_put_bw", 3);
    line("ucx_perftest ucp_am_bw", 4);
    line("PD over ucx, RMA, with a key", 5);
    line("PD over ucx, AM, with a key", 6);
    println!(
        "  ({messages} puts / messages of {} KiB a round, two processes)",
        DATA_CHUNK / 1024
    );
    let (rma_vs_put, l1) = ratio(0, 3);
    let (am_vs_am, l2) = ratio(1, 4);
    let (vs_tcp, l3) = ratio(0, 2);
    println!("  ucx RMA vs ucp_put_bw: {rma_vs_put:.2}× (rounds: {l1}; goal ≥ 0.8)");
    println!("  ucx AM vs ucp_am_bw:   {am_vs_am:.2}× (rounds: {l2}; goal ≥ 0.8)");
    let (rma_auth_vs_plain, l4) = ratio(5, 0);
    let (am_auth_vs_plain, l5) = ratio(6, 1);
    println!("  ucx RMA vs tcp transport: {vs_tcp:.2}× (rounds: {l3})");
    println!("  ucx RMA with a key vs without: {rma_auth_vs_plain:.2}× (rounds: {l4}; goal ≥ 0.9)");
    println!("  ucx AM with a key vs without:  {am_auth_vs_plain:.2}× (rounds: {l5}; goal ≥ 0.9)");
    println!(
        "ratios ucx_rma_vs_put_perftest={rma_vs_put:.2} ucx_am_vs_am_perftest={am_vs_am:.2} \
         ucx_vs_tcp_transport={vs_tcp:.2} ucx_rma_auth_vs_plain={rma_auth_vs_plain:.2} \
         ucx_am_auth_vs_plain={am_auth_vs_plain:.2}"
    );
}
