//! The engine a host embeds: parameters validated, the plan checked against this machine, the
//! model loaded, KV pools allocated, and one engine thread that owns them. Callers submit
//! requests through a bounded channel and receive events by polling or through a callback;
//! admission control answers at submit time.

mod admit;
mod controls;
mod ending;
mod event;
mod executor;
mod gauges;
mod health;
mod inbox;
mod metrics;
mod phase;
mod prometheus;
mod request;
mod retract;
mod rooms;
mod sampling;
mod scheduler;
mod shared;
mod worker;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;
use serde_json::Value;

pub use event::{Event, EventCallback, EventKind, EventStats, FinishReason, Origin};
use inbox::Control;
pub use metrics::{
    Histogram, KvTransfer, MetricsSnapshot, Outcome, PdGauges, PoolGauges, Rejection, Units,
    BYTE_BUCKETS, LATENCY_BUCKETS, STEP_BUCKETS,
};
pub use phase::Phase;
pub use request::{RequestSpec, MAX_STOP_SEQUENCE_TOKENS};
pub use sampling::{filtered, Sampler, SamplingParams};
use scheduler::Limits;
pub use shared::{EngineState, ExportedSequence, PoolUsage, ShutdownMode};
use shared::{Pending, Shared};
use worker::Worker;

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::config::params::Endpoint;
use crate::config::params::{Backend as BackendKind, Params, Role};
use crate::error::{Error, ErrorKind, Result};
use crate::kv::cache::Tier;
use crate::kv::hicache::HostPools;
use crate::kv::{KvPools, PrefixCache};
use crate::model::Model;
use crate::pd::{self, Node, Side};
use crate::plan::{self, Plan};
use crate::tokenizer::TextCodec;

/// A loaded engine. Thread-safe: every method takes `&self`. Not generic over the backend: the
/// backend is chosen once, in [`Engine::create`] (`start_on_backend`), and lives on the
/// engine thread.
pub struct Engine {
    params: Params,
    plan: Plan,
    /// What the loaded model reports (`model_info`), taken at load.
    model_info: Value,
    vocab_size: usize,
    shared: Arc<Shared>,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
    /// Prompt + generated tokens one request may reach: the smaller of kv.max_context_tokens
    /// and what the device pages hold.
    context_limit: usize,
    /// The PD node (prefill and decode roles): listener, links, rooms.
    pd: Option<Arc<Node>>,
    /// The checkpoint's tokenizer and chat template, when it has them. Used on the caller's
    /// thread only: text calls never wait on the engine thread.
    text: TextCodec,
    /// The host memory this engine's plan requires, counted by every later engine's fit check
    /// (its pools map lazily, so free memory alone does not show them) until it is dropped.
    _reservation: plan::Reservation,
}

/// What starting the engine thread on a backend gives the handle.
struct Started {
    thread: JoinHandle<()>,
    model_info: Value,
    vocab_size: usize,
    pd: Option<Arc<Node>>,
    text: TextCodec,
}

/// The one place a backend is chosen: builds it from the params, then loads the model and the
/// KV pools on it and starts the engine thread ([`start`]).
fn start_on_backend(params: &Params, plan: &Plan, shared: Arc<Shared>) -> Result<Started> {
    match params.backend {
        BackendKind::Cpu => {
            let backend = Arc::new(CpuBackend::new(params.threads as usize)?);
            let threads = backend.threads();
            start(params, plan, backend, threads, shared)
        }
        // Refused before planning (`refuse_unbuilt`); kept exhaustive for when it lands.
        BackendKind::Cuda => Err(Error::new(
            ErrorKind::Unsupported,
            crate::backend::cuda::not_ready(&params.devices),
        )),
    }
}

