//! The CUDA backend (issue "CUDA 1" builds its foundation): cudarc with every CUDA library
//! loaded at run time, so the crate builds and runs without a toolkit; `probe` finds what this
//! machine has before cudarc can panic.

pub mod device;
#[cfg(test)]
mod emulate;
pub mod launch;

pub mod nvrtc;
pub mod probe;
pub mod sources;

pub use device::CudaBackend;

/// Why an engine cannot run on CUDA on this machine yet: the first missing library, driver or
/// device, with what provides it; else the part of the forward pass still to come.
pub fn not_ready(devices: &[u32]) -> String {
    let found = probe::gpus(devices).and_then(|gpus| {
        probe::require(
            &[probe::NVRTC, probe::CUBLAS, probe::CUBLASLT],
            probe::lib_dir().as_deref(),
        )
        .map(|()| gpus)
    });
    match found {
        Err(e) => format!(
            "`backend` = cuda: {}",
            e.message().trim_start_matches("backend = cuda: ")
        ),
        Ok(gpus) => format!(
            "`backend` = cuda on GPU {} ({}, {}): the CUDA libraries and the device are here, \
             but the forward pass's attention, compressor, indexer, mHC and MoE kernels land \
             with \"CUDA 2\"; use backend = cpu for now",
            gpus[0].ordinal,
            gpus[0].name,
            gpus[0].arch()
        ),
    }
}
