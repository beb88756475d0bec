//! The CUDA backend's ops against the CPU backend (the reference), one line per check:
//! `PASS name`, `FAIL name: why` or `SKIP name: why`. Without a GPU (no driver, no device, a
//! CUDA library missing) every check is SKIPPED with the reason — never passed. The GPU
//! machine runs this binary from the bundle (`scripts/gpu-check.sh`); `cargo test` runs it
//! here, where it skips.
//!
//! Tolerances, per check:
//! - copies (tensors, indices, pool bytes, regions, tier copies): bit-exact (memcpy);
//! - f32 GEMM (cuBLAS, TF32 off) against the CPU's f32 GEMM: both accumulate in f32 in
//!   different orders; for k-term dot products of values in [-1, 1] the difference is bounded
//!   by about k · 2⁻²⁴ · Σ|terms|, so |gpu − cpu| ≤ 1e-5 · (1 + Σ|x_i·w_i|) with k ≤ 4096.

use std::process::ExitCode;
use std::sync::Arc;

use dsv4::backend::cpu::CpuBackend;
use dsv4::backend::cuda::CudaBackend;
use dsv4::backend::{
    Backend, CopyDirection, CopyRegion, HostPtr, Precision, Ticket, TierCopy, WeightData,
    WeightFormat,
};
use dsv4::error::ErrorKind;

type Check = fn(&CudaBackend, &CpuBackend) -> Result<(), String>;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = fastrand::Rng::with_seed(seed);
    (0..n).map(|_| rng.f32() * 2.0 - 1.0).collect()
}

fn f32_matrix<'a>(bytes: &'a [u8], rows: usize, cols: usize) -> WeightData<'a> {
    WeightData::whole(WeightFormat::F32, bytes, Vec::new(), rows, cols)
}

fn e<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

fn tensors_and_indices_round_trip(g: &CudaBackend, _: &CpuBackend) -> Result<(), String> {
    let v = values(1 << 16, 1);
    let t = g.tensor(&v).map_err(e)?;
    if g.read(&t).map_err(e)? != v || g.len(&t) != v.len() {
        return Err("tensor bytes changed".into());
    }
    let ids: Vec<i32> = (0..5000).map(|i| i * 7 - 3).collect();
    if g.read_index(&g.index(&ids).map_err(e)?).map_err(e)? != ids {
        return Err("index bytes changed".into());
    }
    let z = g.read(&g.zeros(1000).map_err(e)?).map_err(e)?;
    if z.iter().any(|&x| x != 0.0) {
        return Err("zeros are not zero".into());
    }
    Ok(())
}

fn pool_bytes_match_memcpy(g: &CudaBackend, _: &CpuBackend) -> Result<(), String> {
    let n = 3 << 20;
    let mut b = g.alloc(n).map_err(e)?;
    let mut host = vec![0u8; n];
    g.read_bytes(&b, 0, &mut host).map_err(e)?;
    if host.iter().any(|&x| x != 0) {
        return Err("a fresh buffer is not zeroed".into());
    }
    let data: Vec<u8> = (0..100_000).map(|i| (i * 31 % 251) as u8).collect();
    g.write_bytes(&mut b, 12345, &data).map_err(e)?;
    let mut back = vec![0u8; data.len()];
    g.read_bytes(&b, 12345, &mut back).map_err(e)?;
    if back != data {
        return Err("bytes read back differ".into());
    }
    // Out of range: an error, not a fault.
    let err = g.write_bytes(&mut b, n - 10, &data).unwrap_err();
    if err.kind() != ErrorKind::Internal || !err.message().contains("outside a buffer") {
        return Err(format!("out-of-range write: {err}"));
    }
    // Regions between two buffers, against the same copies done on the host.
    let mut dst = g.alloc(n).map_err(e)?;
    let regions = [
        CopyRegion {
            src: 12345,
            dst: 0,
            len: 50_000,
        },
        CopyRegion {
            src: 62345,
            dst: n - 50_000,
            len: 50_000,
        },
    ];
    g.copy_regions(&b, &mut dst, &regions).map_err(e)?;
    let mut all = vec![0u8; n];
    g.read_bytes(&dst, 0, &mut all).map_err(e)?;
    let mut want = vec![0u8; n];
    want[..50_000].copy_from_slice(&data[..50_000]);
    want[n - 50_000..].copy_from_slice(&data[50_000..]);
    if all != want {
        return Err("copy_regions differs from memcpy".into());
    }
    // A tier round trip through host memory.
    let mut staging = vec![0u8; 100_000];
    let ticket = Ticket::new();
    g.copy_tier(
        &b,
        CopyDirection::ToHost,
        vec![TierCopy {
            pool_offset: 12345,
            host: HostPtr(staging.as_mut_ptr()),
            len: staging.len(),
        }],
        &ticket,
    )
    .map_err(e)?;
    ticket.seal();
    ticket.wait();
    if staging != data {
        return Err("tier copy to host differs".into());
    }
    let ticket = Ticket::new();
    g.copy_tier(
        &dst,
        CopyDirection::FromHost,
        vec![TierCopy {
            pool_offset: 1000,
            host: HostPtr(staging.as_mut_ptr()),
            len: staging.len(),
        }],
        &ticket,
    )
    .map_err(e)?;
    ticket.seal();
    ticket.wait();
    let mut back = vec![0u8; staging.len()];
    g.read_bytes(&dst, 1000, &mut back).map_err(e)?;
    if back != data || ticket.bytes() != data.len() as u64 {
        return Err("tier copy from host differs".into());
    }
    Ok(())
}

