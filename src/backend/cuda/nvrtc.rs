//! Compiling the kernels in `kernels/` with NVRTC, at run time, to CUBIN for one GPU
//! architecture (`sm_90`, `sm_100`, …), cached per architecture for the life of the process.
//!
//! NVRTC comes from CUDA 13's `libnvrtc.so.13`, which needs no GPU or driver (the pip package
//! `nvidia-cuda-nvrtc` carries it). cudarc `dlopen`s it by name and panics when it or a symbol is
//! missing, so [`load`] opens it first — from `DSV4_NVRTC_PATH` (the file),
//! `DSV4_CUDA_LIB_DIR` (its directory) or the library search path — with
//! `RTLD_NOW | RTLD_GLOBAL`, checks every symbol dsv4 calls and the version, and also loads the
//! `libnvrtc-builtins.so.13.x` beside it (NVRTC opens that by name when compiling, and a
//! directory outside the search path would not be found). cudarc's own `dlopen` by name then
//! finds the library already loaded. Every cudarc call runs under `catch_unwind`: no panic
//! escapes.
//!
//! Kernels are compiled without fast math (`--fmad=false --ftz=false --prec-div=true
//! --prec-sqrt=true`) so their arithmetic is the CPU backend's, operation for operation.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::nvrtc::sys;

use super::sources::{KernelSource, PRELUDE, PRELUDE_NAME, SOURCES};
use crate::error::{Error, ErrorKind, Result};

/// The library file NVRTC is loaded from (CUDA 13; cudarc is built with `cuda-13000`).
pub const LIBRARY: &str = "libnvrtc.so.13";
/// The pip package that provides it.
pub const PACKAGE: &str = "nvidia-cuda-nvrtc";
/// An explicit path to `libnvrtc.so.13`.
pub const PATH_VAR: &str = "DSV4_NVRTC_PATH";
/// A directory holding the CUDA 13 libraries (`libnvrtc.so.13` among them).
pub use super::probe::LIB_DIR_ENV as LIB_DIR_VAR;

/// The NVRTC major version dsv4 is built against.
const MAJOR: c_int = 13;

/// Compiler options besides the architecture: device code by default, C++17, and IEEE
/// arithmetic exactly as written (no contraction into FMAs, no flush to zero, correctly
/// rounded division and square root) so results match the CPU backend.
pub const OPTIONS: &[&str] = &[
    "-default-device",
    "--std=c++17",
    "--fmad=false",
    "--ftz=false",
    "--prec-div=true",
    "--prec-sqrt=true",
];

/// The symbols dsv4 calls (through cudarc): checked before cudarc can panic on one.
const SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcDestroyProgram",
];

/// Where to load `libnvrtc.so.13` from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// This file.
    Path(PathBuf),
    /// `libnvrtc.so.13` by name: the library search path (`LD_LIBRARY_PATH`, ld.so.cache).
    SearchPath,
}

impl Location {
    /// `DSV4_NVRTC_PATH` when set, else `DSV4_CUDA_LIB_DIR/libnvrtc.so.13`, else the search path.
    pub fn from_env() -> Self {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(path) = var(PATH_VAR) {
            Self::Path(PathBuf::from(path))
        } else if let Some(dir) = var(LIB_DIR_VAR) {
            Self::Path(PathBuf::from(dir).join(LIBRARY))
        } else {
            Self::SearchPath
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Path(p) => p.display().to_string(),
            Self::SearchPath => {
                format!("the library search path ({PATH_VAR} and {LIB_DIR_VAR} unset)")
            }
        }
    }
}

/// The NVRTC dsv4 loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nvrtc {
    pub major: i32,
    pub minor: i32,
    pub location: Location,
}

/// The error for a library that cannot be used, with how to get one.
fn missing(location: &Location, problem: &str) -> Error {
    Error::unsupported(format!(
        "the CUDA backend cannot load NVRTC ({LIBRARY}, CUDA 13) from {}: {problem}. It compiles \
         dsv4's kernels at run time: install the pip package {PACKAGE} for CUDA 13 \
         (pip install \"{PACKAGE}==13.0.*\") and set {PATH_VAR} to its \
         site-packages/nvidia/cu13/lib/{LIBRARY} (or {LIB_DIR_VAR} to that directory, or add it to \
         LD_LIBRARY_PATH)",
        location.describe()
    ))
}

