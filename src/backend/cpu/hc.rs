//! Manifold-constrained hyper-connections: the `hc` residual streams collapsed into one block
//! input (`pre`), the block output spread back (`post`), and the streams mixed by a doubly
//! stochastic matrix (`comb`, Sinkhorn-normalised: column first, ending on a column).

use rayon::prelude::*;

use super::ops::inv_rms;
use super::{gemm, gemv, recycle, CpuBackend, CpuMatrix};
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
    let logits = mixes(x, rows, p);
    let mut mix = Mix::new(rows, p);
    mix.rows_mut()
        .zip(logits.par_chunks(n_mix(p)))
        .zip(x.par_chunks(p.hc * p.dim))
        .for_each(|((row, logits), streams)| row.finish(logits, streams, p));
    mix.wrap(b)
}

/// Logits per row: `pre`, `post` and `comb` (`hc` + `hc` + `hc²`).
fn n_mix(p: &HcParams<'_, CpuBackend>) -> usize {
    (2 + p.hc) * p.hc
}

/// A mix being made: per row the collapsed input, `post` and `comb`.
struct Mix {
    collapsed: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
    hc: usize,
    dim: usize,
}

/// One row of a [`Mix`].
struct MixRow<'a> {
    collapsed: &'a mut [f32],
    post: &'a mut [f32],
    comb: &'a mut [f32],
}

impl Mix {
    fn new(rows: usize, p: &HcParams<'_, CpuBackend>) -> Self {
        let (hc, dim) = (p.hc, p.dim);
        Mix {
            // Each row written by `weighted_sum` (which clears it first).
            collapsed: recycle::overwritten(rows * dim),
            post: vec![0.0; rows * hc],
            comb: vec![0.0; rows * hc * hc],
            hc,
            dim,
        }
    }

    /// The rows, in parallel.
    fn rows_mut(&mut self) -> impl IndexedParallelIterator<Item = MixRow<'_>> {
        let (hc, dim) = (self.hc, self.dim);
        self.collapsed
            .par_chunks_mut(dim)
            .zip(self.post.par_chunks_mut(hc))
            .zip(self.comb.par_chunks_mut(hc * hc))
            .map(|((collapsed, post), comb)| MixRow {
                collapsed,
                post,
                comb,
            })
    }

    /// The rows in tiles of [`TILE`], each tile's rows in order.
    fn tiles_mut(&mut self) -> impl Iterator<Item = Vec<MixRow<'_>>> {
        let (hc, dim) = (self.hc, self.dim);
        self.collapsed
            .chunks_mut(TILE * dim)
            .zip(self.post.chunks_mut(TILE * hc))
            .zip(self.comb.chunks_mut(TILE * hc * hc))
            .map(move |((collapsed, post), comb)| {
                collapsed
                    .chunks_mut(dim)
                    .zip(post.chunks_mut(hc))
                    .zip(comb.chunks_mut(hc * hc))
                    .map(|((collapsed, post), comb)| MixRow {
                        collapsed,
                        post,
                        comb,
                    })
                    .collect()
            })
    }

    fn wrap(self, b: &CpuBackend) -> HcMix<CpuBackend> {
        HcMix {
            collapsed: b.wrap(self.collapsed),
            post: b.wrap(self.post),
            comb: b.wrap(self.comb),
        }
    }
}

impl MixRow<'_> {
    /// From one row's logits (already times its streams' `inv_rms`): the `pre` weights (which
    /// collapse `streams` into this row's input), `post`, and `comb` through Sinkhorn.
    fn finish(self, logits: &[f32], streams: &[f32], p: &HcParams<'_, CpuBackend>) {
        let hc = p.hc;
        let (base, scale) = (&p.base.0, &p.scale.0);
        for i in 0..hc {
            self.post[i] = 2.0 * sigmoid(logits[hc + i] * scale[1] + base[hc + i]);
        }
        for (c, (&m, &bias)) in self
            .comb
            .iter_mut()
            .zip(logits[2 * hc..].iter().zip(&base[2 * hc..]))
        {
            *c = m * scale[2] + bias;
        }
        sinkhorn(self.comb, hc, p.sinkhorn_iters, p.hc_eps);
        weighted_sum(self.collapsed, streams, &pre_weights(logits, p), p.dim);
    }
}

