//! The tensors a DeepSeek V4 checkpoint holds, by official name, with logical shapes derived from
//! the config (docs/model.md §4.1). The planner sums their bytes per rank; the weight loader
//! checks a checkpoint against the same list, so shapes are written down once.

use serde::Serialize;

use super::model::{AttentionKind, DenseFormat, ExpertFormat, MlpKind, ModelConfig};

/// How a tensor is stored, which decides its checkpoint dtype and its resident dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Storage {
    /// A dense linear weight `[out, in]`: FP8 with block scales in quantised checkpoints.
    Linear,
    /// A routed expert's linear weight: FP4 with 1×32 scales in quantised checkpoints.
    Expert,
    /// Never quantised (embeddings, norms, compressor projections, router gate): `torch_dtype`.
    Unquantized,
    /// Always fp32 (hyper-connection mixes, sinks, position biases, router bias).
    Float32,
    /// The hash router's token → expert table, int64.
    Index,
}

/// How a tensor is split across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shard {
    Replicated,
    /// Split over tensor-parallel ranks (attention heads, output groups, vocabulary, shared
    /// expert intermediate).
    Tensor,
    /// Split over expert-parallel ranks (tensor-parallel ranks when `ep` is 1).
    Expert,
}

/// One tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TensorSpec {
    /// Official name (no `model.` prefix).
    pub name: String,
    /// Logical shape (FP4 packing and scales not applied).
    pub shape: Vec<usize>,
    pub storage: Storage,
    pub shard: Shard,
}

impl TensorSpec {
    pub fn elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// Stored dtypes, named as in safetensors headers' spirit but stable in reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Dtype {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "bf16")]
    Bf16,
    #[serde(rename = "f16")]
    F16,
    #[serde(rename = "fp8_e4m3")]
    Fp8E4m3,
    #[serde(rename = "fp4_e2m1")]
    Fp4E2m1,
    #[serde(rename = "e8m0")]
    E8m0,
    #[serde(rename = "i64")]
    I64,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Fp8E4m3 => "fp8_e4m3",
            Self::Fp4E2m1 => "fp4_e2m1",
            Self::E8m0 => "e8m0",
            Self::I64 => "i64",
        }
    }

    /// Bytes for `elements` values (FP4 packs two per byte).
    pub fn bytes(self, elements: u64) -> u64 {
        match self {
            Self::F32 => elements * 4,
            Self::Bf16 | Self::F16 => elements * 2,
            Self::Fp8E4m3 | Self::E8m0 => elements,
            Self::Fp4E2m1 => elements.div_ceil(2),
            Self::I64 => elements * 8,
        }
    }

    pub fn of_dense(format: DenseFormat) -> Self {
        match format {
            DenseFormat::F32 => Self::F32,
            DenseFormat::Bf16 => Self::Bf16,
            DenseFormat::F16 => Self::F16,
            DenseFormat::Fp8Block { .. } => Self::Fp8E4m3,
        }
    }
}

/// The checkpoint's stored parts of one tensor: the values and, for quantised formats, the scales.
pub fn stored_parts(spec: &TensorSpec, config: &ModelConfig) -> Vec<(Dtype, u64)> {
    let (out, inner) = match spec.shape.as_slice() {
        [out, inner] => (*out as u64, *inner as u64),
        _ => (spec.elements(), 1),
    };
    let fp8 = |block: [usize; 2]| {
        let scales = out.div_ceil(block[0] as u64) * inner.div_ceil(block[1] as u64);
        vec![(Dtype::Fp8E4m3, out * inner), (Dtype::E8m0, scales)]
    };
    let dense = |format: DenseFormat| match format {
        DenseFormat::Fp8Block { block } => fp8(block),
        other => vec![(Dtype::of_dense(other), spec.elements())],
    };
    let parts = match spec.storage {
        Storage::Linear => dense(config.dense_format),
        Storage::Expert => match config.expert_format {
            ExpertFormat::Fp4 { block } => vec![
                (Dtype::Fp4E2m1, out * inner),
                (Dtype::E8m0, out * inner.div_ceil(block as u64)),
            ],
            ExpertFormat::Dense => dense(config.dense_format),
        },
        Storage::Unquantized => vec![(Dtype::of_dense(config.unquantized_dtype), spec.elements())],
        Storage::Float32 => vec![(Dtype::F32, spec.elements())],
        Storage::Index => vec![(Dtype::I64, spec.elements())],
    };
    parts
        .into_iter()
        .map(|(dtype, elements)| (dtype, dtype.bytes(elements)))
        .collect()
}