/// Loads the model and the KV pools on `backend` (with `threads` workers) and starts the
/// engine thread over them.
fn start<B: Backend>(
    params: &Params,
    plan: &Plan,
    backend: Arc<B>,
    threads: usize,
    shared: Arc<Shared>,
) -> Result<Started> {
    let path = params
        .model_path
        .as_deref()
        .ok_or_else(|| Error::config("`model_path` is not set"))?;
    log::info!(
        "creating engine: {} on the {} backend with {threads} threads",
        plan.model.name,
        backend.name()
    );
    let model = Arc::new(
        Model::load(
            Path::new(path),
            plan.model.clone(),
            backend.clone(),
            params.model.weight_dtype,
        )?
        .with_numerics(params.numerics.mode),
    );
    let mut pools = KvPools::new(backend.clone(), plan)?;
    if params.kv.prefault {
        pools.prefault()?;
    }
    let mut cache = PrefixCache::new(pools, params.kv.snapshot_interval() as usize)?;
    if !params.kv.prefix_cache {
        cache = cache.without_reuse();
    }
    if params.hicache.enabled {
        let host = HostPools::new(plan, backend.as_ref(), threads)?;
        cache = cache.with_host(host, params.hicache.write_policy);
    }
    let limits = Limits {
        max_running: params.kv.max_running_requests as usize,
        chunk_tokens: params.scheduler.chunked_prefill_tokens as usize,
        batch_tokens: params.scheduler.max_batch_tokens as usize,
        queue_timeout: match params.admission.queue_timeout_ms {
            0 => None,
            ms => Some(Duration::from_millis(ms.into())),
        },
        policy: params.scheduler.policy,
        lpm_max_waiting: params.scheduler.lpm_max_waiting as usize,
    };
    let mut model_info = model.info();
    model_info["threads"] = threads.into();
    // What `auto` resolved to for this checkpoint.
    model_info["weight_dtype"] = params
        .model
        .weight_dtype
        .resolve(&model.config)
        .name()
        .into();
    model_info["bos_token_id"] = model.config.bos_token_id.into();
    model_info["eos_token_ids"] = model.config.eos_token_ids.clone().into();
    let vocab_size = model.config.vocab_size;
    // Ids cross the ABI as int32_t (the config loader keeps vocab_size far below i32::MAX).
    let text = TextCodec::load(model_dir(Path::new(path)), vocab_size);
    // Whether the text calls work (a file that is present but unusable is not "found": the
    // calls say why, and so did a warning at load).
    model_info["has_tokenizer"] = text.has_tokenizer().into();
    model_info["has_chat_template"] = text.has_chat_template().into();
    let pd = match params.role {
        Role::Unified => None,
        role => {
            let p = &params.pd;
            let endpoint = |text: &str| {
                Endpoint::parse(text).map_err(|m| Error::config(format!("pd endpoint: {m}")))
            };
            let listen = endpoint(&p.listen)?;
            let auth =
                pd::auth::for_listen(p.auth_key_file.as_deref(), p.insecure_no_auth, &listen)
                    .map_err(Error::config)?;
            let side = if role == Role::Prefill {
                Side::Prefill
            } else {
                Side::Decode
            };
            let tls = pd::tls::for_engine(p, side).map_err(Error::config)?;
            let cfg = pd::Config {
                side,
                listen,
                ucx_library: p.ucx_library.as_ref().map(std::path::PathBuf::from),
                advertise: p.advertise.as_deref().map(endpoint).transpose()?,
                bootstrap_timeout: Duration::from_millis(p.bootstrap_timeout_ms.into()),
                transfer_timeout: Duration::from_millis(p.transfer_timeout_ms.into()),
                heartbeat_interval: Duration::from_millis(p.heartbeat_interval_ms.into()),
                heartbeat_misses: p.heartbeat_misses,
                max_rooms: p.max_rooms as usize,
                bounds: pd::PeerBounds {
                    max_links: p.max_links as usize,
                    max_handshakes: p.max_handshakes as usize,
                    handshake_timeout: Duration::from_millis(p.handshake_timeout_ms.into()),
                    max_outbox_bytes: usize::try_from(p.max_outbox_bytes).unwrap_or(usize::MAX),
                },
                auth,
                tls,
                allowed_peers: p.allowed_peers.clone(),
                layout: cache.pools().layout().fingerprint().clone(),
                // Host-memory pools may be written by a prefill's RMA (UCX); the engine thread
                // shuts the node down before it frees them.
                rma_regions: match role {
                    Role::Decode
                        if p.ucx_rma && cache.pools().backend().buffers_in_host_memory() =>
                    {
                        cache.pools().regions()
                    }
                    _ => Vec::new(),
                },
                rma_emulated: p.ucx_rma_emulated,
            };
            let sink: Arc<dyn pd::Sink> = shared.clone();
            Some(Arc::new(Node::start(cfg, sink)?))
        }
    };
    let worker = Worker::new(model, cache, shared, limits, pd.clone());
    let thread = std::thread::Builder::new()
        .name("dsv4-engine".into())
        .spawn(move || worker.run())
        .map_err(|e| Error::internal(format!("cannot start the engine thread: {e}")))?;
    Ok(Started {
        thread,
        model_info,
        vocab_size,
        pd,
        text,
    })
}

