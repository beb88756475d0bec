//! The UCX thread of a node with `pd.transport = "ucx"`: one UCP worker that owns the listener
//! and every endpoint, sends each link's frames from its outbox as active messages (in the
//! order the TCP writer would write them), hands the peer's frames to the same handler the TCP
//! reader does, sends heartbeats and declares silent peers dead.
//!
//! Each frame is one active message: its header is an 8-byte sequence number then the frame's
//! 16-byte header (and a DATA frame's 8-byte offset), its data the payload (the state's bytes,
//! sent from the room's buffer without a copy). UCX does not promise that active messages
//! arrive in the order sent (a rendezvous message's data completes after a later eager one),
//! so the receiver puts them back in order by sequence number before handing them on: the
//! protocol needs DONE after the last DATA.
//!
//! A connection begins as over TCP: where the engines hold a `pd.auth_key_file`, first the
//! challenge-response of [`super::handshake`] (AUTH, AUTH, PROOF, PROOF), run here a message
//! at a time; then the HELLO exchange: the decode sends its HELLO; the prefill's [`Acceptor`]
//! answers with its HELLO (and starts the link) or a REFUSE. The decode's remote keys are in
//! its HELLO, so they reach only a prefill that proved it holds the secret. From the HELLOs
//! on, every message of an authenticated connection carries a MAC in its header
//! ([`super::seal::Keyed`], over its sequence number, frame header and data), checked as it
//! arrives: a message that does not verify ends the connection before it is acted on.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::auth::Keys as Secrets;
use super::handshake::{self, Authenticated, Initiator, Responder};
use super::in_order::InOrder;
use super::link::{spawn, Handler, Link, Out};
use super::rma;
use super::seal::{self, Keyed};
use super::ucx::{self, Context, Endpoint, EpKey, Listener, Message, RemoteKey, Request, Worker};
use super::ucx_faults::{self, Faults};
use super::wire::{self, Frame, Kind};

/// The one active-message id: every frame.
const FRAME: u32 = 0;
/// Sequence number, frame header, a DATA frame's offset, an authenticated connection's MAC.
pub const MAX_AM_HEADER: usize = 8 + wire::HEADER + 8 + seal::TAG;
/// Bytes in flight per link before its outbox waits for completions (UCX copies nothing of a
/// DATA frame; this bounds how much of the rooms' buffers UCX holds at once).
const INFLIGHT_BYTES: usize = 8 << 20;
/// RMA bytes written since the last flush at most before the next flush starts, and at most
/// this many more while it is in flight: a put completes locally once UCX has queued it, so
/// without this bound a whole state would queue inside UCX ahead of the heartbeats (both
/// ways) and the link would look silent for as long as the state takes.
const RMA_WINDOW: usize = 4 << 20;
/// Frames held ahead of a missing one at most, per connection (UCX reorders little: a few
/// rendezvous messages in flight).
pub const MAX_EARLY: usize = 4096;
/// How often the thread wakes at least (to declare silent peers dead).
const TICK: Duration = Duration::from_millis(20);
/// How long the thread polls in-flight operations without progress before it sleeps between
/// polls, and how long those sleeps are.
const POLL_FOR: Duration = Duration::from_millis(5);
const STUCK_TICK: Duration = Duration::from_millis(1);

/// The prefill side's answer to a connection's first frame.
pub trait Acceptor: Send + Sync + 'static {
    /// `first` is the connection's first frame after the challenge-response (a HELLO from a
    /// well-behaved peer), `authenticated` what the challenge-response gave where the engine
    /// holds keys: the reply to send and the link it starts, or the frame to refuse it with.
    fn accept(
        &self,
        port: &Port,
        first: Frame,
        authenticated: Option<&Authenticated>,
    ) -> Result<Accepted, Vec<u8>>;
}

/// A connection the acceptor took: its HELLO reply and its link.
pub struct Accepted {
    pub reply: Vec<u8>,
    pub link: Arc<Link>,
    pub handler: Arc<dyn Handler>,
    /// The decode's registered memory (its HELLO's `rma_keys`): rooms whose claim names
    /// spans in it are written by RMA.
    pub rma_keys: Vec<wire::RmaKey>,
}

/// Why [`Port::connect`] gave no connection.
#[derive(Debug)]
pub enum NotConnected {
    /// No connection, or it ended (or timed out) before its handshake did.
    Lost(String),
    /// The challenge-response failed: the prefill refused this engine's proof, or its own
    /// did not verify.
    Unauthenticated(String),
}

impl std::fmt::Display for NotConnected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotConnected::Lost(m) | NotConnected::Unauthenticated(m) => f.write_str(m),
        }
    }
}

/// A connection made by [`Port::connect`]: the peer's answer to our HELLO; bind it to a link
/// with [`Port::bind`] or drop it with [`Port::drop_conn`].
pub struct Connected {
    pub conn: u64,
    pub answer: Frame,
    /// Whether the endpoint's puts travel on a real RMA lane (not emulated with active
    /// messages: see [`super::ucx::lanes`]), and its lanes' transports, as UCX describes them.
    pub rma_lane: bool,
    pub transports: Vec<String>,
    /// What the challenge-response gave, where the engine holds keys.
    pub authenticated: Option<Authenticated>,
}

enum Cmd {
    Connect {
        addr: SocketAddr,
        hello: Vec<u8>,
        deadline: Instant,
        reply: Sender<Result<Connected, NotConnected>>,
    },
    Bind {
        conn: u64,
        link: Arc<Link>,
        handler: Arc<dyn Handler>,
    },
    Drop(u64),
    Stop,
}

/// Wakes the worker from other threads: `ucp_worker_signal`, while the worker lives.
struct Signal {
    api: Arc<ucx::sys::Api>,
    worker: usize,
}

/// Clears the wake-up signal when dropped (before the worker it names is destroyed).
struct ClearSignal(Arc<Mutex<Option<Signal>>>);

impl Drop for ClearSignal {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// The handle other threads hold: queues commands and wakes the thread.
#[derive(Clone)]
pub struct Port {
    cmds: Sender<Cmd>,
    signal: Arc<Mutex<Option<Signal>>>,
}

impl Port {
    /// Wakes the thread: a link has frames to send, or is finishing or closed.
    pub fn wake(&self) {
        let s = self.signal.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = &*s {
            // SAFETY: the worker is live while the signal is set (the thread clears it under
            // this lock before destroying the worker); ucp_worker_signal is safe from any
            // thread.
            unsafe { (s.api.ucp_worker_signal)(s.worker as ucx::sys::Handle) };
        }
    }

    fn command(&self, cmd: Cmd) -> bool {
        let ok = self.cmds.send(cmd).is_ok();
        self.wake();
        ok
    }

    /// Connects to the UCX listener at `addr` and sends `hello`; waits (until `deadline`) for
    /// the peer's first frame.
    pub fn connect(
        &self,
        addr: SocketAddr,
        hello: Vec<u8>,
        deadline: Instant,
    ) -> Result<Connected, NotConnected> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        let cmd = Cmd::Connect {
            addr,
            hello,
            deadline,
            reply,
        };
        if !self.command(cmd) {
            return Err(NotConnected::Lost(
                "the UCX thread has stopped (the engine is shutting down)".into(),
            ));
        }
        let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(1);
        answer
            .recv_timeout(wait)
            .unwrap_or_else(|_| Err(NotConnected::Lost("the UCX thread did not answer".into())))
    }