/// Every tensor of the checkpoint, main model then MTP blocks.
pub fn checkpoint_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let mut list = Inventory::default();
    let (d, v, hc) = (c.hidden_size, c.vocab_size, c.hc_mult);
    list.add("embed.weight", &[v, d], Storage::Unquantized, Shard::Tensor);
    list.add("head.weight", &[v, d], Storage::Unquantized, Shard::Tensor);
    list.add("norm.weight", &[d], Storage::Unquantized, Shard::Replicated);
    list.hc_head("", c);
    for (i, (&attention, &mlp)) in c.attention.iter().zip(&c.mlp).enumerate() {
        list.block(&format!("layers.{i}."), c, attention, mlp);
    }
    for k in 0..c.num_mtp_layers {
        let p = format!("mtp.{k}.");
        list.block(&p, c, AttentionKind::Swa, MlpKind::Moe);
        list.add(
            &format!("{p}e_proj.weight"),
            &[d, d],
            Storage::Linear,
            Shard::Replicated,
        );
        list.add(
            &format!("{p}h_proj.weight"),
            &[d, d],
            Storage::Linear,
            Shard::Replicated,
        );
        for norm in ["enorm", "hnorm", "norm"] {
            list.add(
                &format!("{p}{norm}.weight"),
                &[d],
                Storage::Unquantized,
                Shard::Replicated,
            );
        }
        list.hc_head(&p, c);
    }
    debug_assert!(hc > 0);
    list.0
}

#[derive(Default)]
struct Inventory(Vec<TensorSpec>);

impl Inventory {
    fn add(&mut self, name: &str, shape: &[usize], storage: Storage, shard: Shard) {
        self.0.push(TensorSpec {
            name: name.to_string(),
            shape: shape.to_vec(),
            storage,
            shard,
        });
    }

    fn hc_head(&mut self, prefix: &str, c: &ModelConfig) {
        let hc = c.hc_mult;
        let r = Shard::Replicated;
        self.add(
            &format!("{prefix}hc_head_fn"),
            &[hc, hc * c.hidden_size],
            Storage::Float32,
            r,
        );
        self.add(&format!("{prefix}hc_head_base"), &[hc], Storage::Float32, r);
        self.add(&format!("{prefix}hc_head_scale"), &[1], Storage::Float32, r);
    }

    fn block(&mut self, p: &str, c: &ModelConfig, attention: AttentionKind, mlp: MlpKind) {
        use Shard::{Expert, Replicated as R, Tensor};
        use Storage::{Float32, Index, Linear, Unquantized};
        let (d, h, hd, q) = (c.hidden_size, c.num_heads, c.head_dim, c.q_lora_rank);
        let hc = c.hc_mult;
        let mix = (2 + hc) * hc;
        for norm in ["attn_norm", "ffn_norm"] {
            self.add(&format!("{p}{norm}.weight"), &[d], Unquantized, R);
        }
        for site in ["attn", "ffn"] {
            self.add(&format!("{p}hc_{site}_fn"), &[mix, hc * d], Float32, R);
            self.add(&format!("{p}hc_{site}_base"), &[mix], Float32, R);
            self.add(&format!("{p}hc_{site}_scale"), &[3], Float32, R);
        }
        let a = format!("{p}attn.");
        self.add(&format!("{a}wq_a.weight"), &[q, d], Linear, R);
        self.add(&format!("{a}q_norm.weight"), &[q], Unquantized, R);
        self.add(&format!("{a}wq_b.weight"), &[h * hd, q], Linear, Tensor);
        self.add(&format!("{a}wkv.weight"), &[hd, d], Linear, R);
        self.add(&format!("{a}kv_norm.weight"), &[hd], Unquantized, R);
        let group_in = h * hd / c.o_groups;
        self.add(
            &format!("{a}wo_a.weight"),
            &[c.o_groups * c.o_lora_rank, group_in],
            Linear,
            Tensor,
        );
        self.add(
            &format!("{a}wo_b.weight"),
            &[d, c.o_groups * c.o_lora_rank],
            Linear,
            Tensor,
        );
        self.add(&format!("{a}attn_sink"), &[h], Float32, Tensor);
        if attention != AttentionKind::Swa {
            let ratio = c.ratio(attention);
            self.compressor(
                &format!("{a}compressor."),
                c,
                ratio,
                hd,
                attention == AttentionKind::Csa,
            );
        }
        if attention == AttentionKind::Csa {
            let (ih, id) = (c.index_n_heads, c.index_head_dim);
            let ix = format!("{a}indexer.");
            self.add(&format!("{ix}wq_b.weight"), &[ih * id, q], Linear, R);
            self.add(
                &format!("{ix}weights_proj.weight"),
                &[ih, d],
                Unquantized,
                R,
            );
            self.compressor(&format!("{ix}compressor."), c, c.csa_ratio, id, true);
        }
        let f = format!("{p}ffn.");
        let (e, i) = (c.n_routed_experts, c.moe_intermediate_size);
        self.add(&format!("{f}gate.weight"), &[e, d], Unquantized, R);
        match mlp {
            MlpKind::HashMoe => self.add(
                &format!("{f}gate.tid2eid"),
                &[c.vocab_size, c.n_activated_experts],
                Index,
                R,
            ),
            MlpKind::Moe => self.add(&format!("{f}gate.bias"), &[e], Float32, R),
        }
        for x in 0..e {
            let ex = format!("{f}experts.{x}.");
            self.add(&format!("{ex}w1.weight"), &[i, d], Storage::Expert, Expert);
            self.add(&format!("{ex}w3.weight"), &[i, d], Storage::Expert, Expert);
            self.add(&format!("{ex}w2.weight"), &[d, i], Storage::Expert, Expert);
        }
        if c.n_shared_experts > 0 {
            let si = i * c.n_shared_experts;
            let s = format!("{f}shared_experts.");
            self.add(&format!("{s}w1.weight"), &[si, d], Linear, Tensor);
            self.add(&format!("{s}w3.weight"), &[si, d], Linear, Tensor);
            self.add(&format!("{s}w2.weight"), &[d, si], Linear, Tensor);
        }
    }

