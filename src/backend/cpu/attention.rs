//! Per-sequence attention state and attention itself: compressor frontiers, the window ring,
//! the lightning indexer and windowed + compressed attention with sinks.

use std::ops::Range;

use rayon::prelude::*;

use super::{exp, gemm, gemv, pool, recycle, CpuBackend, CpuTensor};
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
    // Slot by slot over all channels (each channel's terms still in slot order): the
    // exponentials go through the vector `exp`, and each slot's row is read contiguously.
    let score = |&(r, h): &(usize, usize)| &frontier[r * row_len + cols + h..][..width];
    let value = |&(r, h): &(usize, usize)| &frontier[r * row_len + h..][..width];
    let mut max = vec![f32::NEG_INFINITY; width];
    for slot in &slots {
        max.iter_mut()
            .zip(score(slot))
            .for_each(|(m, &s)| *m = m.max(s));
    }
    let (mut num, mut den, mut e) = (vec![0.0f32; width], vec![0.0f32; width], vec![0.0; width]);
    for slot in &slots {
        e.iter_mut()
            .zip(score(slot).iter().zip(&max))
            .for_each(|(e, (&s, &m))| *e = s - m);
        exp::exp_in_place(&mut e);
        for (((n, d), &e), &v) in num.iter_mut().zip(&mut den).zip(&e).zip(value(slot)) {
            *d += e;
            *n += e * v;
        }
    }
    row.iter_mut()
        .zip(num.iter().zip(&den))
        .for_each(|(o, (&n, &d))| *o = n / d);
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
    // Every value written by the product.
    let mut dots = recycle::overwritten(n_new * heads * n_keys);
    let keys = pool::gather(&a.keys, 0..n_keys);
    // A prefill's queries in blocks over the workers (one product on one thread was ~3 ms of
    // each CSA layer's 512-token prefill); a decode step's few in one product.
    let threads = rayon::current_num_threads().max(1);
    let per = if n_new * heads * n_keys * dim < 1 << 20 {
        n_new
    } else {
        n_new.div_ceil(4 * threads)
    };
    dots.par_chunks_mut(per * heads * n_keys)
        .zip(q_rows.par_chunks(per * heads * dim))
        .for_each(|(d, q)| {
            let m = q.len() / dim;
            gemm::product(q, m, dim, &keys, n_keys, d)
        });
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
    recycle::give(dots);
    recycle::give(keys);
    (out, k)
}

/// Keys per part of one query's attention. Each part's softmax is taken on its own and the
/// parts are merged in order (flash-decoding), so a query's output does not depend on how many
/// threads computed its parts: a decode step (one query, its parts on every worker) and a
/// prefill (many queries, each one's parts in turn) give the same bits for the same keys. (A
/// prefix-cache hit can still differ from a scratch run by rounding elsewhere: a chunk of up
/// to 16 tokens runs its projections as matrix-vector products, a longer one as GEMMs.) A
/// multiple of 4 (the score kernel's key quads).
const PART: usize = 32;

/// Consecutive queries of one sequence that share one gathered window: each query's window
/// keys are a slice of it, so 16 queries copy 143 window rows instead of 16 × 128.
const TILE: usize = 16;

