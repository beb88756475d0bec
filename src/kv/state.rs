//! One sequence's whole state as an explicit list of byte regions, so it can leave its pools
//! (prefill → decode transfer, a storage tier) and be rebuilt, bit for bit, in other pools
//! with the same layout.
//!
//! [`export`] only lists regions (no bytes move); [`read`] copies them out in list order;
//! [`import`] takes fresh units in the destination pools and writes the bytes into the same
//! regions of those units. What the regions are (docs/kv-cache.md "Sequence state
//! export/import"):
//!
//! 1. `c4_kv`, `c4_indexer`, `c128_kv`: for each page of the sequence, the rows written so far
//!    (rows of closed compression windows, `position / ratio` per layer) — a whole unit for a
//!    full page, then one region per layer for the page that is partly written;
//! 2. `swa`: the window rings of every layer and MTP block — the whole slot unit once the
//!    position reached the window, else the first `position` rows of each ring;
//! 3. `c4_state`, `c4_indexer_state`, `c128_state`: the slot's whole compressor frontiers
//!    (pending windows and the CSA overlap half).
//!
//! Position, last token and the sampler's RNG state travel as fields of [`SequenceState`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::config::AttentionKind;
use crate::error::{Error, ErrorKind, Result};

use super::ids::{PageId, UnitId};
use super::layout::{KvLayout, PoolId};
use super::pools::{KvPools, SeqKv};

/// Where a region's bytes are. Running sequences live on the device today; `Host` is for a
/// state parked in a host tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionTier {
    Device,
    Host,
}

/// `len` bytes at byte `offset` of pool `pool`'s buffer in tier `tier`: an offset into that
/// pool's [`PoolRegion`](super::regions::PoolRegion) (`KvPools::regions`, `HostPools::regions`),
/// which [`Region::locate`] turns into an absolute `(addr, len)`, bounds-checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    pub pool: PoolId,
    pub tier: RegionTier,
    pub offset: usize,
    pub len: usize,
}

/// What a layout's bytes mean: the model and its geometry, the page size, the row formats and
/// every pool's unit size. Unit counts are not part of it (pools of any size can exchange
/// sequences).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayoutFingerprint {
    /// The model's display name (`_name_or_path` or the checkpoint directory).
    pub model: String,
    /// Attention kind per main layer: `S` window only, `C` CSA, `H` HCA.
    pub layers: String,
    pub mtp_layers: usize,
    pub head_dim: usize,
    pub index_dim: usize,
    pub window: usize,
    pub csa_ratio: usize,
    pub hca_ratio: usize,
    pub page_size: usize,
    /// The kv row format and its bytes per row.
    pub kv_rows: String,
    /// The indexer row format and its bytes per row.
    pub index_rows: String,
    /// Bytes of one unit of every pool, by pool name.
    pub unit_bytes: Vec<(String, usize)>,
}

impl LayoutFingerprint {
    /// `field: ours vs theirs` for every field that differs.
    pub fn differences(&self, other: &Self) -> Vec<String> {
        let mut out = Vec::new();
        let mut cmp = |name: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{name}: {a} vs {b}"));
            }
        };
        cmp("model", self.model.clone(), other.model.clone());
        cmp("layers", self.layers.clone(), other.layers.clone());
        cmp(
            "mtp_layers",
            self.mtp_layers.to_string(),
            other.mtp_layers.to_string(),
        );
        cmp(
            "head_dim",
            self.head_dim.to_string(),
            other.head_dim.to_string(),
        );
        cmp(
            "index_dim",
            self.index_dim.to_string(),
            other.index_dim.to_string(),
        );
        cmp("window", self.window.to_string(), other.window.to_string());
        cmp(
            "csa_ratio",
            self.csa_ratio.to_string(),
            other.csa_ratio.to_string(),
        );
        cmp(
            "hca_ratio",
            self.hca_ratio.to_string(),
            other.hca_ratio.to_string(),
        );
        cmp(
            "page_size",
            self.page_size.to_string(),
            other.page_size.to_string(),
        );
        cmp("kv rows", self.kv_rows.clone(), other.kv_rows.clone());
        cmp(
            "indexer rows",
            self.index_rows.clone(),
            other.index_rows.clone(),
        );
        cmp(
            "unit bytes",
            units(&self.unit_bytes),
            units(&other.unit_bytes),
        );
        out
    }
}

