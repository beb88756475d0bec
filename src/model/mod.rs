//! DeepSeek V4: weights and the forward pass, expressed only through the [`Backend`] trait.
//!
//! [`Model::load`] reads a checkpoint (official or Hugging Face naming; f32/bf16/f16, FP8 with
//! block scales, FP4 experts) and [`Model::forward`] runs one step over a batch of sequences,
//! each with its own new tokens and its place in the KV pools ([`crate::kv`]). Exact mode follows transformers 5.23.0.

mod diagnose;
mod forward;
pub mod rope;
pub mod tiny;
pub mod weights;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::backend::{Backend, Expert, Precision, WeightData, WeightFormat, WeightPart};
use crate::config::model::ScoringFunc;
use crate::config::params::{NumericsMode, WeightDtype};
use crate::config::tensors::{checkpoint_tensors, TensorSpec};
use crate::config::{AttentionKind, ModelConfig};
use crate::error::{Error, Result};
pub use diagnose::NonFinite;
pub use forward::{Chunk, Logits};
use weights::{Checkpoint, Loader};

/// The three parameters of one hyper-connection instance.
pub(crate) struct Hc<B: Backend> {
    fn_: B::Matrix,
    base: B::Tensor,
    scale: B::Tensor,
}

/// A compressor; its `wkv` and `wgate` projections live in the layer's `x_proj`.
pub(crate) struct Compressor<B: Backend> {
    ape: B::Tensor,
    norm: B::Tensor,
    ratio: usize,
    width: usize,
    overlap: bool,
}

/// The lightning indexer; its `wq_b` lives in `qr_proj`, its `weights_proj` and compressor
/// projections in `x_proj`.
pub(crate) struct Indexer<B: Backend> {
    compressor: Compressor<B>,
}

/// One attention. Projections that share an input are stacked by rows so a step reads each
/// input once and runs one product: `x_proj` = [wq_a; wkv; compressor wkv; compressor wgate;
/// indexer compressor wkv; indexer compressor wgate; indexer weights_proj] (the parts the layer
/// has), `qr_proj` = [wq_b; indexer wq_b].
pub(crate) struct Attention<B: Backend> {
    x_proj: B::Matrix,
    qr_proj: B::Matrix,
    q_norm: B::Tensor,
    kv_norm: B::Tensor,
    wo_a: B::Matrix,
    wo_b: B::Matrix,
    sinks: B::Tensor,
    compressor: Option<Compressor<B>>,
    indexer: Option<Indexer<B>>,
}

pub(crate) enum Router<B: Backend> {
    Hash(B::Index),
    TopK(Option<B::Tensor>),
}

/// One MoE. `x_proj` stacks the router gate and the shared expert's `[w1; w3]`.
pub(crate) struct Moe<B: Backend> {
    x_proj: B::Matrix,
    router: Router<B>,
    experts: Vec<Expert<B>>,
    /// The shared expert's `w2`.
    shared_w2: Option<B::Matrix>,
}

pub(crate) struct Block<B: Backend> {
    kind: AttentionKind,
    attn_norm: B::Tensor,
    ffn_norm: B::Tensor,
    attn_hc: Hc<B>,
    ffn_hc: Hc<B>,
    attn: Attention<B>,
    ffn: Moe<B>,
}

/// A multi-token-prediction block: loaded for speculative decoding, not run by `forward`.
pub(crate) struct Mtp<B: Backend> {
    #[allow(dead_code)]
    block: Block<B>,
    #[allow(dead_code)]
    e_proj: B::Matrix,
    #[allow(dead_code)]
    h_proj: B::Matrix,
    #[allow(dead_code)]
    norms: [B::Tensor; 3],
    #[allow(dead_code)]
    hc_head: Hc<B>,
}

/// A loaded DeepSeek V4 model.
pub struct Model<B: Backend> {
    pub config: ModelConfig,
    backend: Arc<B>,
    embed: B::Matrix,
    head: B::Matrix,
    norm: B::Tensor,
    hc_head: Hc<B>,
    blocks: Vec<Block<B>>,
    mtp: Vec<Mtp<B>>,
    rope_main: B::Rope,
    rope_compress: B::Rope,
    /// Resident bytes by kind ("f32", "bf16", "i32").
    bytes: BTreeMap<&'static str, u64>,
    parameters: u64,
    numerics: NumericsMode,
}

