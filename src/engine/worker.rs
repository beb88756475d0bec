//! The engine thread: takes what callers sent (submits, aborts, the shutdown, control calls),
//! lets the scheduler admit and plan, has the executor run each step, and ends requests. Owns
//! the model's KV state. Its work is split by job: `admit` (queue → running), `retract` (decode
//! pages, retraction), `ending` (terminal events, timeouts, aborts), `controls` (calls answered
//! between steps), `gauges` (metrics refreshed between steps).
//!
//! Pages are reserved for a request's prefill when it starts and one page at a time as it
//! decodes. Admission estimates what the running requests will still need (see
//! [`super::scheduler`]); when the estimate was wrong and a decoding request finds no page, the
//! newest running request is retracted: its sequence goes into the prefix cache, its pages and
//! slot are freed, and it waits at the front of the queue to be recomputed, its sampler and
//! emitted tokens kept, so its output is what it would have been.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::event::{Event, EventStats, Origin};
use super::executor::Executor;
use super::inbox::Batch;
use super::metrics::Outcome;
use super::sampling::Sampler;
use super::scheduler::{Limits, Progress, Scheduler, Waiting};
use super::shared::{Admission, Shared, ShutdownMode};
use crate::backend::Backend;
use crate::error::Error;
use crate::kv::{PrefixCache, Request};
use crate::model::Model;
use crate::pd::{Node, Side};

pub struct Worker<B: Backend> {
    pub(super) exec: Executor<B>,
    pub(super) cache: PrefixCache<B>,
    pub(super) sched: Scheduler<Request>,
    pub(super) shared: Arc<Shared>,
    pub(super) rng: fastrand::Rng,
    pub(super) shutdown: Option<ShutdownMode>,
    /// The PD node (prefill and decode roles).
    pub(super) pd: Option<Arc<Node>>,
    /// Decode: destinations of ended requests that a link's reader was still writing into,
    /// by room: freed on the node's `Notice::Released`.
    pub(super) parked: HashMap<u64, crate::kv::Request>,
    /// The last step had nothing to compute (e.g. every request paused for unpolled events).
    stalled: bool,
}

impl<B: Backend> Worker<B> {
    pub fn new(
        model: Arc<Model<B>>,
        cache: PrefixCache<B>,
        shared: Arc<Shared>,
        limits: Limits,
        pd: Option<Arc<Node>>,
    ) -> Self {
        let hands_over = pd.as_ref().is_some_and(|n| n.side() == Side::Prefill);
        let worker = Self {
            exec: Executor::new(model, hands_over),
            pd,
            cache,
            sched: Scheduler::new(limits),
            shared,
            rng: fastrand::Rng::new(),
            shutdown: None,
            parked: HashMap::new(),
            stalled: false,
        };
        // Gauges are valid from creation on, not from the first step.
        worker.publish();
        worker
    }

