//! Element-wise and per-row ops: embedding gather, RMSNorm, RoPE, SwiGLU, row selection.

use half::bf16;
use rayon::prelude::*;

use super::{recycle, CpuMatrix};

/// Rows below this many values are processed without splitting across threads.
const PAR_MIN: usize = 1 << 14;

pub(super) fn embed(table: &CpuMatrix, ids: &[i32]) -> Vec<f32> {
    let d = table.cols;
    // Every row written (a kept buffer's old values need no zeroing pass first).
    let mut out = recycle::overwritten(ids.len() * d);
    out.par_chunks_mut(d)
        .zip(ids)
        .for_each(|(row, &id)| table.data.row_into(d, id as usize, row));
    out
}

/// `1 / sqrt(mean(x²) + eps)`, accumulated in f64 so long rows keep f32-exact results.
pub(super) fn inv_rms(x: &[f32], eps: f32) -> f32 {
    // Eight partial sums (f64, as one sum was): independent chains that the compiler keeps in
    // vector registers. One running sum is one dependent add per value, ~5 µs for a 4096-wide
    // mHC row, 1.4 ms of every hc_pre of a 512-token prefill.
    let mut acc = [0f64; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    let sum = acc.iter().sum::<f64>() + tail;
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

pub(super) fn rms_norm(x: &[f32], dim: usize, weight: Option<&[f32]>, eps: f32) -> Vec<f32> {
    // Written once from `x` (not copied, then scaled in place: one pass over the output less).
    let mut out = recycle::overwritten(x.len());
    let norm = |(o, v): (&mut [f32], &[f32])| {
        let r = inv_rms(v, eps);
        match weight {
            Some(w) => o
                .iter_mut()
                .zip(v.iter().zip(w))
                .for_each(|(o, (x, w))| *o = *x * r * w),
            None => o.iter_mut().zip(v).for_each(|(o, x)| *o = *x * r),
        }
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(dim)
            .zip(x.par_chunks(dim))
            .for_each(norm);
    } else {
        out.chunks_mut(dim).zip(x.chunks(dim)).for_each(norm);
    }
    out
}

/// Rotates the trailing `2·inv_freq.len()` channels of every head in place.
pub(super) fn rope(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    positions: &[i32],
    inverse: bool,
) {
    let width = heads * head_dim;
    let pairs = inv_freq.len();
    let start = head_dim - 2 * pairs;
    let rotate_row = |(row, &pos): (&mut [f32], &i32)| {
        // cos/sin of pos·θ in f32, as transformers computes them.
        let (sin, cos): (Vec<f32>, Vec<f32>) =
            inv_freq.iter().map(|&f| (pos as f32 * f).sin_cos()).unzip();
        for head in row.chunks_mut(head_dim) {
            let rot = &mut head[start..];
            for i in 0..pairs {
                let (a, b) = (rot[2 * i], rot[2 * i + 1]);
                let s = if inverse { -sin[i] } else { sin[i] };
                rot[2 * i] = a * cos[i] - b * s;
                rot[2 * i + 1] = a * s + b * cos[i];
            }
        }
    };
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(width).zip(positions).for_each(rotate_row);
    } else {
        x.chunks_mut(width).zip(positions).for_each(rotate_row);
    }
}

pub(super) fn swiglu(gate_up: &[f32], inter: usize, limit: f32) -> Vec<f32> {
    let rows = gate_up.len() / (2 * inter);
    // Every value written.
    let mut out = recycle::overwritten(rows * inter);
    out.par_chunks_mut(inter.max(1))
        .zip(gate_up.par_chunks(2 * inter.max(1)))
        .for_each(|(o, gu)| swiglu_row(&gu[..inter], &gu[inter..], limit, o));
    out
}

/// `silu(min(g, L)) · clamp(u, −L, L)`; `limit <= 0` disables the clamp.
pub(super) fn swiglu_row(gate: &[f32], up: &[f32], limit: f32, out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let (g, u) = if limit > 0.0 {
            (g.min(limit), u.clamp(-limit, limit))
        } else {
            (g, u)
        };
        *o = g / (1.0 + (-g).exp()) * u;
    }
}

pub(super) fn fp8_round_trip(x: &mut [f32], width: usize, channels: usize, block: usize) {
    x.par_chunks_mut(width).for_each(|row| {
        row[..channels]
            .chunks_mut(block)
            .for_each(crate::formats::fp8_round_trip)
    });
}

pub(super) fn hadamard_fp4_round_trip(x: &mut [f32], dim: usize, block: usize) {
    x.par_chunks_mut(dim).for_each(|v| {
        crate::formats::hadamard(v);
        v.chunks_mut(block).for_each(crate::formats::fp4_round_trip);
    });
}

pub(super) fn take_rows(x: &[f32], cols: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = recycle::with_capacity(rows.len() * cols);
    for &r in rows {
        out.extend_from_slice(&x[r * cols..(r + 1) * cols]);
    }
    out
}

/// `v` rounded to bf16, in memory marked for huge pages (a weight matrix).
pub(super) fn to_bf16(v: &[f32]) -> Vec<bf16> {
    let mut out = super::huge_pages::reserve(v.len());
    out.extend(v.iter().map(|&x| bf16::from_f32(x)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_is_a_rotation_and_inverse_undoes_it() {
        let inv = [1.0f32, 0.1];
        let original: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 2.0).collect();
        let mut x = original.clone();
        rope(&mut x, 2, 8, &inv, &[7], false);
        // The first 4 channels of each head are untouched; pair norms are kept.
        assert_eq!(&x[..4], &original[..4]);
        let norm = |v: &[f32]| (v[0] * v[0] + v[1] * v[1]).sqrt();
        assert!((norm(&x[4..6]) - norm(&original[4..6])).abs() < 1e-5);
        // Pair 0 rotates by 7 rad: (a, b) → (a cos − b sin, a sin + b cos).
        let (s, c) = 7.0f32.sin_cos();
        let (a, b) = (original[4], original[5]);
        assert!((x[4] - (a * c - b * s)).abs() < 1e-6);
        assert!((x[5] - (a * s + b * c)).abs() < 1e-6);
        rope(&mut x, 2, 8, &inv, &[7], true);
        for (y, o) in x.iter().zip(&original) {
            assert!((y - o).abs() < 1e-5);
        }
    }

    #[test]
    fn rms_norm_and_swiglu_follow_their_formulas() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let y = rms_norm(&x, 4, Some(&[1.0, 2.0, 1.0, 1.0]), 0.0);
        let r = 1.0 / (25.0f32 / 4.0).sqrt();
        assert!((y[0] - 3.0 * r).abs() < 1e-6 && (y[1] - 8.0 * r).abs() < 1e-6);
        let mut out = [0.0; 2];
        swiglu_row(&[20.0, -1.0], &[-30.0, 0.5], 10.0, &mut out);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert!((out[0] - silu(10.0) * -10.0).abs() < 1e-4);
        assert!((out[1] - silu(-1.0) * 0.5).abs() < 1e-6);
    }
}