impl Engine {
    /// Validates `params`, checks the plan fits this machine, loads the model, allocates the
    /// KV pools and starts the engine thread.
    pub fn create(params: Params) -> Result<Self> {
        refuse_unbuilt(&params)?;
        let plan = plan::plan(&params)?;
        if !plan.numa.fits {
            return Err(Error::new(ErrorKind::Capacity, plan.numa.reason.clone()));
        }
        // Taken before anything is loaded, so an engine created meanwhile already counts it;
        // re-checks the fit against the engines that reserved since the plan was made.
        let reservation = plan::Reservation::acquire(&plan)?;
        let context_limit = (plan.max_context_tokens as usize).min(plan.device_tokens() as usize);
        let shared = Arc::new(Shared::new(params.admission.max_unpolled_events as usize));
        let started = start_on_backend(&params, &plan, shared.clone())?;
        let mut model_info = started.model_info;
        // What one request can hold, prompt and output together: the model's positions are
        // not the limit, the KV pools and kv.max_context_tokens are.
        model_info["context_limit"] = context_limit.into();
        Ok(Self {
            params,
            plan,
            model_info,
            vocab_size: started.vocab_size,
            shared,
            thread: std::sync::Mutex::new(Some(started.thread)),
            pd: started.pd,
            text: started.text,
            context_limit,
            _reservation: reservation,
        })
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Accepts a request or refuses it at once: `InvalidArgument` (bad fields), `Capacity`
    /// (a prompt no pool could ever hold), `QueueFull` (admission limits), `Shutdown`. Does not
    /// block. Returns the request id.
    pub fn submit(&self, spec: RequestSpec) -> Result<u64> {
        self.submit_with(spec, None)
    }

    /// Continues a sequence exported from another engine with the same params
    /// ([`Self::export_sequence`]): `spec` is the original request (its prompt must begin the
    /// exported tokens); the next TOKEN event is number `generated + 1`. Admitted like a
    /// submit; a state whose layout differs from this engine's ends with an ERROR event.
    pub fn submit_imported(&self, spec: RequestSpec, sequence: ExportedSequence) -> Result<u64> {
        let x = &sequence;
        let problem = if !x.tokens.starts_with(&spec.prompt) {
            Some("its tokens do not begin with the request's prompt".to_string())
        } else if x.generated != x.tokens.len() - spec.prompt.len() || x.generated == 0 {
            Some(format!(
                "it says {} tokens were generated but holds {} after a {}-token prompt",
                x.generated,
                x.tokens.len() - spec.prompt.len(),
                spec.prompt.len()
            ))
        } else if x.state.position + 1 != x.tokens.len() {
            Some(format!(
                "its KV covers {} tokens but {} are listed (the last one not yet fed)",
                x.state.position,
                x.tokens.len()
            ))
        } else if x.generated >= spec.max_new_tokens as usize {
            Some(format!(
                "it already generated {} of max_new_tokens = {}",
                x.generated, spec.max_new_tokens
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            let e = Error::invalid_argument(format!(
                "the exported sequence does not continue this request: {p}"
            ));
            self.shared.metrics.reject(e.kind());
            return Err(e);
        }
        self.submit_with(spec, Some(Box::new(sequence)))
    }

    /// The state of decoding request `id`, taken between steps; the request keeps running.
    /// `InvalidArgument` unless it is decoding (after its first TOKEN event).
    pub fn export_sequence(&self, id: u64) -> Result<ExportedSequence> {
        self.ask("export_sequence", |tx| Control::Export(id, tx))?
    }

    fn submit_with(&self, spec: RequestSpec, import: Option<Box<ExportedSequence>>) -> Result<u64> {
        self.alive()?;
        let result = self.admit(spec, import);
        match &result {
            Ok(_) => self.shared.metrics.update(|m| m.requests += 1),
            Err(e) => self.shared.metrics.reject(e.kind()),
        }
        result
    }

    fn admit(&self, spec: RequestSpec, import: Option<Box<ExportedSequence>>) -> Result<u64> {
        if !self.shared.inbox.accepting() {
            return Err(shutting_down());
        }
        spec.validate(self.vocab_size())?;
        self.check_pd_fields(&spec)?;
        let prompt = spec.prompt.len();
        // Admission counts the tokens the request brings: its prompt, or an import's all.
        let queued = import.as_ref().map_or(prompt, |x| x.tokens.len());
        if prompt > self.context_limit {
            return Err(Error::new(
                ErrorKind::Capacity,
                format!(
                    "the prompt has {prompt} tokens but one request can hold at most {} (kv.max_context_tokens \
                     = {}, device KV pages hold {} tokens): shorten it or raise kv.max_context_tokens / \
                     kv.device_memory_bytes",
                    self.context_limit,
                    self.plan.max_context_tokens,
                    self.plan.device_tokens()
                ),
            ));
        }
        let limits = &self.params.admission;
        {
            let mut a = self.shared.admission();
            // A prefill's rooms waiting for their claim after they left the queue still
            // count: they hold pages until a decode engine takes them.
            let parked = match &self.pd {
                Some(n) if n.side() == Side::Prefill => n.unclaimed_out_of_queue() as u64,
                _ => 0,
            };
            if a.queued_requests + parked + 1 > u64::from(limits.max_queued_requests) {
                return Err(Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "admission.max_queued_requests = {} reached ({} requests waiting): retry \
                         later, or raise the limit if the server can absorb the burst",
                        limits.max_queued_requests,
                        a.queued_requests + parked
                    ),
                ));
            }
            if a.queued_tokens + queued as u64 > limits.max_queued_tokens {
                return Err(Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "admission.max_queued_tokens = {} would be exceeded: {} prompt tokens are \
                         queued and this request adds {queued}: retry later, or raise the limit",
                        limits.max_queued_tokens, a.queued_tokens
                    ),
                ));
            }
            a.queued_requests += 1;
            a.queued_tokens += queued as u64;
        }
        let id = self.shared.next_id.fetch_add(1, Ordering::SeqCst);
        let room = spec.pd_room;
        if let Some(node) = &self.pd {
            if let Err(e) = node.register(room, id, spec.pd_digest(), spec.pd_peer.clone()) {
                let mut a = self.shared.admission();
                a.queued_requests -= 1;
                a.queued_tokens -= queued as u64;
                return Err(e);
            }
        }
        self.shared.live().insert(id, spec.user_tag);
        let mut max_gen = (spec.max_new_tokens as usize).min(self.context_limit - prompt + 1);
        if self.params.role == Role::Prefill {
            // A prefill engine samples the first token only (the decode generates the rest).
            max_gen = 1;
        }
        let pending = Pending {
            id,
            spec,
            submitted: Instant::now(),
            max_gen,
            import,
        };
        // Accepted only if the engine thread will see it: the inbox refuses once a shutdown
        // began, under the same lock the engine thread takes to decide it is done.
        match self.shared.inbox.submit(pending) {
            Ok(()) => {
                if let Some(node) = &self.pd {
                    node.activate(room);
                }
                Ok(id)
            }
            Err(_) => {
                self.shared.live().remove(&id);
                if let Some(node) = &self.pd {
                    node.close(room, None);
                }
                let mut a = self.shared.admission();
                a.queued_requests -= 1;
                a.queued_tokens -= queued as u64;
                Err(shutting_down())
            }
        }
    }

    /// The PD fields of a request against this engine's role.
    fn check_pd_fields(&self, spec: &RequestSpec) -> Result<()> {
        if self.params.role == Role::Unified && (spec.pd_room != 0 || spec.pd_peer.is_some()) {
            return Err(Error::invalid_argument(format!(
                "pd_room = {} / pd_peer = {:?} are for PD engines (role = prefill or decode), \
                 but this engine's role is unified: leave them unset, or create prefill and \
                 decode engines",
                spec.pd_room, spec.pd_peer
            )));
        }
        if self.params.role == Role::Unified {
            return Ok(());
        }
        if spec.pd_room == 0 {
            return Err(Error::invalid_argument(
                "pd_room is 0: a request to a prefill or decode engine needs the room the router \
                 gave it (non-zero, the same on both engines)",
            ));
        }
        match (self.params.role, &spec.pd_peer) {
            (Role::Decode, None) => Err(Error::invalid_argument(
                "pd_peer is not set: a decode engine's request names the prefill engine it \
                 continues (its dsv4_pd_endpoint, e.g. tcp://10.0.0.5:7000)",
            )),
            (Role::Decode, Some(peer)) => Endpoint::parse(peer)
                .map(|_| ())
                .map_err(|m| Error::invalid_argument(format!("pd_peer: {m}"))),
            (_, Some(peer)) => Err(Error::invalid_argument(format!(
                "pd_peer = {peer:?} on a prefill engine: only decode engines name a peer (the \
                 decode connects to the prefill); leave it unset"
            ))),
            _ => Ok(()),
        }
    }

    /// The address PD peers reach this engine at (`pd.advertise`, else the bound `pd.listen`),
    /// as `tcp://host:port`. `InvalidArgument` in the unified role (it has none).
    pub fn pd_endpoint(&self) -> Result<String> {
        if let Some(node) = &self.pd {
            return Ok(node.endpoint().to_string());
        }
        Err(Error::invalid_argument(format!(
            "this engine's role is {}: only prefill and decode engines have a PD endpoint",
            format!("{:?}", self.params.role).to_lowercase()
        )))
    }

    /// Up to `max` events; waits up to `timeout` for the first (`None` = until one arrives or
    /// the engine stops, `Some(0)` = never blocks). `Unsupported` while a callback is set
    /// (also for a poller already waiting when one is set).
    pub fn poll(&self, max: usize, timeout: Option<Duration>) -> Result<Vec<Event>> {
        let polled = self.shared.sink.poll(max, timeout)?;
        if polled.freed {
            // Requests paused for unpolled events may continue.
            self.shared.inbox.wake();
        }
        Ok(polled.events)
    }

    /// Ends a request with FINISHED/ABORTED. `NotFound` for unknown or already ended ids.
    /// Never blocks (also from a callback).
    pub fn abort(&self, id: u64) -> Result<()> {
        self.alive()?;
        if !self.shared.live().contains_key(&id) {
            return Err(Error::new(
                ErrorKind::NotFound,
                format!("request {id} is not in flight (unknown, or it already ended)"),
            ));
        }
        self.shared.inbox.abort(id);
        Ok(())
    }

    /// Push mode: `callback` receives every event on the engine thread (`None`: back to
    /// polling). Events queued before are delivered to it first. Blocks until the engine
    /// thread has switched; refused on dsv4's own threads (from a callback).
    pub fn set_callback(&self, callback: Option<Arc<dyn EventCallback>>) -> Result<()> {
        self.not_from_callback("dsv4_set_event_callback")?;
        let (tx, rx) = bounded(1);
        let queued = self
            .shared
            .inbox
            .control(Control::SetCallback(callback.clone(), tx));
        if queued.is_ok() && rx.recv().is_ok() {
            return Ok(());
        }
        // The engine thread has ended: nothing else emits, so switch here.
        for e in self.shared.sink.set_callback(callback) {
            self.shared.sink.emit(e);
        }
        Ok(())
    }

    /// Stops intake and ends the requests in flight per `mode`; waits up to `timeout` (None =
    /// as long as it takes) for the engine thread to finish. `Timeout` if it is still draining.
    pub fn shutdown(&self, mode: ShutdownMode, timeout: Option<Duration>) -> Result<()> {
        self.not_from_callback("dsv4_engine_shutdown")?;
        self.shared.inbox.shutdown(mode);
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut stopped = self
            .shared
            .stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        while !*stopped {
            match deadline {
                None => {
                    stopped = self
                        .shared
                        .stopped_cv
                        .wait(stopped)
                        .unwrap_or_else(|e| e.into_inner())
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Err(Error::new(
                            ErrorKind::Timeout,
                            "the engine is still draining its requests: poll for their events, \
                             or shut down with DSV4_SHUTDOWN_ABORT",
                        ));
                    }
                    stopped = self
                        .shared
                        .stopped_cv
                        .wait_timeout(stopped, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        drop(stopped);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
        // Every request has ended (its room closed): the links and the listener go now.
        if let Some(node) = &self.pd {
            node.shutdown();
        }
        Ok(())
    }

    /// Where the engine stands and why, in words a health endpoint can show. Never blocks
    /// (also from a callback). Checked in order: a dead engine thread is `Failed` (the reason
    /// quotes its error), an ended one `Stopped`, a shutdown under way `Draining` (with the
    /// requests still in flight), otherwise `Ready`. Never `Loading`: `create` returns a handle
    /// only once the model is loaded.
    pub fn state(&self) -> (EngineState, String) {
        if let Some(message) = self.shared.dead() {
            return (
                EngineState::Failed,
                format!("the engine thread failed: {message}"),
            );
        }
        let in_flight = self.shared.live().len();
        let requests = |n: usize| match n {
            1 => "1 request".to_string(),
            n => format!("{n} requests"),
        };
        if *self
            .shared
            .stopped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        {
            return (
                EngineState::Stopped,
                "shut down: the engine thread has ended every request and stopped".into(),
            );
        }
        match self.shared.inbox.shutdown_mode() {
            Some(mode) => {
                let mode = match mode {
                    ShutdownMode::Drain => "drain",
                    ShutdownMode::Abort => "abort",
                };
                (
                    EngineState::Draining,
                    format!(
                        "shutting down ({mode}): {} still running",
                        requests(in_flight)
                    ),
                )
            }
            None => (
                EngineState::Ready,
                format!("ready: {} in flight", requests(in_flight)),
            ),
        }
    }

    /// Tests only: makes the engine thread panic with `message` (the dead-engine path, which
    /// no input reaches on purpose).
    #[cfg(test)]
    pub(crate) fn inject_panic(&self, message: &'static str) {
        let _ = self.shared.inbox.control(Control::Panic(message));
    }

    /// Calls that wait for the engine thread are refused on dsv4's own threads: there they run
    /// inside a host callback, and the engine thread (or the worker it waits for) is the one
    /// running it.
    fn not_from_callback(&self, call: &str) -> Result<()> {
        if crate::threads::is_internal() {
            return Err(Error::invalid_argument(format!(
                "{call} was called on a dsv4 thread (from an event or log callback): it waits \
                 for the engine thread, which is running the callback; call it from another \
                 thread (submit, abort, poll and the metrics calls may be made from callbacks)"
            )));
        }
        Ok(())
    }

    /// `Internal` with the panic's message once the engine thread has died.
    fn alive(&self) -> Result<()> {
        match self.shared.dead() {
            Some(message) => Err(Error::internal(message)),
            None => Ok(()),
        }
    }

    /// Runs `make(reply)` on the engine thread between steps and waits for its answer.
    fn ask<T>(
        &self,
        call: &str,
        make: impl FnOnce(crossbeam_channel::Sender<T>) -> Control,
    ) -> Result<T> {
        self.alive()?;
        self.not_from_callback(call)?;
        let (tx, rx) = bounded(1);
        if self.shared.inbox.control(make(tx)).is_err() {
            return Err(self.stopped_error());
        }
        rx.recv().map_err(|_| self.stopped_error())
    }

    fn stopped_error(&self) -> Error {
        match self.shared.dead() {
            Some(message) => Error::internal(message),
            None => Error::new(ErrorKind::Shutdown, "the engine thread has stopped"),
        }
    }

    /// Logits of every position of one fresh sequence, `[tokens.len(), vocab]` row-major.
    /// Runs on the engine thread between steps.
    pub fn score(&self, tokens: &[i32]) -> Result<Vec<f32>> {
        let ids = self.check_tokens(tokens)?;
        self.ask("dsv4_score", |tx| Control::Score(ids, tx))?
    }

    /// Drops every unlocked cached prefix of `tier` (flushing the device keeps host copies)
    /// and reports the device units still in use (running requests' pages, slots and
    /// snapshots). Blocks until the engine thread has done it.
    pub fn flush_cache(&self, tier: Tier) -> Result<PoolUsage> {
        self.ask("dsv4_cache_flush", |tx| Control::FlushCache(tier, tx))
    }

    /// Per pool and tier: used / total units and bytes; hits, load-backs, backups and
    /// evictions (see docs/hicache.md). Blocks briefly (answered between steps).
    pub fn cache_stats(&self) -> Result<Value> {
        self.ask("dsv4_cache_stats", Control::CacheStats)
    }

    /// Counters, histograms and gauges at this instant. Never waits for the engine thread:
    /// pool gauges and cache counters are as of the last step.
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.shared.metrics.snapshot();
        let a = self.shared.admission();
        m.queued = a.queued_requests;
        m.queued_tokens = a.queued_tokens;
        drop(a);
        if let Some(node) = &self.pd {
            let s = node.stats();
            m.kv_transfer = KvTransfer {
                requests: s.transfers,
                bytes: s.bytes,
                seconds: s.seconds,
                failures: s.failures.iter().sum(),
                early_bytes: s.early_bytes,
                rma_bytes: s.rma_bytes,
            };
            m.transfer_latency = s.transfer_latency;
            m.transfer_bytes = s.transfer_bytes;
            m.claim_wait = s.claim_wait;
            let g = &mut m.pd;
            g.side = match node.side() {
                Side::Prefill => "prefill",
                Side::Decode => "decode",
            };
            if node.side() == Side::Prefill {
                g.prefill_bootstrap = s.bootstrapping;
                g.prefill_inflight = s.transferring;
            } else {
                g.decode_prealloc = s.bootstrapping;
                g.decode_transfer = s.transferring;
            }
            g.early_claims = s.early_claims;
            g.peers = s.peers;
            g.authenticated = u64::from(node.authenticated());
            g.failures = s.failures;
        }
        m
    }

    /// [`Self::metrics`] in the Prometheus text format, `metrics.labels` on every sample.
    pub fn prometheus(&self) -> String {
        let m = self.metrics();
        let health = self.health(&m);
        prometheus::render(&m, &self.params.metrics.labels, &health)
    }

    /// This scrape's node-health facts (see [`health::NodeHealth`]).
    fn health(&self, m: &MetricsSnapshot) -> health::NodeHealth {
        use crate::plan::numa::MemoryProbe;
        let node = self.plan.numa.node.as_ref().map_or(0, |n| n.index);
        let host_tier = [
            ("pages", m.pools.host_pages.total_bytes),
            ("snapshots", m.pools.host_snapshots.total_bytes),
        ]
        .into_iter()
        .filter(|&(_, bytes)| bytes > 0)
        .map(|(pool, bytes)| (node, pool, bytes))
        .collect();
        health::NodeHealth {
            state: self.state().0,
            since_last_step: self.shared.steps.since_last_step(),
            version: env!("CARGO_PKG_VERSION"),
            backend: match self.params.backend {
                BackendKind::Cpu => "cpu",
                BackendKind::Cuda => "cuda",
            },
            role: match self.params.role {
                Role::Unified => "unified",
                Role::Prefill => "prefill",
                Role::Decode => "decode",
            },
            resident_bytes: health::resident_bytes(),
            numa: crate::plan::numa::SystemProbe::new().nodes(),
            host_tier,
        }
    }

    /// Configuration summary, parameter count and resident bytes by dtype, with the thread
    /// count and weight dtype.
    pub fn model_info(&self) -> Value {
        self.model_info.clone()
    }

    /// The checkpoint's tokenizer and chat template (each call on it reports a missing file
    /// as [`ErrorKind::Unsupported`]).
    pub fn text(&self) -> &TextCodec {
        &self.text
    }

    fn check_tokens(&self, tokens: &[i32]) -> Result<Vec<u32>> {
        if tokens.is_empty() {
            return Err(Error::invalid_argument(
                "no tokens: pass at least one token id",
            ));
        }
        let limit = self.plan.max_context_tokens;
        if tokens.len() as u64 > limit {
            return Err(Error::invalid_argument(format!(
                "{} tokens exceed kv.max_context_tokens = {limit}",
                tokens.len()
            )));
        }
        let vocab = self.vocab_size();
        if let Some((i, id)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &id)| id < 0 || id as usize >= vocab)
        {
            return Err(Error::invalid_argument(format!(
                "token id {id} at position {i} is outside the vocabulary (ids 0..{vocab})"
            )));
        }
        Ok(tokens.iter().map(|&id| id as u32).collect())
    }
}

