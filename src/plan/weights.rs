//! Resident weight bytes per rank, by dtype, summed from the checkpoint's tensor inventory.

use std::collections::BTreeMap;

use crate::config::params::{Backend, Params, WeightDtype};
use crate::config::tensors::{checkpoint_tensors, stored_parts, Dtype, Shard, Storage};
use crate::config::ModelConfig;

/// Bytes one rank holds, by dtype. The CPU backend dequantises every matrix to
/// `model.weight_dtype` at load; the CUDA backend keeps the checkpoint's FP8/FP4 format.
pub fn per_rank(model: &ModelConfig, params: &Params) -> BTreeMap<Dtype, u64> {
    let (tp, ep) = (u64::from(params.parallel.tp), u64::from(params.parallel.ep));
    let resident = match params.model.weight_dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::Bf16,
    };
    let mut bytes = BTreeMap::new();
    for spec in checkpoint_tensors(model) {
        let divisor = match spec.shard {
            Shard::Replicated => 1,
            Shard::Tensor => tp,
            Shard::Expert if ep > 1 => ep,
            Shard::Expert => tp,
        };
        let parts = match (params.backend, spec.storage) {
            (Backend::Cpu, Storage::Linear | Storage::Expert | Storage::Unquantized) => {
                vec![(resident, resident.bytes(spec.elements()))]
            }
            _ => stored_parts(&spec, model),
        };
        for (dtype, b) in parts {
            *bytes.entry(dtype).or_insert(0) += b.div_ceil(divisor);
        }
    }
    bytes
}
