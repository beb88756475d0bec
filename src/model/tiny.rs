//! The built-in tiny model: a random DeepSeek V4 checkpoint small enough to serve on two CPU
//! cores, written on demand so demos and smoke tests need no download and no committed weights.
//!
//! It is stored exactly as the official release stores its weights (official names, FP8 e4m3
//! dense weights with 128×128 ue8m0 block scales, FP4 e2m1 routed experts packed two per byte
//! with 1×32 scales, int64 hash-routing tables, bf16 and f32 elsewhere, an MTP block), so the
//! demo runs the same loading and dequantisation path as a real checkpoint. It has every layer
//! kind (sliding window, CSA with its indexer, HCA; hash-routed and score-routed MoE) and a
//! hidden size of 160, which leaves ragged 32-wide FP8 blocks at the matrix edges.
//!
//! The weights come from a fixed seed (one stream per tensor, keyed by its name, so the values
//! of a tensor do not depend on the order tensors are listed in) and are drawn from uniform
//! distributions computed without transcendental functions: the bytes are the same on every
//! machine, which lets [`write_checkpoint`] decide by comparing bytes whether a checkpoint on
//! disk is the one it would write.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

use crate::config::tensors::{checkpoint_tensors, Storage, TensorSpec};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::formats::{ceil_log2, e2m1_encode, e4m3_encode, e8m0_decode};

/// The tiny model's tokenizer (byte-level BPE, 4096 ids like its embedding, DeepSeek's special
/// tokens with BOS 0 and EOS 1) and its chat template, made by tests/reference/make_tokenizer.py
/// (its docstring has the command), so the demo can serve text.
const TOKENIZER_JSON: &[u8] = include_bytes!("../../assets/tiny-model/tokenizer.json");
const TOKENIZER_CONFIG_JSON: &[u8] =
    include_bytes!("../../assets/tiny-model/tokenizer_config.json");

/// Changing it (or any initialisation rule) changes every weight; `write_checkpoint` then
/// rewrites checkpoints written before.
const SEED: u64 = 0x0d5e_4711;

/// FP8 block edge (official `weight_block_size` [128, 128]).
const FP8_BLOCK: usize = 128;
/// FP4 scale group: one ue8m0 scale per 32 consecutive inputs.
const FP4_BLOCK: usize = 32;
/// `sqrt(3)`: a uniform distribution on ±(std·√3) has standard deviation `std`.
const SQRT_3: f32 = 1.732_050_8;

/// The `config.json` of the tiny model, in the official inference form (`dim`, `n_layers`,
/// `compress_ratios`, …). The layer order is explicit because the Hugging Face default order is
/// refused by the loader; the last ratio belongs to the MTP layer. The first three layers (SWA,
/// CSA, HCA) are hash-routed and the next three (CSA, HCA, SWA) score-routed, so each attention
/// kind meets each router. YaRN's `original_seq_len` × `rope_factor` gives 8192 positions, room
/// for 4096-token prompts plus their completions.
pub fn config_json() -> Value {
    json!({
        "vocab_size": 4096,
        "dim": 160,
        "moe_inter_dim": 32,
        "n_layers": 6,
        "n_hash_layers": 3,
        "n_mtp_layers": 1,
        "n_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_activated_experts": 2,
        "score_func": "sqrtsoftplus",
        "route_scale": 1.5,
        "swiglu_limit": 10.0,
        "q_lora_rank": 48,
        "head_dim": 64,
        "rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 32,
        "window_size": 64,
        "original_seq_len": 512,
        "rope_theta": 10000.0,
        "rope_factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 16,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "norm_eps": 1e-6,
        "dtype": "fp8",
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
        "compress_rope_theta": 160000.0,
        "compress_ratios": [0, 4, 128, 4, 128, 0, 0]
    })
}

