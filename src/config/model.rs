//! DeepSeek V4 `config.json`, in either of its two published forms:
//!
//! * Hugging Face (`hidden_size`, `num_hidden_layers`, `layer_types` or legacy `compress_ratios`,
//!   `mlp_layer_types` or `num_hash_layers`, `rope_parameters` or legacy `rope_scaling`, …);
//! * the official inference form (`dim`, `n_layers`, `compress_ratios`, `n_hash_layers`,
//!   `rope_factor`, `original_seq_len`, …).
//!
//! Both normalise to one [`ModelConfig`]. Every problem in the file is collected and reported at
//! once. One pitfall is refused rather than guessed: with neither `layer_types` nor
//! `compress_ratios`, transformers silently builds `[HCA, HCA, HCA, CSA, …]`, which is not the
//! official layer order (docs/model.md §1.2).

use std::io::Read;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use super::json::parse_strict;
use super::problems_error;
use super::size::{describe, shorten};
use crate::error::{Error, ErrorKind, Result};

/// The largest config.json accepted, in bytes (a DeepSeek V4 one is about 3 KB).
pub const MAX_CONFIG_BYTES: usize = 1 << 20;

/// The largest value accepted for each config.json integer that sizes a loop or an allocation,
/// by its first (Hugging Face) name; docs/params.md lists them. Each is at least 8× the largest
/// published DeepSeek V4 value (in parentheses), so a real checkpoint never meets one, while a
/// corrupt or hostile file cannot make dsv4 loop for minutes (`hc_sinkhorn_iters` = 10⁹) or
/// allocate by a number of its choosing (`num_hidden_layers` = 10¹²).
pub const INT_LIMITS: &[(&str, u64)] = &[
    ("vocab_size", 1 << 24),              // 129,280
    ("hidden_size", 65_536),              // 7,168
    ("num_hidden_layers", 1024),          // 61
    ("num_attention_heads", 1024),        // 128
    ("head_dim", 4096),                   // 512
    ("qk_rope_head_dim", 4096),           // 64
    ("q_lora_rank", 65_536),              // 1,536
    ("o_groups", 1024),                   // 16
    ("o_lora_rank", 65_536),              // 1,024
    ("sliding_window", 65_536),           // 128
    ("num_nextn_predict_layers", 16),     // 1
    ("index_n_heads", 1024),              // 64
    ("index_head_dim", 4096),             // 128
    ("index_topk", 65_536),               // 1,024
    ("n_routed_experts", 8192),           // 384
    ("num_experts_per_tok", 8192),        // 6
    ("n_shared_experts", 64),             // 1
    ("moe_intermediate_size", 65_536),    // 3,072
    ("hc_mult", 64),                      // 4
    ("hc_sinkhorn_iters", 1000),          // 20
    ("max_position_embeddings", 1 << 32), // 1,048,576
    ("original_seq_len", 1 << 32),        // 65,536
    ("weight_block_size", 65_536),        // 128
];

/// The most end-of-sequence ids (every decode step compares the sampled token with each).
pub const MAX_EOS_IDS: usize = 64;

/// Ranges of the config.json floats whose bad values give NaN or nonsense silently.
pub const EPS_RANGE: RangeInclusive<f64> = 1e-12..=0.1;

fn int_limit(key: &str) -> u64 {
    INT_LIMITS
        .iter()
        .find(|(name, _)| *name == key)
        .map_or(u64::MAX, |&(_, max)| max)
}

/// Attention variant of one layer (docs/model.md §2.10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Sliding window only (compress ratio 0).
    Swa,
    /// Compressed sparse attention: overlapping ratio-4 compressor + lightning indexer top-k.
    Csa,
    /// Heavily compressed attention: disjoint ratio-128 compressor, all rows attended.
    Hca,
}

impl AttentionKind {
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Swa => "sliding_attention",
            Self::Csa => "compressed_sparse_attention",
            Self::Hca => "heavily_compressed_attention",
        }
    }
}

/// Expert routing of one layer's MoE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// Experts picked by the fixed token-id table `tid2eid`.
    HashMoe,
    /// Experts picked by top-k over scores + bias.
    Moe,
}

/// Which `config.json` dialect the file was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConfigForm {
    HuggingFace,
    Official,
}

/// Router score function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoringFunc {
    SqrtSoftplus,
    Sigmoid,
    Softmax,
}

/// YaRN frequency interpolation (no magnitude scaling: DeepSeek V4 forces it to 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
}

/// One RoPE frequency set: `main` (SWA layers, MTP) or `compress` (layers with a compressor).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rope {
    pub theta: f64,
    pub yarn: Option<Yarn>,
}

/// How dense linear weights are stored in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "format")]
pub enum DenseFormat {
    F32,
    Bf16,
    F16,
    /// `float8_e4m3fn` with one `float8_e8m0fnu` scale per `block[0] × block[1]` tile.
    Fp8Block {
        block: [usize; 2],
    },
}

/// How routed experts are stored in the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "format")]
pub enum ExpertFormat {
    /// Same as the dense linears.
    Dense,
    /// e2m1 packed two per byte (element 2j in the low nibble), one e8m0 scale per `block` inputs.
    Fp4 { block: usize },
}

/// A normalised DeepSeek V4 model configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    /// A display name: `_name_or_path` or the checkpoint directory's name.
    pub name: String,
    pub form: ConfigForm,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Main decoder blocks (MTP not counted).
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    /// RoPE covers the last `rope_head_dim` channels of every head.
    pub rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    /// Raw attention window in tokens, including the current token.
    pub sliding_window: usize,
    /// Per main layer.
    pub attention: Vec<AttentionKind>,
    /// Per main layer.
    pub mlp: Vec<MlpKind>,
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub num_mtp_layers: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub n_activated_experts: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub scoring_func: ScoringFunc,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    pub swiglu_limit: f64,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub rms_norm_eps: f64,
    pub main_rope: Rope,
    pub compress_rope: Rope,
    pub max_position_embeddings: u64,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub dense_format: DenseFormat,
    pub expert_format: ExpertFormat,
    /// Storage of the unquantised tensors (embeddings, norms, compressor projections, …).
    pub unquantized_dtype: DenseFormat,
}

