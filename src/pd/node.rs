//! A PD engine's network side: the listener, the links to peers, every room's state and its
//! deadline, and the notices the engine thread acts on. Nothing here waits for the engine
//! thread: the engine calls in (register, claim, send, landed, close) and gets [`Notice`]s back
//! through its [`Sink`] (its inbox).
//!
//! Deadlines: a room waits at most `bootstrap_timeout` for its claim (a decode room: for its
//! destination to be reserved and claimed), and an early claim at most that long for its
//! prefill request; from the claim on, ONE `transfer_timeout` covers the prefill computing,
//! the bytes moving and the decode importing. A peer silent for `heartbeat_misses` intervals is
//! dead and every room on it fails.

use std::collections::{HashMap, HashSet};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::auth;
use super::buffers::{StateBuf, StateBuffers};
use super::deferred::{self, Deferred};
use super::handshake;
use super::incoming::{Incoming, Lent};
use super::link::{spawn, Bulk, Handler, Link, Segment};
use super::rma::{self, Target};
use super::room::{FailReason, RoomState};
use super::tls::Stream;
use super::ucx_port::{self, Accepted, Acceptor, NotConnected, Port};
use super::wire::{self, Claim, Done, Failure, Frame, Hello, Kind, Refusal, Side, StateHeader};
use crate::config::params::{Endpoint, PdTransport};
use crate::engine::{Histogram, BYTE_BUCKETS, LATENCY_BUCKETS};
use crate::error::{Error, ErrorKind, Result};
use crate::kv::state::LayoutFingerprint;
use crate::kv::Landing;

/// How often blocking handshake reads and connects look at the node's shutdown flag.
const POLL: Duration = Duration::from_millis(100);

/// Decode: the longest an ACK waits for the ACKs of rooms arriving right after it (the
/// prefill's request ends that much later; the decode's does not wait).
const ACK_DELAY: Duration = Duration::from_millis(2);

/// What the node tells the engine thread.
#[derive(Debug)]
pub enum Notice {
    /// Prefill: the decode has the room's state in its pools; the request is done here.
    Transferred { room: u64, request: u64 },
    /// Decode: the room's state arrived whole, lengths and checksum verified.
    Received {
        room: u64,
        request: u64,
        delivery: Box<Delivery>,
    },
    /// Decode: nothing writes into the destination of `room` any more, whose release
    /// ([`Node::release_landing`]) had to wait for a DATA frame being read into it.
    Released { room: u64 },
    /// Either side: the room failed; the request ends with this error.
    Failed {
        room: u64,
        request: u64,
        error: Error,
    },
}

/// A room's state as it arrived on the decode.
#[derive(Debug)]
pub struct Delivery {
    pub header: StateHeader,
    /// The state's bytes for the engine to write into the destination; `None`: they were
    /// received straight into it (the claim's [`Landing`]).
    pub bytes: Option<Vec<u8>>,
}

/// Where notices go (the engine's inbox). Must not block.
pub trait Sink: Send + Sync + 'static {
    fn notice(&self, notice: Notice);
    /// Several at once, in order (the engine's inbox wakes its thread once for them all).
    fn notices(&self, notices: Vec<Notice>) {
        for n in notices {
            self.notice(n);
        }
    }
}

/// How a node is set up (from the `pd` params and the engine's layout).
#[derive(Debug, Clone)]
pub struct Config {
    pub side: Side,
    /// Where to listen; its scheme is the transport (`tcp://` or `ucx://`).
    pub listen: Endpoint,
    /// The libucp to load for `ucx://` (else `libucp.so.0` from the loader's search path).
    pub ucx_library: Option<std::path::PathBuf>,
    pub advertise: Option<Endpoint>,
    pub bootstrap_timeout: Duration,
    pub transfer_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_misses: u32,
    pub max_rooms: usize,
    /// Connections, handshakes, handshake time and queued bytes per peer.
    pub bounds: super::PeerBounds,
    /// `pd.auth_key_file`'s secrets: links authenticate with them before anything else.
    pub auth: Option<auth::Keys>,
    /// `pd.tls`: TCP links are encrypted (a prefill's certificate, a decode's trust anchors).
    pub tls: Option<super::tls::Tls>,
    /// Decode: the prefills `pd_peer` may name (`pd.allowed_peers`); empty: any.
    pub allowed_peers: Vec<String>,
    pub layout: LayoutFingerprint,
    /// A decode's pool memory where it is host memory: over UCX it is registered at start
    /// and prefills write states straight into it by RMA. It must stay allocated until
    /// [`Node::shutdown`] returns.
    pub rma_regions: Vec<crate::kv::PoolRegion>,
    /// Decode: RMA also over endpoints whose puts UCX emulates with messages (its tcp
    /// transport). Off by default: UCX 1.13 aborts the target's process when such a put's
    /// answer cannot go back to an origin that failed (see `ucx::lanes`). For tests of the
    /// RMA protocol on machines without RMA hardware.
    pub rma_emulated: bool,
}

/// Counters, histograms and gauges for the metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct PdStats {
    /// Rooms transferred whole (prefill: acknowledged; decode: landed).
    pub transfers: u64,
    pub bytes: u64,
    /// Claim → done, summed over the transferred rooms.
    pub seconds: f64,
    /// State bytes sent ahead of the rest (prefill) or received before the STATE frame
    /// (decode): complete pages overlapping the prompt's compute.
    pub early_bytes: u64,
    /// Of `bytes`, those written by RMA straight into the decode's memory (UCX).
    pub rma_bytes: u64,
    /// Failed rooms by reason (`FailReason::ALL` order).
    pub failures: [u64; 7],
    /// Live rooms waiting for their claim (a decode room: for its destination).
    pub bootstrapping: u64,
    /// Live rooms claimed and not yet done (prefill: computing or sending; decode: reserved).
    pub transferring: u64,
    /// Connected peers.
    pub peers: u64,
    /// Prefill: claims waiting for their request.
    pub early_claims: u64,
    /// Claim → done of each transferred room (seconds).
    pub transfer_latency: Histogram,
    /// State bytes of each transferred room.
    pub transfer_bytes: Histogram,
    /// Registration → claim of each claimed room (seconds): on a prefill how long a room
    /// waited for the decode's claim, on a decode how long it waited for its destination.
    pub claim_wait: Histogram,
}

