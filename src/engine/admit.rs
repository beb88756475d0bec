//! From the queue to the running set: the scheduler picks the next queued request and says
//! whether it fits; here its sequence is started (a prefix-cache hit, a load-back from the host
//! tier, or an imported state) and its prefill's pages are reserved.

use std::time::Duration;

use super::executor::{micros, End};
use super::phase::Phase;
use super::sampling::Sampler;
use super::scheduler::{Progress, Running};
use super::worker::Worker;
use crate::backend::Backend;
use crate::error::ErrorKind;

impl<B: Backend> Worker<B> {
    /// Starts queued requests while the scheduler says they fit.
    pub(super) fn admit(&mut self) {
        while self.sched.may_start() {
            let Some(i) = self.sched.next_waiting(&self.cache) else {
                return;
            };
            if !self.sched.fits(i, &self.cache) {
                self.sched.blocked = true;
                return;
            }
            let w = &self.sched.waiting[i];
            let salt = w.pending.spec.cache_salt.clone();
            // What admission counted for it (its tokens), and what it must compute before it
            // samples: everything, or for an import nothing past the exported position.
            let queued = w.tokens().len();
            // A PD decode's request: its destination, for the state the prefill sends.
            let receives = self.receives(w.pending.spec.pd_room);
            let started = match &w.pending.import {
                _ if receives => self
                    .cache
                    .reserve_import(salt.as_deref(), w.pending.spec.prompt.len())
                    .map(|r| (r, queued)),
                Some(x) => self
                    .cache
                    .import(
                        salt.as_deref(),
                        w.pending.spec.prompt.len(),
                        &x.state,
                        &x.bytes,
                    )
                    .map(|r| (r, x.state.position)),
                None => self
                    .cache
                    .start(salt.as_deref(), w.tokens())
                    .map(|r| (r, queued)),
            };
            let (mut req, prefill_len) = match started {
                Ok(r) => r,
                Err(e) if e.kind() != ErrorKind::Capacity && w.phase() == Phase::Imported => {
                    // A state this engine can never take (another layout, altered bytes).
                    log::warn!("request {}: cannot import: {e}", w.pending.id);
                    self.end_waiting(i, End::Failed(e));
                    continue;
                }
                Err(e) => {
                    log::warn!("request {}: cannot start: {e}", w.pending.id);
                    self.sched.blocked = true;
                    return;
                }
            };
            // The prefill's pages now (after its load-back, for a host hit: `finish_loads`);
            // decode pages one at a time (`make_room_for_decode`).
            let phase = if receives {
                Phase::Receiving
            } else if req.is_loading() {
                Phase::LoadingBack
            } else if let Err(e) = self.cache.reserve(&mut req, prefill_len) {
                self.cache.abort(req);
                if self.sched.running.is_empty() {
                    // Nothing will free pages: it can never run.
                    log::warn!("request {}: {e}", self.sched.waiting[i].pending.id);
                    self.end_waiting(i, End::Failed(e));
                    continue;
                }
                self.sched.blocked = true;
                return;
            } else if w.phase() == Phase::Imported {
                Phase::Decoding
            } else {
                Phase::Prefilling
            };
            let mut w = self.sched.waiting.remove(i);
            // The KV is in the pools now; the bytes are not needed again.
            w.pending.import = None;
            {
                let mut a = self.shared.admission();
                // A decode's reservation stays counted until its state arrives.
                if !receives {
                    a.queued_requests -= 1;
                }
                a.queued_tokens -= queued as u64;
            }
            let room = w.pending.spec.pd_room;
            let mut p = match w.progress.take() {
                Some(p) => *p,
                None => {
                    let spec = &w.pending.spec;
                    let seed = if spec.seed != 0 {
                        spec.seed
                    } else {
                        self.rng.u64(..)
                    };
                    // Room for the tokens it will generate (up to 1024), so the first one
                    // does not reallocate and copy the whole prompt.
                    let mut tokens = Vec::with_capacity(
                        spec.prompt.len() + (spec.max_new_tokens as usize).min(1024),
                    );
                    tokens.extend_from_slice(&spec.prompt);
                    Progress::new(Sampler::new(spec.sampling.clone(), seed), tokens, 0)
                }
            };
            if !p.counted {
                p.queue_us = micros(w.pending.submitted.elapsed());
            }
            self.sched
                .running
                .push(Running::start(w, req, prefill_len, phase, p));
            let i = self.sched.running.len() - 1;
            self.sched.running[i].holds_queue_slot = receives;
            self.sched.running[i].recount(&self.shared.admission);
            if phase != Phase::LoadingBack {
                self.on_ready(i);
            }
            if receives {
                self.claim_room(i);
            } else if room != 0 {
                if let Some(node) = &self.pd {
                    node.left_queue(room);
                }
            }
        }
    }

    /// Whether a request in `room` receives its state from a prefill engine (decode role).
    fn receives(&self, room: u64) -> bool {
        room != 0
            && self
                .pd
                .as_ref()
                .is_some_and(|n| n.side() == crate::pd::Side::Decode)
    }

    /// Requests whose load-back has landed get their prefill pages and become runnable; one
    /// that cannot get them now goes back to the queue (its prefix is on the device now, so it
    /// will hit there).
    pub(super) fn finish_loads(&mut self) {
        let mut i = 0;
        while i < self.sched.running.len() {
            let r = &mut self.sched.running[i];
            if r.phase() != Phase::LoadingBack {
                i += 1;
                continue;
            }
            match self.cache.complete_load(&mut r.req, Duration::ZERO) {
                Ok(true) => {}
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Err(e) => {
                    log::error!("request {}: its load-back failed: {e}", r.id);
                    self.end_running(i, End::Failed(e), false);
                    continue;
                }
            }
            let r = &mut self.sched.running[i];
            match self.cache.reserve(&mut r.req, r.prefill_len) {
                Ok(()) => {
                    r.set_phase(Phase::Prefilling);
                    r.recount(&self.shared.admission);
                    self.on_ready(i);
                    i += 1;
                }
                Err(e) => {
                    log::debug!(
                        "request {}: no pages after its load-back ({e}); requeued",
                        r.id
                    );
                    self.requeue(i, false);
                    self.sched.blocked = !self.sched.running.is_empty();
                }
            }
        }
    }

    /// First time a request is ready to compute: queue time, prompt and cached tokens.
    fn on_ready(&mut self, i: usize) {
        let r = &mut self.sched.running[i];
        if r.p.counted {
            return;
        }
        r.p.counted = true;
        r.p.cached = r.req.reused_tokens();
        r.p.cached_host = r.req.reused_host_tokens();
        let (prompt, cached, host, queue) = (
            r.spec.prompt.len() as u64,
            r.p.cached as u64,
            r.p.cached_host as u64,
            r.p.queue_us,
        );
        self.shared.metrics.update(|m| {
            m.prompt_tokens += prompt;
            m.cached_tokens_device += cached - host;
            m.cached_tokens_host += host;
            m.queue_time.observe(queue as f64 * 1e-6);
        });
    }
}
