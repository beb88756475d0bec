//! Runs what the scheduler planned on one backend: the forward pass over the step's chunks,
//! sampling, TOKEN events and the step metrics. Also the engine's other model calls (scoring,
//! the non-finite diagnosis). The only part of the engine thread that touches the model.

use std::sync::Arc;
use std::time::Instant;

use super::event::{Event, EventStats, FinishReason, Origin};
use super::scheduler::{Running, StepPlan};
use super::shared::Shared;
use crate::backend::Backend;
use crate::error::{Error, ErrorKind, Result};
use crate::kv::{PrefixCache, Request};
use crate::model::{Chunk, Logits, Model, NonFinite};

/// How a request ends: its terminal event.
#[derive(Debug)]
pub enum End {
    Finished(FinishReason),
    Failed(Error),
}

/// A prefill engine's request that sampled its first token: its state goes to the decode.
pub struct HandOver {
    pub index: usize,
    /// The first token's log-probability (0 unless the request asked for logprobs).
    pub logprob: f32,
}

/// The time before a token: since submit for the first, since the previous one after.
pub enum Gap {
    First(std::time::Duration),
    Next(std::time::Duration),
}

/// What a step did.
pub enum StepOutcome {
    /// The forward pass ran; these running requests (by index) end, and these hand over
    /// (prefill role).
    Ran(Vec<(usize, End)>, Vec<HandOver>),
    /// The forward pass failed: every planned request ends with this error.
    Failed(Error),
}

pub struct Executor<B: Backend> {
    model: Arc<Model<B>>,
    eos: Vec<u32>,
    /// A prefill engine: PD requests hand over after their first sample.
    hands_over: bool,
}

pub fn micros(d: std::time::Duration) -> u64 {
    d.as_micros().min(u128::from(u64::MAX)) as u64
}

impl<B: Backend> Executor<B> {
    pub fn new(model: Arc<Model<B>>, hands_over: bool) -> Self {
        let eos = model.config.eos_token_ids.clone();
        Self {
            model,
            eos,
            hands_over,
        }
    }

