//! Manifold-constrained hyper-connections: the `hc` residual streams collapsed into one block
//! input (`pre`), the block output spread back (`post`), and the streams mixed by a doubly
//! stochastic matrix (`comb`, Sinkhorn-normalised: column first, ending on a column).

use rayon::prelude::*;

use super::ops::inv_rms;
use super::{gemm, CpuBackend, CpuMatrix};
use crate::backend::{Backend, HcMix, HcParams};

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `rms(flat) @ fnᵀ` for every row: the raw mixing logits `[rows, fn.rows]`, computed as
/// `(flat @ fnᵀ) · inv_rms(flat)` — the same up to rounding, without writing a normalised
/// copy of the `hc·dim`-wide streams (8 MB for a 512-token chunk, and its page faults).
fn mixes(x: &[f32], rows: usize, p: &HcParams<'_, CpuBackend>) -> Vec<f32> {
    let width = p.hc * p.dim;
    let f: &CpuMatrix = p.fn_;
    let mut out = vec![0.0; rows * f.rows];
    let at = |stride| gemm::Strided {
        offset: 0,
        row_stride: stride,
    };
    gemm::gemm_into(x, at(width), rows, f, 0..f.rows, &mut out, at(f.rows));
    out.par_chunks_mut(f.rows.max(1))
        .zip(x.par_chunks(width))
        .for_each(|(mix, row)| {
            let r = inv_rms(row, p.norm_eps);
            mix.iter_mut().for_each(|m| *m *= r);
        });
    out
}

pub(super) fn pre(
    b: &CpuBackend,
    x: &[f32],
    rows: usize,
    p: &HcParams<'_, CpuBackend>,
) -> HcMix<CpuBackend> {
    let (hc, dim) = (p.hc, p.dim);
    let logits = mixes(x, rows, p);
    let n_mix = (2 + hc) * hc;
    let (base, scale) = (&p.base.0, &p.scale.0);
    let mut pre = vec![0.0; rows * hc];
    let mut post = vec![0.0; rows * hc];
    let mut comb = vec![0.0; rows * hc * hc];
    pre.par_chunks_mut(hc)
        .zip(post.par_chunks_mut(hc))
        .zip(comb.par_chunks_mut(hc * hc))
        .zip(logits.par_chunks(n_mix))
        .for_each(|(((pre, post), comb), mix)| {
            for i in 0..hc {
                pre[i] = sigmoid(mix[i] * scale[0] + base[i]) + p.hc_eps;
                post[i] = 2.0 * sigmoid(mix[hc + i] * scale[1] + base[hc + i]);
            }
            for (c, (&m, &bias)) in comb
                .iter_mut()
                .zip(mix[2 * hc..].iter().zip(&base[2 * hc..]))
            {
                *c = m * scale[2] + bias;
            }
            sinkhorn(comb, hc, p.sinkhorn_iters, p.hc_eps);
        });
    let mut collapsed = vec![0.0; rows * dim];
    collapsed
        .par_chunks_mut(dim)
        .zip(x.par_chunks(hc * dim))
        .zip(pre.par_chunks(hc))
        .for_each(|((out, streams), pre)| weighted_sum(out, streams, pre, dim));
    HcMix {
        collapsed: b.wrap(collapsed),
        post: b.wrap(post),
        comb: b.wrap(comb),
    }
}

/// `out = Σ_i w[i] · streams[i]`.
fn weighted_sum(out: &mut [f32], streams: &[f32], w: &[f32], dim: usize) {
    out.fill(0.0);
    for (stream, &wi) in streams.chunks(dim).zip(w) {
        out.iter_mut().zip(stream).for_each(|(o, &s)| *o += wi * s);
    }
}

/// Row softmax + ε, then alternate column and row normalisation, ending on a column one
/// (`c[j·hc + k]`: row j, column k).
fn sinkhorn(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
    for row in c.chunks_mut(hc) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row
            .iter_mut()
            .map(|v| {
                *v = (*v - max).exp();
                *v
            })
            .sum();
        row.iter_mut().for_each(|v| *v = *v / sum + eps);
    }
    let normalize_columns = |c: &mut [f32]| {
        for k in 0..hc {
            let sum: f32 = (0..hc).map(|j| c[j * hc + k]).sum::<f32>() + eps;
            (0..hc).for_each(|j| c[j * hc + k] /= sum);
        }
    };
    normalize_columns(c);
    for _ in 1..iters {
        for row in c.chunks_mut(hc) {
            let sum: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= sum);
        }
        normalize_columns(c);
    }
}

pub(super) fn post(
    out: &[f32],
    x: &[f32],
    mix: &HcMix<CpuBackend>,
    hc: usize,
    dim: usize,
) -> Vec<f32> {
    let mut y = vec![0.0; x.len()];
    y.par_chunks_mut(hc * dim)
        .zip(x.par_chunks(hc * dim))
        .zip(out.par_chunks(dim))
        .zip(
            mix.post
                .0
                .par_chunks(hc)
                .zip(mix.comb.0.par_chunks(hc * hc)),
        )
        .for_each(|(((y, x), o), (post, comb))| {
            for (k, yk) in y.chunks_mut(dim).enumerate() {
                yk.iter_mut().zip(o).for_each(|(v, &ov)| *v = post[k] * ov);
                for (j, xj) in x.chunks(dim).enumerate() {
                    let c = comb[j * hc + k];
                    yk.iter_mut().zip(xj).for_each(|(v, &xv)| *v += c * xv);
                }
            }
        });
    y
}

pub(super) fn head(x: &[f32], rows: usize, p: &HcParams<'_, CpuBackend>) -> Vec<f32> {
    let (hc, dim) = (p.hc, p.dim);
    let logits = mixes(x, rows, p);
    let mut out = vec![0.0; rows * dim];
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(hc * dim))
        .zip(logits.par_chunks(hc))
        .for_each(|((out, streams), mix)| {
            let w: Vec<f32> = (0..hc)
                .map(|i| sigmoid(mix[i] * p.scale.0[0] + p.base.0[i]) + p.hc_eps)
                .collect();
            weighted_sum(out, streams, &w, dim);
        });
    out
}

pub(super) fn expand(
    b: &CpuBackend,
    x: &[f32],
    hc: usize,
    dim: usize,
) -> <CpuBackend as Backend>::Tensor {
    let mut out = Vec::with_capacity(x.len() * hc);
    for row in x.chunks(dim) {
        for _ in 0..hc {
            out.extend_from_slice(row);
        }
    }
    b.wrap(out)
}

#[cfg(test)]
mod tests {
    use super::sinkhorn;

    #[test]
    fn sinkhorn_gives_a_nearly_doubly_stochastic_matrix() {
        let mut c: Vec<f32> = (0..16).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for k in 0..4 {
            let col: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            let row: f32 = c[k * 4..k * 4 + 4].iter().sum();
            assert!((col - 1.0).abs() < 1e-4, "column {k}: {col}");
            assert!((row - 1.0).abs() < 1e-2, "row {k}: {row}");
        }
    }
}
