//! Which requests run and what each step computes. The scheduler owns every request between
//! submit and its end: the queue (`Waiting`, `Imported`, `Retracted`) and the running set
//! (`LoadingBack`, `Prefilling`, `Decoding`), each entry with its [`Phase`]. It decides, the
//! engine thread carries out: the scheduler never allocates, runs the model or emits events,
//! and sees the pools only through [`KvView`], so its rules are unit-tested on plain numbers
//! (`tests.rs`).
//!
//! The rules:
//! - **Order.** Retracted and imported requests first; then, under `lpm` (up to
//!   `lpm_max_waiting` queued), the longest reusable cached prefix; then priority; then
//!   arrival.
//! - **Admission.** A queued request starts when its prefill's pages plus, for it and every
//!   running request, `new_token_ratio` of what they may still generate fit the free and
//!   reclaimable pages. The ratio (SGLang's conservative defaults) starts at 0.7, decays by
//!   0.001 per decode step to 0.1, and rises by 0.2 (at least back to 0.7) per retraction.
//! - **Steps.** Decode tokens first (one per decoding request that has its next page), then
//!   prefill chunks up to `max_batch_tokens`, each at most `chunked_prefill_tokens` and cut at
//!   the next snapshot point. Requests paused for unpolled events sit a step out.
//! - **Retraction.** A decoding request that finds no page retracts the running request with
//!   the lowest priority, newest first.

mod entries;
#[cfg(test)]
mod tests;
mod view;

use std::collections::HashSet;
use std::ops::Range;
use std::time::{Duration, Instant};

pub use entries::{Progress, Running, Waiting};
pub use view::{KvView, SeqView};

use super::phase::Phase;
use crate::config::params::SchedulerPolicy;

/// Scheduling limits from the params.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_running: usize,
    pub chunk_tokens: usize,
    pub batch_tokens: usize,
    pub queue_timeout: Option<Duration>,
    pub policy: SchedulerPolicy,
    pub lpm_max_waiting: usize,
}

/// The admission estimate's share of remaining `max_new_tokens`: it starts at INIT, decays by
/// DECAY per decode step to MIN, and rises by BUMP (at least back to INIT) per retraction.
pub const RATIO_INIT: f64 = 0.7;
pub const RATIO_MIN: f64 = 0.1;
pub const RATIO_DECAY: f64 = 0.001;
pub const RATIO_BUMP: f64 = 0.2;

/// One running request's part of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    /// Index into the running set.
    pub index: usize,
    /// The positions it computes.
    pub tokens: Range<usize>,
    /// Samples after them (a decode token, or the last chunk of a prefill).
    pub sample: bool,
}

/// What one forward step computes: decode tokens first, then prefill chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub items: Vec<Planned>,
    /// How many of `items` (the first ones) are decode tokens.
    pub decodes: usize,
}

impl StepPlan {
    pub fn tokens(&self) -> usize {
        self.items.iter().map(|p| p.tokens.len()).sum()
    }
}

/// The queue, the running set and the rules that move requests between them.
pub struct Scheduler<S> {
    pub limits: Limits,
    pub waiting: Vec<Waiting>,
    pub running: Vec<Running<S>>,
    /// Admission failed for lack of pages; retried once something ends.
    pub blocked: bool,
    new_token_ratio: f64,
}

impl<S: SeqView> Scheduler<S> {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            waiting: Vec::new(),
            running: Vec::new(),
            blocked: false,
            new_token_ratio: RATIO_INIT,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// The admission estimate's current share of remaining `max_new_tokens`.
    pub fn new_token_ratio(&self) -> f64 {
        self.new_token_ratio
    }

    /// Running requests that take part in steps, and those still loading back.
    pub fn running_counts(&self) -> (usize, usize) {
        let reserved = self.running.iter().filter(|r| r.reserved()).count();
        let loading = self
            .running
            .iter()
            .filter(|r| r.phase() == Phase::LoadingBack)
            .count();
        (reserved, loading)
    }

    // --- the queue ---------------------------------------------------------------------------

    /// The queued request to start next (see the module docs for the order).
    pub fn next_waiting(&self, kv: &impl KvView<S>) -> Option<usize> {
        let lpm = self.limits.policy == SchedulerPolicy::Lpm
            && self.waiting.len() <= self.limits.lpm_max_waiting;
        (0..self.waiting.len()).min_by_key(|&i| {
            let w = &self.waiting[i];
            let p = &w.pending;
            let cached = if lpm {
                kv.cached_prefix(p.spec.cache_salt.as_deref(), w.tokens())
            } else {
                0
            };
            (
                w.phase() == Phase::Waiting,
                std::cmp::Reverse(cached),
                std::cmp::Reverse(p.spec.priority),
                p.id,
            )
        })
    }

    /// Tokens the admission estimate expects a request with `remaining` tokens to generate.
    fn expected(&self, remaining: usize) -> usize {
        (self.new_token_ratio * remaining as f64).ceil() as usize
    }

