//! The device pools of one engine and the per-request handles into them.
//!
//! [`KvPools`] owns one backend buffer per pool (sized from the plan's units), the page, slot
//! and snapshot allocators, and gives the model views of a sequence's state: its window rings,
//! compressed rows and compressor frontiers. A [`SeqKv`] is one running request: a slot, a page
//! table and a position.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::{Backend, CompressArgs, CopyRegion, Rows};
use crate::error::{Error, ErrorKind, Result};
use crate::plan::Plan;

use super::ids::{PageId, SnapshotId, UnitId};
use super::layout::{KvLayout, PoolId, Stream};
use super::units::UnitAllocator;

/// One running request's place in the pools.
#[derive(Debug)]
pub struct SeqKv {
    position: usize,
    pages: Vec<PageId>,
    slot: u32,
}

impl SeqKv {
    /// Tokens processed so far: the position of the next token.
    pub fn position(&self) -> usize {
        self.position
    }

    /// The page table: page i holds tokens `[i·P, (i+1)·P)`.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// Moves the position after a forward step (the model calls this).
    pub fn advance(&mut self, tokens: usize) {
        self.position += tokens;
    }
}

/// Every KV pool of one engine on one backend.
pub struct KvPools<B: Backend> {
    backend: Arc<B>,
    layout: KvLayout,
    buffers: Vec<B::Buffer>,
    pages: UnitAllocator<PageId>,
    slots: UnitAllocator<u32>,
    snapshots: UnitAllocator<SnapshotId>,
}

