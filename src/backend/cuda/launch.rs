//! Kernel launches as values: which entry point of `kernels/`, its launch shape and its
//! arguments in the kernel's parameter order and widths (kernels/README.md gives every
//! signature). The CUDA backend launches these with device pointers; the host emulation test
//! (`emulate`) runs the very same values through the kernels compiled as host C++, so the
//! argument lists the backend builds are checked against the CPU backend without a GPU.

use crate::backend::{Placement, RowLayout, WeightFormat};
use crate::error::{Error, Result};
use crate::formats::rows::RowCodec;

/// Threads per block for every launch.
pub const BLOCK: u32 = 256;
/// The most blocks a grid-stride launch uses (its loop covers the rest).
pub const MAX_GRID: u64 = 65_535;
/// The router kernel's limit on experts (its static shared arrays).
pub const ROUTE_MAX_EXPERTS: usize = 1024;

/// One kernel argument, exactly as wide as the kernel's parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    /// A device pointer (0 = null).
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// How the kernel covers its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// A grid-stride loop over this many work items.
    GridStride { items: u64 },
    /// One block per row.
    PerRow { rows: u32 },
}

/// One kernel launch.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    pub kernel: &'static str,
    pub shape: Shape,
    pub args: Vec<Arg>,
}

impl Launch {
    /// `(grid, block)`, or `None` when there is no work (nothing to launch).
    pub fn dims(&self) -> Option<(u32, u32)> {
        match self.shape {
            Shape::GridStride { items: 0 } | Shape::PerRow { rows: 0 } => None,
            Shape::GridStride { items } => {
                Some((items.div_ceil(BLOCK as u64).min(MAX_GRID) as u32, BLOCK))
            }
            Shape::PerRow { rows } => Some((rows, BLOCK)),
        }
    }
}

/// `v` as a kernel's `i32`, or an error naming what overflowed (shapes beyond 2³¹ are refused
/// rather than wrapped).
pub fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::invalid_argument(format!(
            "{what} = {v} exceeds the CUDA kernels' 32-bit limit ({})",
            i32::MAX
        ))
    })
}

fn i64_of(v: usize) -> i64 {
    // usize is 64-bit on every target the CUDA backend supports; sizes fit device memory.
    v as i64
}

fn grid(kernel: &'static str, items: usize, args: Vec<Arg>) -> Launch {
    Launch {
        kernel,
        shape: Shape::GridStride {
            items: items as u64,
        },
        args,
    }
}

/// `embed_f32` / `embed_bf16`: `out [rows, cols]` = rows `ids` of `table [vocab, cols]`.
pub fn embed(
    table: u64,
    bf16: bool,
    ids: u64,
    out: u64,
    rows: usize,
    cols: usize,
    vocab: usize,
) -> Result<Launch> {
    let kernel = if bf16 { "embed_bf16" } else { "embed_f32" };
    Ok(grid(
        kernel,
        rows * cols,
        vec![
            Arg::Ptr(table),
            Arg::Ptr(ids),
            Arg::Ptr(out),
            Arg::I32(i32_of("embedding rows", rows)?),
            Arg::I32(i32_of("embedding width", cols)?),
            Arg::I32(i32_of("vocabulary", vocab)?),
        ],
    ))
}

/// `rms_norm`: one block per vector.
pub fn rms_norm(
    x: u64,
    weight: Option<u64>,
    out: u64,
    vectors: usize,
    dim: usize,
    eps: f32,
) -> Result<Launch> {
    Ok(Launch {
        kernel: "rms_norm",
        shape: Shape::PerRow {
            rows: i32_of("RMSNorm vectors", vectors)? as u32,
        },
        args: vec![
            Arg::Ptr(x),
            Arg::Ptr(weight.unwrap_or(0)),
            Arg::Ptr(out),
            Arg::I32(vectors as i32),
            Arg::I32(i32_of("RMSNorm width", dim)?),
            Arg::F32(eps),
        ],
    })
}

