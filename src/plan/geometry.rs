//! Row formats and pool geometry: the contract between model, kv, plan and pd
//! (docs/plan.md "Pools", docs/kv-cache.md "Pools"; docs/model.md §3).

use serde::Serialize;

use crate::config::params::{IndexerDtype, KvDtype};
use crate::config::{AttentionKind, ModelConfig};
use crate::formats::rows::RowCodec;

use super::PoolId;

/// What one unit of a pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// `page_size` tokens of growing state; one page id addresses all paged pools.
    Page,
    /// The fixed state of one running request.
    Slot,
    /// A copy of a request's fixed state at a page boundary.
    Snapshot,
}

/// How a compressed or window KV row (one K=V head) is stored for `dtype`.
///
/// fp8 is SGLang's packed row: e4m3 nope channels, bf16 rope channels, one ue8m0 scale per 64
/// nope channels, padded to 8 bytes (448 + 128 + 7 + 1 = 584 for V4).
pub fn kv_codec(dtype: KvDtype, model: &ModelConfig) -> RowCodec {
    match dtype {
        KvDtype::F32 | KvDtype::Auto => RowCodec::F32,
        KvDtype::Bf16 => RowCodec::Bf16,
        KvDtype::Fp8 => RowCodec::Fp8Kv {
            nope: model.nope_head_dim(),
            rope: model.rope_head_dim,
        },
    }
}

/// How an indexer key row is stored: fp8 values with one f32 scale per 128 channels (132 B
/// for V4), or fp4 values packed two per byte with one ue8m0 scale per 32 channels (68 B).
pub fn indexer_codec(dtype: IndexerDtype) -> RowCodec {
    match dtype {
        IndexerDtype::F32 | IndexerDtype::Auto => RowCodec::F32,
        IndexerDtype::Bf16 => RowCodec::Bf16,
        IndexerDtype::Fp8 => RowCodec::Fp8Index,
        IndexerDtype::Fp4 => RowCodec::Fp4Index,
    }
}

/// Bytes of one compressed or window KV row.
pub fn kv_row_bytes(dtype: KvDtype, model: &ModelConfig) -> u64 {
    kv_codec(dtype, model).row_bytes(model.head_dim) as u64
}

/// Bytes of one indexer key row.
pub fn indexer_row_bytes(dtype: IndexerDtype, model: &ModelConfig) -> u64 {
    indexer_codec(dtype).row_bytes(model.index_head_dim) as u64
}

/// The shape of one pool, before it is given any units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolShape {
    /// Which pool (serialized as its name, as before).
    #[serde(rename = "name")]
    pub id: PoolId,
    pub unit: Unit,
    pub layers: u64,
    pub row_bytes: u64,
    pub rows_per_unit: u64,
    /// `layers × rows_per_unit × row_bytes`, plus `extra` parts for composite units.
    pub unit_bytes: u64,
    /// For snapshots: what the unit is made of, by part.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<(&'static str, u64)>,
}

impl PoolShape {
    fn rows(id: PoolId, unit: Unit, layers: usize, rows: u64, row_bytes: u64) -> Self {
        let layers = layers as u64;
        Self {
            id,
            unit,
            layers,
            row_bytes,
            rows_per_unit: rows,
            unit_bytes: layers * rows * row_bytes,
            components: Vec::new(),
        }
    }
}

/// All pools of a deployment, in report order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub page_size: u64,
    pub c4_kv: PoolShape,
    pub c4_indexer: PoolShape,
    pub c128_kv: PoolShape,
    pub swa: PoolShape,
    pub c4_state: PoolShape,
    pub c4_indexer_state: PoolShape,
    pub c128_state: PoolShape,
    pub snapshots: PoolShape,
}

impl Geometry {
    pub fn new(model: &ModelConfig, page_size: u64, kv: KvDtype, indexer: IndexerDtype) -> Self {
        let n_csa = model.count(AttentionKind::Csa);
        let n_hca = model.count(AttentionKind::Hca);
        let (csa, hca) = (model.csa_ratio as u64, model.hca_ratio as u64);
        let (head, index) = (model.head_dim as u64, model.index_head_dim as u64);
        let kv_row = kv_row_bytes(kv, model);
        let f32 = 4;
        // Compressor frontiers, official layout: for each of the `coff·ratio` pending slots, kv
        // and score (gate + position bias) at width `coff·head` (coff = 2 with CSA's overlap).
        let frontier_row = |coff: u64, width: u64| 2 * coff * width * f32;
        let swa_layers = model.num_layers + model.num_mtp_layers;
        let swa = PoolShape::rows(
            PoolId::Swa,
            Unit::Slot,
            swa_layers,
            model.sliding_window as u64,
            kv_row,
        );
        // At a page boundary (a multiple of 128 tokens) every compressor window is closed, so a
        // snapshot holds the SWA ring plus only the CSA overlap halves ("Ca": the last window's
        // first-half kv and score), docs/model.md §6.2.
        let halo = |width: u64| n_csa as u64 * csa * 2 * width * f32;
        let components = vec![
            ("swa", swa.unit_bytes),
            ("c4_halo", halo(head)),
            ("c4_indexer_halo", halo(index)),
        ];
        let snapshots = PoolShape {
            id: PoolId::Snapshots,
            unit: Unit::Snapshot,
            unit_bytes: components.iter().map(|(_, b)| b).sum(),
            components,
            ..swa.clone()
        };
        Self {
            page_size,
            c4_kv: PoolShape::rows(PoolId::C4Kv, Unit::Page, n_csa, page_size / csa, kv_row),
            c4_indexer: PoolShape::rows(
                PoolId::C4Indexer,
                Unit::Page,
                n_csa,
                page_size / csa,
                indexer_row_bytes(indexer, model),
            ),
            c128_kv: PoolShape::rows(PoolId::C128Kv, Unit::Page, n_hca, page_size / hca, kv_row),
            swa,
            c4_state: PoolShape::rows(
                PoolId::C4State,
                Unit::Slot,
                n_csa,
                2 * csa,
                frontier_row(2, head),
            ),
            c4_indexer_state: PoolShape::rows(
                PoolId::C4IndexerState,
                Unit::Slot,
                n_csa,
                2 * csa,
                frontier_row(2, index),
            ),
            c128_state: PoolShape::rows(
                PoolId::C128State,
                Unit::Slot,
                n_hca,
                hca,
                frontier_row(1, head),
            ),
            snapshots,
        }
    }

    /// The paged pools (one page id addresses all three).
    pub fn paged(&self) -> [&PoolShape; 3] {
        [&self.c4_kv, &self.c4_indexer, &self.c128_kv]
    }

    /// The per-request slot pools.
    pub fn slotted(&self) -> [&PoolShape; 4] {
        [
            &self.swa,
            &self.c4_state,
            &self.c4_indexer_state,
            &self.c128_state,
        ]
    }

    /// Bytes of one page across the paged pools.
    pub fn page_bytes(&self) -> u64 {
        self.paged().iter().map(|p| p.unit_bytes).sum()
    }

    /// Bytes of one running request's fixed state.
    pub fn slot_bytes(&self) -> u64 {
        self.slotted().iter().map(|p| p.unit_bytes).sum()
    }

    /// Every pool in report order.
    pub fn all(&self) -> [&PoolShape; 8] {
        [
            &self.c4_kv,
            &self.c4_indexer,
            &self.c128_kv,
            &self.swa,
            &self.c4_state,
            &self.c4_indexer_state,
            &self.c128_state,
            &self.snapshots,
        ]
    }
}
