//! Matrix multiplication on the engine's thread pool: the `gemm` crate's f32 kernels over
//! blocks of output features, with bf16 and FP8/FP4 weights widened (and transposed) block by
//! block.

use std::ops::Range;

use gemm::Parallelism;
use rayon::prelude::*;

use super::{CpuMatrix, MatrixData};

/// A raw destination pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(super) struct Dst(pub(super) *mut f32);
// SAFETY: every task writes a disjoint set of output columns (see `gemm_into`).
unsafe impl Send for Dst {}
// SAFETY: as above; the pointer is only used for disjoint writes.
unsafe impl Sync for Dst {}

impl Dst {
    /// Taking `self` makes closures capture the whole (Send) wrapper, not the raw field.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// One operand placement: a row-major slice where row r starts at `offset + r·row_stride`.
#[derive(Clone, Copy)]
pub(super) struct Strided {
    pub offset: usize,
    pub row_stride: usize,
}

/// `dst[r, dst_col0 + j] = Σ_k x[r, k] · w[w_rows.start + j, k]` for `rows` rows, where `x`
/// rows are `k` = `w.cols` wide at `x_at`, and `dst` rows are placed at `dst_at`.
pub(super) fn gemm_into(
    x: &[f32],
    x_at: Strided,
    rows: usize,
    w: &CpuMatrix,
    w_rows: Range<usize>,
    dst: &mut [f32],
    dst_at: Strided,
) {
    // bf16, FP8, FP4 on AMX tiles where the CPU has them (1.7x the f32 kernels), stacked
    // parts too: the input is split once for all of them.
    #[cfg(target_arch = "x86_64")]
    if super::amx::takes(rows, w) {
        return super::amx::gemm_into(x, x_at, rows, w, w_rows, dst, dst_at);
    }
    // Stacked parts: each part's rows, into their columns of the destination.
    if w.for_each_part(&w_rows, dst_at, |m, part_rows, at| {
        gemm_into(x, x_at, rows, m, part_rows, dst, at)
    }) {
        return;
    }
    if rows <= super::gemv::MAX_ROWS {
        return super::gemv::gemv_into(x, x_at, rows, w, w_rows, dst, dst_at);
    }
    let k = w.cols;
    let n = w_rows.len();
    if rows == 0 || n == 0 {
        return;
    }
    assert!(
        x.len() >= x_at.offset + (rows - 1) * x_at.row_stride + k,
        "lhs too short"
    );
    assert!(
        dst.len() >= dst_at.offset + (rows - 1) * dst_at.row_stride + n,
        "dst too short"
    );
    assert!(w_rows.end <= w.rows, "weight rows out of range");
    // Enough blocks to keep every thread busy, none so small the kernel call dominates.
    if let MatrixData::F32(v) = &w.data {
        // One call: the crate packs the input once and splits the work over the pool.
        let rhs = &v[w_rows.start * k..w_rows.end * k];
        // SAFETY: the lhs rows lie inside `x` and the destination rows inside `dst` (asserted
        // above); `rhs` is the requested weight rows; `dst` does not alias `x` or the weights.
        unsafe {
            gemm::gemm(
                rows,
                n,
                k,
                dst.as_mut_ptr().add(dst_at.offset),
                1,
                dst_at.row_stride as isize,
                false,
                x.as_ptr().add(x_at.offset),
                1,
                x_at.row_stride as isize,
                rhs.as_ptr(),
                k as isize,
                1,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::Rayon(0),
            );
        }
        return;
    }
    // Elsewhere: widen blocks of output features, each multiplied on one thread.
    let threads = rayon::current_num_threads().max(1);
    let work = rows * n * k;
    let blocks = if work < 1 << 16 {
        1
    } else {
        (threads * 4).min(n.div_ceil(16)).max(1)
    };
    // Whole 64-row panels where there are enough rows: the crate's widest kernel is 64 rows
    // tall, and narrower blocks ran its half-height one throughout (11 % of a prefill).
    let block = n.div_ceil(blocks).next_multiple_of(64).min(n);
    let dst_ptr = Dst(dst.as_mut_ptr());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let j0 = b * block;
        let j1 = (j0 + block).min(n);
        let w_block = w_rows.start + j0..w_rows.start + j1;
        // Widened column-major (`[k, block]`): the kernels read the weights' columns as they
        // are, where row-major rows were transposed again by the crate's packing (14 % of a
        // prefill's samples; the transposition here takes 2-5 %).
        let nb = j1 - j0;
        let rhs = widen_transposed(w, w_block, k);
        // SAFETY: lhs rows lie inside `x` and the rhs block inside `rhs` (both asserted or
        // sliced above); this task writes only columns [dst_col0 + j0, dst_col0 + j1) of the
        // `rows` destination rows, which lie inside `dst` (asserted above) and which no other
        // task writes; `dst` outlives the parallel loop.
        unsafe {
            gemm::gemm(
                rows,
                j1 - j0,
                k,
                dst_ptr.get().add(dst_at.offset + j0),
                1,
                dst_at.row_stride as isize,
                false,
                x.as_ptr().add(x_at.offset),
                1,
                x_at.row_stride as isize,
                rhs.as_ptr(),
                1,
                nb as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
        super::recycle::give(rhs);
    });
}

/// Rows `rows` of a bf16 or native matrix widened to f32 and transposed: `out[c · n + j]` is
/// row `rows.start + j`'s column `c` (`n` = the row count). Rows are widened sixteen at a time
/// into a buffer and moved out sixteen columns at a time.
fn widen_transposed(w: &CpuMatrix, rows: Range<usize>, k: usize) -> Vec<f32> {
    const TILE: usize = 16;
    let n = rows.len();
    let mut out = super::recycle::overwritten(k * n);
    let mut tile = vec![0.0f32; TILE * k];
    for j0 in (0..n).step_by(TILE) {
        let take = (n - j0).min(TILE);
        for (t, row) in tile.chunks_exact_mut(k).take(take).enumerate() {
            let r = rows.start + j0 + t;
            match &w.data {
                MatrixData::Bf16(v) => {
                    for (o, x) in row.iter_mut().zip(&v[r * k..(r + 1) * k]) {
                        *o = x.to_f32();
                    }
                }
                MatrixData::Native(q) => q.decode_row(k, r, row),
                MatrixData::F32(v) => row.copy_from_slice(&v[r * k..(r + 1) * k]),
                MatrixData::Stacked(_) => {
                    unreachable!("stacked parts are multiplied part by part")
                }
            }
        }
        let mut c0 = 0;
        #[cfg(target_arch = "x86_64")]
        if take == TILE && super::gemv::has_avx512() {
            while c0 + TILE <= k {
                // SAFETY: AVX-512F detected; the tile holds 16 rows of k ≥ c0 + 16 values and
                // `out` k columns of n ≥ j0 + 16 values.
                unsafe { x86::transpose16(&tile, k, c0, &mut out, n, j0) };
                c0 += TILE;
            }
        }
        for (c, column) in out.chunks_exact_mut(n).enumerate().skip(c0) {
            for (t, o) in column[j0..j0 + take].iter_mut().enumerate() {
                *o = tile[t * k + c];
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// `out[(c0 + c) · n + j0 + r] = tile[r · k + c0 + c]` for r, c in 0..16: a 16 × 16 block
    /// transposed in registers (pairs of rows interleaved, then pairs of pairs, then 128-bit
    /// lanes twice).
    ///
    /// # Safety
    /// AVX-512F and VL available; `tile` holds 16 rows of `k ≥ c0 + 16` values, `out` `c0 + 16`
    /// columns of `n ≥ j0 + 16`.
    #[target_feature(enable = "avx512f,avx512vl")]
    pub unsafe fn transpose16(
        tile: &[f32],
        k: usize,
        c0: usize,
        out: &mut [f32],
        n: usize,
        j0: usize,
    ) {
        assert!(c0 + 16 <= k && tile.len() >= 16 * k);
        assert!(j0 + 16 <= n && out.len() >= (c0 + 16) * n);
        // SAFETY: row r's 16 values at c0 lie inside `tile` (asserted).
        let r: [__m512; 16] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_ps(tile.as_ptr().add(i * k + c0)) });
        // t[2i], t[2i + 1], 128-bit lane L: rows 2i and 2i + 1 interleaved, columns 4L, 4L + 1
        // and 4L + 2, 4L + 3.
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        // u[4i + m], lane L: column 4L + m of rows 4i..4i + 4.
        let lo = |a: __m512, b: __m512| {
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
        };
        let hi = |a: __m512, b: __m512| {
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)))
        };
        let mut u = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            u[4 * i] = lo(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
        }
        // Column 4L + m is lane L of u[m], u[4 + m], u[8 + m], u[12 + m].
        let mut o = [_mm512_setzero_ps(); 16];
        for m in 0..4 {
            let a = _mm512_shuffle_f32x4::<0x88>(u[m], u[4 + m]);
            let b = _mm512_shuffle_f32x4::<0x88>(u[8 + m], u[12 + m]);
            let c = _mm512_shuffle_f32x4::<0xdd>(u[m], u[4 + m]);
            let d = _mm512_shuffle_f32x4::<0xdd>(u[8 + m], u[12 + m]);
            o[m] = _mm512_shuffle_f32x4::<0x88>(a, b);
            o[8 + m] = _mm512_shuffle_f32x4::<0xdd>(a, b);
            o[4 + m] = _mm512_shuffle_f32x4::<0x88>(c, d);
            o[12 + m] = _mm512_shuffle_f32x4::<0xdd>(c, d);
        }
        for (c, v) in o.iter().enumerate() {
            // SAFETY: column c0 + c's 16 values at j0 lie inside `out` (asserted).
            unsafe { _mm512_storeu_ps(out.as_mut_ptr().add((c0 + c) * n + j0), *v) };
        }
    }
}

