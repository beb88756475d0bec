//! One forward step over a batch of sequences: every weight is applied once to all new tokens
//! of the batch; only the state-dependent parts (compressors, indexer, attention, window ring)
//! run per sequence.

use std::ops::Range;

use super::diagnose::{Site, Watch};
use super::{Attention, Block, Hc, Model, Moe, Router};
use crate::backend::{
    AttentionArgs, Backend, CompressArgs, HcMix, HcParams, IndexerArgs, RouteArgs, RouteKind,
};
use crate::config::params::NumericsMode;
use crate::config::AttentionKind;
use crate::error::{Error, Result};
use crate::formats::rows::RowCodec;
use crate::kv::{KvPools, SeqKv, Stream};

/// Official numerics: FP8 blocks over the non-rope kv channels, FP4 blocks in the indexer.
const FP8_KV_BLOCK: usize = 64;
const FP4_BLOCK: usize = 32;

/// Which positions' logits a chunk wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    /// The last new token's (decode, end of prefill).
    Last,
    /// Every new token's (scoring).
    All,
}

/// One sequence's part of a step: its new tokens and its place in the KV pools.
pub struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub seq: &'a mut SeqKv,
    pub logits: Logits,
}

/// What every layer of a step reads on the backend: the batch's token ids and positions,
/// uploaded once per step.
struct StepIndex<B: Backend> {
    tokens: B::Index,
    positions: B::Index,
    rows: usize,
}

/// Where each sequence's rows sit in the batch.
struct Segment<B: Backend> {
    rows: Range<usize>,
    start_pos: usize,
    /// The sequence's page table on the backend, uploaded once per step.
    pages: B::Index,
}

