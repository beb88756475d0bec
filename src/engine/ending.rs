//! Ending requests: every accepted request leaves through here with exactly one terminal event
//! (FINISHED or ERROR), its pool units returned and the admission books balanced. Also aborts,
//! queue timeouts and deadlines.

use std::time::Instant;

use super::event::{Event, EventStats, FinishReason, Origin};
use super::executor::{micros, End, StepOutcome};
use super::metrics::Outcome;
use super::phase::Phase;
use super::scheduler::{past_deadline, StepPlan};
use super::worker::Worker;
use crate::backend::Backend;
use crate::error::{Error, ErrorKind};

/// What a terminal event reports of a request.
struct TerminalInfo {
    origin: Origin,
    prompt_tokens: u32,
    cached: usize,
    cached_host: usize,
    generated: usize,
    submitted: Instant,
    queue_us: u64,
    first_token: Option<Instant>,
    /// The PD room (0: none).
    pd_room: u64,
}

impl<B: Backend> Worker<B> {
    fn terminal(&self, r: TerminalInfo, end: End) {
        if r.pd_room != 0 {
            self.close_room(r.pd_room, &end);
        }
        // Off the live set first: once the host sees the terminal event, abort says NOT_FOUND.
        self.shared.live().remove(&r.origin.request_id);
        let now = Instant::now();
        let outcome = match &end {
            End::Finished(reason) => Outcome::of(*reason),
            End::Failed(_) => Outcome::Error,
        };
        self.shared.metrics.finish(outcome, now - r.submitted);
        let stats = EventStats {
            prompt_tokens: r.prompt_tokens,
            cached_tokens_device: (r.cached - r.cached_host) as u32,
            cached_tokens_host: r.cached_host as u32,
            generated_tokens: r.generated as u32,
            queue_us: r.queue_us,
            ttft_us: r.first_token.map_or(0, |t| micros(t - r.submitted)),
            elapsed_us: micros(now - r.submitted),
        };
        self.shared.sink.emit(match end {
            End::Finished(reason) => Event::finished(r.origin, reason, stats),
            End::Failed(e) => Event::error(r.origin, &e, stats),
        });
    }

    /// Ends queued request `i` (it never ran, or was retracted or imported).
    pub(super) fn end_waiting(&mut self, i: usize, end: End) {
        let w = self.sched.waiting.remove(i);
        debug_assert!(w.phase().may_become(Phase::Finished));
        {
            let mut a = self.shared.admission();
            a.queued_requests -= 1;
            a.queued_tokens -= w.tokens().len() as u64;
        }
        let p = &w.pending;
        let origin = Origin {
            request_id: p.id,
            user_tag: p.spec.user_tag,
        };
        let prompt_tokens = p.spec.prompt.len() as u32;
        let info = match &w.progress {
            Some(g) => TerminalInfo {
                origin,
                prompt_tokens,
                cached: g.cached,
                cached_host: g.cached_host,
                generated: g.generated,
                submitted: p.submitted,
                queue_us: g.queue_us,
                first_token: g.first_token,
                pd_room: p.spec.pd_room,
            },
            None => TerminalInfo {
                origin,
                prompt_tokens,
                cached: 0,
                cached_host: 0,
                generated: 0,
                submitted: p.submitted,
                queue_us: micros(p.submitted.elapsed()),
                first_token: None,
                pd_room: p.spec.pd_room,
            },
        };
        self.terminal(info, end);
    }

    /// Ends running request `i`; `cache` inserts its sequence into the prefix cache.
    pub(super) fn end_running(&mut self, i: usize, end: End, cache: bool) {
        let info = self.release_running(i, cache);
        self.terminal(info, end);
    }

    /// Takes running request `i` out: its sequence goes into the prefix cache (`cache`) or
    /// back to the pools, the gauges are published; returns what its terminal event needs.
    fn release_running(&mut self, i: usize, cache: bool) -> TerminalInfo {
        let mut r = self.sched.running.swap_remove(i);
        let receiving = r.phase() == Phase::Receiving;
        r.set_phase(Phase::Finished);
        {
            let mut a = self.shared.admission();
            a.queued_tokens -= r.queued_tokens as u64;
            if r.holds_queue_slot {
                a.queued_requests -= 1;
            }
        }
        let info = TerminalInfo {
            origin: Origin {
                request_id: r.id,
                user_tag: r.spec.user_tag,
            },
            prompt_tokens: r.spec.prompt.len() as u32,
            cached: r.p.cached,
            cached_host: r.p.cached_host,
            generated: r.p.generated,
            submitted: r.submitted,
            queue_us: r.p.queue_us,
            first_token: r.p.first_token,
            pd_room: r.spec.pd_room,
        };
        let position = r.req.position();
        if receiving {
            // A PD decode's destination: the node's reader may be writing into it.
            if let Some(req) = self.release_landing(r.spec.pd_room, r.req) {
                self.cache.abort(req);
            }
        } else if cache {
            self.cache.finish(r.req, &r.p.tokens[..position]);
        } else {
            self.cache.abort(r.req);
        }
        self.sched.blocked = false;
        // Gauges first: a host that reads metrics on the terminal event sees it gone.
        self.publish();
        info
    }