/// Writes (if absent or different) the tiny model's `config.json`, `model.safetensors`,
/// `tokenizer.json` and `tokenizer_config.json` into
/// `dir`, creating it. Returns `true` when it wrote a file and `false` when an identical
/// checkpoint was already there, so callers can say whether they generated one.
///
/// Existing files are compared byte for byte with what would be written, so a truncated,
/// edited or outdated checkpoint is replaced rather than trusted. Each file is written to a
/// hidden temporary name in `dir`, synced, then renamed over the old one: a write that is
/// interrupted leaves the previous file (or none), never a partial file under the real name.
/// Errors name the path and suggest `DSV4_DEMO_MODEL_DIR`, the variable the demo reads.
pub fn write_checkpoint(dir: &Path) -> Result<bool> {
    let config = config_json();
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| Error::internal(format!("cannot render the tiny config.json: {e}")))?
        + "\n";
    let parsed = ModelConfig::from_json_str(&text, "dsv4-tiny")
        .map_err(|e| Error::internal(format!("the tiny config.json does not parse: {e}")))?;
    let weights = safetensors_bytes(&parsed)?;
    prepare_dir(dir)?;
    let mut wrote = false;
    // Weights first: until both files are in place, a config.json from this writer never sits
    // next to weights it does not describe.
    for (name, bytes) in [
        ("model.safetensors", weights.as_slice()),
        ("tokenizer.json", TOKENIZER_JSON),
        ("tokenizer_config.json", TOKENIZER_CONFIG_JSON),
        ("config.json", text.as_bytes()),
    ] {
        let path = dir.join(name);
        if holds(&path, bytes) {
            continue;
        }
        replace(&path, bytes)?;
        wrote = true;
    }
    if wrote {
        // Make the renames durable; a failure here only risks redoing the write next time.
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(wrote)
}

/// Creates `dir` and refuses one where the loader would read other weights than ours.
fn prepare_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| {
        Error::io(format!(
            "cannot create {}: {e}: set DSV4_DEMO_MODEL_DIR to a writable directory",
            dir.display()
        ))
    })?;
    // The loader prefers a shard index over model.safetensors.
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        return Err(Error::io(format!(
            "{} exists, so the loader would read the checkpoint it lists instead of the tiny \
             model: remove it or set DSV4_DEMO_MODEL_DIR to an empty directory",
            index.display()
        )));
    }
    Ok(())
}

/// Whether `path` already holds exactly `bytes` (the size is checked before reading).
fn holds(path: &Path, bytes: &[u8]) -> bool {
    let same_size = fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64);
    same_size && fs::read(path).is_ok_and(|existing| existing == bytes)
}

/// Writes `bytes` to a temporary sibling, syncs it and renames it over `path`.
fn replace(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The process id keeps two concurrent writers apart; the `.tmp` suffix keeps the loader's
    // `*.safetensors` scan from ever picking the file up.
    let temp: PathBuf = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = fs::File::create(&temp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        fs::rename(&temp, path)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&temp);
        Error::io(format!(
            "cannot write {} ({} bytes): {e}: set DSV4_DEMO_MODEL_DIR to a writable directory \
             with enough free space",
            path.display(),
            bytes.len()
        ))
    })
}

