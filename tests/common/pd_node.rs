//! Engine processes of examples/pd_node.rs, driven over its stdin/stdout line protocol:
//! what tests/pd_processes.rs runs on loopback and tests/pd_netns.rs runs in two network
//! namespaces. The binary is the one `cargo test` builds with the examples
//! (target/<profile>/examples/pd_node, next to the test's deps/ directory); a test fails when
//! it is missing.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::requests::merge;
use serde_json::{json, Value};

/// The tests take turns: each runs two engine processes on a small machine, and the
/// heartbeat deadlines they check should not measure each other's load.
pub static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What every engine here runs with (the pools of tests/common/requests.rs's `engine_with`).
pub fn base() -> Value {
    json!({
        "threads": 2,
        "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 16, "page_size": 128},
        "scheduler": {"chunked_prefill_tokens": 64},
    })
}

pub fn with(extra: Value) -> Value {
    let mut doc = base();
    merge(&mut doc, extra);
    doc
}

/// [`with`] `extra`, PD over `transport` ("tcp" or "ucx") on a free loopback port.
pub fn over(transport: &str, extra: Value) -> Value {
    let mut doc = with(extra);
    super::requests::merge(
        &mut doc,
        serde_json::json!({"pd": {"transport": transport,
                                  "listen": format!("{transport}://127.0.0.1:0")}}),
    );
    doc
}

pub fn pd_node_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    // target/<profile>/deps/pd_processes-<hash> -> target/<profile>/examples/pd_node
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test executable sits in target/<profile>/deps")
        .join("examples")
        .join(format!("pd_node{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "{} is missing: these tests run the pd_node example, which `cargo test` builds with \
         the examples; run `cargo build --example pd_node` (same profile and target dir) first",
        bin.display()
    );
    bin
}

/// One engine process. Dropping it kills the process (a failing test leaves none behind).
pub struct Node {
    pub name: &'static str,
    pub child: Child,
    pub stdin: ChildStdin,
    pub lines: Receiver<String>,
    /// Every stdout line read so far (stderr lines prefixed `stderr:`), in order.
    pub seen: Vec<String>,
    pub endpoint: String,
}

impl Node {
    pub fn start(name: &'static str, role: &str, params: Value, peer: Option<&str>) -> Node {
        Self::start_in(None, &[], name, role, params, peer)
    }

    /// [`Self::start`] inside network namespace `netns` (`ip netns exec`, which execs the
    /// binary: the child's pid is the engine's, for the kill tests), with `env` set.
    pub fn start_in(
        netns: Option<&str>,
        env: &[(&str, &str)],
        name: &'static str,
        role: &str,
        params: Value,
        peer: Option<&str>,
    ) -> Node {
        let mut cmd = match netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(pd_node_binary());
                c
            }
            None => Command::new(pd_node_binary()),
        };
        cmd.envs(env.iter().copied());
        cmd.args(["--role", role, "--model"])
            .arg(super::fixture("flash-like/hf-f32"))
            .args(["--params", &params.to_string()]);
        if let Some(p) = peer {
            cmd.args(["--peer", p]);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pd_node");
        let (tx, lines) = channel();
        let forward = |stream: Box<dyn Read + Send>, prefix: &'static str| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(format!("{prefix}{line}")).is_err() {
                        return;
                    }
                }
            });
        };
        forward(Box::new(child.stdout.take().unwrap()), "");
        forward(Box::new(child.stderr.take().unwrap()), "stderr: ");
        let stdin = child.stdin.take().unwrap();
        let mut node = Node {
            name,
            child,
            stdin,
            lines,
            seen: Vec::new(),
            endpoint: String::new(),
        };
        let line = node.wait_line(Duration::from_secs(20), |l| l.starts_with("endpoint "));
        node.endpoint = line["endpoint ".len()..].to_string();
        node
    }

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    pub fn send(&mut self, command: &str) {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .unwrap_or_else(|e| panic!("{}: cannot send {command:?}: {e}", self.name));
    }

    /// Reads lines until `done` holds over every line seen so far; fails after `timeout`.
    pub fn wait_until(&mut self, timeout: Duration, what: &str, done: impl Fn(&[String]) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(&self.seen) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(e) => panic!(
                    "{}: {what}: {} after {timeout:?}; its output:\n{}",
                    self.name,
                    match e {
                        RecvTimeoutError::Timeout => "still not there",
                        RecvTimeoutError::Disconnected => "the process exited",
                    },
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// The first line (seen before or read now) matching `want`.
    pub fn wait_line(&mut self, timeout: Duration, want: impl Fn(&str) -> bool) -> String {
        self.wait_until(timeout, "a line", |seen| seen.iter().any(|l| want(l)));
        self.seen.iter().find(|l| want(l)).unwrap().clone()
    }

    /// Submits room `room` and waits for it to be accepted.
    pub fn submit(&mut self, room: u64, max_new: u32, prompt: &[u32]) {
        let tokens: Vec<String> = prompt.iter().map(u32::to_string).collect();
        self.send(&format!("submit {room} {max_new} {}", tokens.join(",")));
        let (ok, no) = (format!("accepted {room} "), format!("refused {room} "));
        let line = self.wait_line(Duration::from_secs(10), |l| {
            l.starts_with(&ok) || l.starts_with(&no)
        });
        assert!(line.starts_with(&ok), "{}: {line}", self.name);
    }

    /// The room's terminal line (`finished <room> ...` or `error <room> ...`), if seen.
    pub fn end_of(&self, room: u64) -> Option<&String> {
        let (f, e) = (format!("finished {room} "), format!("error {room} "));
        self.seen
            .iter()
            .find(|l| l.starts_with(&f) || l.starts_with(&e))
    }

    pub fn wait_ends(&mut self, rooms: &[u64], timeout: Duration) {
        let rooms = rooms.to_vec();
        self.wait_until(timeout, &format!("the ends of rooms {rooms:?}"), |seen| {
            rooms.iter().all(|r| {
                let (f, e) = (format!("finished {r} "), format!("error {r} "));
                seen.iter().any(|l| l.starts_with(&f) || l.starts_with(&e))
            })
        });
    }

    pub fn tokens(&self, room: u64) -> Vec<u32> {
        let head = format!("token {room} ");
        self.seen
            .iter()
            .filter_map(|l| l.strip_prefix(&head))
            .map(|t| t.parse().unwrap())
            .collect()
    }

    /// `(pages, slots)` in use after flushing the device cache.
    pub fn usage(&mut self) -> (usize, usize) {
        let before = self.seen.len();
        self.send("usage");
        self.wait_until(Duration::from_secs(10), "usage", |seen| {
            seen[before..].iter().any(|l| l.starts_with("usage "))
        });
        let line = self.seen[before..]
            .iter()
            .find(|l| l.starts_with("usage "))
            .unwrap();
        let field = |key: &str| -> usize {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        };
        (field("pages="), field("slots="))
    }

    /// Freezes the process (SIGSTOP): it holds its connections open and answers nothing.
    pub fn stop(&self) {
        let status = Command::new("kill")
            .args(["-STOP", &self.pid()])
            .status()
            .expect("run kill -STOP");
        assert!(status.success(), "kill -STOP {}", self.pid());
    }

    /// Thaws a process frozen by [`Self::stop`] (SIGCONT).
    pub fn cont(&self) {
        let status = Command::new("kill")
            .args(["-CONT", &self.pid()])
            .status()
            .expect("run kill -CONT");
        assert!(status.success(), "kill -CONT {}", self.pid());
    }

    /// `abort <room>`: aborts the room's live request (its end line follows as usual).
    pub fn abort(&mut self, room: u64) {
        self.send(&format!("abort {room}"));
    }

    /// The PD gauges (`metrics` command), by name.
    pub fn metrics(&mut self) -> HashMap<String, u64> {
        let before = self.seen.len();
        self.send("metrics");
        self.wait_until(Duration::from_secs(10), "metrics", |seen| {
            seen[before..].iter().any(|l| l.starts_with("metrics "))
        });
        let line = self.seen[before..]
            .iter()
            .find(|l| l.starts_with("metrics "))
            .unwrap();
        line.split_whitespace()
            .skip(1)
            .map(|kv| {
                let (k, v) = kv
                    .split_once('=')
                    .unwrap_or_else(|| panic!("{line:?}: {kv:?} is not key=value"));
                (k.to_string(), v.parse().unwrap())
            })
            .collect()
    }

    /// Polls the PD gauges until `done` holds; fails after `timeout`.
    pub fn wait_metrics(
        &mut self,
        timeout: Duration,
        what: &str,
        done: impl Fn(&HashMap<String, u64>) -> bool,
    ) -> HashMap<String, u64> {
        let deadline = Instant::now() + timeout;
        loop {
            let m = self.metrics();
            if done(&m) {
                return m;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {what}: not after {timeout:?}; metrics {m:?}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and waits for the process to be gone.
    pub fn kill(&mut self) {
        self.child.kill().expect("kill -9");
        self.child.wait().expect("reap");
    }

    /// `quit`, and waits (bounded) for a clean exit.
    pub fn quit(mut self) {
        self.send("quit");
        self.wait_line(Duration::from_secs(15), |l| l == "bye");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "{}: exit status {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{}: did not exit", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failing test shows what each process said (the failing wait shows one).
            self.seen.extend(self.lines.try_iter());
            eprintln!("--- {} output:\n{}", self.name, self.seen.join("\n"));
        }
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Submits rooms to the decode only (the prefill has no request for them yet), then a probe
/// room to both, and waits for the probe to go through. The probe's claim went out after
/// theirs on the same connection, and its ACK after that: once the prefill reports the probe
/// TRANSFERRED, every earlier room is claimed on the decode, bound to the connection, and its
/// claim is held early on the prefill.
pub fn claim_early(p: &mut Node, d: &mut Node, rooms: &[(u64, &[u32])], probe: (u64, &[u32])) {
    claim_early_with(p, d, rooms, 4, probe);
}

/// [`claim_early`] with rooms of `max_new` tokens (their prefill requests must match).
pub fn claim_early_with(
    p: &mut Node,
    d: &mut Node,
    rooms: &[(u64, &[u32])],
    max_new: u32,
    probe: (u64, &[u32]),
) {
    for &(room, prompt) in rooms {
        d.submit(room, max_new, prompt);
    }
    // The claims are held early on the prefill and the link they came on is up there before
    // any of its rooms has a state to send. (A room whose state is ready when its claim comes
    // in on a link still being set up fails on the prefill as if the decode were gone, and
    // the decode is never told: a race in pd::node's add_link, which adds the link to the
    // table only after its reader started.)
    let n = rooms.len() as u64;
    p.wait_metrics(Duration::from_secs(10), "the early claims", |m| {
        m["early_claims"] == n && m["peers"] == 1
    });
    d.submit(probe.0, 2, probe.1);
    p.submit(probe.0, 2, probe.1);
    let t = Duration::from_secs(20);
    p.wait_ends(&[probe.0], t);
    d.wait_ends(&[probe.0], t);
    assert_eq!(
        p.end_of(probe.0).unwrap(),
        &format!("finished {} Transferred", probe.0)
    );
    assert_eq!(
        d.end_of(probe.0).unwrap(),
        &format!("finished {} Length", probe.0)
    );
    for &(room, _) in rooms {
        assert!(
            d.end_of(room).is_none(),
            "room {room} ended early: {:?}",
            d.seen
        );
    }
}

/// Each room's line is an error for a lost peer (the connection went down with the rooms on
/// it: neither a bootstrap timeout nor a refused connection).
pub fn assert_lost_peer(node: &Node, rooms: &[u64]) {
    for &room in rooms {
        let end = node.end_of(room).unwrap();
        assert!(
            end.starts_with(&format!("error {room} KvTransfer "))
                && end.contains("is gone")
                && end.contains("peer_dead"),
            "{}: room {room}: {end}",
            node.name
        );
    }
}

/// What a unified engine with `params` generates (`max_new` greedy tokens) for the first `n`
/// tokens of `ids`, for each `n` in `lens`: the reference a pair must equal.
pub fn unified_tokens(
    params: Value,
    ids: &[u32],
    lens: &[usize],
    max_new: u32,
) -> HashMap<usize, Vec<u32>> {
    use super::requests::{collect, engine_with, exact, tokens_of};
    let unified = engine_with(params);
    lens.iter()
        .map(|&n| {
            let id = unified.submit(exact(&ids[..n], max_new)).unwrap();
            (n, tokens_of(&collect(&unified, &[id])[&id]))
        })
        .collect()
}

/// Rooms 1, 2, … of the first `lens[i]` tokens of `ids` through the pair: each ends
/// TRANSFERRED on the prefill (no token there) and `Length` on the decode with `want`'s
/// tokens; then both pools are empty.
pub fn rooms_match(
    p: &mut Node,
    d: &mut Node,
    ids: &[u32],
    lens: &[usize],
    max_new: u32,
    want: &HashMap<usize, Vec<u32>>,
) {
    rooms_match_from(1, p, d, ids, lens, max_new, want);
}

/// [`rooms_match`] with rooms numbered from `first` (a prefill remembers the rooms it ended
/// for a while: another decode's rooms take new numbers).
pub fn rooms_match_from(
    first: u64,
    p: &mut Node,
    d: &mut Node,
    ids: &[u32],
    lens: &[usize],
    max_new: u32,
    want: &HashMap<usize, Vec<u32>>,
) {
    let rooms: Vec<u64> = (first..first + lens.len() as u64).collect();
    for (&room, &n) in rooms.iter().zip(lens) {
        p.submit(room, max_new, &ids[..n]);
        d.submit(room, max_new, &ids[..n]);
    }
    d.wait_ends(&rooms, Duration::from_secs(60));
    p.wait_ends(&rooms, Duration::from_secs(10));
    for (&room, &n) in rooms.iter().zip(lens) {
        assert_eq!(
            p.end_of(room).unwrap(),
            &format!("finished {room} Transferred")
        );
        assert_eq!(
            p.tokens(room),
            Vec::<u32>::new(),
            "the prefill emits no token"
        );
        assert_eq!(d.end_of(room).unwrap(), &format!("finished {room} Length"));
        assert_eq!(d.tokens(room), want[&n], "prompt of {n} tokens");
    }
    assert_eq!(p.usage(), (0, 0));
    assert_eq!(d.usage(), (0, 0));
}