    /// Hands a connected endpoint to its link: frames flow from now on.
    pub fn bind(&self, conn: u64, link: Arc<Link>, handler: Arc<dyn Handler>) {
        self.command(Cmd::Bind {
            conn,
            link,
            handler,
        });
    }

    /// Closes a connected endpoint no link will use (its peer was refused).
    pub fn drop_conn(&self, conn: u64) {
        self.command(Cmd::Drop(conn));
    }

    /// Stops the thread once its links' last frames are out (at most a second).
    pub fn stop(&self) {
        self.command(Cmd::Stop);
    }
}

/// A running UCX thread.
pub struct Started {
    pub port: Port,
    /// The listener's address (`listen` with its port filled in).
    pub bound: Option<SocketAddr>,
    pub thread: JoinHandle<()>,
}

/// How the thread's connections begin.
pub struct Handshakes {
    /// The secrets both sides of a connection must prove they hold (`pd.auth_key_file`).
    pub secrets: Option<Secrets>,
    /// How long an accepted connection has to finish its handshake (`pd.handshake_timeout_ms`).
    pub timeout: Duration,
    /// Accepted connections still in their handshake at most; more are closed at once
    /// (`pd.max_handshakes`).
    pub max: usize,
}

/// Starts the UCX thread over `ctx`: listening on `listen` (with `acceptor` answering
/// connections, which must finish their handshake within `handshakes.timeout`) when given.
pub fn start(
    ctx: Arc<Context>,
    listen: Option<SocketAddr>,
    acceptor: Option<Arc<dyn Acceptor>>,
    handshakes: Handshakes,
) -> Result<Started, String> {
    let (cmds, rx) = crossbeam_channel::unbounded();
    let port = Port {
        cmds,
        signal: Arc::new(Mutex::new(None)),
    };
    let (ready_tx, ready) = crossbeam_channel::bounded(1);
    let p = port.clone();
    let thread = spawn("dsv4-pd-ucx".into(), move || {
        crate::threads::mark_internal();
        let worker = match Worker::new(&ctx).and_then(|w| {
            w.receive(FRAME, MAX_AM_HEADER, wire::max_payload())?;
            Ok(w)
        }) {
            Ok(w) => w,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let listener = match listen.map(|a| worker.listen(a)).transpose() {
            Ok(l) => l,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        *p.signal.lock().unwrap_or_else(|e| e.into_inner()) = Some(Signal {
            api: ctx.api_handle(),
            worker: worker.raw() as usize,
        });
        // Declared after the worker, so dropped before it, on every path (a panic included):
        // no signal can reach a destroyed worker.
        let _clear = ClearSignal(p.signal.clone());
        let _ = ready_tx.send(Ok(listener.as_ref().map(|l| l.local_addr())));
        let mut thread = Thread {
            port: p.clone(),
            worker: &worker,
            listener: listener.as_ref(),
            acceptor,
            handshakes,
            conns: HashMap::new(),
            by_ep: HashMap::new(),
            next_conn: 0,
            closing: Vec::new(),
            stopping: None,
            faults: Faults::from_env(),
            faults_seen: 0,
        };
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| thread.run(&rx)));
        if let Err(e) = run {
            let why = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            log::error!("PD: the UCX thread failed (a dsv4 bug): {why}");
            // Its links cannot move another frame: down, so their rooms fail now.
            thread.abandon(&format!("the UCX thread failed: {why}"));
        }
        drop(thread);
        // Connection requests that came in the last pass: refused, not left to the worker.
        if let Some(l) = &listener {
            refuse_all(l);
        }
        drop(listener);
    })
    .map_err(|e| format!("cannot start the UCX thread: {e}"))?;
    let bound = ready
        .recv()
        .unwrap_or_else(|_| Err("the UCX thread ended while starting".into()));
    match bound {
        Ok(bound) => Ok(Started {
            port,
            bound,
            thread,
        }),
        Err(e) => {
            let _ = thread.join();
            Err(e)
        }
    }
}

/// Registers a decode's pool memory with `ctx` for the prefills' RMA writes.
///
/// The regions (from the engine's `KvPools::regions`) must stay allocated until the
/// registrations are dropped, and the node drops them only once its UCX thread has stopped
/// (`pd::Node::shutdown`), which the engine thread does before it frees the pools.
pub fn register(
    ctx: &Arc<Context>,
    regions: &[crate::kv::PoolRegion],
) -> Result<Vec<ucx::Registered>, String> {
    regions
        .iter()
        .map(|r| {
            let addr = usize::try_from(r.addr)
                .map_err(|_| format!("pool memory at {:#x} is beyond this machine's", r.addr))?;
            // SAFETY: the pools' memory, allocated (and not moved) until the node's shutdown
            // drops these registrations after its UCX thread stopped, before the pools are
            // freed (the contract above): no peer writes into it after that.
            unsafe { ctx.register(std::ptr::with_exposed_provenance_mut(addr), r.len) }.map_err(
                |e| {
                    format!(
                        "registering the KV pools ({} bytes) for RMA writes: {e}",
                        r.len
                    )
                },
            )
        })
        .collect()
}

/// A link and its handler.
type Bound = (Arc<Link>, Arc<dyn Handler>);

/// A peer's registered regions (`(address, length)`) and their keys unpacked on our endpoint.
type Keys = Vec<((u64, u64), RemoteKey)>;

/// Remote keys that operations still in flight may read: left to UCX (see [`RemoteKey::leak`]).
fn leak(keys: Keys) {
    for (_, key) in keys {
        key.leak();
    }
}

/// Refuses every connection request waiting on `listener` (shutting down); whether any was.
fn refuse_all(listener: &Listener) -> bool {
    let mut any = false;
    while let Some(r) = listener.reject_next() {
        any = true;
        if let Err(e) = r {
            log::warn!("PD: refusing a UCX connection during shutdown: {e}");
        }
    }
    any
}

/// An operation that ends a connection (a graceful close, or a send still in flight when it
/// began), with what waits for it: the link to tell once the endpoint's close is done, and
/// the remote keys the connection's puts read until then.
struct Closing {
    req: Request,
    bound: Option<Bound>,
    keys: Keys,
}

enum State {
    /// Accepted: waiting for the peer's first frame (its AUTH where the engine holds keys,
    /// else its HELLO) until the deadline.
    Accepting(Instant),
    /// Accepted, keys held: the peer's AUTH answered, its PROOF due.
    Proving(Box<Responder>, Instant),
    /// Accepted and authenticated: the peer's HELLO due (sealed).
    Proven(Box<Authenticated>, Instant),
    /// Connected by us: the handshake's next step due.
    Connecting {
        deadline: Instant,
        reply: Sender<Result<Connected, NotConnected>>,
        /// Our HELLO: sent at once without keys, else once the prefill proved it holds the
        /// secret.
        hello: Vec<u8>,
        step: Dialing,
    },
    /// Answered: waiting for [`Port::bind`] until the deadline; frames that come in turn
    /// meanwhile (checked, in order) are held for the link, at most [`MAX_HELD`].
    Answered(Vec<Parsed>, Instant),
    Bound {
        link: Arc<Link>,
        handler: Arc<dyn Handler>,
    },
}