/// `rope_cos_sin`: `cs [rows, pairs, 2]` for the rows' positions.
pub fn rope_cos_sin(
    inv_freq: u64,
    positions: u64,
    cs: u64,
    rows: usize,
    pairs: usize,
) -> Result<Launch> {
    Ok(grid(
        "rope_cos_sin",
        rows * pairs,
        vec![
            Arg::Ptr(inv_freq),
            Arg::Ptr(positions),
            Arg::Ptr(cs),
            Arg::I32(i32_of("RoPE rows", rows)?),
            Arg::I32(i32_of("RoPE pairs", pairs)?),
        ],
    ))
}

/// `rope_apply`: rotates the last `2 · pairs` channels of every head of `x` in place.
pub fn rope_apply(
    x: u64,
    cs: u64,
    rows: usize,
    heads: usize,
    head_dim: usize,
    pairs: usize,
    inverse: bool,
) -> Result<Launch> {
    Ok(grid(
        "rope_apply",
        rows * heads * pairs,
        vec![
            Arg::Ptr(x),
            Arg::Ptr(cs),
            Arg::I32(i32_of("RoPE rows", rows)?),
            Arg::I32(i32_of("RoPE heads", heads)?),
            Arg::I32(i32_of("RoPE head width", head_dim)?),
            Arg::I32(pairs as i32),
            Arg::I32(inverse as i32),
        ],
    ))
}

/// `swiglu`: `out [rows, inter]` from `gate_up [rows, 2·inter]`.
pub fn swiglu(gate_up: u64, out: u64, rows: usize, inter: usize, limit: f32) -> Result<Launch> {
    Ok(grid(
        "swiglu",
        rows * inter,
        vec![
            Arg::Ptr(gate_up),
            Arg::Ptr(out),
            Arg::I32(i32_of("SwiGLU rows", rows)?),
            Arg::I32(i32_of("SwiGLU width", inter)?),
            Arg::F32(limit),
        ],
    ))
}

/// `add_f32`: `a += b` over `n` values.
pub fn add(a: u64, b: u64, n: usize) -> Launch {
    grid(
        "add_f32",
        n,
        vec![Arg::Ptr(a), Arg::Ptr(b), Arg::I64(i64_of(n))],
    )
}

/// `copy_cols`: columns `start .. start + width` of `x [rows, total]` into `out`.
pub fn copy_cols(
    x: u64,
    out: u64,
    rows: usize,
    total: usize,
    start: usize,
    width: usize,
) -> Launch {
    grid(
        "copy_cols",
        rows * width,
        vec![
            Arg::Ptr(x),
            Arg::Ptr(out),
            Arg::I64(i64_of(rows)),
            Arg::I64(i64_of(total)),
            Arg::I64(i64_of(start)),
            Arg::I64(i64_of(width)),
        ],
    )
}

/// `gather_rows`: rows `index[0 .. n)` of `x [_, cols]` into `out [n, cols]`.
pub fn gather_rows(x: u64, index: u64, out: u64, n: usize, cols: usize) -> Launch {
    grid(
        "gather_rows",
        n * cols,
        vec![
            Arg::Ptr(x),
            Arg::Ptr(index),
            Arg::Ptr(out),
            Arg::I64(i64_of(n)),
            Arg::I64(i64_of(cols)),
        ],
    )
}

/// Where a layout's rows are, as the row kernels take it (`pool` the buffer's base pointer,
/// `pages` the page table's, unused for a ring).
pub fn placement<P: ?Sized>(pool: u64, pages: u64, layout: &RowLayout<'_, P>) -> [Arg; 7] {
    let (pages, rows_per_unit, unit_bytes, ring_rows) = match layout.placement {
        Placement::Paged {
            rows_per_unit,
            unit_bytes,
            ..
        } => (pages, rows_per_unit, unit_bytes, 0),
        Placement::Ring { rows } => (0, 0, 0, rows),
    };
    [
        Arg::Ptr(pool),
        Arg::Ptr(pages),
        Arg::I64(i64_of(rows_per_unit)),
        Arg::I64(i64_of(unit_bytes)),
        Arg::I64(i64_of(ring_rows)),
        Arg::I64(i64_of(layout.offset)),
        Arg::I64(i64_of(layout.row_bytes)),
    ]
}

/// Work items per row of a row kernel for `codec` on rows `width` wide (kernels/README.md).
fn units(codec: RowCodec, width: usize) -> usize {
    match codec {
        RowCodec::F32 | RowCodec::Bf16 => width,
        RowCodec::Fp8Kv { nope, .. } => nope.div_ceil(64) + 1,
        RowCodec::Fp8Index => width.div_ceil(128),
        RowCodec::Fp4Index => width.div_ceil(32),
    }
}