impl<B: Backend> Model<B> {
    /// Runs one step and returns, per chunk, the requested logits (`[n, vocab]` row-major).
    /// Each chunk's sequence advances by its tokens; its pages must already be reserved
    /// ([`KvPools::reserve`]).
    pub fn forward(&self, kv: &mut KvPools<B>, chunks: &mut [Chunk<'_>]) -> Result<Vec<Vec<f32>>> {
        self.backend()
            .scope(|| self.step(kv, chunks, &mut Watch::off()))
    }

    /// One step; `watch` checks every sub-step's output for non-finite values when it is on
    /// (the diagnostic run, [`Model::diagnose_nonfinite`]) and costs a branch per check when
    /// off.
    pub(super) fn step(
        &self,
        kv: &mut KvPools<B>,
        chunks: &mut [Chunk<'_>],
        watch: &mut Watch,
    ) -> Result<Vec<Vec<f32>>> {
        let c = &self.config;
        let b = self.backend();
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut segments = Vec::with_capacity(chunks.len());
        for (s, chunk) in chunks.iter().enumerate() {
            if chunk.tokens.is_empty() {
                return Err(Error::invalid_argument(format!(
                    "sequence {s} of the batch has no tokens: pass at least one"
                )));
            }
            if let Some((i, &id)) = chunk
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &id)| id as usize >= c.vocab_size)
            {
                return Err(Error::invalid_argument(format!(
                    "token id {id} at position {i} is outside the vocabulary (ids 0..{})",
                    c.vocab_size
                )));
            }
            let start_pos = chunk.seq.position();
            let end = start_pos + chunk.tokens.len();
            if kv.pages_for(end) > chunk.seq.pages().len() {
                return Err(Error::invalid_argument(format!(
                    "sequence {s} of the batch holds {} KV pages but reaching position {end} \
                     needs {}: reserve them first (KvPools::reserve)",
                    chunk.seq.pages().len(),
                    kv.pages_for(end)
                )));
            }
            let rows = ids.len()..ids.len() + chunk.tokens.len();
            ids.extend_from_slice(chunk.tokens);
            positions.extend((start_pos..start_pos + chunk.tokens.len()).map(|p| p as u32));
            segments.push(Segment {
                rows,
                start_pos,
                pages: kv.page_table(chunk.seq)?,
            });
        }
        let n = ids.len();
        let d = c.hidden_size;
        watch.set_positions(&positions);
        // Token ids and positions go to the backend once per step: the embedding, the hash
        // routers and every RoPE read them there. Ids are below the vocabulary size and
        // positions below the context limit, both far below i32::MAX.
        let as_i32 = |v: &[u32]| -> Vec<i32> { v.iter().map(|&x| x as i32).collect() };
        let step = StepIndex {
            tokens: b.index(&as_i32(&ids))?,
            positions: b.index(&as_i32(&positions))?,
            rows: n,
        };
        let x = b.embed(&self.embed, &step.tokens)?;
        watch.rows(b, &x, |_| Site::outside("embedding", &["embed.weight"]))?;
        let mut streams = b.hc_expand(&x, n, c.hc_mult, d)?;
        // Each block's FFN residual also makes the next block's attention mix (one pass over
        // the streams where the backend fuses them: `hc_post_pre`).
        let mut mix = None;
        for (l, block) in self.blocks.iter().enumerate() {
            let next = self.blocks.get(l + 1);
            let io = (streams, mix.take(), next);
            (streams, mix) = self.block(l, block, io, &step, &segments, kv, chunks, watch)?;
        }
        let h = b.hc_head(&streams, n, &self.hc(&self.hc_head))?;
        watch.rows(b, &h, |_| {
            Site::outside(
                "final hyper-connection head",
                &["hc_head_fn", "hc_head_base", "hc_head_scale"],
            )
        })?;
        let h = b.rms_norm(&h, n, d, Some(&self.norm), c.rms_norm_eps as f32)?;
        watch.rows(b, &h, |_| Site::outside("final norm", &["norm.weight"]))?;
        let mut wanted = Vec::new();
        for (chunk, seg) in chunks.iter().zip(&segments) {
            match chunk.logits {
                Logits::None => {}
                Logits::Last => wanted.push(seg.rows.end - 1),
                Logits::All => wanted.extend(seg.rows.clone()),
            }
        }
        let logits = if wanted.is_empty() {
            Vec::new()
        } else {
            let h = b.take_rows(&h, d, &wanted)?;
            let logits = b.read(&b.matmul(&h, wanted.len(), &self.head)?)?;
            if watch.active() {
                let at: Vec<u32> = wanted.iter().map(|&r| positions[r]).collect();
                watch.values(&logits, &at, |_| {
                    Site::outside("logits (output head)", &["head.weight"])
                });
            }
            logits
        };
        let vocab = c.vocab_size;
        let mut out = Vec::with_capacity(chunks.len());
        let mut next = 0;
        for chunk in chunks.iter_mut() {
            let count = match chunk.logits {
                Logits::None => 0,
                Logits::Last => 1,
                Logits::All => chunk.tokens.len(),
            };
            out.push(logits[next * vocab..(next + count) * vocab].to_vec());
            next += count;
            chunk.seq.advance(chunk.tokens.len());
        }
        Ok(out)
    }

