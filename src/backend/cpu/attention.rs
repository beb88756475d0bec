//! Per-sequence attention state and attention itself: compressor frontiers, the window ring,
//! the lightning indexer and windowed + compressed attention with sinks.

use rayon::prelude::*;

use super::{gemm, gemv, pool, CpuBackend, CpuTensor};
use crate::backend::{AttentionArgs, CompressArgs, IndexerArgs};

/// Advances a frontier by the new tokens and pools every window they close.
///
/// Frontier layout (per row: kv ‖ score, each `coff·width` wide): for CSA the first `ratio`
/// rows hold the last closed window (its first halves feed the next row), the next `ratio` the
/// pending window; for HCA the `ratio` rows are the pending window. Pending slot = position %
/// ratio, so the position alone says which slots are filled.
pub(super) fn compress(
    frontier: &mut [f32],
    a: &CompressArgs<'_, CpuBackend>,
) -> (Vec<f32>, usize) {
    let (ratio, width) = (a.ratio, a.width);
    let coff = if a.overlap { 2 } else { 1 };
    let cols = coff * width;
    let row_len = 2 * cols;
    let pending_base = if a.overlap { ratio } else { 0 };
    debug_assert_eq!(frontier.len(), coff * ratio * row_len);
    let (kv, gate, ape) = (&a.kv.0, &a.gate.0, &a.ape.0);
    let mut rows = Vec::new();
    for (i, r) in a.rows.clone().enumerate() {
        let pos = a.start_pos + i;
        let slot = pos % ratio;
        let dst =
            &mut frontier[(pending_base + slot) * row_len..(pending_base + slot + 1) * row_len];
        dst[..cols].copy_from_slice(&kv[r * cols..(r + 1) * cols]);
        for (c, s) in dst[cols..].iter_mut().enumerate() {
            *s = gate[r * cols + c] + ape[slot * cols + c];
        }
        if slot + 1 < ratio {
            continue;
        }
        let window = pos / ratio;
        let mut row = vec![0.0f32; width];
        pool_window(
            frontier,
            ratio,
            width,
            cols,
            a.overlap && window > 0,
            pending_base,
            &mut row,
        );
        rows.extend_from_slice(&row);
        if a.overlap {
            // The closed window becomes the overlap for the next one.
            frontier.copy_within(ratio * row_len..2 * ratio * row_len, 0);
        }
    }
    let n = rows.len() / width.max(1);
    (rows, n)
}

/// `row[c] = Σ_slots softmax_slots(score[·, c]) · kv[·, c]` over the window's slots: the
/// previous window's first halves (when `with_previous`) and the pending window's last halves
/// (its only half for HCA).
fn pool_window(
    frontier: &[f32],
    ratio: usize,
    width: usize,
    cols: usize,
    with_previous: bool,
    pending_base: usize,
    row: &mut [f32],
) {
    let row_len = 2 * cols;
    // (row index, column offset of the half that belongs to this window)
    let mut slots: Vec<(usize, usize)> = Vec::with_capacity(2 * ratio);
    if with_previous {
        slots.extend((0..ratio).map(|s| (s, 0)));
    }
    let current_half = if cols > width { width } else { 0 };
    slots.extend((0..ratio).map(|s| (pending_base + s, current_half)));
    for (c, out) in row.iter_mut().enumerate() {
        let score = |&(r, h): &(usize, usize)| frontier[r * row_len + cols + h + c];
        let max = slots.iter().map(score).fold(f32::NEG_INFINITY, f32::max);
        let (mut num, mut den) = (0.0f32, 0.0f32);
        for slot in &slots {
            let e = (score(slot) - max).exp();
            den += e;
            num += e * frontier[slot.0 * row_len + slot.1 + c];
        }
        *out = num / den;
    }
}

/// Keys visible to a query at `pos` among `n` rows of ratio `ratio`: rows whose window has
/// closed by `pos` (its last token ≤ pos).
fn visible_rows(pos: usize, ratio: usize, n: usize) -> usize {
    ((pos + 1) / ratio).min(n)
}