impl<B: Backend> KvPools<B> {
    /// Allocates every pool with the plan's device units. Fails (nothing kept) when the
    /// backend cannot provide the memory.
    pub fn new(backend: Arc<B>, plan: &Plan) -> Result<Self> {
        let layout = KvLayout::new(plan)?;
        let mut buffers = Vec::with_capacity(PoolId::ALL.len());
        for id in PoolId::ALL {
            let bytes = layout
                .unit_bytes(id)
                .checked_mul(layout.units(id))
                .ok_or_else(|| Error::internal("pool size overflows"))?;
            buffers.push(backend.alloc(bytes).map_err(|e| {
                Error::new(
                    ErrorKind::Capacity,
                    format!("KV pool `{}` ({bytes} bytes): {}", id.name(), e.message()),
                )
            })?);
        }
        log::info!(
            "KV pools: {} pages of {} tokens, {} slots, {} snapshots ({} bytes)",
            layout.units(PoolId::C4Kv),
            layout.page_size,
            layout.units(PoolId::Swa),
            layout.units(PoolId::Snapshots),
            buffers
                .iter()
                .map(|b| backend.buffer_bytes(b))
                .sum::<usize>()
        );
        Ok(Self {
            pages: UnitAllocator::new(layout.units(PoolId::C4Kv)),
            slots: UnitAllocator::new(layout.units(PoolId::Swa)),
            snapshots: UnitAllocator::new(layout.units(PoolId::Snapshots)),
            backend,
            layout,
            buffers,
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// `kv.prefault`: makes every pool's memory resident now, before any request, so that
    /// writing a page never waits on a first-touch fault and memory the machine cannot back
    /// fails here instead of under load.
    pub fn prefault(&mut self) -> Result<()> {
        let start = std::time::Instant::now();
        for (id, buffer) in PoolId::ALL.into_iter().zip(self.buffers.iter_mut()) {
            self.backend.prefault(buffer).map_err(|e| {
                Error::new(
                    e.kind(),
                    format!("KV pool `{}`: {}", id.name(), e.message()),
                )
            })?;
        }
        log::info!(
            "KV pools prefaulted ({} bytes) in {:.3} s",
            self.buffers
                .iter()
                .map(|b| self.backend.buffer_bytes(b))
                .sum::<usize>(),
            start.elapsed().as_secs_f64()
        );
        Ok(())
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn page_size(&self) -> usize {
        self.layout.page_size
    }

    /// Bytes each pool's allocation actually holds, measured from the buffers.
    pub fn allocated_bytes(&self) -> Vec<(PoolId, u64)> {
        PoolId::ALL
            .iter()
            .map(|&id| {
                (
                    id,
                    self.backend.buffer_bytes(&self.buffers[id.index()]) as u64,
                )
            })
            .collect()
    }

    pub fn buffer(&self, id: PoolId) -> &B::Buffer {
        &self.buffers[id.index()]
    }

    pub fn buffer_mut(&mut self, id: PoolId) -> &mut B::Buffer {
        &mut self.buffers[id.index()]
    }

    /// Copies `out.len()` bytes of pool `id` at `offset` to the host.
    pub fn read_bytes(&self, id: PoolId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.backend.read_bytes(self.buffer(id), offset, out)
    }

    /// Copies host bytes into pool `id` at `offset`.
    pub fn write_bytes(&mut self, id: PoolId, offset: usize, data: &[u8]) -> Result<()> {
        let b = Arc::clone(&self.backend);
        b.write_bytes(self.buffer_mut(id), offset, data)
    }

    pub fn page_allocator(&self) -> &UnitAllocator<PageId> {
        &self.pages
    }

    pub fn slot_allocator(&self) -> &UnitAllocator<u32> {
        &self.slots
    }

    pub fn snapshot_allocator(&self) -> &UnitAllocator<SnapshotId> {
        &self.snapshots
    }

    // --- requests -------------------------------------------------------------------------

    /// A new request at position 0 with a slot and no pages.
    pub fn open(&mut self) -> Result<SeqKv> {
        let slot = self.slots.alloc(1).ok_or_else(|| {
            Error::new(
                ErrorKind::Capacity,
                format!(
                    "all {} request slots are in use: wait for a request to finish or raise \
                     kv.max_running_requests",
                    self.slots.capacity()
                ),
            )
        })?[0];
        Ok(SeqKv {
            position: 0,
            pages: Vec::new(),
            slot,
        })
    }

    /// A request at `position` with a fresh slot and `pages` fresh pages (a sequence being
    /// imported): all of them, or `DSV4_ERR_CAPACITY` naming what was short and nothing taken.
    pub(super) fn open_at(&mut self, position: usize, pages: usize) -> Result<SeqKv> {
        let mut seq = self.open()?;
        match self.pages.alloc(pages) {
            Some(p) => seq.pages = p,
            None => {
                let (free, capacity) = (self.pages.free_count(), self.pages.capacity());
                self.close(seq);
                return Err(Error::new(
                    ErrorKind::Capacity,
                    format!(
                        "a sequence of {position} tokens needs {pages} KV pages of {} tokens \
                         but {free} of {capacity} are free: free pages (finish or evict \
                         requests) or raise kv.device_memory_bytes",
                        self.layout.page_size
                    ),
                ));
            }
        }
        seq.position = position;
        Ok(seq)
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.layout.page_size)
    }

    /// Makes `seq` hold pages for its first `tokens` tokens: all the missing pages, or none
    /// (`DSV4_ERR_CAPACITY`, naming how many were missing).
    pub fn reserve(&mut self, seq: &mut SeqKv, tokens: usize) -> Result<()> {
        let missing = self.pages_for(tokens).saturating_sub(seq.pages.len());
        if missing == 0 {
            return Ok(());
        }
        let pages = self.pages.alloc(missing).ok_or_else(|| {
            Error::new(
                ErrorKind::Capacity,
                format!(
                    "{tokens} tokens need {missing} more KV pages of {} tokens but {} of {} are \
                     free: shorten the request or raise kv.device_memory_bytes",
                    self.layout.page_size,
                    self.pages.free_count(),
                    self.pages.capacity()
                ),
            )
        })?;
        seq.pages.extend(pages);
        Ok(())
    }

    /// Starts `seq` on shared pages (a prefix-cache hit): one more reference on each.
    pub fn share_pages(&mut self, seq: &mut SeqKv, pages: &[PageId]) {
        assert!(
            seq.pages.is_empty(),
            "shared pages go first in a page table"
        );
        for &p in pages {
            self.pages.retain(p);
        }
        seq.pages.extend_from_slice(pages);
    }

    /// Sets the position of a sequence resumed from a snapshot.
    pub fn set_position(&mut self, seq: &mut SeqKv, position: usize) {
        debug_assert!(position <= seq.pages.len() * self.layout.page_size);
        seq.position = position;
    }

    /// Ends a request: its references on pages and its slot go back.
    pub fn close(&mut self, seq: SeqKv) {
        for p in seq.pages {
            self.pages.release(p);
        }
        self.slots.release(seq.slot);
    }

    /// `n` free pages (one reference each, owned by the caller), or None and nothing taken.
    pub fn alloc_pages(&mut self, n: usize) -> Option<Vec<PageId>> {
        self.pages.alloc(n)
    }

    pub fn retain_page(&mut self, page: PageId) {
        self.pages.retain(page);
    }

    pub fn release_page(&mut self, page: PageId) -> bool {
        self.pages.release(page)
    }

    // --- what a forward step reads and writes -------------------------------------------------

    /// Layer `l`'s window ring.
    pub fn ring(&self, seq: &SeqKv, l: usize) -> Rows<'_, B> {
        Rows {
            buffer: self.buffer(PoolId::Swa),
            layout: self.layout.ring(seq.slot, l),
            count: self.layout.window,
        }
    }

    /// Stores rows `rows` of `kv` (tokens from `start` on) in layer `l`'s window ring.
    pub fn write_window(
        &mut self,
        seq: &SeqKv,
        l: usize,
        kv: &B::Tensor,
        rows: Range<usize>,
        start: usize,
    ) -> Result<()> {
        // Only the last `window` tokens survive; earlier ones would be overwritten anyway.
        let skip = rows.len().saturating_sub(self.layout.window);
        let layout = self.layout.ring(seq.slot, l);
        let b = Arc::clone(&self.backend);
        b.write_rows(
            self.buffer_mut(PoolId::Swa),
            &layout,
            start + skip,
            kv,
            rows.start + skip..rows.end,
        )
    }

    /// `seq`'s page table on the backend: uploaded once per step, read by every layer's row
    /// accesses ([`Self::rows`], [`Self::write_rows`]).
    pub fn page_table(&self, seq: &SeqKv) -> Result<B::Index> {
        // The one place page ids become the backend's raw indices. Unit indices are far below
        // i32::MAX (the plan caps unit counts).
        let ids: Vec<i32> = seq.pages.iter().map(|&p| p.get() as i32).collect();
        self.backend.index(&ids)
    }

    /// The first `count` compressed rows of layer `l` (`None` for window-only layers), through
    /// `table`, the sequence's [`Self::page_table`].
    pub fn rows<'a>(
        &'a self,
        table: &'a B::Index,
        l: usize,
        stream: Stream,
        count: usize,
    ) -> Option<Rows<'a, B>> {
        let (pool, _, layout) = self.layout.rows(table, l, stream)?;
        Some(Rows {
            buffer: self.buffer(pool),
            layout,
            count,
        })
    }

