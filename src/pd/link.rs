//! One connection to a peer engine, shared by every room between the two. Over TCP: a writer
//! thread that sends control frames before bulk data and a heartbeat whenever it has been idle
//! for an interval, and a reader thread that hands each frame to the node and declares the peer
//! dead once it has been silent for `heartbeat_misses` intervals. Over UCX the node's UCX
//! thread ([`super::ucx_port`]) does both for every link, taking frames from the same outbox in
//! the same order and handing frames to the same handler.
//!
//! Bulk data goes out in frames of at most [`wire::DATA_CHUNK`] bytes, so a heartbeat, a claim
//! or a FAIL waits behind one frame at most, never behind a whole state. Between rooms, the one
//! with the fewest bytes left goes next, frame by frame: a small room overtakes a large one at
//! the next frame, and rooms of one size finish one after another — each lands (and its first
//! token goes out) while the next is on the wire — instead of all at the end, as taking turns
//! would have them. So that a stream of smaller rooms cannot starve a large one until its
//! transfer deadline fails it, rooms queued for `STARVED_AFTER` (250 ms) go first, oldest first.
//!
//! Frames queued while the writer thread is idle are written at once by the caller, without
//! blocking (`MSG_DONTWAIT`): what the socket takes, up to `DIRECT_BYTES`; the rest goes to
//! the writer thread. Waking the writer costs tens of microseconds on a busy machine, and a room
//! crosses several such hand-offs (the decode's claim, the prefill's first frame, the ACK).
//! Every write uses `MSG_NOSIGNAL`: a peer that hangs up must not raise SIGPIPE in the host.
//!
//! The reader reads `READ_AHEAD` (8 KiB) ahead, so the next frame's header usually comes with
//! the bytes before it; a DATA frame's bytes go straight into the room's destination. Between
//! frames it tells its handler whether the next frame is already in
//! ([`Handler::between_frames`]), so good news can wait for the rest of a burst.
//!
//! A frame queued with [`Link::send_lazy`] (an ACK while more rooms are arriving) waits for
//! other frames to go with, until its deadline.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{self, BufReader, ErrorKind as IoKind, IoSliceMut, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::buffers::StateBuf;
use super::incoming::Lent;
use super::rma::Target;
use super::seal::{self, Sequence};
use super::tls::Stream;
use super::wire::{self, Frame, Kind, ReadError};

/// At most this many bytes are written by a caller directly (without blocking) before the rest
/// is left to the writer thread: a few DATA frames, a typical room's state (the caller may hold
/// the node's table meanwhile).
const DIRECT_BYTES: usize = 1 << 20;

/// A room's bytes queued this long go ahead of rooms with fewer bytes left (oldest first): a
/// room moves in milliseconds unless the link is overloaded, and then every room gets its turn
/// in order instead of the largest waiting until its deadline.
const STARVED_AFTER: Duration = Duration::from_millis(250);

/// The reader reads up to this many bytes ahead: a frame's header (and a DATA frame's offset)
/// usually arrive with the bytes before them, one system call instead of three per frame.
/// Reads of at least this many bytes go straight into their destination (`BufReader` skips
/// its buffer for them), so a DATA frame's bytes are copied out of the buffer at most this
/// many.
const READ_AHEAD: usize = 8 << 10;

/// The reader's end of a TCP link.
type Reader = BufReader<Stream>;

/// Consecutive control frames are written together up to this many bytes.
const COALESCE_BYTES: usize = 64 << 10;

thread_local! {
    /// This thread's [`Cork`]s held (nesting depth), and the TCP links it queued frames on
    /// meanwhile.
    static CORK: RefCell<(usize, Vec<Arc<Link>>)> = const { RefCell::new((0, Vec::new())) };
}

/// While a cork is held, frames the holding thread queues on TCP links wait in their
/// outboxes; when the last is dropped each such link writes what it has, consecutive control
/// frames in one write. A PD engine's thread holds one while it handles what arrived and
/// another while it admits: the claims of requests admitted together (and the ACKs of rooms landed
/// together) then cost one system call, and one wake-up of the peer's reader, instead of one
/// each — on loopback a `sendmsg` runs the peer's whole receive path. Other threads' frames
/// are not held, and a writer thread already at work sends what is queued, corked or not.
/// Not `Send`: it belongs to the thread that took it.
pub struct Cork(std::marker::PhantomData<*const ()>);

impl Cork {
    pub fn hold() -> Self {
        CORK.with(|c| c.borrow_mut().0 += 1);
        Cork(std::marker::PhantomData)
    }

    /// Whether this thread holds a cork; if so, `link` is written when it is dropped.
    fn defer(link: &Arc<Link>) -> bool {
        CORK.with(|c| {
            let mut c = c.borrow_mut();
            if c.0 == 0 {
                return false;
            }
            if !c.1.iter().any(|l| Arc::ptr_eq(l, link)) {
                c.1.push(link.clone());
            }
            true
        })
    }
}

impl Drop for Cork {
    fn drop(&mut self) {
        let links = CORK.with(|c| {
            let mut c = c.borrow_mut();
            c.0 -= 1;
            if c.0 == 0 {
                std::mem::take(&mut c.1)
            } else {
                Vec::new()
            }
        });
        for link in links {
            link.flush();
        }
    }
}

/// What the link reports to its owner (the node).
pub trait Handler: Send + Sync + 'static {
    fn on_frame(&self, link: &Arc<Link>, frame: Frame);
    /// A DATA frame's `len` bytes at `offset` of `room`'s state are about to be read: where
    /// they go (read straight from the socket into the room's destination or its buffer,
    /// without a frame buffer and a copy), handed back by [`Self::put_back`]. `None`: read the
    /// frame whole and pass it to `on_frame` (which checks and refuses what does not fit).
    fn lend(&self, _link: &Arc<Link>, _room: u64, _offset: u64, _len: usize) -> Option<Lent> {
        None
    }
    /// What `lend` lent, back: holding the DATA frame's bytes at `offset` when `filled`, else
    /// the connection failed while they were read (the link goes down next).
    fn put_back(
        &self,
        _link: &Arc<Link>,
        _room: u64,
        _offset: u64,
        _len: usize,
        _lent: Lent,
        _filled: bool,
    ) {
    }
    /// TCP: the reader is between two frames; `more_ready` says whether the next one's bytes
    /// (some of them) are already in (a system call when nothing is buffered: call it only
    /// when the answer matters).
    fn between_frames(&self, _link: &Arc<Link>, _more_ready: &mut dyn FnMut() -> bool) {}
    /// The link is down (`why`); called once.
    fn on_down(&self, link: &Arc<Link>, why: String);
    /// UCX: the link's endpoint is closed (after [`Self::on_down`]): nothing the peer wrote by
    /// RMA can land any more.
    fn on_closed(&self, _link: &Arc<Link>) {}
}

/// A piece of a room's outgoing bytes: a ready frame (STATE, DONE), or state bytes that go out
/// as DATA frames of at most [`wire::DATA_CHUNK`] bytes.
pub enum Segment {
    Frame(Vec<u8>),
    /// `bytes[range]` is the state's bytes from offset `at`.
    Data {
        at: u64,
        bytes: Arc<StateBuf>,
        range: std::ops::Range<usize>,
    },
}

/// One room's bytes on their way out, in order: complete pages sent early while the prompt
/// is still computing, then the STATE frame, the rest of the bytes and the DONE frame.
pub struct Bulk {
    pub room: u64,
    segments: VecDeque<Segment>,
    /// Bytes of the segments still to go (frames and state bytes, without DATA headers).
    left: usize,
    /// When the room's bytes were queued (those appended later wait with them).
    since: Instant,
    /// Set when the room ends: the rest is not sent.
    pub cancel: Arc<AtomicBool>,
    /// Over UCX, where the decode's claim named its memory: the state's bytes are written
    /// there by RMA instead of going as DATA frames.
    target: Option<Arc<Target>>,
}