pub(super) fn indexer_top_k(a: &IndexerArgs<'_, CpuBackend>) -> (Vec<i32>, usize) {
    let n_keys = a.keys.count;
    let k = a.top_k.min(n_keys);
    let n_new = a.rows.len();
    let mut out = vec![-1i32; n_new * k];
    if k == 0 {
        return (out, 0);
    }
    let (heads, dim) = (a.heads, a.dim);
    // Every (query, head) against every key in one product: [n_new·heads, n_keys].
    let q_rows = &a.q.0[a.rows.start * heads * dim..a.rows.end * heads * dim];
    let mut dots = vec![0.0f32; n_new * heads * n_keys];
    let keys = pool::gather(&a.keys, 0..n_keys);
    gemm::product(q_rows, n_new * heads, dim, &keys, n_keys, &mut dots);
    let w = &a.weights.0;
    out.par_chunks_mut(k).enumerate().for_each(|(i, sel)| {
        let r = a.rows.start + i;
        let visible = visible_rows(a.start_pos + i, a.ratio, n_keys);
        let wr = &w[r * heads..(r + 1) * heads];
        let block = &dots[i * heads * n_keys..(i + 1) * heads * n_keys];
        let mut scored: Vec<(f32, usize)> = (0..visible)
            .map(|s| {
                let score: f32 = (0..heads)
                    .map(|h| block[h * n_keys + s].max(0.0) * wr[h])
                    .sum();
                (score * a.score_scale, s)
            })
            .collect();
        // Highest score first; ties go to the earlier row.
        let keep = k.min(scored.len());
        if keep < scored.len() {
            scored.select_nth_unstable_by(keep, |x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
        }
        let mut chosen: Vec<usize> = scored[..keep].iter().map(|&(_, s)| s).collect();
        chosen.sort_unstable();
        for (slot, s) in sel.iter_mut().zip(chosen) {
            *slot = s as i32;
        }
    });
    (out, k)
}

pub(super) fn attention(seqs: &[AttentionArgs<'_, CpuBackend>], out: &mut CpuTensor) {
    let Some(first) = seqs.first() else { return };
    let width = first.heads * first.head_dim;
    // Which sequence (and which of its tokens) each batch row belongs to.
    let mut owner: Vec<Option<(usize, usize)>> = vec![None; out.0.len() / width.max(1)];
    for (s, a) in seqs.iter().enumerate() {
        for (i, r) in a.rows.clone().enumerate() {
            owner[r] = Some((s, i));
        }
    }
    // Every query of every sequence in parallel; all heads of a query together: the heads share
    // every key (K = V, one KV head), so keys are gathered once and both products run as small
    // matrix multiplications.
    out.0
        .par_chunks_mut(width)
        .zip(owner.par_iter())
        .for_each(|(o, owner)| {
            if let Some((s, i)) = *owner {
                attend_query(&seqs[s], i, o);
            }
        });
}

fn attend_query(a: &AttentionArgs<'_, CpuBackend>, i: usize, o: &mut [f32]) {
    let (heads, hd) = (a.heads, a.head_dim);
    let width = heads * hd;
    let (q, kv, sinks) = (&a.q.0, &a.kv.0, &a.sinks.0);
    let pos = a.start_pos + i;
    let r = a.rows.start + i;
    let mut keys: Vec<f32> = Vec::with_capacity((a.window + 64) * hd);
    // Window keys in position order, then compressed rows in index order.
    let first = (pos + 1).saturating_sub(a.window);
    for p in first..=pos {
        if p < a.start_pos {
            pool::push_row(&a.ring, p, &mut keys);
        } else {
            let rr = a.rows.start + (p - a.start_pos);
            keys.extend_from_slice(&kv[rr * hd..(rr + 1) * hd]);
        }
    }
    if let Some(comp) = &a.compressed {
        match a.selection {
            Some((sel, k)) => {
                for &s in &sel.0[i * k..(i + 1) * k] {
                    if s >= 0 {
                        pool::push_row(comp, s as usize, &mut keys);
                    }
                }
            }
            None => {
                for s in 0..visible_rows(pos, a.ratio, comp.count) {
                    pool::push_row(comp, s, &mut keys);
                }
            }
        }
    }
    let n_keys = keys.len() / hd;
    let mut scores = vec![0.0f32; heads * n_keys];
    gemv::attention_scores(
        &q[r * width..(r + 1) * width],
        heads,
        hd,
        &keys,
        n_keys,
        &mut scores,
    );
    // Softmax per head with the sink logit in the denominator only.
    for (h, row) in scores.chunks_mut(n_keys.max(1)).enumerate().take(heads) {
        let max = row.iter().fold(sinks[h], |m, &s| m.max(s * a.scale));
        let mut den = (sinks[h] - max).exp();
        for s in row.iter_mut() {
            *s = (*s * a.scale - max).exp();
            den += *s;
        }
        row.iter_mut().for_each(|s| *s /= den);
    }
    if n_keys == 0 {
        o.fill(0.0);
        return;
    }
    gemv::attention_values(&scores, heads, n_keys, &keys, hd, o);
}
