//! What this machine has for the CUDA backend, found without letting cudarc panic: cudarc
//! loads the driver, NVRTC and cuBLAS by name at their first call and panics when one is
//! missing, so each library is opened here first (by its CUDA 13 soname, or from
//! `DSV4_CUDA_LIB_DIR`), and every driver call runs under `catch_unwind`.
//!
//! A missing piece is `DSV4_ERR_UNSUPPORTED` naming it and what provides it.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use crate::error::{Error, ErrorKind, Result};

/// One CUDA library the backend needs: its soname and what provides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Library {
    pub soname: &'static str,
    pub provider: &'static str,
}

/// The driver: the NVIDIA kernel driver's user-space library.
pub const DRIVER: Library = Library {
    soname: "libcuda.so.1",
    provider: "the NVIDIA driver (R580 or newer for CUDA 13)",
};
/// Kernels are compiled at run time for the device found.
pub const NVRTC: Library = Library {
    soname: "libnvrtc.so.13",
    provider: "the CUDA 13 NVRTC library (pip: nvidia-cuda-nvrtc==13.*, or the CUDA 13 toolkit)",
};
pub const CUBLAS: Library = Library {
    soname: "libcublas.so.13",
    provider: "CUDA 13 cuBLAS (pip: nvidia-cublas==13.*, or the CUDA 13 toolkit)",
};
pub const CUBLASLT: Library = Library {
    soname: "libcublasLt.so.13",
    provider: "CUDA 13 cuBLASLt (pip: nvidia-cublas==13.*, or the CUDA 13 toolkit)",
};

/// The environment variable naming a directory to load the CUDA libraries from (for example a
/// pip wheel's `site-packages/nvidia/cu13/lib`) when they are not on the loader's path.
pub const LIB_DIR_ENV: &str = "DSV4_CUDA_LIB_DIR";

/// `dlopen(name, RTLD_NOW | RTLD_GLOBAL)`, or dlerror's message. The handle is deliberately
/// never closed: the library stays loaded for cudarc, which later opens it by its soname and
/// finds this copy.
pub fn dlopen_global(name: &Path) -> std::result::Result<*mut std::ffi::c_void, String> {
    let c = CString::new(name.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{} contains a NUL byte", name.display()))?;
    // SAFETY: `c` is a valid NUL-terminated path; loading a shared library runs its
    // initialisers, which is what loading a CUDA library means.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns NULL or a valid C string owned by libc, read at once.
        let why = unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown error".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        };
        return Err(why);
    }
    Ok(handle)
}

/// Opens `lib` globally: from `dir` when given (so cudarc's later open by name finds the same
/// library already loaded), else by its soname.
pub fn open(lib: Library, dir: Option<&Path>) -> std::result::Result<PathBuf, String> {
    let path = match dir {
        Some(d) => d.join(lib.soname),
        None => PathBuf::from(lib.soname),
    };
    dlopen_global(&path).map(|_| path)
}

/// The directory from [`LIB_DIR_ENV`], if set.
pub fn lib_dir() -> Option<PathBuf> {
    std::env::var_os(LIB_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Opens every library in `libs` (from `dir` when given), or says which are missing and what
/// provides each.
pub fn require(libs: &[Library], dir: Option<&Path>) -> Result<()> {
    let missing: Vec<String> = libs
        .iter()
        .filter_map(|&lib| {
            open(lib, dir).err().map(|why| {
                format!(
                    "{} is not loadable ({why}); it comes with {}",
                    lib.soname, lib.provider
                )
            })
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let place = match dir {
        Some(d) => format!("{LIB_DIR_ENV} = {}", d.display()),
        None => {
            format!("the loader's path (LD_LIBRARY_PATH; or set {LIB_DIR_ENV} to the directory)")
        }
    };
    Err(Error::new(
        ErrorKind::Unsupported,
        format!(
            "backend = cuda: {} (looked in {place}); install it, or use backend = cpu",
            missing.join("; ")
        ),
    ))
}

/// One visible GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub ordinal: u32,
    pub name: String,
    /// Compute capability (major, minor): 9.0 for Hopper, 10.0 for Blackwell.
    pub capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl Gpu {
    /// The NVRTC architecture name kernels are compiled for (`sm_90`, `sm_100`, …).
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }
}

/// Runs a driver call, turning a cudarc panic (a missing symbol) into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, String>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Error::new(
            ErrorKind::Unsupported,
            format!("backend = cuda: {what} failed: {e}"),
        )),
        Err(p) => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "backend = cuda: {what} failed inside the CUDA bindings ({}): the driver library \
                 may be older than CUDA 13 (R580 or newer is needed)",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ),
        )),
    }
}