fn dl_open(name: &str) -> std::result::Result<*mut c_void, String> {
    super::probe::dlopen_global(Path::new(name))
}

/// Opens `libnvrtc.so.13` at `location` and its builtins library, checks the symbols dsv4
/// calls, and returns its version. Touches no cudarc state (what the tests call directly).
pub(crate) fn open(location: &Location) -> Result<(i32, i32)> {
    let name = match location {
        Location::Path(p) => {
            if !p.is_file() {
                return Err(missing(location, "no such file"));
            }
            p.to_string_lossy().into_owned()
        }
        Location::SearchPath => LIBRARY.to_string(),
    };
    let handle = dl_open(&name).map_err(|e| missing(location, &e))?;
    for symbol in SYMBOLS {
        let c = CString::new(*symbol).expect("symbol names have no NUL");
        // SAFETY: `handle` is a live handle from dlopen and `c` a NUL-terminated name.
        if unsafe { libc::dlsym(handle, c.as_ptr()) }.is_null() {
            return Err(missing(
                location,
                &format!("the library has no symbol {symbol} (not NVRTC 13?)"),
            ));
        }
    }
    let version = CString::new("nvrtcVersion").expect("no NUL");
    // SAFETY: the symbol exists (checked above) and is NVRTC's
    // `nvrtcResult nvrtcVersion(int* major, int* minor)`.
    let (status, major, minor) = unsafe {
        let f: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            std::mem::transmute(libc::dlsym(handle, version.as_ptr()));
        let (mut major, mut minor) = (0, 0);
        let status = f(&mut major, &mut minor);
        (status, major, minor)
    };
    if status != 0 || major != MAJOR {
        return Err(missing(
            location,
            &format!("it is NVRTC {major}.{minor} (status {status}), not CUDA {MAJOR}"),
        ));
    }
    // NVRTC dlopens libnvrtc-builtins.so.<major>.<minor> by name while compiling.
    let builtins = format!("libnvrtc-builtins.so.{major}.{minor}");
    let builtins_path = match location {
        Location::Path(p) => p.with_file_name(&builtins).to_string_lossy().into_owned(),
        Location::SearchPath => builtins.clone(),
    };
    dl_open(&builtins_path).map_err(|e| {
        missing(
            location,
            &format!("its companion {builtins} does not load ({e})"),
        )
    })?;
    Ok((major, minor))
}

/// Runs `f` (cudarc calls) with panics turned into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        Err(Error::unsupported(format!(
            "NVRTC failed while {what}: {message}"
        )))
    })
}

static LOADED: OnceLock<Result<Nvrtc>> = OnceLock::new();

/// Loads NVRTC from [`Location::from_env`], once per process (the outcome is kept).
pub fn load() -> Result<Nvrtc> {
    load_from(&Location::from_env())
}

/// Loads NVRTC from `location` unless a library was already loaded (or failed to load) in this
/// process: the first call decides, as cudarc binds one library per process.
pub fn load_from(location: &Location) -> Result<Nvrtc> {
    LOADED
        .get_or_init(|| {
            let (major, minor) = open(location)?;
            // cudarc now opens its library by name; check it bound the same one.
            let bound = guarded("reading its version", || {
                let (mut ma, mut mi) = (0, 0);
                // SAFETY: plain out-pointers to two ints; the library and symbol exist (open).
                let status = unsafe { sys::nvrtcVersion(&mut ma, &mut mi) };
                if status == sys::nvrtcResult::NVRTC_SUCCESS {
                    Ok((ma, mi))
                } else {
                    Err(Error::unsupported(format!(
                        "nvrtcVersion failed: {status:?}"
                    )))
                }
            })?;
            if bound != (major, minor) {
                return Err(missing(
                    location,
                    &format!(
                        "cudarc bound a different NVRTC ({}.{}) found by name on the search \
                         path; remove it from the search path or point {PATH_VAR} at the one \
                         to use",
                        bound.0, bound.1
                    ),
                ));
            }
            Ok(Nvrtc {
                major,
                minor,
                location: location.clone(),
            })
        })
        .clone()
}