impl<B: Backend> Model<B> {
    /// Loads the checkpoint at `dir` for `config`, storing matrices at `weight_dtype`.
    pub fn load(
        dir: &Path,
        config: ModelConfig,
        backend: Arc<B>,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let ckpt = Checkpoint::open(dir)?;
        let precision = match weight_dtype.resolve(&config) {
            WeightDtype::F32 => Precision::F32,
            WeightDtype::Bf16 => Precision::Bf16,
            WeightDtype::Native | WeightDtype::Auto => Precision::Native,
        };
        let mut builder = Builder {
            loader: Loader::new(&ckpt, &config),
            backend: backend.as_ref(),
            precision,
            specs: checkpoint_tensors(&config)
                .into_iter()
                .map(|s| (s.name.clone(), s))
                .collect(),
            bytes: BTreeMap::new(),
            parameters: 0,
            failed: false,
            backend_error: None,
        };
        let model = builder.model(&config);
        let mtp = builder.mtp(&config);
        let (bytes, parameters) = (builder.bytes.clone(), builder.parameters);
        let naming = builder.loader.naming;
        // MTP tensors never make loading fail: a broken or absent MTP block only disables it.
        let backend_error = builder.backend_error.take();
        builder.loader.finish(&["mtp.", "model.mtp."])?;
        if let Some(e) = backend_error {
            return Err(e);
        }
        let Some(parts) = model else {
            return Err(Error::internal("checkpoint problems were not reported"));
        };
        let c = &config;
        let result = Self {
            rope_main: backend.rope(&rope::inv_freq(&c.main_rope, c.rope_head_dim))?,
            rope_compress: backend.rope(&rope::inv_freq(&c.compress_rope, c.rope_head_dim))?,
            embed: parts.0,
            head: parts.1,
            norm: parts.2,
            hc_head: parts.3,
            blocks: parts.4,
            mtp,
            bytes,
            parameters,
            config,
            backend,
            numerics: NumericsMode::Exact,
        };
        log::info!(
            "loaded {} ({:?} naming, {} parameters, {} MTP block(s)) from {} in {:.2} s",
            result.config.name,
            naming,
            result.parameters,
            result.mtp.len(),
            dir.display(),
            started.elapsed().as_secs_f64()
        );
        Ok(result)
    }

    /// Selects exact (transformers) or official (FP8 KV and FP4 indexer emulation) numerics.
    pub fn with_numerics(mut self, mode: NumericsMode) -> Self {
        self.numerics = mode;
        self
    }

    pub fn numerics(&self) -> NumericsMode {
        self.numerics
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, shared (KV pools live on the model's backend).
    pub fn backend_arc(&self) -> Arc<B> {
        Arc::clone(&self.backend)
    }

    /// MTP blocks loaded (0 when the checkpoint has none).
    pub fn mtp_blocks(&self) -> usize {
        self.mtp.len()
    }

    /// Configuration summary, parameter count and resident bytes by dtype.
    pub fn info(&self) -> Value {
        let c = &self.config;
        json!({
            "name": c.name,
            "config_form": c.form,
            "backend": self.backend.name(),
            "layers": c.num_layers,
            "layer_kinds": c.attention,
            "mlp_kinds": c.mlp,
            "mtp_layers_loaded": self.mtp.len(),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "num_heads": c.num_heads,
            "head_dim": c.head_dim,
            "sliding_window": c.sliding_window,
            "n_routed_experts": c.n_routed_experts,
            "n_activated_experts": c.n_activated_experts,
            "max_position_embeddings": c.max_position_embeddings,
            "parameters": self.parameters,
            "numerics": self.numerics,
            "bytes_by_dtype": self.bytes,
        })
    }
}

type Parts<B> = (
    <B as Backend>::Matrix,
    <B as Backend>::Matrix,
    <B as Backend>::Tensor,
    Hc<B>,
    Vec<Block<B>>,
);

/// Assembles backend objects from checked tensors; after the first problem it keeps reading
/// (to report every problem) but builds nothing.
struct Builder<'a, B: Backend> {
    loader: Loader<'a>,
    backend: &'a B,
    precision: Precision,
    specs: BTreeMap<String, TensorSpec>,
    bytes: BTreeMap<&'static str, u64>,
    parameters: u64,
    failed: bool,
    /// The first error the backend returned while building (an allocation, a format it
    /// refuses): reported as it is, not as a checkpoint problem.
    backend_error: Option<Error>,
}

impl<'a, B: Backend> Builder<'a, B> {
    fn spec(&self, name: &str) -> Option<&TensorSpec> {
        self.specs.get(name)
    }

