//! The engine thread: owns the model's KV state, admits waiting requests, builds each step
//! (decode tokens first, then prefill chunks up to the token budget, cut at snapshot points),
//! samples, emits events and keeps the prefix cache.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::event::{Event, EventCallback, EventKind, EventSink, FinishReason};
use super::request::RequestSpec;
use super::sampling::Sampler;
use crate::backend::cpu::CpuBackend;
use crate::error::{ErrorKind, Result};
use crate::kv::cache::Tier;
use crate::kv::{PrefixCache, Request};
use crate::model::{Chunk, Logits, Model};
use serde_json::Value;

/// How a shutdown ends the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Every accepted request runs to its end.
    Drain,
    /// Every accepted request ends now with FINISHED/ABORTED.
    Abort,
}

/// What callers send the engine thread.
pub enum Command {
    Submit(Box<Pending>),
    Abort(u64),
    Shutdown(ShutdownMode),
    SetCallback(Option<Arc<dyn EventCallback>>, Sender<()>),
    Score(Vec<u32>, Sender<Result<Vec<f32>>>),
    /// Drop every unlocked cached prefix of a tier; reports the device units still in use.
    FlushCache(Tier, Sender<PoolUsage>),
    /// The cache's per-pool, per-tier usage and counters.
    CacheStats(Sender<Value>),
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
    pub admission: Mutex<Admission>,
    /// Accepted requests without a terminal event yet.
    pub live: Mutex<HashSet<u64>>,
    pub accepting: AtomicBool,
    pub next_id: AtomicU64,
    /// Set when the engine thread has ended.
    pub stopped: Mutex<bool>,
    pub stopped_cv: Condvar,
}

impl Shared {
    pub fn new() -> Self {
        Self {
            sink: EventSink::default(),
            admission: Mutex::new(Admission::default()),
            live: Mutex::new(HashSet::new()),
            accepting: AtomicBool::new(true),
            next_id: AtomicU64::new(1),
            stopped: Mutex::new(false),
            stopped_cv: Condvar::new(),
        }
    }