/// Every tensor the config implies, stored as the official release stores it, serialised.
fn safetensors_bytes(config: &ModelConfig) -> Result<Vec<u8>> {
    let mut stored: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for spec in checkpoint_tensors(config) {
        store(&spec, config, &mut stored);
    }
    let views = stored
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes).map(|view| (name.clone(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::internal(format!("a tiny-model tensor is inconsistent: {e}")))?;
    // No `__metadata__`: its map would be serialised in hash order and break byte equality.
    safetensors::serialize(views, None)
        .map_err(|e| Error::internal(format!("cannot serialise the tiny model: {e}")))
}

/// Appends the stored form of one tensor (and its scale, when quantised).
fn store(
    spec: &TensorSpec,
    config: &ModelConfig,
    out: &mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
) {
    let mut rng = fastrand::Rng::with_seed(SEED ^ fnv1a(&spec.name));
    let (rows, cols) = match spec.shape.as_slice() {
        [r, c] => (*r, *c),
        _ => (spec.elements() as usize, 1),
    };
    let scale_name = || {
        let base = spec.name.strip_suffix(".weight").unwrap_or(&spec.name);
        format!("{base}.scale")
    };
    match spec.storage {
        Storage::Index => {
            let table = hash_table(&mut rng, rows, cols, config.n_routed_experts);
            let bytes = table.iter().flat_map(|v| v.to_le_bytes()).collect();
            out.push((spec.name.clone(), Dtype::I64, spec.shape.clone(), bytes));
        }
        Storage::Float32 => {
            let bytes = values(spec, &mut rng)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            out.push((spec.name.clone(), Dtype::F32, spec.shape.clone(), bytes));
        }
        Storage::Unquantized => {
            let bytes = values(spec, &mut rng)
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect();
            out.push((spec.name.clone(), Dtype::BF16, spec.shape.clone(), bytes));
        }
        Storage::Linear => {
            let (q, scales) = fp8_blocks(&values(spec, &mut rng), rows, cols);
            out.push((spec.name.clone(), Dtype::F8_E4M3, vec![rows, cols], q));
            let grid = vec![rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
            out.push((scale_name(), Dtype::F8_E8M0, grid, scales));
        }
        Storage::Expert => {
            let (packed, scales) = fp4_rows(&values(spec, &mut rng), rows, cols);
            // The official release stores packed FP4 as I8.
            out.push((spec.name.clone(), Dtype::I8, vec![rows, cols / 2], packed));
            let grid = vec![rows, cols / FP4_BLOCK];
            out.push((scale_name(), Dtype::F8_E8M0, grid, scales));
        }
    }
}

/// Random values by the rules transformers' reference fixtures use (tests/reference), with
/// uniform instead of normal draws of the same spread: parameters transformers initialises to
/// constants get random values so that every input of the forward pass matters, and matrices
/// get a spread of `1/sqrt(fan_in)` so activations keep their scale through the layers and the
/// logits are neither flat nor dominated by one token.
fn values(spec: &TensorSpec, rng: &mut fastrand::Rng) -> Vec<f32> {
    let name = spec.name.as_str();
    let last = name.rsplit('.').next().unwrap_or(name);
    let hc = last.starts_with("hc_");
    let (centre, std) = if name.ends_with("norm.weight") {
        (1.0, 0.1)
    } else if last == "attn_sink" {
        (0.0, 1.0)
    } else if last == "ape" || (hc && last.ends_with("_base")) {
        (0.0, 0.5)
    } else if hc && last.ends_with("_scale") {
        // Uniform on [0.5, 1.5).
        (1.0, 0.5 / SQRT_3)
    } else if hc && last.ends_with("_fn") {
        (0.0, 0.03)
    } else if let [_, fan_in] = spec.shape.as_slice() {
        (0.0, 1.0 / (*fan_in as f32).sqrt())
    } else {
        (0.0, 0.1)
    };
    let half_width = std * SQRT_3;
    (0..spec.elements())
        .map(|_| centre + (2.0 * rng.f32() - 1.0) * half_width)
        .collect()
}

/// `tid2eid`: for each token, `k` distinct experts (a partial Fisher–Yates shuffle).
fn hash_table(rng: &mut fastrand::Rng, tokens: usize, k: usize, experts: usize) -> Vec<i64> {
    let mut table = Vec::with_capacity(tokens * k);
    let mut perm: Vec<i64> = (0..experts as i64).collect();
    for _ in 0..tokens {
        for j in 0..k.min(experts) {
            let pick = rng.usize(j..experts);
            perm.swap(j, pick);
        }
        table.extend_from_slice(&perm[..k]);
    }
    table
}

/// The e8m0 exponent byte of the smallest power of two `s` with `amax / s <= top`.
fn e8m0_for(amax: f32, top: f32) -> u8 {
    let exponent = ceil_log2(amax.max(f32::MIN_POSITIVE) / top);
    (exponent + 127).clamp(0, 254) as u8
}

/// FP8 e4m3 values of a `[rows, cols]` matrix and its `[ceil(rows/128), ceil(cols/128)]` ue8m0
/// scales; edge blocks are narrower when a side is not a multiple of 128.
fn fp8_blocks(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let (grid_rows, grid_cols) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let mut q = vec![0u8; rows * cols];
    let mut scales = vec![0u8; grid_rows * grid_cols];
    for bi in 0..grid_rows {
        let rs = bi * FP8_BLOCK..((bi + 1) * FP8_BLOCK).min(rows);
        for bj in 0..grid_cols {
            let cs = bj * FP8_BLOCK..((bj + 1) * FP8_BLOCK).min(cols);
            let amax = rs
                .clone()
                .flat_map(|r| &w[r * cols + cs.start..r * cols + cs.end])
                .fold(0f32, |m, v| m.max(v.abs()));
            let byte = e8m0_for(amax, 448.0);
            let scale = e8m0_decode(byte);
            scales[bi * grid_cols + bj] = byte;
            for r in rs.clone() {
                for c in cs.clone() {
                    q[r * cols + c] = e4m3_encode((w[r * cols + c] / scale).clamp(-448.0, 448.0));
                }
            }
        }
    }
    (q, scales)
}

/// FP4 e2m1 codes of a `[rows, cols]` matrix packed `[rows, cols/2]` (element 2j in the low
/// nibble) and its `[rows, cols/32]` ue8m0 scales.
fn fp4_rows(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut packed = Vec::with_capacity(rows * cols / 2);
    let mut scales = Vec::with_capacity(rows * cols / FP4_BLOCK);
    for row in w.chunks_exact(cols).take(rows) {
        for group in row.chunks_exact(FP4_BLOCK) {
            let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
            let byte = e8m0_for(amax, 6.0);
            let scale = e8m0_decode(byte);
            scales.push(byte);
            let code = |v: f32| e2m1_encode((v / scale).clamp(-6.0, 6.0));
            packed.extend(
                group
                    .chunks_exact(2)
                    .map(|pair| code(pair[0]) | (code(pair[1]) << 4)),
            );
        }
    }
    (packed, scales)
}

/// FNV-1a: a stable per-name seed offset (std's hashers may change between releases).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{WeightData, WeightFormat};

    #[test]
    fn quantised_blocks_decode_close_to_their_values() {
        let mut rng = fastrand::Rng::with_seed(7);
        let (rows, cols) = (130, 160);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.f32() - 0.5).collect();
        let (q, s) = fp8_blocks(&w, rows, cols);
        let scales: Vec<f32> = s.iter().map(|&b| e8m0_decode(b)).collect();
        let fp8 = WeightFormat::Fp8E4m3 {
            block: [FP8_BLOCK, FP8_BLOCK],
        };
        let back = WeightData::whole(fp8, &q, scales, rows, cols).to_f32();
        let worst = w
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 0.5 / 16.0, "fp8 error {worst}");
        let (packed, s) = fp4_rows(&w, rows, cols);
        let scales: Vec<f32> = s.iter().map(|&b| e8m0_decode(b)).collect();
        let fp4 = WeightFormat::Fp4E2m1 { block: FP4_BLOCK };
        let back = WeightData::whole(fp4, &packed, scales, rows, cols).to_f32();
        let worst = w
            .iter()
            .zip(&back)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(worst <= 0.125 + 1e-6, "fp4 error {worst}");
    }

    #[test]
    fn hash_rows_hold_distinct_experts() {
        let table = hash_table(&mut fastrand::Rng::with_seed(1), 100, 2, 8);
        assert!(table
            .chunks(2)
            .all(|r| r[0] != r[1] && r.iter().all(|&e| (0..8).contains(&e))));
    }
}
