//! Mixture of experts: routing (hash table or scored top-k) and the routed experts' SwiGLU
//! feed-forward, grouped by expert so every expert runs one matrix product over its tokens.

use rayon::prelude::*;

use super::gemm::{gemm_into, Strided};
use super::ops::swiglu_row;
use super::{recycle, CpuBackend, CpuMatrix};
use crate::backend::{Expert, RouteArgs, RouteKind, Routing, Scoring};
use crate::error::{Error, Result};

fn score(x: f32, scoring: Scoring) -> f32 {
    match scoring {
        // softplus as torch computes it (linear above 20), then the square root.
        Scoring::SqrtSoftplus => {
            let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
            sp.sqrt()
        }
        Scoring::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        Scoring::Softmax => x,
    }
}

pub(super) fn route(b: &CpuBackend, a: &RouteArgs<'_, CpuBackend>) -> Result<Routing<CpuBackend>> {
    let (e, k) = (a.experts, a.top_k);
    let logits = &a.logits.0;
    let mut experts = vec![0i32; a.rows * k];
    let mut weights = vec![0f32; a.rows * k];
    for r in 0..a.rows {
        let row = &logits[r * e..(r + 1) * e];
        let mut scores: Vec<f32> = row.iter().map(|&x| score(x, a.scoring)).collect();
        if a.scoring == Scoring::Softmax {
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = scores.iter().map(|s| (s - max).exp()).sum();
            scores.iter_mut().for_each(|s| *s = (*s - max).exp() / sum);
        }
        let chosen: Vec<usize> = match &a.kind {
            RouteKind::Hash { table, token_ids } => {
                let id = token_ids.0[r] as usize;
                table.0[id * k..(id + 1) * k]
                    .iter()
                    .map(|&x| x as usize)
                    .collect()
            }
            RouteKind::TopK { bias } => {
                let mut order: Vec<usize> = (0..e).collect();
                let key = |i: usize| scores[i] + bias.map_or(0.0, |b| b.0[i]);
                order.sort_by(|&x, &y| key(y).total_cmp(&key(x)).then(x.cmp(&y)));
                order.truncate(k);
                order
            }
        };
        if let Some(&bad) = chosen.iter().find(|&&x| x >= e) {
            return Err(Error::model_format(format!(
                "the hash router sends token {} to expert {bad}, but the layer has {e} experts",
                match &a.kind {
                    RouteKind::Hash { token_ids, .. } => token_ids.0[r],
                    RouteKind::TopK { .. } => 0,
                }
            )));
        }
        let picked: Vec<f32> = chosen.iter().map(|&x| scores[x]).collect();
        let sum: f32 = picked.iter().sum();
        for (j, (&x, &w)) in chosen.iter().zip(&picked).enumerate() {
            experts[r * k + j] = x as i32;
            let w = if a.normalize { w / (sum + 1e-20) } else { w };
            weights[r * k + j] = w * a.scale;
        }
    }
    Ok(Routing {
        experts: b.wrap_index(experts),
        weights: b.wrap(weights),
        top_k: k,
    })
}

pub(super) fn moe(
    x: &[f32],
    rows: usize,
    routing: &Routing<CpuBackend>,
    experts: &[Expert<CpuBackend>],
    inter: usize,
    limit: f32,
) -> Vec<f32> {
    let k = routing.top_k;
    let dim = x.len() / rows.max(1);
    // Tokens per expert, in token order: (token row, slot in the token's top-k).
    let mut assigned: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts.len()];
    for (i, &e) in routing.experts.0.iter().enumerate() {
        assigned[e as usize].push((i / k, i % k));
    }
    let outputs: Vec<(usize, Vec<f32>)> = assigned
        .par_iter()
        .enumerate()
        .filter(|(_, tokens)| !tokens.is_empty())
        .map(|(e, tokens)| (e, expert_forward(x, dim, tokens, &experts[e], inter, limit)))
        .collect();
    // Accumulate every token's slots in top-k order.
    let mut contributions: Vec<Option<&[f32]>> = vec![None; rows * k];
    for (e, out) in &outputs {
        for (n, &(t, slot)) in assigned[*e].iter().enumerate() {
            contributions[t * k + slot] = Some(&out[n * dim..(n + 1) * dim]);
        }
    }
    let mut y = recycle::zeroed(rows * dim);
    let weights = &routing.weights.0;
    y.par_chunks_mut(dim).enumerate().for_each(|(t, yt)| {
        for slot in 0..k {
            if let Some(c) = contributions[t * k + slot] {
                let w = weights[t * k + slot];
                yt.iter_mut().zip(c).for_each(|(y, &v)| *y += w * v);
            }
        }
    });
    drop(contributions);
    outputs.into_iter().for_each(|(_, out)| recycle::give(out));
    y
}

fn expert_forward(
    x: &[f32],
    dim: usize,
    tokens: &[(usize, usize)],
    expert: &Expert<CpuBackend>,
    inter: usize,
    limit: f32,
) -> Vec<f32> {
    let n = tokens.len();
    let mut xe = recycle::with_capacity(n * dim);
    for &(t, _) in tokens {
        xe.extend_from_slice(&x[t * dim..(t + 1) * dim]);
    }
    let w13: &CpuMatrix = &expert.w13;
    // Products and SwiGLU write every value of their outputs: no zeroing pass.
    let mut h = recycle::overwritten(n * 2 * inter);
    let at = |stride| Strided {
        offset: 0,
        row_stride: stride,
    };
    gemm_into(&xe, at(dim), n, w13, 0..2 * inter, &mut h, at(2 * inter));
    let mut act = recycle::overwritten(n * inter);
    for (o, hr) in act.chunks_mut(inter).zip(h.chunks(2 * inter)) {
        swiglu_row(&hr[..inter], &hr[inter..], limit, o);
    }
    recycle::give(h);
    recycle::give(xe);
    let mut out = recycle::overwritten(n * dim);
    gemm_into(&act, at(inter), n, &expert.w2, 0..dim, &mut out, at(dim));
    recycle::give(act);
    out
}
