//! The CUDA kernel sources in `kernels/`, embedded in the library: NVRTC compiles them at run
//! time for the device found (see [`super::nvrtc`]), so no CUDA toolkit is needed to build.
//! `kernels/README.md` documents every entry point's arguments, launch shape and numerical
//! contract against the CPU backend.

/// The header every kernel file includes (`#include "prelude.cuh"`): integer types, bit casts
/// and the number formats (bf16, e4m3, e8m0, e2m1), written without any CUDA header. NVRTC
/// receives it as an in-memory header of this name.
pub const PRELUDE_NAME: &str = "prelude.cuh";
pub const PRELUDE: &str = include_str!("../../../kernels/prelude.cuh");

/// How an entry point is launched (kernels/README.md gives the sizes per kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// A 1-D grid-stride loop over a stated number of work items: any grid and block size
    /// (256 threads, `min(ceil(items / 256), 65535)` blocks suggested).
    GridStride,
    /// One block per row (grid = rows), any block size (256 threads suggested); the kernel
    /// synchronises its block.
    BlockPerRow,
}

/// One `extern "C" __global__` function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub name: &'static str,
    pub launch: Launch,
}

/// One kernel file: a CUDA C++ translation unit, compiled to one cubin (one CUDA module).
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// The file name under `kernels/` (NVRTC's program name is `kernels/<file>`, so its
    /// diagnostics name the file).
    pub file: &'static str,
    pub source: &'static str,
    /// Its entry points, in file order.
    pub entries: &'static [Entry],
}

const fn grid(name: &'static str) -> Entry {
    Entry {
        name,
        launch: Launch::GridStride,
    }
}

const fn per_row(name: &'static str) -> Entry {
    Entry {
        name,
        launch: Launch::BlockPerRow,
    }
}

/// Every kernel file, in the order `make kernels-check` reports them.
pub static SOURCES: &[KernelSource] = &[
    KernelSource {
        file: "embed.cu",
        source: include_str!("../../../kernels/embed.cu"),
        entries: &[grid("embed_f32"), grid("embed_bf16")],
    },
    KernelSource {
        file: "rms_norm.cu",
        source: include_str!("../../../kernels/rms_norm.cu"),
        entries: &[per_row("rms_norm")],
    },
    KernelSource {
        file: "rope.cu",
        source: include_str!("../../../kernels/rope.cu"),
        entries: &[grid("rope_cos_sin"), grid("rope_apply")],
    },
    KernelSource {
        file: "swiglu.cu",
        source: include_str!("../../../kernels/swiglu.cu"),
        entries: &[grid("swiglu")],
    },
    KernelSource {
        file: "kv_rows.cu",
        source: include_str!("../../../kernels/kv_rows.cu"),
        entries: &[
            grid("kv_write_f32"),
            grid("kv_read_f32"),
            grid("kv_write_bf16"),
            grid("kv_read_bf16"),
            grid("kv_round_trip_bf16"),
            grid("kv_write_fp8"),
            grid("kv_read_fp8"),
            grid("kv_round_trip_fp8"),
            grid("kv_write_fp8_index"),
            grid("kv_read_fp8_index"),
            grid("kv_round_trip_fp8_index"),
            grid("kv_write_fp4_index"),
            grid("kv_read_fp4_index"),
            grid("kv_round_trip_fp4_index"),
        ],
    },
    KernelSource {
        file: "weights.cu",
        source: include_str!("../../../kernels/weights.cu"),
        entries: &[
            grid("dequant_fp8_f32"),
            grid("dequant_fp8_bf16"),
            grid("dequant_fp4_f32"),
            grid("dequant_fp4_bf16"),
            grid("convert_f32_to_bf16"),
            grid("convert_bf16_to_f32"),
            grid("convert_f16_to_f32"),
            grid("convert_f16_to_bf16"),
        ],
    },
    KernelSource {
        file: "router.cu",
        source: include_str!("../../../kernels/router.cu"),
        entries: &[per_row("moe_route")],
    },
    KernelSource {
        file: "tensor.cu",
        source: include_str!("../../../kernels/tensor.cu"),
        entries: &[grid("add_f32"), grid("copy_cols"), grid("gather_rows")],
    },
];

/// The file that defines entry point `name`.
pub fn source_of(name: &str) -> Option<&'static KernelSource> {
    SOURCES
        .iter()
        .find(|s| s.entries.iter().any(|e| e.name == name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `extern "C" __global__` function names a source defines, in file order.
    fn defined_entries(source: &str) -> Vec<&str> {
        let marker = "extern \"C\" __global__ void ";
        source
            .match_indices(marker)
            .map(|(at, _)| {
                let rest = &source[at + marker.len()..];
                rest[..rest.find('(').expect("a parameter list")].trim()
            })
            .collect()
    }

    #[test]
    fn every_kernel_file_is_embedded_and_lists_exactly_its_entry_points() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .expect("kernels/")
            .map(|e| e.expect("a directory entry").file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<String> = SOURCES.iter().map(|s| s.file.to_string()).collect();
        embedded.sort();
        assert_eq!(on_disk, embedded, "kernels/*.cu vs SOURCES");
        for s in SOURCES {
            let listed: Vec<&str> = s.entries.iter().map(|e| e.name).collect();
            assert_eq!(defined_entries(s.source), listed, "{}", s.file);
        }
        let mut names: Vec<&str> = SOURCES
            .iter()
            .flat_map(|s| s.entries.iter().map(|e| e.name))
            .collect();
        let all = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all, "entry point names are unique");
        assert_eq!(source_of("moe_route").map(|s| s.file), Some("router.cu"));
        assert!(source_of("no_such_kernel").is_none());
    }

    #[test]
    fn kernels_include_only_the_prelude() {
        for (file, text) in SOURCES
            .iter()
            .map(|s| (s.file, s.source))
            .chain([(PRELUDE_NAME, PRELUDE)])
        {
            for line in text
                .lines()
                .filter(|l| l.trim_start().starts_with("#include"))
            {
                assert_eq!(
                    line.trim(),
                    "#include \"prelude.cuh\"",
                    "{file}: kernels are built without CUDA headers"
                );
            }
        }
        for s in SOURCES {
            assert!(s.source.contains("#include \"prelude.cuh\""), "{}", s.file);
        }
    }

    #[test]
    fn the_readme_documents_every_entry_point() {
        let readme = include_str!("../../../kernels/README.md");
        for s in SOURCES {
            assert!(readme.contains(&format!("`{}`", s.file)), "{}", s.file);
            for e in s.entries {
                // `name(` or `name   (` (signatures are aligned) at the start of a line.
                let documented = readme.lines().any(|l| {
                    l.strip_prefix(e.name)
                        .is_some_and(|rest| rest.trim_start().starts_with('('))
                });
                assert!(
                    documented,
                    "kernels/README.md lacks the signature of {}",
                    e.name
                );
            }
        }
    }
}
