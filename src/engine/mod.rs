//! The engine a host embeds. Today: creation (params validated, plan checked against this
//! machine, weights loaded on the CPU backend) and scoring of single sequences; the request
//! path (queues, scheduler, sampling, events) builds on it.

use std::path::Path;
use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::backend::cpu::CpuBackend;
use crate::config::params::{Backend as BackendKind, Params, Role};
use crate::error::{Error, ErrorKind, Result};
use crate::kv::KvPools;
use crate::model::{Chunk, Logits, Model};
use crate::plan::{self, Plan};

/// A loaded engine. Thread-safe: every method takes `&self`.
pub struct Engine {
    params: Params,
    plan: Plan,
    model: Model<CpuBackend>,
    kv: Mutex<KvPools<CpuBackend>>,
}

impl Engine {
    /// Validates `params`, checks the plan fits this machine and loads the model.
    pub fn create(params: Params) -> Result<Self> {
        refuse_unbuilt(&params)?;
        let plan = plan::plan(&params)?;
        if !plan.numa.fits {
            return Err(Error::new(ErrorKind::Capacity, plan.numa.reason.clone()));
        }
        let path = params
            .model_path
            .as_deref()
            .ok_or_else(|| Error::config("`model_path` is not set"))?;
        let backend = Arc::new(CpuBackend::new(params.threads as usize)?);
        log::info!(
            "creating engine: {} on the cpu backend with {} threads",
            plan.model.name,
            backend.threads()
        );
        let model = Model::load(
            Path::new(path),
            plan.model.clone(),
            backend.clone(),
            params.model.weight_dtype,
        )?
        .with_numerics(params.numerics.mode);
        let kv = KvPools::new(backend, &plan)?;
        Ok(Self {
            params,
            plan,
            model,
            kv: Mutex::new(kv),
        })
    }

    pub fn params(&self) -> &Params {
        &self.params
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config.vocab_size
    }

    /// Logits of every position of one fresh sequence, `[tokens.len(), vocab]` row-major.
    pub fn score(&self, tokens: &[i32]) -> Result<Vec<f32>> {
        let ids = self.check_tokens(tokens)?;
        let mut kv = self
            .kv
            .lock()
            .map_err(|_| Error::internal("the KV pools were poisoned by an earlier panic"))?;
        let mut seq = kv.open()?;
        let result = kv.reserve(&mut seq, ids.len()).and_then(|()| {
            self.model.forward(
                &mut kv,
                &mut [Chunk {
                    tokens: &ids,
                    seq: &mut seq,
                    logits: Logits::All,
                }],
            )
        });
        kv.close(seq);
        Ok(result?.remove(0))
    }

    /// Configuration summary, parameter count and resident bytes by dtype.
    pub fn model_info(&self) -> Value {
        let mut info = self.model.info();
        info["threads"] = self.model.backend().threads().into();
        info["weight_dtype"] =
            serde_json::to_value(self.params.model.weight_dtype).unwrap_or_default();
        info
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

/// Parameters that are valid (they plan) but whose implementation has not landed yet.
fn refuse_unbuilt(p: &Params) -> Result<()> {
    let mut missing = Vec::new();
    if p.backend == BackendKind::Cuda {
        missing.push("`backend` = cuda: the CUDA backend is not built yet; use cpu".to_string());
    }
    if p.role != Role::Unified {
        missing.push(
            "`role` = prefill/decode: PD disaggregation is not built yet; use unified".into(),
        );
    }
    if p.parallel.tp > 1 || p.parallel.ep > 1 {
        missing.push(
            "`parallel.tp` / `parallel.ep` > 1: multi-rank engines are not built yet; use 1".into(),
        );
    }
    if p.hicache.enabled {
        missing.push("`hicache.enabled`: the host tier is not built yet; set it to false".into());
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
