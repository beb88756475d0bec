//! The requests the scheduler holds: queued ([`Waiting`]) and running ([`Running`]), each with
//! its [`Phase`], and what a request has done so far ([`Progress`]), which survives a
//! retraction.

use std::sync::Mutex;
use std::time::Instant;

use super::view::SeqView;
use crate::engine::phase::Phase;
use crate::engine::request::RequestSpec;
use crate::engine::sampling::Sampler;
use crate::engine::shared::{Admission, Pending};

/// What a request has done so far; kept across a retraction.
pub struct Progress {
    pub sampler: Sampler,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub generated: usize,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
    pub queue_us: u64,
    /// Prompt tokens reused from the cache when it first ran (reported in events).
    pub cached: usize,
    pub cached_host: usize,
    /// Counted in the metrics as started (prompt, cached and queue time) once.
    pub counted: bool,
}

impl Progress {
    /// A request about to run for the first time here: `tokens` (its prompt, or everything an
    /// imported sequence holds) of which `generated` were sampled.
    pub fn new(sampler: Sampler, tokens: Vec<u32>, generated: usize) -> Self {
        Self {
            sampler,
            tokens,
            generated,
            first_token: None,
            last_token: None,
            queue_us: 0,
            cached: 0,
            cached_host: 0,
            counted: false,
        }
    }
}

/// A queued request: `Waiting`, `Imported` or `Retracted`.
pub struct Waiting {
    pub pending: Box<Pending>,
    /// Known for a retracted or imported request: recompute (or import) its tokens, then
    /// continue with its sampler.
    pub progress: Option<Box<Progress>>,
    phase: Phase,
}

impl Waiting {
    /// A request as submitted (or requeued before it ran); an import uses [`Self::imported`].
    pub fn new(pending: Box<Pending>) -> Self {
        debug_assert!(
            pending.import.is_none(),
            "an import waits with its progress"
        );
        Self {
            pending,
            progress: None,
            phase: Phase::Waiting,
        }
    }

    /// An imported request: its tokens and sampler come from the export.
    pub fn imported(pending: Box<Pending>, progress: Box<Progress>) -> Self {
        debug_assert!(pending.import.is_some());
        Self {
            pending,
            progress: Some(progress),
            phase: Phase::Imported,
        }
    }

    /// A running request sent back to the queue from `from`: retracted once it has run (it
    /// keeps its progress), else waiting again as submitted. Only a request still loading back
    /// can be uncounted: a request is counted when its prefill's pages are reserved.
    pub fn requeued(pending: Box<Pending>, progress: Progress, from: Phase) -> Self {
        debug_assert!(from == Phase::LoadingBack || progress.counted);
        if progress.counted {
            Self {
                pending,
                progress: Some(Box::new(progress)),
                phase: from.become_(Phase::Retracted),
            }
        } else {
            Self {
                pending,
                progress: None,
                phase: from.become_(Phase::Waiting),
            }
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// What it must (re)compute or import: its prompt, or a resumed request's every token.
    pub fn tokens(&self) -> &[u32] {
        self.progress
            .as_ref()
            .map_or(&self.pending.spec.prompt, |p| &p.tokens)
    }

    pub fn generated(&self) -> usize {
        self.progress.as_ref().map_or(0, |p| p.generated)
    }
}

/// A request that holds a slot: `LoadingBack`, `Prefilling` or `Decoding`. `S` is its KV
/// sequence (`kv::Request` in the engine).
pub struct Running<S> {
    pub id: u64,
    pub spec: RequestSpec,
    pub submitted: Instant,
    pub req: S,
    /// Tokens to compute before the next sample: the prompt, or every token of a resumed
    /// request (an imported one has computed them all).
    pub prefill_len: usize,
    pub max_gen: usize,
    pub p: Progress,
    phase: Phase,
    /// What this request adds to the admission's `queued_tokens`: its whole prefill until its
    /// pages are reserved, then what is left of it. Every change goes through `recount`, and
    /// ending or requeueing takes exactly this back, so the books balance on every path.
    pub queued_tokens: usize,
    /// Still counted in the admission's `queued_requests` (a PD decode's reservation, until
    /// its state arrives).
    pub holds_queue_slot: bool,
    /// PD prefill: pages of its prompt already sent to the claimed room ahead of the rest.
    pub pages_sent_early: usize,
}

impl<S: SeqView> Running<S> {
    /// Waiting request `w` started with sequence `req`: in `phase` (`LoadingBack`,
    /// `Prefilling`, or `Decoding` for an import), its prefill `prefill_len` tokens.
    pub fn start(w: Waiting, req: S, prefill_len: usize, phase: Phase, progress: Progress) -> Self {
        let pending = *w.pending;
        Self {
            id: pending.id,
            spec: pending.spec,
            submitted: pending.submitted,
            req,
            prefill_len,
            max_gen: pending.max_gen,
            p: progress,
            phase: w.phase.become_(phase),
            queued_tokens: 0,
            holds_queue_slot: false,
            pages_sent_early: 0,
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn set_phase(&mut self, next: Phase) {
        self.phase = self.phase.become_(next);
    }

    /// Holds its prefill's pages (takes part in steps).
    pub fn reserved(&self) -> bool {
        self.phase.is_reserved()
    }

    pub fn decoding(&self) -> bool {
        self.phase == Phase::Decoding
    }

    /// What `queued_tokens` should be now.
    pub fn unprefilled(&self) -> usize {
        if self.reserved() {
            self.prefill_len.saturating_sub(self.req.position())
        } else {
            self.prefill_len
        }
    }

    /// Brings this request's share of the admission's `queued_tokens` up to date.
    pub fn recount(&mut self, admission: &Mutex<Admission>) {
        let now = self.unprefilled();
        if now != self.queued_tokens {
            let mut a = admission.lock().unwrap_or_else(|e| e.into_inner());
            a.queued_tokens = a.queued_tokens + now as u64 - self.queued_tokens as u64;
            self.queued_tokens = now;
        }
    }

    /// Back to a queue entry (for a requeue): the request as submitted, with its progress and
    /// the phase it leaves; its sequence separately.
    pub fn into_parts(self) -> (Box<Pending>, Progress, Phase, S) {
        let pending = Box::new(Pending {
            id: self.id,
            spec: self.spec,
            submitted: self.submitted,
            max_gen: self.max_gen,
            import: None,
        });
        (pending, self.p, self.phase, self.req)
    }
}
