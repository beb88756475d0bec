//! What the engine tells the host: one event per generated token and exactly one terminal event
//! (FINISHED or ERROR) per accepted request, delivered by polling or by a callback.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{ErrorKind, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Token,
    Finished,
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    None,
    Length,
    Stop,
    Aborted,
    Timeout,
}

/// One event. Counters and timings are filled on terminal events (and the token ones where
/// known: `ttft_us` from the first token on).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub request_id: u64,
    pub user_tag: u64,
    pub kind: EventKind,
    /// TOKEN events: the token; otherwise −1.
    pub token: i32,
    /// TOKEN events of requests that asked for log-probabilities; otherwise 0.
    pub logprob: f32,
    pub finish_reason: FinishReason,
    /// ERROR events: why.
    pub error: Option<ErrorKind>,
    pub prompt_tokens: u32,
    pub cached_tokens_device: u32,
    pub cached_tokens_host: u32,
    pub generated_tokens: u32,
    pub queue_us: u64,
    pub ttft_us: u64,
    pub elapsed_us: u64,
}

impl Event {
    pub fn is_terminal(&self) -> bool {
        self.kind != EventKind::Token
    }
}

/// A host callback: called from the engine thread, one event at a time, never concurrently.
pub trait EventCallback: Send + Sync {
    fn deliver(&self, event: &Event);
}

struct Queue {
    events: VecDeque<Event>,
    callback: Option<Arc<dyn EventCallback>>,
}

/// Where the engine thread puts events.
pub struct EventSink {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Default for EventSink {
    fn default() -> Self {
        Self {
            queue: Mutex::new(Queue {
                events: VecDeque::new(),
                callback: None,
            }),
            ready: Condvar::new(),
        }
    }
}

impl EventSink {
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
                    q.events.push_back(event);
                    self.ready.notify_all();
                    return;
                }
            }
        };
        callback.deliver(&event);
    }

    /// Switches to push mode (or back to polling with `None`); events queued before are handed
    /// to the new callback first (on the calling thread — the engine thread when called from
    /// the worker).
    pub fn set_callback(&self, callback: Option<Arc<dyn EventCallback>>) -> Vec<Event> {
        let mut q = self.lock();
        q.callback = callback;
        if q.callback.is_some() {
            q.events.drain(..).collect()
        } else {
            Vec::new()
        }
    }

    /// Up to `max` queued events, waiting up to `timeout` (None = forever) for the first.
    pub fn poll(&self, max: usize, timeout: Option<Duration>) -> Result<Vec<Event>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.lock();
        loop {
            if q.callback.is_some() {
                return Err(crate::error::Error::unsupported(
                    "an event callback is set: events go to it, not to dsv4_poll; set a NULL \
                     callback to poll again",
                ));
            }
            if !q.events.is_empty() || max == 0 {
                let n = q.events.len().min(max);
                return Ok(q.events.drain(..n).collect());
            }
            match deadline {
                None => q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(Vec::new());
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

    /// Wakes pollers (shutdown).
    pub fn wake(&self) {
        self.ready.notify_all();
    }

    /// Drops queued events (destroy).
    pub fn clear(&self) {
        self.lock().events.clear();
    }
}