fn units(list: &[(String, usize)]) -> String {
    list.iter()
        .map(|(n, b)| format!("{n}={b}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl fmt::Display for LayoutFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model `{}` (layers {} + {} MTP, head_dim {}, index_dim {}, window {}, ratios {}/{}), \
             page_size {}, kv rows {}, indexer rows {}, unit bytes {}",
            self.model,
            self.layers,
            self.mtp_layers,
            self.head_dim,
            self.index_dim,
            self.window,
            self.csa_ratio,
            self.hca_ratio,
            self.page_size,
            self.kv_rows,
            self.index_rows,
            units(&self.unit_bytes)
        )
    }
}

/// One sequence's state: where its bytes are (in the pools it was exported from) and the
/// scalars that go with them.
///
/// The regions point into the source pools by offset and stay valid while the source
/// sequence is alive and not stepped; [`read`] copies them. The struct is serde-serializable
/// (a transfer sends it ahead of the bytes); [`import`] checks it against the destination.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SequenceState {
    /// The layout the bytes are in.
    pub layout: LayoutFingerprint,
    /// Tokens processed: the position of the next token.
    pub position: usize,
    /// The last token fed (or sampled and not yet fed), filled by the caller: the KV pools do
    /// not keep token ids.
    pub last_token: Option<u32>,
    /// The sampler's RNG state, filled by the caller (the engine owns the sampler).
    pub rng: Option<u64>,
    /// Pages the sequence holds for its `position` tokens (what an import allocates).
    pub pages: usize,
    /// The source units: its slot and the first `pages` pages of its page table.
    pub source_slot: u32,
    pub source_pages: Vec<PageId>,
    /// The byte regions, in the order [`read`] concatenates them.
    pub regions: Vec<Region>,
}

impl SequenceState {
    /// Bytes of all regions together (the length [`read`] returns and [`import`] takes).
    pub fn byte_len(&self) -> usize {
        // Saturating: an altered state must not overflow (its length is then refused).
        self.regions
            .iter()
            .fold(0usize, |n, r| n.saturating_add(r.len))
    }
}

/// The regions of the sequence at `position` in slot `slot` with page table `pages`
/// (`pages.len() >= pages_for(position)`), in export order.
fn regions(layout: &KvLayout, slot: u32, pages: &[PageId], position: usize) -> Vec<Region> {
    tagged_regions(layout, slot, pages, position)
        .into_iter()
        .map(|(r, _)| r)
        .collect()
}

/// [`regions`], each whole-page region tagged with its index in the page table.
fn tagged_regions(
    layout: &KvLayout,
    slot: u32,
    pages: &[PageId],
    position: usize,
) -> Vec<(Region, Option<usize>)> {
    // A page per pool for three paged pools, a partial page per layer, the rings and states:
    // reserved at once (a long prompt's ~200 regions otherwise reallocate ~8 times).
    let mut out = Vec::with_capacity(
        3 * pages.len()
            + 2 * layout.count(AttentionKind::Csa)
            + layout.count(AttentionKind::Hca)
            + layout.swa_layers()
            + 4,
    );
    let mut push_tagged = |pool, offset, len, page| {
        if len > 0 {
            out.push((
                Region {
                    pool,
                    tier: RegionTier::Device,
                    offset,
                    len,
                },
                page,
            ))
        }
    };
    for (pool, kind, ratio, row) in [
        (
            PoolId::C4Kv,
            AttentionKind::Csa,
            layout.csa_ratio,
            layout.kv_row_bytes(),
        ),
        (
            PoolId::C4Indexer,
            AttentionKind::Csa,
            layout.csa_ratio,
            layout.index_row_bytes(),
        ),
        (
            PoolId::C128Kv,
            AttentionKind::Hca,
            layout.hca_ratio,
            layout.kv_row_bytes(),
        ),
    ] {
        let (unit, layers) = (layout.unit_bytes(pool), layout.count(kind));
        if unit == 0 || layers == 0 {
            continue;
        }
        let per_page = layout.page_size / ratio;
        let closed = position / ratio;
        let (full, partial) = (closed / per_page, closed % per_page);
        for (k, &page) in pages[..full].iter().enumerate() {
            push_tagged(pool, page.index() * unit, unit, Some(k));
        }
        if partial > 0 {
            let base = pages[full].index() * unit;
            for j in 0..layers {
                push_tagged(pool, base + j * per_page * row, partial * row, None);
            }
        }
    }
    let swa = layout.unit_bytes(PoolId::Swa);
    if position >= layout.window {
        push_tagged(PoolId::Swa, slot as usize * swa, swa, None);
    } else {
        for l in 0..layout.swa_layers() {
            let ring = layout.ring::<[u32]>(slot, l);
            push_tagged(PoolId::Swa, ring.offset, position * ring.row_bytes, None);
        }
    }
    for pool in [PoolId::C4State, PoolId::C4IndexerState, PoolId::C128State] {
        let unit = layout.unit_bytes(pool);
        push_tagged(pool, slot as usize * unit, unit, None);
    }
    out
}

