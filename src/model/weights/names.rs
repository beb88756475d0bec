//! The two naming schemes of DeepSeek V4 checkpoints (docs/model.md §4.3). The loader asks
//! for every tensor by its official name; [`locate`] says where the checkpoint at hand keeps
//! it: under the same name (official), under its Hugging Face name, or as a slice of HF's
//! stacked expert tensors.

/// Which scheme a checkpoint uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Naming {
    /// `layers.0.attn.wq_a.weight`, scales as `….scale`, one tensor per expert matrix.
    Official,
    /// `model.layers.0.self_attn.q_a_proj.weight`, scales as `….weight_scale_inv`, experts
    /// stacked in `mlp.experts.gate_up_proj [E, 2I, D]` and `mlp.experts.down_proj [E, D, I]`.
    HuggingFace,
}

impl Naming {
    /// Tells the scheme from the tensor names present.
    pub fn detect<'a>(mut names: impl Iterator<Item = &'a str>) -> Self {
        if names.any(|n| n.starts_with("model.") || n == "lm_head.weight") {
            Self::HuggingFace
        } else {
            Self::Official
        }
    }
}

/// Where one official tensor lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The stored tensor holding the values.
    pub name: String,
    /// The scale tensor, used when the values are FP8/FP4.
    pub scale: String,
    /// For a stacked expert tensor: the expert index and the rows of its matrix to keep.
    pub slice: Option<Slice>,
}

/// A slice of a stacked `[E, R, C]` tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub expert: usize,
    pub rows: std::ops::Range<usize>,
}

/// Official → Hugging Face names within a decoder block (order matters: longest first).
const BLOCK: &[(&str, &str)] = &[
    (
        "attn.indexer.compressor.wkv.weight",
        "self_attn.compressor.indexer.kv_proj.weight",
    ),
    (
        "attn.indexer.compressor.wgate.weight",
        "self_attn.compressor.indexer.gate_proj.weight",
    ),
    (
        "attn.indexer.compressor.ape",
        "self_attn.compressor.indexer.position_bias",
    ),
    (
        "attn.indexer.compressor.norm.weight",
        "self_attn.compressor.indexer.kv_norm.weight",
    ),
    (
        "attn.indexer.wq_b.weight",
        "self_attn.compressor.indexer.q_b_proj.weight",
    ),
    (
        "attn.indexer.weights_proj.weight",
        "self_attn.compressor.indexer.scorer.weights_proj.weight",
    ),
    (
        "attn.compressor.wkv.weight",
        "self_attn.compressor.kv_proj.weight",
    ),
    (
        "attn.compressor.wgate.weight",
        "self_attn.compressor.gate_proj.weight",
    ),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    (
        "attn.compressor.norm.weight",
        "self_attn.compressor.kv_norm.weight",
    ),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"),
    ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"),
    ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"),
    ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_fn", "attn_hc.fn"),
    ("hc_attn_base", "attn_hc.base"),
    ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"),
    ("hc_ffn_base", "ffn_hc.base"),
    ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    (
        "ffn.shared_experts.w1.weight",
        "mlp.shared_experts.gate_proj.weight",
    ),
    (
        "ffn.shared_experts.w2.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    (
        "ffn.shared_experts.w3.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
];

const TOP: &[(&str, &str)] = &[
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "lm_head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_fn", "model.hc_head.hc_fn"),
    ("hc_head_base", "model.hc_head.hc_base"),
    ("hc_head_scale", "model.hc_head.hc_scale"),
];