/// The width arguments of a row kernel: `nope, rope` for Fp8Kv, else `width`.
fn widths(codec: RowCodec, width: usize) -> Result<Vec<Arg>> {
    Ok(match codec {
        RowCodec::Fp8Kv { nope, rope } => {
            if nope + rope != width {
                return Err(Error::internal(format!(
                    "an Fp8Kv row of {nope} + {rope} values is not {width} wide"
                )));
            }
            vec![
                Arg::I32(i32_of("KV nope width", nope)?),
                Arg::I32(i32_of("KV rope width", rope)?),
            ]
        }
        _ => vec![Arg::I32(i32_of("KV row width", width)?)],
    })
}

fn row_kernel(codec: RowCodec, write: bool) -> &'static str {
    match (codec, write) {
        (RowCodec::F32, true) => "kv_write_f32",
        (RowCodec::F32, false) => "kv_read_f32",
        (RowCodec::Bf16, true) => "kv_write_bf16",
        (RowCodec::Bf16, false) => "kv_read_bf16",
        (RowCodec::Fp8Kv { .. }, true) => "kv_write_fp8",
        (RowCodec::Fp8Kv { .. }, false) => "kv_read_fp8",
        (RowCodec::Fp8Index, true) => "kv_write_fp8_index",
        (RowCodec::Fp8Index, false) => "kv_read_fp8_index",
        (RowCodec::Fp4Index, true) => "kv_write_fp4_index",
        (RowCodec::Fp4Index, false) => "kv_read_fp4_index",
    }
}

fn check_row_bytes<P: ?Sized>(layout: &RowLayout<'_, P>) -> Result<()> {
    let want = layout.codec.row_bytes(layout.width);
    if layout.row_bytes != want {
        return Err(Error::internal(format!(
            "a {:?} row of {} values takes {want} bytes, not the layout's {}",
            layout.codec, layout.width, layout.row_bytes
        )));
    }
    Ok(())
}

/// Encodes rows `x_row0 .. x_row0 + n` of `x [_, width]` into layout rows `first .. first + n`.
pub fn kv_write<P: ?Sized>(
    x: u64,
    x_row0: usize,
    n: usize,
    layout: &RowLayout<'_, P>,
    pool: u64,
    pages: u64,
    first: usize,
) -> Result<Launch> {
    check_row_bytes(layout)?;
    let mut args = vec![
        Arg::Ptr(x),
        Arg::I64(i64_of(x_row0)),
        Arg::I32(i32_of("KV rows written", n)?),
    ];
    args.extend(widths(layout.codec, layout.width)?);
    args.extend(placement(pool, pages, layout));
    args.push(Arg::I64(i64_of(first)));
    Ok(grid(
        row_kernel(layout.codec, true),
        n * units(layout.codec, layout.width),
        args,
    ))
}

/// Decodes layout rows `first .. first + n` into `out [n, width]`.
pub fn kv_read<P: ?Sized>(
    out: u64,
    n: usize,
    layout: &RowLayout<'_, P>,
    pool: u64,
    pages: u64,
    first: usize,
) -> Result<Launch> {
    check_row_bytes(layout)?;
    let mut args = vec![Arg::Ptr(out), Arg::I32(i32_of("KV rows read", n)?)];
    args.extend(widths(layout.codec, layout.width)?);
    args.extend(placement(pool, pages, layout));
    args.push(Arg::I64(i64_of(first)));
    Ok(grid(
        row_kernel(layout.codec, false),
        n * units(layout.codec, layout.width),
        args,
    ))
}

/// Replaces every row of `x [rows, width]` by its value after `codec`'s encode and decode;
/// `None` for F32 (the identity).
pub fn kv_round_trip(x: u64, rows: usize, width: usize, codec: RowCodec) -> Result<Option<Launch>> {
    Ok(Some(match codec {
        RowCodec::F32 => return Ok(None),
        RowCodec::Bf16 => grid(
            "kv_round_trip_bf16",
            rows * width,
            vec![Arg::Ptr(x), Arg::I64(i64_of(rows * width))],
        ),
        _ => {
            let kernel = match codec {
                RowCodec::Fp8Kv { .. } => "kv_round_trip_fp8",
                RowCodec::Fp8Index => "kv_round_trip_fp8_index",
                _ => "kv_round_trip_fp4_index",
            };
            let mut args = vec![Arg::Ptr(x), Arg::I32(i32_of("KV rows", rows)?)];
            args.extend(widths(codec, width)?);
            grid(kernel, rows * units(codec, width), args)
        }
    }))
}

