//! Where every piece of a request's DeepSeek V4 state lives: the per-layer offsets, row
//! formats and unit sizes of each pool, all derived from the plan's geometry
//! (docs/kv-cache.md "Pools", docs/plan.md "Pools"). Nothing here computes a size the plan
//! does not own.

use crate::backend::{Placement, RowLayout};
use crate::config::AttentionKind;
use crate::error::{Error, Result};
use crate::formats::rows::RowCodec;
use crate::plan::{self, Plan};

use super::ids::{SnapshotId, UnitId};
use super::state::LayoutFingerprint;

/// The pools: the plan owns the vocabulary; re-exported here for `kv::layout::PoolId` users.
pub use crate::plan::PoolId;

/// Which compressor of a layer: the attention's own, or the lightning indexer's (CSA only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Main,
    Indexer,
}

/// A layer's place in the pools of its kind.
#[derive(Debug, Clone, Copy)]
struct LayerSlot {
    kind: AttentionKind,
    /// Index among the layers of its kind (CSA or HCA).
    index: usize,
}

/// One compressor frontier: f32 `[coff·ratio, 2·coff·width]`.
#[derive(Debug, Clone, Copy)]
pub struct Frontier {
    pub pool: PoolId,
    /// Byte offset inside the slot.
    pub offset: usize,
    pub ratio: usize,
    pub width: usize,
    pub overlap: bool,
}

impl Frontier {
    fn row_bytes(&self) -> usize {
        let coff = if self.overlap { 2 } else { 1 };
        2 * coff * self.width * 4
    }
}

/// The layout of every pool for one deployment.
#[derive(Debug, Clone)]
pub struct KvLayout {
    pub page_size: usize,
    pub window: usize,
    pub head_dim: usize,
    pub index_dim: usize,
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub kv_codec: RowCodec,
    pub index_codec: RowCodec,
    kv_row: usize,
    index_row: usize,
    layers: Vec<LayerSlot>,
    /// Window rings per slot: every layer plus the MTP blocks.
    swa_layers: usize,
    n_csa: usize,
    /// Bytes of one unit of each pool (`PoolId` order).
    unit_bytes: [usize; 8],
    /// Units of each pool on the device.
    units: [usize; 8],
    /// What a sequence's bytes mean here (compared on sequence-state import).
    fingerprint: LayoutFingerprint,
}