pub(super) fn attention(seqs: &[AttentionArgs<'_, CpuBackend>], out: &mut CpuTensor) {
    let Some(first) = seqs.first() else { return };
    let width = first.heads * first.head_dim;
    // Tiles in batch-row order: (sequence, its tokens).
    let mut tiles: Vec<(usize, Range<usize>)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, a)| {
            let n = a.rows.len();
            (0..n)
                .step_by(TILE)
                .map(move |i0| (s, i0..(i0 + TILE).min(n)))
        })
        .collect();
    tiles.sort_by_key(|(s, r)| seqs[*s].rows.start + r.start);
    // Each tile's output rows, cut from `out` in order (rows no sequence owns stay as they are).
    let mut rest: &mut [f32] = &mut out.0;
    let mut at = 0;
    let mut jobs = Vec::with_capacity(tiles.len());
    for (s, range) in tiles {
        let start = seqs[s].rows.start + range.start;
        assert!(start >= at, "attention: sequences' batch rows overlap");
        let (_, tail) = std::mem::take(&mut rest).split_at_mut((start - at) * width);
        let (mine, tail) = tail.split_at_mut(range.len() * width);
        (rest, at) = (tail, start + range.len());
        jobs.push((s, range, mine));
    }
    // Every tile of every sequence in parallel; all heads of a query together: the heads share
    // every key (K = V, one KV head), so keys are gathered once and both products run as small
    // matrix multiplications. With fewer queries than threads (decode), each query's key parts
    // run in parallel too.
    let queries: usize = seqs.iter().map(|a| a.rows.len()).sum();
    let split = queries < rayon::current_num_threads();
    jobs.into_par_iter()
        .for_each_init(Scratch::default, |scratch, (s, range, o)| {
            attend_tile(&seqs[s], range, o, split, scratch)
        });
}

/// A worker's buffers, reused from one tile to the next: the tile's window rows; the parts of
/// one query (per part and head the largest scaled score and the sum of `exp(score − max)`,
/// `[parts, heads]`, and the rows weighted by those terms, `[parts, heads, head_dim]`); one
/// part's keys and scores.
#[derive(Default)]
struct Scratch {
    window: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    out: Vec<f32>,
    keys: Vec<f32>,
    scores: Vec<f32>,
    weights: Vec<f32>,
}

/// Queries `range` of one sequence (consecutive positions) into `o` (`[range.len(), heads ·
/// head_dim]`). A lone query (a decode step's) reads its window rows where they are when the
/// ring stores f32 (at most two runs of ring rows, then the new row); a tile of several has
/// them decoded or copied once, onto a 64-byte line (`aligned`: the kernels read the
/// 16-byte-aligned activations slower).
fn attend_tile(
    a: &AttentionArgs<'_, CpuBackend>,
    range: Range<usize>,
    o: &mut [f32],
    split: bool,
    scratch: &mut Scratch,
) {
    let hd = a.head_dim;
    let width = a.heads * hd;
    if range.is_empty() {
        return;
    }
    let new_rows = |from: usize, to: usize| {
        let r = |p: usize| a.rows.start + (p - a.start_pos);
        &a.kv.0[r(from) * hd..r(to) * hd]
    };
    if let Some((ring, ring_rows)) = pool::f32_ring(&a.ring).filter(|_| range.len() == 1) {
        for (k, i) in range.enumerate() {
            let pos = a.start_pos + i;
            let from = (pos + 1).saturating_sub(a.window);
            let mut runs = ring_runs(ring, ring_rows, hd, from..a.start_pos);
            runs.push(new_rows(from.max(a.start_pos), pos + 1));
            let o = &mut o[k * width..(k + 1) * width];
            attend_query(a, i, o, split, scratch, &runs);
        }
        return;
    }
    // The tile's window, decoded once: from its first query's first key to its last query.
    let last = a.start_pos + range.end - 1;
    let first = (a.start_pos + range.start + 1).saturating_sub(a.window);
    let mut window = std::mem::take(&mut scratch.window);
    let pad = super::aligned::start(&mut window, (last + 1 - first) * hd);
    for p in first..a.start_pos.min(last + 1) {
        pool::push_row(&a.ring, p, &mut window);
    }
    window.extend_from_slice(new_rows(first.max(a.start_pos), last + 1));
    for (k, i) in range.enumerate() {
        let pos = a.start_pos + i;
        let from = (pos + 1).saturating_sub(a.window) - first;
        let keys = &window[pad + from * hd..pad + (pos + 1 - first) * hd];
        let o = &mut o[k * width..(k + 1) * width];
        attend_query(a, i, o, split, scratch, &[keys]);
    }
    scratch.window = window;
}

