//! The per-sequence DeepSeek V4 state a forward step reads and extends (docs/model-dsv4.md §3):
//! every layer's window ring, and for compressed layers the compressor frontiers and the rows
//! emitted so far. Contiguous per-sequence storage for now; the paged KV cache replaces it
//! behind the same methods.

use std::ops::Range;

use crate::backend::{Backend, CompressArgs};
use crate::config::AttentionKind;

use super::Model;

/// Which compressor of a layer: the attention's own, or the lightning indexer's (CSA only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Main,
    Indexer,
}

/// One compressor's frontier and emitted rows.
pub struct CompressorState<B: Backend> {
    /// `[coff·ratio, 2·coff·width]`: kv ‖ score per slot.
    pub frontier: B::Tensor,
    /// `[rows, width]`, normed and roped.
    pub rows: B::Tensor,
    pub n_rows: usize,
}

/// One layer's state.
pub struct LayerState<B: Backend> {
    /// `[window, head_dim]`: position p in row `p % window`.
    pub ring: B::Tensor,
    pub compressor: Option<CompressorState<B>>,
    /// The lightning indexer's own compressor (CSA only).
    pub indexer: Option<CompressorState<B>>,
}

/// Everything a sequence carries between forward steps. Layer code reaches it only through
/// the methods below, so the storage can move (paged pools) without touching the layers.
pub struct SeqState<B: Backend> {
    /// Tokens processed so far: the position of the next token.
    pub position: usize,
    layers: Vec<LayerState<B>>,
    /// The MTP blocks' window rings (sliding-window layers; filled by speculative decoding).
    mtp_windows: Vec<B::Tensor>,
}

impl<B: Backend> SeqState<B> {
    /// A fresh state for `model`.
    pub fn new(model: &Model<B>) -> Self {
        let c = &model.config;
        let b = model.backend();
        let compressor = |ratio: usize, width: usize, overlap: bool| {
            let coff = if overlap { 2 } else { 1 };
            CompressorState {
                frontier: b.zeros(coff * ratio * 2 * coff * width),
                rows: b.zeros(0),
                n_rows: 0,
            }
        };
        let layers = c
            .attention
            .iter()
            .map(|&kind| LayerState {
                ring: b.zeros(c.sliding_window * c.head_dim),
                compressor: match kind {
                    AttentionKind::Swa => None,
                    AttentionKind::Csa => Some(compressor(c.csa_ratio, c.head_dim, true)),
                    AttentionKind::Hca => Some(compressor(c.hca_ratio, c.head_dim, false)),
                },
                indexer: (kind == AttentionKind::Csa)
                    .then(|| compressor(c.csa_ratio, c.index_head_dim, true)),
            })
            .collect();
        Self {
            position: 0,
            layers,
            mtp_windows: (0..model.mtp_blocks())
                .map(|_| b.zeros(c.sliding_window * c.head_dim))
                .collect(),
        }
    }
}

impl<B: Backend> SeqState<B> {
    fn compressor(&self, l: usize, stream: Stream) -> Option<&CompressorState<B>> {
        let layer = &self.layers[l];
        match stream {
            Stream::Main => layer.compressor.as_ref(),
            Stream::Indexer => layer.indexer.as_ref(),
        }
    }

    fn compressor_mut(&mut self, l: usize, stream: Stream) -> Option<&mut CompressorState<B>> {
        let layer = &mut self.layers[l];
        match stream {
            Stream::Main => layer.compressor.as_mut(),
            Stream::Indexer => layer.indexer.as_mut(),
        }
    }

    /// How many MTP window rings the state carries.
    pub fn mtp_windows(&self) -> usize {
        self.mtp_windows.len()
    }

    /// Layer `l`'s window ring (positions before this step's tokens).
    pub fn window(&self, l: usize) -> &B::Tensor {
        &self.layers[l].ring
    }

    /// Stores this step's K=V rows (`rows` of the batch's `kv`) in layer `l`'s ring.
    pub fn write_window(
        &mut self,
        b: &B,
        l: usize,
        kv: &B::Tensor,
        rows: Range<usize>,
        window: usize,
        dim: usize,
    ) {
        let start = self.position;
        b.ring_write(&mut self.layers[l].ring, kv, rows, start, window, dim);
    }

    /// Feeds this step's projections to a compressor; returns the pooled rows of the windows
    /// they close (not yet normed or roped), their count, and the index of the first.
    pub fn compress(
        &mut self,
        b: &B,
        l: usize,
        stream: Stream,
        args: &CompressArgs<'_, B>,
    ) -> (B::Tensor, usize, usize) {
        let state = self
            .compressor_mut(l, stream)
            .expect("compress called on a layer without that compressor");
        let first = state.n_rows;
        let (rows, count) = b.compress(&mut state.frontier, args);
        (rows, count, first)
    }

    /// Appends finished (normed, roped) rows to a compressor's store.
    pub fn append_rows(&mut self, b: &B, l: usize, stream: Stream, rows: &B::Tensor, count: usize) {
        let state = self
            .compressor_mut(l, stream)
            .expect("append_rows called on a layer without that compressor");
        b.append_rows(&mut state.rows, rows);
        state.n_rows += count;
    }

    /// A compressor's rows so far and their count.
    pub fn rows(&self, l: usize, stream: Stream) -> Option<(&B::Tensor, usize)> {
        self.compressor(l, stream).map(|c| (&c.rows, c.n_rows))
    }
}