/// Where the official tensor `name` (a `[rows, …]` tensor; `inter` is the experts'
/// intermediate size) lives in a checkpoint of scheme `naming`. `None` when the scheme has no
/// such tensor (an unknown name).
pub fn locate(name: &str, naming: Naming, inter: usize) -> Option<Location> {
    let official_scale = || {
        name.strip_suffix(".weight")
            .map_or_else(|| format!("{name}.scale"), |b| format!("{b}.scale"))
    };
    if naming == Naming::Official || name.starts_with("mtp.") {
        // HF checkpoints keep the MTP block (which transformers ignores) under official names.
        return Some(Location {
            name: name.to_string(),
            scale: official_scale(),
            slice: None,
        });
    }
    let hf = |stored: String| Location {
        scale: stored.strip_suffix(".weight").map_or_else(
            || format!("{stored}_scale_inv"),
            |b| format!("{b}.weight_scale_inv"),
        ),
        name: stored,
        slice: None,
    };
    if let Some((_, to)) = TOP.iter().find(|(from, _)| *from == name) {
        return Some(hf(to.to_string()));
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let prefix = format!("model.layers.{layer}.");
    if let Some(expert) = rest.strip_prefix("ffn.experts.") {
        let (index, matrix) = expert.split_once('.')?;
        let index: usize = index.parse().ok()?;
        let (stack, rows) = match matrix {
            "w1.weight" => ("gate_up_proj", 0..inter),
            "w3.weight" => ("gate_up_proj", inter..2 * inter),
            "w2.weight" => ("down_proj", 0..usize::MAX),
            _ => return None,
        };
        return Some(Location {
            name: format!("{prefix}mlp.experts.{stack}"),
            scale: format!("{prefix}mlp.experts.{stack}_scale_inv"),
            slice: Some(Slice {
                expert: index,
                rows,
            }),
        });
    }
    let (_, to) = BLOCK.iter().find(|(from, _)| *from == rest)?;
    Some(hf(format!("{prefix}{to}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_follow_the_conversion_mapping() {
        let hf = |n: &str| locate(n, Naming::HuggingFace, 64).unwrap();
        assert_eq!(hf("embed.weight").name, "model.embed_tokens.weight");
        assert_eq!(hf("hc_head_scale").name, "model.hc_head.hc_scale");
        let q = hf("layers.3.attn.wq_a.weight");
        assert_eq!(q.name, "model.layers.3.self_attn.q_a_proj.weight");
        assert_eq!(
            q.scale,
            "model.layers.3.self_attn.q_a_proj.weight_scale_inv"
        );
        assert_eq!(
            hf("layers.2.attn.indexer.compressor.ape").name,
            "model.layers.2.self_attn.compressor.indexer.position_bias"
        );
        assert_eq!(
            hf("layers.2.attn.indexer.weights_proj.weight").name,
            "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight"
        );
        assert_eq!(
            hf("layers.0.attn.attn_sink").name,
            "model.layers.0.self_attn.sinks"
        );
        assert_eq!(
            hf("layers.0.ffn.gate.bias").name,
            "model.layers.0.mlp.gate.e_score_correction_bias"
        );
        let w3 = hf("layers.1.ffn.experts.5.w3.weight");
        assert_eq!(w3.name, "model.layers.1.mlp.experts.gate_up_proj");
        assert_eq!(
            w3.scale,
            "model.layers.1.mlp.experts.gate_up_proj_scale_inv"
        );
        assert_eq!(
            w3.slice,
            Some(Slice {
                expert: 5,
                rows: 64..128
            })
        );
        assert_eq!(hf("mtp.0.e_proj.weight").name, "mtp.0.e_proj.weight");
        assert!(locate("layers.0.attn.nonsense", Naming::HuggingFace, 64).is_none());
    }

    #[test]
    fn official_scales_sit_next_to_their_weights() {
        let loc = locate("layers.0.ffn.experts.7.w2.weight", Naming::Official, 64).unwrap();
        assert_eq!(loc.name, "layers.0.ffn.experts.7.w2.weight");
        assert_eq!(loc.scale, "layers.0.ffn.experts.7.w2.scale");
        assert_eq!(loc.slice, None);
    }

    #[test]
    fn the_scheme_is_detected_from_names() {
        assert_eq!(
            Naming::detect(["lm_head.weight"].into_iter()),
            Naming::HuggingFace
        );
        assert_eq!(
            Naming::detect(["embed.weight", "layers.0.attn_norm.weight"].into_iter()),
            Naming::Official
        );
    }
}