/// Positions `range` of a ring of `ring_rows` f32 rows (`ring`, `width` values each) as at
/// most two runs of rows in position order (the second where the ring wraps).
fn ring_runs(ring: &[f32], ring_rows: usize, width: usize, range: Range<usize>) -> Vec<&[f32]> {
    let mut runs = Vec::with_capacity(3);
    let mut p = range.start;
    while p < range.end {
        let slot = p % ring_rows;
        let n = (ring_rows - slot).min(range.end - p);
        runs.push(&ring[slot * width..(slot + n) * width]);
        p += n;
    }
    runs
}

/// A query's compressed rows, in index order (after its window keys).
fn compressed_keys(a: &AttentionArgs<'_, CpuBackend>, i: usize) -> Vec<usize> {
    let Some(comp) = &a.compressed else {
        return Vec::new();
    };
    match a.selection {
        Some((sel, k)) => sel.0[i * k..(i + 1) * k]
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as usize)
            .collect(),
        None => (0..visible_rows(a.start_pos + i, a.ratio, comp.count)).collect(),
    }
}

/// Keys `range` of a query's list (its `window` rows, runs of rows in position order, then
/// its `compressed` rows): their scores, and per head their max, sum and weighted rows. A part
/// inside one run reads its rows where they are; `keys` and `scores` are scratch space.
#[allow(clippy::too_many_arguments)]
fn attend_part(
    a: &AttentionArgs<'_, CpuBackend>,
    i: usize,
    window: &[&[f32]],
    compressed: &[usize],
    range: Range<usize>,
    keys: &mut Vec<f32>,
    scores: &mut Vec<f32>,
    (max, sum, out): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let (heads, hd) = (a.heads, a.head_dim);
    let width = heads * hd;
    let mut in_place = None;
    let mut at = 0;
    for run in window {
        let n = run.len() / hd;
        if at <= range.start && range.end <= at + n {
            in_place = Some(&run[(range.start - at) * hd..(range.end - at) * hd]);
            break;
        }
        at += n;
    }
    let rows: &[f32] = match in_place {
        Some(rows) => rows,
        None => {
            let pad = super::aligned::start(keys, range.len() * hd);
            let mut at = 0;
            for run in window {
                let n = run.len() / hd;
                let (lo, hi) = (range.start.max(at), range.end.min(at + n));
                if lo < hi {
                    keys.extend_from_slice(&run[(lo - at) * hd..(hi - at) * hd]);
                }
                at += n;
            }
            let wn = at;
            if range.end > wn {
                let comp = a.compressed.as_ref().expect("compressed keys have rows");
                for &s in &compressed[range.start.max(wn) - wn..range.end - wn] {
                    pool::push_row(comp, s, keys);
                }
            }
            &keys[pad..]
        }
    };
    let n = range.len();
    let r = a.rows.start + i;
    scores.clear();
    scores.resize(heads * n, 0.0);
    gemv::attention_scores(
        &a.q.0[r * width..(r + 1) * width],
        heads,
        hd,
        rows,
        n,
        scores,
    );
    for (h, row) in scores.chunks_mut(n).enumerate() {
        let m = row
            .iter()
            .fold(f32::NEG_INFINITY, |m, &s| m.max(s * a.scale));
        row.iter_mut().for_each(|s| *s = *s * a.scale - m);
        exp::exp_in_place(row);
        // Summed in key order, as one running sum.
        (max[h], sum[h]) = (m, row.iter().sum());
    }
    gemv::attention_values(scores, heads, n, rows, hd, out);
}

