//! Resident weight bytes per rank, by dtype, summed from the checkpoint's tensor inventory.

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::config::params::{Backend, Params, WeightDtype};
use crate::config::tensors::{checkpoint_tensors, stored_parts, Dtype, Shard, Storage};
use crate::config::ModelConfig;

/// Recent answers of [`per_rank`]: the inventory of a V4 checkpoint names ~10^5 tensors
/// (0.1 s to build natively, seconds under valgrind) and every `dsv4_plan` and engine creation
/// asks again for the same few models. Keyed by everything the answer depends on.
static RECENT: Mutex<Vec<(String, BTreeMap<Dtype, u64>)>> = Mutex::new(Vec::new());
const RECENT_MAX: usize = 16;

/// Bytes one rank holds, by dtype. The CPU backend dequantises every matrix to
/// `model.weight_dtype` at load or keeps them as stored (`native`, what `auto` means for an
/// FP8/FP4 checkpoint); the CUDA backend keeps the checkpoint's FP8/FP4 format.
pub fn per_rank(model: &ModelConfig, params: &Params) -> BTreeMap<Dtype, u64> {
    let key = format!(
        "{model:?}|{:?}|{:?}|{:?}|{:?}",
        params.parallel.tp, params.parallel.ep, params.model.weight_dtype, params.backend
    );
    let mut recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, found)) = recent.iter().find(|(k, _)| *k == key) {
        return found.clone();
    }
    drop(recent);
    let bytes = compute(model, params);
    recent = RECENT.lock().unwrap_or_else(|e| e.into_inner());
    if recent.len() == RECENT_MAX {
        recent.remove(0);
    }
    recent.push((key, bytes.clone()));
    bytes
}

fn compute(model: &ModelConfig, params: &Params) -> BTreeMap<Dtype, u64> {
    let (tp, ep) = (u64::from(params.parallel.tp), u64::from(params.parallel.ep));
    let resident = match params.model.weight_dtype.resolve(model) {
        WeightDtype::F32 => Some(Dtype::F32),
        WeightDtype::Bf16 => Some(Dtype::Bf16),
        WeightDtype::Native | WeightDtype::Auto => None,
    };
    let mut bytes = BTreeMap::new();
    for spec in checkpoint_tensors(model) {
        let divisor = match spec.shard {
            Shard::Replicated => 1,
            Shard::Tensor => tp,
            Shard::Expert if ep > 1 => ep,
            Shard::Expert => tp,
        };
        let parts = match (params.backend, spec.storage, resident) {
            (
                Backend::Cpu,
                Storage::Linear | Storage::Expert | Storage::Unquantized,
                Some(resident),
            ) => vec![(resident, resident.bytes(spec.elements()))],
            (Backend::Cpu, _, None) => native_cpu(&spec, model),
            _ => stored_parts(&spec, model),
        };
        for (dtype, b) in parts {
            *bytes.entry(dtype).or_insert(0) += b.div_ceil(divisor);
        }
    }
    bytes
}

/// What the CPU backend holds of one tensor with `model.weight_dtype = native`: FP8 and FP4 as
/// stored, except that FP8's 128 × 128 scale tiles are repeated on each of their rows (one
/// e8m0 byte per row per 128 columns); f16 widened to f32.
fn native_cpu(spec: &crate::config::tensors::TensorSpec, model: &ModelConfig) -> Vec<(Dtype, u64)> {
    stored_parts(spec, model)
        .into_iter()
        .map(|(dtype, bytes)| match (dtype, spec.shape.as_slice()) {
            (Dtype::E8m0, [out, inner]) if spec.storage != Storage::Expert => {
                let block = match model.dense_format {
                    crate::config::model::DenseFormat::Fp8Block { block } => block[1],
                    _ => 128,
                };
                (Dtype::E8m0, (*out * inner.div_ceil(block)) as u64)
            }
            (Dtype::F16, _) => (Dtype::F32, 2 * bytes),
            _ => (dtype, bytes),
        })
        .collect()
}