/// Pieces of a state's bytes, each at its offset in the whole ([`read`]'s order).
pub type Pieces = Vec<(usize, Vec<u8>)>;

/// Bytes of `seq`'s complete pages, page-table indices `from..` up to the pages complete now,
/// each with its offset in the bytes of the state the sequence will have at `final_position`
/// ([`read`]'s order), and how many pages are complete now. A page is complete once the
/// sequence is past its last token: no row of it changes after that (the prefix cache shares
/// such pages for the same reason). What a PD prefill sends while the rest of the prompt is
/// still computing.
pub fn complete_pages<B: Backend>(
    pools: &KvPools<B>,
    seq: &SeqKv,
    final_position: usize,
    from: usize,
) -> Result<(Pieces, usize)> {
    let layout = pools.layout();
    let done = (seq.position().min(final_position) / layout.page_size).min(seq.pages().len());
    if done <= from {
        return Ok((Vec::new(), done));
    }
    // The final state's page table: the pages held now, then placeholders for the pages the
    // rest of the prompt takes (only the offsets of the regions before them matter here).
    let mut pages = seq.pages().to_vec();
    pages.resize(pools.pages_for(final_position).max(pages.len()), PageId(0));
    let mut at = 0;
    let mut out = Vec::new();
    for (r, page) in tagged_regions(layout, seq.slot(), &pages, final_position) {
        if page.is_some_and(|k| (from..done).contains(&k)) {
            let mut bytes = vec![0; r.len];
            pools.read_bytes(r.pool, r.offset, &mut bytes)?;
            out.push((at, bytes));
        }
        at += r.len;
    }
    Ok((out, done))
}

/// The state of `seq` in `pools`: its regions and position. Copies nothing; `last_token` and
/// `rng` are left for the caller to fill.
pub fn export<B: Backend>(pools: &KvPools<B>, seq: &SeqKv) -> SequenceState {
    let layout = pools.layout();
    let pages = pools.pages_for(seq.position());
    SequenceState {
        layout: layout.fingerprint().clone(),
        position: seq.position(),
        last_token: None,
        rng: None,
        pages,
        source_slot: seq.slot(),
        source_pages: seq.pages()[..pages].to_vec(),
        regions: regions(layout, seq.slot(), seq.pages(), seq.position()),
    }
}

fn check_layout(ours: &LayoutFingerprint, theirs: &LayoutFingerprint, what: &str) -> Result<()> {
    if ours == theirs {
        return Ok(());
    }
    Err(Error::invalid_argument(format!(
        "{what}: the sequence state's layout differs from these pools' ({}). State: {theirs}. \
         Pools: {ours}. Exchange sequences only between pools built from the same model with \
         the same kv.page_size, kv.dtype and kv.indexer_dtype",
        theirs.differences(ours).join("; ")
    )))
}

