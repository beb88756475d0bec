//! The per-sequence DeepSeek V4 state a forward step reads and extends (docs/model-dsv4.md §3):
//! every layer's window ring, and for compressed layers the compressor frontiers and the rows
//! emitted so far. Contiguous per-sequence storage for now; the paged KV cache replaces it
//! behind the same methods.

use crate::backend::Backend;
use crate::config::AttentionKind;

use super::Model;

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

/// Everything a sequence carries between forward steps.
pub struct SeqState<B: Backend> {
    /// Tokens processed so far: the position of the next token.
    pub position: usize,
    pub layers: Vec<LayerState<B>>,
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
        }
    }
}
