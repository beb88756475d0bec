//! Matrix multiplication on the engine's thread pool: the `gemm` crate's f32 kernels over
//! blocks of output features, with bf16 weights widened block by block.

use std::ops::Range;

use gemm::Parallelism;
use half::bf16;
use rayon::prelude::*;

use super::{CpuMatrix, MatrixData};

/// A raw destination pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct Dst(*mut f32);
// SAFETY: every task writes a disjoint set of output columns (see `gemm_into`).
unsafe impl Send for Dst {}
// SAFETY: as above; the pointer is only used for disjoint writes.
unsafe impl Sync for Dst {}

impl Dst {
    /// Taking `self` makes closures capture the whole (Send) wrapper, not the raw field.
    fn get(self) -> *mut f32 {
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
    // bf16, FP8, FP4: widen blocks of output features, each multiplied on one thread.
    let threads = rayon::current_num_threads().max(1);
    let work = rows * n * k;
    let blocks = if work < 1 << 16 {
        1
    } else {
        (threads * 4).min(n.div_ceil(16)).max(1)
    };
    let block = n.div_ceil(blocks);
    let dst_ptr = Dst(dst.as_mut_ptr());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let j0 = b * block;
        let j1 = (j0 + block).min(n);
        let w_block = w_rows.start + j0..w_rows.start + j1;
        let widened;
        let rhs: &[f32] = match &w.data {
            MatrixData::F32(v) => &v[w_block.start * k..w_block.end * k],
            MatrixData::Bf16(v) => {
                widened = widen(&v[w_block.start * k..w_block.end * k]);
                &widened
            }
            MatrixData::Stacked(_) => unreachable!("stacked parts are multiplied part by part"),
            MatrixData::Native(q) => {
                let mut rows = vec![0.0f32; w_block.len() * k];
                for (r, out) in w_block.clone().zip(rows.chunks_exact_mut(k)) {
                    q.decode_row(k, r, out);
                }
                widened = rows;
                &widened
            }
        };
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
    });
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

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
                let mut y = vec![0.0; rows * out];
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
