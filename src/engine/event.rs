//! What the engine tells the host: one event per generated token and exactly one terminal event
//! (FINISHED or ERROR) per accepted request, delivered by polling or by a callback.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind, Result};

/// Which of the three events an [`Event`] is (for matching on the kind alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Token,
    Finished,
    Error,
}

/// Why a request finished normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Stop,
    Aborted,
    Timeout,
    /// A prefill engine's request whose KV and state a decode engine confirmed it received
    /// (the decode engine continues it).
    Transferred,
}

impl FinishReason {
    /// The lowercase name (`"stop"`, `"length"`, …), as OpenAI-style servers report it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
            Self::Aborted => "aborted",
            Self::Timeout => "timeout",
            Self::Transferred => "transferred",
        }
    }
}

/// The request an event belongs to: every event carries both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    pub request_id: u64,
    /// The host's tag from the request (`RequestSpec::user_tag`).
    pub user_tag: u64,
}

/// A request's counters and timings as of an event. Terminal events have them all; token
/// events have what is known by then (`ttft_us` from the first token on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EventStats {
    pub prompt_tokens: u32,
    pub cached_tokens_device: u32,
    pub cached_tokens_host: u32,
    pub generated_tokens: u32,
    pub queue_us: u64,
    pub ttft_us: u64,
    pub elapsed_us: u64,
}

/// One event: a generated token, or the request's one terminal event (FINISHED or ERROR).
/// Built only by the constructors, which take the request's [`Origin`], so no event goes out
/// without its id and tag; the C struct is made from it in `ffi/`.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        origin: Origin,
        token: u32,
        /// For requests that asked for log-probabilities; otherwise 0.
        logprob: f32,
        stats: EventStats,
    },
    Finished {
        origin: Origin,
        reason: FinishReason,
        stats: EventStats,
    },
    Error {
        origin: Origin,
        kind: ErrorKind,
        /// What went wrong and what to do (the status alone rarely says).
        message: String,
        stats: EventStats,
    },
}

impl Event {
    pub fn token(origin: Origin, token: u32, logprob: f32, stats: EventStats) -> Self {
        Self::Token {
            origin,
            token,
            logprob,
            stats,
        }
    }

    pub fn finished(origin: Origin, reason: FinishReason, stats: EventStats) -> Self {
        Self::Finished {
            origin,
            reason,
            stats,
        }
    }

    pub fn error(origin: Origin, error: &Error, stats: EventStats) -> Self {
        Self::Error {
            origin,
            kind: error.kind(),
            message: error.message().to_string(),
            stats,
        }
    }

    pub fn origin(&self) -> Origin {
        match self {
            Self::Token { origin, .. }
            | Self::Finished { origin, .. }
            | Self::Error { origin, .. } => *origin,
        }
    }

    pub fn request_id(&self) -> u64 {
        self.origin().request_id
    }

    pub fn user_tag(&self) -> u64 {
        self.origin().user_tag
    }

    pub fn kind(&self) -> EventKind {
        match self {
            Self::Token { .. } => EventKind::Token,
            Self::Finished { .. } => EventKind::Finished,
            Self::Error { .. } => EventKind::Error,
        }
    }

    pub fn stats(&self) -> &EventStats {
        match self {
            Self::Token { stats, .. }
            | Self::Finished { stats, .. }
            | Self::Error { stats, .. } => stats,
        }
    }

    /// TOKEN events: the token.
    pub fn token_id(&self) -> Option<u32> {
        match self {
            Self::Token { token, .. } => Some(*token),
            _ => None,
        }
    }

    /// TOKEN events: the log-probability (0 unless the request asked for it); else 0.
    pub fn logprob(&self) -> f32 {
        match self {
            Self::Token { logprob, .. } => *logprob,
            _ => 0.0,
        }
    }

    /// FINISHED events: why.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        match self {
            Self::Finished { reason, .. } => Some(*reason),
            _ => None,
        }
    }

    /// ERROR events: the status.
    pub fn error_kind(&self) -> Option<ErrorKind> {
        match self {
            Self::Error { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// ERROR events: the message.
    pub fn message(&self) -> Option<&str> {
        match self {
            Self::Error { message, .. } => Some(message),
            _ => None,
        }
    }

    pub fn is_terminal(&self) -> bool {
        !matches!(self, Self::Token { .. })
    }
}

/// A host callback: called from the engine thread, one event at a time, never concurrently.
pub trait EventCallback: Send + Sync {
    fn deliver(&self, event: &Event);
}

struct Queue {
    events: VecDeque<Event>,
    /// Unpolled events per request: requests with events waiting pause once the queue is full.
    per_request: HashMap<u64, u32>,
    callback: Option<Arc<dyn EventCallback>>,
    /// The engine thread has stopped: nothing more will be queued.
    closed: bool,
    /// [`Held`] guards alive: events queued meanwhile wake no poller until the last drops.
    held: u32,
    /// An event was queued while held: the last guard wakes the pollers.
    unnotified: bool,
}

/// Where the engine thread puts events.
pub struct EventSink {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// Unpolled events beyond which the engine pauses the requests whose events wait.
    limit: usize,
}

impl Default for EventSink {
    fn default() -> Self {
        Self::new(usize::MAX)
    }
}

/// See [`EventSink::hold`].
pub struct Held<'a>(&'a EventSink);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut q = self.0.lock();
        q.held -= 1;
        if q.held == 0 && std::mem::take(&mut q.unnotified) {
            // After the lock is released: a poller woken under it would sleep again on it.
            drop(q);
            self.0.ready.notify_all();
        }
    }
}