fn an_impossible_allocation_is_a_capacity_error(
    g: &CudaBackend,
    _: &CpuBackend,
) -> Result<(), String> {
    match g.alloc(1 << 50) {
        Err(err) if err.kind() == ErrorKind::Capacity => Ok(()),
        Err(err) => Err(format!("wrong error: {err}")),
        Ok(_) => Err("a 1 PiB allocation succeeded".into()),
    }
}

fn f32_gemm_matches_the_cpu(g: &CudaBackend, c: &CpuBackend) -> Result<(), String> {
    for (rows, out, inner) in [(1, 7, 5), (3, 257, 129), (64, 512, 4096), (129, 96, 1000)] {
        let x = values(rows * inner, 2);
        let w = values(out * inner, 3);
        let wb: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let data = f32_matrix(&wb, out, inner);
        let gm = g.matrix(&data, Precision::F32).map_err(e)?;
        let cm = c.matrix(&data, Precision::F32).map_err(e)?;
        let gy = g
            .read(&g.matmul(&g.tensor(&x).map_err(e)?, rows, &gm).map_err(e)?)
            .map_err(e)?;
        let cy = c
            .read(&c.matmul(&c.tensor(&x).map_err(e)?, rows, &cm).map_err(e)?)
            .map_err(e)?;
        for r in 0..rows {
            for o in 0..out {
                let mass: f32 = (0..inner)
                    .map(|i| (x[r * inner + i] * w[o * inner + i]).abs())
                    .sum();
                let (a, b) = (gy[r * out + o], cy[r * out + o]);
                if (a - b).abs() > 1e-5 * (1.0 + mass) {
                    return Err(format!(
                        "[{rows}×{inner}]·[{out}×{inner}]ᵀ at ({r}, {o}): gpu {a} cpu {b}"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn ops_still_to_come_are_refused_by_name(g: &CudaBackend, _: &CpuBackend) -> Result<(), String> {
    let x = g.tensor(&values(64, 4)).map_err(e)?;
    match g.swiglu(&x, 1, 32, 0.0) {
        Err(err) if err.kind() == ErrorKind::Unsupported && err.message().contains("SwiGLU") => {
            Ok(())
        }
        Err(err) => Err(format!("wrong error: {err}")),
        Ok(_) => Err("swiglu ran: move it out of this check".into()),
    }
}

/// The test fixture (a tiny DeepSeek V4 with every layer kind), from the repo root or the
/// crate's directory.
fn fixture() -> std::path::PathBuf {
    let here = std::path::Path::new("tests/fixtures/flash-like/hf-f32");
    if here.exists() {
        here.to_path_buf()
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(here)
    }
}

fn weights_upload_and_pools_match_the_plan(g: &CudaBackend, c: &CpuBackend) -> Result<(), String> {
    use dsv4::config::model::ModelConfig;
    use dsv4::config::params::{Params, WeightDtype};
    use dsv4::kv::KvPools;
    use dsv4::model::Model;
    let dir = fixture();
    let config = ModelConfig::load(&dir).map_err(e)?;
    // The backends are shared with the model and the pools (Arc), as in an engine; these
    // wrap fresh handles on the same GPU and CPU.
    let gpu = Arc::new(CudaBackend::new(g.gpu.ordinal).map_err(e)?);
    let cpu = Arc::new(CpuBackend::new(2).map_err(e)?);
    let _ = c;
    let on_gpu = Model::load(&dir, config.clone(), gpu.clone(), WeightDtype::F32).map_err(e)?;
    let on_cpu = Model::load(&dir, config.clone(), cpu.clone(), WeightDtype::F32).map_err(e)?;
    for key in ["parameters", "bytes_by_dtype", "mtp_layers_loaded"] {
        if on_gpu.info()[key] != on_cpu.info()[key] {
            return Err(format!(
                "{key}: gpu {} cpu {}",
                on_gpu.info()[key],
                on_cpu.info()[key]
            ));
        }
    }
    let params = Params::from_value(&serde_json::json!({
        "model_path": dir.to_str().unwrap(),
        "kv": {"device_memory_bytes": "24MiB", "max_running_requests": 8, "page_size": 128}
    }))
    .map_err(e)?;
    let plan = dsv4::plan::plan(&params).map_err(e)?;
    let gp = KvPools::new(gpu, &plan).map_err(e)?;
    let cp = KvPools::new(cpu, &plan).map_err(e)?;
    let sizes = |r: Vec<dsv4::kv::regions::PoolRegion>| -> Vec<(String, usize)> {
        r.iter().map(|r| (format!("{:?}", r.pool), r.len)).collect()
    };
    let (gs, cs) = (sizes(gp.regions()), sizes(cp.regions()));
    if gs != cs {
        return Err(format!("pool sizes: gpu {gs:?} cpu {cs:?}"));
    }
    Ok(())
}

const CHECKS: &[(&str, Check)] = &[
    (
        "weights_upload_and_pools_match_the_plan",
        weights_upload_and_pools_match_the_plan,
    ),
    (
        "tensors_and_indices_round_trip",
        tensors_and_indices_round_trip,
    ),
    ("pool_bytes_match_memcpy", pool_bytes_match_memcpy),
    (
        "an_impossible_allocation_is_a_capacity_error",
        an_impossible_allocation_is_a_capacity_error,
    ),
    ("f32_gemm_matches_the_cpu", f32_gemm_matches_the_cpu),
    (
        "ops_still_to_come_are_refused_by_name",
        ops_still_to_come_are_refused_by_name,
    ),
];

fn main() -> ExitCode {
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(err) => {
            for (name, _) in CHECKS {
                println!("SKIP gpu_ops::{name}: {err}");
            }
            println!("gpu_ops: 0 passed, 0 failed, {} skipped", CHECKS.len());
            return ExitCode::SUCCESS;
        }
    };
    println!(
        "gpu_ops: on GPU {} ({}, {}, {} MiB)",
        gpu.gpu.ordinal,
        gpu.gpu.name,
        gpu.gpu.arch(),
        gpu.gpu.total_bytes >> 20
    );
    let cpu = Arc::new(CpuBackend::new(2).expect("the CPU backend"));
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in CHECKS {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&gpu, &cpu)))
            .unwrap_or_else(|p| {
                Err(format!(
                    "panicked: {}",
                    p.downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                ))
            });
        match outcome {
            Ok(()) => {
                passed += 1;
                println!("PASS gpu_ops::{name}");
            }
            Err(why) => {
                failed += 1;
                println!("FAIL gpu_ops::{name}: {why}");
            }
        }
    }
    println!("gpu_ops: {passed} passed, {failed} failed, 0 skipped");
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