/// Where a connection we made stands in its handshake.
enum Dialing {
    /// Our AUTH went: the prefill's AUTH due.
    Auth(Box<Initiator>),
    /// Our PROOF went: the prefill's PROOF due.
    Proof(Box<Initiator>),
    /// Our HELLO went: the prefill's answer due (what the challenge-response gave, if it ran).
    Hello(Option<Box<Authenticated>>),
}

struct Conn {
    ep: Endpoint,
    /// On an authenticated connection (after the challenge-response): the key each message
    /// sent is sealed with, and the one each message received must verify under.
    sealer: Option<Keyed>,
    opener: Option<Keyed>,
    /// The peer's registered regions (`(address, length)`) and their keys unpacked on `ep`;
    /// dropped only after `ep`'s close completed ([`Thread::remove`]), since the puts in
    /// flight read them (declared after `ep`, should a `Conn` ever be dropped whole).
    keys: Keys,
    state: State,
    next_out: u64,
    /// The peer's frames, put back in the order sent.
    incoming: InOrder<Parsed>,
    inflight: VecDeque<(Request, usize)>,
    inflight_bytes: usize,
    /// Rooms with RMA writes issued since the last flush.
    dirty: HashSet<u64>,
    /// A flush in flight: it completes once every write issued before it is in at the peer.
    flushing: Option<Request>,
    /// RMA bytes issued since the last flush started ([`RMA_WINDOW`]).
    unflushed: usize,
    /// Frames waiting for it, in order: the room's DONE, FAIL or FLUSHED that asked for it,
    /// then every later frame but RMA writes (which go on meanwhile: other rooms' bytes keep
    /// moving), so no frame overtakes one that waits.
    held: VecDeque<Out>,
}

/// Frames held behind a flush at most; then the link takes no more until it completes.
const MAX_HELD: usize = 4096;

/// A slice of a room's bytes, kept (not copied) until the put that writes it completes.
struct Slice {
    bytes: Arc<super::buffers::StateBuf>,
    range: std::ops::Range<usize>,
}

impl AsRef<[u8]> for Slice {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[self.range.clone()]
    }
}

/// The kind and room of a whole frame.
fn kind_and_room(frame: &[u8]) -> Option<(Kind, u64)> {
    let kind = Kind::from_u8(*frame.first()?)?;
    let room = u64::from_le_bytes(frame.get(8..16)?.try_into().ok()?);
    Some((kind, room))
}

impl Conn {
    fn new(ep: Endpoint, state: State) -> Conn {
        Conn {
            keys: Vec::new(),
            sealer: None,
            opener: None,
            ep,
            state,
            next_out: 0,
            incoming: InOrder::new(MAX_EARLY),
            inflight: VecDeque::new(),
            inflight_bytes: 0,
            dirty: HashSet::new(),
            flushing: None,
            unflushed: 0,
            held: VecDeque::new(),
        }
    }

    /// The link and handler, once bound.
    fn bound(&self) -> Option<Bound> {
        match &self.state {
            State::Bound { link, handler } => Some((link.clone(), handler.clone())),
            _ => None,
        }
    }

    /// Unpacks the peer's remote keys (its HELLO's `rma_keys`) on this endpoint.
    fn unpack(&mut self, keys: &[wire::RmaKey]) -> Result<(), String> {
        for k in keys {
            let packed = rma::from_hex(&k.rkey)?;
            let key = self.ep.unpack_rkey(&packed)?;
            self.keys.push(((k.addr, k.len), key));
        }
        Ok(())
    }

    /// Takes the next frame of `link` to go out: a DATA frame with a target becomes RMA
    /// writes; a room's DONE, FAIL or FLUSHED after such writes waits for a flush, and later
    /// frames wait behind it. `None` when the link has nothing to send now; else whether a
    /// message went to the peer (RMA writes and held frames are not messages: they do not put
    /// the next heartbeat off, or a long transfer by RMA would look like silence).
    fn take(&mut self, link: &Link, faults: Option<&mut Faults>) -> Result<Option<bool>, String> {
        if self.held.len() >= MAX_HELD {
            return Ok(None);
        }
        let Some(out) = link.next_out() else {
            return Ok(None);
        };
        let sent = match &out {
            Out::Data {
                target: Some(_), ..
            } => {
                self.put(out, faults)?;
                false
            }
            _ if self.flushing.is_some() => {
                self.held.push_back(out);
                false
            }
            _ if self.needs_flush(&out) => {
                self.held.push_back(out);
                self.flush()?;
                false
            }
            _ => {
                self.send(out)?;
                true
            }
        };
        Ok(Some(sent))
    }

    /// Whether `out` ends what a room's RMA writes since the last flush began.
    fn needs_flush(&self, out: &Out) -> bool {
        let Out::Frame(f) = out else {
            return false;
        };
        kind_and_room(f).is_some_and(|(kind, room)| {
            matches!(kind, Kind::Done | Kind::Fail | Kind::Flushed) && self.dirty.contains(&room)
        })
    }

    /// Starts a flush of every write issued so far, for every room.
    fn flush(&mut self) -> Result<(), String> {
        self.dirty.clear();
        self.unflushed = 0;
        self.flushing = Some(self.ep.flush()?);
        Ok(())
    }

    /// Whether more may be taken now: not while a flush is in flight and a window of RMA
    /// writes went since it started.
    fn open(&self) -> bool {
        self.inflight_bytes < INFLIGHT_BYTES
            && (self.flushing.is_none() || self.unflushed < RMA_WINDOW)
    }

    /// Once the flush completed, the held frames go in order, up to the next one that needs
    /// a flush of its own (writes issued meanwhile). Whether a message went out.
    fn flushed(&mut self) -> Result<bool, String> {
        let Some(flush) = &mut self.flushing else {
            return Ok(false);
        };
        let Some(r) = flush.poll() else {
            return Ok(false);
        };
        self.flushing = None;
        r?;
        let mut sent = false;
        while let Some(out) = self.held.pop_front() {
            if self.needs_flush(&out) {
                self.held.push_front(out);
                self.flush()?;
                return Ok(sent);
            }
            self.send(out)?;
            sent = true;
        }
        if self.unflushed >= RMA_WINDOW {
            // A window of writes went while the flush was in flight: the next one starts now
            // (after the held frames, which a long stream of writes must not starve).
            self.flush()?;
        }
        Ok(sent)
    }

    /// Writes a DATA frame's bytes into the decode's memory by RMA, at the addresses its
    /// claim named for their offsets.
    fn put(&mut self, out: Out, mut faults: Option<&mut Faults>) -> Result<(), String> {
        let Out::Data {
            prefix,
            bytes,
            range,
            target: Some(target),
            ..
        } = out
        else {
            return Err("a frame without a target was to be written by RMA (a dsv4 bug)".into());
        };
        let room = u64::from_le_bytes(prefix[8..16].try_into().unwrap_or_default());
        let at = u64::from_le_bytes(prefix[16..24].try_into().unwrap_or_default());
        let n = range.len() as u64;
        let pieces = target.pieces(at, at + n).ok_or_else(|| {
            format!(
                "room {room}: state bytes {at}..{} lie past the {} bytes of the destination \
                 the decode's claim named",
                at + n,
                target.len()
            )
        })?;
        let mut local = range.start;
        for (addr, len) in pieces {
            let i =
                rma::region_of(self.keys.iter().map(|(r, _)| *r), addr, len).ok_or_else(|| {
                    format!(
                        "room {room}: the decode's claim names {len} bytes at {addr:#x}, outside \
                         the memory its HELLO registered"
                    )
                })?;
            let len = len as usize;
            let mut slice = Slice {
                bytes: bytes.clone(),
                range: local..local + len,
            };
            if faults.as_mut().is_some_and(|f| f.flip_this_put(room)) {
                let mut copy = slice.as_ref().to_vec();
                copy[0] ^= 0xff;
                slice = Slice {
                    bytes: Arc::new(copy.into()),
                    range: 0..len,
                };
            }
            let req = self.ep.put(slice, addr, &self.keys[i].1)?;
            self.inflight_bytes += len;
            self.unflushed += len;
            self.inflight.push_back((req, len));
            local += len;
        }
        self.dirty.insert(room);
        if self.flushing.is_none() && self.unflushed >= RMA_WINDOW {
            self.flush()?;
        }
        Ok(())
    }