    /// Stores finished rows `first..first + count` of layer `l` through `table`, the
    /// sequence's [`Self::page_table`].
    #[allow(clippy::too_many_arguments)]
    pub fn write_rows(
        &mut self,
        seq: &SeqKv,
        table: &B::Index,
        l: usize,
        stream: Stream,
        first: usize,
        x: &B::Tensor,
        count: usize,
    ) -> Result<()> {
        let (pool, ratio, layout) = self
            .layout
            .rows(table, l, stream)
            .expect("rows written to a layer without that compressor");
        assert!(
            (first + count) * ratio <= seq.pages.len() * self.layout.page_size,
            "rows written past the reserved pages"
        );
        let b = Arc::clone(&self.backend);
        b.write_rows(&mut self.buffers[pool.index()], &layout, first, x, 0..count)
    }

    /// Advances a compressor of layer `l` by the step's rows; returns the pooled rows of the
    /// windows closed (not normed or roped), their count and the index of the first.
    pub fn compress(
        &mut self,
        seq: &SeqKv,
        l: usize,
        stream: Stream,
        args: &CompressArgs<'_, B>,
    ) -> Result<(B::Tensor, usize, usize)> {
        let f = self
            .layout
            .frontier(seq.slot, l, stream)
            .expect("compress called on a layer without that compressor");
        let first = args.start_pos / f.ratio;
        let b = Arc::clone(&self.backend);
        let (rows, count) = b.compress(&mut self.buffers[f.pool.index()], f.offset, args)?;
        Ok((rows, count, first))
    }

    // --- snapshots -------------------------------------------------------------------------

