//! A frame-aware TCP proxy for PD fault injection: a decode engine connects to it as its
//! `pd_peer`, and it relays every connection to the prefill engine, parsing only the 16-byte
//! frame header (kind u8, 3 zero bytes, payload length u32 LE, room u64 LE; src/pd/wire.rs).
//!
//! On the way it applies a [`Plan`]: scripted rules ("the Nth frame of kind K for room R going
//! to the decode") and random chances driven by a seeded `fastrand::Rng`. A fault drops a frame,
//! delays it, truncates it (sends part, then closes the connection), corrupts one byte of its
//! header or payload, duplicates it, reorders it (it goes out after the next frame of the same
//! room) or closes the connection instead of sending it; [`FaultProxy::kill`] closes every
//! connection at once (the peer "dies"). Every fault applied is logged with the frame it hit,
//! so a failing test prints the seed and what was done ([`FaultProxy::report`]).
//!
//! The seed fixes the random choices for a given sequence of frames; which frames arrive in
//! which order still depends on thread timing, which is why the log records what happened.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub const HELLO: u8 = 1;
pub const REFUSE: u8 = 2;
pub const CLAIM: u8 = 3;
pub const STATE: u8 = 4;
pub const DATA: u8 = 5;
pub const DONE: u8 = 6;
pub const ACK: u8 = 7;
pub const FAIL: u8 = 8;
pub const HEARTBEAT: u8 = 9;

pub const HEADER: usize = 16;

pub fn kind_name(kind: u8) -> &'static str {
    match kind {
        HELLO => "HELLO",
        REFUSE => "REFUSE",
        CLAIM => "CLAIM",
        STATE => "STATE",
        DATA => "DATA",
        DONE => "DONE",
        ACK => "ACK",
        FAIL => "FAIL",
        HEARTBEAT => "HEARTBEAT",
        _ => "?",
    }
}

/// Which way a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Decode → prefill: HELLO, CLAIM, ACK, FAIL, HEARTBEAT.
    ToPrefill,
    /// Prefill → decode: HELLO, REFUSE, STATE, DATA, DONE, FAIL, HEARTBEAT.
    ToDecode,
}

/// Which byte a corruption hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    /// Header byte `i` (0: kind, 1..4: reserved, 4..8: length, 8..16: room).
    Header(usize),
    /// Payload byte `i` modulo the payload's length (nothing is corrupted in an empty payload).
    Payload(usize),
}

/// What happens to one frame.
// No PartialEq: function pointers do not compare meaningfully.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// Not sent.
    Drop,
    /// Sent after this long; the frames behind it in this direction wait too (TCP order).
    Delay(Duration),
    /// The header and at most this many payload bytes are sent, then the connection closes.
    Truncate(usize),
    /// One byte XORed with `mask` (non-zero).
    Corrupt { at: At, mask: u8 },
    /// Sent twice.
    Duplicate,
    /// Held until the next frame of the same room in this direction has gone out (frames of
    /// other rooms pass it), so the receiver sees that room's two frames swapped. Lost if the
    /// connection ends first.
    Reorder,
    /// The header and the first `after` payload bytes go out, the rest `pause` later: the
    /// receiver is in the middle of reading the frame meanwhile.
    Stall { after: usize, pause: Duration },
    /// The connection closes (both directions) instead of the frame going out.
    Close,
    /// The payload is replaced by what the function makes of it (the header's length follows):
    /// a well-formed frame that says something else.
    Rewrite(fn(&[u8]) -> Vec<u8>),
    /// Sent, then sent again with the payload replaced by what the function makes of it: a
    /// second, different frame of the same kind for the same room.
    Repeat(fn(&[u8]) -> Vec<u8>),
}

impl Fault {
    /// Whether the fault takes the whole connection down (every room on it is affected).
    pub fn kills_connection(self) -> bool {
        matches!(self, Fault::Truncate(_) | Fault::Close)
    }
}

