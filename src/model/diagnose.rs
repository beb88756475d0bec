//! Finding where a NaN or infinity starts: a diagnostic re-run of one sequence with a finite
//! check after every sub-step of every layer.
//!
//! The engine checks only the logits rows it samples (one pass over `vocab` values per
//! request per step). When one is non-finite it re-runs that request's tokens through
//! [`Model::diagnose_nonfinite`], whose [`Watch`] reads back each intermediate tensor and stops
//! recording at the first non-finite value, naming the layer, the sub-step and the weights that
//! sub-step reads. Normal steps pass [`Watch::off`]: each check is then one branch on a bool
//! (about forty per layer per step, nothing read back), so the hot path does not pay for it.

use std::fmt;

use super::forward::{Chunk, Logits};
use super::Model;
use crate::backend::Backend;
use crate::config::AttentionKind;
use crate::error::{Error, Result};
use crate::kv::KvPools;

/// The first non-finite value of a diagnostic run.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFinite {
    /// The decoder layer (`None`: the embedding before the first layer, or the head after the
    /// last).
    pub layer: Option<usize>,
    /// That layer's attention kind.
    pub kind: Option<AttentionKind>,
    /// The sub-step whose output held the value, e.g. "attention output".
    pub step: &'static str,
    /// Official names of the weights that sub-step reads (the likely culprits).
    pub weights: Vec<String>,
    /// Token position of the row that held it (for compressor rows: the first position of the
    /// compressed window).
    pub position: usize,
    /// The value (NaN, +inf or -inf).
    pub value: f32,
}

impl fmt::Display for NonFinite {
    /// "layer 3 (CSA) attention output: NaN at position 17 (weights: layers.3.attn.wo_b.weight)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.layer {
            write!(f, "layer {l} ")?;
            if let Some(kind) = self.kind {
                write!(f, "({}) ", kind_name(kind))?;
            }
        }
        let value = if self.value.is_nan() {
            "NaN".to_string()
        } else {
            format!("{}", self.value)
        };
        write!(
            f,
            "{}: {value} at position {} (weights: {})",
            self.step,
            self.position,
            self.weights.join(", ")
        )
    }
}

impl NonFinite {
    /// The finding with what to do about it, for an ERROR event.
    pub fn message(&self) -> String {
        format!(
            "the logits are not finite; a diagnostic re-run found the first non-finite value in \
             {self}: those weights (or their scales) are likely corrupt; download the \
             checkpoint again, or convert it again from the original release"
        )
    }
}

fn kind_name(kind: AttentionKind) -> &'static str {
    match kind {
        AttentionKind::Swa => "SWA",
        AttentionKind::Csa => "CSA",
        AttentionKind::Hca => "HCA",
    }
}

/// Where a check sits: layer, sub-step and the weights it reads.
pub(crate) struct Site {
    pub layer: Option<(usize, AttentionKind)>,
    pub step: &'static str,
    pub weights: Vec<String>,
}

impl Site {
    /// A sub-step of layer `l`; `weights` are names below `layers.{l}.`.
    pub fn layer(l: usize, kind: AttentionKind, step: &'static str, weights: &[&str]) -> Self {
        Self {
            layer: Some((l, kind)),
            step,
            weights: weights.iter().map(|w| format!("layers.{l}.{w}")).collect(),
        }
    }

    /// A step outside the layers (embedding, head).
    pub fn outside(step: &'static str, weights: &[&str]) -> Self {
        Self {
            layer: None,
            step,
            weights: weights.iter().map(|w| w.to_string()).collect(),
        }
    }
}

/// Finite checks of a forward step: off (the hot path) or recording the first non-finite
/// value.
pub(crate) struct Watch {
    on: bool,
    /// Position of each row of the batch (set by the step when on).
    positions: Vec<u32>,
    found: Option<NonFinite>,
}

impl Watch {
    /// No checks: what every serving step passes.
    pub fn off() -> Self {
        Self {
            on: false,
            positions: Vec::new(),
            found: None,
        }
    }

    fn on() -> Self {
        Self {
            on: true,
            positions: Vec::new(),
            found: None,
        }
    }