/// `out[i, j] = Σ_k a[i, k] · b[j, k]` on the calling thread: `a [m, k]`, `b [n, k]`,
/// `out [m, n]`, all row-major (both operands contiguous).
pub(super) fn product(a: &[f32], m: usize, k: usize, b: &[f32], n: usize, out: &mut [f32]) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    // SAFETY: the bounds are asserted above; `out` does not alias `a` or `b` (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `out[i, c] = Σ_j p[i, j] · v[j, c]` on the calling thread: `p [m, n]`, `v [n, width]`,
/// `out [m, width]`.
pub(super) fn weighted_sum(
    p: &[f32],
    m: usize,
    n: usize,
    v: &[f32],
    width: usize,
    out: &mut [f32],
) {
    assert!(p.len() >= m * n && v.len() >= n * width && out.len() >= m * width);
    // SAFETY: the bounds are asserted above; `out` does not alias `p` or `v`.
    unsafe {
        gemm::gemm(
            m,
            width,
            n,
            out.as_mut_ptr(),
            1,
            width as isize,
            false,
            p.as_ptr(),
            1,
            n as isize,
            v.as_ptr(),
            1,
            width as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn naive(x: &[f32], rows: usize, w: &[f32], out: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0.0; rows * out];
        for r in 0..rows {
            for j in 0..out {
                y[r * out + j] = (0..k).map(|i| x[r * k + i] * w[j * k + i]).sum();
            }
        }
        y
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    /// The widened block is the rows transposed, value for value, on the SIMD tiles (16 rows
    /// × 16 columns) and the leftover rows and columns alike.
    #[test]
    fn widened_blocks_are_the_rows_transposed() {
        // The last is 1 MiB widened: its buffer comes from `recycle`, seeded here with NaNs
        // (values a kept buffer may hold), all of which must be overwritten.
        let _keeps_buffers = super::super::CpuBackend::new(1).unwrap();
        for &(n, k) in &[(16, 16), (37, 53), (64, 130), (5, 16), (256, 1024)] {
            super::super::recycle::give(vec![f32::NAN; n * k]);
            let v: Vec<bf16> = values((n + 3) * k, 3)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let m = CpuMatrix {
                rows: n + 3,
                cols: k,
                data: MatrixData::Bf16(v.clone()),
            };
            let got = widen_transposed(&m, 2..n + 2, k);
            for c in 0..k {
                for j in 0..n {
                    let want = v[(j + 2) * k + c].to_f32();
                    assert_eq!(got[c * n + j], want, "{n}x{k}: [{c}, {j}]");
                }
            }
        }
    }

    #[test]
    fn blocked_gemm_matches_a_naive_product_for_f32_and_bf16() {
        for &(rows, out, k) in &[(1, 7, 5), (3, 300, 129), (17, 64, 256), (40, 513, 96)] {
            let x = values(rows * k, 1);
            let w = values(out * k, 2);
            let w16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let w16_f32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            for (data, exact) in [
                (MatrixData::F32(w.clone()), naive(&x, rows, &w, out, k)),
                (
                    MatrixData::Bf16(w16.clone()),
                    naive(&x, rows, &w16_f32, out, k),
                ),
            ] {
                let m = CpuMatrix {
                    rows: out,
                    cols: k,
                    data,
                };
                // NaNs where the product goes: it must assign every value (a product's output
                // is a kept buffer's old values, `product_output`).
                let mut y = vec![f32::NAN; rows * out];
                let at = |stride| Strided {
                    offset: 0,
                    row_stride: stride,
                };
                gemm_into(&x, at(k), rows, &m, 0..out, &mut y, at(out));
                for (a, b) in y.iter().zip(&exact) {
                    assert!(
                        (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                        "{a} vs {b} ({rows}x{out}x{k})"
                    );
                }
            }
        }
    }
}