    /// Whether queued request `i` fits next to the running ones: the pages its prefill needs
    /// plus, for it and every running request, `new_token_ratio` of what they may still
    /// generate, against the free and reclaimable pages. A request always fits an empty
    /// running set (if its pages cannot be found, nothing else will free them).
    pub fn fits(&self, i: usize, kv: &impl KvView<S>) -> bool {
        if self.running.is_empty() {
            return true;
        }
        let mut need = 0;
        for r in &self.running {
            let target = r.prefill_len.max(r.req.position())
                + self.expected(r.max_gen.saturating_sub(r.p.generated));
            need += kv.pages_for(target).saturating_sub(r.req.pages_held());
        }
        let w = &self.waiting[i];
        let tokens = w.tokens();
        let remaining = w.pending.max_gen.saturating_sub(w.generated());
        let (own, available) = kv.page_budget(
            w.pending.spec.cache_salt.as_deref(),
            tokens,
            tokens.len() + self.expected(remaining),
        );
        need + own <= available
    }

    /// Whether another request may start now (a free running place, admission not blocked).
    pub fn may_start(&self) -> bool {
        !self.blocked && self.running.len() < self.limits.max_running
    }

    /// The queue timeout of a queued request (retracted and imported ones already ran: only
    /// their deadline applies).
    pub fn queue_deadline(&self, w: &Waiting) -> Option<Instant> {
        match (w.phase(), self.limits.queue_timeout) {
            (Phase::Waiting, Some(q)) => Some(w.pending.submitted + q),
            _ => None,
        }
    }

    /// Whether queued request `w` has waited past its queue timeout or deadline at `now`.
    pub fn waiting_expired(&self, w: &Waiting, now: Instant) -> bool {
        self.queue_deadline(w).is_some_and(|t| now >= t)
            || past_deadline(w.pending.submitted, w.pending.spec.deadline_ms, now)
    }

    /// The earliest queue timeout or deadline among queued requests.
    pub fn next_deadline(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        for w in &self.waiting {
            let p = &w.pending;
            if let Some(t) = self.queue_deadline(w) {
                consider(t);
            }
            if p.spec.deadline_ms > 0 {
                consider(p.submitted + Duration::from_millis(p.spec.deadline_ms.into()));
            }
        }
        next
    }

    // --- steps -------------------------------------------------------------------------------

    /// The next step over every runnable request (see the module docs); `None` when nothing
    /// can run. Requests in `paused` sit it out. A step with decode tokens decays the
    /// admission estimate.
    pub fn plan_step(&mut self, kv: &impl KvView<S>, paused: &HashSet<u64>) -> Option<StepPlan> {
        let mut items = Vec::new();
        let mut budget = self.limits.batch_tokens;
        for (i, r) in self.running.iter().enumerate() {
            let pos = r.req.position();
            if paused.contains(&r.id) {
                continue;
            }
            if r.decoding() && kv.pages_for(pos + 1) <= r.req.pages_held() {
                items.push(Planned {
                    index: i,
                    tokens: pos..pos + 1,
                    sample: true,
                });
                budget = budget.saturating_sub(1);
            }
        }
        let decodes = items.len();
        for (i, r) in self.running.iter().enumerate() {
            let pos = r.req.position();
            if r.phase() != Phase::Prefilling
                || pos >= r.prefill_len
                || budget == 0
                || paused.contains(&r.id)
            {
                continue;
            }
            let end = kv
                .chunk_limit(&r.req)
                .min(pos + self.limits.chunk_tokens)
                .min(pos + budget);
            budget -= end - pos;
            items.push(Planned {
                index: i,
                tokens: pos..end,
                sample: end == r.prefill_len,
            });
        }
        if items.is_empty() {
            return None;
        }
        if decodes > 0 {
            self.new_token_ratio = (self.new_token_ratio - RATIO_DECAY).max(RATIO_MIN);
        }
        Some(StepPlan { items, decodes })
    }

    // --- decode pages and retraction -----------------------------------------------------------

    /// Decoding requests whose next token needs a page they do not hold, oldest first.
    pub fn needing_pages(&self, kv: &impl KvView<S>) -> Vec<usize> {
        let mut needy: Vec<(u64, usize)> = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, r)| {
                r.decoding() && kv.pages_for(r.req.position() + 1) > r.req.pages_held()
            })
            .map(|(i, r)| (r.id, i))
            .collect();
        needy.sort_unstable();
        needy.into_iter().map(|(_, i)| i).collect()
    }

    /// The running request to retract: lowest priority, then the newest (of those holding
    /// pages).
    pub fn retraction_victim(&self) -> Option<usize> {
        (0..self.running.len())
            .filter(|&i| self.running[i].reserved())
            .max_by_key(|&i| {
                let r = &self.running[i];
                (std::cmp::Reverse(r.spec.priority), r.id)
            })
    }

    /// A retraction happened: the estimate was too low. Blocks admission until something ends.
    pub fn note_retraction(&mut self) {
        self.new_token_ratio = (self.new_token_ratio + RATIO_BUMP).clamp(RATIO_INIT, 1.0);
        self.blocked = true;
    }
}

/// Whether a request submitted at `submitted` with `deadline_ms` (0 = none) is past it at `now`.
pub fn past_deadline(submitted: Instant, deadline_ms: u32, now: Instant) -> bool {
    deadline_ms > 0 && now >= submitted + Duration::from_millis(deadline_ms.into())
}