impl ModelConfig {
    /// Reads `config.json` from a checkpoint directory (or the file itself).
    pub fn load(model_path: &Path) -> Result<Self> {
        let file = config_file(model_path)?;
        // Read at most one byte past the cap: a huge (or endless) file costs no more than that,
        // and from_json_str reports the size.
        let mut bytes = Vec::new();
        std::fs::File::open(&file)
            .and_then(|f| f.take(MAX_CONFIG_BYTES as u64 + 1).read_to_end(&mut bytes))
            .map_err(|e| {
                Error::io(format!(
                    "cannot read {}: {e}: check the file's permissions",
                    file.display()
                ))
            })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            Error::model_format(format!(
                "{} is not valid UTF-8 (invalid byte at offset {}): it is not a config.json",
                file.display(),
                e.valid_up_to()
            ))
        })?;
        let fallback_name = file
            .parent()
            .and_then(|dir| dir.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "deepseek-v4".into());
        Self::from_json_str(text, &fallback_name)
            .map_err(|e| Error::new(e.kind(), format!("{}: {}", file.display(), e.message())))
    }

    /// Parses the text of a `config.json`; `fallback_name` names the model when the file does not.
    pub fn from_json_str(text: &str, fallback_name: &str) -> Result<Self> {
        if text.len() > MAX_CONFIG_BYTES {
            return Err(Error::model_format(format!(
                "config.json is {} bytes; the limit is {MAX_CONFIG_BYTES} bytes (1 MiB) and a \
                 DeepSeek V4 config.json is about 3 KB: this is not a config.json",
                text.len()
            )));
        }
        // Duplicate keys are refused (not last-wins) and invalid JSON says where; both name the
        // file's problem as a model-format error, like every other config.json problem.
        let value = parse_strict(text).map_err(|e| Error::model_format(e.to_string()))?;
        let Value::Object(obj) = value else {
            return Err(Error::model_format(format!(
                "expected a JSON object, got {}",
                describe(&value)
            )));
        };
        let mut reader = Reader {
            obj: &obj,
            problems: Vec::new(),
        };
        let config = parse(&mut reader, fallback_name);
        if reader.problems.is_empty() {
            Ok(config)
        } else {
            Err(problems_error(
                ErrorKind::ModelFormat,
                "DeepSeek V4 config.json",
                &reader.problems,
            ))
        }
    }

    /// Number of main layers of an attention kind.
    pub fn count(&self, kind: AttentionKind) -> usize {
        self.attention.iter().filter(|&&k| k == kind).count()
    }

    /// Compression ratio of an attention kind (0 for SWA).
    pub fn ratio(&self, kind: AttentionKind) -> usize {
        match kind {
            AttentionKind::Swa => 0,
            AttentionKind::Csa => self.csa_ratio,
            AttentionKind::Hca => self.hca_ratio,
        }
    }

    /// Width of the non-rotary part of a head.
    pub fn nope_head_dim(&self) -> usize {
        self.head_dim - self.rope_head_dim
    }
}

fn config_file(model_path: &Path) -> Result<PathBuf> {
    if model_path.is_file() {
        return Ok(model_path.to_path_buf());
    }
    let file = model_path.join("config.json");
    if file.is_file() {
        Ok(file)
    } else if model_path.is_dir() {
        Err(Error::io(format!(
            "model_path `{}` has no config.json: point model_path at a DeepSeek V4 checkpoint \
             directory (or at configs/deepseek-v4-flash to plan without weights)",
            model_path.display()
        )))
    } else {
        Err(Error::io(format!(
            "model_path `{}` does not exist: point it at a DeepSeek V4 checkpoint directory \
             (or at configs/deepseek-v4-flash to plan without weights)",
            model_path.display()
        )))
    }
}

/// Field access that records a problem instead of failing at the first one.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
    problems: Vec<String>,
}