    /// Reads a tensor; `scan` also refuses NaN and infinite values (small tensors only).
    fn read(&mut self, name: &str, scan: bool) -> Option<(Vec<f32>, Vec<usize>)> {
        let Some(spec) = self.spec(name).cloned() else {
            self.failed = true;
            return None;
        };
        let values = if scan {
            self.loader.finite_floats(&spec)
        } else {
            self.loader.floats(&spec)
        };
        match values {
            Some(v) if !self.failed => {
                self.parameters += spec.elements();
                Some((v, spec.shape))
            }
            _ => {
                self.failed = true;
                None
            }
        }
    }

    fn matrix_at(&mut self, name: &str, precision: Precision) -> Option<B::Matrix> {
        self.matrix_read(name, precision, false)
    }

    /// A tensor as stored (checkpoint format and raw bytes) with its column count.
    fn part(&mut self, name: &str) -> Option<(WeightPart<'a>, usize)> {
        let Some(spec) = self.spec(name).cloned() else {
            self.failed = true;
            return None;
        };
        match self.loader.part(&spec) {
            Some(p) if !self.failed => {
                self.parameters += spec.elements();
                Some(p)
            }
            _ => {
                self.failed = true;
                None
            }
        }
    }

    /// A matrix handed to the backend in its checkpoint format; `scan` (small matrices only)
    /// first refuses NaN and infinite values.
    fn matrix_read(&mut self, name: &str, precision: Precision, scan: bool) -> Option<B::Matrix> {
        if scan {
            let (values, shape) = self.read(name, true)?;
            let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
            let bytes: &[u8] = bytemuck::cast_slice(&values);
            let data = WeightData::whole(WeightFormat::F32, bytes, Vec::new(), rows, cols);
            return self.build(name, &data, precision);
        }
        let (part, cols) = self.part(name)?;
        let data = WeightData {
            cols,
            parts: vec![part],
        };
        self.build(name, &data, precision)
    }

    fn matrix(&mut self, name: &str) -> Option<B::Matrix> {
        self.matrix_at(name, self.precision)
    }