    fn check_boundary(&self, seq: &SeqKv) -> Result<()> {
        if seq.position == 0 || !seq.position.is_multiple_of(self.layout.page_size) {
            return Err(Error::internal(format!(
                "snapshot at position {}: snapshots are taken at page boundaries ({} tokens)",
                seq.position, self.layout.page_size
            )));
        }
        Ok(())
    }

    /// A new snapshot of `seq`'s fixed state (at a page boundary), or `None` when every
    /// snapshot unit is taken.
    pub fn capture(&mut self, seq: &SeqKv) -> Result<Option<SnapshotId>> {
        self.check_boundary(seq)?;
        let Some(units) = self.snapshots.alloc(1) else {
            return Ok(None);
        };
        self.capture_into(seq, units[0])?;
        Ok(Some(units[0]))
    }

    /// Overwrites snapshot `snap` (held by the caller) with `seq`'s fixed state.
    pub fn capture_into(&mut self, seq: &SeqKv, snap: SnapshotId) -> Result<()> {
        self.check_boundary(seq)?;
        let regions = self.layout.snapshot_regions(seq.slot, snap);
        let b = Arc::clone(&self.backend);
        let (dst, srcs) = split_snapshots(&mut self.buffers);
        for id in [PoolId::Swa, PoolId::C4State, PoolId::C4IndexerState] {
            let list: Vec<CopyRegion> = regions
                .iter()
                .filter(|r| r.0 == id)
                .map(|&(_, src, dst, len)| CopyRegion { src, dst, len })
                .collect();
            if !list.is_empty() {
                b.copy_regions(&srcs[id.index()], dst, &list)?;
            }
        }
        Ok(())
    }

    /// Puts snapshot `snap` into `seq`'s slot.
    pub fn restore(&mut self, seq: &SeqKv, snap: SnapshotId) -> Result<()> {
        let regions = self.layout.snapshot_regions(seq.slot, snap);
        let b = Arc::clone(&self.backend);
        let (snapshots, slots) = split_snapshots(&mut self.buffers);
        for id in [PoolId::Swa, PoolId::C4State, PoolId::C4IndexerState] {
            let list: Vec<CopyRegion> = regions
                .iter()
                .filter(|r| r.0 == id)
                .map(|&(_, slot, snap, len)| CopyRegion {
                    src: snap,
                    dst: slot,
                    len,
                })
                .collect();
            if !list.is_empty() {
                b.copy_regions(snapshots, &mut slots[id.index()], &list)?;
            }
        }
        Ok(())
    }

    pub fn alloc_snapshot(&mut self) -> Option<SnapshotId> {
        self.snapshots.alloc(1).map(|s| s[0])
    }

    pub fn retain_snapshot(&mut self, snap: SnapshotId) {
        self.snapshots.retain(snap);
    }

    pub fn release_snapshot(&mut self, snap: SnapshotId) -> bool {
        self.snapshots.release(snap)
    }

    /// The bytes of snapshot `snap`.
    pub fn snapshot_bytes(&self, snap: SnapshotId) -> Result<Vec<u8>> {
        let unit = self.layout.unit_bytes(PoolId::Snapshots);
        let mut out = vec![0; unit];
        self.backend.read_bytes(
            self.buffer(PoolId::Snapshots),
            snap.index() * unit,
            &mut out,
        )?;
        Ok(out)
    }

    /// The bytes a snapshot of `seq` would hold now, read straight from its slot.
    pub fn fixed_state_bytes(&self, seq: &SeqKv) -> Result<Vec<u8>> {
        let regions = self.layout.snapshot_regions(seq.slot, SnapshotId(0));
        let mut out = vec![0; self.layout.unit_bytes(PoolId::Snapshots)];
        for (pool, src, dst, len) in regions {
            self.backend
                .read_bytes(self.buffer(pool), src, &mut out[dst..dst + len])?;
        }
        Ok(out)
    }

    /// Checks every allocator's books (for tests and debug builds).
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pages.check().map_err(|e| format!("pages: {e}"))?;
        self.slots.check().map_err(|e| format!("slots: {e}"))?;
        self.snapshots
            .check()
            .map_err(|e| format!("snapshots: {e}"))
    }
}

/// The snapshot pool mutably, and every other pool.
fn split_snapshots<T>(buffers: &mut [T]) -> (&mut T, &mut [T]) {
    let (rest, last) = buffers.split_at_mut(PoolId::Snapshots.index());
    (&mut last[0], rest)
}