    /// Whether checks still record (on, and nothing found yet).
    #[inline]
    pub fn active(&self) -> bool {
        self.on && self.found.is_none()
    }

    pub fn set_positions(&mut self, positions: &[u32]) {
        if self.on {
            self.positions = positions.to_vec();
        }
    }

    /// Checks `t`, one row per batch row (any width); `site` gets the row of the first
    /// non-finite value.
    #[inline]
    pub fn rows<B: Backend>(
        &mut self,
        b: &B,
        t: &B::Tensor,
        site: impl FnOnce(usize) -> Site,
    ) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        let positions = std::mem::take(&mut self.positions);
        let values = b.read(t);
        if let Ok(v) = &values {
            self.record(v, &positions, site);
        }
        self.positions = positions;
        values.map(drop)
    }

    /// Checks `t` whose rows sit at `positions` (compressed rows, logits rows).
    #[inline]
    pub fn rows_at<B: Backend>(
        &mut self,
        b: &B,
        t: &B::Tensor,
        positions: &[u32],
        site: impl FnOnce(usize) -> Site,
    ) -> Result<()> {
        if self.active() {
            self.record(&b.read(t)?, positions, site);
        }
        Ok(())
    }

    /// Checks values already on the host (the logits).
    #[inline]
    pub fn values(&mut self, values: &[f32], positions: &[u32], site: impl FnOnce(usize) -> Site) {
        if self.active() {
            self.record(values, positions, site);
        }
    }

    fn record(&mut self, values: &[f32], positions: &[u32], site: impl FnOnce(usize) -> Site) {
        let Some(i) = values.iter().position(|v| !v.is_finite()) else {
            return;
        };
        let width = (values.len() / positions.len().max(1)).max(1);
        let row = (i / width).min(positions.len().saturating_sub(1));
        let site = site(row);
        self.found = Some(NonFinite {
            layer: site.layer.map(|(l, _)| l),
            kind: site.layer.map(|(_, k)| k),
            step: site.step,
            weights: site.weights,
            position: positions.get(row).map_or(row, |&p| p as usize),
            value: values[i],
        });
    }
}

impl<B: Backend> Model<B> {
    /// Re-runs `tokens` as a fresh sequence with a finite check after every sub-step of every
    /// layer and returns the first non-finite value found (`None`: every value was finite, so
    /// the non-finite logits did not come from the weights, e.g. a `logit_bias` of +inf).
    ///
    /// Opens a scratch sequence in `kv` (one slot and pages for all of `tokens`; a `Capacity`
    /// error when the pools have no room, so free the failing request's sequence first or
    /// evict cached prefixes), runs it in chunks of `chunk_tokens` (0: all at once) and closes
    /// it again: the pools end as they started. Costs about one forward pass of `tokens` plus a
    /// read-back of every intermediate tensor; it is meant for the rare step whose logits are
    /// not finite, never for serving.
    pub fn diagnose_nonfinite(
        &self,
        kv: &mut KvPools<B>,
        tokens: &[u32],
        chunk_tokens: usize,
    ) -> Result<Option<NonFinite>> {
        if tokens.is_empty() {
            return Err(Error::invalid_argument(
                "no tokens to diagnose: pass the sequence whose logits were not finite",
            ));
        }
        let mut seq = kv.open()?;
        let result = kv.reserve(&mut seq, tokens.len()).and_then(|()| {
            let chunk = if chunk_tokens == 0 {
                tokens.len()
            } else {
                chunk_tokens
            };
            let parts = tokens.chunks(chunk).count();
            for (i, part) in tokens.chunks(chunk).enumerate() {
                let mut watch = Watch::on();
                let mut chunks = [Chunk {
                    tokens: part,
                    seq: &mut seq,
                    logits: if i + 1 == parts {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                }];
                let out = self
                    .backend()
                    .scope(|| self.step(kv, &mut chunks, &mut watch));
                // A non-finite value can make a later op fail; the finding explains that.
                if let Some(found) = watch.found {
                    return Ok(Some(found));
                }
                out?;
            }
            Ok(None)
        });
        kv.close(seq);
        result
    }
}