    pub fn admission(&self) -> std::sync::MutexGuard<'_, Admission> {
        self.admission.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn live(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Waiting {
    pending: Box<Pending>,
}

struct Running {
    id: u64,
    spec: RequestSpec,
    submitted: Instant,
    queue_us: u64,
    first_token: Option<Instant>,
    req: Request,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    generated: usize,
    max_gen: usize,
    sampler: Sampler,
    /// Pages for the whole request are reserved (after any load-back has landed).
    reserved: bool,
}

/// Scheduling limits from the params.
pub struct Limits {
    pub max_running: usize,
    pub chunk_tokens: usize,
    pub batch_tokens: usize,
    pub queue_timeout: Option<Duration>,
}

pub struct Worker {
    model: Arc<Model<CpuBackend>>,
    cache: PrefixCache<CpuBackend>,
    shared: Arc<Shared>,
    commands: Receiver<Command>,
    limits: Limits,
    eos: Vec<u32>,
    rng: fastrand::Rng,
    waiting: Vec<Waiting>,
    running: Vec<Running>,
    shutdown: Option<ShutdownMode>,
    /// Admission failed for lack of pages; retried when something ends.
    blocked: bool,
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

impl Worker {
    pub fn new(
        model: Arc<Model<CpuBackend>>,
        cache: PrefixCache<CpuBackend>,
        shared: Arc<Shared>,
        commands: Receiver<Command>,
        limits: Limits,
    ) -> Self {
        let eos = model.config.eos_token_ids.clone();
        Self {
            model,
            cache,
            shared,
            commands,
            limits,
            eos,
            rng: fastrand::Rng::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            shutdown: None,
            blocked: false,
        }
    }

    /// Runs until shutdown has ended every request. A panic ends every live request with an
    /// INTERNAL error instead of leaving them without a terminal event.
    pub fn run(mut self) {
        let shared = Arc::clone(&self.shared);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.main_loop()));
        if outcome.is_err() {
            log::error!("the engine thread panicked; ending every request with DSV4_ERR_INTERNAL");
            shared.accepting.store(false, Ordering::SeqCst);
            let ids: Vec<u64> = shared.live().drain().collect();
            for id in ids {
                shared.sink.emit(Event {
                    request_id: id,
                    user_tag: 0,
                    kind: EventKind::Error,
                    token: -1,
                    logprob: 0.0,
                    finish_reason: FinishReason::None,
                    error: Some(ErrorKind::Internal),
                    prompt_tokens: 0,
                    cached_tokens_device: 0,
                    cached_tokens_host: 0,
                    generated_tokens: 0,
                    queue_us: 0,
                    ttft_us: 0,
                    elapsed_us: 0,
                });
            }
        }
        *shared.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        shared.stopped_cv.notify_all();
        shared.sink.wake();
    }

    fn main_loop(&mut self) {
        loop {
            self.receive();
            self.expire();
            if self.shutdown == Some(ShutdownMode::Abort) {
                self.abort_all();
            }
            if self.shutdown.is_some() && self.waiting.is_empty() && self.running.is_empty() {
                return;
            }
            self.cache.poll();
            self.finish_loads();
            self.admit();
            if self.running.iter().any(|r| r.reserved) {
                self.step();
            } else if let Some(r) = self.running.iter_mut().find(|r| r.req.is_loading()) {
                // Only load-backs in flight: wait for one instead of spinning.
                self.cache
                    .complete_load(&mut r.req, Duration::from_millis(2));
            }
        }
    }

    /// Requests whose load-back has landed get their pages and become runnable; one that
    /// cannot get its pages now goes back to the waiting queue (its prefix is on the device
    /// now, so it will hit there).
    fn finish_loads(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if r.reserved || !self.cache.complete_load(&mut r.req, Duration::ZERO) {
                i += 1;
                continue;
            }
            let tokens = r.spec.prompt.len() + r.max_gen - 1;
            match self.cache.reserve(&mut r.req, tokens) {
                Ok(()) => {
                    r.reserved = true;
                    self.shared.admission().queued_tokens -= r.req.reused_tokens() as u64;
                    i += 1;
                }
                Err(e) => {
                    log::debug!(
                        "request {}: no pages after its load-back ({e}); requeued",
                        r.id
                    );
                    let r = self.running.swap_remove(i);
                    self.cache.abort(r.req);
                    self.shared.admission().queued_requests += 1;
                    self.waiting.push(Waiting {
                        pending: Box::new(Pending {
                            id: r.id,
                            spec: r.spec,
                            submitted: r.submitted,
                            max_gen: r.max_gen,
                        }),
                    });
                    self.blocked = !self.running.is_empty();
                }
            }
        }
    }