    /// Matrices with the same number of columns stacked by rows: `[a; b; …]`.
    fn stack(&mut self, names: &[String]) -> Option<B::Matrix> {
        let parts: Vec<Option<(WeightPart<'a>, usize)>> =
            names.iter().map(|n| self.part(n)).collect();
        let parts: Vec<(WeightPart<'a>, usize)> = parts.into_iter().collect::<Option<_>>()?;
        let cols = parts.first()?.1;
        if parts.iter().any(|(_, c)| *c != cols) {
            self.failed = true;
            return None;
        }
        let data = WeightData {
            cols,
            parts: parts.into_iter().map(|(p, _)| p).collect(),
        };
        self.build(&names[0], &data, self.precision)
    }

    /// The backend's matrix for `data` stored at `precision`, its bytes counted; a backend
    /// error is kept (the first one) and returned by `Model::load` with its message.
    fn build(
        &mut self,
        name: &str,
        data: &WeightData<'_>,
        precision: Precision,
    ) -> Option<B::Matrix> {
        match self.backend.matrix(data, precision) {
            Ok(m) => {
                for (dtype, bytes) in self.backend.matrix_bytes_by_dtype(&m) {
                    *self.bytes.entry(dtype).or_insert(0) += bytes as u64;
                }
                Some(m)
            }
            Err(e) => {
                self.backend_failed(name, e);
                None
            }
        }
    }

    /// Records the first backend error (with the tensor it was building) and fails the load.
    fn backend_failed(&mut self, name: &str, e: Error) {
        self.failed = true;
        if self.backend_error.is_none() {
            self.backend_error = Some(Error::new(
                e.kind(),
                format!("loading `{name}`: {}", e.message()),
            ));
        }
    }

    /// A small per-channel tensor (norm weight, bias, sink, position bias, hyper-connection
    /// base or scale), scanned for NaN and infinities at load.
    fn vector(&mut self, name: &str) -> Option<B::Tensor> {
        let (values, _) = self.read(name, true)?;
        *self.bytes.entry("f32").or_insert(0) += 4 * values.len() as u64;
        match self.backend.tensor(&values) {
            Ok(t) => Some(t),
            Err(e) => {
                self.backend_failed(name, e);
                None
            }
        }
    }

    fn hc(&mut self, fn_: &str, base: &str, scale: &str) -> Option<Hc<B>> {
        // Hyper-connection mixes stay f32 (transformers keeps them in fp32). They are small
        // ([(2 + hc)·hc, hc·hidden]) and mix every stream, so they are scanned too.
        let fn_ = self.matrix_read(fn_, Precision::F32, true);
        let base = self.vector(base);
        let scale = self.vector(scale);
        Some(Hc {
            fn_: fn_?,
            base: base?,
            scale: scale?,
        })
    }

    fn compressor(
        &mut self,
        p: &str,
        ratio: usize,
        width: usize,
        overlap: bool,
    ) -> Option<Compressor<B>> {
        let ape = self.vector(&format!("{p}ape"));
        let norm = self.vector(&format!("{p}norm.weight"));
        Some(Compressor {
            ape: ape?,
            norm: norm?,
            ratio,
            width,
            overlap,
        })
    }

    fn block(
        &mut self,
        p: &str,
        c: &ModelConfig,
        kind: AttentionKind,
        hash: bool,
    ) -> Option<Block<B>> {
        let attn_norm = self.vector(&format!("{p}attn_norm.weight"));
        let ffn_norm = self.vector(&format!("{p}ffn_norm.weight"));
        let attn_hc = self.hc(
            &format!("{p}hc_attn_fn"),
            &format!("{p}hc_attn_base"),
            &format!("{p}hc_attn_scale"),
        );
        let ffn_hc = self.hc(
            &format!("{p}hc_ffn_fn"),
            &format!("{p}hc_ffn_base"),
            &format!("{p}hc_ffn_scale"),
        );
        let a = format!("{p}attn.");
        let mut x_names = vec![format!("{a}wq_a.weight"), format!("{a}wkv.weight")];
        let mut qr_names = vec![format!("{a}wq_b.weight")];
        if kind != AttentionKind::Swa {
            x_names.push(format!("{a}compressor.wkv.weight"));
            x_names.push(format!("{a}compressor.wgate.weight"));
        }
        if kind == AttentionKind::Csa {
            x_names.push(format!("{a}indexer.compressor.wkv.weight"));
            x_names.push(format!("{a}indexer.compressor.wgate.weight"));
            x_names.push(format!("{a}indexer.weights_proj.weight"));
            qr_names.push(format!("{a}indexer.wq_b.weight"));
        }
        let x_proj = self.stack(&x_names);
        let qr_proj = self.stack(&qr_names);
        let q_norm = self.vector(&format!("{a}q_norm.weight"));
        let kv_norm = self.vector(&format!("{a}kv_norm.weight"));
        let wo_a = self.matrix(&format!("{a}wo_a.weight"));
        let wo_b = self.matrix(&format!("{a}wo_b.weight"));
        let sinks = self.vector(&format!("{a}attn_sink"));
        let compressor = match kind {
            AttentionKind::Swa => None,
            AttentionKind::Csa => {
                Some(self.compressor(&format!("{a}compressor."), c.csa_ratio, c.head_dim, true))
            }
            AttentionKind::Hca => {
                Some(self.compressor(&format!("{a}compressor."), c.hca_ratio, c.head_dim, false))
            }
        };
        let indexer = (kind == AttentionKind::Csa).then(|| {
            let compressor = self.compressor(
                &format!("{a}indexer.compressor."),
                c.csa_ratio,
                c.index_head_dim,
                true,
            );
            Some(Indexer {
                compressor: compressor?,
            })
        });
        let f = format!("{p}ffn.");
        let mut moe_names = vec![format!("{f}gate.weight")];
        if c.n_shared_experts > 0 {
            moe_names.push(format!("{f}shared_experts.w1.weight"));
            moe_names.push(format!("{f}shared_experts.w3.weight"));
        }
        let moe_proj = self.stack(&moe_names);
        let router = if hash {
            let name = format!("{f}gate.tid2eid");
            let spec = self.spec(&name).cloned();
            let table = spec.and_then(|s| self.loader.indices(&s, c.n_routed_experts));
            if table.is_none() {
                self.failed = true;
            }
            table.and_then(|t| {
                *self.bytes.entry("i32").or_insert(0) += 4 * t.len() as u64;
                match self.backend.index(&t) {
                    Ok(i) => Some(Router::Hash(i)),
                    Err(e) => {
                        self.backend_failed(&name, e);
                        None
                    }
                }
            })
        } else {
            self.vector(&format!("{f}gate.bias"))
                .map(|b| Router::TopK(Some(b)))
        };
        let experts: Vec<Option<Expert<B>>> = (0..c.n_routed_experts)
            .map(|e| {
                let ex = format!("{f}experts.{e}.");
                let w13 = self.stack(&[format!("{ex}w1.weight"), format!("{ex}w3.weight")]);
                let w2 = self.matrix(&format!("{ex}w2.weight"));
                Some(Expert { w13: w13?, w2: w2? })
            })
            .collect();
        let shared_w2 =
            (c.n_shared_experts > 0).then(|| self.matrix(&format!("{f}shared_experts.w2.weight")));
        Some(Block {
            kind,
            attn_norm: attn_norm?,
            ffn_norm: ffn_norm?,
            attn_hc: attn_hc?,
            ffn_hc: ffn_hc?,
            attn: Attention {
                x_proj: x_proj?,
                qr_proj: qr_proj?,
                q_norm: q_norm?,
                kv_norm: kv_norm?,
                wo_a: wo_a?,
                wo_b: wo_b?,
                sinks: sinks?,
                compressor: compressor.flatten_failure()?,
                indexer: indexer.flatten_failure()?,
            },
            ffn: Moe {
                x_proj: moe_proj?,
                router: router?,
                experts: experts.into_iter().collect::<Option<Vec<_>>>()?,
                shared_w2: shared_w2.flatten_failure()?,
            },
        })
    }

    fn model(&mut self, c: &ModelConfig) -> Option<Parts<B>> {
        let embed = self.matrix("embed.weight");
        let head = self.matrix("head.weight");
        let norm = self.vector("norm.weight");
        let hc_head = self.hc("hc_head_fn", "hc_head_base", "hc_head_scale");
        let blocks: Vec<Option<Block<B>>> = c
            .attention
            .iter()
            .zip(&c.mlp)
            .enumerate()
            .map(|(i, (&kind, &mlp))| {
                self.block(
                    &format!("layers.{i}."),
                    c,
                    kind,
                    mlp == crate::config::model::MlpKind::HashMoe,
                )
            })
            .collect();
        let blocks = blocks.into_iter().collect::<Option<Vec<_>>>();
        if self.failed {
            return None;
        }
        Some((embed?, head?, norm?, hc_head?, blocks?))
    }

    /// MTP blocks, when the checkpoint has them and they load cleanly.
    fn mtp(&mut self, c: &ModelConfig) -> Vec<Mtp<B>> {
        let mut loaded = Vec::new();
        for k in 0..c.num_mtp_layers {
            let p = format!("mtp.{k}.");
            let Some(probe) = self.spec(&format!("{p}e_proj.weight")).cloned() else {
                continue;
            };
            if !self.loader.has(&probe) {
                log::info!(
                    "checkpoint has no MTP block {k}: speculative decoding will be unavailable"
                );
                continue;
            }
            let failed_before = std::mem::replace(&mut self.failed, false);
            let mark = self.loader.problem_count();
            let block = self.block(&p, c, AttentionKind::Swa, false);
            let e_proj = self.matrix(&format!("{p}e_proj.weight"));
            let h_proj = self.matrix(&format!("{p}h_proj.weight"));
            let norms = [
                self.vector(&format!("{p}enorm.weight")),
                self.vector(&format!("{p}hnorm.weight")),
                self.vector(&format!("{p}norm.weight")),
            ];
            let hc_head = self.hc(
                &format!("{p}hc_head_fn"),
                &format!("{p}hc_head_base"),
                &format!("{p}hc_head_scale"),
            );
            let problems = self.loader.take_problems_since(mark);
            let ok = !self.failed;
            self.failed = failed_before;
            if !ok || !problems.is_empty() {
                log::warn!(
                    "MTP block {k} is unusable and is skipped ({}); the main model is unaffected",
                    problems.join("; ")
                );
                continue;
            }
            if let (
                Some(block),
                Some(e_proj),
                Some(h_proj),
                [Some(a), Some(b), Some(n)],
                Some(hc_head),
            ) = (block, e_proj, h_proj, norms, hc_head)
            {
                loaded.push(Mtp {
                    block,
                    e_proj,
                    h_proj,
                    norms: [a, b, n],
                    hc_head,
                });
            }
        }
        loaded
    }
}

/// For an optional part: `None` (absent) stays absent, `Some(None)` (failed to load) fails the
/// whole block, `Some(Some(v))` is present.
trait OptionalPart<T> {
    fn flatten_failure(self) -> Option<Option<T>>;
}

impl<T> OptionalPart<T> for Option<Option<T>> {
    fn flatten_failure(self) -> Option<Option<T>> {
        match self {
            None => Some(None),
            Some(None) => None,
            Some(Some(v)) => Some(Some(v)),
        }
    }
}

pub(crate) fn scoring(c: &ModelConfig) -> crate::backend::Scoring {
    match c.scoring_func {
        ScoringFunc::SqrtSoftplus => crate::backend::Scoring::SqrtSoftplus,
        ScoringFunc::Sigmoid => crate::backend::Scoring::Sigmoid,
        ScoringFunc::Softmax => crate::backend::Scoring::Softmax,
    }
}