/// A scripted fault: the `nth` (1-based) frame going `dir` that matches `kind` and `room`
/// (`None`: any), counted over the proxy's lifetime since the plan was set.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub dir: Dir,
    pub kind: Option<u8>,
    pub room: Option<u64>,
    pub nth: usize,
    pub fault: Fault,
}

/// A random fault: each frame going `dir` whose kind is in `kinds` (empty: any) gets `fault`
/// with probability `p`.
#[derive(Debug, Clone)]
pub struct Chance {
    pub dir: Dir,
    pub kinds: Vec<u8>,
    pub p: f64,
    pub fault: Fault,
}

/// What the proxy does. A frame gets at most one fault: the first rule that fires, else the
/// first chance that does.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub rules: Vec<Rule>,
    pub chances: Vec<Chance>,
}

/// One fault the proxy applied.
#[derive(Debug, Clone)]
pub struct Applied {
    /// Since the plan was set.
    pub at: Duration,
    /// Which accepted connection (1-based; a decode reconnects after a connection dies).
    pub conn: u64,
    pub dir: Dir,
    /// The frame's kind, room and payload length as read (before any corruption); kind 0 and
    /// room 0 for [`FaultProxy::kill`].
    pub kind: u8,
    pub room: u64,
    pub len: usize,
    pub fault: Fault,
    /// Index of the rule that fired; `None` for a random chance or a kill.
    pub rule: Option<usize>,
}

impl std::fmt::Display for Applied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>6.1} ms conn {} {:?} {} room {} ({} bytes): {:?}{}",
            self.at.as_secs_f64() * 1e3,
            self.conn,
            self.dir,
            kind_name(self.kind),
            self.room,
            self.len,
            self.fault,
            self.rule.map_or(String::new(), |r| format!(" (rule {r})"))
        )
    }
}

struct State {
    plan: Plan,
    seed: u64,
    rng: fastrand::Rng,
    /// Frames each rule matched so far.
    seen: Vec<usize>,
    log: Vec<Applied>,
    started: Instant,
}

/// One relayed connection: both sockets, to close them together.
struct Conn {
    id: u64,
    decode: TcpStream,
    prefill: TcpStream,
}

impl Conn {
    fn close(&self) {
        let _ = self.decode.shutdown(Shutdown::Both);
        let _ = self.prefill.shutdown(Shutdown::Both);
    }
}

struct Shared {
    target: String,
    /// Bytes of MAC after each frame but AUTH and PROOF (an authenticated link's), relayed
    /// as part of the frame's payload.
    tag: usize,
    state: Mutex<State>,
    conns: Mutex<Vec<Arc<Conn>>>,
    next_conn: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn conns(&self) -> MutexGuard<'_, Vec<Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The fault for a frame, logged when there is one.
    fn decide(&self, conn: u64, dir: Dir, kind: u8, room: u64, len: usize) -> Option<Fault> {
        let mut s = self.state();
        let mut hit = None;
        for (i, r) in s.plan.rules.clone().iter().enumerate() {
            let matches = r.dir == dir
                && r.kind.is_none_or(|k| k == kind)
                && r.room.is_none_or(|x| x == room);
            if matches {
                s.seen[i] += 1;
                if s.seen[i] == r.nth && hit.is_none() {
                    hit = Some((r.fault, Some(i)));
                }
            }
        }
        if hit.is_none() {
            for c in s.plan.chances.clone() {
                if c.dir == dir && (c.kinds.is_empty() || c.kinds.contains(&kind)) {
                    // Drawn for every eligible frame, so the sequence of draws depends only on
                    // the frames seen.
                    if s.rng.f64() < c.p {
                        hit = Some((c.fault, None));
                        break;
                    }
                }
            }
        }
        let (fault, rule) = hit?;
        let at = s.started.elapsed();
        s.log.push(Applied {
            at,
            conn,
            dir,
            kind,
            room,
            len,
            fault,
            rule,
        });
        Some(fault)
    }
}