impl KvLayout {
    pub fn new(plan: &Plan) -> Result<Self> {
        let m = &plan.model;
        let g = &plan.geometry;
        let mut unit_bytes = [0; 8];
        let mut units = [0; 8];
        for id in PoolId::ALL {
            let pool = plan
                .pool(id)
                .ok_or_else(|| Error::internal(format!("the plan has no `{}` pool", id.name())))?;
            unit_bytes[id.index()] = usize::try_from(pool.shape.unit_bytes)
                .map_err(|_| Error::internal("pool unit larger than the address space"))?;
            units[id.index()] = usize::try_from(pool.device_units)
                .map_err(|_| Error::internal("pool unit count larger than the address space"))?;
        }
        let page_size = g.page_size as usize;
        for ratio in [m.csa_ratio, m.hca_ratio] {
            if ratio == 0 || !page_size.is_multiple_of(ratio) {
                return Err(Error::config(format!(
                    "kv.page_size = {page_size} is not a multiple of the compression ratio \
                     {ratio}: use a multiple of {}",
                    m.csa_ratio.max(m.hca_ratio)
                )));
            }
        }
        let mut counts = [0usize; 3];
        let layers = m
            .attention
            .iter()
            .map(|&kind| {
                let c = &mut counts[kind as usize];
                *c += 1;
                LayerSlot {
                    kind,
                    index: *c - 1,
                }
            })
            .collect();
        let kv_codec = plan::kv_codec(plan.kv_dtype, m);
        let index_codec = plan::indexer_codec(plan.indexer_dtype);
        let kv_row = kv_codec.row_bytes(m.head_dim);
        let index_row = index_codec.row_bytes(m.index_head_dim);
        let fingerprint = LayoutFingerprint {
            model: m.name.clone(),
            layers: m
                .attention
                .iter()
                .map(|k| match k {
                    AttentionKind::Swa => 'S',
                    AttentionKind::Csa => 'C',
                    AttentionKind::Hca => 'H',
                })
                .collect(),
            mtp_layers: m.num_mtp_layers,
            head_dim: m.head_dim,
            index_dim: m.index_head_dim,
            window: m.sliding_window,
            csa_ratio: m.csa_ratio,
            hca_ratio: m.hca_ratio,
            page_size,
            kv_rows: format!("{kv_codec:?}, {kv_row} B"),
            index_rows: format!("{index_codec:?}, {index_row} B"),
            unit_bytes: PoolId::ALL
                .iter()
                .map(|id| (id.name().to_string(), unit_bytes[id.index()]))
                .collect(),
        };
        let layout = Self {
            page_size,
            window: m.sliding_window,
            head_dim: m.head_dim,
            index_dim: m.index_head_dim,
            csa_ratio: m.csa_ratio,
            hca_ratio: m.hca_ratio,
            kv_codec,
            index_codec,
            kv_row,
            index_row,
            layers,
            swa_layers: m.num_layers + m.num_mtp_layers,
            n_csa: m.count(AttentionKind::Csa),
            unit_bytes,
            units,
            fingerprint,
        };
        // The plan sized these units; the layout below must agree to the byte.
        for (id, computed) in [
            (
                PoolId::Swa,
                layout.swa_layers * layout.window * layout.kv_row,
            ),
            (PoolId::Snapshots, layout.snapshot_unit_bytes()),
        ] {
            if layout.unit_bytes(id) != computed {
                return Err(Error::internal(format!(
                    "pool `{}`: plan unit {} B, layout {computed} B",
                    id.name(),
                    layout.unit_bytes(id)
                )));
            }
        }
        Ok(layout)
    }

    pub fn unit_bytes(&self, id: PoolId) -> usize {
        self.unit_bytes[id.index()]
    }

    pub fn units(&self, id: PoolId) -> usize {
        self.units[id.index()]
    }

    /// The model, geometry, page size, row formats and unit sizes this layout stores bytes
    /// in; two pools can exchange a sequence's bytes exactly when these are equal.
    pub fn fingerprint(&self) -> &LayoutFingerprint {
        &self.fingerprint
    }

    /// Bytes of one window-ring or compressed kv row.
    pub fn kv_row_bytes(&self) -> usize {
        self.kv_row
    }

    /// Bytes of one indexer key row.
    pub fn index_row_bytes(&self) -> usize {
        self.index_row
    }

    /// Layers of attention kind `kind` (main layers only).
    pub fn count(&self, kind: AttentionKind) -> usize {
        self.layers.iter().filter(|s| s.kind == kind).count()
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Window rings per slot (layers plus MTP blocks).
    pub fn swa_layers(&self) -> usize {
        self.swa_layers
    }

    pub fn kind(&self, layer: usize) -> AttentionKind {
        self.layers[layer].kind
    }

    /// Layer `l`'s window ring in slot `slot`.
    pub fn ring<P: ?Sized>(&self, slot: u32, l: usize) -> RowLayout<'static, P> {
        RowLayout {
            offset: slot as usize * self.unit_bytes(PoolId::Swa) + l * self.window * self.kv_row,
            row_bytes: self.kv_row,
            width: self.head_dim,
            codec: self.kv_codec,
            placement: Placement::Ring { rows: self.window },
        }
    }

