//! HiCache: the host tier of the paged pools and of the snapshot pool. Host pools mirror the
//! device pools unit for unit (same unit sizes, units from the plan's `host_units`), live on the
//! GPU's NUMA node (or `hicache.numa_node`), and exchange whole pages and snapshots with the
//! device through the backend's asynchronous tier copies.

pub mod host;

use std::sync::Arc;

use crate::backend::{Backend, CopyDirection, Ticket, TierCopy};
use crate::error::{Error, Result};
use crate::plan::Plan;

use super::layout::PoolId;
use super::pools::KvPools;
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
    pages: UnitAllocator,
    snapshots: UnitAllocator,
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
                .pool(id.name())
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
    pub fn allocated_bytes(&self) -> Vec<(&'static str, u64)> {
        MIRRORED
            .iter()
            .zip(&self.memory)
            .map(|(id, m)| (id.name(), m.len() as u64))
            .collect()
    }

    /// How each allocation went.
    pub fn reports(&self) -> &[AllocReport] {
        &self.reports
    }

    pub fn page_allocator(&self) -> &UnitAllocator {
        &self.pages
    }

    pub fn snapshot_allocator(&self) -> &UnitAllocator {
        &self.snapshots
    }

    pub fn page_allocator_mut(&mut self) -> &mut UnitAllocator {
        &mut self.pages
    }

    pub fn snapshot_allocator_mut(&mut self) -> &mut UnitAllocator {
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
        pairs: &[(u32, u32)],
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        for id in [PoolId::C4Kv, PoolId::C4Indexer, PoolId::C128Kv] {
            self.copy_units(pools, id, direction, pairs, ticket)?;
        }
        Ok(())
    }

    /// Queues snapshot copies (`(device unit, host unit)` pairs) onto `ticket`.
    pub fn copy_snapshots<B: Backend>(
        &self,
        pools: &KvPools<B>,
        direction: CopyDirection,
        pairs: &[(u32, u32)],
        ticket: &Arc<Ticket>,
    ) -> Result<()> {
        self.copy_units(pools, PoolId::Snapshots, direction, pairs, ticket)
    }

    /// One copy part for pool `id`: whole units, `(device unit, host unit)` pairs.
    fn copy_units<B: Backend>(
        &self,
        pools: &KvPools<B>,
        id: PoolId,
        direction: CopyDirection,
        pairs: &[(u32, u32)],
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
                pool_offset: device as usize * unit,
                host: self.memory[i].ptr_at(host as usize * unit),
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