    /// Starts sealing what it sends and checking what it receives with `keys`.
    fn authenticated(&mut self, keys: &seal::FrameKeys) {
        self.sealer = Some(Keyed::new(&keys.send));
        self.opener = Some(Keyed::new(&keys.recv));
    }

    /// Sends one frame (its parts as [`Out::parts`] gives them) as the next active message,
    /// sealed where the connection is authenticated.
    fn send(&mut self, out: Out) -> Result<(), String> {
        let (head, body) = out.parts();
        let (head_len, body_len) = (head.len(), body.len());
        let mut header = Vec::with_capacity(MAX_AM_HEADER);
        header.extend_from_slice(&self.next_out.to_le_bytes());
        // A whole frame's header goes in the message's header, its payload in the data; a
        // DATA frame's prefix (header and offset) in the header, its slice in the data.
        let split = if body_len == 0 {
            wire::HEADER.min(head_len)
        } else {
            head_len
        };
        header.extend_from_slice(&head[..split]);
        let data = Payload { out, skip: split };
        if let Some(k) = &self.sealer {
            let tag = k.tag(self.next_out, &[&header[8..], data.as_ref()]);
            header.extend_from_slice(&tag);
        }
        let req = self.ep.send(FRAME, header, data)?;
        self.next_out += 1;
        let bytes = head_len + body_len;
        self.inflight_bytes += bytes;
        self.inflight.push_back((req, bytes));
        Ok(())
    }

    /// Frees what completed; the first failure.
    fn reap(&mut self) -> Result<(), String> {
        while let Some((req, _)) = self.inflight.front_mut() {
            match req.poll() {
                None => break,
                Some(r) => {
                    let (_, bytes) = self.inflight.pop_front().expect("front exists");
                    self.inflight_bytes -= bytes;
                    r?;
                }
            }
        }
        Ok(())
    }
}

/// An active message's data: the frame's bytes after the first `skip` (which went in the
/// message's header), kept without a copy until UCX is done with them.
struct Payload {
    out: Out,
    skip: usize,
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        let (head, body) = self.out.parts();
        if body.is_empty() {
            &head[self.skip..]
        } else {
            body
        }
    }
}

/// A frame as carried: kind, room, a DATA frame's offset, the payload (the bytes).
pub type Parsed = (Kind, u64, Option<u64>, Vec<u8>);

/// Checks one message against the frame format: sequence number, then a frame's header (and
/// a DATA frame's offset) whose length matches the data, then, where the connection is
/// authenticated (`opener`), the MAC over them, verified. Public for the fuzz target
/// (`fuzz/src/bin/ucx_messages.rs`).
pub fn parse(mut m: Message, opener: Option<&Keyed>) -> Result<(u64, Parsed), String> {
    if let Some(k) = opener {
        let len = m.header.len();
        if len < 8 + wire::HEADER + seal::TAG {
            return Err(format!(
                "a message without its MAC (a header of {len} bytes) on an authenticated \
                 connection"
            ));
        }
        let mut tag = [0u8; seal::TAG];
        tag.copy_from_slice(&m.header[len - seal::TAG..]);
        m.header.truncate(len - seal::TAG);
        let seq = u64::from_le_bytes(m.header[..8].try_into().unwrap_or_default());
        if !k.check(seq, &[&m.header[8..], &m.data], &tag) {
            return Err(format!(
                "message {seq} does not verify under the connection's key"
            ));
        }
    }
    let h = &m.header;
    if h.len() < 8 + wire::HEADER {
        return Err(format!("an active message header of {} bytes", h.len()));
    }
    let seq = u64::from_le_bytes(h[..8].try_into().unwrap_or_default());
    let mut at = 8;
    let (kind, len, room) = wire::read_header(&mut |buf: &mut [u8]| {
        buf.copy_from_slice(&h[at..at + buf.len()]);
        at += buf.len();
        Ok(())
    })
    .map_err(|e| match e {
        wire::ReadError::Protocol(m) => m,
        wire::ReadError::Io(e) => e.to_string(),
    })?;
    let offset = if kind == Kind::Data && h.len() == 8 + wire::HEADER + 8 {
        Some(u64::from_le_bytes(h[24..32].try_into().unwrap_or_default()))
    } else if h.len() == 8 + wire::HEADER {
        None
    } else {
        return Err(format!(
            "a {kind:?} frame with a header of {} bytes",
            h.len()
        ));
    };
    let Some(want) = len.checked_sub(offset.map_or(0, |_| 8)) else {
        return Err(format!(
            "a {kind:?} frame announcing {len} bytes, less than its offset"
        ));
    };
    if m.data.len() != want || (kind == Kind::Data && offset.is_none()) {
        return Err(format!(
            "a {kind:?} frame announcing {len} bytes carries {}",
            m.data.len() + offset.map_or(0, |_| 8)
        ));
    }
    Ok((seq, (kind, room, offset, m.data)))
}

struct Thread<'w> {
    port: Port,
    worker: &'w Worker,
    listener: Option<&'w Listener>,
    acceptor: Option<Arc<dyn Acceptor>>,
    handshakes: Handshakes,
    conns: HashMap<u64, Conn>,
    by_ep: HashMap<EpKey, u64>,
    next_conn: u64,
    /// Graceful closes in flight, with the link to tell once each is done.
    closing: Vec<Closing>,
    /// Stopping: the deadline after which what is left is closed by force.
    stopping: Option<Instant>,
    /// Tests only (`DSV4_UCX_FAULTS`, [`ucx_faults::set`]).
    faults: Option<Faults>,
    /// The generation of [`ucx_faults::set`] the faults come from.
    faults_seen: u64,
}