    /// Runs `plan` over `running`: one forward pass, then for each request that samples, its
    /// token, TOKEN event and stop check. Admission books and the prefix cache's snapshots are
    /// brought up to date for every planned request.
    pub fn run(
        &self,
        plan: &StepPlan,
        running: &mut [Running<Request>],
        cache: &mut PrefixCache<B>,
        shared: &Shared,
    ) -> StepOutcome {
        let result = {
            // One disjoint borrow per planned request, in plan order.
            let mut seqs: Vec<(usize, &mut Running<Request>)> =
                running.iter_mut().enumerate().collect();
            let mut chunks = Vec::with_capacity(plan.items.len());
            for item in &plan.items {
                let slot = seqs
                    .iter()
                    .position(|(j, _)| *j == item.index)
                    .expect("planned once");
                let (_, r) = seqs.swap_remove(slot);
                let Running { req, p, .. } = r;
                chunks.push(Chunk {
                    tokens: &p.tokens[item.tokens.clone()],
                    seq: req.kv_mut(),
                    logits: if item.sample {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                });
            }
            let started = Instant::now();
            let result = self.model.forward(cache.pools_mut(), &mut chunks);
            let elapsed = started.elapsed();
            let computed = plan.tokens() as u64;
            shared.steps.stepped();
            shared.metrics.update(|m| {
                m.forward_steps += 1;
                m.forward_tokens += computed;
                m.step_time.observe_duration(elapsed);
            });
            result
        };
        let outputs = match result {
            Ok(o) => o,
            Err(e) => {
                log::error!("forward step failed: {e}");
                return StepOutcome::Failed(e);
            }
        };
        let mut ended = Vec::new();
        let mut handed = Vec::new();
        let mut itl = Vec::new();
        let mut ttft = Vec::new();
        let mut new_tokens = 0u64;
        for (item, logits) in plan.items.iter().zip(outputs) {
            let r = &mut running[item.index];
            r.recount(&shared.admission);
            let pos = r.req.position();
            if let Err(e) = cache.after_step(&mut r.req, &r.p.tokens[..pos]) {
                log::error!("request {}: prefix cache: {e}", r.id);
            }
            if logits.is_empty() {
                continue;
            }
            // One pass over the sampled rows only (not per layer): a NaN or inf here would be
            // sampled as some token and the request would "finish" normally with garbage.
            if logits.iter().any(|v| !v.is_finite()) {
                ended.push((
                    item.index,
                    End::Failed(nonfinite_logits(r.id, pos, &logits)),
                ));
                continue;
            }
            let (token, logprob) = r.p.sampler.sample(&logits);
            if self.hands_over && r.spec.pd_room != 0 {
                // A prefill engine's request: its first token goes to the decode engine with
                // the state; no TOKEN event here.
                r.p.tokens.push(token);
                r.p.generated += 1;
                handed.push(HandOver {
                    index: item.index,
                    logprob: if r.spec.logprobs { logprob } else { 0.0 },
                });
                continue;
            }
            new_tokens += 1;
            let (end, timing) = self.deliver(r, token, logprob, shared);
            match timing {
                Gap::First(d) => ttft.push(d),
                Gap::Next(d) => itl.push(d),
            }
            if let Some(end) = end {
                ended.push((item.index, end));
            }
        }
        shared.metrics.update(|m| {
            m.generation_tokens += new_tokens;
            for d in ttft {
                m.ttft.observe_duration(d);
            }
            for d in itl {
                m.itl.observe_duration(d);
            }
        });
        StepOutcome::Ran(ended, handed)
    }

    /// Takes sampled `token` into running request `r`: its tokens, phase and timings, its
    /// TOKEN event, and how it ends if this token ends it. Returns that and the time since the
    /// previous token (or since submit, for the first) for the step's metrics.
    pub fn deliver(
        &self,
        r: &mut Running<Request>,
        token: u32,
        logprob: f32,
        shared: &Shared,
    ) -> (Option<End>, Gap) {
        r.p.tokens.push(token);
        r.p.generated += 1;
        if !r.decoding() {
            r.set_phase(super::phase::Phase::Decoding);
        }
        let now = Instant::now();
        let gap = match r.p.last_token {
            Some(last) => Gap::Next(now - last),
            None => Gap::First(now - r.submitted),
        };
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
        shared
            .sink
            .emit(Event::token(origin, token, logprob, stats));
        let generated = &r.p.tokens[r.p.tokens.len() - r.p.generated..];
        let eos = !r.spec.ignore_eos && self.eos.contains(&token);
        let end = if eos
            || r.spec.stop_tokens.contains(&token)
            || r.spec.ends_with_stop_sequence(generated)
        {
            Some(End::Finished(FinishReason::Stop))
        } else if r.p.generated >= r.max_gen {
            Some(End::Finished(FinishReason::Length))
        } else {
            None
        };
        (end, gap)
    }

    /// Nothing to compute: the backend may give back working memory unused for a while.
    pub fn release_idle_memory(&self) {
        self.model.backend().release_idle_memory();
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Logits of every position of one fresh sequence (`dsv4_score`), cached prefixes giving
    /// way when the pages run short.
    pub fn score(&self, cache: &mut PrefixCache<B>, tokens: &[u32]) -> Result<Vec<f32>> {
        let pools = cache.pools_mut();
        let mut seq = pools.open()?;
        let mut result = pools.reserve(&mut seq, tokens.len());
        if result.is_err() {
            cache.evict(cache.pools().pages_for(tokens.len()), 0);
            result = cache.pools_mut().reserve(&mut seq, tokens.len());
        }
        let pools = cache.pools_mut();
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
        cache.pools_mut().close(seq);
        Ok(out?.remove(0))
    }

    /// Re-runs `tokens` with a finite check after every layer sub-step and names the first
    /// layer and weights that produced a non-finite value (`None`: every layer stayed finite).
    pub fn diagnose(
        &self,
        cache: &mut PrefixCache<B>,
        tokens: &[u32],
        chunk: usize,
    ) -> Result<Option<NonFinite>> {
        let mut diagnosis = self
            .model
            .diagnose_nonfinite(cache.pools_mut(), tokens, chunk);
        if matches!(&diagnosis, Err(e) if e.kind() == ErrorKind::Capacity) {
            // Cached prefixes give way to the diagnosis, as they do to scoring.
            cache.evict(cache.pools().pages_for(tokens.len()), 0);
            diagnosis = self
                .model
                .diagnose_nonfinite(cache.pools_mut(), tokens, chunk);
        }
        diagnosis
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
