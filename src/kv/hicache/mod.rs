//! HiCache: the host tier of the paged pools and of the snapshot pool. Host pools mirror the
//! device pools unit for unit (same unit sizes, units from the plan's `host_units`), live on the
//! GPU's NUMA node (or `hicache.numa_node`), and exchange whole pages and snapshots with the
//! device through the backend's asynchronous tier copies.

pub mod host;

use std::sync::Arc;

use crate::backend::{Backend, CopyDirection, Ticket, TierCopy};
use crate::error::{Error, Result};
use crate::plan::Plan;

use super::ids::{HostPageId, HostSnapshotId, PageId, SnapshotId, UnitId};
use super::layout::PoolId;
use super::pools::KvPools;
use super::regions::{self, PoolRegion};
use super::state::RegionTier;
use super::units::UnitAllocator;
pub use host::{AllocReport, HostMemory};

/// The pools with a host tier: the three paged pools (one host page id across them) and the
/// snapshots.
pub const MIRRORED: [PoolId; 4] = [
    PoolId::C4Kv,
    PoolId::C4Indexer,
    PoolId::C128Kv,
    PoolId::Snapshots,
];

/// The host tier of one engine.
pub struct HostPools {
    /// One allocation per mirrored pool (`MIRRORED` order).
    memory: Vec<HostMemory>,
    unit_bytes: [usize; 4],
    pages: UnitAllocator<HostPageId>,
    snapshots: UnitAllocator<HostSnapshotId>,
    reports: Vec<AllocReport>,
}

impl HostPools {
    /// Allocates the host pools the plan sizes, on the plan's NUMA node, pre-touched by
    /// `threads` threads, and registers them with the backend (pinning on CUDA).
    pub fn new<B: Backend>(plan: &Plan, backend: &B, threads: usize) -> Result<Self> {
        let node = plan.numa.node.as_ref().map(|n| n.index);
        let mut memory = Vec::new();
        let mut reports = Vec::new();
        let mut unit_bytes = [0usize; 4];
        let mut units = [0usize; 4];
        for (i, id) in MIRRORED.iter().enumerate() {
            let pool = plan
                .pool(*id)
                .ok_or_else(|| Error::internal(format!("the plan has no `{}` pool", id.name())))?;
            unit_bytes[i] = pool.shape.unit_bytes as usize;
            units[i] = pool.host_units as usize;
            let bytes = unit_bytes[i] * units[i];
            let (mem, report) = HostMemory::allocate(bytes, node, threads)?;
            backend.register_host(mem.ptr_at(0), bytes)?;
            log::info!(
                "HiCache host pool `{}`: {} units, {bytes} bytes on NUMA node {} in {:.3} s ({:.2} GiB/s with pre-touch)",
                id.name(),
                units[i],
                report.bound_node.map_or("(first touch)".to_string(), |n| n.to_string()),
                report.seconds,
                report.gib_per_s()
            );
            memory.push(mem);
            reports.push(report);
        }
        Ok(Self {
            memory,
            unit_bytes,
            pages: UnitAllocator::new(units[0]),
            snapshots: UnitAllocator::new(units[3]),
            reports,
        })
    }

    fn index(id: PoolId) -> usize {
        MIRRORED
            .iter()
            .position(|&m| m == id)
            .expect("a mirrored pool")
    }

    /// Bytes each host pool's allocation holds (measured from the allocations).
    pub fn allocated_bytes(&self) -> Vec<(PoolId, u64)> {
        MIRRORED
            .iter()
            .zip(&self.memory)
            .map(|(&id, m)| (id, m.len() as u64))
            .collect()
    }

    /// Every host pool's memory, one region per mirrored pool (`MIRRORED` order).
    pub fn regions(&self) -> Vec<PoolRegion> {
        MIRRORED
            .iter()
            .zip(&self.memory)
            .map(|(&pool, m)| PoolRegion {
                pool,
                tier: RegionTier::Host,
                // Exposed so that `read_mapped` may read through the published address.
                addr: m.ptr_at(0).0.expose_provenance() as u64,
                len: m.len(),
            })
            .collect()
    }