/// The weights that collapse a row's streams into one input, from its logits' first `hc`:
/// `sigmoid(logit · scale + base) + eps`.
fn pre_weights(logits: &[f32], p: &HcParams<'_, CpuBackend>) -> Vec<f32> {
    (0..p.hc)
        .map(|i| sigmoid(logits[i] * p.scale.0[0] + p.base.0[i]) + p.hc_eps)
        .collect()
}

/// Rows per tile of [`post_pre`]: their streams (16 × 4 × 4096 f32 = 1 MiB at the release's
/// width, 256 KiB at the bench model's) are still in cache for the mixes and the collapse.
pub(super) const TILE: usize = 16;

/// [`post`] then [`pre`] with the next block's parameters, in one pass over the streams: a
/// tile of rows has its new streams written, then their mixing logits (a product with
/// `fn`), RMS, Sinkhorn and collapse computed while those streams are in cache. Apart, the
/// two read the `hc·dim`-wide streams four times from memory (post's output, the product,
/// the RMS, the collapse). The new streams are the same bits, written over the old ones
/// (`x`); the logits are the product of the same values in tiles instead of in one call
/// (rounding may differ, as between a decode step and a prefill).
pub(super) fn post_pre(
    b: &CpuBackend,
    out: &[f32],
    mut x: Vec<f32>,
    prev: &HcMix<CpuBackend>,
    rows: usize,
    p: &HcParams<'_, CpuBackend>,
) -> (Vec<f32>, HcMix<CpuBackend>) {
    let (hc, dim) = (p.hc, p.dim);
    let width = hc * dim;
    let f: &CpuMatrix = p.fn_;
    let nm = n_mix(p);
    let mut mix = Mix::new(rows, p);
    let tiles: Vec<_> = x
        .chunks_mut(TILE * width)
        .zip(mix.tiles_mut())
        .enumerate()
        .collect();
    // `fn` and each tile's new streams on 64-byte lines for the logits' product (`aligned`;
    // the streams and a small `fn` sit anywhere on 16-byte boundaries): with more than a
    // tile of rows, where copying `fn` once is worth it.
    let mut fn_copy = Vec::new();
    let fn_values = f.f32_values().map(|w| {
        if rows > TILE {
            super::aligned::copy(&mut fn_copy, w)
        } else {
            w
        }
    });
    tiles
        .into_par_iter()
        .for_each_init(Vec::new, |tile, (t, (y, tile_rows))| {
            let r0 = t * TILE;
            let n = y.len() / width;
            // Each row's new streams replace its old ones (they are the old streams' only use):
            // no fresh 8 MB output to fault in per call. They are made in the tile's scratch.
            let new = super::aligned::scratch(tile, n * width);
            for (i, (y, row)) in y.chunks_mut(width).zip(new.chunks_mut(width)).enumerate() {
                let r = r0 + i;
                post_row(
                    row,
                    y,
                    &out[r * dim..(r + 1) * dim],
                    &prev.post.0[r * hc..(r + 1) * hc],
                    &prev.comb.0[r * hc * hc..(r + 1) * hc * hc],
                    hc,
                    dim,
                );
                y.copy_from_slice(row);
            }
            let y: &[f32] = new;
            let mut logits = vec![0.0; n * nm];
            match fn_values {
                // The tile's rows against every row of `fn`, four by four (each load of `fn`
                // serves four rows of the tile), on this thread.
                Some(w) => gemv::attention_scores(y, n, width, w, f.rows, &mut logits),
                None => {
                    let at = |stride| gemm::Strided {
                        offset: 0,
                        row_stride: stride,
                    };
                    gemm::gemm_into(y, at(width), n, f, 0..f.rows, &mut logits, at(f.rows));
                }
            }
            for ((row, logits), streams) in tile_rows
                .into_iter()
                .zip(logits.chunks_mut(nm))
                .zip(y.chunks(width))
            {
                let r = inv_rms(streams, p.norm_eps);
                logits.iter_mut().for_each(|m| *m *= r);
                row.finish(logits, streams, p);
            }
        });
    (x, mix.wrap(b))
}