/// The NVRTC architecture name of a compute capability: `sm_90` for 9.0, `sm_100` for 10.0.
pub fn arch_for(major: u32, minor: u32) -> String {
    format!("sm_{major}{minor}")
}

/// Whether `arch` is an architecture name NVRTC takes (`sm_` and digits, an optional `a`/`f`).
fn valid_arch(arch: &str) -> bool {
    arch.strip_prefix("sm_").is_some_and(|rest| {
        let digits = rest.trim_end_matches(['a', 'f']);
        !digits.is_empty()
            && digits.len() + 1 >= rest.len()
            && digits.bytes().all(|b| b.is_ascii_digit())
    })
}

/// One compiled kernel file.
#[derive(Debug, Clone)]
pub struct Cubin {
    /// The file under `kernels/`.
    pub file: String,
    pub arch: String,
    pub bytes: Vec<u8>,
    /// NVRTC's log (warnings; empty when clean).
    pub log: String,
    /// Compile time.
    pub elapsed: Duration,
}

/// Compiles one kernel source (`file` names it in errors and in NVRTC's diagnostics as
/// `kernels/<file>`) to CUBIN for `arch`, with the prelude as its only header. A source that
/// does not compile is an Internal error (a dsv4 bug) carrying NVRTC's log; a missing or
/// unusable NVRTC, or an architecture it cannot target, is Unsupported.
pub fn compile_source(file: &str, source: &str, arch: &str) -> Result<Cubin> {
    if !valid_arch(arch) {
        return Err(Error::invalid_argument(format!(
            "{arch:?} is not a GPU architecture name NVRTC takes (sm_90, sm_100, ...)"
        )));
    }
    let nvrtc = load()?;
    let start = Instant::now();
    let program = format!("kernels/{file}");
    let (status, log, bytes) = guarded(&format!("compiling {program}"), || {
        // SAFETY: see `compile_raw`; every pointer handed to NVRTC outlives the program.
        Ok(unsafe { compile_raw(&program, source, arch) })
    })?;
    let log = log.trim_end_matches('\0').trim_end().to_string();
    use sys::nvrtcResult as R;
    match status {
        R::NVRTC_SUCCESS => Ok(Cubin {
            file: file.to_string(),
            arch: arch.to_string(),
            bytes,
            log,
            elapsed: start.elapsed(),
        }),
        R::NVRTC_ERROR_COMPILATION => Err(Error::internal(format!(
            "NVRTC {}.{} could not compile {program} for {arch} (a dsv4 bug):\n{log}",
            nvrtc.major, nvrtc.minor
        ))),
        R::NVRTC_ERROR_INVALID_OPTION => Err(Error::unsupported(format!(
            "NVRTC {}.{} cannot compile {program} for {arch} ({status:?}; an architecture this \
             NVRTC does not know? install a newer {PACKAGE}): {log}",
            nvrtc.major, nvrtc.minor
        ))),
        R::NVRTC_ERROR_BUILTIN_OPERATION_FAILURE => Err(Error::unsupported(format!(
            "NVRTC {}.{} could not compile {program} for {arch}: its builtins library is \
             missing or broken ({status:?}; reinstall {PACKAGE}): {log}",
            nvrtc.major, nvrtc.minor
        ))),
        other => Err(Error::new(
            ErrorKind::Internal,
            format!(
                "NVRTC {}.{} failed on {program} for {arch}: {other:?}: {log}",
                nvrtc.major, nvrtc.minor
            ),
        )),
    }
}

