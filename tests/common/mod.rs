//! Shared helpers of the integration tests: fixtures, models and KV pools sized by the planner.
#![allow(dead_code)]

pub mod books;
pub mod fault_proxy;
pub mod machine;
pub mod pd_node;
pub mod requests;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::{Params, WeightDtype};
use dsv4::config::ModelConfig;
use dsv4::kv::{KvPools, SeqKv};
use dsv4::model::{Chunk, Logits, Model};
use dsv4::plan::{self, Plan};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde_json::{json, Value};

pub fn fixture(parts: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(parts)
}

/// `input_ids` of a fixture's golden file.
pub fn ids(name: &str) -> Vec<u32> {
    let bytes = std::fs::read(fixture(name).join("golden.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

pub fn load_model(dir: &Path, dtype: WeightDtype, threads: usize) -> Model<CpuBackend> {
    let config = ModelConfig::load(dir).unwrap();
    Model::load(
        dir,
        config,
        Arc::new(CpuBackend::new(threads).unwrap()),
        dtype,
    )
    .unwrap()
}

/// A fixture's f32 model (Hugging Face naming, f32 weights).
pub fn model(name: &str) -> Model<CpuBackend> {
    load_model(&fixture(name).join("hf-f32"), WeightDtype::F32, 2)
}

fn test_params(model_path: Option<&Path>, kv: Value) -> Params {
    let mut doc = json!({
        "kv": {"device_memory_bytes": "24MiB", "max_running_requests": 8, "page_size": 128}
    });
    if let Some(dir) = model_path {
        doc["model_path"] = dir.to_str().unwrap().into();
    }
    if let Value::Object(extra) = kv {
        for (k, v) in extra {
            doc["kv"][k] = v;
        }
    }
    Params::from_value(&doc).unwrap()
}

/// The plan for the checkpoint at `dir` with small test pools (128-token pages, 8 slots,
/// 24 MiB), `kv` merged over those.
pub fn plan_for(dir: &Path, kv: Value) -> Plan {
    plan::plan(&test_params(Some(dir), kv)).unwrap()
}

/// The same for a loaded model.
pub fn plan_for_model(model: &Model<CpuBackend>, kv: Value) -> Plan {
    plan::plan_with(
        &test_params(None, kv),
        model.config.clone(),
        &plan::numa::SystemProbe::new(),
    )
    .unwrap()
}

/// The plan for a loaded model with a whole params document (`kv` and `hicache` sections
/// merged over the test defaults).
pub fn plan_for_model_doc(model: &Model<CpuBackend>, extra: Value) -> Plan {
    let mut params = test_params(None, extra.get("kv").cloned().unwrap_or(json!({})));
    if let Some(h) = extra.get("hicache") {
        let mut doc = params.to_json_value();
        doc["hicache"] = h.clone();
        params = Params::from_value(&doc).unwrap();
    }
    plan::plan_with(
        &params,
        model.config.clone(),
        &plan::numa::SystemProbe::new(),
    )
    .unwrap()
}

/// Pools for `model` on the model's own backend, `kv` params merged over the test defaults.
pub fn pools_with(model: &Model<CpuBackend>, kv: Value) -> KvPools<CpuBackend> {
    KvPools::new(model.backend_arc(), &plan_for_model(model, kv)).unwrap()
}

pub fn pools(model: &Model<CpuBackend>) -> KvPools<CpuBackend> {
    pools_with(model, json!({}))
}

/// Runs `tokens` as one chunk of `seq` (reserving its pages) and returns the logits asked for.
pub fn step(
    model: &Model<CpuBackend>,
    kv: &mut KvPools<CpuBackend>,
    seq: &mut SeqKv,
    tokens: &[u32],
    logits: Logits,
) -> Vec<f32> {
    kv.reserve(seq, seq.position() + tokens.len()).unwrap();
    model
        .forward(
            kv,
            &mut [Chunk {
                tokens,
                seq,
                logits,
            }],
        )
        .unwrap()
        .remove(0)
}

/// Every position's logits of `ids` in one pass on a fresh sequence.
pub fn full(model: &Model<CpuBackend>, kv: &mut KvPools<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut seq = kv.open().unwrap();
    let out = step(model, kv, &mut seq, ids, Logits::All);
    kv.close(seq);
    out
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Prefills `prompt` for `req` through the cache (chunks cut at its snapshot points, pages
/// reserved per chunk, snapshots captured); the last position's logits. A page shortage is
/// returned, anything else unwraps.
pub fn prefill(
    model: &Model<CpuBackend>,
    cache: &mut dsv4::kv::PrefixCache<CpuBackend>,
    req: &mut dsv4::kv::Request,
    prompt: &[u32],
) -> dsv4::error::Result<Vec<f32>> {
    let mut logits = Vec::new();
    while req.position() < prompt.len() {
        let (pos, end) = (req.position(), cache.chunk_limit(req));
        cache.reserve(req, end)?;
        logits = model
            .forward(
                cache.pools_mut(),
                &mut [Chunk {
                    tokens: &prompt[pos..end],
                    seq: req.kv_mut(),
                    logits: Logits::Last,
                }],
            )
            .unwrap()
            .remove(0);
        cache.after_step(req, &prompt[..end]).unwrap();
    }
    Ok(logits)
}

/// A safetensors file's tensors by name: (dtype, shape, bytes).
pub type TensorMap = std::collections::HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Rewrites the safetensors file at `path` after `edit` changes its tensors.
pub fn edit_safetensors(path: &Path, edit: impl FnOnce(&mut TensorMap)) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: TensorMap = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, (t.dtype(), t.shape().to_vec(), t.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Messages quote hostile text by its start and length, so they stay readable.
pub fn assert_short(err: &dsv4::Error) {
    assert!(
        err.message().len() < 10_000,
        "a {}-byte message: {:.300}",
        err.message().len(),
        err.message()
    );
}

/// The `pd` params of an engine in `role` on `transport` ("tcp" or "ucx"), listening on a free
/// loopback port.
pub fn pd_doc(role: &str, transport: &str) -> Value {
    json!({"role": role, "pd": {"transport": transport, "listen": format!("{transport}://127.0.0.1:0")}})
}

/// A file of the test certificates for `pd.tls` (tests/fixtures/tls/README.md).
pub fn tls_fixture(name: &str) -> String {
    format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// A `pd.auth_key_file` holding `secrets`, a line each, named `name` in a directory of this
/// test process's own.
pub fn key_file(name: &str, secrets: &[&str]) -> String {
    let dir = std::env::temp_dir().join(format!("dsv4-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, secrets.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

/// `doc` with `pd.ucx_rma_emulated` set: over UCX a decode takes states by RMA even where UCX
/// emulates puts with messages (its tcp transport: the only RMA these machines have), so the
/// RMA path is what runs. Ignored over TCP.
pub fn with_emulated_rma(mut doc: Value) -> Value {
    requests::merge(
        &mut doc,
        serde_json::json!({"pd": {"ucx_rma_emulated": true}}),
    );
    doc
}

/// The enclosed items (helpers and tests) once per PD transport: in module `tcp` and in module
/// `ucx`, each with `TRANSPORT` ("tcp" or "ucx") in scope. UCX runs on its tcp, self and
/// shared-memory transports here (no RDMA on these machines): `UCX_TLS` unset lets UCX pick
/// among those it finds.
#[macro_export]
macro_rules! on_both_transports {
    ($($item:item)*) => {
        mod tcp {
            #[allow(unused_imports)]
            use super::*;
            pub const TRANSPORT: &str = "tcp";
            $($item)*
        }
        mod ucx {
            #[allow(unused_imports)]
            use super::*;
            pub const TRANSPORT: &str = "ucx";
            $($item)*
        }
    };
}
