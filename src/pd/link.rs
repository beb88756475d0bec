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

/// One room's state on its way out: the STATE frame, the bytes, the DONE frame.
pub struct Bulk {
    pub room: u64,
    pub state_frame: Vec<u8>,
    pub data: Arc<Vec<u8>>,
    pub done_frame: Vec<u8>,
    /// Set when the room ends: the rest is not sent.
    pub cancel: Arc<AtomicBool>,
    /// Progress: the STATE frame went out; then bytes of `data` sent.
    started: bool,
    sent: usize,
}

impl Bulk {
    pub fn new(
        room: u64,
        state_frame: Vec<u8>,
        data: Arc<Vec<u8>>,
        done_frame: Vec<u8>,
        cancel: Arc<AtomicBool>,
    ) -> Self {
        Self {
            room,
            state_frame,
            data,
            done_frame,
            cancel,
            started: false,
            sent: 0,
        }
    }

    /// The next frame to write and whether it was the last.
    fn next_frame(&mut self) -> (Vec<u8>, bool) {
        if !self.started {
            self.started = true;
            return (std::mem::take(&mut self.state_frame), false);
        }
        if self.sent < self.data.len() {
            let end = (self.sent + wire::DATA_CHUNK).min(self.data.len());
            let frame = wire::encode_data(self.room, self.sent as u64, &self.data[self.sent..end]);
            self.sent = end;
            return (frame, false);
        }
        (std::mem::take(&mut self.done_frame), true)
    }
}

#[derive(Default)]
struct Outbox {
    control: VecDeque<Vec<u8>>,
    bulk: VecDeque<Bulk>,
    closed: bool,
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
    dead_after: Duration,
}

impl Link {
    /// Starts the reader and writer threads over `stream` (HELLO already exchanged); their
    /// handles go to `threads`.
    pub fn start(
        id: u64,
        peer: String,
        stream: TcpStream,
        interval: Duration,
        misses: u32,
        handler: Arc<dyn Handler>,
        threads: &mut Vec<JoinHandle<()>>,
    ) -> io::Result<Arc<Link>> {
        let dead_after = interval * misses;
        stream.set_nodelay(true)?;
        // The reader wakes every interval to check for silence; a write blocked that long on a
        // peer that stopped reading means the peer is gone.
        stream.set_read_timeout(Some(interval))?;
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

    /// Queues a room's state. False when the link is down.
    pub fn send_bulk(&self, bulk: Bulk) -> bool {
        let mut o = self.outbox();
        if o.closed {
            return false;
        }
        o.bulk.push_back(bulk);
        self.ready.notify_one();
        true
    }

    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
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

    fn next_to_write(&self) -> Option<Vec<u8>> {
        let mut o = self.outbox();
        let deadline = Instant::now() + self.interval;
        loop {
            if o.closed {
                return None;
            }
            if let Some(f) = o.control.pop_front() {
                return Some(f);
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
                return Some(wire::encode(Kind::Heartbeat, 0, &[]));
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
        while let Some(frame) = self.next_to_write() {
            if let Err(e) = stream.write_all(&frame) {
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
                                silent.as_millis() / self.interval.as_millis().max(1)
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