    /// The pool, ratio and row layout of a compressed layer's rows addressed by `pages` (host
    /// page ids, or the backend's copy of them).
    pub fn rows<'a, P: ?Sized>(
        &self,
        pages: &'a P,
        l: usize,
        stream: Stream,
    ) -> Option<(PoolId, usize, RowLayout<'a, P>)> {
        let slot = self.layers[l];
        let (pool, ratio, row_bytes, width, codec) = match (slot.kind, stream) {
            (AttentionKind::Csa, Stream::Main) => (
                PoolId::C4Kv,
                self.csa_ratio,
                self.kv_row,
                self.head_dim,
                self.kv_codec,
            ),
            (AttentionKind::Csa, Stream::Indexer) => (
                PoolId::C4Indexer,
                self.csa_ratio,
                self.index_row,
                self.index_dim,
                self.index_codec,
            ),
            (AttentionKind::Hca, Stream::Main) => (
                PoolId::C128Kv,
                self.hca_ratio,
                self.kv_row,
                self.head_dim,
                self.kv_codec,
            ),
            _ => return None,
        };
        let per_page = self.page_size / ratio;
        Some((
            pool,
            ratio,
            RowLayout {
                offset: slot.index * per_page * row_bytes,
                row_bytes,
                width,
                codec,
                placement: Placement::Paged {
                    pages,
                    rows_per_unit: per_page,
                    unit_bytes: self.unit_bytes(pool),
                },
            },
        ))
    }

    /// A compressed layer's compressor frontier in slot `slot`.
    pub fn frontier(&self, slot: u32, l: usize, stream: Stream) -> Option<Frontier> {
        let s = self.layers[l];
        let (pool, ratio, width, overlap) = match (s.kind, stream) {
            (AttentionKind::Csa, Stream::Main) => {
                (PoolId::C4State, self.csa_ratio, self.head_dim, true)
            }
            (AttentionKind::Csa, Stream::Indexer) => {
                (PoolId::C4IndexerState, self.csa_ratio, self.index_dim, true)
            }
            (AttentionKind::Hca, Stream::Main) => {
                (PoolId::C128State, self.hca_ratio, self.head_dim, false)
            }
            _ => return None,
        };
        let mut f = Frontier {
            pool,
            offset: 0,
            ratio,
            width,
            overlap,
        };
        let per_layer = (if overlap { 2 } else { 1 }) * ratio * f.row_bytes();
        f.offset = slot as usize * self.unit_bytes(pool) + s.index * per_layer;
        Some(f)
    }

    fn snapshot_unit_bytes(&self) -> usize {
        let halo = |width: usize| self.n_csa * self.csa_ratio * 2 * width * 4;
        self.unit_bytes(PoolId::Swa) + halo(self.head_dim) + halo(self.index_dim)
    }

    /// The byte regions of a slot that a snapshot keeps, as `(slot pool, slot offset,
    /// snapshot offset, len)`: the window rings, then for every CSA layer the overlap half of
    /// the last closed window (the first-half kv and score of its `ratio` rows) of the main
    /// and indexer compressors. At a page boundary every other frontier entry is dead: the
    /// pending windows are empty and HCA windows are closed.
    pub fn snapshot_regions(
        &self,
        slot: u32,
        snapshot: SnapshotId,
    ) -> Vec<(PoolId, usize, usize, usize)> {
        let base = snapshot.index() * self.unit_bytes(PoolId::Snapshots);
        let swa = self.unit_bytes(PoolId::Swa);
        let mut out = vec![(PoolId::Swa, slot as usize * swa, base, swa)];
        let mut at = base + swa;
        for stream in [Stream::Main, Stream::Indexer] {
            for l in 0..self.layers.len() {
                if self.layers[l].kind != AttentionKind::Csa {
                    continue;
                }
                let f = self
                    .frontier(slot, l, stream)
                    .expect("CSA layers have both frontiers");
                let half = f.width * 4;
                let cols = 2 * half;
                for s in 0..f.ratio {
                    let row = f.offset + s * f.row_bytes();
                    out.push((f.pool, row, at, half));
                    out.push((f.pool, row + cols, at + half, half));
                    at += 2 * half;
                }
            }
        }
        debug_assert_eq!(at - base, self.unit_bytes(PoolId::Snapshots));
        out
    }
}
