//! One PD engine (prefill or decode) in a process of its own, driven by a line protocol on
//! stdin/stdout: what tests/pd_processes.rs runs two of, to kill one mid-transfer.
//!
//!   pd_node --role prefill|decode --model DIR [--params JSON] [--peer tcp://host:port]
//!
//! `--params` is merged over `{"model_path": DIR, "role": ROLE, "pd": {"listen":
//! "tcp://127.0.0.1:0"}}`; `--peer` is the prefill a decode's requests continue.
//!
//! Out, first: `endpoint <url>`. In, one command a line:
//!   submit <room> <max_new> <tok,tok,...>   greedy, EOS suppressed (exactly max_new tokens)
//!       -> accepted <room> <request_id> | refused <room> <ErrorKind> <message>
//!   abort <room>   aborts the live request of that room (prints nothing: its `finished` or
//!       `error` line follows as usual) | refused <room> <ErrorKind> <message>
//!   usage   flushes the device cache -> usage pages=<n> slots=<n> snapshots=<n>
//!   metrics   the PD gauges -> metrics prefill_bootstrap=<n> prefill_inflight=<n>
//!       decode_prealloc=<n> decode_transfer=<n> pages_held=<n> early_claims=<n> peers=<n>
//!       transfers=<n> failures=<n> bytes=<n> rma_bytes=<n>   (kv_transfer requests, failures,
//!       bytes, and bytes written by RMA: totals)
//!   quit    (or end of input) aborts what is in flight and exits -> bye
//! Events, as they come: `token <room> <id>`, `finished <room> <reason>`,
//! `error <room> <ErrorKind> <message>`.
//!
//! `PD_NODE_LOG=warn|info|debug|trace` logs the library's records at that level and above to
//! stderr (`<elapsed ms> <LEVEL> <target>: <message>`).

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsv4::config::params::Params;
use dsv4::engine::{Engine, EventKind, RequestSpec, SamplingParams, ShutdownMode};
use dsv4::kv::cache::Tier;
use serde_json::{json, Value};

/// The library's log records on stderr, with the milliseconds since start.
struct StderrLog(std::time::Instant);

impl log::Log for StderrLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!(
                "{} {} {}: {}",
                self.0.elapsed().as_millis(),
                r.level(),
                r.target(),
                r.args().to_string().replace('\n', " ")
            );
        }
    }

    fn flush(&self) {}
}

fn main() {
    if let Ok(level) = std::env::var("PD_NODE_LOG") {
        if let Ok(level) = level.parse::<log::LevelFilter>() {
            let logger = Box::leak(Box::new(StderrLog(std::time::Instant::now())));
            if log::set_logger(logger).is_ok() {
                log::set_max_level(level);
            }
        }
    }
    if let Err(e) = run() {
        eprintln!("pd_node: {e}");
        std::process::exit(1);
    }
}

/// Whole lines on stdout, one writer at a time, flushed at once.
struct Out(Mutex<io::Stdout>);

impl Out {
    fn line(&self, text: &str) {
        let mut out = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Messages stay on their line.
        let _ = writeln!(out, "{}", text.replace('\n', " "));
        let _ = out.flush();
    }
}

struct Args {
    role: String,
    model: String,
    params: Value,
    peer: Option<String>,
}

fn args() -> Result<Args, String> {
    let usage = "usage: pd_node --role prefill|decode --model DIR [--params JSON] [--peer URL]";
    let (mut role, mut model, mut params, mut peer) = (None, None, json!({}), None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value; {usage}"))?;
        match flag.as_str() {
            "--role" => role = Some(value),
            "--model" => model = Some(value),
            "--params" => {
                params = serde_json::from_str(&value).map_err(|e| format!("--params: {e}"))?
            }
            "--peer" => peer = Some(value),
            _ => return Err(format!("unknown flag {flag}; {usage}")),
        }
    }
    Ok(Args {
        role: role.ok_or(usage)?,
        model: model.ok_or(usage)?,
        params,
        peer,
    })
}

fn merge(doc: &mut Value, extra: Value) {
    if let (Value::Object(d), Value::Object(e)) = (doc, extra) {
        for (k, v) in e {
            match d.get_mut(&k) {
                Some(slot @ Value::Object(_)) if v.is_object() => merge(slot, v),
                _ => {
                    d.insert(k, v);
                }
            }
        }
    }
}

/// Greedy with EOS (token 1) suppressed, like tests/pd_loopback.rs: the same spec on both
/// engines of a room, so their request digests agree.
fn spec(room: u64, max_new: u32, prompt: Vec<u32>, peer: Option<String>) -> RequestSpec {
    RequestSpec {
        prompt,
        max_new_tokens: max_new,
        logprobs: true,
        seed: 99,
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        pd_room: room,
        pd_peer: peer,
        ..RequestSpec::default()
    }
}

/// `Transferred`, not `Some(Transferred)`.
fn name(v: Option<impl std::fmt::Debug>) -> String {
    v.map_or("?".into(), |v| format!("{v:?}"))
}