/// The raw NVRTC sequence: create the program (the prelude as an in-memory header), compile,
/// read the log and, on success, the CUBIN; the program is always destroyed.
///
/// # Safety
/// NVRTC must be loaded and its symbols present ([`load`] succeeded).
unsafe fn compile_raw(
    program: &str,
    source: &str,
    arch: &str,
) -> (sys::nvrtcResult, String, Vec<u8>) {
    use sys::nvrtcResult as R;
    let cstr = |s: &str| CString::new(s.replace('\0', " ")).expect("NULs replaced");
    let (src, name) = (cstr(source), cstr(program));
    let (header, header_name) = (cstr(PRELUDE), cstr(PRELUDE_NAME));
    let headers = [header.as_ptr()];
    let include_names = [header_name.as_ptr()];
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    let status = sys::nvrtcCreateProgram(
        &mut prog,
        src.as_ptr(),
        name.as_ptr(),
        1,
        headers.as_ptr(),
        include_names.as_ptr(),
    );
    if status != R::NVRTC_SUCCESS {
        return (
            status,
            format!("nvrtcCreateProgram: {status:?}"),
            Vec::new(),
        );
    }
    let options: Vec<CString> = std::iter::once(format!("--gpu-architecture={arch}"))
        .chain(OPTIONS.iter().map(|o| o.to_string()))
        .map(|o| cstr(&o))
        .collect();
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut status =
        sys::nvrtcCompileProgram(prog, option_ptrs.len() as c_int, option_ptrs.as_ptr());
    let mut log = String::new();
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size) == R::NVRTC_SUCCESS && size > 1 {
        let mut buf = vec![0u8; size];
        if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) == R::NVRTC_SUCCESS {
            log = String::from_utf8_lossy(&buf).into_owned();
        }
    }
    let mut bytes = Vec::new();
    if status == R::NVRTC_SUCCESS {
        let mut size = 0usize;
        status = sys::nvrtcGetCUBINSize(prog, &mut size);
        if status == R::NVRTC_SUCCESS {
            bytes = vec![0u8; size];
            status = sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr().cast());
        }
    }
    sys::nvrtcDestroyProgram(&mut prog);
    (status, log, bytes)
}

/// Every kernel file compiled for one architecture.
#[derive(Debug)]
pub struct KernelSet {
    pub arch: String,
    /// One cubin per file of [`SOURCES`], in that order.
    pub cubins: Vec<Cubin>,
}

impl KernelSet {
    /// The cubin (CUDA module) that holds entry point `kernel`, and the file it came from.
    pub fn module_of(&self, kernel: &str) -> Option<&Cubin> {
        let source = super::sources::source_of(kernel)?;
        self.cubins.iter().find(|c| c.file == source.file)
    }
}

/// Compiles every kernel file for `arch`.
pub fn compile_all(arch: &str) -> Result<KernelSet> {
    compile_sources(SOURCES, arch)
}

fn compile_sources(sources: &[KernelSource], arch: &str) -> Result<KernelSet> {
    let cubins = sources
        .iter()
        .map(|s| compile_source(s.file, s.source, arch))
        .collect::<Result<Vec<_>>>()?;
    Ok(KernelSet {
        arch: arch.to_string(),
        cubins,
    })
}

/// Every kernel compiled for `arch`, compiled on the first call per architecture and kept for
/// the life of the process (concurrent callers wait for the one compile). Errors are not cached.
pub fn kernels_for(arch: &str) -> Result<Arc<KernelSet>> {
    static CACHE: Mutex<Option<HashMap<String, Arc<KernelSet>>>> = Mutex::new(None);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let map = cache.get_or_insert_with(HashMap::new);
    if let Some(set) = map.get(arch) {
        return Ok(Arc::clone(set));
    }
    let set = Arc::new(compile_all(arch)?);
    map.insert(arch.to_string(), Arc::clone(&set));
    Ok(set)
}