/// Copies the bytes of `state`'s regions out of `pools` (the pools it was exported from,
/// its sequence still alive and not stepped since) into `out`, in region order.
pub fn read_into<B: Backend>(
    pools: &KvPools<B>,
    state: &SequenceState,
    out: &mut [u8],
) -> Result<()> {
    check_layout(
        pools.layout().fingerprint(),
        &state.layout,
        "reading a sequence state",
    )?;
    if out.len() != state.byte_len() {
        return Err(Error::invalid_argument(format!(
            "reading a sequence state of {} bytes into a buffer of {}: pass a buffer of \
             SequenceState::byte_len() bytes",
            state.byte_len(),
            out.len()
        )));
    }
    let (slots, page_alloc) = (pools.slot_allocator(), pools.page_allocator());
    if !slots.is_held(state.source_slot)
        || !state.source_pages.iter().all(|&p| page_alloc.is_held(p))
    {
        return Err(Error::invalid_argument(format!(
            "the sequence state points at slot {} and pages {:?}, which are no longer in use in \
             these pools: read the state before the sequence is closed",
            state.source_slot, state.source_pages
        )));
    }
    if state.regions.iter().any(|r| r.tier != RegionTier::Device) {
        return Err(Error::invalid_argument(
            "the sequence state has host-tier regions: read them from the host tier",
        ));
    }
    // Only the regions `export` lists for these units are read (an altered list could point
    // anywhere).
    if state.source_pages.len() != pools.pages_for(state.position)
        || regions(
            pools.layout(),
            state.source_slot,
            &state.source_pages,
            state.position,
        ) != state.regions
    {
        return Err(Error::invalid_argument(format!(
            "the sequence state's regions are not the ones its sequence (slot {}, {} pages, \
             position {}) has in these pools: the state was altered; export it again",
            state.source_slot,
            state.source_pages.len(),
            state.position
        )));
    }
    let mut at = 0;
    for r in &state.regions {
        pools.read_bytes(r.pool, r.offset, &mut out[at..at + r.len])?;
        at += r.len;
    }
    Ok(())
}

/// The bytes of `state`'s regions, concatenated in region order.
pub fn read<B: Backend>(pools: &KvPools<B>, state: &SequenceState) -> Result<Vec<u8>> {
    let mut out = vec![0; state.byte_len()];
    read_into(pools, state, &mut out)?;
    Ok(out)
}

/// Rebuilds the sequence of `state` in `pools` from its `bytes` ([`read`]'s output): takes a
/// fresh slot and pages, writes every region and returns the sequence at `state.position`,
/// ready to step. Refuses — taking nothing — a state of another layout or inconsistent with
/// its own (`DSV4_ERR_INVALID_ARGUMENT`), bytes of the wrong length (same), and too few free
/// slots or pages (`DSV4_ERR_CAPACITY`).
pub fn import<B: Backend>(
    pools: &mut KvPools<B>,
    state: &SequenceState,
    bytes: &[u8],
) -> Result<SeqKv> {
    let pages = check_import(pools, state, bytes)?;
    let seq = open_destination(pools, state.position, pages)?;
    if let Err(e) = write_regions(pools, &seq, bytes) {
        // Refused: nothing taken.
        pools.close(seq);
        return Err(e);
    }
    Ok(seq)
}

/// A fresh slot and `pages` pages for a sequence at `position` whose state arrives later
/// ([`write_arrival`]): a PD decode engine reserves its destination before the bytes come.
pub fn open_destination<B: Backend>(
    pools: &mut KvPools<B>,
    position: usize,
    pages: usize,
) -> Result<SeqKv> {
    pools.open_at(position, pages).map_err(|e| {
        Error::new(
            ErrorKind::Capacity,
            format!("importing a sequence: {}", e.message()),
        )
    })
}

/// Bytes a state at `position` holds in this layout (what a destination reserved for it
/// receives).
pub fn byte_len_at<B: Backend>(pools: &KvPools<B>, position: usize) -> usize {
    let pages = vec![PageId(0); pools.pages_for(position)];
    regions(pools.layout(), 0, &pages, position)
        .iter()
        .map(|r| r.len)
        .sum()
}