    fn hc<'a>(&self, hc: &'a Hc<B>) -> HcParams<'a, B> {
        let c = &self.config;
        HcParams {
            fn_: &hc.fn_,
            base: &hc.base,
            scale: &hc.scale,
            hc: c.hc_mult,
            dim: c.hidden_size,
            sinkhorn_iters: c.hc_sinkhorn_iters,
            hc_eps: c.hc_eps as f32,
            norm_eps: c.rms_norm_eps as f32,
        }
    }

    /// Block `l` on `streams`: its output streams and, given the next block, that block's
    /// attention mix of them. `mix` is this block's attention mix when the block before made
    /// it.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        l: usize,
        block: &Block<B>,
        (streams, mix, next): (B::Tensor, Option<HcMix<B>>, Option<&Block<B>>),
        step: &StepIndex<B>,
        segments: &[Segment<B>],
        kv: &mut KvPools<B>,
        chunks: &mut [Chunk<'_>],
        watch: &mut Watch,
    ) -> Result<(B::Tensor, Option<HcMix<B>>)> {
        let c = &self.config;
        let b = self.backend();
        let (n, d, hc) = (step.rows, c.hidden_size, c.hc_mult);
        let eps = c.rms_norm_eps as f32;
        let kind = block.kind;
        let site = |step, weights: &[&str]| Site::layer(l, kind, step, weights);
        const HC_ATTN: [&str; 3] = ["hc_attn_fn", "hc_attn_base", "hc_attn_scale"];
        const HC_FFN: [&str; 3] = ["hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"];
        let mix = match mix {
            Some(mix) => mix,
            None => b.hc_pre(&streams, n, &self.hc(&block.attn_hc))?,
        };
        watch.rows(b, &mix.collapsed, |_| {
            site("attention hyper-connection mix", &HC_ATTN)
        })?;
        let x = b.rms_norm(&mix.collapsed, n, d, Some(&block.attn_norm), eps)?;
        watch.rows(b, &x, |_| site("attention norm", &["attn_norm.weight"]))?;
        let a = self.attention(
            l,
            block.kind,
            &block.attn,
            &x,
            step,
            segments,
            kv,
            chunks,
            watch,
        )?;
        let (streams, mix) = b.hc_post_pre(&a, streams, &mix, n, hc, d, &self.hc(&block.ffn_hc))?;
        watch.rows(b, &streams, |_| {
            site("attention residual (hyper-connection post)", &HC_ATTN)
        })?;
        watch.rows(b, &mix.collapsed, |_| {
            site("FFN hyper-connection mix", &HC_FFN)
        })?;
        let x = b.rms_norm(&mix.collapsed, n, d, Some(&block.ffn_norm), eps)?;
        watch.rows(b, &x, |_| site("FFN norm", &["ffn_norm.weight"]))?;
        let m = self.moe(l, kind, &block.ffn, &x, step, watch)?;
        let (out, next_mix) = match next {
            Some(next) => {
                let p = self.hc(&next.attn_hc);
                let (out, mix) = b.hc_post_pre(&m, streams, &mix, n, hc, d, &p)?;
                (out, Some(mix))
            }
            None => (b.hc_post(&m, &streams, &mix, n, hc, d)?, None),
        };
        watch.rows(b, &out, |_| {
            site("FFN residual (hyper-connection post)", &HC_FFN)
        })?;
        Ok((out, next_mix))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        kind: AttentionKind,
        w: &Attention<B>,
        x: &B::Tensor,
        step: &StepIndex<B>,
        segments: &[Segment<B>],
        kv_pools: &mut KvPools<B>,
        chunks: &mut [Chunk<'_>],
        watch: &mut Watch,
    ) -> Result<B::Tensor> {
        let c = &self.config;
        let b = self.backend();
        let site = |step, weights: &[&str]| Site::layer(l, kind, step, weights);
        let (n, positions) = (step.rows, &step.positions);
        let (heads, hd) = (c.num_heads, c.head_dim);
        let eps = c.rms_norm_eps as f32;
        let rope = match kind {
            AttentionKind::Swa => &self.rope_main,
            AttentionKind::Csa | AttentionKind::Hca => &self.rope_compress,
        };
        // One product per input: x feeds the query latent, kv and every compressor; the query
        // latent feeds the queries and the indexer's queries.
        let (coff, id, ih) = (
            if kind == AttentionKind::Csa { 2 } else { 1 },
            c.index_head_dim,
            c.index_n_heads,
        );
        let mut x_widths = vec![c.q_lora_rank, hd];
        if w.compressor.is_some() {
            x_widths.extend([coff * hd, coff * hd]);
        }
        if w.indexer.is_some() {
            x_widths.extend([2 * id, 2 * id, ih]);
        }
        let mut x_parts = b.matmul_split(x, n, &w.x_proj, &x_widths)?.into_iter();
        // Each part is checked against the weight that produced it (the parts come in this
        // order; a layer without a compressor or indexer stops early).
        const X_NAMES: [&str; 7] = [
            "attn.wq_a.weight",
            "attn.wkv.weight",
            "attn.compressor.wkv.weight",
            "attn.compressor.wgate.weight",
            "attn.indexer.compressor.wkv.weight",
            "attn.indexer.compressor.wgate.weight",
            "attn.indexer.weights_proj.weight",
        ];
        let mut x_names = X_NAMES.iter();
        let mut take = || -> Result<B::Tensor> {
            let part = x_parts.next().expect("one part per width");
            let name = x_names.next().copied().unwrap_or("attn");
            watch.rows(b, &part, |_| site("input projection", &[name]))?;
            Ok(part)
        };
        let qr_raw = take()?;
        let kv_raw = take()?;
        let comp_proj = match &w.compressor {
            Some(_) => Some((take()?, take()?)),
            None => None,
        };
        let index_x = match &w.indexer {
            Some(_) => Some(((take()?, take()?), take()?)),
            None => None,
        };
        let qr = b.rms_norm(&qr_raw, n, c.q_lora_rank, Some(&w.q_norm), eps)?;
        watch.rows(b, &qr, |_| {
            site("query latent norm", &["attn.q_norm.weight"])
        })?;
        let mut kv = b.rms_norm(&kv_raw, n, hd, Some(&w.kv_norm), eps)?;
        watch.rows(b, &kv, |_| site("kv norm", &["attn.kv_norm.weight"]))?;
        let mut qr_widths = vec![heads * hd];
        if w.indexer.is_some() {
            qr_widths.push(ih * id);
        }
        let mut qr_parts = b.matmul_split(&qr, n, &w.qr_proj, &qr_widths)?.into_iter();
        let q_raw = qr_parts.next().expect("queries");
        watch.rows(b, &q_raw, |_| {
            site("query up-projection", &["attn.wq_b.weight"])
        })?;
        let mut q = b.rms_norm(&q_raw, n * heads, hd, None, eps)?;
        b.rope_apply(&mut q, heads, hd, rope, positions, false)?;
        b.rope_apply(&mut kv, 1, hd, rope, positions, false)?;
        let official = self.numerics == NumericsMode::Official;
        if official {
            b.fp8_round_trip(&mut kv, hd, c.nope_head_dim(), FP8_KV_BLOCK)?;
        }
        // The step's own keys go through the pool's row format too, so a token sees the same
        // keys whether they come from this step or from the pools (chunking and prefix hits
        // stay exact at every kv dtype).
        let kv_codec = kv_pools.layout().kv_codec;
        if kv_codec != RowCodec::F32 {
            b.codec_round_trip(&mut kv, hd, kv_codec)?;
        }
        let index_proj = match index_x {
            Some((kv_gate, weights)) => {
                let mut qi = qr_parts.next().expect("indexer queries");
                watch.rows(b, &qi, |_| {
                    site("indexer query projection", &["attn.indexer.wq_b.weight"])
                })?;
                b.rope_apply(&mut qi, ih, id, &self.rope_compress, positions, false)?;
                if official {
                    b.hadamard_fp4_round_trip(&mut qi, id, FP4_BLOCK)?;
                }
                Some((kv_gate, qi, weights))
            }
            None => None,
        };

        // State updates run per sequence; the searches and attention then run for all
        // sequences at once.
        for (seg, chunk) in segments.iter().zip(chunks.iter()) {
            let seq = &*chunk.seq;
            if let (Some(comp), Some((kv_c, gate_c))) = (&w.compressor, &comp_proj) {
                self.advance_compressor(
                    comp,
                    kv_pools,
                    seq,
                    (l, kind),
                    Stream::Main,
                    kv_c,
                    gate_c,
                    seg,
                    watch,
                )?;
            }
            if let (Some(ix), Some(((kv_i, gate_i), _, _))) = (&w.indexer, &index_proj) {
                self.advance_compressor(
                    &ix.compressor,
                    kv_pools,
                    seq,
                    (l, kind),
                    Stream::Indexer,
                    kv_i,
                    gate_i,
                    seg,
                    watch,
                )?;
            }
        }
        let selections: Vec<Option<(B::Index, usize)>> = match &index_proj {
            Some((_, qi, weights)) => {
                let scale =
                    (c.index_head_dim as f32).powf(-0.5) * (c.index_n_heads as f32).powf(-0.5);
                let args: Vec<IndexerArgs<'_, B>> = segments
                    .iter()
                    .map(|seg| {
                        let closed = (seg.start_pos + seg.rows.len()) / c.csa_ratio;
                        let keys = kv_pools
                            .rows(&seg.pages, l, Stream::Indexer, closed)
                            .expect("CSA layers index");
                        IndexerArgs {
                            q: qi,
                            weights,
                            rows: seg.rows.clone(),
                            start_pos: seg.start_pos,
                            keys,
                            ratio: c.csa_ratio,
                            top_k: c.index_topk,
                            heads: c.index_n_heads,
                            dim: c.index_head_dim,
                            score_scale: scale,
                        }
                    })
                    .collect();
                b.indexer_top_k(&args)?.into_iter().map(Some).collect()
            }
            None => segments.iter().map(|_| None).collect(),
        };
        let mut o = b.zeros(n * heads * hd)?;
        let args: Vec<AttentionArgs<'_, B>> = segments
            .iter()
            .zip(chunks.iter())
            .zip(&selections)
            .map(|((seg, chunk), selection)| AttentionArgs {
                q: &q,
                kv: &kv,
                rows: seg.rows.clone(),
                start_pos: seg.start_pos,
                ring: kv_pools.ring(chunk.seq, l),
                window: c.sliding_window,
                compressed: kv_pools.rows(
                    &seg.pages,
                    l,
                    Stream::Main,
                    (seg.start_pos + seg.rows.len()) / c.ratio(kind).max(1),
                ),
                ratio: c.ratio(kind).max(1),
                selection: selection.as_ref().map(|(sel, k)| (sel, *k)),
                sinks: &w.sinks,
                heads,
                head_dim: hd,
                scale: (hd as f32).powf(-0.5),
            })
            .collect();
        b.attention(&args, &mut o)?;
        drop(args);
        watch.rows(b, &o, |_| {
            site(
                "attention core (scores over cached keys)",
                &["attn.attn_sink"],
            )
        })?;
        for (seg, chunk) in segments.iter().zip(chunks.iter()) {
            kv_pools.write_window(chunk.seq, l, &kv, seg.rows.clone(), seg.start_pos)?;
        }
        // Undo the values' rotation so each contributes relative to the query position.
        b.rope_apply(&mut o, heads, hd, rope, positions, true)?;
        let grouped = b.matmul_grouped(&o, n, &w.wo_a, c.o_groups)?;
        watch.rows(b, &grouped, |_| {
            site("grouped output projection", &["attn.wo_a.weight"])
        })?;
        let out = b.matmul(&grouped, n, &w.wo_b)?;
        watch.rows(b, &out, |_| site("attention output", &["attn.wo_b.weight"]))?;
        Ok(out)
    }

    /// Feeds a sequence's new rows to a compressor; rows of windows they close are normed,
    /// roped at their window's first position and appended.
    #[allow(clippy::too_many_arguments)]
    fn advance_compressor(
        &self,
        comp: &super::Compressor<B>,
        kv_pools: &mut KvPools<B>,
        seq: &SeqKv,
        (l, kind): (usize, AttentionKind),
        stream: Stream,
        kv: &B::Tensor,
        gate: &B::Tensor,
        seg: &Segment<B>,
        watch: &mut Watch,
    ) -> Result<()> {
        let b = self.backend();
        let args = CompressArgs {
            kv,
            gate,
            rows: seg.rows.clone(),
            start_pos: seg.start_pos,
            ape: &comp.ape,
            ratio: comp.ratio,
            width: comp.width,
            overlap: comp.overlap,
        };
        let (rows, count, first) = kv_pools.compress(seq, l, stream, &args)?;
        if count == 0 {
            return Ok(());
        }
        let eps = self.config.rms_norm_eps as f32;
        let starts: Vec<u32> = (first..first + count)
            .map(|w| (w * comp.ratio) as u32)
            .collect();
        let prefix = match stream {
            Stream::Main => "attn.compressor.",
            Stream::Indexer => "attn.indexer.compressor.",
        };
        let names = |parts: &[&str]| -> Vec<String> {
            parts
                .iter()
                .map(|p| format!("layers.{l}.{prefix}{p}"))
                .collect()
        };
        let site = |step, weights: Vec<String>| Site {
            layer: Some((l, kind)),
            step,
            weights,
        };
        watch.rows_at(b, &rows, &starts, |_| {
            site(
                match stream {
                    Stream::Main => "compressor pooling",
                    Stream::Indexer => "indexer compressor pooling",
                },
                names(&["wkv.weight", "wgate.weight", "ape"]),
            )
        })?;
        let mut rows = b.rms_norm(&rows, count, comp.width, Some(&comp.norm), eps)?;
        watch.rows_at(b, &rows, &starts, |_| {
            site(
                match stream {
                    Stream::Main => "compressor norm",
                    Stream::Indexer => "indexer compressor norm",
                },
                names(&["norm.weight"]),
            )
        })?;
        // The windows' first positions: one small upload per compressor call.
        let first_positions: Vec<i32> = starts.iter().map(|&p| p as i32).collect();
        b.rope_apply(
            &mut rows,
            1,
            comp.width,
            &self.rope_compress,
            &b.index(&first_positions)?,
            false,
        )?;
        if self.numerics == NumericsMode::Official {
            let nope = self.config.nope_head_dim();
            match stream {
                Stream::Main => b.fp8_round_trip(&mut rows, comp.width, nope, FP8_KV_BLOCK)?,
                Stream::Indexer => b.hadamard_fp4_round_trip(&mut rows, comp.width, FP4_BLOCK)?,
            }
        }
        kv_pools.write_rows(seq, &seg.pages, l, stream, first, &rows, count)
    }

    fn moe(
        &self,
        l: usize,
        kind: AttentionKind,
        w: &Moe<B>,
        x: &B::Tensor,
        step: &StepIndex<B>,
        watch: &mut Watch,
    ) -> Result<B::Tensor> {
        let c = &self.config;
        let b = self.backend();
        let n = step.rows;
        let site = |step, weights: &[&str]| Site::layer(l, kind, step, weights);
        let inter_shared = c.moe_intermediate_size * c.n_shared_experts;
        let mut widths = vec![c.n_routed_experts];
        if w.shared_w2.is_some() {
            widths.push(2 * inter_shared);
        }
        let mut parts = b.matmul_split(x, n, &w.x_proj, &widths)?.into_iter();
        let logits = parts.next().expect("router logits");
        watch.rows(b, &logits, |_| site("router logits", &["ffn.gate.weight"]))?;
        let route_kind = match &w.router {
            Router::Hash(table) => RouteKind::Hash {
                table,
                token_ids: &step.tokens,
            },
            Router::TopK(bias) => RouteKind::TopK {
                bias: bias.as_ref(),
            },
        };
        let routing = b.route(&RouteArgs {
            logits: &logits,
            rows: n,
            experts: c.n_routed_experts,
            top_k: c.n_activated_experts,
            scoring: super::scoring(c),
            normalize: c.norm_topk_prob,
            scale: c.routed_scaling_factor as f32,
            kind: route_kind,
        })?;
        let limit = c.swiglu_limit as f32;
        watch.rows(b, &routing.weights, |_| {
            site("router weights", &["ffn.gate.weight", "ffn.gate.bias"])
        })?;
        let mut y = b.moe(x, n, &routing, &w.experts, c.moe_intermediate_size, limit)?;
        watch.rows(b, &y, |row| {
            // Name the experts this token was routed to.
            // (An unreadable routing table leaves the names out; the layer is still named.)
            let chosen = b.read_index(&routing.experts).unwrap_or_default();
            let k = routing.top_k.max(1);
            let names: Vec<String> = chosen
                .iter()
                .skip(row * k)
                .take(k)
                .flat_map(|e| {
                    ["w1", "w3", "w2"].map(|m| format!("layers.{l}.ffn.experts.{e}.{m}.weight"))
                })
                .collect();
            Site {
                layer: Some((l, kind)),
                step: "routed experts",
                weights: names,
            }
        })?;
        if let (Some(w2), Some(gate_up)) = (&w.shared_w2, parts.next()) {
            watch.rows(b, &gate_up, |_| {
                site(
                    "shared expert gate/up projection",
                    &[
                        "ffn.shared_experts.w1.weight",
                        "ffn.shared_experts.w3.weight",
                    ],
                )
            })?;
            let h = b.swiglu(&gate_up, n, inter_shared, limit)?;
            let shared = b.matmul(&h, n, w2)?;
            watch.rows(b, &shared, |_| {
                site(
                    "shared expert down projection",
                    &["ffn.shared_experts.w2.weight"],
                )
            })?;
            b.add_assign(&mut y, &shared)?;
        }
        Ok(y)
    }
}
