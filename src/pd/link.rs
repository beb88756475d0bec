//! One TCP connection to a peer engine, shared by every room between the two: a writer thread
//! that sends control frames before bulk data and a heartbeat whenever it has been idle for
//! an interval, and a reader thread that hands each frame to the node and declares the peer
//! dead once it has been silent for `heartbeat_misses` intervals.
//!
//! Bulk data goes out in frames of at most [`wire::DATA_CHUNK`] bytes, rooms taking turns, so a
//! heartbeat, a claim or a FAIL waits behind one frame at most, never behind a whole state.

use std::collections::VecDeque;
use std::io::{self, ErrorKind as IoKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::wire::{self, Frame, Kind, ReadError};

/// What the link reports to its owner (the node).
pub trait Handler: Send + Sync + 'static {
    fn on_frame(&self, link: &Arc<Link>, frame: Frame);
    /// The link is down (`why`); called once.
    fn on_down(&self, link: &Arc<Link>, why: String);
}

/// A piece of a room's outgoing bytes: a ready frame (STATE, DONE), or state bytes that go out
/// as DATA frames of at most [`wire::DATA_CHUNK`] bytes.
pub enum Segment {
    Frame(Vec<u8>),
    /// `bytes[range]` is the state's bytes from offset `at`.
    Data {
        at: u64,
        bytes: Arc<Vec<u8>>,
        range: std::ops::Range<usize>,
    },
}

/// One room's bytes on their way out, in order: complete pages sent early while the prompt
/// is still computing, then the STATE frame, the rest of the bytes and the DONE frame.
pub struct Bulk {
    pub room: u64,
    segments: VecDeque<Segment>,
    /// Set when the room ends: the rest is not sent.
    pub cancel: Arc<AtomicBool>,
}

impl Bulk {
    /// The whole state at once: STATE, every byte of `data`, DONE.
    pub fn new(
        room: u64,
        state_frame: Vec<u8>,
        data: Arc<Vec<u8>>,
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
        Self {
            room,
            segments: segments.into(),
            cancel,
        }
    }