    /// Copies `out.len()` bytes at absolute address `addr` into `out` through the published
    /// address (see `KvPools::read_mapped`). Refused unless the bytes lie inside one of
    /// [`Self::regions`]; the range must not be one a tier copy is writing meanwhile.
    pub fn read_mapped(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: the regions are this tier's own allocations (`self.memory`), alive while
        // `&self` is held and initialised by the pre-touch; by the tier copy protocol nothing
        // writes a range that is being read.
        unsafe { regions::read_in_regions(&self.regions(), addr, out) }
    }

    /// How each allocation went.
    pub fn reports(&self) -> &[AllocReport] {
        &self.reports
    }

    pub fn page_allocator(&self) -> &UnitAllocator<HostPageId> {
        &self.pages
    }

    pub fn snapshot_allocator(&self) -> &UnitAllocator<HostSnapshotId> {
        &self.snapshots
    }

    pub fn page_allocator_mut(&mut self) -> &mut UnitAllocator<HostPageId> {
        &mut self.pages
    }

    pub fn snapshot_allocator_mut(&mut self) -> &mut UnitAllocator<HostSnapshotId> {
        &mut self.snapshots
    }

    /// Bytes of one host page across the paged pools.
    pub fn page_bytes(&self) -> usize {
        self.unit_bytes[..3].iter().sum()
    }

    pub fn snapshot_bytes(&self) -> usize {
        self.unit_bytes[3]
    }

    /// Queues copies of `device → host` page pairs (`direction` ToHost) or `host → device`
    /// (FromHost) onto `ticket`, one part per paged pool.
    pub fn copy_pages<B: Backend>(
        &self,
        pools: &KvPools<B>,
        direction: CopyDirection,
        pairs: &[(PageId, HostPageId)],
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        let pairs: Vec<(usize, usize)> =
            pairs.iter().map(|(d, h)| (d.index(), h.index())).collect();
        for id in [PoolId::C4Kv, PoolId::C4Indexer, PoolId::C128Kv] {
            self.copy_units(pools, id, direction, &pairs, ticket)?;
        }
        Ok(())
    }

    /// Queues snapshot copies (`(device unit, host unit)` pairs) onto `ticket`.
    pub fn copy_snapshots<B: Backend>(
        &self,
        pools: &KvPools<B>,
        direction: CopyDirection,
        pairs: &[(SnapshotId, HostSnapshotId)],
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        let pairs: Vec<(usize, usize)> =
            pairs.iter().map(|(d, h)| (d.index(), h.index())).collect();
        self.copy_units(pools, PoolId::Snapshots, direction, &pairs, ticket)
    }

    /// One copy part for pool `id`: whole units, `(device unit, host unit)` index pairs.
    fn copy_units<B: Backend>(
        &self,
        pools: &KvPools<B>,
        id: PoolId,
        direction: CopyDirection,
        pairs: &[(usize, usize)],
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        let i = Self::index(id);
        let unit = self.unit_bytes[i];
        if pairs.is_empty() || unit == 0 {
            return Ok(());
        }
        let copies = pairs
            .iter()
            .map(|&(device, host)| TierCopy {
                pool_offset: device * unit,
                host: self.memory[i].ptr_at(host * unit),
                len: unit,
            })
            .collect();
        pools
            .backend()
            .copy_tier(pools.buffer(id), direction, copies, ticket)
    }

    /// The first bytes of host unit `unit` of pool `id` (tests).
    pub fn read(&self, id: PoolId, unit: u32, out: &mut [u8]) {
        let i = Self::index(id);
        out.copy_from_slice(self.memory[i].range(unit as usize * self.unit_bytes[i], out.len()));
    }

    /// Checks the allocators' books.
    pub fn check(&self) -> std::result::Result<(), String> {
        self.pages.check().map_err(|e| format!("host pages: {e}"))?;
        self.snapshots
            .check()
            .map_err(|e| format!("host snapshots: {e}"))
    }
}