    /// A compressor pooling `ratio` tokens at width `width`; the overlapping (CSA) variant
    /// projects twice the width: the previous window's half and the current one's.
    fn compressor(&mut self, p: &str, c: &ModelConfig, ratio: usize, width: usize, overlap: bool) {
        let coff = if overlap { 2 } else { 1 };
        let r = Shard::Replicated;
        for proj in ["wkv", "wgate"] {
            self.add(
                &format!("{p}{proj}.weight"),
                &[coff * width, c.hidden_size],
                Storage::Unquantized,
                r,
            );
        }
        self.add(
            &format!("{p}ape"),
            &[ratio, coff * width],
            Storage::Float32,
            r,
        );
        self.add(
            &format!("{p}norm.weight"),
            &[width],
            Storage::Unquantized,
            r,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn load(name: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs")
            .join(name);
        ModelConfig::load(&dir).unwrap()
    }

    fn find<'a>(list: &'a [TensorSpec], name: &str) -> &'a TensorSpec {
        list.iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name}"))
    }

    #[test]
    fn flash_shapes_match_the_published_tensor_table() {
        // Literal shapes from docs/model.md §4.1 (V4-Flash).
        let c = load("deepseek-v4-flash");
        let t = checkpoint_tensors(&c);
        for (name, shape) in [
            ("embed.weight", vec![129280, 4096]),
            ("hc_head_fn", vec![4, 16384]),
            ("layers.0.hc_attn_fn", vec![24, 16384]),
            ("layers.2.attn.wq_b.weight", vec![32768, 1024]),
            ("layers.2.attn.wo_a.weight", vec![8192, 4096]),
            ("layers.2.attn.wo_b.weight", vec![4096, 8192]),
            ("layers.2.attn.compressor.wkv.weight", vec![1024, 4096]),
            ("layers.2.attn.compressor.ape", vec![4, 1024]),
            ("layers.3.attn.compressor.wkv.weight", vec![512, 4096]),
            ("layers.3.attn.compressor.ape", vec![128, 512]),
            ("layers.2.attn.indexer.wq_b.weight", vec![8192, 1024]),
            ("layers.2.attn.indexer.weights_proj.weight", vec![64, 4096]),
            (
                "layers.2.attn.indexer.compressor.wkv.weight",
                vec![256, 4096],
            ),
            ("layers.2.attn.indexer.compressor.ape", vec![4, 256]),
            ("layers.0.ffn.gate.tid2eid", vec![129280, 6]),
            ("layers.3.ffn.gate.bias", vec![256]),
            ("layers.3.ffn.experts.255.w2.weight", vec![4096, 2048]),
            ("layers.3.ffn.shared_experts.w1.weight", vec![2048, 4096]),
            ("mtp.0.e_proj.weight", vec![4096, 4096]),
        ] {
            assert_eq!(find(&t, name).shape, shape, "{name}");
        }
        assert!(!t.iter().any(|s| s.name == "layers.0.attn.compressor.ape"));
        assert!(!t.iter().any(|s| s.name == "layers.3.ffn.gate.tid2eid"));
        // Stored FP4 expert: [2048, 2048] bytes + [2048, 128] scales (§4.1).
        let w1 = find(&t, "layers.3.ffn.experts.0.w1.weight");
        assert_eq!(
            stored_parts(w1, &c),
            vec![(Dtype::Fp4E2m1, 2048 * 2048), (Dtype::E8m0, 2048 * 128)]
        );
        // FP8 wq_b [32768, 1024] with scale [256, 8] (§4.1).
        let wq_b = find(&t, "layers.2.attn.wq_b.weight");
        assert_eq!(
            stored_parts(wq_b, &c),
            vec![(Dtype::Fp8E4m3, 32768 * 1024), (Dtype::E8m0, 256 * 8)]
        );
    }

    #[test]
    fn parameter_totals_match_the_published_sizes() {
        // docs/model.md §1.2: Flash 284B and Pro 1.6T total parameters (main model; the
        // published figures are rounded to 3 and 2 significant digits).
        for (name, published, digits) in [
            ("deepseek-v4-flash", 284e9, 3),
            ("deepseek-v4-pro", 1.6e12, 2),
        ] {
            let c = load(name);
            let total: u64 = checkpoint_tensors(&c)
                .iter()
                .filter(|t| !t.name.starts_with("mtp."))
                .map(TensorSpec::elements)
                .sum();
            let scale = 10f64.powi((total as f64).log10().floor() as i32 + 1 - digits);
            let rounded = (total as f64 / scale).round() * scale;
            assert_eq!(rounded, published, "{name}: {total} parameters");
        }
    }
}