impl Default for PdStats {
    fn default() -> Self {
        Self {
            transfers: 0,
            bytes: 0,
            seconds: 0.0,
            early_bytes: 0,
            rma_bytes: 0,
            failures: [0; 7],
            bootstrapping: 0,
            transferring: 0,
            peers: 0,
            early_claims: 0,
            transfer_latency: Histogram::new(LATENCY_BUCKETS),
            transfer_bytes: Histogram::new(BYTE_BUCKETS),
            claim_wait: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

/// Prefill: a computed state ready to go, with its STATE frame and the CRC-32C of the STATE
/// payload then every byte, both made when the state is computed (outside the table's lock):
/// made when the claim comes, the CRC would delay the room's first byte (72 µs for a 611 KiB
/// state).
struct Outgoing {
    header: StateHeader,
    bytes: Arc<StateBuf>,
    /// Taken by the one start_sending.
    state_frame: Vec<u8>,
    crc: u32,
    /// The MAC of the state's bytes for RMA writes on an authenticated link, where the room
    /// was claimed so when the state was computed (made then, outside the table's lock): the
    /// link and the MAC.
    rma_mac: Option<(u64, [u8; super::seal::TAG])>,
}

/// The MAC a DONE carries over an RMA-written room's STATE payload and bytes.
fn rma_mac(
    key: &super::seal::Keyed,
    room: u64,
    state_frame: &[u8],
    bytes: &[u8],
) -> [u8; super::seal::TAG] {
    key.tag(room, &[&state_frame[wire::HEADER..], bytes])
}

impl Room {
    /// Decode: where the room's bytes stand, opened at the first byte or the STATE frame:
    /// straight into the destination when the claim gave its memory, else a buffer.
    fn incoming(&mut self) -> &mut Incoming {
        let (max_bytes, landing) = (self.max_bytes, &self.landing);
        self.incoming
            .get_or_insert_with(|| Incoming::new(max_bytes, landing.clone()))
    }
}

struct Room {
    side: Side,
    state: RoomState,
    request_id: u64,
    hash: u64,
    /// The peer's endpoint (decode: the prefill it claims from; prefill: the claimer's).
    peer: Option<String>,
    link: Option<u64>,
    deadline: Instant,
    registered_at: Instant,
    claimed_at: Option<Instant>,
    claim: Option<Claim>,
    /// Prefill: the state, once computed.
    outgoing: Option<Outgoing>,
    /// Prefill: byte ranges of the state sent ahead of it (complete pages), in order sent.
    early: Vec<std::ops::Range<usize>>,
    /// Decode: the most bytes the reserved destination can take.
    max_bytes: usize,
    /// Decode: the destination's memory, when the reader may write it directly.
    landing: Option<Arc<Landing>>,
    /// Decode: the claim named the destination's memory: the prefill writes it by RMA (no
    /// DATA frames).
    by_rma: bool,
    /// Prefill: the decode's memory the state's bytes are written into by RMA (its claim's
    /// `rma_spans`).
    target: Option<Arc<Target>>,
    incoming: Option<Incoming>,
    /// Prefill: its request left the admission queue (it is counted here while unclaimed).
    left_queue: bool,
    /// Its request is in the engine's inbox ([`Node::activate`]): notices about it may go
    /// out (before, one could reach the engine thread ahead of the request).
    active: bool,
    cancel: Arc<AtomicBool>,
}

/// A claim that came before its prefill request.
struct EarlyClaim {
    claim: Claim,
    link: u64,
    peer: String,
    deadline: Instant,
}

/// A destination a prefill may be writing by RMA.
struct Written {
    link: u64,
    /// When the engine asked for the destination back ([`Node::release_landing`]): it gets
    /// [`Notice::Released`] once nothing more can land.
    asked: Option<Instant>,
}

#[derive(Default)]
struct Table {
    rooms: HashMap<u64, Room>,
    early: HashMap<u64, EarlyClaim>,
    /// Ended rooms: when, and how (a claim for one is answered at once).
    ended: HashMap<u64, (Instant, String)>,
    /// Decode: rooms whose state landed, while their request decodes: (request, link). A FAIL
    /// from the prefill still ends the request (an abort there after the bytes were sent).
    landed: HashMap<u64, (u64, u64)>,
    /// Prefill: rooms the decode failed (aborted) before their request came here: the request
    /// fails as soon as it does.
    failed_early: HashMap<u64, (Instant, Failure)>,
    links: HashMap<u64, Arc<Link>>,
    /// Decode: the link to each prefill endpoint.
    by_peer: HashMap<String, u64>,
    /// Decode: rooms waiting for a connection to a peer being opened.
    connecting: HashMap<String, Vec<u64>>,
    /// Decode: rooms whose destination a link's reader is writing into now (the frame it
    /// reads), and whether the engine asked for it back meanwhile
    /// ([`Node::release_landing`]: it then waits for [`Notice::Released`]).
    lent: HashMap<u64, bool>,
    /// Decode: rooms whose destination a prefill may be writing by RMA (claimed with
    /// `rma_spans`), until its DONE, FAIL or FLUSHED, or until the link's endpoint closed.
    written: HashMap<u64, Written>,
    /// Prefill: the memory each UCX decode registered (its HELLO's `rma_keys`), by link:
    /// a claim's spans must lie inside it.
    peer_regions: HashMap<u64, Vec<(u64, u64)>>,
    /// Decode: UCX links whose endpoint has no RMA lane (its puts would be emulated with
    /// messages, see `ucx::lanes`): their claims go without `rma_spans`, the state as DATA.
    no_rma: HashSet<u64>,
    /// Each authenticated link's keys for its rooms (request digests, RMA-written bytes).
    link_keys: HashMap<u64, auth::LinkKeys>,
    next_link: u64,
    stats: PdStats,
}

impl Table {
    fn count_failure(&mut self, reason: FailReason) {
        let i = FailReason::ALL
            .iter()
            .position(|&x| x == reason)
            .unwrap_or(0);
        self.stats.failures[i] += 1;
    }

    /// Counts room `room` transferred whole (`bytes` of state, claimed at `claimed_at`) and
    /// remembers it ended so.
    fn transferred(&mut self, room: u64, bytes: usize, claimed_at: Option<Instant>) {
        let s = &mut self.stats;
        let seconds = claimed_at.map_or(0.0, |c| c.elapsed().as_secs_f64());
        s.transfers += 1;
        s.bytes += bytes as u64;
        s.seconds += seconds;
        s.transfer_latency.observe(seconds);
        s.transfer_bytes.observe(bytes as f64);
        self.ended
            .insert(room, (Instant::now(), "it was transferred".into()));
    }
}

struct Inner {
    cfg: Config,
    endpoint: String,
    sink: Arc<dyn Sink>,
    table: Mutex<Table>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    closing: AtomicBool,
    tick: Condvar,
    /// The UCX thread, with `ucx://`.
    ucx: Option<Port>,
    /// A UCX decode's pool memory registered for RMA (unregistered at shutdown), and its keys
    /// as its HELLO names them.
    registered: Mutex<Vec<super::ucx::Registered>>,
    rma_keys: Vec<wire::RmaKey>,
    /// Prefill: buffers for the states it sends, reused room after room.
    buffers: StateBuffers,
    /// Rooms landed or acknowledged while more of a TCP stream was already in (`deferred`).
    deferred: Mutex<Deferred>,
    /// Ends the TCP listener's wait at shutdown (`None` with UCX, which has no listener).
    accept_wake: Option<super::wake::Wake>,
    /// TCP connections in their handshake now (each holds a thread): at most
    /// `pd.max_handshakes`.
    handshakes: Arc<AtomicUsize>,
}

/// An authenticated connection's keys: its rooms', and its frames' MAC sequences (this
/// side's sending and receiving), which seal the HELLOs and then every frame. In TLS the
/// frames carry no MAC of their own: the session protects every byte, and the
/// challenge-response that keyed the link is bound to it.
struct Sealed {
    rooms: auth::LinkKeys,
    frames: Option<(super::seal::Sequence, super::seal::Sequence)>,
}

impl Sealed {
    fn new(secrets: &auth::Keys, a: handshake::Authenticated, stream: &Stream) -> Self {
        let frames = stream.session().is_none().then(|| {
            (
                super::seal::Sequence::new(a.keys.send.clone()),
                super::seal::Sequence::new(a.keys.recv.clone()),
            )
        });
        Self {
            rooms: secrets.link_keys(a.index, &a.keys),
            frames,
        }
    }

    /// `frame` with its MAC where the connection's frames carry one.
    fn seal(sealed: &mut Option<Sealed>, frame: Vec<u8>) -> Vec<u8> {
        let send = sealed
            .as_mut()
            .and_then(|s| s.frames.as_mut())
            .map(|f| &mut f.0);
        super::seal::sealed(send, frame)
    }
}

/// One handshake in progress, counted in [`Inner::handshakes`] until dropped.
struct Handshaking(Arc<AtomicUsize>);

impl Drop for Handshaking {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The node an engine in a PD role owns. [`Node::shutdown`] stops every thread.
pub struct Node {
    inner: Arc<Inner>,
}

/// What the handler's callbacks do with the node (links hold it weakly: no cycle).
struct LinkHandler(Weak<Inner>);

impl Handler for LinkHandler {
    fn on_frame(&self, link: &Arc<Link>, frame: Frame) {
        if let Some(inner) = self.0.upgrade() {
            inner.on_frame(link, frame);
        }
    }

    fn lend(&self, link: &Arc<Link>, room: u64, offset: u64, len: usize) -> Option<Lent> {
        self.0.upgrade()?.lend(link, room, offset, len)
    }

    fn put_back(
        &self,
        _link: &Arc<Link>,
        room: u64,
        offset: u64,
        len: usize,
        lent: Lent,
        filled: bool,
    ) {
        if let Some(inner) = self.0.upgrade() {
            if let Some(n) = inner.put_back(room, offset, len, lent, filled) {
                inner.emit(vec![n]);
            }
        }
    }

    fn between_frames(&self, _link: &Arc<Link>, more_ready: &mut dyn FnMut() -> bool) {
        if let Some(inner) = self.0.upgrade() {
            inner.between_frames(more_ready);
        }
    }

    fn on_down(&self, link: &Arc<Link>, why: String) {
        if let Some(inner) = self.0.upgrade() {
            inner.on_down(link, why);
        }
    }

    fn on_closed(&self, link: &Arc<Link>) {
        if let Some(inner) = self.0.upgrade() {
            inner.on_closed(link);
        }
    }
}

/// Answers UCX connections for the node (set once the node exists).
struct UcxAcceptor(std::sync::OnceLock<Weak<Inner>>);

impl Acceptor for UcxAcceptor {
    fn accept(
        &self,
        port: &Port,
        first: Frame,
        authenticated: Option<&handshake::Authenticated>,
    ) -> std::result::Result<Accepted, Vec<u8>> {
        let refuse = |reason: FailReason, message: String| {
            wire::encode_json(Kind::Refuse, 0, &Refusal { reason, message })
        };
        let Some(inner) = self.0.get().and_then(Weak::upgrade) else {
            return Err(refuse(
                FailReason::PeerDead,
                "the engine is starting or shutting down".into(),
            ));
        };
        if first.kind == Kind::Auth {
            let message = inner.no_key_here();
            log::warn!("PD: refused a UCX connection: {message}");
            return Err(refuse(FailReason::Mismatch, message));
        }
        if first.kind != Kind::Hello {
            log::warn!(
                "PD: a UCX connection began with {:?}, not HELLO",
                first.kind
            );
            return Err(refuse(
                FailReason::Mismatch,
                format!("the connection began with {:?}, not HELLO", first.kind),
            ));
        }
        let hello: Hello = wire::parse(&first).map_err(|m| refuse(FailReason::Mismatch, m))?;
        if let Some((reason, message)) = inner.judge(&hello) {
            log::warn!("PD: refused {}: {message}", hello.endpoint);
            return Err(refuse(reason, message));
        }
        let peer_interval = super::bounds::peer_interval(hello.heartbeat_interval_ms);
        let keys = inner
            .cfg
            .auth
            .as_ref()
            .zip(authenticated)
            .map(|(secrets, a)| secrets.link_keys(a.index, &a.keys));
        let (link, handler) = inner
            .add_link_with(hello.endpoint.clone(), keys, |id, peer, _| {
                Ok(inner.start_ucx_link(id, peer, port.clone(), peer_interval))
            })
            .map_err(|m| refuse(FailReason::Capacity, m))?;
        // Before any frame of the connection is handled (this runs on the UCX thread, which
        // hands them over once this returns).
        let regions = hello.rma_keys.iter().map(|k| (k.addr, k.len)).collect();
        inner.table().peer_regions.insert(link.id, regions);
        Ok(Accepted {
            reply: wire::encode_json(Kind::Hello, 0, &inner.hello()),
            link,
            handler,
            rma_keys: hello.rma_keys,
        })
    }
}

fn resolve(e: &Endpoint) -> std::io::Result<Vec<SocketAddr>> {
    Ok((e.host.as_str(), e.port).to_socket_addrs()?.collect())
}

impl Node {
    /// Binds `cfg.listen` and starts the listener and the timer.
    pub fn start(cfg: Config, sink: Arc<dyn Sink>) -> Result<Node> {
        let listen_text = cfg.listen.text();
        let addrs = resolve(&cfg.listen).map_err(|e| {
            Error::config(format!(
                "pd.listen = {listen_text}: cannot resolve the host: {e}"
            ))
        })?;
        if cfg.listen.transport == PdTransport::Ucx {
            return Self::start_ucx(cfg, sink, &addrs);
        }
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
            Error::config(format!(
                "pd.listen = {listen_text}: cannot bind: {e} (another process holds the port, \
                 or the address is not on this host): pick another port, or 0 for any free one"
            ))
        })?;
        let bound = listener
            .local_addr()
            .map_err(|e| Error::internal(format!("the PD listener has no address: {e}")))?;
        let endpoint = match &cfg.advertise {
            Some(a) => a.text(),
            None => Endpoint {
                transport: PdTransport::Tcp,
                host: bound.ip().to_string(),
                port: bound.port(),
            }
            .text(),
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::internal(format!("the PD listener: {e}")))?;
        let accept_wake = super::wake::Wake::new()
            .map_err(|e| Error::internal(format!("the PD listener's wake-up (eventfd): {e}")))?;
        let inner = Arc::new(Inner {
            cfg,
            endpoint,
            sink,
            table: Mutex::new(Table::default()),
            threads: Mutex::new(Vec::new()),
            closing: AtomicBool::new(false),
            tick: Condvar::new(),
            ucx: None,
            registered: Mutex::new(Vec::new()),
            rma_keys: Vec::new(),
            buffers: StateBuffers::new(),
            deferred: Mutex::new(Deferred::default()),
            accept_wake: Some(accept_wake),
            handshakes: Arc::new(AtomicUsize::new(0)),
        });
        let spawn_err =
            |e: std::io::Error| Error::internal(format!("cannot start a PD thread: {e}"));
        let (a, b) = (inner.clone(), inner.clone());
        let accept =
            spawn("dsv4-pd-listen".into(), move || a.accept_loop(listener)).map_err(spawn_err)?;
        let timer = spawn("dsv4-pd-timer".into(), move || b.timer_loop());
        let mut threads = inner.threads();
        threads.push(accept);
        match timer {
            Ok(t) => threads.push(t),
            Err(e) => {
                drop(threads);
                Node {
                    inner: inner.clone(),
                }
                .shutdown();
                return Err(spawn_err(e));
            }
        }
        drop(threads);
        log::info!(
            "PD {:?} node listening on {bound}, advertised as {}",
            inner.cfg.side,
            inner.endpoint
        );
        Ok(Node { inner })
    }

    /// [`Self::start`] over UCX: libucp loaded (`DSV4_ERR_UNSUPPORTED` naming the package when
    /// it cannot be), its thread listening on the first of `addrs`.
    fn start_ucx(cfg: Config, sink: Arc<dyn Sink>, addrs: &[SocketAddr]) -> Result<Node> {
        let listen_text = cfg.listen.text();
        let ctx = super::ucx::Context::new(cfg.ucx_library.as_deref(), None)
            .map_err(|e| Error::unsupported(format!("pd.transport = \"ucx\": {e}")))?;
        let addr = *addrs.first().ok_or_else(|| {
            Error::config(format!(
                "pd.listen = {listen_text}: the host has no address"
            ))
        })?;
        // A decode's pools are registered once: every claim then names its destination in them.
        let registered = match cfg.side {
            Side::Decode => ucx_port::register(&ctx, &cfg.rma_regions)
                .map_err(|e| Error::unsupported(format!("pd.transport = \"ucx\": {e}")))?,
            Side::Prefill => Vec::new(),
        };
        let rma_keys = registered
            .iter()
            .map(|r| wire::RmaKey {
                addr: r.addr,
                len: r.len as u64,
                rkey: rma::to_hex(&r.rkey),
            })
            .collect();
        let acceptor = Arc::new(UcxAcceptor(std::sync::OnceLock::new()));
        let handshakes = ucx_port::Handshakes {
            secrets: cfg.auth.clone(),
            timeout: cfg.bounds.handshake_timeout,
            max: cfg.bounds.max_handshakes,
        };
        let started = ucx_port::start(ctx, Some(addr), Some(acceptor.clone()), handshakes)
            .map_err(|e| {
                Error::config(format!(
                    "pd.listen = {listen_text}: {e} (another process holds the port, or the \
                 address is not on this host): pick another port, or 0 for any free one"
                ))
            })?;
        let bound = started.bound.unwrap_or(addr);
        let endpoint = match &cfg.advertise {
            Some(a) => a.text(),
            None => Endpoint {
                transport: PdTransport::Ucx,
                host: bound.ip().to_string(),
                port: bound.port(),
            }
            .text(),
        };
        let inner = Arc::new(Inner {
            cfg,
            endpoint,
            sink,
            table: Mutex::new(Table::default()),
            threads: Mutex::new(vec![started.thread]),
            closing: AtomicBool::new(false),
            tick: Condvar::new(),
            ucx: Some(started.port),
            registered: Mutex::new(registered),
            rma_keys,
            buffers: StateBuffers::new(),
            deferred: Mutex::new(Deferred::default()),
            accept_wake: None,
            handshakes: Arc::new(AtomicUsize::new(0)),
        });
        let _ = acceptor.0.set(Arc::downgrade(&inner));
        let node = Node {
            inner: inner.clone(),
        };
        let b = inner.clone();
        match spawn("dsv4-pd-timer".into(), move || b.timer_loop()) {
            Ok(t) => inner.threads().push(t),
            Err(e) => {
                node.shutdown();
                return Err(Error::internal(format!("cannot start a PD thread: {e}")));
            }
        }
        log::info!(
            "PD {:?} node listening on ucx://{bound}, advertised as {}",
            inner.cfg.side,
            inner.endpoint
        );
        Ok(node)
    }

    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// Whether peers authenticate (`pd.auth_key_file`).
    pub fn authenticated(&self) -> bool {
        self.inner.cfg.auth.is_some()
    }

    pub fn side(&self) -> Side {
        self.inner.cfg.side
    }

    /// Prefill: a buffer for a state of `len` bytes, to fill completely and pass to
    /// [`Self::send`]; it comes back for later rooms once the room has ended and nothing
    /// still sends from it.
    pub fn state_buffer(&self, len: usize) -> StateBuf {
        self.inner.buffers.take(len)
    }

    /// Opens room `room` for request `request_id`: `InvalidArgument` when a live request
    /// already has it, `QueueFull` at `pd.max_rooms`. The room acts on nothing until
    /// [`Self::activate`].
    pub fn register(
        &self,
        room: u64,
        request_id: u64,
        hash: u64,
        peer: Option<String>,
    ) -> Result<()> {
        let inner = &self.inner;
        if let Some(p) = peer.as_deref() {
            inner.check_peer_allowed(p)?;
        }
        let mut t = inner.table();
        if t.rooms.contains_key(&room) || t.landed.contains_key(&room) {
            return Err(Error::invalid_argument(format!(
                "pd_room {room} is already in use by a live request on this engine: the router \
                 must give each request its own room"
            )));
        }
        if t.written.contains_key(&room) || t.lent.contains_key(&room) {
            // Its previous request's destination is not back yet (a prefill may still write
            // into it): a new request in the room would be confused with it.
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!(
                    "pd_room {room}: the previous request's destination is still being released \
                     (its prefill has not confirmed that its writes stopped): retry shortly, or \
                     give the request a new room"
                ),
            ));
        }
        if t.rooms.len() >= inner.cfg.max_rooms {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!(
                    "pd.max_rooms = {} rooms are in flight on this engine: retry later, or raise \
                     pd.max_rooms",
                    inner.cfg.max_rooms
                ),
            ));
        }
        t.ended.remove(&room);
        t.rooms.insert(
            room,
            Room {
                side: inner.cfg.side,
                state: RoomState::Bootstrapping,
                request_id,
                hash,
                peer,
                link: None,
                deadline: Instant::now() + inner.cfg.bootstrap_timeout,
                registered_at: Instant::now(),
                claimed_at: None,
                claim: None,
                outgoing: None,
                early: Vec::new(),
                max_bytes: 0,
                landing: None,
                by_rma: false,
                target: None,
                incoming: None,
                left_queue: false,
                active: false,
                cancel: Arc::new(AtomicBool::new(false)),
            },
        );
        Ok(())
    }

    /// The room's request reached the engine's inbox: a claim that came early is taken now,
    /// and a room its decode already failed fails.
    pub fn activate(&self, room: u64) {
        let inner = &self.inner;
        let mut notices = Vec::new();
        {
            let mut t = inner.table();
            let Some(r) = t.rooms.get_mut(&room) else {
                return;
            };
            r.active = true;
            if let Some((_, f)) = t.failed_early.remove(&room) {
                let msg = format!(
                    "the peer failed the room before its request came here: {}",
                    f.message
                );
                inner.fail(&mut t, room, f.reason, &msg, true, &mut notices);
            } else if let Some(e) = t.early.remove(&room) {
                let r = t.rooms.get_mut(&room).expect("present");
                r.peer = Some(e.peer.clone());
                r.link = Some(e.link);
                inner.take_claim(&mut t, room, e.claim, &mut notices);
            }
        }
        inner.emit(notices);
    }

    /// Prefill: the room's request left the admission queue (until its claim arrives, it
    /// counts against `admission.max_queued_requests` here).
    pub fn left_queue(&self, room: u64) {
        if let Some(r) = self.inner.table().rooms.get_mut(&room) {
            r.left_queue = true;
        }
    }

    /// Prefill: rooms whose request left the queue and which wait for their claim.
    pub fn unclaimed_out_of_queue(&self) -> usize {
        self.inner
            .table()
            .rooms
            .values()
            .filter(|r| r.left_queue && r.state == RoomState::Bootstrapping)
            .count()
    }

    /// Prefill: the room's state is computed; it goes out once claimed. An error when the
    /// room already failed (the engine ends the request with it).
    pub fn send(&self, room: u64, header: StateHeader, bytes: StateBuf) -> Result<()> {
        let inner = &self.inner;
        let mut notices = Vec::new();
        let state_frame = wire::encode_json(Kind::State, room, &header);
        // Over the STATE payload and every byte in offset order, however they are sent.
        let crc = crate::crc::append(crate::crc::crc32c(&state_frame[wire::HEADER..]), &bytes);
        // Claimed for RMA writes on an authenticated link already (the usual case): the MAC
        // its DONE carries is made here rather than under the lock.
        // Without keys there is no MAC: no second look at the table.
        let keyed = inner.cfg.auth.as_ref().and_then(|_| {
            let t = inner.table();
            t.rooms
                .get(&room)
                .filter(|r| r.target.is_some())
                .and_then(|r| r.link)
                .and_then(|l| Some((l, t.link_keys.get(&l)?.rma.clone())))
        });
        let rma_mac = keyed.map(|(l, k)| (l, rma_mac(&k, room, &state_frame, &bytes)));
        let outgoing = Outgoing {
            header,
            bytes: Arc::new(bytes),
            state_frame,
            crc,
            rma_mac,
        };
        let result = {
            let mut t = inner.table();
            match t.rooms.get_mut(&room) {
                None => Err(inner.gone(&t, room)),
                Some(r) => {
                    r.outgoing = Some(outgoing);
                    if r.state == RoomState::Claimed {
                        inner.start_sending(&mut t, room, &mut notices);
                    }
                    Ok(())
                }
            }
        };
        inner.emit(notices);
        result
    }

    /// Prefill: whether [`Self::send_early`] would send now (the room is claimed, its state
    /// not yet computed, its connection up): a cheap check before reading pages out.
    pub fn sends_early(&self, room: u64) -> bool {
        let t = self.inner.table();
        t.rooms.get(&room).is_some_and(|r| {
            r.state == RoomState::Claimed
                && r.outgoing.is_none()
                && r.link.is_some_and(|l| t.links.contains_key(&l))
        })
    }

    /// Prefill: bytes of a claimed room's state known before the rest — its complete pages,
    /// each at its offset in the state ([`crate::kv::state::complete_pages`]) — go out now,
    /// overlapping the transfer with the rest of the prompt's compute. False when the room is
    /// not claimed yet (or no longer sending): those bytes then go out with the rest.
    pub fn send_early(&self, room: u64, pieces: crate::kv::state::Pieces) -> bool {
        let mut t = self.inner.table();
        let link = {
            let Some(r) = t.rooms.get(&room) else {
                return false;
            };
            if r.state != RoomState::Claimed || r.outgoing.is_some() {
                return false;
            }
            match r.link.and_then(|l| t.links.get(&l)) {
                Some(l) => l.clone(),
                None => return false,
            }
        };
        let r = t.rooms.get_mut(&room).expect("looked up above");
        let past_target = |end: usize| r.target.as_ref().is_some_and(|t| end as u64 > t.len());
        if pieces
            .iter()
            .any(|(at, bytes)| past_target(at + bytes.len()))
        {
            // Past the destination the claim named: they go with the rest, where the room
            // fails on its own (the state does not fit) instead of the link.
            return false;
        }
        let mut segments = Vec::with_capacity(pieces.len());
        let mut ranges = Vec::with_capacity(pieces.len());
        // A page computed again (its request requeued) was sent already: once is enough.
        let fresh = pieces
            .into_iter()
            .filter(|(at, _)| !r.early.iter().any(|e| e.start == *at));
        for (at, bytes) in fresh {
            let range = 0..bytes.len();
            ranges.push(at..at + bytes.len());
            segments.push(Segment::Data {
                at: at as u64,
                bytes: Arc::new(StateBuf::from(bytes)),
                range,
            });
        }
        if segments.is_empty() {
            return true;
        }
        let bulk = Bulk::of(room, segments, r.cancel.clone()).with_target(r.target.clone());
        if !link.send_bulk(bulk) {
            return false;
        }
        let sent: usize = ranges.iter().map(|e| e.len()).sum();
        r.early.extend(ranges);
        t.stats.early_bytes += sent as u64;
        true
    }

    /// Decode: the destination is reserved; claims the room from its prefill (connecting to
    /// it first if needed). `max_bytes`: the most state bytes the destination can hold;
    /// `landing`: its memory, when the bytes may be received straight into it — the engine
    /// then keeps the destination until [`Self::release_landing`] lets it go. The claim's
    /// `request_hash` is the digest the room was registered with.
    pub fn claim(
        &self,
        room: u64,
        claim: Claim,
        max_bytes: usize,
        landing: Option<Landing>,
    ) -> Result<()> {
        let inner = &self.inner;
        let mut notices = Vec::new();
        let result = {
            let mut t = inner.table();
            let now = Instant::now();
            let Some(r) = t.rooms.get_mut(&room) else {
                return Err(inner.gone(&t, room));
            };
            let peer = r.peer.clone().unwrap_or_default();
            r.state = RoomState::Claimed;
            r.claimed_at = Some(now);
            let waited = now.duration_since(r.registered_at);
            t.stats.claim_wait.observe_duration(waited);
            let r = t.rooms.get_mut(&room).expect("looked up above");
            r.deadline = now + inner.cfg.transfer_timeout;
            r.max_bytes = max_bytes;
            let mut claim = claim;
            // The request's digest, as registered (the caller need not compute it again).
            claim.request_hash = r.hash;
            // Registered memory (a UCX decode's host pools): the prefill writes it by RMA.
            if let Some(l) = landing.as_ref().filter(|_| !inner.rma_keys.is_empty()) {
                claim.rma_spans = l.spans().to_vec();
                r.by_rma = true;
            }
            r.landing = landing.map(Arc::new);
            r.claim = Some(claim);
            match t.by_peer.get(&peer).and_then(|id| t.links.get(id)).cloned() {
                Some(link) => {
                    inner.send_claim(&mut t, room, &link, &mut notices);
                }
                None => {
                    let waiting = t.connecting.entry(peer.clone()).or_default();
                    waiting.push(room);
                    if waiting.len() == 1 {
                        let i = inner.clone();
                        let p = peer.clone();
                        match spawn("dsv4-pd-connect".into(), move || i.connect(p)) {
                            Ok(h) => inner.threads().push(h),
                            Err(e) => {
                                let rooms = t.connecting.remove(&peer).unwrap_or_default();
                                for room in rooms {
                                    inner.fail(
                                        &mut t,
                                        room,
                                        FailReason::PeerDead,
                                        &format!("cannot start a connection thread: {e}"),
                                        false,
                                        &mut notices,
                                    );
                                }
                            }
                        }
                    }
                }
            }
            Ok(())
        };
        inner.emit(notices);
        result
    }

    /// Decode: the room's state is in the pools; acknowledges it to the prefill.
    pub fn landed(&self, room: u64) {
        let inner = &self.inner;
        let mut t = inner.table();
        if let Some(r) = t.rooms.remove(&room) {
            if let Some(link) = r.link.and_then(|l| t.links.get(&l)) {
                let ack = wire::encode(Kind::Ack, room, &[]);
                // While more rooms are coming over this link their ACKs go together (the
                // last one's at once): fewer writes, and fewer wake-ups of the prefill.
                let more = t.rooms.values().any(|o| {
                    o.link == r.link
                        && matches!(
                            o.state,
                            RoomState::Claimed | RoomState::Transferring | RoomState::Delivered
                        )
                });
                if more {
                    link.send_lazy(ack, ACK_DELAY);
                } else {
                    link.send(ack);
                }
            }
            if let Some(l) = r.link {
                t.landed.insert(room, (r.request_id, l));
            }
            let bytes = r.incoming.as_ref().map_or(0, |i| i.received);
            if r.by_rma {
                t.stats.rma_bytes += bytes as u64;
            }
            t.transferred(room, bytes, r.claimed_at);
        }
    }

    /// Decode: the engine is ending `room`'s request and wants its destination back. From
    /// now on nothing more is written into it; `true` when nothing is being written either
    /// (free the pages now), `false` when a link's reader is filling part of it: the node
    /// sends [`Notice::Released`] once it stopped, and the engine keeps the pages until then.
    pub fn release_landing(&self, room: u64) -> bool {
        let mut t = self.inner.table();
        if let Some(inc) = t.rooms.get_mut(&room).and_then(|r| {
            r.landing = None;
            // A claim not sent yet (its connection still opening) must not name the memory
            // handed back now: it goes, if at all, without it.
            if let Some(c) = r.claim.as_mut() {
                c.rma_spans.clear();
            }
            r.by_rma = false;
            r.incoming.as_mut()
        }) {
            inc.release();
        }
        // A prefill may still be writing it by RMA: kept until it says it stopped (its FAIL
        // or FLUSHED answers the FAIL the engine's close sent) or its endpoint is closed.
        if let Some(w) = t.written.get_mut(&room) {
            w.asked.get_or_insert_with(Instant::now);
            return false;
        }
        match t.lent.get_mut(&room) {
            Some(asked) => {
                *asked = true;
                false
            }
            None => true,
        }
    }

    /// The request of `room` ended on this engine: with `why` when the room did not complete
    /// (the peer is told, and the room counts as failed for that reason). Idempotent; the
    /// engine is not notified (it ended the request itself).
    pub fn close(&self, room: u64, why: Option<(FailReason, String)>) {
        let inner = &self.inner;
        let mut t = inner.table();
        t.landed.remove(&room);
        let live = t.rooms.get(&room).is_some_and(|r| !r.state.is_final());
        match why {
            Some((reason, message)) if live => {
                let mut ignored = Vec::new();
                inner.fail(&mut t, room, reason, &message, false, &mut ignored);
            }
            _ => {
                if let Some(r) = t.rooms.remove(&room) {
                    r.cancel.store(true, Ordering::SeqCst);
                    t.ended
                        .insert(room, (Instant::now(), "its request ended".into()));
                }
            }
        }
    }

    pub fn stats(&self) -> PdStats {
        let t = self.inner.table();
        let mut s = t.stats.clone();
        s.bootstrapping = t
            .rooms
            .values()
            .filter(|r| r.state == RoomState::Bootstrapping)
            .count() as u64;
        s.transferring = t.rooms.len() as u64 - s.bootstrapping;
        s.peers = t.links.len() as u64;
        s.early_claims = t.early.len() as u64;
        s
    }

    /// Stops the listener, the timer and every link, and joins their threads. Rooms still
    /// open fail with `aborted` (their peers are told when the link still carries it).
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let links: Vec<Arc<Link>> = {
            let mut t = inner.table();
            let rooms: Vec<u64> = t.rooms.keys().copied().collect();
            let mut ignored = Vec::new();
            for room in rooms {
                inner.fail(
                    &mut t,
                    room,
                    FailReason::Aborted,
                    "the engine shut down",
                    false,
                    &mut ignored,
                );
            }
            // The FAILs just queued go out first.
            for link in t.links.values() {
                link.finish();
            }
            t.links.values().cloned().collect()
        };
        if let Some(port) = &inner.ucx {
            port.stop();
        }
        if let Some(wake) = &inner.accept_wake {
            wake.wake();
        }
        inner.tick.notify_all();
        // A peer that does not read gets the FAILs' bytes for a grace period, no longer: its
        // socket then closes under the writer.
        let grace = Instant::now() + super::bounds::SHUTDOWN_GRACE;
        while Instant::now() < grace && inner.threads().iter().any(|h| !h.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        for link in &links {
            link.close();
        }
        loop {
            let batch: Vec<JoinHandle<()>> = inner.threads().drain(..).collect();
            if batch.is_empty() {
                break;
            }
            for h in batch {
                let _ = h.join();
            }
        }
        // Every endpoint is closed: no peer writes into the pools any more.
        inner
            .registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    /// Decode: refuses a `pd_peer` that `pd.allowed_peers` does not list (an entry `host`
    /// allows any port of it, `host:port` that port).
    fn check_peer_allowed(&self, peer: &str) -> Result<()> {
        let allowed = &self.cfg.allowed_peers;
        if allowed.is_empty() {
            return Ok(());
        }
        let ep = Endpoint::parse(peer).map_err(Error::invalid_argument)?;
        if super::bounds::peer_allowed(allowed, &ep) {
            Ok(())
        } else {
            Err(Error::invalid_argument(format!(
                "pd_peer {peer} is not in pd.allowed_peers ({}): point requests at a listed \
                 prefill engine, or add it to pd.allowed_peers",
                allowed.join(", ")
            )))
        }
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn threads(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        let mut t = self.threads.lock().unwrap_or_else(|e| e.into_inner());
        // Finished threads (links that went down) are joined as new ones start.
        let (done, live): (Vec<_>, Vec<_>) = t.drain(..).partition(|h| h.is_finished());
        *t = live;
        for h in done {
            let _ = h.join();
        }
        t
    }

    /// Hands `notices` to the engine, after any held ones (`deferred`). The hold's lock is
    /// kept while they go, so no other thread's notices come between.
    fn emit(&self, notices: Vec<Notice>) {
        let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        if d.is_empty() && notices.is_empty() {
            return;
        }
        self.sink.notices(d.take_then(notices));
    }

    /// What a TCP reader's frame produced: held while they are all good news (`deferred`),
    /// emitted at once otherwise.
    fn emit_or_hold(&self, link: &Link, notices: Vec<Notice>) {
        if link.is_ucx() || notices.is_empty() || !notices.iter().all(deferred::may_wait) {
            return self.emit(notices);
        }
        let mut d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
        if d.hold(notices, Instant::now()) {
            self.sink.notices(d.take_then(Vec::new()));
        }
    }

    /// A TCP reader between two frames: what it holds goes once it has caught up with the
    /// stream (`more_ready` false) or has held it long enough.
    fn between_frames(&self, more_ready: &mut dyn FnMut() -> bool) {
        let due = {
            let d = self.deferred.lock().unwrap_or_else(|e| e.into_inner());
            if d.is_empty() {
                return;
            }
            d.due(Instant::now())
        };
        if due || !more_ready() {
            self.emit(Vec::new());
        }
    }

    /// The error for an engine call on a room that is no longer here.
    fn gone(&self, t: &Table, room: u64) -> Error {
        let how = t
            .ended
            .get(&room)
            .map_or("it is not open here".to_string(), |(_, how)| how.clone());
        Error::new(
            ErrorKind::KvTransfer,
            format!("room {room}: the room already ended: {how}"),
        )
    }

    /// `room (peer P, phase S)`: the head of every room message.
    fn describe(&self, t: &Table, room: u64) -> String {
        match t.rooms.get(&room) {
            Some(r) => format!(
                "room {room} (request {} on the {} {}, peer {}, phase {})",
                r.request_id,
                match r.side {
                    Side::Prefill => "prefill",
                    Side::Decode => "decode",
                },
                self.endpoint,
                r.peer.as_deref().unwrap_or("none yet"),
                r.state.label()
            ),
            None => format!("room {room}"),
        }
    }

    /// Fails `room` for `reason`: its bytes stop, the peer is told (unless it told us:
    /// `from_peer`), the engine is notified (unless the engine asked: `notices` is then
    /// dropped by the caller), and the room ends.
    fn fail(
        &self,
        t: &mut Table,
        room: u64,
        reason: FailReason,
        message: &str,
        from_peer: bool,
        notices: &mut Vec<Notice>,
    ) {
        let Some(r) = t.rooms.get(&room) else {
            return;
        };
        if r.state.is_final() {
            return;
        }
        let text = format!(
            "{}: {} ({})",
            self.describe(t, room),
            message,
            reason.label()
        );
        let r = t.rooms.remove(&room).expect("present");
        r.cancel.store(true, Ordering::SeqCst);
        if !from_peer {
            if let Some(link) = r.link.and_then(|l| t.links.get(&l)) {
                link.send(wire::encode_json(
                    Kind::Fail,
                    room,
                    &Failure {
                        reason,
                        message: text.clone(),
                    },
                ));
            }
        }
        t.count_failure(reason);
        t.ended
            .insert(room, (Instant::now(), format!("it failed: {text}")));
        log::warn!("PD {text}");
        notices.push(Notice::Failed {
            room,
            request: r.request_id,
            error: Error::new(reason.error_kind(), text),
        });
    }

    /// Prefill: a claim for registered room `room` (the link and peer are set).
    fn take_claim(&self, t: &mut Table, room: u64, claim: Claim, notices: &mut Vec<Notice>) {
        let now = Instant::now();
        let Some(r) = t.rooms.get_mut(&room) else {
            return;
        };
        if r.state != RoomState::Bootstrapping {
            let state = r.state;
            self.fail(
                t,
                room,
                FailReason::Mismatch,
                &format!("a second claim arrived in state {}", state.label()),
                false,
                notices,
            );
            return;
        }
        // Keyed by the link's secret where it is authenticated: the digests shown are no
        // oracle for prompt guesses.
        let expected = auth::keyed_digest(
            r.link.and_then(|l| t.link_keys.get(&l)).map(|k| &k.digest),
            r.hash,
        );
        if claim.request_hash != expected {
            let msg = format!(
                "the decode's request differs from the prefill's (request hash {:#018x} vs \
                 {:#018x}): the router must send the same prompt, sampling params, seed and \
                 cache salt to both engines of a room",
                claim.request_hash, expected
            );
            self.fail(t, room, FailReason::Mismatch, &msg, false, notices);
            return;
        }
        if !claim.rma_spans.is_empty() {
            let link_is_ucx = r
                .link
                .and_then(|l| t.links.get(&l))
                .is_some_and(|l| l.is_ucx());
            let regions = r.link.and_then(|l| t.peer_regions.get(&l));
            let outside = claim.rma_spans.iter().find(|&&(addr, len)| {
                regions.is_none_or(|regions| {
                    rma::region_of(regions.iter().copied(), addr, len).is_none()
                })
            });
            let target = if !link_is_ucx {
                Err("the claim names memory for RMA writes, but it came over TCP".into())
            } else if let Some((addr, len)) = outside {
                Err(format!(
                    "the claim names {len} bytes at {addr:#x} for RMA writes, outside the memory \
                     the decode registered in its HELLO"
                ))
            } else {
                Target::from_claim(&claim.rma_spans)
            };
            match target {
                Ok(target) => {
                    let r = t.rooms.get_mut(&room).expect("looked up above");
                    r.target = Some(Arc::new(target));
                }
                Err(m) => {
                    self.fail(t, room, FailReason::Mismatch, &m, false, notices);
                    return;
                }
            }
        }
        let r = t.rooms.get_mut(&room).expect("looked up above");
        r.state = RoomState::Claimed;
        r.claimed_at = Some(now);
        r.deadline = now + self.cfg.transfer_timeout;
        r.claim = Some(claim);
        let (waited, computed) = (now.duration_since(r.registered_at), r.outgoing.is_some());
        t.stats.claim_wait.observe_duration(waited);
        if computed {
            self.start_sending(t, room, notices);
        }
    }

    /// Prefill: a claimed room whose state is computed starts going out.
    fn start_sending(&self, t: &mut Table, room: u64, notices: &mut Vec<Notice>) {
        let Some(r) = t.rooms.get_mut(&room) else {
            return;
        };
        let (Some(claim), Some(out)) = (&r.claim, &mut r.outgoing) else {
            return;
        };
        let (header, bytes) = (&out.header, &out.bytes);
        if claim.pages.len() != header.state.pages {
            let msg = format!(
                "the decode reserved {} pages but the prompt's state holds {}: the two engines \
                 disagree on the prompt",
                claim.pages.len(),
                header.state.pages
            );
            self.fail(t, room, FailReason::Mismatch, &msg, false, notices);
            return;
        }
        if let Some(target) = r.target.as_ref().filter(|t| t.len() < bytes.len() as u64) {
            let msg = format!(
                "the destination the decode's claim named for RMA writes holds {} bytes, the \
                 state {}",
                target.len(),
                bytes.len()
            );
            self.fail(t, room, FailReason::Capacity, &msg, false, notices);
            return;
        }
        if r.early.iter().any(|e| e.end > bytes.len()) {
            let msg = format!(
                "pages sent early lie past the {} bytes of the finished state (a dsv4 bug)",
                bytes.len()
            );
            self.fail(t, room, FailReason::Mismatch, &msg, false, notices);
            return;
        }
        let state_frame = std::mem::take(&mut out.state_frame);
        let key = r
            .target
            .as_ref()
            .and(r.link)
            .and_then(|l| Some((l, t.link_keys.get(&l)?)));
        let mac = key.map(|(l, k)| match out.rma_mac {
            Some((made_for, mac)) if made_for == l => mac,
            _ => rma_mac(&k.rma, room, &state_frame, bytes),
        });
        let done = wire::encode_json(
            Kind::Done,
            room,
            &Done {
                bytes: bytes.len() as u64,
                crc32c: out.crc,
                mac: mac.map(|m| auth::hex(&m)),
            },
        );
        // The bytes not sent early, in offset order.
        let mut early = r.early.clone();
        early.sort_unstable_by_key(|e| e.start);
        let mut segments = vec![Segment::Frame(state_frame)];
        let mut gap = |from: usize, to: usize| {
            if to > from {
                segments.push(Segment::Data {
                    at: from as u64,
                    bytes: bytes.clone(),
                    range: from..to,
                });
            }
        };
        let mut at = 0;
        for e in &early {
            gap(at, e.start);
            at = at.max(e.end);
        }
        gap(at, bytes.len());
        segments.push(Segment::Frame(done));
        let bulk = Bulk::of(room, segments, r.cancel.clone()).with_target(r.target.clone());
        r.state = RoomState::Transferring;
        let link = r.link.and_then(|l| t.links.get(&l)).cloned();
        if !link.is_some_and(|l| l.send_bulk(bulk)) {
            self.fail(
                t,
                room,
                FailReason::PeerDead,
                "the connection to the decode is gone",
                false,
                notices,
            );
        }
    }

    /// Decode: sends the claim of `room` on `link`.
    fn send_claim(&self, t: &mut Table, room: u64, link: &Arc<Link>, notices: &mut Vec<Notice>) {
        let key = t.link_keys.get(&link.id).map(|k| k.digest.clone());
        let Some(r) = t.rooms.get_mut(&room) else {
            return;
        };
        r.link = Some(link.id);
        if r.by_rma && t.no_rma.contains(&link.id) {
            r.by_rma = false;
            if let Some(c) = r.claim.as_mut() {
                c.rma_spans.clear();
            }
        }
        let Some(claim) = &r.claim else {
            return;
        };
        let by_rma = r.by_rma;
        let keyed = Claim {
            request_hash: auth::keyed_digest(key.as_ref(), claim.request_hash),
            ..claim.clone()
        };
        if link.send(wire::encode_json(Kind::Claim, room, &keyed)) {
            if by_rma {
                // From now on the prefill may write into the destination (the table's lock
                // is held: nothing of the peer's is handled before this).
                let w = Written {
                    link: link.id,
                    asked: None,
                };
                t.written.insert(room, w);
            }
        } else {
            self.fail(
                t,
                room,
                FailReason::PeerDead,
                "the connection to the prefill is gone",
                false,
                notices,
            );
        }
    }

    fn hello(&self) -> Hello {
        Hello {
            protocol: wire::PROTOCOL.into(),
            version: wire::VERSION,
            side: self.cfg.side,
            endpoint: self.endpoint.clone(),
            layout: self.cfg.layout.clone(),
            heartbeat_interval_ms: self.cfg.heartbeat_interval.as_millis() as u64,
            rma_keys: self.rma_keys.clone(),
        }
    }

    /// Why a peer's HELLO is unacceptable, if it is.
    fn check_hello(&self, theirs: &Hello, expect: Side) -> Option<(FailReason, String)> {
        if theirs.protocol != wire::PROTOCOL || theirs.version != wire::VERSION {
            return Some((
                FailReason::Mismatch,
                format!(
                    "the peer speaks {} version {}, this engine {} version {}: run the same \
                     dsv4 release on both",
                    theirs.protocol,
                    theirs.version,
                    wire::PROTOCOL,
                    wire::VERSION
                ),
            ));
        }
        if theirs.side != expect {
            return Some((
                FailReason::Mismatch,
                format!(
                    "the peer {} is a {:?} engine, this one a {:?} engine: decode engines \
                     claim from prefill engines (check pd_peer and the engines' roles)",
                    theirs.endpoint, theirs.side, self.cfg.side
                ),
            ));
        }
        let d = self.cfg.layout.differences(&theirs.layout);
        if !d.is_empty() {
            return Some((
                FailReason::Layout,
                format!(
                    "the KV layouts differ ({}; values: {:?} engine {} vs {:?} engine {}): run \
                     the same model with the same kv.page_size, kv.dtype and kv.indexer_dtype \
                     on both",
                    d.join("; "),
                    self.cfg.side,
                    self.endpoint,
                    theirs.side,
                    theirs.endpoint
                ),
            ));
        }
        None
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        crate::threads::mark_internal();
        let Some(wake) = self.accept_wake.as_ref() else {
            return; // A UCX node: it has no TCP listener.
        };
        while !self.closing.load(Ordering::SeqCst) {
            // Asleep until a peer connects or the node shuts down (`Node::shutdown` wakes it).
            if !wake.readable(&listener) {
                continue;
            }
            match listener.accept() {
                Ok((stream, addr)) => {
                    let max = self.cfg.bounds.max_handshakes;
                    if self.handshakes.fetch_add(1, Ordering::SeqCst) >= max {
                        self.handshakes.fetch_sub(1, Ordering::SeqCst);
                        // Closed unanswered: a flood of connections costs an accept each.
                        log::debug!(
                            "PD: closed a connection from {addr}: pd.max_handshakes = {max} \
                             handshakes are in progress"
                        );
                        continue;
                    }
                    let counted = Handshaking(self.handshakes.clone());
                    let me = self.clone();
                    match spawn("dsv4-pd-handshake".into(), move || {
                        let _counted = counted;
                        me.handshake(stream, addr)
                    }) {
                        Ok(h) => self.threads().push(h),
                        Err(e) => log::warn!("PD: cannot take a connection from {addr}: {e}"),
                    }
                }
                // The peer gave up between the wake-up and the accept.
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => {
                    // Out of descriptors, say: the connection stays queued, so waiting again at
                    // once would spin.
                    log::warn!("PD: accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// The accepting side of a connection: reads the peer's HELLO, refuses it or answers
    /// with ours and starts the link.
    fn handshake(self: Arc<Self>, stream: TcpStream, addr: SocketAddr) {
        crate::threads::mark_internal();
        let setup = stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(POLL)));
        if let Err(e) = setup {
            log::warn!("PD: connection from {addr}: {e}");
            return;
        }
        let deadline = Instant::now() + self.cfg.bounds.handshake_timeout;
        // With pd.tls everything from here on is inside the session; a peer that does not
        // begin one (a decode without pd.tls) is told so, in a frame it can read.
        if self.cfg.tls.is_some() && !self.begins_tls(&stream, deadline) {
            let message = format!(
                "the prefill {} encrypts its links (pd.tls): set pd.tls and pd.tls_ca_file on \
                 the decode too",
                self.endpoint
            );
            log::warn!("PD: refused a connection from {addr}: it did not begin TLS");
            let refusal = wire::encode_json(
                Kind::Refuse,
                0,
                &Refusal {
                    reason: FailReason::Mismatch,
                    message,
                },
            );
            let _ = wire::write_all(&mut &stream, &refusal);
            return;
        }
        let mut stream = match &self.cfg.tls {
            None => Stream::Tcp(stream),
            Some(tls) => {
                match tls.accept(stream, deadline, &|| self.closing.load(Ordering::SeqCst)) {
                    Ok(session) => Stream::Tls(session),
                    Err(e) => {
                        log::warn!("PD: connection from {addr}: {e}");
                        return;
                    }
                }
            }
        };
        let mut first = match self.read_handshake(&mut stream, deadline) {
            Ok(f) => f,
            Err(e) => {
                log::warn!("PD: connection from {addr}: no handshake: {e:?}");
                return;
            }
        };
        // Authenticated: the digest key and this side's (send, receive) MAC sequences, which
        // seal the HELLOs and then every frame of the link.
        let mut sealed: Option<Sealed> = None;
        if let Some(keys) = &self.cfg.auth {
            let Ok(mut out) = stream.try_clone() else {
                return;
            };
            let binding = stream.binding().to_vec();
            let index = handshake::accept(
                keys,
                &binding,
                first,
                &mut || {
                    self.read_handshake(&mut stream, deadline)
                        .map_err(|e| format!("{e:?}"))
                },
                &mut |b: &[u8]| wire::write_all(&mut out, b).map_err(|e| e.to_string()),
            );
            match index {
                Ok(a) => sealed = Some(Sealed::new(keys, a, &stream)),
                Err(why) => {
                    log::warn!(
                        "PD: refused a connection from {addr}: it did not authenticate: {why}"
                    );
                    return;
                }
            }
            first = match self.read_sealed(&mut stream, deadline, &mut sealed) {
                Ok(f) => f,
                Err(e) => {
                    log::warn!("PD: connection from {addr}: no HELLO: {e:?}");
                    return;
                }
            };
        } else if first.kind == Kind::Auth {
            let message = self.no_key_here();
            log::warn!("PD: refused a connection from {addr}: {message}");
            let _ = wire::write_all(
                &mut stream,
                &wire::encode_json(
                    Kind::Refuse,
                    0,
                    &Refusal {
                        reason: FailReason::Mismatch,
                        message,
                    },
                ),
            );
            return;
        }
        if first.kind != Kind::Hello {
            log::warn!(
                "PD: connection from {addr} began with {:?}, not HELLO",
                first.kind
            );
            return;
        }
        let hello: Hello = match wire::parse(&first) {
            Ok(h) => h,
            Err(m) => {
                log::warn!("PD: connection from {addr}: {m}");
                return;
            }
        };
        let full = || {
            let t = self.table();
            self.full(&t).map(|m| (FailReason::Capacity, m))
        };
        if let Some((reason, message)) = self.judge(&hello).or_else(full) {
            log::warn!("PD: refused {} ({addr}): {message}", hello.endpoint);
            let refusal = wire::encode_json(Kind::Refuse, 0, &Refusal { reason, message });
            let _ = wire::write_all(&mut stream, &Sealed::seal(&mut sealed, refusal));
            return;
        }
        let ours = wire::encode_json(Kind::Hello, 0, &self.hello());
        if wire::write_all(&mut stream, &Sealed::seal(&mut sealed, ours)).is_err() {
            return;
        }
        let peer_interval = super::bounds::peer_interval(hello.heartbeat_interval_ms);
        let _ = self.add_link(stream, hello.endpoint, peer_interval, sealed);
    }

    /// Whether the connection's first byte (waited for until `deadline`) begins a TLS
    /// handshake record (22).
    fn begins_tls(&self, stream: &TcpStream, deadline: Instant) -> bool {
        let mut first = [0u8; 1];
        loop {
            match stream.peek(&mut first) {
                Ok(0) => return false,
                Ok(_) => return first[0] == 22,
                Err(e) if super::tls::is_timeout(&e) => {
                    if self.closing.load(Ordering::SeqCst) || Instant::now() >= deadline {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
    }

    /// Why a decode that began with AUTH is refused by a prefill without keys.
    fn no_key_here(&self) -> String {
        format!(
            "the prefill {} holds no pd.auth_key_file but the decode does: give both engines \
             the same one, or neither",
            self.endpoint
        )
    }

    /// Why no link can be added to `t` now, if none can: `pd.max_links` are open.
    fn full(&self, t: &Table) -> Option<String> {
        let max = self.cfg.bounds.max_links;
        (t.links.len() >= max).then(|| {
            format!(
                "the engine {} holds pd.max_links = {max} links already: raise it, or connect \
                 fewer engines",
                self.endpoint
            )
        })
    }

    /// Why a connecting peer's HELLO is refused, if it is (only prefills accept, decodes).
    fn judge(&self, hello: &Hello) -> Option<(FailReason, String)> {
        match self.cfg.side {
            Side::Prefill => self.check_hello(hello, Side::Decode),
            Side::Decode => Some((
                FailReason::Mismatch,
                format!(
                    "{} is a decode engine: decode engines claim from prefill engines and \
                     accept no connections (check pd_peer)",
                    self.endpoint
                ),
            )),
        }
    }

    /// A link over the node's UCX thread.
    fn start_ucx_link(
        &self,
        id: u64,
        peer: String,
        port: Port,
        peer_interval: Duration,
    ) -> Arc<Link> {
        Link::start_ucx(
            id,
            peer,
            port,
            self.cfg.heartbeat_interval,
            peer_interval,
            self.cfg.heartbeat_misses,
            self.cfg.bounds.max_outbox_bytes,
        )
    }

    /// Starts a link over a connection whose HELLOs were exchanged.
    fn add_link(
        self: &Arc<Self>,
        stream: Stream,
        peer: String,
        peer_interval: Duration,
        sealed: Option<Sealed>,
    ) -> std::result::Result<Arc<Link>, String> {
        let (rooms, sequences) = sealed.map(|s| (s.rooms, s.frames)).unzip();
        let sequences = sequences.flatten();
        let (interval, misses) = (self.cfg.heartbeat_interval, self.cfg.heartbeat_misses);
        let max_queued = self.cfg.bounds.max_outbox_bytes;
        self.add_link_with(peer, rooms, |id, peer, handler| {
            let mut threads = Vec::new();
            let link = Link::start(
                id,
                peer,
                stream,
                interval,
                peer_interval,
                misses,
                max_queued,
                sequences,
                handler,
                &mut threads,
            );
            self.threads().extend(threads);
            link
        })
        .map(|(link, _)| link)
    }

    /// Adds the link `start` makes (given its id, the peer and its handler) to the table.
    fn add_link_with(
        self: &Arc<Self>,
        peer: String,
        keys: Option<auth::LinkKeys>,
        start: impl FnOnce(u64, String, Arc<dyn Handler>) -> std::io::Result<Arc<Link>>,
    ) -> std::result::Result<(Arc<Link>, Arc<dyn Handler>), String> {
        // The table stays locked until the link is in it: its reader may hand over a claim
        // (and a room then start sending on it) as soon as it starts. `closing` is read under
        // the lock: a shutdown sets it before it finishes the links in the table, so a link
        // added after that sweep (and never finished) cannot be.
        let mut t = self.table();
        if self.closing.load(Ordering::SeqCst) {
            return Err(format!("the engine {} is shutting down", self.endpoint));
        }
        if let Some(why) = self.full(&t) {
            log::warn!("PD: no link with {peer}: {why}");
            return Err(why);
        }
        t.next_link += 1;
        let id = t.next_link;
        let handler: Arc<dyn Handler> = Arc::new(LinkHandler(Arc::downgrade(self)));
        match start(id, peer.clone(), handler.clone()) {
            Ok(link) => {
                t.links.insert(id, link.clone());
                if let Some(k) = keys {
                    t.link_keys.insert(id, k);
                }
                log::info!("PD: connected to {peer} (link {id})");
                Ok((link, handler))
            }
            Err(e) => {
                log::warn!("PD: cannot start the link to {peer}: {e}");
                Err(format!("cannot start the link: {e}"))
            }
        }
    }

    /// Decode: opens the connection to prefill `peer` and sends the claims waiting for it, or
    /// fails them.
    fn connect(self: Arc<Self>, peer: String) {
        crate::threads::mark_internal();
        let outcome = self.open(&peer);
        let mut notices = Vec::new();
        {
            let mut t = self.table();
            let rooms = t.connecting.remove(&peer).unwrap_or_default();
            match outcome {
                Ok(link) => {
                    t.by_peer.insert(peer.clone(), link.id);
                    for room in rooms {
                        self.send_claim(&mut t, room, &link, &mut notices);
                    }
                }
                Err((reason, message)) => {
                    for room in rooms {
                        self.fail(&mut t, room, reason, &message, false, &mut notices);
                    }
                }
            }
        }
        self.emit(notices);
    }

    fn open(self: &Arc<Self>, peer: &str) -> std::result::Result<Arc<Link>, (FailReason, String)> {
        let dead = |m: String| (FailReason::PeerDead, m);
        let endpoint = Endpoint::parse(peer).map_err(|m| (FailReason::Mismatch, m))?;
        let ours = self.cfg.listen.transport;
        if endpoint.transport != ours {
            return Err((
                FailReason::Mismatch,
                format!(
                    "pd_peer {peer} is a {} endpoint but this engine's pd.transport is \"{}\": \
                     run both engines on the same transport",
                    endpoint.transport.scheme(),
                    ours.scheme()
                ),
            ));
        }
        let addrs = resolve(&endpoint)
            .map_err(|e| dead(format!("cannot resolve the prefill {peer}: {e}")))?;
        let timeout = self.cfg.bootstrap_timeout.min(self.cfg.transfer_timeout);
        if let Some(port) = &self.ucx {
            return self.open_ucx(port, peer, &addrs, Instant::now() + timeout);
        }
        let mut last = None;
        let mut stream = None;
        let deadline = Instant::now() + timeout;
        // In slices, so a shutdown does not wait out a connect to an unreachable host; a
        // refused connection fails at once.
        'connect: while stream.is_none() && !self.closing.load(Ordering::SeqCst) {
            for a in &addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break 'connect;
                }
                match TcpStream::connect_timeout(a, left.min(POLL * 2)) {
                    Ok(s) => {
                        stream = Some(s);
                        break 'connect;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::TimedOut => last = Some(e),
                    Err(e) => {
                        last = Some(e);
                        break 'connect;
                    }
                }
            }
        }
        let stream = stream.ok_or_else(|| {
            dead(format!(
                "cannot connect to the prefill {peer}: {}: check pd_peer (what \
                 dsv4_pd_endpoint returned on the prefill engine) and that it is running",
                last.map_or("no address".into(), |e| e.to_string())
            ))
        })?;
        let io =
            |e: std::io::Error| dead(format!("the handshake with the prefill {peer} failed: {e}"));
        stream.set_read_timeout(Some(POLL)).map_err(io)?;
        let deadline = deadline.min(Instant::now() + self.cfg.bounds.handshake_timeout);
        let mut stream = match &self.cfg.tls {
            None => Stream::Tcp(stream),
            Some(tls) => {
                let stop = || self.closing.load(Ordering::SeqCst);
                let session = tls.connect(stream, &endpoint.host, deadline, &stop);
                Stream::Tls(session.map_err(|m| {
                    (
                        FailReason::Mismatch,
                        format!(
                            "the prefill {peer}: {m}: give both engines pd.tls, this one a \
                             pd.tls_ca_file that signed the prefill's pd.tls_cert_file"
                        ),
                    )
                })?)
            }
        };
        let mut sealed = match &self.cfg.auth {
            Some(keys) => {
                let mut out = stream.try_clone().map_err(io)?;
                let binding = stream.binding().to_vec();
                let authenticated = handshake::initiate(
                    keys,
                    &binding,
                    &mut || {
                        self.read_handshake(&mut stream, deadline)
                            .map_err(|e| format!("{e:?}"))
                    },
                    &mut |b: &[u8]| wire::write_all(&mut out, b).map_err(|e| e.to_string()),
                )
                .map_err(|m| {
                    (
                        FailReason::Mismatch,
                        format!("the prefill {peer} did not authenticate: {m}"),
                    )
                })?;
                Some(Sealed::new(keys, authenticated, &stream))
            }
            None => None,
        };
        let ours = wire::encode_json(Kind::Hello, 0, &self.hello());
        wire::write_all(&mut stream, &Sealed::seal(&mut sealed, ours)).map_err(io)?;
        let frame = self
            .read_sealed(&mut stream, deadline, &mut sealed)
            .map_err(|e| {
                dead(format!(
                    "the prefill {peer} did not answer the handshake: {e:?}"
                ))
            })?;
        let peer_interval = self.answer(peer, &frame)?;
        self.add_link(stream, peer.to_string(), peer_interval, sealed)
            .map_err(dead)
    }

    /// [`Self::open`] over UCX: the UCX thread connects and exchanges the HELLOs.
    fn open_ucx(
        self: &Arc<Self>,
        port: &Port,
        peer: &str,
        addrs: &[SocketAddr],
        deadline: Instant,
    ) -> std::result::Result<Arc<Link>, (FailReason, String)> {
        let dead = |m: String| (FailReason::PeerDead, m);
        let addr = *addrs
            .first()
            .ok_or_else(|| dead(format!("the prefill {peer} has no address")))?;
        let hello = wire::encode_json(Kind::Hello, 0, &self.hello());
        let c = port.connect(addr, hello, deadline).map_err(|e| match e {
            NotConnected::Unauthenticated(m) => (
                FailReason::Mismatch,
                format!("the prefill {peer} did not authenticate: {m}"),
            ),
            NotConnected::Lost(e) => dead(format!(
                "cannot connect to the prefill {peer}: {e}: check pd_peer (what \
                 dsv4_pd_endpoint returned on the prefill engine) and that it is running"
            )),
        })?;
        let peer_interval = match self.answer(peer, &c.answer) {
            Ok(i) => i,
            Err(e) => {
                port.drop_conn(c.conn);
                return Err(e);
            }
        };
        let keys = self
            .cfg
            .auth
            .as_ref()
            .zip(c.authenticated.as_ref())
            .map(|(secrets, a)| secrets.link_keys(a.index, &a.keys));
        let added = self.add_link_with(peer.to_string(), keys, |id, p, _| {
            Ok(self.start_ucx_link(id, p, port.clone(), peer_interval))
        });
        match added {
            Ok((link, handler)) => {
                if !c.rma_lane && !self.rma_keys.is_empty() && !self.cfg.rma_emulated {
                    log::info!(
                        "PD: the UCX endpoint to the prefill {peer} has no RMA lane (its \
                         transports: {}): UCX would emulate puts with messages, so states \
                         come as active messages (pd.ucx_rma_emulated = true forces RMA)",
                        c.transports.join(", ")
                    );
                    self.table().no_rma.insert(link.id);
                }
                port.bind(c.conn, link.clone(), handler);
                Ok(link)
            }
            Err(why) => {
                port.drop_conn(c.conn);
                Err(dead(why))
            }
        }
    }

    /// The prefill's answer to our HELLO: its heartbeat interval, or why the link cannot be.
    fn answer(
        &self,
        peer: &str,
        frame: &Frame,
    ) -> std::result::Result<Duration, (FailReason, String)> {
        Ok(match frame.kind {
            Kind::Hello => {
                let theirs: Hello = wire::parse(frame).map_err(|m| (FailReason::Mismatch, m))?;
                if let Some(why) = self.check_hello(&theirs, Side::Prefill) {
                    return Err(why);
                }
                super::bounds::peer_interval(theirs.heartbeat_interval_ms)
            }
            Kind::Refuse => {
                let r: Refusal = wire::parse(frame).map_err(|m| (FailReason::Mismatch, m))?;
                let hint = if r.message == handshake::REFUSED && self.cfg.auth.is_none() {
                    ": it requires authentication: give this engine the prefill's \
                     pd.auth_key_file"
                } else {
                    ""
                };
                return Err((
                    r.reason,
                    format!(
                        "the prefill {peer} refused the connection: {}{hint}",
                        r.message
                    ),
                ));
            }
            k => {
                return Err((
                    FailReason::Mismatch,
                    format!("the prefill {peer} answered the handshake with {k:?}"),
                ))
            }
        })
    }

    /// Reads one handshake frame, waiting until `deadline` unless the node shuts down (the
    /// stream's read timeout is [`POLL`]).
    fn read_handshake(
        &self,
        stream: &mut Stream,
        deadline: Instant,
    ) -> std::result::Result<Frame, wire::ReadError> {
        wire::read_frame(&mut |buf| self.handshake_fill(stream, deadline, buf))
    }

    /// [`Self::read_handshake`], then, on an authenticated connection outside TLS, the frame's
    /// MAC, checked.
    fn read_sealed(
        &self,
        stream: &mut Stream,
        deadline: Instant,
        sealed: &mut Option<Sealed>,
    ) -> std::result::Result<Frame, wire::ReadError> {
        let frame = self.read_handshake(stream, deadline)?;
        if let Some((_, recv)) = sealed.as_mut().and_then(|s| s.frames.as_mut()) {
            let mut tag = [0u8; super::seal::TAG];
            self.handshake_fill(stream, deadline, &mut tag)?;
            let header = wire::header(frame.kind, frame.payload.len(), frame.room);
            if !recv.check(&[&header, &frame.payload], &tag) {
                return Err(wire::ReadError::Protocol(format!(
                    "a {:?} frame does not verify under the link's key",
                    frame.kind
                )));
            }
        }
        Ok(frame)
    }

    /// Fills `buf` from the handshake's stream by `deadline` (its read timeout is [`POLL`]),
    /// unless the node shuts down.
    fn handshake_fill(
        &self,
        stream: &mut Stream,
        deadline: Instant,
        buf: &mut [u8],
    ) -> std::io::Result<()> {
        use std::io::{ErrorKind as K, Read};
        let mut at = 0;
        while at < buf.len() {
            // Checked at every turn, not only when a read times out: a peer that sends a byte
            // at a time gets no more time.
            if self.closing.load(Ordering::SeqCst) || Instant::now() >= deadline {
                return Err(std::io::Error::new(K::TimedOut, "no handshake in time"));
            }
            match stream.read(&mut buf[at..]) {
                Ok(0) => return Err(std::io::Error::new(K::UnexpectedEof, "connection closed")),
                Ok(n) => at += n,
                Err(e) if super::tls::is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn on_down(&self, link: &Arc<Link>, why: String) {
        let mut notices = Vec::new();
        {
            let mut t = self.table();
            t.links.remove(&link.id);
            t.link_keys.remove(&link.id);
            t.peer_regions.remove(&link.id);
            t.no_rma.remove(&link.id);
            if t.by_peer.get(&link.peer) == Some(&link.id) {
                t.by_peer.remove(&link.peer);
            }
            t.early.retain(|_, e| e.link != link.id);
            // Landed rooms have their state: the peer going away no longer matters to them.
            t.landed.retain(|_, l| l.1 != link.id);
            let rooms: Vec<u64> = t
                .rooms
                .iter()
                .filter(|(_, r)| r.link == Some(link.id))
                .map(|(&id, _)| id)
                .collect();
            if !self.closing.load(Ordering::SeqCst) {
                log::warn!("PD: link {} to {} is down: {why}", link.id, link.peer);
            }
            for room in rooms {
                self.fail(
                    &mut t,
                    room,
                    FailReason::PeerDead,
                    &format!("the peer {} is gone: {why}", link.peer),
                    true,
                    &mut notices,
                );
            }
        }
        self.emit(notices);
    }

    fn on_frame(&self, link: &Arc<Link>, frame: Frame) {
        let mut notices = Vec::new();
        let (room, kind) = (frame.room, frame.kind);
        {
            let mut t = self.table();
            if self.cfg.side == Side::Decode
                && matches!(kind, Kind::Done | Kind::Fail | Kind::Flushed)
                && t.written.get(&room).is_some_and(|w| w.link == link.id)
            {
                // The prefill flushed its RMA writes before this: nothing more lands.
                let w = t.written.remove(&room).expect("checked");
                if w.asked.is_some() {
                    notices.push(Notice::Released { room });
                }
            }
            // A frame for a room that ended (or never was) here, or that another link holds,
            // is dropped, except a claim, which is answered. A room no link holds yet (a
            // prefill's room before its claim, a decode's before its claim went out) takes
            // frames from none: another decode cannot fail or acknowledge it.
            let ours = t.rooms.get(&room).is_some_and(|r| r.link == Some(link.id));
            match (self.cfg.side, frame.kind) {
                (Side::Prefill, Kind::Claim) => self.on_claim(&mut t, link, frame, &mut notices),
                (Side::Prefill, Kind::Ack) if ours => {
                    if let Some(mut r) = t.rooms.remove(&room) {
                        r.state = RoomState::Done;
                        let bytes = r.outgoing.as_ref().map_or(0, |o| o.bytes.len());
                        if r.target.is_some() {
                            t.stats.rma_bytes += bytes as u64;
                        }
                        t.transferred(room, bytes, r.claimed_at);
                        notices.push(Notice::Transferred {
                            room,
                            request: r.request_id,
                        });
                    }
                }
                (Side::Prefill, Kind::Fail)
                    if t.early.get(&room).is_some_and(|e| e.link == link.id) =>
                {
                    t.early.remove(&room);
                    let f: Failure = wire::parse(&frame).unwrap_or(Failure {
                        reason: FailReason::Aborted,
                        message: "an unreadable FAIL frame".into(),
                    });
                    // Bounded like the early claims it replaces: a peer pairing claims with
                    // FAILs cannot grow it past pd.max_rooms.
                    if t.failed_early.len() < self.cfg.max_rooms {
                        t.failed_early.insert(room, (Instant::now(), f));
                    } else {
                        log::warn!(
                            "PD room {room}: the decode failed it before its request came, and \
                             pd.max_rooms = {} such rooms are remembered already: its request \
                             will wait for a claim",
                            self.cfg.max_rooms
                        );
                    }
                }
                (Side::Decode, Kind::Fail)
                    if t.landed.get(&room).is_some_and(|l| l.1 == link.id) =>
                {
                    let (request, _) = t.landed.remove(&room).expect("checked");
                    let f: Failure = wire::parse(&frame).unwrap_or(Failure {
                        reason: FailReason::Aborted,
                        message: "an unreadable FAIL frame".into(),
                    });
                    let text = format!(
                        "room {room} (request {request} on the decode {}, peer {}, phase done): \
                         the prefill failed the room after its state landed: {} ({})",
                        self.endpoint,
                        link.peer,
                        f.message,
                        f.reason.label()
                    );
                    log::warn!("PD {text}");
                    // It was counted as transferred when it landed; its request fails now.
                    t.count_failure(f.reason);
                    notices.push(Notice::Failed {
                        room,
                        request,
                        error: Error::new(ErrorKind::KvTransfer, text),
                    });
                }
                (_, Kind::Fail) if ours => {
                    let f: Failure = wire::parse(&frame).unwrap_or(Failure {
                        reason: FailReason::Mismatch,
                        message: "an unreadable FAIL frame".into(),
                    });
                    let msg = format!("the peer failed the room: {}", f.message);
                    self.fail(&mut t, room, f.reason, &msg, true, &mut notices);
                }
                (Side::Decode, Kind::State | Kind::Data | Kind::Done) if ours => {
                    if let Err((reason, msg)) = self.on_bytes(&mut t, &frame, &mut notices) {
                        self.fail(&mut t, room, reason, &msg, false, &mut notices);
                    }
                }
                (_, k) => {
                    log::debug!("PD: dropped a {k:?} frame for room {room} (not open here)");
                }
            }
            if self.cfg.side == Side::Prefill && kind == Kind::Fail && link.is_ucx() {
                // The decode frees the room's destination once nothing more can land in it:
                // the UCX thread flushes the room's RMA writes before this goes out.
                link.send(wire::encode(Kind::Flushed, room, &[]));
            }
        }
        self.emit_or_hold(link, notices);
    }

    /// UCX: the link's endpoint is closed: destinations its prefill was writing by RMA may
    /// be freed.
    fn on_closed(&self, link: &Arc<Link>) {
        let mut notices = Vec::new();
        {
            let mut t = self.table();
            let rooms: Vec<u64> = t
                .written
                .iter()
                .filter(|(_, w)| w.link == link.id)
                .map(|(&room, _)| room)
                .collect();
            for room in rooms {
                if t.written.remove(&room).is_some_and(|w| w.asked.is_some()) {
                    notices.push(Notice::Released { room });
                }
            }
        }
        self.emit(notices);
    }

    fn on_claim(&self, t: &mut Table, link: &Arc<Link>, frame: Frame, notices: &mut Vec<Notice>) {
        let room = frame.room;
        let claim: Claim = match wire::parse(&frame) {
            Ok(c) => c,
            Err(m) => {
                link.send(wire::encode_json(
                    Kind::Fail,
                    room,
                    &Failure {
                        reason: FailReason::Mismatch,
                        message: m,
                    },
                ));
                return;
            }
        };
        if let Some(r) = t.rooms.get_mut(&room).filter(|r| r.active) {
            // The claim the room took, again on the same connection: a repeated frame (a relay
            // or proxy that sends it twice) changes nothing. Failing the room for it raced the
            // transfer the first claim started: the decode could land the state and finish
            // while this side reported the room failed.
            if r.link == Some(link.id) && r.claim.as_ref() == Some(&claim) {
                log::debug!(
                    "PD room {room}: the same claim again on link {}: ignored",
                    link.id
                );
                return;
            }
            if r.link.is_some_and(|held| held != link.id) {
                // Another decode holds the room: its transfer goes on; the claimer is told
                // only that the room is taken.
                log::warn!(
                    "PD room {room}: a claim from {} (link {}) refused: link {:?} holds it",
                    link.peer,
                    link.id,
                    r.link
                );
                link.send(wire::encode_json(
                    Kind::Fail,
                    room,
                    &Failure {
                        reason: FailReason::Mismatch,
                        message: format!("room {room} is claimed by another decode engine"),
                    },
                ));
                return;
            }
            r.peer = Some(link.peer.clone());
            r.link = Some(link.id);
            self.take_claim(t, room, claim, notices);
            return;
        }
        let refuse = |reason, message: String| {
            link.send(wire::encode_json(
                Kind::Fail,
                room,
                &Failure { reason, message },
            ));
        };
        if let Some((_, how)) = t.ended.get(&room).filter(|_| !t.rooms.contains_key(&room)) {
            refuse(
                FailReason::Mismatch,
                format!("room {room} on the prefill {}: {how}", self.endpoint),
            );
        } else if t.early.get(&room).is_some_and(|e| e.link != link.id) {
            log::warn!(
                "PD room {room}: a claim from {} (link {}) refused: another link claimed it \
                 first",
                link.peer,
                link.id
            );
            refuse(
                FailReason::Mismatch,
                format!("room {room} is claimed by another decode engine"),
            );
        } else if t.early.len() >= self.cfg.max_rooms {
            refuse(
                FailReason::Capacity,
                format!(
                    "the prefill {} holds pd.max_rooms = {} early claims already",
                    self.endpoint, self.cfg.max_rooms
                ),
            );
        } else {
            t.early.insert(
                room,
                EarlyClaim {
                    claim,
                    link: link.id,
                    peer: link.peer.clone(),
                    deadline: Instant::now() + self.cfg.bootstrap_timeout,
                },
            );
        }
    }

    /// Decode: where a DATA frame's bytes are read to (the destination, or the room's
    /// buffer), when the frame is one `on_bytes` would take (else `None`: it goes there whole
    /// and is refused by name). Until [`Self::put_back`] the room counts as lent: only this
    /// link's reader sends the room bytes, one frame at a time, and the engine does not get
    /// the destination back meanwhile ([`Node::release_landing`]).
    fn lend(&self, link: &Arc<Link>, room: u64, offset: u64, len: usize) -> Option<Lent> {
        if self.cfg.side != Side::Decode || len == 0 {
            return None;
        }
        let mut t = self.table();
        let r = t.rooms.get_mut(&room)?;
        if r.link.is_some_and(|l| l != link.id) {
            return None;
        }
        if (r.incoming.is_none() && r.state != RoomState::Claimed) || r.by_rma {
            // Refused by `on_bytes`, whole.
            return None;
        }
        let lent = r.incoming().lend(offset, len)?;
        if matches!(lent, Lent::Direct(_)) {
            t.lent.insert(room, false);
        }
        Some(lent)
    }

    /// Decode: what [`Self::lend`] lent, back: `filled` with `len` more bytes at `offset`, or
    /// not (the connection failed meanwhile). A room that ended meanwhile just drops it.
    fn put_back(
        &self,
        room: u64,
        offset: u64,
        len: usize,
        lent: Lent,
        filled: bool,
    ) -> Option<Notice> {
        // The running CRC is extended over the bytes here, before the table is taken again:
        // ~5 µs a 256 KiB frame that the engine thread (landing, claiming) would otherwise
        // wait through.
        let base = (filled && len > 0)
            .then(|| {
                let t = self.table();
                let inc = t.rooms.get(&room)?.incoming.as_ref()?;
                inc.crc_base(offset)
            })
            .flatten();
        let ahead = base.and_then(|base| {
            // Checked by `lend`.
            let start = offset as usize;
            // SAFETY: `lent` is not back yet (so its destination stays reserved: a release
            // meanwhile waits for `put_back`, see `t.lent`), and the link's reader, this
            // thread, just filled `start..start + len` through it.
            let crc = unsafe { super::incoming::ahead_crc(&lent, base, start, start + len) };
            crc.map(|crc| (base, crc))
        });
        let mut t = self.table();
        let released = match lent {
            Lent::Direct(_) => t.lent.remove(&room).unwrap_or(false),
            _ => false,
        };
        if let Some(inc) = t.rooms.get_mut(&room).and_then(|r| r.incoming.as_mut()) {
            let early = inc.header.is_none();
            inc.put_back(offset, len, lent, filled, ahead);
            if early && filled {
                t.stats.early_bytes += len as u64;
            }
        }
        released.then_some(Notice::Released { room })
    }

    /// Decode: STATE, DATA and DONE frames of a claimed room, checked strictly.
    fn on_bytes(
        &self,
        t: &mut Table,
        frame: &Frame,
        notices: &mut Vec<Notice>,
    ) -> std::result::Result<(), (FailReason, String)> {
        let room = frame.room;
        // An authenticated link's RMA key: a room it writes by RMA ends with a DONE whose MAC
        // covers the bytes (looked up for DONE only: not on every DATA frame's path).
        let rma_key = (frame.kind == Kind::Done)
            .then(|| {
                t.rooms
                    .get(&room)
                    .and_then(|r| r.link)
                    .and_then(|l| t.link_keys.get(&l))
                    .map(|k| k.rma.clone())
            })
            .flatten();
        let r = t.rooms.get_mut(&room).expect("checked by the caller");
        let mismatch = |m: String| (FailReason::Mismatch, m);
        match frame.kind {
            Kind::State => {
                if r.state != RoomState::Claimed {
                    return Err(mismatch(format!(
                        "a STATE frame arrived in state {}",
                        r.state.label()
                    )));
                }
                let header: StateHeader = wire::parse(frame).map_err(mismatch)?;
                let len = usize::try_from(header.state.bytes).unwrap_or(usize::MAX);
                let claim = r.claim.as_ref().expect("claimed");
                if header.state.pages != claim.pages.len()
                    || header.state.position != claim.prompt_tokens
                {
                    return Err(mismatch(format!(
                        "the state covers {} tokens in {} pages, but the decode reserved {} pages \
                         for a {}-token prompt",
                        header.state.position,
                        header.state.pages,
                        claim.pages.len(),
                        claim.prompt_tokens
                    )));
                }
                if len > r.max_bytes {
                    return Err((
                        FailReason::Capacity,
                        format!(
                            "the state holds {len} bytes but the reserved destination takes at \
                             most {}",
                            r.max_bytes
                        ),
                    ));
                }
                let inc = r.incoming();
                // Pages sent early must lie inside the state the header describes.
                if let Some((_, &end)) = inc.ranges.iter().next_back() {
                    if end > len {
                        return Err(mismatch(format!(
                            "pages sent early reach byte {end}, past the {len} bytes of the state"
                        )));
                    }
                }
                inc.set_len(len);
                inc.set_header_crc(&frame.payload);
                inc.header = Some(header);
                r.state = RoomState::Transferring;
            }
            Kind::Data => {
                if r.by_rma {
                    return Err(mismatch(
                        "a DATA frame arrived for a room whose claim named the destination's \
                         memory for RMA writes"
                            .into(),
                    ));
                }
                // Before the STATE frame only while claimed: complete pages sent early.
                if r.incoming.is_none() && r.state != RoomState::Claimed {
                    return Err(mismatch(format!(
                        "DATA arrived in state {}",
                        r.state.label()
                    )));
                }
                let inc = r.incoming();
                let (offset, bytes) = wire::split_data(&frame.payload)
                    .ok_or_else(|| mismatch("a DATA frame without its offset".into()))?;
                inc.put(offset, bytes).map_err(mismatch)?;
                if inc.header.is_none() {
                    t.stats.early_bytes += bytes.len() as u64;
                }
            }
            Kind::Done => {
                let Some(inc) = r.incoming.as_mut().filter(|i| i.header.is_some()) else {
                    return Err(mismatch("DONE arrived before the STATE frame".into()));
                };
                let done: Done = wire::parse(frame).map_err(mismatch)?;
                if r.by_rma {
                    // Written by RMA and flushed before DONE: every byte is in the pages.
                    inc.landed_whole();
                }
                if done.bytes != inc.received as u64 || inc.received != inc.len() {
                    return Err(mismatch(format!(
                        "DONE says {} bytes were sent; {} arrived of the {} the state holds",
                        done.bytes,
                        inc.received,
                        inc.len()
                    )));
                }
                if let Some(key) = rma_key.filter(|_| r.by_rma) {
                    // Written by RMA on an authenticated link: anyone holding the decode's
                    // remote keys could have written the bytes (and matched a CRC), so the
                    // link's keyed MAC checks them instead.
                    let tag = done
                        .mac
                        .as_deref()
                        .and_then(|h| auth::unhex(h, super::seal::TAG))
                        .and_then(|v| <[u8; super::seal::TAG]>::try_from(v).ok());
                    let Some(tag) = tag else {
                        return Err((
                            FailReason::Checksum,
                            "the DONE of a room written by RMA on an authenticated link \
                             carries no MAC over the bytes"
                                .into(),
                        ));
                    };
                    if inc.mac_matches(&key, room, &tag) != Some(true) {
                        return Err((
                            FailReason::Checksum,
                            "the bytes written by RMA do not verify under the link's key (MAC): \
                             they are not the ones the prefill sent"
                                .into(),
                        ));
                    }
                } else {
                    // Disjoint ranges adding up to the length cover every byte once, so the
                    // running CRC has reached the end.
                    let crc = inc.crc().ok_or_else(|| {
                        mismatch(format!(
                            "the bytes are in but their CRC stopped at byte {} of {} (a dsv4 bug)",
                            inc.crc_upto,
                            inc.len()
                        ))
                    })?;
                    if done.crc32c != crc {
                        return Err((
                            FailReason::Checksum,
                            format!(
                                "the bytes arrived with CRC-32C {crc:#010x}, the prefill sent \
                                 {:#010x}",
                                done.crc32c
                            ),
                        ));
                    }
                }
                let header = inc.header.take().expect("checked");
                let bytes = inc.take_bytes();
                // Kept (without its bytes) for the transferred byte count.
                inc.ranges.clear();
                r.state = RoomState::Delivered;
                notices.push(Notice::Received {
                    room,
                    request: r.request_id,
                    delivery: Box::new(Delivery { header, bytes }),
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// Room deadlines, early claims and old tombstones.
    fn timer_loop(self: Arc<Self>) {
        crate::threads::mark_internal();
        let tick = (self.cfg.heartbeat_interval / 4)
            .clamp(Duration::from_millis(5), Duration::from_millis(50));
        // Ended rooms and rooms a decode failed early are remembered this long, at most a
        // minute.
        let keep = (self.cfg.bootstrap_timeout.max(self.cfg.transfer_timeout) * 2)
            .min(Duration::from_secs(60));
        let mut t = self.table();
        while !self.closing.load(Ordering::SeqCst) {
            t = self
                .tick
                .wait_timeout(t, tick)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            let now = Instant::now();
            let mut notices = Vec::new();
            let late: Vec<(u64, RoomState)> = t
                .rooms
                .iter()
                .filter(|(_, r)| now >= r.deadline && !r.state.is_final())
                .map(|(&id, r)| (id, r.state))
                .collect();
            for (room, state) in late {
                let msg = match state {
                    RoomState::Bootstrapping => match self.cfg.side {
                        Side::Prefill => format!(
                            "no decode engine claimed it within pd.bootstrap_timeout_ms = {}",
                            self.cfg.bootstrap_timeout.as_millis()
                        ),
                        Side::Decode => format!(
                            "its destination could not be reserved and claimed within \
                             pd.bootstrap_timeout_ms = {}",
                            self.cfg.bootstrap_timeout.as_millis()
                        ),
                    },
                    _ => format!(
                        "it was not done within pd.transfer_timeout_ms = {} of its claim",
                        self.cfg.transfer_timeout.as_millis()
                    ),
                };
                self.fail(&mut t, room, FailReason::Timeout, &msg, false, &mut notices);
            }
            let expired: Vec<u64> = t
                .early
                .iter()
                .filter(|(_, e)| now >= e.deadline)
                .map(|(&id, _)| id)
                .collect();
            for room in expired {
                let e = t.early.remove(&room).expect("listed");
                if let Some(link) = t.links.get(&e.link) {
                    link.send(wire::encode_json(
                        Kind::Fail,
                        room,
                        &Failure {
                            reason: FailReason::Timeout,
                            message: format!(
                                "room {room}: no request for it reached the prefill {} within \
                                 pd.bootstrap_timeout_ms = {} of the claim",
                                self.endpoint,
                                self.cfg.bootstrap_timeout.as_millis()
                            ),
                        },
                    ));
                }
                t.ended.insert(
                    room,
                    (now, "its claim waited for a request that never came".into()),
                );
            }
            // A prefill that answers neither the FAIL nor its heartbeats in time is cut off:
            // its endpoint closes, and with it the destinations it was writing.
            let grace = (self.cfg.heartbeat_interval * self.cfg.heartbeat_misses)
                .max(Duration::from_secs(1));
            let silent: Vec<u64> = t
                .written
                .values()
                .filter(|w| w.asked.is_some_and(|a| now.duration_since(a) >= grace))
                .map(|w| w.link)
                .collect();
            for id in silent {
                if let Some(link) = t.links.get(&id).cloned() {
                    log::warn!(
                        "PD: the prefill {} did not confirm within {} ms that it stopped \
                         writing into an ended room's destination: its connection is closed",
                        link.peer,
                        grace.as_millis()
                    );
                    let handler: Arc<dyn Handler> = Arc::new(LinkHandler(Arc::downgrade(&self)));
                    drop(t);
                    link.go_down(&handler, "it did not confirm its RMA writes stopped".into());
                    t = self.table();
                }
            }
            t.ended.retain(|_, (at, _)| now.duration_since(*at) < keep);
            t.failed_early
                .retain(|_, (at, _)| now.duration_since(*at) < keep);
            if !notices.is_empty() {
                drop(t);
                self.emit(notices);
                t = self.table();
            }
        }
    }
}