    /// Runs until shutdown has ended every request. A panic ends every live request with an
    /// INTERNAL error instead of leaving them without a terminal event, and leaves the engine
    /// dead: every later call fails with the panic's message.
    pub fn run(mut self) {
        crate::threads::mark_internal();
        let shared = Arc::clone(&self.shared);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.main_loop()));
        if let Err(payload) = outcome {
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with a non-text payload".into());
            let message = format!(
                "internal error: the engine thread panicked ({text}); the engine is dead: \
                 destroy it and create a new one (this is a dsv4 bug; please report it)"
            );
            log::error!("{message}");
            *shared.dead.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.clone());
            // Requests still in the inbox were accepted: they are in `live` and end below.
            drop(shared.inbox.close());
            let live: Vec<(u64, u64)> = shared.live().drain().collect();
            let e = Error::internal(message);
            for (request_id, user_tag) in live {
                shared.metrics.finish(Outcome::Error, Duration::ZERO);
                let origin = Origin {
                    request_id,
                    user_tag,
                };
                shared
                    .sink
                    .emit(Event::error(origin, &e, EventStats::default()));
            }
            *shared.admission() = Admission::default();
        }
        // The node's threads may write into the pools (a DATA frame read into a destination,
        // a prefill's RMA writes): they stop before the pools are freed with this worker.
        if let Some(node) = &self.pd {
            node.shutdown();
        }
        *shared.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        shared.stopped_cv.notify_all();
        shared.sink.close();
    }

    /// Decode: gives `room`'s destination back to the pools, or keeps it (in `parked`) while
    /// the node's reader is still writing into it; returns it when it may be freed now.
    pub(super) fn release_landing(
        &mut self,
        room: u64,
        req: crate::kv::Request,
    ) -> Option<crate::kv::Request> {
        match &self.pd {
            Some(node) if !node.release_landing(room) => {
                self.parked.insert(room, req);
                None
            }
            _ => Some(req),
        }
    }

    fn main_loop(&mut self) {
        loop {
            let batch = self.receive();
            // Frames the node queues while this handles what arrived (ACKs of rooms landed
            // together, FAILs) go out together when the cork drops, and so do the claims of
            // the requests admitted below: a burst is one write, not one each. Not held over
            // the cache work between, which would delay them.
            let cork = self.cork();
            self.handle(batch);
            drop(cork);
            self.expire();
            if self.shutdown == Some(ShutdownMode::Abort) {
                self.abort_all();
            }
            if self.shutdown.is_some() && self.sched.is_empty() {
                // Only once nothing arrived since the last take: a request accepted before the
                // shutdown must still get its terminal event.
                if self.shared.inbox.close_if_empty() {
                    self.publish();
                    return;
                }
                continue;
            }
            self.cache.poll();
            self.finish_loads();
            let cork = self.cork();
            self.admit();
            drop(cork);
            self.stalled = false;
            if self.sched.running.iter().any(|r| r.reserved()) {
                self.make_room_for_decode();
                self.stalled = !self.step();
            } else if let Some(r) = self.sched.running.iter().find(|r| r.req.is_loading()) {
                // Only load-backs in flight: wait for one instead of spinning (the next
                // `finish_loads` completes it).
                self.cache.wait_load(&r.req, Duration::from_millis(2));
            }
            self.publish();
        }
    }

    /// A PD engine's [`crate::pd::link::Cork`] on the frames this thread queues.
    fn cork(&self) -> Option<crate::pd::link::Cork> {
        self.pd.is_some().then(crate::pd::link::Cork::hold)
    }

    /// Takes everything queued; blocks (until the next deadline, or until events are polled)
    /// only when there is nothing to compute.
    fn receive(&mut self) -> Batch {
        let s = &self.sched;
        // PD requests waiting for their room (Transferring, Receiving) compute nothing: the
        // engine thread sleeps until a notice, a submit or a deadline.
        let computing = s
            .running
            .iter()
            .any(|r| r.reserved() || r.phase() == super::phase::Phase::LoadingBack);
        let idle = self.stalled || (!computing && (s.waiting.is_empty() || s.blocked));
        if idle {
            // Between bursts the prefill's kept working memory would otherwise stay resident.
            self.exec.release_idle_memory();
        }
        let wait = (idle && self.shutdown.is_none()).then(|| {
            s.next_deadline().map_or(Duration::from_millis(200), |d| {
                d.saturating_duration_since(Instant::now())
            })
        });
        self.shared.inbox.take(wait)
    }

    fn handle(&mut self, batch: Batch) {
        for p in batch.submits {
            let p = Box::new(p);
            // An imported request's tokens and sampler are known; only its KV comes from the
            // export instead of a recompute.
            let w = match &p.import {
                Some(x) => {
                    let sampler =
                        Sampler::new(p.spec.sampling.clone(), x.state.rng.unwrap_or_default());
                    let progress = Progress::new(sampler, x.tokens.clone(), x.generated);
                    Waiting::imported(p, Box::new(progress))
                }
                None => Waiting::new(p),
            };
            self.sched.waiting.push(w);
        }
        for id in batch.aborts {
            self.abort(id);
        }
        if let Some(mode) = batch.shutdown {
            // An abort shutdown overrides an earlier drain, never the reverse.
            if self.shutdown != Some(ShutdownMode::Abort) {
                self.shutdown = Some(mode);
            }
        }
        for c in batch.controls {
            self.control(c);
        }
        // Whatever these emit (landed rooms' first tokens, and their ends when that was their
        // only token) wakes a waiting poller once.
        let shared = self.shared.clone();
        let _held = shared.sink.hold();
        for n in batch.pd {
            self.on_notice(n);
        }
    }

    /// One forward step over every runnable request; false when there was nothing to run.
    /// Requests whose events wait unpolled while the event queue is full sit this one out.
    fn step(&mut self) -> bool {
        let paused = self.shared.sink.paused();
        let Some(plan) = self.sched.plan_step(&self.cache, &paused) else {
            return false;
        };
        let outcome = self.exec.run(
            &plan,
            &mut self.sched.running,
            &mut self.cache,
            &self.shared,
        );
        self.end_after_step(&plan, outcome);
        true
    }
}

impl<B: Backend> Drop for Worker<B> {
    /// The node's readers may write into the pools (a decode receives states straight into
    /// its destinations): they stop before the pools go.
    fn drop(&mut self) {
        if let Some(node) = &self.pd {
            node.shutdown();
        }
    }
}