/// `out = Σ_i w[i] · streams[i]`, each value summed from 0 in stream order.
fn weighted_sum(out: &mut [f32], streams: &[f32], w: &[f32], dim: usize) {
    if let (&[w0, w1, w2, w3], true) = (w, streams.len() == 4 * dim && out.len() == dim) {
        // The release's four streams in one pass (the same sums as `weighted_sum_any`'s
        // passes).
        let (s0, rest) = streams.split_at(dim);
        let (s1, rest) = rest.split_at(dim);
        let (s2, s3) = rest.split_at(dim);
        for (i, o) in out.iter_mut().enumerate() {
            *o = 0.0 + w0 * s0[i] + w1 * s1[i] + w2 * s2[i] + w3 * s3[i];
        }
        return;
    }
    weighted_sum_any(out, streams, w, dim);
}

/// [`weighted_sum`] for any number of streams, a pass per stream.
fn weighted_sum_any(out: &mut [f32], streams: &[f32], w: &[f32], dim: usize) {
    out.fill(0.0);
    for (stream, &wi) in streams.chunks(dim).zip(w) {
        out.iter_mut().zip(stream).for_each(|(o, &s)| *o += wi * s);
    }
}

/// Row softmax + ε, then alternate column and row normalisation, ending on a column one
/// (`c[j·hc + k]`: row j, column k).
fn sinkhorn(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
    match <&mut [f32; 16]>::try_from(&mut *c) {
        Ok(four) if hc == 4 => sinkhorn4(four, iters, eps),
        _ => sinkhorn_any(c, hc, iters, eps),
    }
}

