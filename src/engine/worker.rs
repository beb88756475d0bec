//! The engine thread: owns the model's KV state, admits waiting requests, builds each step
//! (decode tokens first, then prefill chunks up to the token budget, cut at snapshot points),
//! samples, emits events and keeps the prefix cache.
//!
//! Pages are reserved for a request's prompt when it starts and one page at a time as it
//! decodes. Admission estimates what the running requests will still need (a share of their
//! remaining `max_new_tokens`, `new_token_ratio`, which decays while things go well and jumps
//! after a retraction); when the estimate was wrong and a decoding request finds no page, the
//! newest running request is retracted: its sequence goes into the prefix cache, its pages
//! and slot are freed, and it waits at the front of the queue to be recomputed, its sampler
//! and emitted tokens kept, so its output is what it would have been.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::event::{Event, EventSink, EventStats, FinishReason, Origin};
use super::inbox::{Batch, Control, Inbox};
use super::metrics::{Metrics, Outcome, PoolGauges, Units};
use super::request::RequestSpec;
use super::sampling::Sampler;
use crate::backend::cpu::CpuBackend;
use crate::config::params::SchedulerPolicy;
use crate::error::{Error, ErrorKind, Result};
use crate::kv::layout::PoolId;
use crate::kv::{PrefixCache, Request, SequenceState};
use crate::model::{Chunk, Logits, Model};

/// How a shutdown ends the requests in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Every accepted request runs to its end.
    Drain,
    /// Every accepted request ends now with FINISHED/ABORTED.
    Abort,
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

/// What a request has done so far; kept across a retraction.
struct Progress {
    sampler: Sampler,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    generated: usize,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    queue_us: u64,
    /// Prompt tokens reused from the cache when it first ran (reported in events).
    cached: usize,
    cached_host: usize,
    /// Counted in the metrics as started (prompt, cached and queue time) once.
    counted: bool,
}