/// The GPUs with these ordinals (`devices`; empty = device 0), once the driver library was
/// found: their names, compute capabilities and memory. `DSV4_ERR_UNSUPPORTED` when the driver
/// library is missing, no GPU is visible, or an ordinal is past the last one.
pub fn gpus(devices: &[u32]) -> Result<Vec<Gpu>> {
    require(&[DRIVER], lib_dir().as_deref())?;
    let count = guarded("cuInit / cuDeviceGetCount", || {
        cudarc::driver::CudaContext::device_count().map_err(|e| e.to_string())
    })?;
    if count <= 0 {
        return Err(Error::new(
            ErrorKind::Unsupported,
            "backend = cuda: the CUDA driver sees no GPU (check CUDA_VISIBLE_DEVICES and that \
             the container was started with GPU access); use backend = cpu",
        ));
    }
    let wanted: Vec<u32> = if devices.is_empty() {
        vec![0]
    } else {
        devices.to_vec()
    };
    wanted
        .iter()
        .map(|&ordinal| {
            if ordinal as i32 >= count {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!(
                        "backend = cuda: `devices` names GPU {ordinal} but the driver sees \
                         {count} (0..{}): check `devices` and CUDA_VISIBLE_DEVICES",
                        count - 1
                    ),
                ));
            }
            guarded(&format!("opening GPU {ordinal}"), || {
                let ctx = cudarc::driver::CudaContext::new(ordinal as usize)
                    .map_err(|e| e.to_string())?;
                let (free, total) = ctx.mem_get_info().map_err(|e| e.to_string())?;
                Ok(Gpu {
                    ordinal,
                    name: ctx.name().map_err(|e| e.to_string())?,
                    capability: ctx.compute_capability().map_err(|e| e.to_string())?,
                    total_bytes: total as u64,
                    free_bytes: free as u64,
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named_with_what_provides_it() {
        let dir = std::env::temp_dir().join("dsv4-no-cuda-here");
        let e = require(&[NVRTC, CUBLAS], Some(&dir)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let m = e.message();
        assert!(m.contains("libnvrtc.so.13 is not loadable"), "{m}");
        assert!(m.contains("nvidia-cuda-nvrtc"), "{m}");
        assert!(m.contains("libcublas.so.13 is not loadable"), "{m}");
        assert!(m.contains("nvidia-cublas"), "{m}");
        assert!(m.contains(&dir.display().to_string()), "{m}");
        assert!(m.contains("backend = cpu"), "{m}");
    }

    #[test]
    fn the_probe_answers_on_any_machine() {
        // With a GPU this lists it; without a driver it names libcuda.so.1. Never a panic.
        match gpus(&[]) {
            Ok(g) => {
                assert!(!g.is_empty() && g[0].total_bytes > 0);
                println!(
                    "found {} ({}), {} bytes",
                    g[0].name,
                    g[0].arch(),
                    g[0].total_bytes
                );
            }
            Err(e) => {
                assert_eq!(e.kind(), ErrorKind::Unsupported);
                println!("no GPU here: {e}");
                assert!(e.message().contains("backend = cuda"), "{e}");
            }
        }
    }
}