/// The proxy; dropping it stops accepting and closes every connection.
pub struct FaultProxy {
    addr: String,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Listens on a free loopback port and relays every connection to `target`
    /// (`tcp://host:port`: the prefill engine's endpoint).
    pub fn start(target: &str, plan: Plan, seed: u64) -> FaultProxy {
        Self::start_with_tags(target, plan, seed, 0)
    }

    /// [`Self::start`] between engines that authenticate (`pd.auth_key_file`): frames after
    /// the handshake end with a 32-byte MAC, relayed (and faulted) as part of their payload.
    pub fn start_sealed(target: &str, plan: Plan, seed: u64) -> FaultProxy {
        Self::start_with_tags(target, plan, seed, 32)
    }

    fn start_with_tags(target: &str, plan: Plan, seed: u64, tag: usize) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = format!("tcp://{}", listener.local_addr().unwrap());
        let shared = Arc::new(Shared {
            target: target.trim_start_matches("tcp://").to_string(),
            tag,
            state: Mutex::new(State {
                seen: vec![0; plan.rules.len()],
                plan,
                seed,
                rng: fastrand::Rng::with_seed(seed),
                log: Vec::new(),
                started: Instant::now(),
            }),
            conns: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(decode) = stream else { continue };
                let Ok(prefill) = TcpStream::connect(&s.target) else {
                    // The prefill is gone: the decode sees its connection closed.
                    continue;
                };
                let _ = (decode.set_nodelay(true), prefill.set_nodelay(true));
                let conn = Arc::new(Conn {
                    id: s.next_conn.fetch_add(1, Ordering::SeqCst) + 1,
                    decode: decode.try_clone().unwrap(),
                    prefill: prefill.try_clone().unwrap(),
                });
                s.conns().push(conn.clone());
                for (dir, from, to) in [
                    (
                        Dir::ToPrefill,
                        decode.try_clone().unwrap(),
                        prefill.try_clone(),
                    ),
                    (Dir::ToDecode, prefill, decode.try_clone()),
                ] {
                    let (s, conn) = (s.clone(), conn.clone());
                    let to = to.unwrap();
                    std::thread::spawn(move || relay(&s, &conn, dir, from, to));
                }
            }
        });
        FaultProxy { addr, shared }
    }

    /// `tcp://127.0.0.1:port`: what the decode uses as `pd_peer`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Replaces the plan and the seed for the frames from now on; counts and the log restart.
    pub fn set_plan(&self, plan: Plan, seed: u64) {
        let mut s = self.shared.state();
        s.seen = vec![0; plan.rules.len()];
        s.plan = plan;
        s.seed = seed;
        s.rng = fastrand::Rng::with_seed(seed);
        s.log.clear();
        s.started = Instant::now();
    }

    /// Closes every live connection: to both engines the peer died.
    pub fn kill(&self) {
        let conns: Vec<Arc<Conn>> = self.shared.conns().drain(..).collect();
        for c in &conns {
            c.close();
        }
        let mut s = self.shared.state();
        let at = s.started.elapsed();
        for c in conns {
            s.log.push(Applied {
                at,
                conn: c.id,
                dir: Dir::ToDecode,
                kind: 0,
                room: 0,
                len: 0,
                fault: Fault::Close,
                rule: None,
            });
        }
    }

    /// The faults applied since the plan was set, in order.
    pub fn log(&self) -> Vec<Applied> {
        self.shared.state().log.clone()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.next_conn.load(Ordering::SeqCst)
    }

    /// The seed, the plan and every fault applied: for a failing test's message.
    pub fn report(&self) -> String {
        let s = self.shared.state();
        let mut out = format!(
            "fault proxy seed {:#x}\nplan: {:?}\napplied:",
            s.seed, s.plan
        );
        if s.log.is_empty() {
            out.push_str(" nothing");
        }
        for a in &s.log {
            out.push_str(&format!("\n  {a}"));
        }
        out
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for c in self.shared.conns().drain(..) {
            c.close();
        }
        // Wakes the accept loop so it sees `stop`.
        let _ = TcpStream::connect(self.addr.trim_start_matches("tcp://"));
    }
}

