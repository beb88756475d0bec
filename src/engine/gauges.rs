//! The gauges and cache counters `Engine::metrics` reads without waiting for the engine
//! thread, refreshed between steps (and before a terminal event, so a host reading metrics on it
//! sees the request gone).

use super::metrics::{PoolGauges, Units};
use super::phase::Phase;
use super::worker::Worker;
use crate::backend::Backend;
use crate::kv::layout::PoolId;

impl<B: Backend> Worker<B> {
    /// Gauges and cache counters for `Engine::metrics`, refreshed between steps.
    pub(super) fn publish(&self) {
        let pools = self.cache.pools();
        let layout = pools.layout();
        let bytes = |ids: &[PoolId]| ids.iter().map(|&id| layout.unit_bytes(id) as u64).sum();
        let page_bytes: u64 = bytes(&[PoolId::C4Kv, PoolId::C4Indexer, PoolId::C128Kv]);
        let slot_bytes: u64 = bytes(&[
            PoolId::Swa,
            PoolId::C4State,
            PoolId::C4IndexerState,
            PoolId::C128State,
        ]);
        let snap_bytes: u64 = bytes(&[PoolId::Snapshots]);
        let units = |a: &dyn crate::kv::units::UnitCounts, unit: u64| Units {
            used: a.used_count() as u64,
            total: a.capacity() as u64,
            used_bytes: a.used_count() as u64 * unit,
            total_bytes: a.capacity() as u64 * unit,
        };
        let mut gauges = PoolGauges {
            device_pages: units(pools.page_allocator(), page_bytes),
            device_slots: units(pools.slot_allocator(), slot_bytes),
            device_snapshots: units(pools.snapshot_allocator(), snap_bytes),
            ..PoolGauges::default()
        };
        if let Some(h) = self.cache.host_pools() {
            gauges.host_pages = units(h.page_allocator(), page_bytes);
            gauges.host_snapshots = units(h.snapshot_allocator(), snap_bytes);
        }
        let (running, loading) = self.sched.running_counts();
        let (running, loading) = (running as u64, loading as u64);
        let cache = self.cache.stats();
        let pages_held: usize = self
            .sched
            .running
            .iter()
            .filter(|r| matches!(r.phase(), Phase::Transferring | Phase::Receiving))
            .map(|r| r.req.kv().pages().len())
            .sum::<usize>()
            + self
                .parked
                .values()
                .map(|req| req.kv().pages().len())
                .sum::<usize>();
        self.shared.metrics.update(|m| {
            m.pd.pages_held = pages_held as u64;
            m.running = running;
            m.loading = loading;
            m.pools = gauges;
            m.cache = cache;
        });
    }
}