/// Converts stored rows `row0 .. row0 + rows` of one weight part (`q` its bytes, `scales` its
/// f32 block scales, both in device memory) into `out` (`[rows, cols]`, f32 or bf16 bits);
/// `None` when the part is already stored in the wanted precision (F32 into f32, Bf16 into
/// bf16: a plain copy, no kernel).
#[allow(clippy::too_many_arguments)]
pub fn dequant(
    format: WeightFormat,
    q: u64,
    scales: u64,
    out: u64,
    row0: usize,
    rows: usize,
    cols: usize,
    bf16_out: bool,
) -> Option<Launch> {
    let n = rows * cols;
    let (row0, rows_, cols_) = (i64_of(row0), i64_of(rows), i64_of(cols));
    Some(match format {
        WeightFormat::Fp8E4m3 { block } => grid(
            if bf16_out {
                "dequant_fp8_bf16"
            } else {
                "dequant_fp8_f32"
            },
            n,
            vec![
                Arg::Ptr(q),
                Arg::Ptr(scales),
                Arg::Ptr(out),
                Arg::I64(row0),
                Arg::I64(rows_),
                Arg::I64(cols_),
                Arg::I64(i64_of(block[0])),
                Arg::I64(i64_of(block[1])),
            ],
        ),
        WeightFormat::Fp4E2m1 { block } => grid(
            if bf16_out {
                "dequant_fp4_bf16"
            } else {
                "dequant_fp4_f32"
            },
            n,
            vec![
                Arg::Ptr(q),
                Arg::Ptr(scales),
                Arg::Ptr(out),
                Arg::I64(row0),
                Arg::I64(rows_),
                Arg::I64(cols_),
                Arg::I64(i64_of(block)),
            ],
        ),
        // The float formats: `q` already points at the part's first row.
        WeightFormat::F32 | WeightFormat::Bf16 | WeightFormat::F16 => {
            let kernel = match (format, bf16_out) {
                (WeightFormat::F32, false) | (WeightFormat::Bf16, true) => return None,
                (WeightFormat::F32, true) => "convert_f32_to_bf16",
                (WeightFormat::Bf16, false) => "convert_bf16_to_f32",
                (_, false) => "convert_f16_to_f32",
                (_, true) => "convert_f16_to_bf16",
            };
            convert(kernel, q, out, n)
        }
    })
}

/// One of the `convert_*` kernels over `n` values.
pub fn convert(kernel: &'static str, x: u64, out: u64, n: usize) -> Launch {
    grid(
        kernel,
        n,
        vec![Arg::Ptr(x), Arg::Ptr(out), Arg::I64(i64_of(n))],
    )
}

/// The router's inputs as device pointers (0 = absent).
#[derive(Debug, Clone, Copy)]
pub struct RoutePtrs {
    pub logits: u64,
    pub bias: u64,
    pub hash_table: u64,
    pub token_ids: u64,
    pub experts_out: u64,
    pub weights_out: u64,
    pub bad_row: u64,
}