    /// The next frame to write and whether it was the last one queued.
    fn next_frame(&mut self) -> (Out, bool) {
        let out = loop {
            match self.segments.front_mut() {
                None => return (Out::Frame(wire::encode(Kind::Heartbeat, 0, &[])), true),
                Some(Segment::Frame(f)) => {
                    let f = std::mem::take(f);
                    self.segments.pop_front();
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
                    };
                    *at += (end - range.start) as u64;
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

/// One frame for the writer: whole, or a DATA frame's header and offset then a slice of the
/// room's bytes (written together, without copying the bytes into a frame first).
enum Out {
    Frame(Vec<u8>),
    Data {
        prefix: [u8; wire::HEADER + 8],
        bytes: Arc<Vec<u8>>,
        range: std::ops::Range<usize>,
    },
}

impl Out {
    fn write_to(&self, stream: &mut TcpStream) -> io::Result<()> {
        match self {
            Out::Frame(f) => stream.write_all(f),
            Out::Data {
                prefix,
                bytes,
                range,
            } => write_both(stream, prefix, &bytes[range.clone()]),
        }
    }
}

/// Writes `a` then `b` with vectored writes (one system call when the socket takes it all).
fn write_both(stream: &mut TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = match stream.write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)]) {
            Ok(0) => return Err(io::Error::new(IoKind::WriteZero, "the peer took no bytes")),
            Ok(n) => n,
            Err(e) if e.kind() == IoKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

#[derive(Default)]
struct Outbox {
    control: VecDeque<Vec<u8>>,
    bulk: VecDeque<Bulk>,
    closed: bool,
    /// Closing once the queued control frames are out (the FAILs of an engine shutting
    /// down reach the peer).
    finishing: bool,
}

/// A live connection to one peer.
pub struct Link {
    pub id: u64,
    /// The peer's advertised endpoint (from its HELLO).
    pub peer: String,
    stream: TcpStream,
    out: Mutex<Outbox>,
    ready: Condvar,
    last_heard: Mutex<Instant>,
    down: AtomicBool,
    interval: Duration,
    peer_interval: Duration,
    dead_after: Duration,
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
        stream: TcpStream,
        interval: Duration,
        peer_interval: Duration,
        misses: u32,
        handler: Arc<dyn Handler>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> io::Result<Arc<Link>> {
        let peer_interval = peer_interval.max(Duration::from_millis(1));
        let dead_after = peer_interval * misses;
        stream.set_nodelay(true)?;
        // The reader wakes every peer interval to check for silence; a write blocked that long
        // on a peer that stopped reading means the peer is gone.
        stream.set_read_timeout(Some(peer_interval))?;
        stream.set_write_timeout(Some(dead_after))?;
        let link = Arc::new(Link {
            id,
            peer,
            stream: stream.try_clone()?,
            out: Mutex::new(Outbox::default()),
            ready: Condvar::new(),
            last_heard: Mutex::new(Instant::now()),
            down: AtomicBool::new(false),
            interval,
            peer_interval,
            dead_after,
        });
        let reader_stream = stream.try_clone()?;
        let (l, h) = (link.clone(), handler.clone());
        threads.push(spawn(format!("dsv4-pd-read-{id}"), move || {
            l.read_loop(reader_stream, h)
        })?);
        let (l, h) = (link.clone(), handler);
        threads.push(spawn(format!("dsv4-pd-write-{id}"), move || {
            l.write_loop(stream, h)
        })?);
        Ok(link)
    }

    fn outbox(&self) -> MutexGuard<'_, Outbox> {
        self.out.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a control frame (sent before any further bulk frame). False when the link is
    /// down.
    pub fn send(&self, frame: Vec<u8>) -> bool {
        let mut o = self.outbox();
        if o.closed {
            return false;
        }
        o.control.push_back(frame);
        self.ready.notify_one();
        true
    }

    /// Queues a room's bytes after any of the same room's still queued (a room's frames go
    /// out in the order queued). False when the link is down.
    pub fn send_bulk(&self, mut bulk: Bulk) -> bool {
        let mut o = self.outbox();
        if o.closed {
            return false;
        }
        match o.bulk.iter_mut().find(|b| b.room == bulk.room) {
            Some(queued) => queued.segments.append(&mut bulk.segments),
            None => o.bulk.push_back(bulk),
        }
        self.ready.notify_one();
        true
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }

    /// Sends the queued control frames (bulk data is dropped), then closes the connection;
    /// the writer waits at most the write timeout for a peer that does not read.
    pub fn finish(&self) {
        let mut o = self.outbox();
        o.finishing = true;
        o.bulk.clear();
        self.ready.notify_all();
    }

    /// Closes the connection: both threads end, queued frames are dropped.
    pub fn close(&self) {
        self.outbox().closed = true;
        self.ready.notify_all();
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Takes the link down once: closes it and tells the handler why.
    fn go_down(self: &Arc<Self>, handler: &Arc<dyn Handler>, why: String) {
        if !self.down.swap(true, Ordering::SeqCst) {
            self.close();
            handler.on_down(self, why);
        }
    }

    fn next_to_write(&self) -> Option<Out> {
        let mut o = self.outbox();
        let deadline = Instant::now() + self.interval;
        loop {
            if o.closed {
                return None;
            }
            if let Some(f) = o.control.pop_front() {
                return Some(Out::Frame(f));
            }
            if o.finishing {
                return None;
            }
            while let Some(mut b) = o.bulk.pop_front() {
                if b.cancel.load(Ordering::SeqCst) {
                    continue;
                }
                let (frame, last) = b.next_frame();
                if !last {
                    // Rooms take turns, one frame each.
                    o.bulk.push_back(b);
                }
                return Some(frame);
            }
            let now = Instant::now();
            if now >= deadline {
                return Some(Out::Frame(wire::encode(Kind::Heartbeat, 0, &[])));
            }
            o = self
                .ready
                .wait_timeout(o, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn write_loop(self: Arc<Self>, mut stream: TcpStream, handler: Arc<dyn Handler>) {
        crate::threads::mark_internal();
        // Ends when closed (the link went down) or finished (its last frames are out).
        while let Some(frame) = self.next_to_write() {
            if let Err(e) = frame.write_to(&mut stream) {
                let why = match e.kind() {
                    IoKind::WouldBlock | IoKind::TimedOut => format!(
                        "the peer accepted no data for {} ms (it stopped reading)",
                        self.dead_after.as_millis()
                    ),
                    _ => format!("sending failed: {e}"),
                };
                self.go_down(&handler, why);
                return;
            }
        }
        // Finished: the reader wakes on the closed socket and takes the link down.
        self.close();
    }

    /// Fills `buf` from the stream, waiting through read timeouts until the peer has been
    /// silent for the dead interval (or the link was closed).
    fn fill(&self, stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<()> {
        let mut at = 0;
        while at < buf.len() {
            match stream.read(&mut buf[at..]) {
                Ok(0) => {
                    return Err(io::Error::new(
                        IoKind::UnexpectedEof,
                        "the peer closed the connection",
                    ))
                }
                Ok(n) => {
                    at += n;
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

    fn read_loop(self: Arc<Self>, mut stream: TcpStream, handler: Arc<dyn Handler>) {
        crate::threads::mark_internal();
        loop {
            match wire::read_frame(&mut |buf| self.fill(&mut stream, buf)) {
                Ok(frame) => {
                    if frame.kind != Kind::Heartbeat {
                        handler.on_frame(&self, frame);
                    }
                }
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

/// Starts a named library thread.
pub fn spawn(name: String, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(f)
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (theirs, _) = listener.accept().unwrap();
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        let ms = Duration::from_millis(interval_ms);
        let link = Link::start(
            1,
            "peer".into(),
            ours,
            ms,
            ms,
            3,
            Arc::new(Recorder(Mutex::new(tx))),
            &mut threads,
        )
        .unwrap();
        (link, theirs, rx, threads)
    }

    #[test]
    fn a_control_frame_overtakes_queued_bulk_data() {
        let (link, mut theirs, _rx, threads) = pair(1000);
        // 16 MiB: more than the socket buffers hold, so the writer blocks mid-bulk until the
        // reader below starts.
        let data = Arc::new(vec![7u8; 64 * wire::DATA_CHUNK]);
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
}
