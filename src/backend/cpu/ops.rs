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
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F detected.
        return unsafe { inv_rms_avx512(x, eps) };
    }
    inv_rms_lanes(x, eps)
}

/// [`inv_rms`] compiled for AVX-512: four 8-wide f64 chains where the baseline build has
/// sixteen 2-wide ones (the same sums: IEEE operations, no fused multiply-add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn inv_rms_avx512(x: &[f32], eps: f32) -> f32 {
    inv_rms_lanes(x, eps)
}

#[inline(always)]
fn inv_rms_lanes(x: &[f32], eps: f32) -> f32 {
    // 32 partial sums (f64, as one sum was): independent chains that the compiler keeps in
    // vector registers. One running sum is one dependent add per value, ~5 µs for a 4096-wide
    // mHC row, 1.4 ms of every hc_pre of a 512-token prefill; eight were latency-bound at two
    // values a cycle.
    let mut acc = [0f64; 32];
    let mut chunks = x.chunks_exact(32);
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
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F detected.
            return unsafe { norm_row_avx512(o, v, weight, eps) };
        }
        norm_row(o, v, weight, eps);
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

/// One row of [`rms_norm`]: `o = v · inv_rms(v) (· w)`.
#[inline(always)]
fn norm_row(o: &mut [f32], v: &[f32], weight: Option<&[f32]>, eps: f32) {
    let r = inv_rms_lanes(v, eps);
    match weight {
        Some(w) => o
            .iter_mut()
            .zip(v.iter().zip(w))
            .for_each(|(o, (x, w))| *o = *x * r * w),
        None => o.iter_mut().zip(v).for_each(|(o, x)| *o = *x * r),
    }
}

/// [`norm_row`] compiled for AVX-512 (the same values: IEEE operations only).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn norm_row_avx512(o: &mut [f32], v: &[f32], weight: Option<&[f32]>, eps: f32) {
    norm_row(o, v, weight, eps);
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
    let angles = Angles::of(inv_freq, positions);
    let rotate_row = |((row, sin), cos): ((&mut [f32], &[f32]), &[f32])| {
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
    let per = pairs.max(1);
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(width)
            .zip(angles.sin.par_chunks(per))
            .zip(angles.cos.par_chunks(per))
            .for_each(rotate_row);
    } else {
        x.chunks_mut(width)
            .zip(angles.sin.chunks(per))
            .zip(angles.cos.chunks(per))
            .for_each(rotate_row);
    }
}

/// `sin` and `cos` of `position · θ_i` in f32 (as transformers computes them), `[positions,
/// pairs]`. A prefill's RoPE calls share them: every layer rotates the same positions by the
/// same frequencies (36 calls of a 512-token prefill of the bench model, each spending most of
/// its time in `sin_cos` before), so the last few sets are kept, matched by their frequencies
/// and positions.
struct Angles {
    sin: Vec<f32>,
    cos: Vec<f32>,
}

/// A kept set of [`Angles`] with what it was made from.
type KeptAngles = (Vec<f32>, Vec<i32>, std::sync::Arc<Angles>);

impl Angles {
    /// Sets kept (a prefill's positions and its compressed rows' for each frequency set).
    const KEPT: usize = 4;
    /// Fewer positions than this are computed each call (a decode step's: a lookup would cost
    /// about what it saves).
    const MIN_KEPT: usize = 64;

    fn new(inv_freq: &[f32], positions: &[i32]) -> Angles {
        let (sin, cos) = positions
            .iter()
            .flat_map(|&p| inv_freq.iter().map(move |&f| (p as f32 * f).sin_cos()))
            .unzip();
        Angles { sin, cos }
    }

    fn of(inv_freq: &[f32], positions: &[i32]) -> std::sync::Arc<Angles> {
        use std::sync::{Arc, Mutex};
        static KEPT: Mutex<Vec<KeptAngles>> = Mutex::new(Vec::new());
        if positions.len() < Self::MIN_KEPT {
            return Arc::new(Self::new(inv_freq, positions));
        }
        let same = |(f, p, _): &&KeptAngles| f[..] == *inv_freq && p[..] == *positions;
        if let Some((_, _, a)) = KEPT.lock().unwrap().iter().find(same) {
            return Arc::clone(a);
        }
        let made = Arc::new(Self::new(inv_freq, positions));
        let mut kept = KEPT.lock().unwrap();
        if kept.len() >= Self::KEPT {
            kept.remove(0);
        }
        kept.push((inv_freq.to_vec(), positions.to_vec(), Arc::clone(&made)));
        made
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

    /// `inv_rms` is `1 / sqrt(mean(x²) + eps)` from an f64 sum to within an f32 rounding, and
    /// the AVX-512 build of it and of a normalised row give the baseline build's bits.
    #[test]
    fn inv_rms_is_the_mean_square_and_every_build_gives_the_same_bits() {
        for (n, scale) in [
            (32usize, 1.0f32),
            (1024, 3.0),
            (4096, 1e-3),
            (4096 + 7, 50.0),
        ] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.377).sin() * scale).collect();
            let mean = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / n as f64;
            let want = 1.0 / (mean + 1e-6).sqrt();
            let got = f64::from(inv_rms(&x, 1e-6));
            assert!(
                (got - want).abs() <= 2.5e-7 * want,
                "n {n}: {got} vs {want}"
            );
            // The dispatched build against the baseline one.
            assert_eq!(
                inv_rms_lanes(&x, 1e-6).to_bits(),
                (got as f32).to_bits(),
                "n {n}"
            );
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                let w: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 1e-3).collect();
                let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                norm_row(&mut a, &x, Some(&w), 1e-6);
                // SAFETY: AVX-512F detected.
                unsafe { norm_row_avx512(&mut b, &x, Some(&w), 1e-6) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "n {n}");
            } else {
                eprintln!("no AVX-512 here: only the baseline build is checked");
            }
        }
    }

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

    /// A prefill's positions (enough to keep their angles) rotate by each position's own
    /// angles on the first call and on later ones that find them kept, also among other kept
    /// sets; the inverse undoes it.
    #[test]
    fn kept_angles_rotate_each_position_by_its_own() {
        let inv = [1.0f32, 0.37, 0.05];
        let (heads, hd) = (2, 8);
        let positions: Vec<i32> = (0..100).map(|p| 3 * p + 1).collect();
        let other: Vec<i32> = (0..100).map(|p| 2 * p).collect();
        let original: Vec<f32> = (0..positions.len() * heads * hd)
            .map(|i| (i as f32 * 0.7).sin())
            .collect();
        for round in 0..3 {
            let mut x = original.clone();
            rope(&mut x, heads, hd, &inv, &positions, false);
            for (r, &pos) in positions.iter().enumerate() {
                for h in 0..heads {
                    let at = (r * heads + h) * hd;
                    assert_eq!(&x[at..at + 2], &original[at..at + 2]);
                    for (i, &f) in inv.iter().enumerate() {
                        let (s, c) = (pos as f32 * f).sin_cos();
                        let (a, b) = (original[at + 2 + 2 * i], original[at + 3 + 2 * i]);
                        assert_eq!(x[at + 2 + 2 * i], a * c - b * s, "round {round}");
                        assert_eq!(x[at + 3 + 2 * i], a * s + b * c, "round {round}");
                    }
                }
            }
            rope(&mut x, heads, hd, &inv, &positions, true);
            for (y, o) in x.iter().zip(&original) {
                assert!((y - o).abs() < 1e-5);
            }
            // Another set kept between rounds.
            let mut y = original.clone();
            rope(&mut y, heads, hd, &inv, &other, false);
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