impl Thread<'_> {
    fn run(&mut self, rx: &Receiver<Cmd>) {
        let mut last_busy = Instant::now();
        loop {
            while let Ok(cmd) = rx.try_recv() {
                self.command(cmd);
            }
            self.reload_faults();
            let mut busy = self.worker.progress() > 0;
            busy |= self.accept();
            // Messages before errors: a peer's last frames (a REFUSE, a FAIL) arrive before
            // its endpoint's end and must be read first.
            busy |= self.receive();
            busy |= self.errors();
            busy |= self.send();
            self.closing.retain_mut(|c| {
                if c.req.poll().is_none() {
                    return true;
                }
                c.keys.clear();
                if let Some((link, handler)) = c.bound.take() {
                    handler.on_closed(&link);
                }
                false
            });
            if let Some(deadline) = self.stopping {
                if self.conns.is_empty() && self.closing.is_empty() {
                    return;
                }
                if Instant::now() >= deadline {
                    self.abandon("the engine shut down");
                    return;
                }
            }
            // While operations are in flight the worker is polled, not slept on: UCX completes
            // some steps of a transfer (rendezvous, tcp sends) only as it is progressed, with
            // no event on its file descriptor, and a missed one would cost a whole tick. An
            // operation that makes no progress for POLL_FOR (a frozen peer) is waited on in
            // short sleeps instead, so a stuck send does not hold a core.
            let now = Instant::now();
            if busy {
                last_busy = now;
                continue;
            }
            let in_flight = self.worker.receiving()
                || self
                    .conns
                    .values()
                    .any(|c| !c.inflight.is_empty() || c.flushing.is_some());
            if in_flight && now.duration_since(last_busy) < POLL_FOR {
                std::thread::yield_now();
            } else {
                let tick = if in_flight { STUCK_TICK } else { TICK };
                let mut next = self.next_heartbeat().min(now + tick);
                if let Some(due) = self.faults.as_ref().and_then(Faults::next_due) {
                    next = next.min(due);
                }
                self.worker.wait(next.saturating_duration_since(now), None);
            }
        }
    }

    /// Tests only: takes the faults [`ucx_faults::set`] named, if they changed; a `close`
    /// among them ends every connection now, as a dead peer would.
    fn reload_faults(&mut self) {
        let Some((generation, mut f)) = ucx_faults::changed(self.faults_seen) else {
            return;
        };
        self.faults_seen = generation;
        if let Some(old) = self.faults.take() {
            f.adopt(old);
        }
        if f.take_close() && !self.conns.is_empty() {
            f.closed(self.conns.len());
            let ids: Vec<u64> = self.conns.keys().copied().collect();
            for id in ids {
                self.fail(id, "the connection was closed (an injected fault)".into());
            }
        }
        self.faults = Some(f);
    }

    /// Ends every connection at once, waiting for nothing: bound links go down with `why`;
    /// operations still in flight are abandoned (their buffers leak rather than be freed
    /// under UCX), endpoints force-closed without waiting.
    fn abandon(&mut self, why: &str) {
        for (_, mut c) in self.conns.drain() {
            self.worker.forget(c.ep.key());
            if let State::Bound { link, handler } = &c.state {
                link.go_down(handler, why.to_string());
            }
            for (r, _) in c.inflight {
                r.abandon();
            }
            if let Some(r) = c.flushing.take() {
                r.abandon();
            }
            if let Ok(r) = c.ep.close(true) {
                r.abandon();
            }
            // Abandoned puts may still name them: leaked with the operations.
            leak(std::mem::take(&mut c.keys));
            // The worker is destroyed once this thread ends (the keys above no longer hold
            // it), which ends what is in flight: nothing more lands through it.
            if let State::Bound { link, handler } = &c.state {
                handler.on_closed(link);
            }
        }
        self.by_ep.clear();
        for c in self.closing.drain(..) {
            c.req.abandon();
            leak(c.keys);
            if let Some((link, handler)) = c.bound {
                handler.on_closed(&link);
            }
        }
    }

    fn add(&mut self, ep: Endpoint, state: State) -> u64 {
        self.next_conn += 1;
        let id = self.next_conn;
        self.by_ep.insert(ep.key(), id);
        self.conns.insert(id, Conn::new(ep, state));
        id
    }

    fn remove(&mut self, id: u64, graceful: bool) {
        let Some(mut c) = self.conns.remove(&id) else {
            return;
        };
        self.by_ep.remove(&c.ep.key());
        self.worker.forget(c.ep.key());
        let bound = c.bound();
        // Remote keys are destroyed only once the endpoint's close is done: until then UCX
        // may progress a put that reads its key.
        let keys = std::mem::take(&mut c.keys);
        if graceful {
            // The sends still in flight (a REFUSE, the last FAILs) complete before the
            // close: dropping their requests would cancel them.
            let ops = c
                .inflight
                .drain(..)
                .map(|(r, _)| r)
                .chain(c.flushing.take());
            self.closing.extend(ops.map(|req| Closing {
                req,
                bound: None,
                keys: Keys::new(),
            }));
            match c.ep.close(false) {
                Ok(req) => self.closing.push(Closing { req, bound, keys }),
                Err(e) => {
                    log::warn!("PD: closing a UCX endpoint: {e}");
                    // Its puts may still be in flight, with nothing left to say when they end.
                    leak(keys);
                    if let Some((link, handler)) = bound {
                        handler.on_closed(&link);
                    }
                }
            }
            return;
        }
        // Force-closed (waited for): UCX cancels what is in flight; then the requests (ended)
        // and the keys go.
        let Conn {
            ep,
            inflight,
            flushing,
            ..
        } = c;
        // Done (even with an error) or not: only a close that ended lets the keys go.
        let closed = match ep.close(true) {
            Ok(mut r) => match r.wait(Duration::from_secs(5)) {
                Ok(()) => true,
                Err(e) => {
                    log::warn!("PD: force-closing a UCX endpoint: {e}");
                    r.poll().is_some()
                }
            },
            Err(e) => {
                log::warn!("PD: force-closing a UCX endpoint: {e}");
                false
            }
        };
        drop((inflight, flushing));
        if closed {
            drop(keys);
        } else {
            // Puts may still read them: left to UCX rather than destroyed under it.
            leak(keys);
        }
        if let Some((link, handler)) = bound {
            handler.on_closed(&link);
        }
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Connect {
                addr,
                hello,
                deadline,
                reply,
            } => match self.worker.connect(addr) {
                Ok(ep) => {
                    // With keys the AUTH goes first, the HELLO once the prefill proved itself.
                    let (first, step) = match &self.handshakes.secrets {
                        None => (Ok(hello.clone()), Dialing::Hello(None)),
                        Some(_) => match Initiator::start(&[]) {
                            Ok((i, auth)) => (Ok(auth), Dialing::Auth(Box::new(i))),
                            Err(e) => (Err(e), Dialing::Hello(None)),
                        },
                    };
                    let state = State::Connecting {
                        deadline,
                        reply,
                        hello,
                        step,
                    };
                    let id = self.add(ep, state);
                    let c = self.conns.get_mut(&id).expect("just added");
                    if let Err(e) = first.and_then(|f| c.send(Out::Frame(f))) {
                        if let State::Connecting { reply, .. } = &c.state {
                            let _ = reply.send(Err(NotConnected::Lost(e)));
                        }
                        self.remove(id, false);
                    }
                }
                Err(e) => {
                    let _ = reply.send(Err(NotConnected::Lost(e)));
                }
            },
            Cmd::Bind {
                conn,
                link,
                handler,
            } => {
                let Some(c) = self.conns.get_mut(&conn) else {
                    link.go_down(
                        &handler,
                        "the UCX connection closed during the handshake".into(),
                    );
                    // Its endpoint is gone already; a claim queued meanwhile never left, but
                    // the node counts it as written until told.
                    handler.on_closed(&link);
                    return;
                };
                let held = match std::mem::replace(
                    &mut c.state,
                    State::Bound {
                        link: link.clone(),
                        handler: handler.clone(),
                    },
                ) {
                    State::Answered(held, _) => held,
                    _ => Vec::new(),
                };
                link.heard();
                for frame in held {
                    // A frame may end the connection: the rest go with it.
                    if !self.conns.contains_key(&conn) {
                        break;
                    }
                    self.handle(conn, frame);
                }
            }
            Cmd::Drop(conn) => self.remove(conn, true),
            Cmd::Stop => {
                self.stopping = Some(Instant::now() + Duration::from_secs(1));
                // Links still open finish: their queued control frames go, then they close.
                for c in self.conns.values() {
                    if let State::Bound { link, .. } = &c.state {
                        link.finish();
                    }
                }
                let unbound: Vec<u64> = self
                    .conns
                    .iter()
                    .filter(|(_, c)| !matches!(c.state, State::Bound { .. }))
                    .map(|(&id, _)| id)
                    .collect();
                for id in unbound {
                    self.remove(id, false);
                }
            }
        }
    }

    /// New connections from the listener; handshakes that ran out of time.
    fn accept(&mut self) -> bool {
        let mut busy = false;
        if let (Some(listener), Some(_)) = (self.listener, self.stopping) {
            // Shutting down: a connection now would only be closed again; refused, the peer
            // learns at once and tries elsewhere.
            busy |= refuse_all(listener);
        }
        while let Some(ep) = self.worker.accept() {
            busy = true;
            match ep {
                Ok(ep) if self.acceptor.is_some() && self.stopping.is_none() => {
                    if self.handshaking() >= self.handshakes.max {
                        // Dropped: its endpoint closes (by force) with nothing said.
                        log::warn!(
                            "PD: closed a UCX connection at once: pd.max_handshakes = {} \
                             connections are in their handshake already",
                            self.handshakes.max
                        );
                        drop(ep);
                        continue;
                    }
                    let deadline = Instant::now() + self.handshakes.timeout;
                    self.add(ep, State::Accepting(deadline));
                }
                Ok(_) => {}
                Err(e) => log::warn!("PD: a UCX connection could not be accepted: {e}"),
            }
        }
        let now = Instant::now();
        let late: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| match &c.state {
                State::Accepting(d)
                | State::Proving(_, d)
                | State::Proven(_, d)
                | State::Answered(_, d) => now >= *d,
                State::Connecting { deadline, .. } => now >= *deadline,
                _ => false,
            })
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            if let Some(State::Connecting { reply, .. }) = self.conns.get(&id).map(|c| &c.state) {
                let _ = reply.send(Err(NotConnected::Lost(
                    "no answer to the handshake in time".into(),
                )));
            }
            self.remove(id, false);
        }
        busy
    }

    /// Accepted connections still in their handshake.
    fn handshaking(&self) -> usize {
        self.conns
            .values()
            .filter(|c| {
                matches!(
                    c.state,
                    State::Accepting(_) | State::Proving(..) | State::Proven(..)
                )
            })
            .count()
    }

    /// Failed endpoints: their links go down, their handshakes fail.
    fn errors(&mut self) -> bool {
        let errors = self.worker.take_errors();
        let busy = !errors.is_empty();
        for (ep, why) in errors {
            let Some(&id) = self.by_ep.get(&ep) else {
                continue;
            };
            self.fail(id, format!("connection lost: {why}"));
        }
        busy
    }

    /// Ends connection `id` for `why`: its endpoint is force-closed first (so destinations
    /// the peer was writing are free, `on_closed`, by the time the rooms fail), then its link
    /// goes down.
    fn fail(&mut self, id: u64, why: String) {
        let bound = self.conns.get(&id).and_then(Conn::bound);
        if let Some(State::Connecting { reply, .. }) = self.conns.get(&id).map(|c| &c.state) {
            let _ = reply.send(Err(NotConnected::Lost(why.clone())));
        }
        self.remove(id, false);
        if let Some((link, handler)) = bound {
            link.go_down(&handler, why);
        }
    }

    fn receive(&mut self) -> bool {
        let mut busy = false;
        while let Some(m) = self.worker.take_message() {
            busy = true;
            let Some(&id) = m.from.as_ref().and_then(|ep| self.by_ep.get(ep)) else {
                continue;
            };
            let now = match self.faults.as_mut() {
                Some(f) => f.receive(id, m),
                None => Some((id, m)),
            };
            if let Some((id, m)) = now {
                self.deliver(id, m);
            }
        }
        let due = self
            .faults
            .as_mut()
            .map(|f| f.due(Instant::now()))
            .unwrap_or_default();
        for (id, m) in due {
            busy = true;
            self.deliver(id, m);
        }
        busy
    }

    /// One message from connection `id`, handed on in sequence order.
    fn deliver(&mut self, id: u64, m: Message) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let (seq, frame) = match parse(m, c.opener.as_ref()) {
            Ok(x) => x,
            Err(e) => {
                self.fail(id, format!("the peer broke the protocol: {e}"));
                return;
            }
        };
        // Before the keys are in, nothing is held ahead of its turn: a message parked early
        // would be handed on after the keys came, never checked against them. The
        // challenge-response goes one message at a time each way, so a peer that follows it
        // sends nothing early.
        let due = c.incoming.next();
        if self.handshakes.secrets.is_some() && c.opener.is_none() && seq != due {
            let why = format!("message {seq} arrived before message {due} of its handshake");
            log::warn!("PD: closed a UCX connection in its handshake: {why}");
            self.fail(id, format!("the peer broke the protocol: {why}"));
            return;
        }
        let frames = match c.incoming.accept(seq, frame) {
            Ok(f) => f,
            Err(e) => {
                self.fail(id, format!("the peer broke the protocol: {e}"));
                return;
            }
        };
        for frame in frames {
            // A frame may end the connection: the rest go with it.
            if !self.conns.contains_key(&id) {
                return;
            }
            self.handle(id, frame);
        }
    }

    /// A frame in its turn, by the connection's state.
    fn handle(&mut self, id: u64, (kind, room, offset, data): Parsed) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if let State::Bound { link, handler } = &c.state {
            let (link, handler) = (link.clone(), handler.clone());
            if let Some(buf) = link.deliver(&handler, kind, room, offset, data) {
                self.worker.recycle(buf);
            }
            return;
        }
        let frame = Frame {
            kind,
            room,
            payload: data,
        };
        // Each arm below puts the connection's next state back, or ends it.
        let now = Instant::now();
        match std::mem::replace(&mut c.state, State::Accepting(now)) {
            State::Accepting(deadline) => match &self.handshakes.secrets {
                None => self.welcome(id, frame, None),
                Some(_) => match Responder::on_auth(&frame, &[]) {
                    Ok((r, answer)) => {
                        c.state = State::Proving(Box::new(r), deadline);
                        self.say(id, answer);
                    }
                    Err(why) => self.refuse(id, &why),
                },
            },
            State::Proving(r, deadline) => {
                let secrets = self
                    .handshakes
                    .secrets
                    .as_ref()
                    .expect("proving needs keys");
                match r.on_proof(secrets, &frame) {
                    Ok((a, answer)) => {
                        // The PROOF goes as it is; every message after it is sealed, both
                        // ways (the decode seals its HELLO once this PROOF verified).
                        if self.say(id, answer) {
                            let c = self.conns.get_mut(&id).expect("said on it");
                            c.authenticated(&a.keys);
                            c.state = State::Proven(Box::new(a), deadline);
                        }
                    }
                    Err(why) => self.refuse(id, &why),
                }
            }
            State::Proven(a, _) => self.welcome(id, frame, Some(&a)),
            State::Connecting {
                deadline,
                reply,
                hello,
                step,
            } => self.dial(id, frame, deadline, reply, hello, step),
            State::Answered(mut held, deadline) => {
                // In turn after the answer, before the link is bound: kept for it.
                if held.len() >= MAX_HELD {
                    self.fail(
                        id,
                        format!("{MAX_HELD} frames arrived before the link was ready"),
                    );
                    return;
                }
                held.push((frame.kind, frame.room, offset, frame.payload));
                let c = self.conns.get_mut(&id).expect("looked up above");
                c.state = State::Answered(held, deadline);
            }
            State::Bound { .. } => unreachable!("handled above"),
        }
    }

    /// Sends a handshake frame on connection `id`; whether it went (else the connection is
    /// closed).
    fn say(&mut self, id: u64, frame: Vec<u8>) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        match c.send(Out::Frame(frame)) {
            Ok(()) => true,
            Err(e) => {
                log::warn!("PD: a UCX connection in its handshake: {e}");
                self.remove(id, false);
                false
            }
        }
    }

    /// An accepted connection that did not authenticate: told only [`handshake::REFUSED`],
    /// why goes to the log.
    fn refuse(&mut self, id: u64, why: &str) {
        log::warn!("PD: refused a UCX connection: it did not authenticate: {why}");
        if let Some(c) = self.conns.get_mut(&id) {
            let _ = c.send(Out::Frame(handshake::refusal()));
        }
        // Closed gracefully: the refusal goes out first.
        self.remove(id, true);
    }

    /// An accepted connection's HELLO (after the challenge-response, where it ran): the
    /// acceptor starts its link, or refuses it.
    fn welcome(&mut self, id: u64, frame: Frame, authenticated: Option<&Authenticated>) {
        let Some(acceptor) = self.acceptor.clone() else {
            self.remove(id, false);
            return;
        };
        match acceptor.accept(&self.port, frame, authenticated) {
            Ok(a) => {
                let c = self.conns.get_mut(&id).expect("looked up by the caller");
                if let Err(e) = c.unpack(&a.rma_keys) {
                    c.state = State::Bound {
                        link: a.link,
                        handler: a.handler,
                    };
                    self.fail(id, format!("the decode's remote keys: {e}"));
                    return;
                }
                if let Err(e) = c.send(Out::Frame(a.reply)) {
                    a.link.go_down(&a.handler, format!("connection lost: {e}"));
                    self.remove(id, false);
                    return;
                }
                a.link.heard();
                c.state = State::Bound {
                    link: a.link,
                    handler: a.handler,
                };
            }
            Err(refusal) => {
                let c = self.conns.get_mut(&id).expect("looked up by the caller");
                let _ = c.send(Out::Frame(refusal));
                // Closed gracefully: the refusal goes out first.
                self.remove(id, true);
            }
        }
    }

    /// The prefill's next frame on a connection we made, by the handshake's step.
    fn dial(
        &mut self,
        id: u64,
        frame: Frame,
        deadline: Instant,
        reply: Sender<Result<Connected, NotConnected>>,
        hello: Vec<u8>,
        step: Dialing,
    ) {
        let secrets = self.handshakes.secrets.clone();
        let c = self.conns.get_mut(&id).expect("looked up by the caller");
        let next = match (step, &secrets) {
            (Dialing::Auth(mut i), Some(secrets)) => i
                .on_auth(secrets, &frame)
                .map(|proof| (proof, Dialing::Proof(i))),
            (Dialing::Proof(i), Some(secrets)) => i.on_proof(secrets, &frame).map(|a| {
                // Proven: our HELLO (and everything after it) goes sealed.
                c.authenticated(&a.keys);
                (hello.clone(), Dialing::Hello(Some(Box::new(a))))
            }),
            (Dialing::Hello(authenticated), _) => {
                // An answered connection waits this long for its link.
                let wait = Instant::now() + self.handshakes.timeout;
                c.state = State::Answered(Vec::new(), wait);
                // The answer came over the endpoint: its wire-up is done, its lanes final.
                let described = c.ep.describe().unwrap_or_else(|e| {
                    log::warn!("PD: cannot describe a UCX endpoint: {e}");
                    String::new()
                });
                log::debug!("PD: UCX endpoint {id}:\n{described}");
                let connected = Connected {
                    conn: id,
                    answer: frame,
                    rma_lane: ucx::lanes::has_rma_lane(&described),
                    transports: ucx::lanes::transports(&described),
                    authenticated: authenticated.map(|a| *a),
                };
                if reply.send(Ok(connected)).is_err() {
                    self.remove(id, false);
                }
                return;
            }
            (_, None) => unreachable!("no challenge-response without keys"),
        };
        match next {
            Ok((frame, step)) => {
                c.state = State::Connecting {
                    deadline,
                    reply,
                    hello,
                    step,
                };
                self.say(id, frame);
            }
            Err(why) => {
                let _ = reply.send(Err(NotConnected::Unauthenticated(why)));
                self.remove(id, false);
            }
        }
    }

    /// Each bound link's frames, its heartbeat, its silence; links that ended.
    fn send(&mut self) -> bool {
        let mut busy = false;
        let now = Instant::now();
        let mut ended: Vec<(u64, bool)> = Vec::new();
        // Connections that failed, and why: ended after the loop (`fail`).
        let mut failed: Vec<(u64, String)> = Vec::new();
        for (&id, c) in self.conns.iter_mut() {
            let State::Bound { link, handler } = &c.state else {
                continue;
            };
            let (link, handler) = (link.clone(), handler.clone());
            if let Err(e) = c.reap() {
                failed.push((id, format!("sending failed: {e}")));
                continue;
            }
            let (closed, finished) = link.ending();
            if closed {
                if let Some(why) = link.dropped() {
                    link.go_down(&handler, why);
                }
                ended.push((id, false));
                continue;
            }
            match c.flushed() {
                Ok(true) => {
                    busy = true;
                    link.sent();
                }
                Ok(false) => {}
                Err(e) => {
                    failed.push((id, format!("flushing RMA writes failed: {e}")));
                    continue;
                }
            }
            let mut broken = None;
            while c.open() {
                match c.take(&link, self.faults.as_mut()) {
                    Ok(None) => break,
                    Ok(Some(sent)) => {
                        busy = true;
                        if sent {
                            link.sent();
                        }
                    }
                    Err(e) => {
                        broken = Some(format!("sending failed: {e}"));
                        break;
                    }
                }
            }
            if let Some(why) = broken {
                failed.push((id, why));
                continue;
            }
            // A heartbeat is a few bytes: it goes even with the window full of writes.
            if now >= link.heartbeat_at() {
                let beat = Out::Frame(wire::encode(Kind::Heartbeat, 0, &[]));
                if c.send(beat).is_ok() {
                    link.sent();
                }
            }
            if let Some(why) = link.silence() {
                failed.push((id, why));
                continue;
            }
            if finished && c.inflight.is_empty() && c.flushing.is_none() {
                link.go_down(&handler, "the link was finished".into());
                ended.push((id, true));
            }
        }
        for (id, graceful) in ended {
            self.remove(id, graceful);
        }
        for (id, why) in failed {
            self.fail(id, why);
        }
        busy
    }

    fn next_heartbeat(&self) -> Instant {
        self.conns
            .values()
            .filter_map(|c| match &c.state {
                State::Bound { link, .. } => Some(link.heartbeat_at()),
                _ => None,
            })
            .min()
            .unwrap_or_else(|| Instant::now() + TICK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(header: Vec<u8>, data: Vec<u8>) -> Message {
        Message {
            id: FRAME,
            header,
            data,
            from: None,
        }
    }

    /// What `Conn::send` puts in an active message's header: the sequence number, then the
    /// frame's header (and a DATA frame's offset).
    fn header(seq: u64, frame_head: &[u8]) -> Vec<u8> {
        let mut h = seq.to_le_bytes().to_vec();
        h.extend_from_slice(frame_head);
        h
    }

    #[test]
    fn messages_parse_back_into_the_frames_sent() {
        let f = wire::encode(Kind::Fail, 7, b"{}");
        let (seq, (kind, room, offset, data)) = parse(
            message(header(3, &f[..wire::HEADER]), f[wire::HEADER..].to_vec()),
            None,
        )
        .unwrap();
        assert_eq!(
            (seq, kind, room, offset, data),
            (3, Kind::Fail, 7, None, b"{}".to_vec())
        );
        let bytes = vec![9u8; 1000];
        let prefix = wire::data_prefix(5, 4096, bytes.len());
        let (seq, (kind, room, offset, data)) =
            parse(message(header(4, &prefix), bytes.clone()), None).unwrap();
        assert_eq!((seq, kind, room, offset), (4, Kind::Data, 5, Some(4096)));
        assert_eq!(data, bytes);
    }

    proptest::proptest! {
        /// Any bytes a peer sends as a header and data: parsed or refused, never a panic; what
        /// parses has the data the header announces. Headers are built as the sender builds
        /// them with each field drawn at random (so that many parse), or are random bytes.
        #[test]
        fn any_message_parses_or_is_refused(
            raw in proptest::collection::vec(proptest::num::u8::ANY, 0..48),
            use_raw in proptest::bool::ANY,
            kind in 0u8..12,
            reserved in proptest::sample::select(vec![0u8, 0, 0, 1]),
            declared_extra in 0u32..10,
            len in 0usize..600,
            with_offset in proptest::bool::ANY,
        ) {
            let h = if use_raw {
                raw
            } else {
                let mut h = 5u64.to_le_bytes().to_vec();
                h.extend_from_slice(&[kind, reserved, 0, 0]);
                h.extend_from_slice(&(len as u32 + declared_extra % 9).to_le_bytes());
                h.extend_from_slice(&3u64.to_le_bytes());
                if with_offset {
                    h.extend_from_slice(&4096u64.to_le_bytes());
                }
                h
            };
            let data = vec![0u8; len];
            if let Ok((_, (kind, _, offset, bytes))) = parse(message(h, data), None) {
                proptest::prop_assert_eq!(bytes.len(), len);
                proptest::prop_assert_eq!(offset.is_some(), kind == Kind::Data);
            }
        }
    }

    /// The fuzz target's seeds (fuzz/corpus/ucx_messages: `[header length: u8][data length:
    /// u16 LE][header][data]` each) are messages this thread accepts, in sequence order once
    /// put back in order; they fail here when the format changes under them.
    #[test]
    fn the_fuzz_seeds_are_valid_messages() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/ucx_messages");
        let mut messages = 0;
        for entry in std::fs::read_dir(&dir).expect("the seed corpus") {
            let path = entry.expect("an entry").path();
            let bytes = std::fs::read(&path).expect("a seed");
            let mut input = &bytes[..];
            let mut order = InOrder::new(MAX_EARLY);
            let mut out = Vec::new();
            while !input.is_empty() {
                let (h, d) = (
                    input[0] as usize,
                    u16::from_le_bytes([input[1], input[2]]) as usize,
                );
                let m = message(input[3..3 + h].to_vec(), input[3 + h..3 + h + d].to_vec());
                input = &input[3 + h + d..];
                let (seq, frame) =
                    parse(m, None).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                out.extend(order.accept(seq, (seq, frame.0)).unwrap());
                messages += 1;
            }
            let seqs: Vec<u64> = out.iter().map(|(s, _)| *s).collect();
            assert_eq!(
                seqs,
                (0..seqs.len() as u64).collect::<Vec<_>>(),
                "{}",
                path.display()
            );
        }
        assert!(messages >= 7, "{messages} messages in the seeds");
    }

    #[test]
    fn malformed_messages_are_refused_naming_the_fault() {
        let f = wire::encode(Kind::Fail, 7, b"{}");
        let cases = [
            // Shorter than a sequence number and a frame header.
            (header(0, &f[..8]), vec![], "header of 16 bytes"),
            // The payload's length differs from the header's.
            (
                header(0, &f[..wire::HEADER]),
                b"{}!".to_vec(),
                "announcing 2 bytes carries 3",
            ),
            // A DATA frame without its offset.
            (
                header(0, &wire::data_prefix(1, 0, 4)[..wire::HEADER]),
                vec![0; 12],
                "carries",
            ),
            // A DATA frame with its offset announcing fewer bytes than the offset itself.
            (
                header(0, &{
                    let mut p = wire::data_prefix(1, 0, 0);
                    p[4..8].copy_from_slice(&4u32.to_le_bytes());
                    p
                }),
                vec![],
                "less than its offset",
            ),
            // An unknown kind.
            (header(0, &[77u8; 16]), vec![], "unknown frame kind 77"),
            // Over the kind's payload limit.
            (
                header(0, &wire::data_prefix(1, 0, 64 << 20)),
                vec![],
                "exceeds its limit",
            ),
        ];
        for (h, d, says) in cases {
            let e = parse(message(h, d), None).unwrap_err();
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn on_an_authenticated_connection_only_messages_sealed_under_the_key_for_their_number_parse() {
        use crate::pd::seal::FrameKey;
        let key = Keyed::new(&FrameKey::new([7u8; 16]));
        let f = wire::encode(Kind::Fail, 9, b"{\"x\":1}");
        // The MAC over the sequence number, the frame's header and its data (computed here
        // from the parts, as the sender must), after the header.
        let sealed = |seq: u64, key: &Keyed| {
            let mut h = header(seq, &f[..wire::HEADER]);
            let tag = key.tag(seq, &[&f[..wire::HEADER], &f[wire::HEADER..]]);
            h.extend_from_slice(&tag);
            message(h, f[wire::HEADER..].to_vec())
        };
        let (seq, (kind, room, _, data)) = parse(sealed(5, &key), Some(&key)).unwrap();
        assert_eq!(
            (seq, kind, room, &data[..]),
            (5, Kind::Fail, 9, &f[wire::HEADER..])
        );
        // Its number changed (moved or repeated elsewhere), a byte of the data flipped,
        // another key, no MAC at all: refused before it is parsed further.
        let mut moved = sealed(5, &key);
        moved.header[..8].copy_from_slice(&6u64.to_le_bytes());
        let mut flipped = sealed(5, &key);
        flipped.data[0] ^= 1;
        let other = sealed(5, &Keyed::new(&FrameKey::new([8u8; 16])));
        for m in [moved, flipped, other] {
            let e = parse(m, Some(&key)).unwrap_err();
            assert!(e.contains("does not verify"), "{e}");
        }
        let bare = message(header(5, &f[..wire::HEADER]), f[wire::HEADER..].to_vec());
        let e = parse(bare, Some(&key)).unwrap_err();
        assert!(e.contains("without its MAC"), "{e}");
        // A sealed message where none is expected is malformed.
        assert!(parse(sealed(5, &key), None).is_err());
    }
}
