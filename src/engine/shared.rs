//! What the engine handle and its thread share: the event sink, the inbox, the admission
//! books, the live set and the metrics; and what travels between them (an accepted request, an
//! exported sequence).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use super::event::EventSink;
use super::inbox::Inbox;
use super::metrics::Metrics;
use super::request::RequestSpec;
use crate::kv::SequenceState;

/// How a shutdown ends the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Every accepted request runs to its end.
    Drain,
    /// Every accepted request ends now with FINISHED/ABORTED.
    Abort,
}

/// Where an engine stands, for a host's health checks ([`super::Engine::state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineState {
    /// Loading its weights. `Engine::create` returns only once loading has finished, so no
    /// handle ever reports it; it exists for hosts that report a state before they have one.
    Loading,
    /// Accepting requests.
    Ready,
    /// A shutdown began (drain, or an abort still ending requests): submits are refused, the
    /// requests in flight are still running to their end.
    Draining,
    /// Shut down: the engine thread has ended every request and stopped.
    Stopped,
    /// The engine thread died (a panic): every request got an ERROR event and every later call
    /// fails; destroy the engine and create a new one.
    Failed,
}

impl EngineState {
    /// The lowercase name (`"ready"`, …), as in logs and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Loading => "loading",
            Self::Ready => "ready",
            Self::Draining => "draining",
            Self::Stopped => "stopped",
            Self::Failed => "failed",
        }
    }
}

/// Units in use per pool kind after a cache flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    pub pages: usize,
    pub slots: usize,
    pub snapshots: usize,
}

/// An accepted request on its way to the engine thread.
pub struct Pending {
    pub id: u64,
    pub spec: RequestSpec,
    pub submitted: Instant,
    /// Tokens this request may generate (max_new_tokens clamped to the context limit).
    pub max_gen: usize,
    /// Set for a request that continues a sequence exported from another engine.
    pub import: Option<Box<ExportedSequence>>,
}

/// A decoding request's complete state, taken between steps (the request keeps running):
/// the KV regions and their bytes ([`SequenceState`], with the last sampled token and the
/// sampler's RNG state filled), and the prompt + generated token ids.
#[derive(Debug, Clone)]
pub struct ExportedSequence {
    pub state: SequenceState,
    pub bytes: Vec<u8>,
    /// Prompt then generated tokens; the last one is sampled and not yet fed.
    pub tokens: Vec<u32>,
    pub generated: usize,
}

/// Admission counters, shared with submitting threads.
#[derive(Debug, Default)]
pub struct Admission {
    /// Accepted requests not yet running.
    pub queued_requests: u64,
    /// Prompt tokens of accepted requests not yet prefilled (or taken from the cache).
    pub queued_tokens: u64,
}

/// State shared by the engine handle and its thread.
pub struct Shared {
    pub sink: EventSink,
    pub inbox: Inbox,
    pub admission: Mutex<Admission>,
    /// Accepted requests without a terminal event yet, with their user tags.
    pub live: Mutex<HashMap<u64, u64>>,
    pub next_id: AtomicU64,
    /// Set when the engine thread has ended.
    pub stopped: Mutex<bool>,
    pub stopped_cv: Condvar,
    /// Set when the engine thread panicked: every later call fails with this message.
    pub dead: Mutex<Option<String>>,
    pub metrics: Metrics,
    /// When the engine thread last finished a forward step (`dsv4_seconds_since_last_step`).
    pub steps: super::health::StepClock,
}

impl Shared {
    /// `max_unpolled`: unpolled events beyond which requests with events waiting pause.
    pub fn new(max_unpolled: usize) -> Self {
        Self {
            sink: EventSink::new(max_unpolled),
            inbox: Inbox::default(),
            admission: Mutex::new(Admission::default()),
            live: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            stopped: Mutex::new(false),
            stopped_cv: Condvar::new(),
            dead: Mutex::new(None),
            metrics: Metrics::default(),
            steps: Default::default(),
        }
    }

    pub fn admission(&self) -> std::sync::MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u64>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The panic message once the engine thread has died.
    pub fn dead(&self) -> Option<String> {
        self.dead.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl crate::pd::Sink for Shared {
    fn notice(&self, notice: crate::pd::Notice) {
        self.inbox.pd_notice(notice);
    }

    fn notices(&self, notices: Vec<crate::pd::Notice>) {
        self.inbox.pd_notices(notices);
    }
}