/// What one poll took.
pub struct Polled {
    pub events: Vec<Event>,
    /// The queue was at its limit before: paused requests may continue now.
    pub freed: bool,
}

impl EventSink {
    /// A sink that pauses requests (see [`Self::paused`]) once `limit` events are unpolled.
    pub fn new(limit: usize) -> Self {
        Self {
            queue: Mutex::new(Queue {
                events: VecDeque::new(),
                per_request: HashMap::new(),
                callback: None,
                closed: false,
                held: 0,
                unnotified: false,
            }),
            ready: Condvar::new(),
            limit,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A panic while holding this lock cannot leave the queue half-updated (each
        // operation is one push or pop), so a poisoned lock is still usable.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Delivers `event`: to the callback when one is set (outside the lock), else queued.
    pub fn emit(&self, event: Event) {
        let callback = {
            let mut q = self.lock();
            match &q.callback {
                Some(cb) => Arc::clone(cb),
                None => {
                    *q.per_request.entry(event.request_id()).or_insert(0) += 1;
                    q.events.push_back(event);
                    if q.held > 0 {
                        q.unnotified = true;
                    } else {
                        // After the lock is released: a poller woken under it would sleep
                        // again on it (and on few cores preempt the engine thread twice).
                        drop(q);
                        self.ready.notify_all();
                    }
                    return;
                }
            }
        };
        callback.deliver(&event);
    }

    /// Until the guard drops, queued events wake no poller; then one wake-up covers them all.
    /// The engine thread holds one while it emits several events with no computing between
    /// them (a landed room's first token and, with `max_new_tokens = 1`, its end): a waiting
    /// poller wakes once, instead of once per event — on a busy machine each wake-up also
    /// preempts the engine thread. A callback is called at once either way.
    pub fn hold(&self) -> Held<'_> {
        self.lock().held += 1;
        Held(self)
    }

    /// The requests to pause: with `limit` or more events unpolled, every request that has
    /// events waiting (the others may still add one step's worth each). Empty otherwise.
    pub fn paused(&self) -> HashSet<u64> {
        let q = self.lock();
        if q.events.len() < self.limit {
            return HashSet::new();
        }
        q.per_request.keys().copied().collect()
    }

    /// Switches to push mode (or back to polling with `None`); events queued before are handed
    /// to the new callback first (on the calling thread — the engine thread when called from
    /// the worker). Pollers waiting meanwhile return UNSUPPORTED.
    pub fn set_callback(&self, callback: Option<Arc<dyn EventCallback>>) -> Vec<Event> {
        let mut q = self.lock();
        q.callback = callback;
        self.ready.notify_all();
        if q.callback.is_some() {
            q.per_request.clear();
            q.events.drain(..).collect()
        } else {
            Vec::new()
        }
    }

    /// Up to `max` queued events, waiting up to `timeout` (None = forever) for the first;
    /// returns early (with none) once the sink is closed and empty.
    pub fn poll(&self, max: usize, timeout: Option<Duration>) -> Result<Polled> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.lock();
        loop {
            if q.callback.is_some() {
                return Err(crate::error::Error::unsupported(
                    "an event callback is set: events go to it, not to dsv4_poll; set a NULL \
                     callback to poll again",
                ));
            }
            if !q.events.is_empty() || max == 0 || q.closed {
                let freed = q.events.len() >= self.limit;
                let n = q.events.len().min(max);
                let events: Vec<Event> = q.events.drain(..n).collect();
                for e in &events {
                    if let Some(c) = q.per_request.get_mut(&e.request_id()) {
                        *c -= 1;
                        if *c == 0 {
                            q.per_request.remove(&e.request_id());
                        }
                    }
                }
                return Ok(Polled { events, freed });
            }
            match deadline {
                None => q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(Polled {
                            events: Vec::new(),
                            freed: false,
                        });
                    }
                    q = self
                        .ready
                        .wait_timeout(q, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// The engine thread has stopped: pollers waiting for an event return with what is left.
    pub fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// Drops queued events (destroy).
    pub fn clear(&self) {
        let mut q = self.lock();
        q.events.clear();
        q.per_request.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn token(id: u64) -> Event {
        let origin = Origin {
            request_id: id,
            user_tag: 0,
        };
        Event::token(origin, 7, 0.0, EventStats::default())
    }

    #[test]
    fn events_emitted_while_held_wake_a_waiting_poller_once_for_all() {
        let sink = Arc::new(EventSink::default());
        let (tx, rx) = mpsc::channel();
        let poller = {
            let sink = sink.clone();
            std::thread::spawn(move || {
                let polled = sink.poll(16, Some(Duration::from_secs(10))).unwrap();
                tx.send(polled.events.len()).unwrap();
                // Not held: each event wakes the poller at once.
                let polled = sink.poll(16, Some(Duration::from_secs(10))).unwrap();
                tx.send(polled.events.len()).unwrap();
            })
        };
        std::thread::sleep(Duration::from_millis(50)); // the poller waits
        {
            let _outer = sink.hold();
            sink.emit(token(1));
            {
                let _inner = sink.hold();
                sink.emit(token(1));
            }
            // Neither the events nor the inner guard's end woke it.
            std::thread::sleep(Duration::from_millis(100));
            assert!(rx.try_recv().is_err(), "a held event woke the poller");
            sink.emit(token(1));
        }
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(3));
        sink.emit(token(2));
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(1));
        poller.join().unwrap();
    }
}