    /// Ends the requests a step ended (or, when the forward pass failed, every planned one).
    pub(super) fn end_after_step(&mut self, plan: &StepPlan, outcome: StepOutcome) {
        match outcome {
            StepOutcome::Failed(e) => {
                let mut idx: Vec<usize> = plan.items.iter().map(|p| p.index).collect();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    self.end_running(i, End::Failed(e.clone()), false);
                }
            }
            StepOutcome::Ran(mut ended, handed) => {
                // Hand-overs first: they move no request, and end none here (a failed one is
                // ended below by id, after the indices stop mattering).
                let failed = self.hand_over(handed);
                self.send_complete_pages();
                // Highest index first: swap_remove leaves the lower ones in place.
                ended.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
                for (i, end) in ended {
                    match end {
                        End::Failed(e) => self.end_nonfinite(i, e),
                        end => self.end_running(i, end, true),
                    }
                }
                for (id, e) in failed {
                    if let Some(i) = self.sched.running.iter().position(|r| r.id == id) {
                        self.end_running(i, End::Failed(e), true);
                    }
                }
            }
        }
    }

    /// Ends running request `i`, whose sampled logits were not finite, with MODEL_FORMAT and a
    /// message naming the first layer and weights that produced a non-finite value: its
    /// sequence is freed, then re-run once with a finite check after every layer sub-step.
    fn end_nonfinite(&mut self, i: usize, found: Error) {
        let r = &self.sched.running[i];
        let tokens = r.p.tokens[..r.req.position()].to_vec();
        let info = self.release_running(i, false);
        let chunk = self.sched.limits.chunk_tokens;
        let message = match self.exec.diagnose(&mut self.cache, &tokens, chunk) {
            Ok(Some(f)) => format!("request {}: {}", info.origin.request_id, f.message()),
            Ok(None) => format!(
                "{}; a diagnostic re-run of its {} tokens found every layer finite, so the \
                 values came from outside the weights (a logit bias, or a fault during that step)",
                found.message(),
                tokens.len()
            ),
            Err(e) => format!(
                "{}; the diagnostic re-run could not run: {}",
                found.message(),
                e.message()
            ),
        };
        log::error!("{message}");
        let e = Error::new(ErrorKind::ModelFormat, message);
        self.terminal(info, End::Failed(e));
    }

    pub(super) fn abort(&mut self, id: u64) {
        if let Some(i) = self.sched.waiting.iter().position(|w| w.pending.id == id) {
            self.end_waiting(i, End::Finished(FinishReason::Aborted));
        } else if let Some(i) = self.sched.running.iter().position(|r| r.id == id) {
            self.end_running(i, End::Finished(FinishReason::Aborted), false);
        }
    }

    pub(super) fn abort_all(&mut self) {
        let s = &self.sched;
        if !s.is_empty() {
            log::info!(
                "abort shutdown: ending {} waiting and {} running requests",
                s.waiting.len(),
                s.running.len()
            );
        }
        while !self.sched.waiting.is_empty() {
            self.end_waiting(0, End::Finished(FinishReason::Aborted));
        }
        while !self.sched.running.is_empty() {
            self.end_running(0, End::Finished(FinishReason::Aborted), false);
        }
    }

    /// Queue timeouts and deadlines.
    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.sched.waiting.len() {
            if self.sched.waiting_expired(&self.sched.waiting[i], now) {
                self.end_waiting(i, End::Finished(FinishReason::Timeout));
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.sched.running.len() {
            let r = &self.sched.running[i];
            if past_deadline(r.submitted, r.spec.deadline_ms, now) {
                self.end_running(i, End::Finished(FinishReason::Timeout), true);
            } else {
                i += 1;
            }
        }
    }
}