    /// Takes every queued command; blocks (until the next deadline) only when idle.
    fn receive(&mut self) {
        let idle = self.running.is_empty() && (self.waiting.is_empty() || self.blocked);
        if idle && self.shutdown.is_none() {
            let wait = self
                .next_deadline()
                .map_or(Duration::from_millis(200), |d| {
                    d.saturating_duration_since(Instant::now())
                });
            match self.commands.recv_timeout(wait) {
                Ok(c) => self.handle(c),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    self.shutdown.get_or_insert(ShutdownMode::Abort);
                }
            }
        }
        while let Ok(c) = self.commands.try_recv() {
            self.handle(c);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| next = Some(next.map_or(t, |n| n.min(t)));
        for w in &self.waiting {
            let p = &w.pending;
            if let Some(q) = self.limits.queue_timeout {
                consider(p.submitted + q);
            }
            if p.spec.deadline_ms > 0 {
                consider(p.submitted + Duration::from_millis(p.spec.deadline_ms.into()));
            }
        }
        next
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Submit(p) => {
                self.waiting.push(Waiting { pending: p });
            }
            Command::Abort(id) => self.abort(id),
            Command::Shutdown(mode) => {
                // An abort shutdown overrides an earlier drain, never the reverse.
                if self.shutdown != Some(ShutdownMode::Abort) {
                    self.shutdown = Some(mode);
                }
            }
            Command::SetCallback(cb, done) => {
                for e in self.shared.sink.set_callback(cb) {
                    self.shared.sink.emit(e);
                }
                let _ = done.send(());
            }
            Command::Score(tokens, reply) => {
                let _ = reply.send(self.score(&tokens));
            }
            Command::CacheStats(reply) => {
                self.cache.poll();
                let _ = reply.send(self.cache.stats_json());
            }
            Command::FlushCache(tier, reply) => {
                self.cache.flush(tier);
                let pools = self.cache.pools();
                let _ = reply.send(PoolUsage {
                    pages: pools.page_allocator().used_count(),
                    slots: pools.slot_allocator().used_count(),
                    snapshots: pools.snapshot_allocator().used_count(),
                });
            }
        }
    }

    fn score(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let pools = self.cache.pools_mut();
        let mut seq = pools.open()?;
        let mut result = pools.reserve(&mut seq, tokens.len());
        if result.is_err() {
            // Cached prefixes give way to an explicit scoring call.
            self.cache
                .evict(self.cache.pools().pages_for(tokens.len()), 0);
            result = self.cache.pools_mut().reserve(&mut seq, tokens.len());
        }
        let pools = self.cache.pools_mut();
        let out = result.and_then(|()| {
            self.model.forward(
                pools,
                &mut [Chunk {
                    tokens,
                    seq: &mut seq,
                    logits: Logits::All,
                }],
            )
        });
        self.cache.pools_mut().close(seq);
        Ok(out?.remove(0))
    }

    // --- ending requests ---------------------------------------------------------------------

    fn terminal(
        &self,
        r: TerminalInfo,
        kind: EventKind,
        reason: FinishReason,
        error: Option<ErrorKind>,
    ) {
        // Off the live set first: once the host sees the terminal event, abort says NOT_FOUND.
        self.shared.live().remove(&r.id);
        let now = Instant::now();
        self.shared.sink.emit(Event {
            request_id: r.id,
            user_tag: r.user_tag,
            kind,
            token: -1,
            logprob: 0.0,
            finish_reason: reason,
            error,
            prompt_tokens: r.prompt_tokens,
            cached_tokens_device: (r.cached - r.cached_host) as u32,
            cached_tokens_host: r.cached_host as u32,
            generated_tokens: r.generated as u32,
            queue_us: r.queue_us,
            ttft_us: r.first_token.map_or(0, |t| micros(t - r.submitted)),
            elapsed_us: micros(now - r.submitted),
        });
    }

    /// Ends waiting request `i` (it never ran).
    fn end_waiting(
        &mut self,
        i: usize,
        kind: EventKind,
        reason: FinishReason,
        error: Option<ErrorKind>,
    ) {
        let w = self.waiting.remove(i);
        let p = &w.pending;
        {
            let mut a = self.shared.admission();
            a.queued_requests -= 1;
            a.queued_tokens -= p.spec.prompt.len() as u64;
        }
        let info = TerminalInfo {
            id: p.id,
            user_tag: p.spec.user_tag,
            prompt_tokens: p.spec.prompt.len() as u32,
            cached: 0,
            cached_host: 0,
            generated: 0,
            submitted: p.submitted,
            queue_us: micros(p.submitted.elapsed()),
            first_token: None,
        };
        self.terminal(info, kind, reason, error);
    }

    /// Ends running request `i`; `cache` inserts its sequence into the prefix cache.
    fn end_running(
        &mut self,
        i: usize,
        reason: FinishReason,
        error: Option<ErrorKind>,
        cache: bool,
    ) {
        let r = self.running.swap_remove(i);
        let unprefilled = r.spec.prompt.len().saturating_sub(r.req.position());
        if unprefilled > 0 {
            self.shared.admission().queued_tokens -= unprefilled as u64;
        }
        let info = TerminalInfo {
            id: r.id,
            user_tag: r.spec.user_tag,
            prompt_tokens: r.spec.prompt.len() as u32,
            cached: r.req.reused_tokens(),
            cached_host: r.req.reused_host_tokens(),
            generated: r.generated,
            submitted: r.submitted,
            queue_us: r.queue_us,
            first_token: r.first_token,
        };
        let position = r.req.position();
        if cache {
            self.cache.finish(r.req, &r.tokens[..position]);
        } else {
            self.cache.abort(r.req);
        }
        self.blocked = false;
        let kind = if error.is_some() {
            EventKind::Error
        } else {
            EventKind::Finished
        };
        self.terminal(info, kind, reason, error);
    }

    fn abort(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|w| w.pending.id == id) {
            self.end_waiting(i, EventKind::Finished, FinishReason::Aborted, None);
        } else if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.end_running(i, FinishReason::Aborted, None, false);
        }
    }

    fn abort_all(&mut self) {
        while !self.waiting.is_empty() {
            self.end_waiting(0, EventKind::Finished, FinishReason::Aborted, None);
        }
        while !self.running.is_empty() {
            self.end_running(0, FinishReason::Aborted, None, false);
        }
    }

    /// Queue timeouts and deadlines.
    fn expire(&mut self) {
        let now = Instant::now();
        let past = |submitted: Instant, ms: u32| {
            ms > 0 && now >= submitted + Duration::from_millis(ms.into())
        };
        let mut i = 0;
        while i < self.waiting.len() {
            let p = &self.waiting[i].pending;
            let queued_too_long = self
                .limits
                .queue_timeout
                .is_some_and(|q| now >= p.submitted + q);
            if queued_too_long || past(p.submitted, p.spec.deadline_ms) {
                self.end_waiting(i, EventKind::Finished, FinishReason::Timeout, None);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if past(r.submitted, r.spec.deadline_ms) {
                self.end_running(i, FinishReason::Timeout, None, true);
            } else {
                i += 1;
            }
        }
    }

    // --- admission to the running set ---------------------------------------------------------

    /// The next waiting request: highest priority, then first submitted.
    fn next_waiting(&self) -> Option<usize> {
        (0..self.waiting.len()).min_by_key(|&i| {
            let p = &self.waiting[i].pending;
            (std::cmp::Reverse(p.spec.priority), p.id)
        })
    }

    fn admit(&mut self) {
        if self.blocked {
            return;
        }
        while self.running.len() < self.limits.max_running {
            let Some(i) = self.next_waiting() else { return };
            let p = &self.waiting[i].pending;
            let mut req = match self
                .cache
                .start(p.spec.cache_salt.as_deref(), &p.spec.prompt)
            {
                Ok(r) => r,
                Err(e) => {
                    log::warn!("request {}: cannot start: {e}", p.id);
                    self.blocked = true;
                    return;
                }
            };
            // Pages for the whole request now, so it never stalls or fails mid-generation
            // (after its load-back, for a host hit: see `finish_loads`).
            let tokens = p.spec.prompt.len() + p.max_gen - 1;
            let loading = req.is_loading();
            if loading {
                // Reserved once the load lands.
            } else if let Err(e) = self.cache.reserve(&mut req, tokens) {
                self.cache.abort(req);
                if self.running.is_empty() {
                    // Nothing will free pages: it can never run.
                    log::warn!("request {}: {e}", p.id);
                    self.end_waiting(
                        i,
                        EventKind::Error,
                        FinishReason::None,
                        Some(ErrorKind::Capacity),
                    );
                    continue;
                }
                self.blocked = true;
                return;
            }
            let w = self.waiting.remove(i);
            let p = *w.pending;
            {
                let mut a = self.shared.admission();
                a.queued_requests -= 1;
                a.queued_tokens -= req.reused_tokens() as u64;
            }
            let seed = if p.spec.seed != 0 {
                p.spec.seed
            } else {
                self.rng.u64(..)
            };
            let reserved = !loading;
            self.running.push(Running {
                id: p.id,
                sampler: Sampler::new(p.spec.sampling.clone(), seed),
                tokens: p.spec.prompt.clone(),
                queue_us: micros(p.submitted.elapsed()),
                submitted: p.submitted,
                first_token: None,
                generated: 0,
                max_gen: p.max_gen,
                spec: p.spec,
                req,
                reserved,
            });
        }
    }

    // --- one forward step -----------------------------------------------------------------

    fn step(&mut self) {
        // (running index, token range, wants logits)
        let mut plan: Vec<(usize, std::ops::Range<usize>, bool)> = Vec::new();
        let mut budget = self.limits.batch_tokens;
        for (i, r) in self.running.iter().enumerate() {
            let pos = r.req.position();
            if r.reserved && pos >= r.spec.prompt.len() && pos + 1 == r.tokens.len() {
                plan.push((i, pos..pos + 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            let (pos, prompt) = (r.req.position(), r.spec.prompt.len());
            if !r.reserved || pos >= prompt || budget == 0 {
                continue;
            }
            let end = self
                .cache
                .chunk_limit(&r.req)
                .min(pos + self.limits.chunk_tokens)
                .min(pos + budget);
            budget -= end - pos;
            plan.push((i, pos..end, end == prompt));
        }
        if plan.is_empty() {
            return;
        }
        let (running, cache) = (&mut self.running, &mut self.cache);
        let mut seqs: Vec<(usize, &mut Running)> = running.iter_mut().enumerate().collect();
        let mut chunks = Vec::with_capacity(plan.len());
        let mut order = Vec::with_capacity(plan.len());
        for (i, range, want) in &plan {
            let slot = seqs.iter().position(|(j, _)| j == i).expect("planned once");
            let (_, r) = seqs.swap_remove(slot);
            order.push(*i);
            let Running { req, tokens, .. } = r;
            chunks.push(Chunk {
                tokens: &tokens[range.clone()],
                seq: req.kv_mut(),
                logits: if *want { Logits::Last } else { Logits::None },
            });
        }
        let result = self.model.forward(cache.pools_mut(), &mut chunks);
        drop(chunks);
        let outputs = match result {
            Ok(o) => o,
            Err(e) => {
                log::error!("forward step failed: {e}");
                let mut idx: Vec<usize> = order.clone();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    self.end_running(i, FinishReason::None, Some(e.kind()), false);
                }
                return;
            }
        };
        let mut prefilled = 0u64;
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        for ((i, range, _), logits) in plan.iter().zip(outputs) {
            let r = &mut self.running[*i];
            if range.start < r.spec.prompt.len() {
                prefilled += range.len() as u64;
            }
            let pos = r.req.position();
            if let Err(e) = self.cache.after_step(&mut r.req, &r.tokens[..pos]) {
                log::error!("request {}: prefix cache: {e}", r.id);
            }
            if logits.is_empty() {
                continue;
            }
            let (token, logprob) = r.sampler.sample(&logits);
            r.tokens.push(token);
            r.generated += 1;
            let now = Instant::now();
            let first = *r.first_token.get_or_insert(now);
            self.shared.sink.emit(Event {
                request_id: r.id,
                user_tag: r.spec.user_tag,
                kind: EventKind::Token,
                token: token as i32,
                logprob: if r.spec.logprobs { logprob } else { 0.0 },
                finish_reason: FinishReason::None,
                error: None,
                prompt_tokens: r.spec.prompt.len() as u32,
                cached_tokens_device: (r.req.reused_tokens() - r.req.reused_host_tokens()) as u32,
                cached_tokens_host: r.req.reused_host_tokens() as u32,
                generated_tokens: r.generated as u32,
                queue_us: r.queue_us,
                ttft_us: micros(first - r.submitted),
                elapsed_us: micros(now - r.submitted),
            });
            if self.eos.contains(&token) || r.spec.stop_tokens.contains(&token) {
                finished.push((*i, FinishReason::Stop));
            } else if r.generated >= r.max_gen {
                finished.push((*i, FinishReason::Length));
            }
        }
        if prefilled > 0 {
            self.shared.admission().queued_tokens -= prefilled;
        }
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            self.end_running(i, reason, None, true);
        }
    }
}

struct TerminalInfo {
    id: u64,
    user_tag: u64,
    prompt_tokens: u32,
    cached: usize,
    cached_host: usize,
    generated: usize,
    submitted: Instant,
    queue_us: u64,
    first_token: Option<Instant>,
}