/// Checks that an arrived state (from a peer whose layout was checked to equal these pools')
/// of `bytes` bytes for `position` tokens in `pages` pages fits `seq`, the destination
/// [`open_destination`] reserved for it: same position, same pages, and exactly the bytes
/// this layout holds at that position.
pub fn check_arrival<B: Backend>(
    pools: &KvPools<B>,
    position: usize,
    pages: usize,
    bytes: usize,
    seq: &SeqKv,
) -> Result<()> {
    if seq.position() != position
        || seq.pages().len() != pages
        || pools.pages_for(position) != pages
    {
        return Err(Error::invalid_argument(format!(
            "the destination was reserved for {} tokens in {} pages but the state covers \
             {position} tokens in {pages}",
            seq.position(),
            seq.pages().len(),
        )));
    }
    let expect = byte_len_at(pools, position);
    if bytes != expect {
        return Err(Error::invalid_argument(format!(
            "the state holds {bytes} bytes but {position} tokens hold {expect} in this layout"
        )));
    }
    Ok(())
}

/// [`check_arrival`], then writes the state's `bytes` (in region order) into `seq`.
pub fn write_arrival<B: Backend>(
    pools: &mut KvPools<B>,
    position: usize,
    pages: usize,
    bytes: &[u8],
    seq: &SeqKv,
) -> Result<()> {
    check_arrival(pools, position, pages, bytes.len(), seq)?;
    write_regions(pools, seq, bytes)
}

/// Where `seq`'s state bytes live, in region order: one absolute `(address, length)` per
/// region, for a receiver that writes a state straight into its destination. `None` when the
/// pools are not host memory (a GPU backend: the bytes go through [`write_arrival`]).
pub fn landing_spans<B: Backend>(pools: &KvPools<B>, seq: &SeqKv) -> Option<Vec<(u64, usize)>> {
    if !pools.backend().buffers_in_host_memory() {
        return None;
    }
    let whole = pools.regions();
    regions(pools.layout(), seq.slot(), seq.pages(), seq.position())
        .iter()
        .map(|r| r.locate(&whole).ok())
        .collect()
}

fn write_regions<B: Backend>(pools: &mut KvPools<B>, seq: &SeqKv, bytes: &[u8]) -> Result<()> {
    let dest = regions(pools.layout(), seq.slot(), seq.pages(), seq.position());
    let mut at = 0;
    for r in &dest {
        pools.write_bytes(r.pool, r.offset, &bytes[at..at + r.len])?;
        at += r.len;
    }
    debug_assert_eq!(at, bytes.len());
    Ok(())
}

/// Everything [`import`] checks before it takes units: the layout, the state's consistency and
/// the byte length. Returns the pages the import needs.
pub fn check_import<B: Backend>(
    pools: &KvPools<B>,
    state: &SequenceState,
    bytes: &[u8],
) -> Result<usize> {
    let layout = pools.layout();
    check_layout(layout.fingerprint(), &state.layout, "importing a sequence")?;
    let pages = pools.pages_for(state.position);
    let capacity = pools.page_allocator().capacity();
    if pages > capacity {
        return Err(Error::new(
            ErrorKind::Capacity,
            format!(
                "a sequence of {} tokens needs {pages} KV pages of {} tokens but these pools \
                 have {capacity}: raise kv.device_memory_bytes",
                state.position,
                pools.page_size()
            ),
        ));
    }
    if state.pages != pages || state.source_pages.len() != pages {
        return Err(Error::invalid_argument(format!(
            "the sequence state says {} pages ({} listed) but {} tokens need {pages}: the state \
             was altered; export it again",
            state.pages,
            state.source_pages.len(),
            state.position
        )));
    }
    if bytes.len() != state.byte_len() {
        return Err(Error::invalid_argument(format!(
            "the sequence state holds {} bytes but {} were given: pass exactly what `read` \
             returned for this state",
            state.byte_len(),
            bytes.len()
        )));
    }
    // The destination's regions have the same lengths in the same order (same layout, same
    // position); only the offsets differ. Checked before anything is taken.
    let expected = regions(layout, 0, &vec![PageId(0); pages], state.position);
    let same_shape = expected.len() == state.regions.len()
        && expected
            .iter()
            .zip(&state.regions)
            .all(|(a, b)| a.pool == b.pool && a.len == b.len);
    if !same_shape {
        return Err(Error::invalid_argument(format!(
            "the sequence state's {} regions do not match the {} this layout has for {} tokens: \
             the state was altered or made by another version; export it again",
            state.regions.len(),
            expected.len(),
            state.position
        )));
    }
    Ok(pages)
}