impl Bulk {
    /// The whole state at once: STATE, every byte of `data`, DONE.
    pub fn new(
        room: u64,
        state_frame: Vec<u8>,
        data: Arc<StateBuf>,
        done_frame: Vec<u8>,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        let range = 0..data.len();
        Self::of(
            room,
            vec![
                Segment::Frame(state_frame),
                Segment::Data {
                    at: 0,
                    bytes: data,
                    range,
                },
                Segment::Frame(done_frame),
            ],
            cancel,
        )
    }

    /// `segments`, in order.
    pub fn of(room: u64, segments: Vec<Segment>, cancel: Arc<AtomicBool>) -> Self {
        let left = segments.iter().map(Segment::len).sum();
        Self {
            room,
            segments: segments.into(),
            left,
            since: Instant::now(),
            cancel,
            target: None,
        }
    }

    /// The state's bytes go to `target` by RMA (over UCX).
    pub fn with_target(mut self, target: Option<Arc<Target>>) -> Self {
        self.target = target;
        self
    }

    /// The next frame to write and whether it was the last one queued.
    fn next_frame(&mut self) -> (Out, bool) {
        let out = loop {
            match self.segments.front_mut() {
                None => return (Out::Frame(wire::encode(Kind::Heartbeat, 0, &[])), true),
                Some(Segment::Frame(f)) => {
                    let f = std::mem::take(f);
                    self.segments.pop_front();
                    self.left -= f.len();
                    break Out::Frame(f);
                }
                Some(Segment::Data { at, bytes, range }) => {
                    if range.start >= range.end {
                        self.segments.pop_front();
                        continue;
                    }
                    let end = (range.start + wire::DATA_CHUNK).min(range.end);
                    let out = Out::Data {
                        prefix: wire::data_prefix(self.room, *at, end - range.start),
                        bytes: bytes.clone(),
                        range: range.start..end,
                        target: self.target.clone(),
                        tag: None,
                    };
                    *at += (end - range.start) as u64;
                    self.left -= end - range.start;
                    range.start = end;
                    if range.start >= range.end {
                        self.segments.pop_front();
                    }
                    break out;
                }
            }
        };
        (out, self.segments.is_empty())
    }
}

impl Segment {
    fn len(&self) -> usize {
        match self {
            Segment::Frame(f) => f.len(),
            Segment::Data { range, .. } => range.len(),
        }
    }
}

/// One frame for the writer: whole, or a DATA frame's header and offset then a slice of the
/// room's bytes (written together, without copying the bytes into a frame first).
pub(super) enum Out {
    Frame(Vec<u8>),
    Data {
        prefix: [u8; wire::HEADER + 8],
        bytes: Arc<StateBuf>,
        range: std::ops::Range<usize>,
        /// Over UCX: the decode's memory the bytes are written into by RMA (the frame itself
        /// does not go out).
        target: Option<Arc<Target>>,
        /// On an authenticated TCP link: the frame's MAC, written after the bytes.
        tag: Option<[u8; seal::TAG]>,
    },
    /// The rest of a frame the socket took only part of: `frame`'s bytes from `sent` on (the
    /// frame is kept, not its rest copied: a DATA frame's slice is up to 256 KiB).
    Rest {
        frame: Box<Out>,
        sent: usize,
    },
}

impl Out {
    /// The frame's bytes as they go on the wire, in three parts: the frame (or a DATA
    /// frame's header and offset), a DATA frame's slice of the state, and its MAC (on an
    /// authenticated TCP link).
    pub(super) fn wire_parts(&self) -> [&[u8]; 3] {
        match self {
            Out::Frame(f) => [f, &[], &[]],
            Out::Data {
                prefix,
                bytes,
                range,
                tag,
                ..
            } => [
                prefix,
                &bytes[range.clone()],
                tag.as_ref().map_or(&[][..], |t| &t[..]),
            ],
            Out::Rest { frame, sent } => {
                let mut parts = frame.wire_parts();
                advance(&mut parts, *sent);
                parts
            }
        }
    }

    /// UCX: the frame's header and body (a UCX message's MAC goes in its header: the UCX
    /// thread seals messages in the order it sends them, `ucx_port`).
    pub(super) fn parts(&self) -> (&[u8], &[u8]) {
        let [a, b, _] = self.wire_parts();
        (a, b)
    }

    fn len(&self) -> usize {
        self.wire_parts().iter().map(|p| p.len()).sum()
    }

    /// What is left of this frame once the socket took `n` more of its bytes.
    fn rest(self, n: usize) -> Out {
        match self {
            Out::Rest { frame, sent } => Out::Rest {
                frame,
                sent: sent + n,
            },
            frame => Out::Rest {
                frame: Box::new(frame),
                sent: n,
            },
        }
    }

