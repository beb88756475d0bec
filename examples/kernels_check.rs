//! `make kernels-check`: compiles every kernel file in `kernels/` with NVRTC for each architecture
//! given (default `sm_90 sm_100`), as the CUDA backend does at run time, and prints one line per
//! file and architecture, then `kernels: N compiled for <archs>`. Exits non-zero on any failure:
//! a file that does not compile, compiles with warnings, or lacks one of its entry points.
//!
//! NVRTC comes from `DSV4_NVRTC_PATH` / `DSV4_CUDA_LIB_DIR` / the library search path (the
//! Makefile points `DSV4_NVRTC_PATH` at the `nvidia-cuda-nvrtc` wheel in `.venv`). Needs no GPU.

use std::process::ExitCode;

use dsv4::backend::cuda::nvrtc::{self, Location};
use dsv4::backend::cuda::sources::SOURCES;

fn main() -> ExitCode {
    let mut archs: Vec<String> = std::env::args().skip(1).collect();
    if archs.is_empty() {
        archs = vec!["sm_90".into(), "sm_100".into()];
    }
    let nvrtc = match nvrtc::load_from(&Location::from_env()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("kernels-check: {e}");
            return ExitCode::FAILURE;
        }
    };
    let from = match &nvrtc.location {
        Location::Path(p) => p.display().to_string(),
        Location::SearchPath => "the library search path".to_string(),
    };
    println!("NVRTC {}.{} from {from}", nvrtc.major, nvrtc.minor);
    let mut failures = 0;
    for source in SOURCES {
        for arch in &archs {
            let cubin = match nvrtc::compile_source(source.file, source.source, arch) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("kernels-check: {} for {arch}: {e}", source.file);
                    failures += 1;
                    continue;
                }
            };
            let missing: Vec<&str> = source
                .entries
                .iter()
                .map(|e| e.name)
                .filter(|name| {
                    !cubin
                        .bytes
                        .windows(name.len())
                        .any(|w| w == name.as_bytes())
                })
                .collect();
            println!(
                "{:<12} {:<7} {:>8} B cubin {:>6.0} ms  {} entry point{}",
                source.file,
                arch,
                cubin.bytes.len(),
                cubin.elapsed.as_secs_f64() * 1000.0,
                source.entries.len(),
                if source.entries.len() == 1 { "" } else { "s" }
            );
            if !cubin.log.is_empty() {
                eprintln!(
                    "kernels-check: {} for {arch} compiles with diagnostics:\n{}",
                    source.file, cubin.log
                );
                failures += 1;
            }
            if !missing.is_empty() {
                eprintln!(
                    "kernels-check: the {arch} cubin of {} lacks {}",
                    source.file,
                    missing.join(", ")
                );
                failures += 1;
            }
        }
    }
    if failures > 0 {
        eprintln!("kernels-check: {failures} failures");
        return ExitCode::FAILURE;
    }
    println!(
        "kernels: {} compiled for {}",
        SOURCES.len(),
        archs.join(", ")
    );
    ExitCode::SUCCESS
}