impl<'a> Reader<'a> {
    /// The first of `keys` present with a non-null value.
    fn find(&self, keys: &[&'static str]) -> Option<(&'static str, &'a Value)> {
        keys.iter()
            .find_map(|&k| self.obj.get(k).filter(|v| !v.is_null()).map(|v| (k, v)))
    }

    fn has(&self, keys: &[&'static str]) -> bool {
        self.find(keys).is_some()
    }

    fn problem(&mut self, text: impl Into<String>) {
        self.problems.push(text.into());
    }

    fn missing(&mut self, keys: &[&'static str]) {
        let names: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
        self.problem(format!(
            "{} is missing: DeepSeek V4 configs must set it",
            names.join(" (or ") + &")".repeat(names.len() - 1)
        ));
    }

    fn uint(&mut self, keys: &[&'static str], default: Option<u64>) -> u64 {
        match self.find(keys) {
            Some((key, value)) => match value.as_u64() {
                Some(n) => n,
                None => {
                    let shown = describe(value);
                    self.problem(format!(
                        "`{key}` must be a non-negative integer, got {shown}"
                    ));
                    0
                }
            },
            None => default.unwrap_or_else(|| {
                self.missing(keys);
                0
            }),
        }
    }

    /// Like [`Self::uint`], and the value must be at least 1.
    fn positive(&mut self, keys: &[&'static str], default: Option<u64>) -> usize {
        self.bounded(keys, default, 1)
    }

    /// Like [`Self::uint`], at least `min` and at most the key's [`INT_LIMITS`] entry. A value
    /// out of range is reported and read as 0, so nothing later sizes a loop or an allocation by
    /// it (the config is refused anyway).
    fn bounded(&mut self, keys: &[&'static str], default: Option<u64>, min: u64) -> usize {
        let before = self.problems.len();
        let n = self.uint(keys, default);
        let Some((key, _)) = self.find(keys).filter(|_| self.problems.len() == before) else {
            return n as usize;
        };
        let max = int_limit(keys[0]);
        if n < min {
            self.problem(format!("`{key}` must be at least {min}, got {n}"));
            0
        } else if n > max {
            self.problem(format!(
                "`{key}` = {n} is above the maximum {max} that dsv4 accepts (the published \
                 DeepSeek V4 models stay far below it): the file is corrupt or not a DeepSeek V4 \
                 config.json"
            ));
            0
        } else {
            n as usize
        }
    }

    /// Like [`Self::float`], within `range`.
    fn float_in(
        &mut self,
        keys: &[&'static str],
        default: Option<f64>,
        range: RangeInclusive<f64>,
        why: &str,
    ) -> f64 {
        let before = self.problems.len();
        let x = self.float(keys, default);
        match self.find(keys) {
            Some((key, _)) if self.problems.len() == before && !range.contains(&x) => {
                self.problem(format!(
                    "`{key}` = {x:?} is out of range: it must be between {:?} and {:?} ({why})",
                    range.start(),
                    range.end()
                ));
                *range.start()
            }
            _ => x,
        }
    }

    /// Like [`Self::float`], and finite and greater than zero.
    fn positive_float(&mut self, keys: &[&'static str], default: Option<f64>, why: &str) -> f64 {
        let before = self.problems.len();
        let x = self.float(keys, default);
        match self.find(keys) {
            Some((key, _)) if self.problems.len() == before && x <= 0.0 => {
                self.problem(format!("`{key}` = {x:?} must be greater than 0 ({why})"));
                1.0
            }
            _ => x,
        }
    }

    fn float(&mut self, keys: &[&'static str], default: Option<f64>) -> f64 {
        match self.find(keys) {
            Some((key, value)) => match value.as_f64() {
                Some(x) if x.is_finite() => x,
                _ => {
                    let shown = describe(value);
                    self.problem(format!("`{key}` must be a number, got {shown}"));
                    0.0
                }
            },
            None => default.unwrap_or_else(|| {
                self.missing(keys);
                0.0
            }),
        }
    }

    fn boolean(&mut self, keys: &[&'static str], default: bool) -> bool {
        match self.find(keys) {
            Some((key, value)) => value.as_bool().unwrap_or_else(|| {
                let shown = describe(value);
                self.problem(format!("`{key}` must be true or false, got {shown}"));
                default
            }),
            None => default,
        }
    }

    fn string(&mut self, keys: &[&'static str]) -> Option<String> {
        let (key, value) = self.find(keys)?;
        match value.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let shown = describe(value);
                self.problem(format!("`{key}` must be a string, got {shown}"));
                None
            }
        }
    }
}

fn parse(r: &mut Reader<'_>, fallback_name: &str) -> ModelConfig {
    let form = if r.has(&["hidden_size", "num_hidden_layers"]) {
        ConfigForm::HuggingFace
    } else {
        ConfigForm::Official
    };
    if let Some(model_type) = r.string(&["model_type"]) {
        if model_type != "deepseek_v4" {
            r.problem(format!(
                "`model_type` is \"{}\": dsv4 serves DeepSeek V4 (\"deepseek_v4\") only",
                shorten(&model_type)
            ));
        }
    }
    if let Some((key, value)) = r.find(&["num_key_value_heads"]) {
        if value.as_u64() != Some(1) {
            let shown = describe(value);
            r.problem(format!(
                "`{key}` is {shown}: DeepSeek V4 attention has exactly one shared K=V head"
            ));
        }
    }

    let name = r
        .string(&["_name_or_path"])
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| fallback_name.to_string());
    let vocab_size = r.positive(&["vocab_size"], None);
    let hidden_size = r.positive(&["hidden_size", "dim"], None);
    let num_layers = r.positive(&["num_hidden_layers", "n_layers"], None);
    let num_heads = r.positive(&["num_attention_heads", "n_heads"], None);
    let head_dim = r.positive(&["head_dim"], Some(512));
    let rope_head_dim = if r.has(&["qk_rope_head_dim", "rope_head_dim"]) {
        r.positive(&["qk_rope_head_dim", "rope_head_dim"], None)
    } else if r.has(&["partial_rotary_factor"]) {
        let factor = r.float_in(
            &["partial_rotary_factor"],
            None,
            1e-3..=1.0,
            "the share of each head's channels that RoPE rotates",
        );
        (head_dim as f64 * factor).round() as usize
    } else {
        64
    };
    let q_lora_rank = r.positive(&["q_lora_rank"], None);
    let o_groups = r.positive(&["o_groups"], None);
    let o_lora_rank = r.positive(&["o_lora_rank"], None);
    let sliding_window = r.positive(&["sliding_window", "window_size"], Some(128));
    let num_mtp_layers = r.bounded(&["num_nextn_predict_layers", "n_mtp_layers"], Some(1), 0);
    let index_n_heads = r.positive(&["index_n_heads"], None);
    let index_head_dim = r.positive(&["index_head_dim"], None);
    let index_topk = r.positive(&["index_topk"], None);
    let n_routed_experts = r.positive(&["n_routed_experts", "num_local_experts"], None);
    let n_activated_experts = r.positive(&["num_experts_per_tok", "n_activated_experts"], None);
    let n_shared_experts = r.bounded(&["n_shared_experts"], Some(1), 0);
    let moe_intermediate_size = r.positive(&["moe_intermediate_size", "moe_inter_dim"], None);
    let scoring_func = match r
        .string(&["scoring_func", "score_func"])
        .as_deref()
        .unwrap_or("sqrtsoftplus")
    {
        "sqrtsoftplus" => ScoringFunc::SqrtSoftplus,
        "sigmoid" => ScoringFunc::Sigmoid,
        "softmax" => ScoringFunc::Softmax,
        other => {
            r.problem(format!(
                "`scoring_func` \"{}\" is unknown: use sqrtsoftplus, sigmoid or softmax",
                shorten(other)
            ));
            ScoringFunc::SqrtSoftplus
        }
    };
    let norm_topk_prob = r.boolean(&["norm_topk_prob"], true);
    let routed_scaling_factor = r.positive_float(
        &["routed_scaling_factor", "route_scale"],
        Some(1.0),
        "it scales the routed experts' output; DeepSeek V4 uses 1.5 or 2.5",
    );
    let swiglu_limit = r.float(&["swiglu_limit"], Some(0.0));
    if swiglu_limit < 0.0 {
        r.problem(format!(
            "`swiglu_limit` = {swiglu_limit:?} is negative: use 0 (no clamp) or a positive clamp \
             such as DeepSeek V4's 10.0"
        ));
    }
    let hc_mult = r.positive(&["hc_mult"], Some(4));
    let hc_sinkhorn_iters = r.positive(&["hc_sinkhorn_iters"], Some(20));
    // A zero, negative or tiny epsilon divides by zero (or by a negative) on an all-zero row
    // and turns the logits into NaN without any error; DeepSeek V4 uses 1e-6.
    let hc_eps = r.float_in(&["hc_eps"], Some(1e-6), EPS_RANGE, "DeepSeek V4 uses 1e-6");
    let rms_norm_eps = r.float_in(
        &["rms_norm_eps", "norm_eps"],
        Some(1e-6),
        EPS_RANGE,
        "DeepSeek V4 uses 1e-6",
    );
    let (csa_ratio, hca_ratio) = compress_rates(r);
    let attention = attention_kinds(r, num_layers, num_mtp_layers, csa_ratio, hca_ratio);
    let mlp = mlp_kinds(r, form, num_layers);
    let (main_rope, compress_rope) = ropes(r, form);
    let max_position_embeddings = max_positions(r, &compress_rope);
    let bos_token_id = token_ids(r, "bos_token_id").first().copied();
    let mut eos_token_ids = token_ids(r, "eos_token_id");
    if eos_token_ids.is_empty() && !r.has(&["eos_token_id"]) {
        // The DeepSeek vocabulary's end of sentence; the official config.json omits it.
        eos_token_ids.push(1);
    }
    let (dense_format, expert_format, unquantized_dtype) = weight_formats(r, form);

    let config = ModelConfig {
        name,
        form,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        head_dim,
        rope_head_dim,
        q_lora_rank,
        o_groups,
        o_lora_rank,
        sliding_window,
        attention,
        mlp,
        csa_ratio,
        hca_ratio,
        num_mtp_layers,
        index_n_heads,
        index_head_dim,
        index_topk,
        n_routed_experts,
        n_activated_experts,
        n_shared_experts,
        moe_intermediate_size,
        scoring_func,
        norm_topk_prob,
        routed_scaling_factor,
        swiglu_limit,
        hc_mult,
        hc_sinkhorn_iters,
        hc_eps,
        rms_norm_eps,
        main_rope,
        compress_rope,
        max_position_embeddings,
        bos_token_id,
        eos_token_ids,
        dense_format,
        expert_format,
        unquantized_dtype,
    };
    check_consistency(r, &config);
    config
}

/// The CSA and HCA compression ratios: HF's `compress_rates` map, or the official 4 and 128.
fn compress_rates(r: &mut Reader) -> (usize, usize) {
    let mut rates = (4, 128);
    if let Some((_, value)) = r.find(&["compress_rates"]) {
        let Some(map) = value.as_object() else {
            let shown = describe(value);
            r.problem(format!("`compress_rates` must be an object, got {shown}"));
            return rates;
        };
        for (name, rate) in map {
            let Some(rate) = rate.as_u64().filter(|&n| n > 0) else {
                r.problem(format!(
                    "`compress_rates.{name}` must be a positive integer, got {}",
                    describe(rate)
                ));
                continue;
            };
            match name.as_str() {
                "compressed_sparse_attention" => rates.0 = rate as usize,
                "heavily_compressed_attention" => rates.1 = rate as usize,
                other => r.problem(format!(
                    "`compress_rates` names an unknown layer type \"{}\": use \
                     compressed_sparse_attention or heavily_compressed_attention",
                    shorten(other)
                )),
            }
        }
    }
    for (name, rate) in [("CSA", rates.0), ("HCA", rates.1)] {
        if 128 % rate != 0 {
            r.problem(format!(
                "{name} compression ratio {rate} does not divide 128: dsv4 pages are multiples \
                 of 128 tokens and hold whole compressed rows"
            ));
        }
    }
    if rates.0 == rates.1 {
        r.problem(format!(
            "CSA and HCA share compression ratio {}: `compress_ratios` could not tell them apart",
            rates.0
        ));
    }
    rates
}

fn attention_kinds(
    r: &mut Reader,
    num_layers: usize,
    num_mtp: usize,
    csa_ratio: usize,
    hca_ratio: usize,
) -> Vec<AttentionKind> {
    let from_types = match r.find(&["layer_types"]) {
        Some((_, Value::Array(items))) => {
            let kinds: Vec<Option<AttentionKind>> = items
                .iter()
                .enumerate()
                .map(|(i, item)| match item.as_str() {
                    Some("sliding_attention") => Some(AttentionKind::Swa),
                    Some("compressed_sparse_attention") => Some(AttentionKind::Csa),
                    Some("heavily_compressed_attention") => Some(AttentionKind::Hca),
                    _ => {
                        r.problem(format!(
                            "`layer_types[{i}]` is {}: use sliding_attention, \
                             compressed_sparse_attention or heavily_compressed_attention",
                            describe(item)
                        ));
                        None
                    }
                })
                .collect();
            Some(
                kinds
                    .into_iter()
                    .map(|k| k.unwrap_or(AttentionKind::Swa))
                    .collect::<Vec<_>>(),
            )
        }
        Some((_, other)) => {
            let shown = describe(other);
            r.problem(format!("`layer_types` must be an array, got {shown}"));
            None
        }
        None => None,
    };
    let from_ratios = match r.find(&["compress_ratios"]) {
        Some((_, Value::Array(items))) => Some(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item.as_u64() {
                    Some(0) => AttentionKind::Swa,
                    Some(n) if n as usize == csa_ratio => AttentionKind::Csa,
                    Some(n) if n as usize == hca_ratio => AttentionKind::Hca,
                    _ => {
                        r.problem(format!(
                            "`compress_ratios[{i}]` is {}: use 0 (sliding window), {csa_ratio} \
                             (CSA) or {hca_ratio} (HCA)",
                            describe(item)
                        ));
                        AttentionKind::Swa
                    }
                })
                .collect::<Vec<_>>(),
        ),
        Some((_, other)) => {
            let shown = describe(other);
            r.problem(format!("`compress_ratios` must be an array, got {shown}"));
            None
        }
        None => None,
    };
    let mut check_len = |name: &str, kinds: &[AttentionKind]| {
        // The official list also covers the MTP layers (sliding window); HF truncates it.
        if kinds.len() != num_layers && kinds.len() != num_layers + num_mtp {
            r.problem(format!(
                "`{name}` has {} entries but the model has {num_layers} layers{}: give one \
                 entry per layer",
                kinds.len(),
                if num_mtp > 0 {
                    format!(" (+{num_mtp} MTP)")
                } else {
                    String::new()
                }
            ));
        } else if kinds[num_layers..].iter().any(|&k| k != AttentionKind::Swa) {
            r.problem(format!(
                "`{name}` gives the MTP layer a compressed attention: MTP layers use the \
                 sliding window only (ratio 0)"
            ));
        }
    };
    if let Some(kinds) = &from_types {
        check_len("layer_types", kinds);
    }
    if let Some(kinds) = &from_ratios {
        check_len("compress_ratios", kinds);
    }
    match (from_types, from_ratios) {
        (Some(types), Some(ratios)) => {
            let n = num_layers.min(types.len()).min(ratios.len());
            if let Some(i) = (0..n).find(|&i| types[i] != ratios[i]) {
                r.problem(format!(
                    "`layer_types[{i}]` ({}) and `compress_ratios[{i}]` ({}) disagree: keep one \
                     of the two keys",
                    types[i].hf_name(),
                    ratios[i].hf_name()
                ));
            }
            truncate(types, num_layers)
        }
        (Some(kinds), None) | (None, Some(kinds)) => truncate(kinds, num_layers),
        (None, None) => {
            r.problem(
                "neither `layer_types` nor `compress_ratios` is set: transformers would default \
                 to [HCA, HCA, HCA, CSA, …], which is not the official DeepSeek V4 layer order; \
                 copy `compress_ratios` from the checkpoint's official config.json",
            );
            vec![AttentionKind::Swa; num_layers]
        }
    }
}

fn truncate<T: Copy>(mut items: Vec<T>, n: usize) -> Vec<T> {
    items.truncate(n);
    items
}

fn mlp_kinds(r: &mut Reader, form: ConfigForm, num_layers: usize) -> Vec<MlpKind> {
    if let Some((_, value)) = r.find(&["mlp_layer_types"]) {
        let Some(items) = value.as_array() else {
            let shown = describe(value);
            r.problem(format!("`mlp_layer_types` must be an array, got {shown}"));
            return vec![MlpKind::Moe; num_layers];
        };
        if items.len() < num_layers {
            r.problem(format!(
                "`mlp_layer_types` has {} entries but the model has {num_layers} layers",
                items.len()
            ));
        }
        let kinds: Vec<MlpKind> = items
            .iter()
            .take(num_layers)
            .enumerate()
            .map(|(i, item)| match item.as_str() {
                Some("hash_moe") => MlpKind::HashMoe,
                Some("moe") => MlpKind::Moe,
                _ => {
                    r.problem(format!(
                        "`mlp_layer_types[{i}]` is {}: use hash_moe or moe",
                        describe(item)
                    ));
                    MlpKind::Moe
                }
            })
            .collect();
        return kinds;
    }
    // Each reference implementation's own default: transformers 3 hash layers, official 0.
    let default_hash = match form {
        ConfigForm::HuggingFace => 3,
        ConfigForm::Official => 0,
    };
    let n_hash = r.uint(&["num_hash_layers", "n_hash_layers"], Some(default_hash)) as usize;
    if n_hash > num_layers {
        r.problem(format!(
            "{n_hash} hash-routed layers exceed the model's {num_layers} layers"
        ));
    }
    (0..num_layers)
        .map(|i| {
            if i < n_hash {
                MlpKind::HashMoe
            } else {
                MlpKind::Moe
            }
        })
        .collect()
}

/// `main` (SWA layers, MTP; θ = `rope_theta`) and `compress` (layers with a compressor;
/// θ = `compress_rope_theta`, YaRN when configured).
fn ropes(r: &mut Reader, form: ConfigForm) -> (Rope, Rope) {
    let why = "the RoPE base; DeepSeek V4 uses 10000 and 160000";
    let main_theta = r.positive_float(&["rope_theta"], Some(10_000.0), why);
    let compress_theta = r.positive_float(&["compress_rope_theta"], Some(160_000.0), why);
    if form == ConfigForm::Official {
        let yarn = if r.uint(&["original_seq_len"], Some(0)) > 0 {
            Some(Yarn {
                factor: r.positive_float(
                    &["rope_factor"],
                    Some(40.0),
                    "the YaRN context extension; DeepSeek V4 uses 16",
                ),
                original_max_position_embeddings: r.bounded(&["original_seq_len"], None, 1) as u64,
                beta_fast: r.float(&["beta_fast"], Some(32.0)),
                beta_slow: r.float(&["beta_slow"], Some(1.0)),
            })
        } else {
            None
        };
        return (
            Rope {
                theta: main_theta,
                yarn: None,
            },
            Rope {
                theta: compress_theta,
                yarn,
            },
        );
    }
    let params = r.find(&["rope_parameters"]).map(|(_, v)| v.clone());
    if let Some(Value::Object(params)) = &params {
        if let (Some(main), Some(compress)) = (params.get("main"), params.get("compress")) {
            let main = rope_dict(r, "rope_parameters.main", main, main_theta);
            let compress = rope_dict(r, "rope_parameters.compress", compress, compress_theta);
            return (main, compress);
        }
        // A single standard dict: it configures the compressed branch (HF's legacy resolution).
        let compress = rope_dict(
            r,
            "rope_parameters",
            &Value::Object(params.clone()),
            compress_theta,
        );
        let compress = Rope {
            theta: compress_theta,
            ..compress
        };
        return (
            Rope {
                theta: main_theta,
                yarn: None,
            },
            compress,
        );
    }
    let compress = match r.find(&["rope_scaling"]).map(|(_, v)| v.clone()) {
        Some(scaling) => Rope {
            theta: compress_theta,
            ..rope_dict(r, "rope_scaling", &scaling, compress_theta)
        },
        None => {
            log::warn!(
                "config.json has no rope_scaling: the compressed layers' RoPE runs without YaRN, \
                 as transformers does; real DeepSeek V4 checkpoints set YaRN factor 16"
            );
            Rope {
                theta: compress_theta,
                yarn: None,
            }
        }
    };
    (
        Rope {
            theta: main_theta,
            yarn: None,
        },
        compress,
    )
}

fn rope_dict(r: &mut Reader, name: &str, value: &Value, default_theta: f64) -> Rope {
    let Some(dict) = value.as_object() else {
        r.problem(format!(
            "`{name}` must be an object, got {}",
            describe(value)
        ));
        return Rope {
            theta: default_theta,
            yarn: None,
        };
    };
    let num = |key: &str| dict.get(key).and_then(Value::as_f64);
    let theta = num("rope_theta").unwrap_or(default_theta);
    let kind = dict
        .get("rope_type")
        .or_else(|| dict.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let yarn = match kind {
        "default" => None,
        "yarn" | "deepseek_yarn" => {
            let factor = num("factor");
            let original = dict
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64);
            let max = int_limit("max_position_embeddings");
            match (factor, original) {
                (Some(_), Some(original)) if original > max => {
                    r.problem(format!(
                        "`{name}.original_max_position_embeddings` = {original} is above the \
                         maximum {max}: DeepSeek V4 uses 65536"
                    ));
                    None
                }
                (Some(factor), Some(original)) if factor > 0.0 && original > 0 => Some(Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: num("beta_fast").unwrap_or(32.0),
                    beta_slow: num("beta_slow").unwrap_or(1.0),
                }),
                _ => {
                    r.problem(format!(
                        "`{name}` is YaRN but lacks a positive `factor` and \
                         `original_max_position_embeddings`"
                    ));
                    None
                }
            }
        }
        other => {
            r.problem(format!(
                "`{name}.rope_type` \"{}\" is not supported: DeepSeek V4 uses default or yarn",
                shorten(other)
            ));
            None
        }
    };
    Rope { theta, yarn }
}

fn max_positions(r: &mut Reader, compress_rope: &Rope) -> u64 {
    let max = int_limit("max_position_embeddings");
    if let Some((key, value)) = r.find(&["max_position_embeddings", "max_seq_len"]) {
        return match value.as_u64().filter(|&n| n > 0) {
            Some(n) if n > max => {
                r.problem(format!(
                    "`{key}` = {n} is above the maximum {max} tokens that dsv4 accepts: \
                     DeepSeek V4 uses 1048576"
                ));
                0
            }
            Some(n) => n,
            None => {
                r.problem(format!(
                    "`{key}` must be a positive integer, got {}",
                    describe(value)
                ));
                0
            }
        };
    }
    match compress_rope.yarn {
        Some(yarn) => {
            let n = yarn.original_max_position_embeddings as f64 * yarn.factor;
            if n > max as f64 {
                r.problem(format!(
                    "the YaRN context ({} × factor {}) is above the maximum {max} tokens that \
                     dsv4 accepts: add `max_position_embeddings` to config.json",
                    yarn.original_max_position_embeddings, yarn.factor
                ));
                0
            } else {
                n as u64
            }
        }
        None => {
            r.problem(
                "the maximum context is not stated: add `max_position_embeddings` to config.json",
            );
            0
        }
    }
}

fn token_ids(r: &mut Reader, key: &'static str) -> Vec<u32> {
    let Some((_, value)) = r.find(&[key]) else {
        return if key == "bos_token_id" {
            vec![0]
        } else {
            Vec::new()
        };
    };
    let items: Vec<&Value> = match value {
        Value::Array(items) => items.iter().collect(),
        single => vec![single],
    };
    if items.len() > MAX_EOS_IDS {
        r.problem(format!(
            "`{key}` lists {} token ids; at most {MAX_EOS_IDS} are accepted: list the \
             model's end-of-sequence tokens only",
            items.len()
        ));
        return Vec::new();
    }
    let mut ids = Vec::new();
    for item in items {
        match item.as_u64().and_then(|n| u32::try_from(n).ok()) {
            Some(id) => ids.push(id),
            None => r.problem(format!(
                "`{key}` must be a token id or a list of them, got {}",
                describe(item)
            )),
        }
    }
    ids
}

fn weight_formats(r: &mut Reader, form: ConfigForm) -> (DenseFormat, ExpertFormat, DenseFormat) {
    let torch = |name: &str| match name {
        "float32" | "fp32" | "f32" => Some(DenseFormat::F32),
        "bfloat16" | "bf16" => Some(DenseFormat::Bf16),
        "float16" | "fp16" | "f16" => Some(DenseFormat::F16),
        _ => None,
    };
    let unquantized = match r.string(&["torch_dtype"]) {
        Some(name) => torch(&name).unwrap_or_else(|| {
            r.problem(format!(
                "`torch_dtype` \"{}\" is not supported: use float32, bfloat16 or float16",
                shorten(&name)
            ));
            DenseFormat::Bf16
        }),
        None => DenseFormat::Bf16,
    };
    let mut dense = unquantized;
    match form {
        ConfigForm::HuggingFace => {
            if let Some((_, q)) = r.find(&["quantization_config"]) {
                let q = q.clone();
                let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
                let fmt = q.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
                if method != "fp8" || fmt != "e4m3" {
                    r.problem(format!(
                        "`quantization_config` ({method}/{fmt}) is not supported: DeepSeek V4 \
                         checkpoints use fp8/e4m3 with 128×128 ue8m0 block scales"
                    ));
                }
                let block = q
                    .get("weight_block_size")
                    .and_then(Value::as_array)
                    .map(|b| b.iter().filter_map(Value::as_u64).collect::<Vec<_>>())
                    .unwrap_or_else(|| vec![128, 128]);
                let max = int_limit("weight_block_size");
                if block.len() != 2 || block.contains(&0) || block.iter().any(|&b| b > max) {
                    r.problem(format!(
                        "`quantization_config.weight_block_size` must be two integers from 1 to \
                         {max}: DeepSeek V4 uses [128, 128]"
                    ));
                }
                dense = DenseFormat::Fp8Block {
                    block: [
                        *block.first().unwrap_or(&128) as usize,
                        *block.get(1).unwrap_or(&128) as usize,
                    ],
                };
            }
        }
        ConfigForm::Official => match r.string(&["dtype"]).as_deref() {
            Some("fp8") | None => dense = DenseFormat::Fp8Block { block: [128, 128] },
            Some(other) => match torch(other) {
                Some(format) => dense = format,
                None => r.problem(format!(
                    "`dtype` \"{}\" is not supported: use fp8 or bf16",
                    shorten(other)
                )),
            },
        },
    }
    let experts = match r.string(&["expert_dtype"]).as_deref() {
        Some("fp4") => ExpertFormat::Fp4 { block: 32 },
        Some("fp8") | None => ExpertFormat::Dense,
        Some(other) => {
            r.problem(format!(
                "`expert_dtype` \"{}\" is not supported: use fp4 or leave it out",
                shorten(other)
            ));
            ExpertFormat::Dense
        }
    };
    (dense, experts, unquantized)
}

fn check_consistency(r: &mut Reader, c: &ModelConfig) {
    // Token ids index the embedding and the logits: one past the vocabulary reads out of bounds
    // (or never matches, so generation never stops).
    if c.vocab_size > 0 {
        let named = [("bos_token_id", c.bos_token_id)]
            .into_iter()
            .filter_map(|(k, id)| id.map(|id| (k, id)))
            .chain(c.eos_token_ids.iter().map(|&id| ("eos_token_id", id)));
        for (key, id) in named {
            if id as usize >= c.vocab_size {
                r.problem(format!(
                    "`{key}` {id} is not below `vocab_size` {}: token ids run from 0 to {}; \
                     fix the id or the vocabulary size",
                    c.vocab_size,
                    c.vocab_size - 1
                ));
            }
        }
    }
    if !c.rope_head_dim.is_multiple_of(2) || c.rope_head_dim >= c.head_dim {
        r.problem(format!(
            "rope head dim {} must be even and smaller than head_dim {}",
            c.rope_head_dim, c.head_dim
        ));
    }
    if c.rope_head_dim >= c.index_head_dim && c.index_head_dim > 0 {
        r.problem(format!(
            "rope head dim {} must be smaller than index_head_dim {}",
            c.rope_head_dim, c.index_head_dim
        ));
    }
    if c.o_groups > 0 && !c.num_heads.is_multiple_of(c.o_groups) {
        r.problem(format!(
            "num_attention_heads {} is not a multiple of o_groups {}",
            c.num_heads, c.o_groups
        ));
    }
    if c.n_activated_experts > c.n_routed_experts {
        r.problem(format!(
            "{} experts per token exceed the {} routed experts",
            c.n_activated_experts, c.n_routed_experts
        ));
    }
    if let ExpertFormat::Fp4 { block } = c.expert_format {
        for (what, n) in [
            ("hidden_size", c.hidden_size),
            ("moe_intermediate_size", c.moe_intermediate_size),
        ] {
            if n % block != 0 {
                r.problem(format!(
                    "{what} {n} is not a multiple of {block}: FP4 experts need whole scale blocks"
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flash() -> ModelConfig {
        ModelConfig::load(Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/configs/deepseek-v4-flash"
        )))
        .unwrap()
    }

    /// docs/params.md ("Limits") names every bounded config.json integer.
    #[test]
    fn docs_params_md_lists_every_config_json_limit() {
        let doc = include_str!("../../docs/params.md");
        let limits = &doc[doc.find("## Limits").expect("a Limits section")..];
        for (key, _) in INT_LIMITS {
            assert!(
                limits.contains(&format!("{key}`")),
                "docs/params.md does not list the limit of `{key}`"
            );
        }
    }

    #[test]
    fn flash_layer_layout_matches_the_published_model() {
        let c = flash();
        assert_eq!(c.form, ConfigForm::HuggingFace);
        assert_eq!(c.num_layers, 43);
        assert_eq!(c.num_mtp_layers, 1);
        // docs/model.md §1.2: layers 0-1 SWA, even 2..42 CSA (21), odd 3..41 HCA (20).
        assert_eq!(c.count(AttentionKind::Swa), 2);
        assert_eq!(c.count(AttentionKind::Csa), 21);
        assert_eq!(c.count(AttentionKind::Hca), 20);
        assert_eq!(c.attention[2], AttentionKind::Csa);
        assert_eq!(c.attention[3], AttentionKind::Hca);
        assert_eq!(c.attention[42], AttentionKind::Csa);
        assert_eq!(c.mlp.iter().filter(|&&m| m == MlpKind::HashMoe).count(), 3);
        assert_eq!(c.compress_rope.theta, 160_000.0);
        assert_eq!(
            c.compress_rope.yarn,
            Some(Yarn {
                factor: 16.0,
                original_max_position_embeddings: 65536,
                beta_fast: 32.0,
                beta_slow: 1.0
            })
        );
        assert_eq!(c.main_rope.yarn, None);
        assert_eq!(c.dense_format, DenseFormat::Fp8Block { block: [128, 128] });
        assert_eq!(c.expert_format, ExpertFormat::Fp4 { block: 32 });
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn official_and_hf_forms_normalise_to_the_same_model() {
        let official = r#"{
            "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43,
            "n_hash_layers": 3, "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1,
            "n_activated_experts": 6, "score_func": "sqrtsoftplus", "route_scale": 1.5,
            "swiglu_limit": 10.0, "q_lora_rank": 1024, "head_dim": 512, "rope_head_dim": 64,
            "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "original_seq_len": 65536,
            "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
            "compress_rope_theta": 160000,
            "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4,
              128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
              4, 128, 4, 128, 4, 0]
        }"#;
        let off = ModelConfig::from_json_str(official, "deepseek-v4-flash").unwrap();
        let hf = flash();
        assert_eq!(off.form, ConfigForm::Official);
        let strip = |c: &ModelConfig| ModelConfig {
            form: ConfigForm::Official,
            name: String::new(),
            ..c.clone()
        };
        assert_eq!(strip(&off), strip(&hf));
    }

    #[test]
    fn hf_layer_types_and_rope_parameters_are_read() {
        let text = r#"{
            "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 256,
            "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 128,
            "qk_rope_head_dim": 32, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "index_n_heads": 16, "index_head_dim": 64, "index_topk": 8, "torch_dtype": "float32",
            "num_nextn_predict_layers": 0,
            "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention",
                            "sliding_attention"],
            "mlp_layer_types": ["hash_moe", "moe", "moe"],
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": 10000.0},
                "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                             "original_max_position_embeddings": 256, "beta_fast": 32,
                             "beta_slow": 1}
            },
            "max_position_embeddings": 4096
        }"#;
        let c = ModelConfig::from_json_str(text, "tiny").unwrap();
        use AttentionKind::*;
        assert_eq!(c.attention, vec![Hca, Csa, Swa]);
        assert_eq!(c.mlp, vec![MlpKind::HashMoe, MlpKind::Moe, MlpKind::Moe]);
        assert_eq!(
            c.compress_rope
                .yarn
                .unwrap()
                .original_max_position_embeddings,
            256
        );
        assert_eq!(c.main_rope.theta, 10_000.0);
        assert_eq!(c.dense_format, DenseFormat::F32);
        assert_eq!(c.expert_format, ExpertFormat::Dense);
    }

    #[test]
    fn the_hf_default_layer_order_is_refused_not_guessed() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "q_lora_rank": 4, "o_groups": 1, "o_lora_rank": 4,
            "n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
            "index_n_heads": 1, "index_head_dim": 128, "index_topk": 1,
            "max_position_embeddings": 64}"#;
        let err = ModelConfig::from_json_str(text, "x").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ModelFormat);
        assert!(err
            .message()
            .contains("neither `layer_types` nor `compress_ratios`"));
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let text = r#"{"model_type": "deepseek_v3", "hidden_size": "4096",
            "num_hidden_layers": 2, "num_attention_heads": 3, "o_groups": 2,
            "compress_ratios": [0, 7], "num_key_value_heads": 8}"#;
        let err = ModelConfig::from_json_str(text, "x").unwrap_err();
        let m = err.message();
        for needle in [
            "\"deepseek_v3\"",
            "`hidden_size` must be a non-negative integer, got string \"4096\"",
            "`vocab_size` is missing",
            "`compress_ratios[1]` is number 7",
            "exactly one shared K=V head",
            "not a multiple of o_groups",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
    }

    #[test]
    fn missing_files_are_io_errors_and_garbage_is_a_format_error() {
        let dir = std::env::temp_dir().join(format!("dsv4-model-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = ModelConfig::load(&dir).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        assert!(err.message().contains("has no config.json"));
        let err = ModelConfig::load(&dir.join("nope")).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Io);
        std::fs::write(dir.join("config.json"), b"{\"dim\": 1,").unwrap();
        let err = ModelConfig::load(&dir).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::ModelFormat);
        assert!(err.message().contains("invalid JSON at line 1"));
        std::fs::write(dir.join("config.json"), b"\xff\xfe").unwrap();
        let err = ModelConfig::load(&dir).unwrap_err();
        assert!(err.message().contains("not valid UTF-8"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