/// One query: `window` holds its window keys in position order (runs of rows), its compressed
/// rows follow; parts of [`PART`] keys, merged in order.
fn attend_query(
    a: &AttentionArgs<'_, CpuBackend>,
    i: usize,
    o: &mut [f32],
    split: bool,
    scratch: &mut Scratch,
    window: &[&[f32]],
) {
    let (heads, hd) = (a.heads, a.head_dim);
    let width = heads * hd;
    let compressed = compressed_keys(a, i);
    let n_keys = window.iter().map(|r| r.len()).sum::<usize>() / hd + compressed.len();
    if n_keys == 0 {
        o.fill(0.0);
        return;
    }
    let n_parts = n_keys.div_ceil(PART);
    // Every value of these is written below before it is read: no zeroing between queries.
    let Scratch {
        max: maxes,
        sum: sums,
        out: outs,
        keys,
        scores,
        weights,
        ..
    } = scratch;
    for (v, len) in [
        (&mut *maxes, heads),
        (&mut *sums, heads),
        (&mut *outs, width),
    ] {
        if v.len() < n_parts * len {
            v.resize(n_parts * len, 0.0);
        }
    }
    let range = |p: usize| p * PART..((p + 1) * PART).min(n_keys);
    let (maxes, sums) = (&mut maxes[..n_parts * heads], &mut sums[..n_parts * heads]);
    let outs = &mut outs[..n_parts * width];
    if split {
        // Each part on whichever worker takes it, with its own keys and scores.
        maxes
            .par_chunks_mut(heads)
            .zip(sums.par_chunks_mut(heads))
            .zip(outs.par_chunks_mut(width))
            .enumerate()
            .for_each(|(p, ((max, sum), out))| {
                let (mut k, mut s) = (Vec::new(), Vec::new());
                let to = (max, sum, out);
                attend_part(a, i, window, &compressed, range(p), &mut k, &mut s, to);
            });
    } else {
        let each = maxes
            .chunks_mut(heads)
            .zip(sums.chunks_mut(heads))
            .zip(outs.chunks_mut(width));
        for (p, ((max, sum), out)) in each.enumerate() {
            let to = (max, sum, out);
            attend_part(a, i, window, &compressed, range(p), keys, scores, to);
        }
    }
    // Softmax per head over every part's keys, with the sink logit in the denominator only.
    let sinks = &a.sinks.0;
    weights.resize(n_parts, 0.0);
    for (h, o) in o.chunks_mut(hd).enumerate().take(heads) {
        let at = |p: usize| p * heads + h;
        let max = (0..n_parts).fold(sinks[h], |m, p| m.max(maxes[at(p)]));
        for (p, w) in weights.iter_mut().enumerate() {
            *w = (maxes[at(p)] - max).exp();
        }
        let den =
            (sinks[h] - max).exp() + (0..n_parts).map(|p| weights[p] * sums[at(p)]).sum::<f32>();
        o.fill(0.0);
        for (p, w) in weights.iter().enumerate() {
            let c = w / den;
            o.iter_mut()
                .zip(&outs[p * width + h * hd..p * width + (h + 1) * hd])
                .for_each(|(o, &v)| *o += c * v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuIndex;
    use crate::backend::{Backend, Placement, RowLayout, Rows};
    use crate::formats::rows::RowCodec;

    use crate::backend::cpu::test_data::values;

    /// A prefill's indexer (its queries' products in blocks over the workers) selects, for
    /// every query, the top-k visible compressed rows by `Σ_h w_h · relu(q_h · k)` computed in
    /// f64 (queries whose k-th and next scores are too close to call in f32 are skipped; most
    /// are not), in row order with `-1` past the visible rows.
    #[test]
    fn a_prefills_indexer_picks_the_top_scored_visible_rows() {
        use crate::backend::IndexerArgs;
        let cpu = CpuBackend::new(2).unwrap();
        let (heads, dim, n_keys, new, top_k, ratio, start_pos) = (16, 64, 100, 300, 20, 4, 60);
        assert!(
            new * heads * n_keys * dim >= 1 << 20,
            "large enough to take blocks"
        );
        let keys = values(11, n_keys * dim);
        let mut buf = cpu.alloc(n_keys * RowCodec::F32.row_bytes(dim)).unwrap();
        cpu.write_bytes(&mut buf, 0, bytemuck::cast_slice(&keys))
            .unwrap();
        let q = CpuTensor(values(12, new * heads * dim));
        let w = CpuTensor(values(13, new * heads));
        let args = IndexerArgs {
            q: &q,
            weights: &w,
            rows: 0..new,
            start_pos,
            keys: Rows {
                buffer: &buf,
                layout: RowLayout {
                    offset: 0,
                    row_bytes: RowCodec::F32.row_bytes(dim),
                    width: dim,
                    codec: RowCodec::F32,
                    placement: Placement::Ring { rows: n_keys },
                },
                count: n_keys,
            },
            ratio,
            top_k,
            heads,
            dim,
            score_scale: 0.03,
        };
        let (got, k) = indexer_top_k(&args);
        assert_eq!(k, top_k);
        let mut checked = 0;
        for i in 0..new {
            let visible = visible_rows(start_pos + i, ratio, n_keys);
            let score = |s: usize| -> f64 {
                (0..heads)
                    .map(|h| {
                        let qh = &q.0[(i * heads + h) * dim..][..dim];
                        let dot: f64 = (0..dim)
                            .map(|d| f64::from(qh[d]) * f64::from(keys[s * dim + d]))
                            .sum();
                        dot.max(0.0) * f64::from(w.0[i * heads + h])
                    })
                    .sum()
            };
            let mut order: Vec<(f64, usize)> = (0..visible).map(|s| (score(s), s)).collect();
            order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let keep = top_k.min(visible);
            if keep < visible && (order[keep - 1].0 - order[keep].0).abs() < 1e-4 {
                continue;
            }
            let mut want: Vec<i32> = order[..keep].iter().map(|&(_, s)| s as i32).collect();
            want.sort_unstable();
            want.resize(top_k, -1);
            assert_eq!(&got[i * top_k..(i + 1) * top_k], &want[..], "query {i}");
            checked += 1;
        }
        assert!(
            checked > new * 9 / 10,
            "only {checked} of {new} queries clear of ties"
        );
    }

    /// A query's keys in parts, computed one part after another within a tile of queries and
    /// alone on two threads at once, give the same bits, and both match a plain softmax over
    /// every key (in f64) with the sinks in the denominator. The window ring is read in place
    /// (f32 rows, wrapping around the ring) and decoded (bf16 rows holding the same values):
    /// the same bits again.
    #[test]
    fn parts_on_any_number_of_threads_give_the_same_bits_as_one_softmax() {
        let cpu = CpuBackend::new(2).unwrap();
        let (heads, hd, window) = (8, 64, 128);
        let (start_pos, new, ring_rows, n_comp, k) = (200, 3, 128, 50, 24);
        let row_bytes = RowCodec::F32.row_bytes(hd);
        // Values bf16 holds exactly, so a bf16 ring stores the same keys.
        let ring_values: Vec<f32> = values(1, ring_rows * hd)
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect();
        let ring_in = |codec: RowCodec| {
            let rb = codec.row_bytes(hd);
            let mut bytes = vec![0u8; ring_rows * rb];
            for (row, out) in ring_values.chunks(hd).zip(bytes.chunks_mut(rb)) {
                codec.encode(row, out);
            }
            let mut buf = cpu.alloc(bytes.len()).unwrap();
            cpu.write_bytes(&mut buf, 0, &bytes).unwrap();
            buf
        };
        let (ring_f32, ring_bf16) = (ring_in(RowCodec::F32), ring_in(RowCodec::Bf16));
        let comp_values = values(2, n_comp * hd);
        let mut comp_buf = cpu.alloc(n_comp * row_bytes).unwrap();
        cpu.write_bytes(&mut comp_buf, 0, bytemuck::cast_slice(&comp_values))
            .unwrap();
        let layout = |rows, codec: RowCodec| RowLayout {
            offset: 0,
            row_bytes: codec.row_bytes(hd),
            width: hd,
            codec,
            placement: Placement::Ring { rows },
        };
        let q = CpuTensor(
            values(3, new * heads * hd)
                .iter()
                .map(|v| v * 4.0)
                .collect(),
        );
        let kv = CpuTensor(values(4, new * hd));
        let sinks = CpuTensor(values(5, heads));
        // Each query selects k compressed rows, some slots empty (-1).
        let sel: Vec<i32> = (0..new * k)
            .map(|i| {
                if i % 7 == 3 {
                    -1
                } else {
                    ((i * 13) % n_comp) as i32
                }
            })
            .collect();
        let sel = CpuIndex(sel);
        let args = |ring_buf, codec| AttentionArgs {
            q: &q,
            kv: &kv,
            rows: 0..new,
            start_pos,
            ring: Rows {
                buffer: ring_buf,
                layout: layout(ring_rows, codec),
                count: start_pos,
            },
            window,
            compressed: Some(Rows {
                buffer: &comp_buf,
                layout: layout(n_comp, RowCodec::F32),
                count: n_comp,
            }),
            ratio: 4,
            selection: Some((&sel, k)),
            sinks: &sinks,
            heads,
            head_dim: hd,
            scale: 0.125,
        };
        let (in_place, decoded) = (
            args(&ring_f32, RowCodec::F32),
            args(&ring_bf16, RowCodec::Bf16),
        );
        assert!(
            pool::f32_ring(&in_place.ring).is_some() && pool::f32_ring(&decoded.ring).is_none()
        );
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // The whole chunk as one tile, one worker's scratch for every query (a prefill), and
        // each query alone with its parts on two threads (a decode step).
        let mut all = vec![0.0; new * heads * hd];
        attend_tile(&in_place, 0..new, &mut all, false, &mut Scratch::default());
        let mut all_decoded = vec![0.0; new * heads * hd];
        attend_tile(
            &decoded,
            0..new,
            &mut all_decoded,
            false,
            &mut Scratch::default(),
        );
        assert_eq!(
            bits(&all),
            bits(&all_decoded),
            "ring read in place vs decoded"
        );
        for i in 0..new {
            let one = &all[i * heads * hd..(i + 1) * heads * hd];
            for a in [&in_place, &decoded] {
                let mut two = vec![0.0; heads * hd];
                cpu.run(|| attend_tile(a, i..i + 1, &mut two, true, &mut Scratch::default()));
                assert_eq!(
                    bits(one),
                    bits(&two),
                    "query {i} ({:?} ring): the parts' thread count changed the bits",
                    a.ring.layout.codec
                );
            }
            // The reference: every key in order, one softmax per head in f64.
            let pos = start_pos + i;
            let mut keys: Vec<&[f32]> = Vec::new();
            for p in pos + 1 - window..=pos {
                keys.push(if p < start_pos {
                    &ring_values[(p % ring_rows) * hd..][..hd]
                } else {
                    &kv.0[(p - start_pos) * hd..][..hd]
                });
            }
            for &s in &sel.0[i * k..(i + 1) * k] {
                if s >= 0 {
                    keys.push(&comp_values[s as usize * hd..][..hd]);
                }
            }
            assert!(keys.len() > 4 * PART, "the keys span several parts");
            for h in 0..heads {
                let qh = &q.0[(i * heads + h) * hd..][..hd];
                let logits: Vec<f64> = keys
                    .iter()
                    .map(|key| {
                        let dot: f64 = qh
                            .iter()
                            .zip(*key)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum();
                        dot * 0.125
                    })
                    .collect();
                let sink = f64::from(sinks.0[h]);
                let max = logits.iter().fold(sink, |m, &l| m.max(l));
                let den = (sink - max).exp() + logits.iter().map(|l| (l - max).exp()).sum::<f64>();
                for c in 0..hd {
                    let want: f64 = logits
                        .iter()
                        .zip(&keys)
                        .map(|(l, key)| (l - max).exp() / den * f64::from(key[c]))
                        .sum();
                    let got = f64::from(one[h * hd + c]);
                    assert!(
                        (got - want).abs() < 1e-5,
                        "query {i} head {h} col {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