    /// Writes the whole frame, blocking (up to the socket's write timeout).
    fn write_blocking(&self, fd: RawFd) -> io::Result<()> {
        let mut parts = self.wire_parts();
        while parts.iter().any(|p| !p.is_empty()) {
            let n = match send_parts(fd, parts, 0) {
                Ok(0) => return Err(io::Error::new(IoKind::WriteZero, "the peer took no bytes")),
                Ok(n) => n,
                Err(e) if e.kind() == IoKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            advance(&mut parts, n);
        }
        Ok(())
    }
}

/// In TLS, `out` as the records that carry it (made now, in wire order: the caller holds the
/// wire lock); the rest of a frame the socket took part of is records already. `None` when
/// the session failed.
fn encrypted(tls: Option<&Arc<super::tls::Session>>, out: Out) -> Option<Out> {
    match (tls, out) {
        (Some(s), out @ (Out::Frame(_) | Out::Data { .. })) => {
            s.encrypt(&out.wire_parts()).ok().map(Out::Frame)
        }
        (_, out) => Some(out),
    }
}

/// `parts` without their first `n` bytes (in order across the parts).
fn advance(parts: &mut [&[u8]; 3], mut n: usize) {
    for p in parts.iter_mut() {
        let k = n.min(p.len());
        *p = &p[k..];
        n -= k;
    }
}

/// One `sendmsg` of `parts` in order (one system call, no copy into a frame first), with
/// `MSG_NOSIGNAL` and `extra` flags; the bytes the socket took.
fn send_parts(fd: RawFd, parts: [&[u8]; 3], extra: libc::c_int) -> io::Result<usize> {
    let mut iov = parts.map(|p| libc::iovec {
        iov_base: p.as_ptr() as *mut libc::c_void,
        iov_len: p.len(),
    });
    // SAFETY: an all-zero msghdr is valid (no address, no control data); only the iovec
    // fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `fd` is this link's open socket (the Link owns a clone of the stream for as long
    // as it lives); the iovecs point at `parts`, which outlive the call, and sendmsg only reads
    // them.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | extra) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

struct Outbox {
    /// The rest of a frame a caller started writing directly and the socket took only part
    /// of: the very next bytes on the wire.
    partial: Option<Out>,
    control: VecDeque<Vec<u8>>,
    /// Control frames that may wait until `lazy_due` for company ([`Link::send_lazy`]).
    lazy: Vec<Vec<u8>>,
    lazy_due: Option<Instant>,
    bulk: VecDeque<Bulk>,
    closed: bool,
    /// Closing once the queued control frames are out (the FAILs of an engine shutting
    /// down reach the peer).
    finishing: bool,
    /// When a frame last went out (a heartbeat is due an interval after).
    last_sent: Instant,
    /// Bytes of the control and lazy frames queued: past the link's cap the peer is dropped
    /// (a peer that reads nothing while its requests pile up answers).
    queued: usize,
    /// Why the link was dropped from here (its outbox overflowed): what the reader reports.
    dropped: Option<String>,
    /// An authenticated TCP link's MAC state for what it sends: each frame is sealed as it is
    /// taken for the wire (in wire order: the wire's lock is held).
    sealer: Option<Sequence>,
}

impl Outbox {
    fn new() -> Self {
        Self {
            partial: None,
            control: VecDeque::new(),
            lazy: Vec::new(),
            lazy_due: None,
            bulk: VecDeque::new(),
            closed: false,
            finishing: false,
            last_sent: Instant::now(),
            queued: 0,
            dropped: None,
            sealer: None,
        }
    }

    /// `frame` (one whole frame) with its tag where the link seals its frames.
    fn sealed(&mut self, frame: Vec<u8>) -> Vec<u8> {
        seal::sealed(self.sealer.as_mut(), frame)
    }

    /// The first control frame, sealed, no longer counted as queued.
    fn take_control(&mut self) -> Option<Vec<u8>> {
        let f = self.control.pop_front()?;
        self.queued = self.queued.saturating_sub(f.len());
        Some(self.sealed(f))
    }

    /// The next frame in wire order: a partial frame's rest, control frames, then a frame of
    /// the room with the fewest bytes left, or of the oldest room queued for [`STARVED_AFTER`]
    /// (none while finishing).
    fn pop(&mut self) -> Option<Out> {
        if let Some(rest) = self.partial.take() {
            return Some(rest);
        }
        if let Some(f) = self.take_control() {
            return Some(Out::Frame(f));
        }
        if self.finishing {
            return None;
        }
        self.bulk.retain(|b| !b.cancel.load(Ordering::SeqCst));
        // A scan of at most pd.max_rooms rooms once per frame of up to 256 KiB.
        let now = Instant::now();
        let oldest = (0..self.bulk.len()).min_by_key(|&i| self.bulk[i].since)?;
        let next = if now.duration_since(self.bulk[oldest].since) >= STARVED_AFTER {
            oldest
        } else {
            // The first of the rooms with the fewest bytes left.
            (0..self.bulk.len()).min_by_key(|&i| self.bulk[i].left)?
        };
        let (frame, last) = self.bulk[next].next_frame();
        if last {
            self.bulk.remove(next);
        }
        Some(match (frame, &mut self.sealer) {
            (frame, None) => frame,
            (Out::Frame(f), Some(s)) => Out::Frame(seal::sealed(Some(s), f)),
            (
                Out::Data {
                    prefix,
                    bytes,
                    range,
                    target,
                    ..
                },
                Some(s),
            ) => {
                let tag = s.tag(&[&prefix, &bytes[range.clone()]]);
                Out::Data {
                    prefix,
                    bytes,
                    range,
                    target,
                    tag: Some(tag),
                }
            }
            (rest @ Out::Rest { .. }, Some(_)) => rest,
        })
    }

    /// Over TCP, [`Self::pop`] with consecutive control frames joined into one (a byte
    /// stream does not care where a write ends): one system call for a burst of them. UCX
    /// sends each frame as its own message, so it pops them one by one.
    fn pop_stream(&mut self) -> Option<Out> {
        if self.partial.is_some() || self.control.len() < 2 {
            return self.pop();
        }
        let mut joined = self.take_control()?;
        while let Some(next) = self.control.front() {
            if joined.len() + next.len() > COALESCE_BYTES {
                break;
            }
            // Taken (and sealed) in order, then joined.
            let Some(f) = self.take_control() else { break };
            joined.extend_from_slice(&f);
        }
        Some(Out::Frame(joined))
    }

    /// The lazy frames join the control frames (after those queued before them).
    fn promote_lazy(&mut self) {
        self.control.extend(self.lazy.drain(..));
        self.lazy_due = None;
    }

    fn has_work(&self) -> bool {
        self.partial.is_some()
            || !self.control.is_empty()
            || (!self.finishing && !self.bulk.is_empty())
    }
}

/// What the writer thread does next.
enum Next {
    Write,
    Heartbeat,
    Stop,
}

/// How a link's frames travel.
enum Conn {
    /// A TCP connection (encrypted with `pd.tls`), with the link's own reader and writer
    /// threads.
    Tcp(Stream),
    /// An endpoint of the node's UCX thread, which sends and receives for every UCX link.
    Ucx(super::ucx_port::Port),
}

/// A live connection to one peer.
pub struct Link {
    pub id: u64,
    /// The peer's advertised endpoint (from its HELLO).
    pub peer: String,
    conn: Conn,
    out: Mutex<Outbox>,
    ready: Condvar,
    /// Held while a frame goes onto the socket (by the writer thread, or by a caller writing
    /// directly), and while the next frame is taken from the outbox: frames never interleave
    /// and leave in the order they were taken.
    wire: Mutex<()>,
    last_heard: Mutex<Instant>,
    down: AtomicBool,
    interval: Duration,
    peer_interval: Duration,
    dead_after: Duration,
    /// The most bytes of control frames queued for the peer before it is dropped.
    max_queued: usize,
}

impl Link {
    /// Starts the reader and writer threads over `stream` (HELLO already exchanged); their
    /// handles go to `threads`.
    /// `interval`: how often this side sends a heartbeat when idle; `peer_interval`: how
    /// often the peer does (from its HELLO); the peer is dead after `misses` of those.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        id: u64,
        peer: String,
        stream: Stream,
        interval: Duration,
        peer_interval: Duration,
        misses: u32,
        max_queued: usize,
        sequences: Option<(Sequence, Sequence)>,
        handler: Arc<dyn Handler>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> io::Result<Arc<Link>> {
        let peer_interval = peer_interval.max(Duration::from_millis(1));
        let dead_after = peer_interval * misses;
        let tcp = stream.tcp();
        tcp.set_nodelay(true)?;
        // The reader wakes every peer interval to check for silence; a write blocked that long
        // on a peer that stopped reading means the peer is gone.
        tcp.set_read_timeout(Some(peer_interval))?;
        tcp.set_write_timeout(Some(dead_after))?;
        let (send, opener) = sequences.unzip();
        let link = Arc::new(Link::new(
            id,
            peer,
            Conn::Tcp(stream.try_clone()?),
            interval,
            peer_interval,
            dead_after,
            max_queued,
        ));
        link.outbox().sealer = send;
        let reader_stream = stream.try_clone()?;
        let (l, h) = (link.clone(), handler.clone());
        threads.push(spawn(format!("dsv4-pd-read-{id}"), move || {
            l.read_loop(reader_stream, h, opener)
        })?);
        let (l, h) = (link.clone(), handler);
        threads.push(spawn(format!("dsv4-pd-write-{id}"), move || {
            l.write_loop(stream, h)
        })?);
        Ok(link)
    }

    /// A link over UCX: `port` (the node's UCX thread) sends its frames and hands it the
    /// peer's; no threads of its own. `interval`, `peer_interval`, `misses` as for TCP.
    pub fn start_ucx(
        id: u64,
        peer: String,
        port: super::ucx_port::Port,
        interval: Duration,
        peer_interval: Duration,
        misses: u32,
        max_queued: usize,
    ) -> Arc<Link> {
        let peer_interval = peer_interval.max(Duration::from_millis(1));
        Arc::new(Link::new(
            id,
            peer,
            Conn::Ucx(port),
            interval,
            peer_interval,
            peer_interval * misses,
            max_queued,
        ))
    }

    fn new(
        id: u64,
        peer: String,
        conn: Conn,
        interval: Duration,
        peer_interval: Duration,
        dead_after: Duration,
        max_queued: usize,
    ) -> Link {
        Link {
            id,
            peer,
            conn,
            out: Mutex::new(Outbox::new()),
            ready: Condvar::new(),
            wire: Mutex::new(()),
            last_heard: Mutex::new(Instant::now()),
            down: AtomicBool::new(false),
            interval,
            peer_interval,
            dead_after,
            max_queued,
        }
    }

    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a control frame (sent before any further bulk frame). False when the link is
    /// down.
    pub fn send(self: &Arc<Self>, frame: Vec<u8>) -> bool {
        self.queue(|o| {
            o.queued += frame.len();
            o.control.push_back(frame)
        })
    }

    /// Queues a room's bytes after any of the same room's still queued (a room's frames go
    /// out in the order queued). False when the link is down.
    pub fn send_bulk(self: &Arc<Self>, mut bulk: Bulk) -> bool {
        self.queue(|o| match o.bulk.iter_mut().find(|b| b.room == bulk.room) {
            Some(queued) => {
                queued.left += bulk.left;
                queued.segments.append(&mut bulk.segments);
            }
            None => o.bulk.push_back(bulk),
        })
    }

    /// Queues a control frame that may wait up to `within` for other frames to go with
    /// (any other frame queued takes it along): an ACK while more rooms are arriving on the
    /// link. Over TCP the burst is then one write and one wake-up of the peer's reader and
    /// engine thread, instead of one per room. UCX sends it at once.
    pub fn send_lazy(self: &Arc<Self>, frame: Vec<u8>, within: Duration) -> bool {
        if self.is_ucx() {
            return self.send(frame);
        }
        let mut o = self.outbox();
        if o.closed {
            return false;
        }
        o.queued += frame.len();
        o.lazy.push(frame);
        if o.queued > self.max_queued {
            return self.overflow(o);
        }
        let due = Instant::now() + within;
        if o.lazy_due.is_none_or(|d| due < d) {
            o.lazy_due = Some(due);
            // The writer thread sleeps until its next heartbeat: it now wakes by `due`.
            self.ready.notify_one();
        }
        true
    }

    /// Puts something in the outbox, then writes the next frame from here when nobody else is
    /// writing (else wakes the writer thread) — unless this thread holds a [`Cork`].
    fn queue(self: &Arc<Self>, put: impl FnOnce(&mut Outbox)) -> bool {
        let mut o = self.outbox();
        if o.closed {
            return false;
        }
        o.promote_lazy();
        put(&mut o);
        if o.queued > self.max_queued {
            return self.overflow(o);
        }
        if let Conn::Ucx(port) = &self.conn {
            drop(o);
            port.wake();
            return true;
        }
        if Cork::defer(self) {
            return true;
        }
        self.write_or_wake(o);
        true
    }

    /// The peer let more than `max_queued` bytes of frames pile up (it reads nothing): the
    /// link is closed and its reader (or the UCX thread) takes it down, saying so. False.
    fn overflow(&self, mut o: MutexGuard<'_, Outbox>) -> bool {
        o.dropped = Some(format!(
            "the peer read nothing while {} bytes of frames queued up for it \
             (pd.max_outbox_bytes = {}): it was dropped",
            o.queued, self.max_queued
        ));
        drop(o);
        self.close();
        false
    }

    /// Why the link was dropped from here, if it was.
    pub(super) fn dropped(&self) -> Option<String> {
        self.outbox().dropped.clone()
    }

    /// A cork was dropped: writes what this thread queued (and anything else waiting).
    fn flush(&self) {
        let o = self.outbox();
        if !o.closed && o.has_work() {
            self.write_or_wake(o);
        }
    }

    fn write_or_wake(&self, o: MutexGuard<'_, Outbox>) {
        // try_lock: never wait for the socket here (the caller may hold the node's table).
        match self.wire.try_lock() {
            Ok(wire) if !o.finishing => {
                drop(o);
                self.write_now(wire);
            }
            _ => self.ready.notify_one(),
        }
    }

    /// Writes queued frames without blocking, holding `wire`, while the socket takes them and
    /// up to [`DIRECT_BYTES`]: a room's state usually goes out whole from here. What is left
    /// (the socket is full, or the budget spent) goes to the writer thread, woken for it.
    fn write_now(&self, wire: MutexGuard<'_, ()>) {
        let Conn::Tcp(stream) = &self.conn else {
            return;
        };
        let (fd, tls) = (stream.tcp().as_raw_fd(), stream.session());
        let mut budget = DIRECT_BYTES;
        let mut o = self.outbox();
        while budget > 0 {
            let Some(out) = o.pop_stream() else {
                break;
            };
            drop(o);
            let Some(out) = encrypted(tls, out) else {
                // The session failed: the writer's next write reports why.
                o = self.outbox();
                break;
            };
            let sent = loop {
                match send_parts(fd, out.wire_parts(), libc::MSG_DONTWAIT) {
                    Err(e) if e.kind() == IoKind::Interrupted => continue,
                    // Full (or failing: the writer's blocking write reports why).
                    Err(_) => break 0,
                    Ok(n) => break n,
                }
            };
            o = self.outbox();
            if sent < out.len() {
                o.partial = Some(out.rest(sent));
                break;
            }
            o.last_sent = Instant::now();
            budget = budget.saturating_sub(sent);
        }
        drop(wire);
        if o.has_work() {
            self.ready.notify_one();
        }
    }

    /// Whether the link runs over UCX (where the state may be written by RMA).
    pub fn is_ucx(&self) -> bool {
        matches!(self.conn, Conn::Ucx(_))
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// Sends the queued control frames (bulk data is dropped), then closes the connection;
    /// the writer waits at most the write timeout for a peer that does not read.
    pub fn finish(&self) {
        let mut o = self.outbox();
        o.finishing = true;
        o.promote_lazy();
        o.bulk.clear();
        self.ready.notify_all();
        drop(o);
        if let Conn::Ucx(port) = &self.conn {
            port.wake();
        }
    }

    /// Closes the connection: both threads end, queued frames are dropped.
    pub fn close(&self) {
        self.outbox().closed = true;
        self.ready.notify_all();
        match &self.conn {
            Conn::Tcp(stream) => {
                let _ = stream.tcp().shutdown(Shutdown::Both);
            }
            Conn::Ucx(port) => port.wake(),
        }
    }

    /// Takes the link down once: closes it and tells the handler why.
    pub(super) fn go_down(self: &Arc<Self>, handler: &Arc<dyn Handler>, why: String) {
        if !self.down.swap(true, Ordering::SeqCst) {
            self.close();
            // Dropped from here: that is why, not the closed socket it left.
            let why = self.dropped().unwrap_or(why);
            handler.on_down(self, why);
        }
    }

    /// Waits (without the wire) until there is a frame to write or a heartbeat is due.
    fn wait_for_work(&self) -> Next {
        let mut o = self.outbox();
        loop {
            if o.closed {
                return Next::Stop;
            }
            let now = Instant::now();
            if o.lazy_due.is_some_and(|d| now >= d) {
                o.promote_lazy();
            }
            if o.has_work() {
                return Next::Write;
            }
            if o.finishing {
                return Next::Stop;
            }
            let heartbeat = o.last_sent + self.interval;
            if now >= heartbeat {
                return Next::Heartbeat;
            }
            let due = o.lazy_due.map_or(heartbeat, |d| d.min(heartbeat));
            o = self
                .ready
                .wait_timeout(o, due - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn write_loop(self: Arc<Self>, stream: Stream, handler: Arc<dyn Handler>) {
        crate::threads::mark_internal();
        let fd = stream.tcp().as_raw_fd();
        // Ends when closed (the link went down) or finished (its last frames are out).
        loop {
            let next = self.wait_for_work();
            let turn = self.wire.lock().unwrap_or_else(|e| e.into_inner());
            let frame = match next {
                Next::Stop => break,
                // A caller may have written it meanwhile: then wait again.
                Next::Write => match self.outbox().pop_stream() {
                    Some(f) => f,
                    None => continue,
                },
                // Unless a caller left the rest of a frame (or queued one) since: that goes
                // first, and it is no less a sign of life than a heartbeat.
                Next::Heartbeat => {
                    let mut o = self.outbox();
                    match o.pop_stream() {
                        Some(f) => f,
                        None => Out::Frame(o.sealed(wire::encode(Kind::Heartbeat, 0, &[]))),
                    }
                }
            };
            let written = match (stream.session(), &frame) {
                // What the socket did not take of a frame's records is written as it is.
                (Some(tls), Out::Frame(_) | Out::Data { .. }) => tls.send(&frame.wire_parts()),
                _ => frame.write_blocking(fd),
            };
            if let Err(e) = written {
                let why = match e.kind() {
                    IoKind::WouldBlock | IoKind::TimedOut => format!(
                        "the peer accepted no data for {} ms (it stopped reading)",
                        self.dead_after.as_millis()
                    ),
                    _ => format!("sending failed: {e}"),
                };
                drop(turn);
                self.go_down(&handler, why);
                return;
            }
            self.outbox().last_sent = Instant::now();
            drop(turn);
        }
        // Finished: the reader wakes on the closed socket and takes the link down.
        self.close();
    }

    /// UCX: the next frame to send, in the order the TCP writer would send it.
    pub(super) fn next_out(&self) -> Option<Out> {
        self.outbox().pop()
    }

    /// UCX: a frame went out now (the next heartbeat is due an interval later).
    pub(super) fn sent(&self) {
        self.outbox().last_sent = Instant::now();
    }

    /// UCX: when a heartbeat is due if nothing else goes out before.
    pub(super) fn heartbeat_at(&self) -> Instant {
        self.outbox().last_sent + self.interval
    }

    /// UCX: the peer was heard from now.
    pub(super) fn heard(&self) {
        *self.last_heard.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// UCX: why the peer is dead, once it has been silent for the dead interval.
    pub(super) fn silence(&self) -> Option<String> {
        let silent = self
            .last_heard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed();
        (silent >= self.dead_after).then(|| {
            format!(
                "the peer sent nothing for {} ms ({} heartbeat intervals missed)",
                silent.as_millis(),
                silent.as_millis() / self.peer_interval.as_millis().max(1)
            )
        })
    }

    /// UCX: whether the link was closed, and whether it was finished with nothing left to
    /// send (its endpoint may close).
    pub(super) fn ending(&self) -> (bool, bool) {
        let o = self.outbox();
        (o.closed, o.finishing && !o.has_work())
    }

    /// UCX: one frame from the peer, to the handler; a DATA frame's bytes (`offset`, `bytes`)
    /// go straight where the handler lends them, as the TCP reader reads them. The buffer
    /// comes back when its bytes were copied out (for the next message to land in).
    pub(super) fn deliver(
        self: &Arc<Self>,
        handler: &Arc<dyn Handler>,
        kind: Kind,
        room: u64,
        offset: Option<u64>,
        bytes: Vec<u8>,
    ) -> Option<Vec<u8>> {
        self.heard();
        let Some(offset) = offset else {
            if kind == Kind::Heartbeat {
                return Some(bytes);
            }
            let frame = Frame {
                kind,
                room,
                payload: bytes,
            };
            handler.on_frame(self, frame);
            return None;
        };
        let n = bytes.len();
        if let Some(mut lent) = handler.lend(self, room, offset, n) {
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            let end = start.saturating_add(n);
            let filled = match &mut lent {
                Lent::Buffer(buf) => match buf.get_mut(start..end) {
                    Some(dst) => {
                        dst.copy_from_slice(&bytes);
                        true
                    }
                    None => false,
                },
                Lent::Direct(landing) => {
                    // SAFETY: as in the TCP reader: the node lent bytes `start..end` of this
                    // room's destination, checked to lie inside it and not to overlap bytes
                    // already in; the engine keeps the pages until `put_back`, and only this
                    // link's deliveries write the room's bytes.
                    let parts = unsafe { landing.slices_mut(start, end) };
                    let mut at = 0;
                    for dst in parts {
                        dst.copy_from_slice(&bytes[at..at + dst.len()]);
                        at += dst.len();
                    }
                    at == n
                }
                Lent::Discard => true,
            };
            handler.put_back(self, room, offset, n, lent, filled);
            if !filled {
                self.go_down(
                    handler,
                    format!("a lent destination cannot take bytes {start}..+{n} (a dsv4 bug)"),
                );
            }
            return Some(bytes);
        }
        let mut payload = Vec::with_capacity(8 + n);
        payload.extend_from_slice(&offset.to_le_bytes());
        payload.extend_from_slice(&bytes);
        handler.on_frame(
            self,
            Frame {
                kind,
                room,
                payload,
            },
        );
        Some(bytes)
    }

    /// Fills `buf` from the stream, waiting through read timeouts until the peer has been
    /// silent for the dead interval (or the link was closed).
    fn fill(&self, stream: &mut Reader, buf: &mut [u8]) -> io::Result<()> {
        self.fill_parts(stream, &mut [IoSliceMut::new(buf)])
    }

    /// [`Self::fill`] for buffers filled in order, with as few reads as the socket allows (a
    /// state's destination is hundreds of regions of a few KiB: one `readv` each time).
    fn fill_parts(&self, stream: &mut Reader, mut parts: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        IoSliceMut::advance_slices(&mut parts, 0); // skips empty parts
        while !parts.is_empty() {
            match stream.read_vectored(parts) {
                Ok(0) => {
                    return Err(io::Error::new(
                        IoKind::UnexpectedEof,
                        "the peer closed the connection",
                    ))
                }
                Ok(n) => {
                    IoSliceMut::advance_slices(&mut parts, n);
                    *self.last_heard.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                }
                Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) => {
                    if self.outbox().closed {
                        return Err(io::Error::other("the link was closed"));
                    }
                    let silent = self
                        .last_heard
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .elapsed();
                    if silent >= self.dead_after {
                        return Err(io::Error::new(
                            IoKind::TimedOut,
                            format!(
                                "the peer sent nothing for {} ms ({} heartbeat intervals missed)",
                                silent.as_millis(),
                                silent.as_millis() / self.peer_interval.as_millis().max(1)
                            ),
                        ));
                    }
                }
                Err(e) if e.kind() == IoKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// One frame off the stream, to the handler: a DATA frame's bytes straight into the
    /// room's buffer when the handler lends it.
    /// On an authenticated link (`opener`), every frame's MAC is read after it and checked
    /// before the frame is acted on: a DATA frame's bytes may be in the room's destination by
    /// then, but the room takes them only once they verified (a frame that does not verify
    /// takes the link down, failing its rooms).
    fn read_one(
        self: &Arc<Self>,
        stream: &mut Reader,
        handler: &Arc<dyn Handler>,
        opener: &mut Option<Sequence>,
    ) -> Result<(), ReadError> {
        let fill = &mut |buf: &mut [u8]| self.fill(stream, buf);
        let (kind, len, room) = wire::read_header(fill)?;
        let mut mac = opener.as_mut().map(|o| {
            let mut h = o.begin();
            h.update(&wire::header(kind, len, room));
            h
        });
        // Reads the frame's tag and checks it against what was hashed.
        let check = |mac: Option<seal::Mac>,
                     fill: &mut dyn FnMut(&mut [u8]) -> io::Result<()>|
         -> Result<(), ReadError> {
            let Some(h) = mac else {
                return Ok(());
            };
            let mut tag = [0u8; seal::TAG];
            fill(&mut tag)?;
            if seal::verify(h, &tag) {
                Ok(())
            } else {
                Err(ReadError::Protocol(format!(
                    "a {kind:?} frame (room {room}) does not verify under the link's key: it \
                     was altered, dropped, repeated or injected on the way"
                )))
            }
        };
        let mut payload = Vec::new();
        if kind == Kind::Data && len >= 8 {
            let mut at = [0u8; 8];
            fill(&mut at)?;
            if let Some(h) = &mut mac {
                h.update(&at);
            }
            let (offset, n) = (u64::from_le_bytes(at), len - 8);
            let start = usize::try_from(offset).unwrap_or(usize::MAX);
            if let Some(mut lent) = handler.lend(self, room, offset, n) {
                let end = start.saturating_add(n);
                let read = match &mut lent {
                    Lent::Buffer(buf) => match buf.get_mut(start..end) {
                        Some(dst) => self.fill(stream, dst),
                        // The handler checked the range: a dsv4 bug, the room's bytes are
                        // unusable.
                        None => Err(io::Error::other(format!(
                            "a lent buffer of {} bytes cannot take bytes {start}..+{n}",
                            buf.len()
                        ))),
                    },
                    Lent::Direct(landing) => {
                        // SAFETY: the node lent bytes `start..end` of this room's destination,
                        // checked to lie inside it and not to overlap bytes already in; the
                        // engine keeps the pages until `put_back` (`Node::release_landing`),
                        // and only this reader writes the room's bytes.
                        let parts = unsafe { landing.slices_mut(start, end) };
                        let mut io: Vec<IoSliceMut<'_>> =
                            parts.into_iter().map(IoSliceMut::new).collect();
                        // At most IOV_MAX (1024) buffers per read.
                        io.chunks_mut(1024)
                            .try_for_each(|c| self.fill_parts(stream, c))
                    }
                    Lent::Discard => {
                        let mut scratch = vec![0u8; n.min(64 << 10)];
                        let mut left = n;
                        let mut r = Ok(());
                        while left > 0 && r.is_ok() {
                            let k = left.min(scratch.len());
                            r = self.fill(stream, &mut scratch[..k]);
                            if let Some(h) = &mut mac {
                                h.update(&scratch[..k]);
                            }
                            left -= k;
                        }
                        r
                    }
                };
                // The bytes as they landed go into the MAC.
                let verified = match read {
                    Err(e) => Err(ReadError::Io(e)),
                    Ok(()) => {
                        if let Some(h) = &mut mac {
                            match &mut lent {
                                Lent::Buffer(buf) => {
                                    h.update(&buf[start..start + n]);
                                }
                                Lent::Direct(landing) => {
                                    // SAFETY: as for the read above: bytes `start..end` of the
                                    // room's destination, lent to this reader until
                                    // `put_back`; read back, not written.
                                    for part in unsafe { landing.slices_mut(start, start + n) } {
                                        h.update(part);
                                    }
                                }
                                Lent::Discard => {}
                            }
                        }
                        check(mac, &mut |b: &mut [u8]| self.fill(stream, b))
                    }
                };
                handler.put_back(self, room, offset, n, lent, verified.is_ok());
                return verified;
            }
            payload.extend_from_slice(&at);
        }
        let have = payload.len();
        wire::read_payload(fill, &mut payload, len - have)?;
        if let Some(h) = &mut mac {
            h.update(&payload[have..]);
        }
        check(mac, fill)?;
        if kind != Kind::Heartbeat {
            handler.on_frame(
                self,
                Frame {
                    kind,
                    room,
                    payload,
                },
            );
        }
        Ok(())
    }

    fn read_loop(
        self: Arc<Self>,
        stream: Stream,
        handler: Arc<dyn Handler>,
        mut opener: Option<Sequence>,
    ) {
        crate::threads::mark_internal();
        let mut stream = BufReader::with_capacity(READ_AHEAD, stream);
        loop {
            handler.between_frames(&self, &mut || {
                !stream.buffer().is_empty() || readable(stream.get_ref().tcp())
            });
            match self.read_one(&mut stream, &handler, &mut opener) {
                Ok(()) => {}
                Err(ReadError::Io(e)) => {
                    self.go_down(&handler, format!("connection lost: {e}"));
                    return;
                }
                Err(ReadError::Protocol(m)) => {
                    self.go_down(&handler, format!("the peer broke the protocol: {m}"));
                    return;
                }
            }
        }
    }
}

/// Whether `stream` has bytes to read now (false also at its end or on an error: the next
/// read tells).
fn readable(stream: &TcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: a one-byte peek into a live local; the fd is the stream's own, open while it
    // is borrowed.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n > 0
}

/// Starts a named library thread.
pub fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(f)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;
    use std::sync::mpsc;

    struct Recorder(Mutex<mpsc::Sender<String>>);

    impl Handler for Recorder {
        fn on_frame(&self, _: &Arc<Link>, frame: Frame) {
            let _ = self.0.lock().unwrap().send(format!("{:?}", frame.kind));
        }
        fn on_down(&self, _: &Arc<Link>, why: String) {
            let _ = self.0.lock().unwrap().send(format!("down: {why}"));
        }
    }

    /// A link to a raw socket the test reads and writes itself.
    fn pair(
        interval_ms: u64,
    ) -> (
        Arc<Link>,
        TcpStream,
        mpsc::Receiver<String>,
        Vec<JoinHandle<()>>,
    ) {
        let (tx, rx) = mpsc::channel();
        let (link, theirs, threads) = linked(interval_ms, Arc::new(Recorder(Mutex::new(tx))));
        (link, theirs, rx, threads)
    }

    /// A link handing frames to `handler`, to a raw socket the test reads and writes itself;
    /// a heartbeat every `interval_ms`, dead after 3 silent intervals.
    fn linked(
        interval_ms: u64,
        handler: Arc<dyn Handler>,
    ) -> (Arc<Link>, TcpStream, Vec<JoinHandle<()>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        let mut threads = Vec::new();
        let ms = Duration::from_millis(interval_ms);
        let link = Link::start(
            1,
            "peer".into(),
            Stream::Tcp(ours),
            ms,
            ms,
            3,
            64 << 20,
            None,
            handler,
            &mut threads,
        )
        .unwrap();
        (link, theirs, threads)
    }

    /// The rooms' DONE frames in the order they arrive, reading until `n` have.
    fn done_order(theirs: &mut TcpStream, n: usize) -> Vec<u64> {
        let mut done = Vec::new();
        while done.len() < n {
            let f = wire::read_frame_from(theirs).unwrap();
            if f.kind == Kind::Done {
                done.push(f.room);
            }
        }
        done
    }

    fn room_bulk(room: u64, chunks: usize) -> Bulk {
        let data = Arc::new(StateBuf::from(vec![room as u8; chunks * wire::DATA_CHUNK]));
        let state = wire::encode(Kind::State, room, b"{}");
        let done = wire::encode(Kind::Done, room, b"{}");
        Bulk::new(room, state, data, done, Arc::new(AtomicBool::new(false)))
    }

    #[test]
    fn the_room_with_the_fewest_bytes_left_goes_next() {
        let (link, mut theirs, _rx, threads) = pair(1000);
        // Nobody reads yet: the 16 MiB room fills the socket buffers and waits, then a small
        // room queued after it overtakes it at the next frame.
        assert!(link.send_bulk(room_bulk(1, 64)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(link.send_bulk(room_bulk(2, 1)));
        assert_eq!(done_order(&mut theirs, 2), [2, 1]);
        // Rooms of one size queued together go out one after another, not frame by frame in
        // turns: the first one's DONE comes before any byte of the next.
        let (mut seen, mut order) = (Vec::new(), Vec::new());
        for room in [3, 4, 5] {
            assert!(link.send_bulk(room_bulk(room, 8)));
        }
        while order.len() < 3 {
            let f = wire::read_frame_from(&mut theirs).unwrap();
            if seen.last() != Some(&f.room) {
                seen.push(f.room);
            }
            if f.kind == Kind::Done {
                order.push(f.room);
            }
        }
        assert_eq!(order, [3, 4, 5]);
        assert_eq!(seen, [3, 4, 5], "the rooms' frames interleaved");
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn the_rest_of_a_frame_is_its_bytes_past_what_the_socket_took() {
        let bytes = Arc::new(StateBuf::from(
            (0..3000u32).map(|i| (i * 7) as u8).collect::<Vec<u8>>(),
        ));
        let data = || Out::Data {
            prefix: wire::data_prefix(9, 100, 2000),
            bytes: bytes.clone(),
            range: 500..2500,
            target: None,
            // An authenticated link's MAC, after the bytes.
            tag: Some(std::array::from_fn(|i| 200 + i as u8)),
        };
        let whole = |o: &Out| o.wire_parts().concat();
        let all = whole(&data());
        assert_eq!(all.len(), wire::HEADER + 8 + 2000 + seal::TAG);
        assert_eq!(all[..wire::HEADER + 8], wire::data_prefix(9, 100, 2000));
        assert_eq!(all[wire::HEADER + 8..][..2000], bytes[500..2500]);
        assert_eq!(all[all.len() - 1], 200 + 31);
        // Within the header, across it, past it, twice in a row, into the MAC, and all of it.
        for cuts in [
            vec![5],
            vec![24],
            vec![30],
            vec![5, 30],
            vec![3, 0, 1000, 900],
            vec![2024],
            vec![2030],
            vec![1000, 1040],
            vec![2056],
        ] {
            let mut out = data();
            let mut taken = 0;
            for n in cuts.iter().copied() {
                out = out.rest(n);
                taken += n;
            }
            assert_eq!(whole(&out), all[taken..], "cuts {cuts:?}");
            assert_eq!(out.len(), all.len() - taken);
        }
        let frame = wire::encode(Kind::Ack, 4, b"xyz");
        let out = Out::Frame(frame.clone()).rest(7).rest(2);
        assert_eq!(whole(&out), frame[9..]);
    }

    #[test]
    fn bytes_written_in_part_while_the_socket_is_full_arrive_whole() {
        let (link, mut theirs, _rx, threads) = pair(1000);
        // 16 MiB queued while nobody reads: the queueing thread writes until the socket is
        // full, mid-frame, and the writer thread sends that frame's rest later.
        let n = 64 * wire::DATA_CHUNK;
        let data = Arc::new(StateBuf::from(
            (0..n).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
        ));
        let state = wire::encode(Kind::State, 3, b"{}");
        let done = wire::encode(Kind::Done, 3, b"{}");
        let cancel = Arc::new(AtomicBool::new(false));
        assert!(link.send_bulk(Bulk::new(3, state, data.clone(), done, cancel)));
        std::thread::sleep(Duration::from_millis(50));
        let mut got = vec![0u8; n];
        let mut filled = 0;
        loop {
            let f = wire::read_frame_from(&mut theirs).unwrap();
            if f.kind == Kind::Data {
                let at = u64::from_le_bytes(f.payload[..8].try_into().unwrap()) as usize;
                got[at..at + f.payload.len() - 8].copy_from_slice(&f.payload[8..]);
                filled += f.payload.len() - 8;
            }
            if f.kind == Kind::Done {
                break;
            }
        }
        assert_eq!(filled, n);
        assert!(got[..] == data[..], "the bytes differ from what was queued");
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_room_queued_too_long_goes_before_smaller_ones() {
        let mut out = Outbox::new();
        let (mut big, small) = (room_bulk(1, 4), room_bulk(2, 1));
        out.bulk.push_back(small);
        // Fresh, the small room goes first; the big one, queued past the bound, goes first.
        assert!(matches!(out.pop(), Some(Out::Frame(f)) if f[8] == 2));
        big.since = Instant::now() - STARVED_AFTER;
        out.bulk.push_back(big);
        let mut rooms = Vec::new();
        while let Some(o) = out.pop() {
            let (a, _) = o.parts();
            rooms.push(a[8]);
        }
        // The big room's STATE, 4 DATA frames and DONE, then the rest of the small one.
        assert_eq!(rooms, [1, 1, 1, 1, 1, 1, 2, 2]);
    }

    #[test]
    fn a_control_frame_overtakes_queued_bulk_data() {
        let (link, mut theirs, _rx, threads) = pair(1000);
        // 16 MiB: more than the socket buffers hold, so the writer blocks mid-bulk until the
        // reader below starts.
        let data = Arc::new(StateBuf::from(vec![7u8; 64 * wire::DATA_CHUNK]));
        let cancel = Arc::new(AtomicBool::new(false));
        let state = wire::encode(Kind::State, 5, b"{}");
        let done = wire::encode(Kind::Done, 5, b"{}");
        assert!(link.send_bulk(Bulk::new(5, state, data, done, cancel)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(link.send(wire::encode(Kind::Ack, 9, &[])));
        let mut kinds = Vec::new();
        loop {
            let f = wire::read_frame_from(&mut theirs).unwrap();
            kinds.push((f.kind, f.room));
            if f.kind == Kind::Done {
                break;
            }
        }
        let ack = kinds.iter().position(|k| *k == (Kind::Ack, 9)).unwrap();
        let data_frames = kinds.iter().filter(|k| k.0 == Kind::Data).count();
        assert_eq!(data_frames, 64);
        // The ACK went out between two DATA frames, long before the bulk ended.
        assert!(ack < kinds.len() / 2, "ACK at {ack} of {}", kinds.len());
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn consecutive_control_frames_are_written_as_one() {
        let mut o = Outbox::new();
        let frames: Vec<Vec<u8>> = (1..=3).map(|r| wire::encode(Kind::Ack, r, &[])).collect();
        o.control.extend(frames.iter().cloned());
        let Some(Out::Frame(joined)) = o.pop_stream() else {
            panic!("no frame");
        };
        assert_eq!(joined, frames.concat());
        assert!(o.pop_stream().is_none());
        // Up to COALESCE_BYTES: a frame that would pass it starts the next write.
        let half = |room| wire::encode(Kind::Claim, room, &vec![b' '; COALESCE_BYTES / 2]);
        o.control.extend([half(4), half(5), frames[1].clone()]);
        let lens: Vec<usize> = std::iter::from_fn(|| o.pop_stream())
            .map(|f| f.len())
            .collect();
        let h = half(4).len();
        assert_eq!(lens, [h, h + frames[1].len()]);
        // The rest of a partly written frame still goes first, alone.
        o.partial = Some(Out::Frame(vec![9; 5]));
        o.control.extend(frames.iter().cloned());
        assert_eq!(o.pop_stream().map(|f| f.len()), Some(5));
    }

    #[test]
    fn frames_queued_under_a_cork_go_out_when_it_is_dropped() {
        // A minute between heartbeats: a heartbeat would also send what is queued, so every
        // read below times out long before one could make the test pass without the cork's
        // own flush.
        let (link, mut theirs, _rx, threads) = pair(60_000);
        // A writer thread at work sends whatever is queued, corked or not: let it first go
        // idle.
        std::thread::sleep(Duration::from_millis(100));
        theirs
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut byte = [0u8; 1];
        {
            let _outer = Cork::hold();
            {
                let _inner = Cork::hold();
                for room in 1..=3 {
                    assert!(link.send(wire::encode(Kind::Ack, room, &[])));
                }
            }
            // Still held by the outer cork: nothing on the wire.
            let e = theirs.peek(&mut byte).unwrap_err();
            assert!(
                matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut),
                "{e}"
            );
        }
        theirs
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let rooms: Vec<u64> = (0..3)
            .map(|_| wire::read_frame_from(&mut theirs).unwrap().room)
            .collect();
        assert_eq!(rooms, [1, 2, 3]);
        // Another thread's frames are not held, and go out after those queued before them.
        let _cork = Cork::hold();
        assert!(link.send(wire::encode(Kind::Ack, 4, &[])));
        let l = link.clone();
        std::thread::spawn(move || assert!(l.send(wire::encode(Kind::Ack, 5, &[]))))
            .join()
            .unwrap();
        let rooms: Vec<u64> = (0..2)
            .map(|_| wire::read_frame_from(&mut theirs).unwrap().room)
            .collect();
        assert_eq!(rooms, [4, 5]);
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn an_idle_link_heartbeats_and_a_silent_peer_is_declared_dead() {
        let (link, mut theirs, rx, threads) = pair(10);
        // Read until the link hangs up on us: every frame of an idle link is a heartbeat. (Not
        // "for 25 ms": on a loaded machine this thread may first run after the link has already
        // declared us dead, and what was sent is still there to read.)
        let mut beats = 0;
        while let Ok(f) = wire::read_frame_from(&mut theirs) {
            assert_eq!(f.kind, Kind::Heartbeat);
            beats += 1;
        }
        assert!(
            beats >= 1,
            "an idle link sent no heartbeat before it went down"
        );
        // We (the peer) never sent anything: after 3 intervals of 10 ms the link goes down.
        let why = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(
            why.starts_with("down: connection lost: the peer sent nothing"),
            "{why}"
        );
        assert!(link.is_down());
        for t in threads {
            t.join().unwrap();
        }
    }

    /// The bytes go out with MSG_NOSIGNAL: a peer that hangs up mid-transfer takes the link
    /// down instead of killing the host with SIGPIPE (a C host need not ignore it; Rust's
    /// runtime does, so the check runs in a child process with SIGPIPE at its default).
    /// Records every frame whole.
    #[test]
    fn lazy_frames_wait_for_company_or_their_deadline_and_keep_their_order() {
        // A minute between heartbeats: nothing else sends what is queued.
        let (link, mut theirs, _rx, threads) = pair(60_000);
        std::thread::sleep(Duration::from_millis(100));
        theirs
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut byte = [0u8; 1];
        for room in [1, 2] {
            assert!(link.send_lazy(wire::encode(Kind::Ack, room, &[]), Duration::from_secs(60)));
        }
        let e = theirs.peek(&mut byte).unwrap_err();
        assert!(
            matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut),
            "a lazy frame went out alone: {e}"
        );
        theirs
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        // Any other frame takes them along, after them.
        assert!(link.send(wire::encode(Kind::Fail, 3, &[])));
        let got: Vec<(Kind, u64)> = (0..3)
            .map(|_| wire::read_frame_from(&mut theirs).unwrap())
            .map(|f| (f.kind, f.room))
            .collect();
        assert_eq!(got, [(Kind::Ack, 1), (Kind::Ack, 2), (Kind::Fail, 3)]);
        // Alone, one goes by its deadline (the writer thread wakes for it, not for a
        // heartbeat a minute away).
        let queued = Instant::now();
        assert!(link.send_lazy(wire::encode(Kind::Ack, 4, &[]), Duration::from_millis(20)));
        assert_eq!(wire::read_frame_from(&mut theirs).unwrap().room, 4);
        assert!(
            queued.elapsed() >= Duration::from_millis(20),
            "went before its deadline"
        );
        // Finishing sends them too.
        assert!(link.send_lazy(wire::encode(Kind::Ack, 5, &[]), Duration::from_secs(60)));
        link.finish();
        assert_eq!(wire::read_frame_from(&mut theirs).unwrap().room, 5);
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    /// Records frames and what the reader says between them.
    struct Boundaries(Mutex<mpsc::Sender<String>>);

    impl Handler for Boundaries {
        fn on_frame(&self, _: &Arc<Link>, frame: Frame) {
            let _ = self.0.lock().unwrap().send(format!("room {}", frame.room));
        }
        fn between_frames(&self, _: &Arc<Link>, more_ready: &mut dyn FnMut() -> bool) {
            let _ = self
                .0
                .lock()
                .unwrap()
                .send(format!("more {}", more_ready()));
        }
        fn on_down(&self, _: &Arc<Link>, _: String) {}
    }

    #[test]
    fn between_frames_the_reader_says_whether_the_next_frame_is_already_in() {
        let (tx, rx) = mpsc::channel();
        let (link, mut theirs, threads) = linked(60_000, Arc::new(Boundaries(Mutex::new(tx))));
        let next = || rx.recv_timeout(Duration::from_secs(5)).unwrap();
        // Before anything arrived.
        assert_eq!(next(), "more false");
        // Three frames in one write: the second and third are in once the first is read.
        let burst: Vec<u8> = (1..=3)
            .flat_map(|room| wire::encode(Kind::Ack, room, &[]))
            .collect();
        theirs.write_all(&burst).unwrap();
        let seen: Vec<String> = (0..6).map(|_| next()).collect();
        assert_eq!(
            seen,
            [
                "room 1",
                "more true",
                "room 2",
                "more true",
                "room 3",
                "more false"
            ]
        );
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    struct Frames(Mutex<mpsc::Sender<(Kind, u64, Vec<u8>)>>);

    impl Handler for Frames {
        fn on_frame(&self, _: &Arc<Link>, frame: Frame) {
            let f = (frame.kind, frame.room, frame.payload);
            let _ = self.0.lock().unwrap().send(f);
        }
        fn on_down(&self, _: &Arc<Link>, _: String) {}
    }

    #[test]
    fn frames_split_and_joined_anywhere_by_the_stream_arrive_whole() {
        // The reader reads ahead of the frame it parses (READ_AHEAD): headers arrive inside
        // the bytes before them, payloads straddle its buffer, DATA frames larger than it go
        // around it. The peer writes a seeded mix of frames as one stream cut at random
        // places, some pieces a byte long, with pauses so the reader sees partial frames.
        let (tx, rx) = mpsc::channel();
        let (link, mut theirs, threads) = linked(1000, Arc::new(Frames(Mutex::new(tx))));
        let mut rng = fastrand::Rng::with_seed(7);
        let mut sent = Vec::new();
        let mut stream = Vec::new();
        for room in 1..=300u64 {
            let (kind, len) = match rng.u8(0..4) {
                0 => (Kind::Ack, 0),
                1 => (Kind::Claim, rng.usize(0..3 * READ_AHEAD)),
                2 => (Kind::Done, rng.usize(0..64)),
                _ => (Kind::Data, rng.usize(8..=wire::DATA_CHUNK + 8)),
            };
            let payload: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            stream.extend_from_slice(&wire::encode(kind, room, &payload));
            sent.push((kind, room, payload));
        }
        let mut at = 0;
        while at < stream.len() {
            let n = match rng.u8(0..8) {
                0 => 1,
                1 => rng.usize(1..wire::HEADER + 8),
                _ => rng.usize(1..64 << 10),
            }
            .min(stream.len() - at);
            theirs.write_all(&stream[at..at + n]).unwrap();
            at += n;
            if rng.u8(0..16) == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for (i, want) in sent.iter().enumerate() {
            let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(
                got == *want,
                "frame {i} ({:?}, room {}) arrived changed",
                want.0,
                want.1
            );
        }
        link.close();
        for t in threads {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_peer_that_hangs_up_raises_no_sigpipe() {
        const CHILD: &str = "DSV4_TEST_SIGPIPE_CHILD";
        if std::env::var_os(CHILD).is_some() {
            // SAFETY: restoring the default disposition of one signal in this child process,
            // before any thread of the test is started.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            // A peer that neither reads nor writes: the writer blocks mid-bulk (the socket
            // buffers are full), then the reader declares the peer dead after 3 silent 50 ms
            // intervals and shuts the socket down under the blocked write, which fails with
            // EPIPE: SIGPIPE without MSG_NOSIGNAL. 50 ms: the bulk must be queued before the
            // peer is declared dead, on a loaded machine too.
            let (link, _theirs, rx, threads) = pair(50);
            let data = Arc::new(StateBuf::from(vec![1u8; 64 * wire::DATA_CHUNK]));
            let state = wire::encode(Kind::State, 1, b"{}");
            let done = wire::encode(Kind::Done, 1, b"{}");
            let cancel = Arc::new(AtomicBool::new(false));
            assert!(link.send_bulk(Bulk::new(1, state, data, done, cancel)));
            let why = rx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(why.starts_with("down: "), "{why}");
            println!("{why}");
            link.close();
            for t in threads {
                t.join().unwrap();
            }
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "pd::link::tests::a_peer_that_hangs_up_raises_no_sigpipe",
                "--nocapture",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the child ended with {:?}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