impl Progress {
    /// A request about to run for the first time here: `tokens` (its prompt, or everything an
    /// imported sequence holds) of which `generated` were sampled.
    fn new(sampler: Sampler, tokens: Vec<u32>, generated: usize) -> Self {
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

struct Waiting {
    pending: Box<Pending>,
    /// Set for a retracted request: recompute its tokens, then continue.
    progress: Option<Box<Progress>>,
}

impl Waiting {
    fn tokens(&self) -> &[u32] {
        self.progress
            .as_ref()
            .map_or(&self.pending.spec.prompt, |p| &p.tokens)
    }

    fn generated(&self) -> usize {
        self.progress.as_ref().map_or(0, |p| p.generated)
    }
}

struct Running {
    id: u64,
    spec: RequestSpec,
    submitted: Instant,
    req: Request,
    /// Tokens to compute before the next sample: the prompt, or every token of a resumed
    /// request.
    prefill_len: usize,
    max_gen: usize,
    p: Progress,
    /// Pages for the prefill are reserved (after any load-back has landed).
    reserved: bool,
    /// What this request adds to the admission's `queued_tokens`: its whole prefill until it
    /// is reserved, then what is left of it. Every change goes through `recount`, and ending
    /// or requeueing takes exactly this back, so the books balance on every path.
    queued_tokens: usize,
}

impl Running {
    /// What `queued_tokens` should be now.
    fn unprefilled(&self) -> usize {
        if self.reserved {
            self.prefill_len.saturating_sub(self.req.position())
        } else {
            self.prefill_len
        }
    }

    fn decoding(&self) -> bool {
        let pos = self.req.position();
        self.reserved && pos >= self.prefill_len && pos + 1 == self.p.tokens.len()
    }
}

/// Scheduling limits from the params.
pub struct Limits {
    pub max_running: usize,
    pub chunk_tokens: usize,
    pub batch_tokens: usize,
    pub queue_timeout: Option<Duration>,
    pub policy: SchedulerPolicy,
    pub lpm_max_waiting: usize,
}

/// The admission estimate's share of remaining `max_new_tokens` (SGLang's conservative
/// defaults): it starts at INIT, decays by DECAY per decode step to MIN, and rises by BUMP
/// (at least back to INIT) after each retraction.
const RATIO_INIT: f64 = 0.7;
const RATIO_MIN: f64 = 0.1;
const RATIO_DECAY: f64 = 0.001;
const RATIO_BUMP: f64 = 0.2;

pub struct Worker {
    model: Arc<Model<CpuBackend>>,
    cache: PrefixCache<CpuBackend>,
    shared: Arc<Shared>,
    limits: Limits,
    eos: Vec<u32>,
    rng: fastrand::Rng,
    waiting: Vec<Waiting>,
    running: Vec<Running>,
    shutdown: Option<ShutdownMode>,
    /// Admission failed for lack of pages; retried when something ends.
    blocked: bool,
    /// The last step had nothing to compute (e.g. every request paused for unpolled events).
    stalled: bool,
    new_token_ratio: f64,
}

fn micros(d: Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

impl Worker {
    pub fn new(
        model: Arc<Model<CpuBackend>>,
        cache: PrefixCache<CpuBackend>,
        shared: Arc<Shared>,
        limits: Limits,
    ) -> Self {
        let eos = model.config.eos_token_ids.clone();
        let worker = Self {
            model,
            cache,
            shared,
            limits,
            eos,
            rng: fastrand::Rng::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            shutdown: None,
            blocked: false,
            stalled: false,
            new_token_ratio: RATIO_INIT,
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
            for (id, user_tag) in live {
                shared.metrics.finish(Outcome::Error, Duration::ZERO);
                let origin = Origin {
                    request_id: id,
                    user_tag,
                };
                let e = Error::internal(message.clone());
                shared
                    .sink
                    .emit(Event::error(origin, &e, EventStats::default()));
            }
            let mut a = shared.admission();
            *a = Admission::default();
        }
        *shared.stopped.lock().unwrap_or_else(|e| e.into_inner()) = true;
        shared.stopped_cv.notify_all();
        shared.sink.close();
    }

    fn main_loop(&mut self) {
        loop {
            self.receive();
            self.expire();
            if self.shutdown == Some(ShutdownMode::Abort) {
                self.abort_all();
            }
            if self.shutdown.is_some() && self.waiting.is_empty() && self.running.is_empty() {
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
            self.admit();
            self.stalled = false;
            if self.running.iter().any(|r| r.reserved) {
                self.make_room_for_decode();
                self.stalled = !self.step();
            } else if let Some(r) = self.running.iter_mut().find(|r| r.req.is_loading()) {
                // Only load-backs in flight: wait for one instead of spinning.
                self.cache
                    .complete_load(&mut r.req, Duration::from_millis(2));
            }
            self.publish();
        }
    }

    /// Gauges and cache counters for `Engine::metrics`, refreshed between steps.
    fn publish(&self) {
        let pools = self.cache.pools();
        let layout = pools.layout();
        let bytes = |ids: &[PoolId]| ids.iter().map(|&id| layout.unit_bytes(id) as u64).sum();
        let page_bytes: u64 = bytes(&[PoolId::C4Kv, PoolId::C4Indexer, PoolId::C128Kv]);
        let slot_bytes: u64 = bytes(&[
            PoolId::Swa,
            PoolId::C4State,
            PoolId::C4IndexerState,
            PoolId::C128State,
        ]);
        let snap_bytes: u64 = bytes(&[PoolId::Snapshots]);
        let units = |a: &crate::kv::units::UnitAllocator, unit: u64| Units {
            used: a.used_count() as u64,
            total: a.capacity() as u64,
            used_bytes: a.used_count() as u64 * unit,
            total_bytes: a.capacity() as u64 * unit,
        };
        let mut gauges = PoolGauges {
            device_pages: units(pools.page_allocator(), page_bytes),
            device_slots: units(pools.slot_allocator(), slot_bytes),
            device_snapshots: units(pools.snapshot_allocator(), snap_bytes),
            ..PoolGauges::default()
        };
        if let Some(h) = self.cache.host_pools() {
            gauges.host_pages = units(h.page_allocator(), page_bytes);
            gauges.host_snapshots = units(h.snapshot_allocator(), snap_bytes);
        }
        let running = self.running.iter().filter(|r| r.reserved).count() as u64;
        let loading = self.running.len() as u64 - running;
        let cache = self.cache.stats();
        self.shared.metrics.update(|m| {
            m.running = running;
            m.loading = loading;
            m.pools = gauges;
            m.cache = cache;
        });
    }

    /// Requests whose load-back has landed get their prefill pages and become runnable; one
    /// that cannot get them now goes back to the waiting queue (its prefix is on the device
    /// now, so it will hit there).
    fn finish_loads(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            let r = &mut self.running[i];
            if r.reserved || !self.cache.complete_load(&mut r.req, Duration::ZERO) {
                i += 1;
                continue;
            }
            match self.cache.reserve(&mut r.req, r.prefill_len) {
                Ok(()) => {
                    r.reserved = true;
                    self.recount(i);
                    self.on_ready(i);
                    i += 1;
                }
                Err(e) => {
                    log::debug!(
                        "request {}: no pages after its load-back ({e}); requeued",
                        r.id
                    );
                    self.requeue(i, false);
                    self.blocked = !self.running.is_empty();
                }
            }
        }
    }

    /// First time a request is ready to compute: queue time, prompt and cached tokens.
    fn on_ready(&mut self, i: usize) {
        let r = &mut self.running[i];
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

    /// Brings running request `i`'s share of `queued_tokens` up to date.
    fn recount(&mut self, i: usize) {
        let r = &mut self.running[i];
        let now = r.unprefilled();
        if now != r.queued_tokens {
            let mut a = self.shared.admission();
            a.queued_tokens = a.queued_tokens + now as u64 - r.queued_tokens as u64;
            r.queued_tokens = now;
        }
    }

    /// Takes everything queued; blocks (until the next deadline, or until events are polled)
    /// only when there is nothing to compute.
    fn receive(&mut self) {
        let idle =
            self.stalled || (self.running.is_empty() && (self.waiting.is_empty() || self.blocked));
        let wait = (idle && self.shutdown.is_none()).then(|| {
            self.next_deadline()
                .map_or(Duration::from_millis(200), |d| {
                    d.saturating_duration_since(Instant::now())
                })
        });
        let batch = self.shared.inbox.take(wait);
        self.handle(batch);
    }

    /// The queue timeout of a waiting request (retracted ones already ran: only their
    /// deadline applies).
    fn queue_deadline(&self, w: &Waiting) -> Option<Instant> {
        match (w.progress.is_none(), self.limits.queue_timeout) {
            (true, Some(q)) => Some(w.pending.submitted + q),
            _ => None,
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
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

    fn handle(&mut self, batch: Batch) {
        for p in batch.submits {
            // An imported request waits like a retracted one: its tokens and sampler are
            // known; only its KV comes from the export instead of a recompute.
            let progress = p.import.as_ref().map(|x| {
                Box::new(Progress::new(
                    Sampler::new(p.spec.sampling.clone(), x.state.rng.unwrap_or_default()),
                    x.tokens.clone(),
                    x.generated,
                ))
            });
            self.waiting.push(Waiting {
                pending: Box::new(p),
                progress,
            });
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
            match c {
                Control::SetCallback(cb, done) => {
                    for e in self.shared.sink.set_callback(cb) {
                        self.shared.sink.emit(e);
                    }
                    let _ = done.send(());
                }
                Control::Score(tokens, reply) => {
                    let _ = reply.send(self.score(&tokens));
                }
                Control::Export(id, reply) => {
                    let _ = reply.send(self.export(id));
                }
                Control::CacheStats(reply) => {
                    self.cache.poll();
                    let _ = reply.send(self.cache.stats_json());
                }
                Control::FlushCache(tier, reply) => {
                    self.cache.flush(tier);
                    let pools = self.cache.pools();
                    let _ = reply.send(PoolUsage {
                        pages: pools.page_allocator().used_count(),
                        slots: pools.slot_allocator().used_count(),
                        snapshots: pools.snapshot_allocator().used_count(),
                    });
                    self.publish();
                }
            }
        }
    }

    /// The state of decoding request `id` as it stands between steps (it keeps running).
    fn export(&self, id: u64) -> Result<ExportedSequence> {
        let r = self
            .running
            .iter()
            .find(|r| r.id == id)
            .filter(|r| r.decoding())
            .ok_or_else(|| {
                Error::invalid_argument(format!(
                    "request {id} is not decoding (unknown, ended, waiting, or still in its \
                     prefill): export a request after its first TOKEN event"
                ))
            })?;
        let mut state = self.cache.export(&r.req)?;
        state.last_token = r.p.tokens.last().copied();
        state.rng = Some(r.p.sampler.rng_state());
        let bytes = crate::kv::state::read(self.cache.pools(), &state)?;
        Ok(ExportedSequence {
            state,
            bytes,
            tokens: r.p.tokens.clone(),
            generated: r.p.generated,
        })
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

    fn terminal(&self, r: TerminalInfo, end: End) {
        // Off the live set first: once the host sees the terminal event, abort says NOT_FOUND.
        self.shared.live().remove(&r.id);
        let now = Instant::now();
        let outcome = match &end {
            End::Finished(reason) => Outcome::of(*reason),
            End::Failed(_) => Outcome::Error,
        };
        self.shared.metrics.finish(outcome, now - r.submitted);
        let origin = Origin {
            request_id: r.id,
            user_tag: r.user_tag,
        };
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
            End::Finished(reason) => Event::finished(origin, reason, stats),
            End::Failed(e) => Event::error(origin, &e, stats),
        });
    }

    /// Ends waiting request `i` (it never ran, or was retracted).
    fn end_waiting(&mut self, i: usize, end: End) {
        let w = self.waiting.remove(i);
        {
            let mut a = self.shared.admission();
            a.queued_requests -= 1;
            a.queued_tokens -= w.tokens().len() as u64;
        }
        let p = &w.pending;
        let info = match &w.progress {
            Some(g) => TerminalInfo {
                id: p.id,
                user_tag: p.spec.user_tag,
                prompt_tokens: p.spec.prompt.len() as u32,
                cached: g.cached,
                cached_host: g.cached_host,
                generated: g.generated,
                submitted: p.submitted,
                queue_us: g.queue_us,
                first_token: g.first_token,
            },
            None => TerminalInfo {
                id: p.id,
                user_tag: p.spec.user_tag,
                prompt_tokens: p.spec.prompt.len() as u32,
                cached: 0,
                cached_host: 0,
                generated: 0,
                submitted: p.submitted,
                queue_us: micros(p.submitted.elapsed()),
                first_token: None,
            },
        };
        self.terminal(info, end);
    }

    /// Ends running request `i`; `cache` inserts its sequence into the prefix cache.
    fn end_running(&mut self, i: usize, end: End, cache: bool) {
        let info = self.release_running(i, cache);
        self.terminal(info, end);
    }

    /// Takes running request `i` out: its sequence goes into the prefix cache (`cache`) or
    /// back to the pools, the gauges are published; returns what its terminal event needs.
    fn release_running(&mut self, i: usize, cache: bool) -> TerminalInfo {
        let r = self.running.swap_remove(i);
        self.shared.admission().queued_tokens -= r.queued_tokens as u64;
        let info = TerminalInfo {
            id: r.id,
            user_tag: r.spec.user_tag,
            prompt_tokens: r.spec.prompt.len() as u32,
            cached: r.p.cached,
            cached_host: r.p.cached_host,
            generated: r.p.generated,
            submitted: r.submitted,
            queue_us: r.p.queue_us,
            first_token: r.p.first_token,
        };
        let position = r.req.position();
        if cache {
            self.cache.finish(r.req, &r.p.tokens[..position]);
        } else {
            self.cache.abort(r.req);
        }
        self.blocked = false;
        // Gauges first: a host that reads metrics on the terminal event sees it gone.
        self.publish();
        info
    }

    /// Ends running request `i`, whose sampled logits were not finite, with MODEL_FORMAT and a
    /// message naming the first layer and weights that produced a non-finite value: its
    /// sequence is freed, then re-run once with a finite check after every layer sub-step.
    fn end_nonfinite(&mut self, i: usize, found: Error) {
        let r = &self.running[i];
        let tokens = r.p.tokens[..r.req.position()].to_vec();
        let info = self.release_running(i, false);
        let chunk = self.limits.chunk_tokens;
        let mut diagnosis = self
            .model
            .diagnose_nonfinite(self.cache.pools_mut(), &tokens, chunk);
        if matches!(&diagnosis, Err(e) if e.kind() == ErrorKind::Capacity) {
            // Cached prefixes give way to the diagnosis, as they do to scoring.
            self.cache
                .evict(self.cache.pools().pages_for(tokens.len()), 0);
            diagnosis = self
                .model
                .diagnose_nonfinite(self.cache.pools_mut(), &tokens, chunk);
        }
        let message = match diagnosis {
            Ok(Some(f)) => format!("request {}: {}", info.id, f.message()),
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

    /// Moves running request `i` back to the front of the queue: what it computed goes into
    /// the prefix cache (so the recompute may hit it), its pages and slot are freed.
    fn requeue(&mut self, i: usize, retracted: bool) {
        let r = self.running.swap_remove(i);
        let counted = r.queued_tokens as u64;
        let position = r.req.position();
        self.cache.finish(r.req, &r.p.tokens[..position]);
        let p = r.p;
        {
            let mut a = self.shared.admission();
            a.queued_requests += 1;
            a.queued_tokens -= counted;
            a.queued_tokens += p.tokens.len() as u64;
        }
        if retracted {
            log::info!(
                "request {} retracted after {} generated tokens: the KV pools ran out \
                 (new_token_ratio now {:.2})",
                r.id,
                p.generated,
                self.new_token_ratio
            );
        }
        self.waiting.push(Waiting {
            pending: Box::new(Pending {
                id: r.id,
                spec: r.spec,
                submitted: r.submitted,
                max_gen: r.max_gen,
                import: None,
            }),
            // One that never ran waits again as it was submitted (its queue timeout applies,
            // its seed is drawn when it starts).
            progress: p.counted.then(|| Box::new(p)),
        });
    }

    fn abort(&mut self, id: u64) {
        if let Some(i) = self.waiting.iter().position(|w| w.pending.id == id) {
            self.end_waiting(i, End::Finished(FinishReason::Aborted));
        } else if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.end_running(i, End::Finished(FinishReason::Aborted), false);
        }
    }

    fn abort_all(&mut self) {
        if !self.waiting.is_empty() || !self.running.is_empty() {
            log::info!(
                "abort shutdown: ending {} waiting and {} running requests",
                self.waiting.len(),
                self.running.len()
            );
        }
        while !self.waiting.is_empty() {
            self.end_waiting(0, End::Finished(FinishReason::Aborted));
        }
        while !self.running.is_empty() {
            self.end_running(0, End::Finished(FinishReason::Aborted), false);
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
            let w = &self.waiting[i];
            let queued_too_long = self.queue_deadline(w).is_some_and(|t| now >= t);
            if queued_too_long || past(w.pending.submitted, w.pending.spec.deadline_ms) {
                self.end_waiting(i, End::Finished(FinishReason::Timeout));
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if past(r.submitted, r.spec.deadline_ms) {
                self.end_running(i, End::Finished(FinishReason::Timeout), true);
            } else {
                i += 1;
            }
        }
    }

    // --- admission to the running set ---------------------------------------------------------

    /// The next waiting request. Retracted requests first; then, under `lpm` (up to
    /// `lpm_max_waiting` waiting), the longest reusable cached prefix; then priority; then
    /// arrival.
    fn next_waiting(&self) -> Option<usize> {
        let lpm = self.limits.policy == SchedulerPolicy::Lpm
            && self.waiting.len() <= self.limits.lpm_max_waiting;
        (0..self.waiting.len()).min_by_key(|&i| {
            let w = &self.waiting[i];
            let p = &w.pending;
            let cached = if lpm {
                self.cache.peek(p.spec.cache_salt.as_deref(), w.tokens()).0
            } else {
                0
            };
            (
                w.progress.is_none(),
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

    /// Whether waiting request `i` fits next to the running ones: the pages its prefill needs
    /// plus, for it and every running request, `new_token_ratio` of what they may still
    /// generate, against the free and reclaimable pages.
    fn fits(&self, i: usize) -> bool {
        let pools = self.cache.pools();
        let mut need = 0;
        for r in &self.running {
            let target = r.prefill_len.max(r.req.position())
                + self.expected(r.max_gen.saturating_sub(r.p.generated));
            need += pools
                .pages_for(target)
                .saturating_sub(r.req.kv().pages().len());
        }
        let w = &self.waiting[i];
        let tokens = w.tokens();
        let remaining = w.pending.max_gen.saturating_sub(w.generated());
        let (own, available) = self.cache.page_budget(
            w.pending.spec.cache_salt.as_deref(),
            tokens,
            tokens.len() + self.expected(remaining),
        );
        need + own <= available
    }

    fn admit(&mut self) {
        if self.blocked {
            return;
        }
        while self.running.len() < self.limits.max_running {
            let Some(i) = self.next_waiting() else { return };
            if !self.running.is_empty() && !self.fits(i) {
                self.blocked = true;
                return;
            }
            let w = &self.waiting[i];
            let salt = w.pending.spec.cache_salt.clone();
            // What admission counted for it (its tokens), and what it must compute before it
            // samples: everything, or for an import nothing past the exported position.
            let queued = w.tokens().len();
            let started = match &w.pending.import {
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
                Err(e) if e.kind() != ErrorKind::Capacity && w.pending.import.is_some() => {
                    // A state this engine can never take (another layout, altered bytes).
                    log::warn!("request {}: cannot import: {e}", w.pending.id);
                    self.end_waiting(i, End::Failed(e));
                    continue;
                }
                Err(e) => {
                    log::warn!("request {}: cannot start: {e}", w.pending.id);
                    self.blocked = true;
                    return;
                }
            };
            // The prefill's pages now (after its load-back, for a host hit: `finish_loads`);
            // decode pages one at a time (`make_room_for_decode`).
            let loading = req.is_loading();
            if loading {
                // Reserved once the load lands.
            } else if let Err(e) = self.cache.reserve(&mut req, prefill_len) {
                self.cache.abort(req);
                if self.running.is_empty() {
                    // Nothing will free pages: it can never run.
                    log::warn!("request {}: {e}", self.waiting[i].pending.id);
                    self.end_waiting(i, End::Failed(e));
                    continue;
                }
                self.blocked = true;
                return;
            }
            let w = self.waiting.remove(i);
            let mut pending = *w.pending;
            // The KV is in the pools now; the bytes are not needed again.
            pending.import = None;
            {
                let mut a = self.shared.admission();
                a.queued_requests -= 1;
                a.queued_tokens -= queued as u64;
            }
            let p = match w.progress {
                Some(p) => *p,
                None => {
                    let seed = if pending.spec.seed != 0 {
                        pending.spec.seed
                    } else {
                        self.rng.u64(..)
                    };
                    Progress::new(
                        Sampler::new(pending.spec.sampling.clone(), seed),
                        pending.spec.prompt.clone(),
                        0,
                    )
                }
            };
            let mut p = p;
            if !p.counted {
                p.queue_us = micros(pending.submitted.elapsed());
            }
            self.running.push(Running {
                id: pending.id,
                submitted: pending.submitted,
                max_gen: pending.max_gen,
                spec: pending.spec,
                req,
                prefill_len,
                p,
                reserved: !loading,
                queued_tokens: 0,
            });
            let i = self.running.len() - 1;
            self.recount(i);
            if !loading {
                self.on_ready(i);
            }
        }
    }

    // --- decode pages and retraction ------------------------------------------------------

    /// Every decoding request gets the page its next token needs, oldest first; when none can
    /// be freed, the newest running request (lowest priority first) is retracted and the
    /// search starts over.
    fn make_room_for_decode(&mut self) {
        'search: loop {
            let mut needy: Vec<(u64, usize)> = self
                .running
                .iter()
                .enumerate()
                .filter(|(_, r)| {
                    r.decoding()
                        && self.cache.pools().pages_for(r.req.position() + 1)
                            > r.req.kv().pages().len()
                })
                .map(|(i, r)| (r.id, i))
                .collect();
            needy.sort_unstable();
            for (_, i) in needy {
                let r = &mut self.running[i];
                let want = r.req.position() + 1;
                if self.cache.reserve(&mut r.req, want).is_ok() {
                    continue;
                }
                let Some(victim) = self.retraction_victim() else {
                    return;
                };
                if self.running.len() == 1 {
                    // Alone and still short: the pools cannot hold it (the context limit
                    // should have prevented this).
                    let message = format!(
                        "request {}: no KV page for token {want} with nothing else running: \
                         raise kv.device_memory_bytes or lower kv.max_context_tokens",
                        self.running[victim].id
                    );
                    log::error!("{message}");
                    let e = Error::new(ErrorKind::Capacity, message);
                    self.end_running(victim, End::Failed(e), true);
                    return;
                }
                self.new_token_ratio = (self.new_token_ratio + RATIO_BUMP).clamp(RATIO_INIT, 1.0);
                self.shared.metrics.update(|m| m.retractions += 1);
                self.requeue(victim, true);
                self.blocked = true;
                continue 'search;
            }
            return;
        }
    }

    /// The running request to retract: lowest priority, then the newest.
    fn retraction_victim(&self) -> Option<usize> {
        (0..self.running.len())
            .filter(|&i| self.running[i].reserved)
            .max_by_key(|&i| {
                let r = &self.running[i];
                (std::cmp::Reverse(r.spec.priority), r.id)
            })
    }

    // --- one forward step -----------------------------------------------------------------

    /// One forward step over every runnable request; false when there was nothing to run.
    /// Requests whose events wait unpolled while the event queue is full sit this one out.
    fn step(&mut self) -> bool {
        // (running index, token range, wants logits)
        let mut plan: Vec<(usize, std::ops::Range<usize>, bool)> = Vec::new();
        let mut budget = self.limits.batch_tokens;
        let paused = self.shared.sink.paused();
        for (i, r) in self.running.iter().enumerate() {
            let pos = r.req.position();
            if paused.contains(&r.id) {
                continue;
            }
            if r.decoding() && self.cache.pools().pages_for(pos + 1) <= r.req.kv().pages().len() {
                plan.push((i, pos..pos + 1, true));
                budget = budget.saturating_sub(1);
            }
        }
        let decodes = plan.len();
        for (i, r) in self.running.iter().enumerate() {
            let pos = r.req.position();
            if !r.reserved || pos >= r.prefill_len || budget == 0 || paused.contains(&r.id) {
                continue;
            }
            let end = self
                .cache
                .chunk_limit(&r.req)
                .min(pos + self.limits.chunk_tokens)
                .min(pos + budget);
            budget -= end - pos;
            plan.push((i, pos..end, end == r.prefill_len));
        }
        if plan.is_empty() {
            return false;
        }
        if decodes > 0 {
            self.new_token_ratio = (self.new_token_ratio - RATIO_DECAY).max(RATIO_MIN);
        }
        let (running, cache) = (&mut self.running, &mut self.cache);
        let mut seqs: Vec<(usize, &mut Running)> = running.iter_mut().enumerate().collect();
        let mut chunks = Vec::with_capacity(plan.len());
        let mut order = Vec::with_capacity(plan.len());
        for (i, range, want) in &plan {
            let slot = seqs.iter().position(|(j, _)| j == i).expect("planned once");
            let (_, r) = seqs.swap_remove(slot);
            order.push(*i);
            let Running { req, p, .. } = r;
            chunks.push(Chunk {
                tokens: &p.tokens[range.clone()],
                seq: req.kv_mut(),
                logits: if *want { Logits::Last } else { Logits::None },
            });
        }
        let started = Instant::now();
        let result = self.model.forward(cache.pools_mut(), &mut chunks);
        let elapsed = started.elapsed();
        drop(chunks);
        let computed: usize = plan.iter().map(|(_, r, _)| r.len()).sum();
        self.shared.metrics.update(|m| {
            m.forward_steps += 1;
            m.forward_tokens += computed as u64;
            m.step_time.observe_duration(elapsed);
        });
        let outputs = match result {
            Ok(o) => o,
            Err(e) => {
                log::error!("forward step failed: {e}");
                let mut idx: Vec<usize> = order.clone();
                idx.sort_unstable_by(|a, b| b.cmp(a));
                for i in idx {
                    self.end_running(i, End::Failed(e.clone()), false);
                }
                return true;
            }
        };
        // (running index, how it ends; a failure here is non-finite logits)
        let mut finished: Vec<(usize, End)> = Vec::new();
        let mut itl = Vec::new();
        let mut new_tokens = 0u64;
        let mut ttft = Vec::new();
        for ((i, _, _), logits) in plan.iter().zip(outputs) {
            self.recount(*i);
            let r = &mut self.running[*i];
            let pos = r.req.position();
            if let Err(e) = self.cache.after_step(&mut r.req, &r.p.tokens[..pos]) {
                log::error!("request {}: prefix cache: {e}", r.id);
            }
            if logits.is_empty() {
                continue;
            }
            // One pass over the sampled rows only (not per layer): a NaN or inf here would be
            // sampled as some token and the request would "finish" normally with garbage.
            if logits.iter().any(|v| !v.is_finite()) {
                finished.push((*i, End::Failed(nonfinite_logits(r.id, pos, &logits))));
                continue;
            }
            let (token, logprob) = r.p.sampler.sample(&logits);
            r.p.tokens.push(token);
            r.p.generated += 1;
            new_tokens += 1;
            let now = Instant::now();
            match r.p.last_token {
                Some(last) => itl.push(now - last),
                None => ttft.push(now - r.submitted),
            }
            r.p.last_token = Some(now);
            let first = *r.p.first_token.get_or_insert(now);
            let origin = Origin {
                request_id: r.id,
                user_tag: r.spec.user_tag,
            };
            let stats = EventStats {
                prompt_tokens: r.spec.prompt.len() as u32,
                cached_tokens_device: (r.p.cached - r.p.cached_host) as u32,
                cached_tokens_host: r.p.cached_host as u32,
                generated_tokens: r.p.generated as u32,
                queue_us: r.p.queue_us,
                ttft_us: micros(first - r.submitted),
                elapsed_us: micros(now - r.submitted),
            };
            let logprob = if r.spec.logprobs { logprob } else { 0.0 };
            self.shared
                .sink
                .emit(Event::token(origin, token, logprob, stats));
            if self.eos.contains(&token) || r.spec.stop_tokens.contains(&token) {
                finished.push((*i, End::Finished(FinishReason::Stop)));
            } else if r.p.generated >= r.max_gen {
                finished.push((*i, End::Finished(FinishReason::Length)));
            }
        }
        self.shared.metrics.update(|m| {
            m.generation_tokens += new_tokens;
            for d in ttft {
                m.ttft.observe_duration(d);
            }
            for d in itl {
                m.itl.observe_duration(d);
            }
        });
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        for (i, end) in finished {
            match end {
                End::Failed(e) => self.end_nonfinite(i, e),
                end => self.end_running(i, end, true),
            }
        }
        true
    }
}

/// The error that ends a request whose sampled logits are not finite.
fn nonfinite_logits(id: u64, position: usize, logits: &[f32]) -> Error {
    let nan = logits.iter().filter(|v| v.is_nan()).count();
    let inf = logits.iter().filter(|v| v.is_infinite()).count();
    Error::new(
        ErrorKind::ModelFormat,
        format!(
            "request {id}: the logits after position {position} are not finite ({nan} NaN, {inf} \
             ±inf of {}): the model produced non-finite values (a NaN or inf in a weight or \
             scale, or an out-of-range config value); check or re-convert the checkpoint",
            logits.len()
        ),
    )
}

/// How a request ends: its terminal event.
enum End {
    Finished(FinishReason),
    Failed(Error),
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