fn read_frame(s: &mut TcpStream, tag: usize) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut header = vec![0u8; HEADER];
    s.read_exact(&mut header).ok()?;
    let mut len = u32::from_le_bytes(header[4..8].try_into().unwrap()) as usize;
    // AUTH (11) and PROOF (12) come before the link's keys exist, and so does a refusal.
    if !matches!(header[0], 2 | 11 | 12) {
        len += tag;
    }
    // The proxy trusts the engines' headers (the corruption happens after parsing), but a
    // length past any cap means the stream is not frames: stop relaying.
    if len > 128 << 20 {
        return None;
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

/// Relays one direction of `conn` frame by frame, applying the plan; closes the connection
/// when either side ends it or a fault does.
fn relay(s: &Shared, conn: &Conn, dir: Dir, mut from: TcpStream, mut to: TcpStream) {
    // A reordered frame waiting for the next frame of its room: (room, bytes).
    let mut held: Option<(u64, Vec<u8>)> = None;
    while let Some((header, payload)) = read_frame(&mut from, s.tag) {
        let kind = header[0];
        let room = u64::from_le_bytes(header[8..16].try_into().unwrap());
        let mut frame = header;
        frame.extend_from_slice(&payload);
        let mut out: Vec<Vec<u8>> = Vec::new();
        let mut just_held = false;
        match s.decide(conn.id, dir, kind, room, payload.len()) {
            None => out.push(frame),
            Some(Fault::Drop) => {}
            Some(Fault::Delay(d)) => {
                std::thread::sleep(d);
                out.push(frame);
            }
            Some(Fault::Truncate(n)) => {
                let cut = HEADER + n.min(payload.len());
                let _ = to.write_all(&frame[..cut.min(frame.len() - 1)]);
                break;
            }
            Some(Fault::Corrupt { at, mask }) => {
                let i = match at {
                    At::Header(i) => Some(i % HEADER),
                    At::Payload(i) => (!payload.is_empty()).then(|| HEADER + i % payload.len()),
                };
                if let Some(i) = i {
                    frame[i] ^= mask.max(1);
                }
                out.push(frame);
            }
            Some(Fault::Duplicate) => {
                out.push(frame.clone());
                out.push(frame);
            }
            Some(Fault::Reorder) => {
                // A second reorder while one is held: the older one goes out first.
                if let Some((_, f)) = held.replace((room, frame)) {
                    out.push(f);
                }
                just_held = true;
            }
            Some(Fault::Stall { after, pause }) => {
                let cut = HEADER + after.min(payload.len());
                if to.write_all(&frame[..cut]).is_err() {
                    break;
                }
                std::thread::sleep(pause);
                out.push(frame[cut..].to_vec());
            }
            Some(Fault::Close) => break,
            Some(Fault::Rewrite(f)) => {
                out.push(rewritten(&frame, f));
            }
            Some(Fault::Repeat(f)) => {
                let second = rewritten(&frame, f);
                out.push(frame);
                out.push(second);
            }
        }
        // The frame just decided on (or dropped) is the next of the held one's room.
        if !just_held
            && held
                .as_ref()
                .is_some_and(|h| h.0 == room && !out.is_empty())
        {
            out.push(held.take().unwrap().1);
        }
        if out.iter().any(|f| to.write_all(f).is_err()) {
            break;
        }
    }
    conn.close();
    s.conns().retain(|c| c.id != conn.id);
}

/// `frame` with its payload replaced by what `f` makes of it (the header's length follows).
fn rewritten(frame: &[u8], f: fn(&[u8]) -> Vec<u8>) -> Vec<u8> {
    let payload = f(&frame[HEADER..]);
    let mut out = frame[..HEADER].to_vec();
    out[4..8].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}