/// [`sinkhorn`] for any number of streams.
fn sinkhorn_any(c: &mut [f32], hc: usize, iters: usize, eps: f32) {
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

/// [`sinkhorn`] for the release's four streams, the same operations in the same order
/// (every sum from 0 in index order, every division as one), written over rows of four so
/// the divisions and the column sums run four at a time.
fn sinkhorn4(c: &mut [f32; 16], iters: usize, eps: f32) {
    let mut m: [[f32; 4]; 4] = std::array::from_fn(|j| std::array::from_fn(|k| c[j * 4 + k]));
    for row in &mut m {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for v in row.iter_mut() {
            *v = (*v - max).exp();
        }
        let sum = 0.0 + row[0] + row[1] + row[2] + row[3];
        for v in row.iter_mut() {
            *v = *v / sum + eps;
        }
    }
    let normalize_columns = |m: &mut [[f32; 4]; 4]| {
        let sum: [f32; 4] =
            std::array::from_fn(|k| 0.0 + m[0][k] + m[1][k] + m[2][k] + m[3][k] + eps);
        for row in m.iter_mut() {
            for (v, s) in row.iter_mut().zip(sum) {
                *v /= s;
            }
        }
    };
    normalize_columns(&mut m);
    for _ in 1..iters {
        for row in &mut m {
            let sum = 0.0 + row[0] + row[1] + row[2] + row[3] + eps;
            for v in row.iter_mut() {
                *v /= sum;
            }
        }
        normalize_columns(&mut m);
    }
    for (j, row) in m.iter().enumerate() {
        c[j * 4..j * 4 + 4].copy_from_slice(row);
    }
}

pub(super) fn post(
    out: &[f32],
    x: &[f32],
    mix: &HcMix<CpuBackend>,
    hc: usize,
    dim: usize,
) -> Vec<f32> {
    // Every value written by `post_row`.
    let mut y = recycle::overwritten(x.len());
    y.par_chunks_mut(hc * dim)
        .zip(x.par_chunks(hc * dim))
        .zip(out.par_chunks(dim))
        .zip(
            mix.post
                .0
                .par_chunks(hc)
                .zip(mix.comb.0.par_chunks(hc * hc)),
        )
        .for_each(|(((y, x), o), (post, comb))| post_row(y, x, o, post, comb, hc, dim));
    y
}

/// One row's new streams: `y[k] = post[k] · o + Σ_j comb[j, k] · x[j]`, summed in that order
/// (`j` ascending, each term rounded then added).
fn post_row(
    y: &mut [f32],
    x: &[f32],
    o: &[f32],
    post: &[f32],
    comb: &[f32],
    hc: usize,
    dim: usize,
) {
    if hc == 4 {
        // The release's four streams: all four outputs of a column from one read of its five
        // inputs (one pass that vectorises, instead of a pass per term).
        let (x0, rest) = x[..4 * dim].split_at(dim);
        let (x1, rest) = rest.split_at(dim);
        let (x2, x3) = rest.split_at(dim);
        let (y0, rest) = y[..4 * dim].split_at_mut(dim);
        let (y1, rest) = rest.split_at_mut(dim);
        let (y2, y3) = rest.split_at_mut(dim);
        let o = &o[..dim];
        let c = |j: usize, k: usize| comb[j * 4 + k];
        for i in 0..dim {
            let (a, b, cc, d, v) = (x0[i], x1[i], x2[i], x3[i], o[i]);
            y0[i] = post[0] * v + c(0, 0) * a + c(1, 0) * b + c(2, 0) * cc + c(3, 0) * d;
            y1[i] = post[1] * v + c(0, 1) * a + c(1, 1) * b + c(2, 1) * cc + c(3, 1) * d;
            y2[i] = post[2] * v + c(0, 2) * a + c(1, 2) * b + c(2, 2) * cc + c(3, 2) * d;
            y3[i] = post[3] * v + c(0, 3) * a + c(1, 3) * b + c(2, 3) * cc + c(3, 3) * d;
        }
        return;
    }
    for (k, yk) in y.chunks_mut(dim).enumerate() {
        yk.iter_mut().zip(o).for_each(|(v, &ov)| *v = post[k] * ov);
        for (j, xj) in x.chunks(dim).enumerate() {
            let c = comb[j * hc + k];
            yk.iter_mut().zip(xj).for_each(|(v, &xv)| *v += c * xv);
        }
    }
}

pub(super) fn head(x: &[f32], rows: usize, p: &HcParams<'_, CpuBackend>) -> Vec<f32> {
    let (hc, dim) = (p.hc, p.dim);
    let logits = mixes(x, rows, p);
    let mut out = recycle::overwritten(rows * dim);
    out.par_chunks_mut(dim)
        .zip(x.par_chunks(hc * dim))
        .zip(logits.par_chunks(hc))
        .for_each(|((out, streams), mix)| weighted_sum(out, streams, &pre_weights(mix, p), dim));
    out
}

pub(super) fn expand(
    b: &CpuBackend,
    x: &[f32],
    hc: usize,
    dim: usize,
) -> <CpuBackend as Backend>::Tensor {
    let mut out = recycle::with_capacity(x.len() * hc);
    for row in x.chunks(dim) {
        for _ in 0..hc {
            out.extend_from_slice(row);
        }
    }
    b.wrap(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuTensor;
    use crate::backend::{Precision, WeightData, WeightFormat};

    use crate::backend::cpu::test_data::values;

    /// The fused post + pre (tiles of rows, new streams over the old) gives the same streams,
    /// bit for bit, as `post`, and the mix `pre` makes of them (to rounding: the logits are
    /// summed in another order), for the release's four streams and for three; with partial
    /// tiles; and on a backend with one thread.
    #[test]
    fn post_then_pre_fused_matches_the_two_apart() {
        for (hc, dim, rows, threads) in [(4, 64, 40, 2), (4, 32, 69, 2), (3, 48, 50, 1)] {
            let cpu = CpuBackend::new(threads).unwrap();
            let width = hc * dim;
            let n_mix = (2 + hc) * hc;
            let fn_values: Vec<u8> = values(1, n_mix * width)
                .iter()
                .flat_map(|v| (v * 0.2).to_le_bytes())
                .collect();
            let fn_ = cpu
                .matrix(
                    &WeightData::whole(WeightFormat::F32, &fn_values, vec![], n_mix, width),
                    Precision::F32,
                )
                .unwrap();
            let base = CpuTensor(values(2, n_mix));
            let scale = CpuTensor(vec![0.7, 1.3, 0.9]);
            let p = HcParams {
                fn_: &fn_,
                base: &base,
                scale: &scale,
                hc,
                dim,
                sinkhorn_iters: 20,
                hc_eps: 1e-6,
                norm_eps: 1e-6,
            };
            let x = values(3, rows * width);
            let out = values(4, rows * dim);
            // The previous block's mix: any post weights and a doubly stochastic comb.
            let prev = cpu.run(|| pre(&cpu, &values(5, rows * width), rows, &p));
            let apart_streams = cpu.run(|| post(&out, &x, &prev, hc, dim));
            let apart = cpu.run(|| pre(&cpu, &apart_streams, rows, &p));
            let (fused_streams, fused) =
                cpu.run(|| post_pre(&cpu, &out, x.clone(), &prev, rows, &p));
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&fused_streams),
                bits(&apart_streams),
                "hc {hc} rows {rows}"
            );
            for (name, a, f) in [
                ("collapsed", &apart.collapsed, &fused.collapsed),
                ("post", &apart.post, &fused.post),
                ("comb", &apart.comb, &fused.comb),
            ] {
                assert_eq!(a.0.len(), f.0.len());
                for (i, (a, f)) in a.0.iter().zip(&f.0).enumerate() {
                    assert!(
                        (a - f).abs() <= 1e-5 * (1.0 + a.abs()),
                        "hc {hc} rows {rows} {name}[{i}]: {f} vs {a}"
                    );
                }
            }
        }
    }

    #[test]
    fn sinkhorn_gives_a_nearly_doubly_stochastic_matrix_and_four_streams_the_same_bits() {
        let mut c: Vec<f32> = (0..16).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for k in 0..4 {
            let col: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            let row: f32 = c[k * 4..k * 4 + 4].iter().sum();
            assert!((col - 1.0).abs() < 1e-4, "column {k}: {col}");
            assert!((row - 1.0).abs() < 1e-2, "row {k}: {row}");
        }
        // Four streams take `sinkhorn4`: the general loop's bits, for logits of every size.
        for seed in 0..200u32 {
            let logits: Vec<f32> = (0..16)
                .map(|i| ((seed * 16 + i) as f32 * 0.731).sin() * (1 + seed % 9) as f32)
                .collect();
            let (mut four, mut any) = (logits.clone(), logits);
            sinkhorn(&mut four, 4, 20, 1e-6);
            sinkhorn_any(&mut any, 4, 20, 1e-6);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&four), bits(&any), "seed {seed}");
        }
    }

    /// Four streams are collapsed in one pass with the bits of a pass per stream.
    #[test]
    fn four_streams_collapse_in_one_pass_to_the_same_bits() {
        let dim = 100;
        let streams: Vec<f32> = (0..4 * dim)
            .map(|i| (i as f32 * 0.37).cos() * 3.0)
            .collect();
        let w = [0.3f32, 1.7, -0.2, 0.9];
        let (mut one, mut each) = (vec![f32::NAN; dim], vec![f32::NAN; dim]);
        weighted_sum(&mut one, &streams, &w, dim);
        weighted_sum_any(&mut each, &streams, &w, dim);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&one), bits(&each));
    }
}