impl Drop for Engine {
    /// An abort shutdown: every request in flight gets its terminal event (callbacks see them;
    /// unpolled events are dropped), then the engine thread is joined.
    fn drop(&mut self) {
        if crate::threads::is_internal() {
            // Destroyed from a callback: stop it, but it cannot join itself.
            log::error!("engine destroyed from a dsv4 thread (a callback); its thread is detached");
            self.shared.inbox.shutdown(ShutdownMode::Abort);
            return;
        }
        let _ = self.shutdown(ShutdownMode::Abort, None);
        self.shared.sink.clear();
    }
}

/// The directory holding the checkpoint's files (`model_path` may name a file in it).
fn model_dir(model_path: &Path) -> &Path {
    if model_path.is_file() {
        model_path.parent().unwrap_or(Path::new("."))
    } else {
        model_path
    }
}

fn shutting_down() -> Error {
    Error::new(
        ErrorKind::Shutdown,
        "the engine is shutting down: it accepts no new requests",
    )
}

/// Parameters that are valid (they plan) but whose implementation has not landed yet.
fn refuse_unbuilt(p: &Params) -> Result<()> {
    let mut missing = Vec::new();
    if p.backend == BackendKind::Cuda {
        missing.push(crate::backend::cuda::not_ready(&p.devices));
    }
    if p.parallel.tp > 1 || p.parallel.ep > 1 {
        missing.push(
            "`parallel.tp` / `parallel.ep` > 1: multi-rank engines are not built yet; use 1".into(),
        );
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::from_problems(
            ErrorKind::Unsupported,
            "this dsv4 build",
            &missing,
        ))
    }
}