fn num<T: std::str::FromStr>(s: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    s.parse().map_err(|e| format!("{s:?}: {e}"))
}

fn parse_submit(rest: &[&str]) -> Result<(u64, u32, Vec<u32>), String> {
    let [room, max_new, tokens] = rest else {
        return Err("submit <room> <max_new> <tok,tok,...>".into());
    };
    let prompt = tokens.split(',').map(num).collect::<Result<_, _>>()?;
    Ok((num(room)?, num(max_new)?, prompt))
}

fn run() -> Result<(), String> {
    let a = args()?;
    let mut doc =
        json!({"model_path": a.model, "role": a.role, "pd": {"listen": "tcp://127.0.0.1:0"}});
    merge(&mut doc, a.params);
    let params = Params::from_value(&doc).map_err(|e| format!("params: {e}"))?;
    let engine = Arc::new(Engine::create(params).map_err(|e| format!("engine: {e}"))?);
    let out = Arc::new(Out(Mutex::new(io::stdout())));
    out.line(&format!(
        "endpoint {}",
        engine.pd_endpoint().map_err(|e| e.to_string())?
    ));

    // Request id -> room. Held across submit, so the poller never sees an id before its room.
    let rooms: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let poller = {
        let (engine, out, rooms, stop) = (engine.clone(), out.clone(), rooms.clone(), stop.clone());
        std::thread::spawn(move || loop {
            let events = engine
                .poll(64, Some(Duration::from_millis(100)))
                .unwrap_or_default();
            if events.is_empty() && stop.load(Ordering::SeqCst) {
                return;
            }
            for e in events {
                let mut map = rooms.lock().unwrap_or_else(|e| e.into_inner());
                let room = map.get(&e.request_id()).copied().unwrap_or(0);
                if e.is_terminal() {
                    map.remove(&e.request_id());
                }
                drop(map);
                out.line(&match e.kind() {
                    EventKind::Token => format!("token {room} {}", e.token_id().unwrap_or(0)),
                    EventKind::Finished => format!("finished {room} {}", name(e.finish_reason())),
                    EventKind::Error => format!(
                        "error {room} {} {}",
                        name(e.error_kind()),
                        e.message().unwrap_or("")
                    ),
                });
            }
        })
    };

    for line in io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["submit", rest @ ..] => match parse_submit(rest) {
                Ok((room, max_new, prompt)) => {
                    let mut map = rooms.lock().unwrap_or_else(|e| e.into_inner());
                    match engine.submit(spec(room, max_new, prompt, a.peer.clone())) {
                        Ok(id) => {
                            map.insert(id, room);
                            out.line(&format!("accepted {room} {id}"));
                        }
                        Err(e) => out.line(&format!("refused {room} {:?} {e}", e.kind())),
                    }
                }
                Err(e) => out.line(&format!("refused 0 InvalidArgument {e}")),
            },
            ["abort", room] => {
                let room: u64 = match num(room) {
                    Ok(r) => r,
                    Err(e) => {
                        out.line(&format!("refused 0 InvalidArgument abort <room>: {e}"));
                        continue;
                    }
                };
                let id = rooms
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .iter()
                    .find_map(|(&id, &r)| (r == room).then_some(id));
                match id.map(|id| engine.abort(id)) {
                    Some(Ok(())) => {}
                    Some(Err(e)) => out.line(&format!("refused {room} {:?} {e}", e.kind())),
                    None => out.line(&format!(
                        "refused {room} NotFound no live request has room {room}"
                    )),
                }
            }
            ["metrics"] => {
                let m = engine.metrics();
                let g = m.pd;
                out.line(&format!(
                    "metrics prefill_bootstrap={} prefill_inflight={} decode_prealloc={} \
                     decode_transfer={} pages_held={} early_claims={} peers={} transfers={} \
                     failures={} bytes={} rma_bytes={}",
                    g.prefill_bootstrap,
                    g.prefill_inflight,
                    g.decode_prealloc,
                    g.decode_transfer,
                    g.pages_held,
                    g.early_claims,
                    g.peers,
                    m.kv_transfer.requests,
                    m.kv_transfer.failures,
                    m.kv_transfer.bytes,
                    m.kv_transfer.rma_bytes
                ));
            }
            ["usage"] => match engine.flush_cache(Tier::Device) {
                Ok(u) => out.line(&format!(
                    "usage pages={} slots={} snapshots={}",
                    u.pages, u.slots, u.snapshots
                )),
                Err(e) => out.line(&format!("error 0 {:?} {e}", e.kind())),
            },
            ["quit"] => break,
            [] => {}
            _ => out.line(&format!(
                "refused 0 InvalidArgument unknown command {line:?}"
            )),
        }
    }
    let down = engine.shutdown(ShutdownMode::Abort, Some(Duration::from_secs(10)));
    stop.store(true, Ordering::SeqCst);
    let _ = poller.join();
    down.map_err(|e| format!("shutdown: {e}"))?;
    out.line("bye");
    Ok(())
}