/// The wheel's `libnvrtc.so.13` under a Python environment (`<venv>/lib/python3.*/
/// site-packages/nvidia/cu13/lib/`), when installed: what `make kernels-check` and the tests use.
pub fn find_in_venv(venv: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    let mut found: Vec<PathBuf> = lib
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages/nvidia/cu13/lib").join(LIBRARY))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found.pop()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC from the environment, else the repo's .venv wheel (`make kernels-check` installs
    /// it); None (with the reason) when neither loads.
    fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
        let location = match Location::from_env() {
            Location::SearchPath => {
                let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv");
                find_in_venv(&venv).map_or(Location::SearchPath, Location::Path)
            }
            explicit => explicit,
        };
        match load_from(&location) {
            Ok(n) => Some(n),
            Err(e) => {
                println!(
                    "{test}: SKIPPED, NVRTC is not available ({}); `make kernels-check` installs \
                     it and is the real gate",
                    e.message()
                );
                None
            }
        }
    }

    #[test]
    fn every_kernel_compiles_for_sm_90() {
        let Some(nvrtc) = nvrtc_or_skip("every_kernel_compiles_for_sm_90") else {
            return;
        };
        let set = kernels_for("sm_90").expect("every kernel compiles");
        assert_eq!(set.cubins.len(), SOURCES.len());
        for (cubin, source) in set.cubins.iter().zip(SOURCES) {
            assert_eq!(cubin.file, source.file);
            assert!(cubin.log.is_empty(), "{}: {}", cubin.file, cubin.log);
            // An ELF image that names every entry point it should define.
            assert_eq!(&cubin.bytes[..4], b"\x7fELF", "{}", cubin.file);
            for e in source.entries {
                let name = e.name.as_bytes();
                assert!(
                    cubin.bytes.windows(name.len()).any(|w| w == name),
                    "{} lacks {}",
                    cubin.file,
                    e.name
                );
            }
        }
        // Cached: the same set again.
        assert!(Arc::ptr_eq(&set, &kernels_for("sm_90").expect("cached")));
        assert_eq!(
            set.module_of("moe_route").map(|c| c.file.as_str()),
            Some("router.cu")
        );
        println!(
            "every_kernel_compiles_for_sm_90: {} files with NVRTC {}.{}",
            set.cubins.len(),
            nvrtc.major,
            nvrtc.minor
        );
    }

    #[test]
    fn a_broken_kernel_is_an_internal_error_with_the_log_and_file() {
        if nvrtc_or_skip("a_broken_kernel_is_an_internal_error_with_the_log_and_file").is_none() {
            return;
        }
        let source = "#include \"prelude.cuh\"\n\
                      extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }\n";
        let e = compile_source("broken_test.cu", source, "sm_90").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
        let m = e.message();
        assert!(m.contains("kernels/broken_test.cu"), "{m}");
        // NVRTC's own diagnostic line: the file, the line number and the undefined name.
        assert!(
            m.lines().any(|l| l.contains("kernels/broken_test.cu(2)")
                && l.contains("error")
                && l.contains("undefined_name")),
            "{m}"
        );
        // The prelude header compiles on its own: the error is the kernel's.
        compile_source("prelude_only.cu", "#include \"prelude.cuh\"\n", "sm_90")
            .expect("the prelude compiles");
    }

    #[test]
    fn a_missing_library_is_unsupported_and_names_the_library_and_package() {
        let e = open(&Location::Path(PathBuf::from(
            "/nonexistent/dsv4-test/libnvrtc.so.13",
        )))
        .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        let m = e.message();
        for needle in [
            LIBRARY,
            PACKAGE,
            "/nonexistent/dsv4-test/libnvrtc.so.13",
            PATH_VAR,
        ] {
            assert!(m.contains(needle), "{needle} missing from: {m}");
        }
        // A file that is not a shared library: dlopen's reason is carried.
        let not_a_library = Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml");
        let e = open(&Location::Path(not_a_library)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported);
        assert!(e.message().contains(LIBRARY) && e.message().contains(PACKAGE));
    }

    #[test]
    fn architecture_names_are_checked_before_nvrtc() {
        assert_eq!(arch_for(9, 0), "sm_90");
        assert_eq!(arch_for(10, 0), "sm_100");
        for good in ["sm_90", "sm_100", "sm_100a", "sm_90a", "sm_120f"] {
            assert!(valid_arch(good), "{good}");
        }
        for bad in [
            "",
            "sm_",
            "90",
            "sm_9x",
            "compute_90",
            "sm_90 --fmad=true",
            "sm_aa",
        ] {
            assert!(!valid_arch(bad), "{bad}");
            let e = compile_source("x.cu", "", bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}");
        }
    }
}