/// `moe_route`: one block per token row.
#[allow(clippy::too_many_arguments)]
pub fn route(
    p: RoutePtrs,
    rows: usize,
    experts: usize,
    top_k: usize,
    scoring: i32,
    normalize: bool,
    scale: f32,
    vocab: usize,
) -> Result<Launch> {
    if experts > ROUTE_MAX_EXPERTS {
        return Err(Error::unsupported(format!(
            "the CUDA router takes at most {ROUTE_MAX_EXPERTS} experts, not {experts}"
        )));
    }
    Ok(Launch {
        kernel: "moe_route",
        shape: Shape::PerRow {
            rows: i32_of("routed rows", rows)? as u32,
        },
        args: vec![
            Arg::Ptr(p.logits),
            Arg::Ptr(p.bias),
            Arg::Ptr(p.hash_table),
            Arg::Ptr(p.token_ids),
            Arg::Ptr(p.experts_out),
            Arg::Ptr(p.weights_out),
            Arg::Ptr(p.bad_row),
            Arg::I32(rows as i32),
            Arg::I32(experts as i32),
            Arg::I32(i32_of("top-k", top_k)?),
            Arg::I32(scoring),
            Arg::I32(normalize as i32),
            Arg::F32(scale),
            Arg::I32(i32_of("vocabulary", vocab)?),
        ],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::sources::source_of;

    #[test]
    fn grid_stride_launches_cap_the_grid_and_skip_empty_work() {
        let l = add(1, 2, 0);
        assert_eq!(l.dims(), None);
        assert_eq!(add(1, 2, 1).dims(), Some((1, BLOCK)));
        assert_eq!(add(1, 2, 257).dims(), Some((2, BLOCK)));
        assert_eq!(add(1, 2, 1 << 30).dims(), Some((MAX_GRID as u32, BLOCK)));
        let r = rms_norm(1, None, 2, 3, 8, 1e-6).unwrap();
        assert_eq!(r.dims(), Some((3, BLOCK)));
        assert_eq!(r.args[1], Arg::Ptr(0), "no weight is a null pointer");
    }

    #[test]
    fn oversized_shapes_are_refused_not_wrapped() {
        let e = swiglu(1, 2, 1 << 31, 1, 0.0).unwrap_err();
        assert!(e.message().contains("SwiGLU rows = 2147483648"), "{e}");
        let e = route(
            RoutePtrs {
                logits: 1,
                bias: 0,
                hash_table: 0,
                token_ids: 0,
                experts_out: 2,
                weights_out: 3,
                bad_row: 4,
            },
            1,
            2048,
            8,
            0,
            true,
            1.0,
            10,
        )
        .unwrap_err();
        assert!(e.message().contains("at most 1024 experts"), "{e}");
    }

    #[test]
    fn every_planned_kernel_exists_with_its_launch_shape() {
        use crate::backend::cuda::sources::Launch as Kind;
        let layout = RowLayout::<[u32]> {
            offset: 0,
            row_bytes: RowCodec::Fp8Kv { nope: 64, rope: 8 }.row_bytes(72),
            width: 72,
            codec: RowCodec::Fp8Kv { nope: 64, rope: 8 },
            placement: Placement::Ring { rows: 4 },
        };
        let launches = [
            embed(1, true, 2, 3, 4, 5, 6).unwrap(),
            rms_norm(1, Some(2), 3, 4, 5, 1e-6).unwrap(),
            rope_cos_sin(1, 2, 3, 4, 5).unwrap(),
            rope_apply(1, 2, 3, 4, 16, 4, true).unwrap(),
            swiglu(1, 2, 3, 4, 7.0).unwrap(),
            add(1, 2, 3),
            copy_cols(1, 2, 3, 8, 2, 4),
            gather_rows(1, 2, 3, 4, 5),
            kv_write(1, 0, 2, &layout, 3, 0, 1).unwrap(),
            kv_read(1, 2, &layout, 3, 0, 1).unwrap(),
            kv_round_trip(1, 2, 72, layout.codec).unwrap().unwrap(),
            dequant(WeightFormat::Fp4E2m1 { block: 32 }, 1, 2, 3, 0, 4, 64, true).unwrap(),
            dequant(WeightFormat::F16, 1, 0, 3, 0, 4, 64, false).unwrap(),
        ];
        for l in &launches {
            let source = source_of(l.kernel).unwrap_or_else(|| panic!("{} exists", l.kernel));
            let entry = source.entries.iter().find(|e| e.name == l.kernel).unwrap();
            let per_row = matches!(l.shape, Shape::PerRow { .. });
            assert_eq!(entry.launch == Kind::BlockPerRow, per_row, "{}", l.kernel);
        }
        assert_eq!(kv_round_trip(1, 2, 3, RowCodec::F32).unwrap(), None);
        let bad = RowLayout::<[u32]> {
            row_bytes: 10,
            ..layout
        };
        let e = kv_write(1, 0, 1, &bad, 2, 0, 0).unwrap_err();
        assert!(e.message().contains("not the layout's 10"), "{e}");
    }
}
