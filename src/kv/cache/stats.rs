//! Counters since creation ([`CacheStats`]) and the JSON report of pools, tree and counters
//! (`dsv4_cache_stats`; field names are part of the C API's documented output).

use serde_json::{json, Value};

use crate::backend::Backend;

use super::PrefixCache;
use crate::kv::layout::PoolId;
use crate::kv::units::UnitCounts;

/// Cache counters since creation.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct CacheStats {
    pub requests: u64,
    pub hits: u64,
    pub reused_tokens: u64,
    pub device_hits: u64,
    pub device_hit_tokens: u64,
    pub host_hits: u64,
    pub host_hit_tokens: u64,
    pub snapshots_taken: u64,
    /// Snapshot points skipped because no snapshot unit could be freed.
    pub snapshots_skipped: u64,
    pub loadbacks: u64,
    pub loadback_tokens: u64,
    pub loadback_bytes: u64,
    pub loadback_seconds: f64,
    /// Host hits served as misses because device pages for the load could not be found.
    pub loadbacks_skipped: u64,
    pub backups: u64,
    pub backup_tokens: u64,
    pub backup_bytes: u64,
    pub backup_seconds: f64,
    /// Backups not made because the host tier had no room.
    pub backups_skipped: u64,
    /// Device evictions that kept a host copy (made earlier, or written back just then).
    pub evicted_to_host: u64,
    /// Device evictions that dropped the prefix (no host copy).
    pub evicted_dropped: u64,
    pub evicted_pages: u64,
    pub evicted_snapshots: u64,
    /// Host copies dropped to make room or by a flush.
    pub host_evictions: u64,
    pub host_evicted_pages: u64,
}

impl<B: Backend> PrefixCache<B> {
    /// Per pool and tier: used / total units and bytes; the counters; the policy.
    pub fn stats_json(&self) -> Value {
        let mut pools = serde_json::Map::new();
        let layout = self.pools.layout();
        for id in PoolId::ALL {
            let unit = layout.unit_bytes(id) as u64;
            let (used, total) = match id {
                PoolId::C4Kv | PoolId::C4Indexer | PoolId::C128Kv => (
                    self.pools.page_allocator().used_count(),
                    self.pools.page_allocator().capacity(),
                ),
                PoolId::Snapshots => (
                    self.pools.snapshot_allocator().used_count(),
                    self.pools.snapshot_allocator().capacity(),
                ),
                _ => (
                    self.pools.slot_allocator().used_count(),
                    self.pools.slot_allocator().capacity(),
                ),
            };
            let mut entry = json!({"device": {
                "used_units": used, "total_units": total,
                "used_bytes": used as u64 * unit, "total_bytes": total as u64 * unit,
            }});
            if let Some(h) = &self.host {
                let host: Option<&dyn UnitCounts> = match id {
                    PoolId::C4Kv | PoolId::C4Indexer | PoolId::C128Kv => {
                        Some(h.pools.page_allocator())
                    }
                    PoolId::Snapshots => Some(h.pools.snapshot_allocator()),
                    _ => None,
                };
                if let Some(a) = host {
                    entry["host"] = json!({
                        "used_units": a.used_count(), "total_units": a.capacity(),
                        "used_bytes": a.used_count() as u64 * unit,
                        "total_bytes": a.capacity() as u64 * unit,
                    });
                }
            }
            pools.insert(id.name().to_string(), entry);
        }
        let s = &self.stats;
        let rate = |bytes: u64, secs: f64| if secs > 0.0 { bytes as f64 / secs } else { 0.0 };
        json!({
            "page_size": self.pools.page_size(),
            "write_policy": self.policy().map(|p| serde_json::to_value(p).unwrap_or_default()),
            "pools": pools,
            "tree": {
                "nodes": self.tree.node_count(),
                "device_pages": self.tree.pages_held(),
                "device_snapshots": self.tree.snapshots_held(),
                "host_pages": self.tree.host_pages_held(),
                "host_snapshots": self.tree.host_snapshots_held(),
            },
            "requests": s.requests,
            "hits": {"total": s.hits, "device": s.device_hits, "host": s.host_hits},
            "hit_tokens": {"total": s.reused_tokens, "device": s.device_hit_tokens, "host": s.host_hit_tokens},
            "loadback": {"count": s.loadbacks, "tokens": s.loadback_tokens, "bytes": s.loadback_bytes,
                         "seconds": s.loadback_seconds, "bytes_per_s": rate(s.loadback_bytes, s.loadback_seconds),
                         "skipped_no_device_room": s.loadbacks_skipped},
            "backup": {"count": s.backups, "tokens": s.backup_tokens, "bytes": s.backup_bytes,
                       "seconds": s.backup_seconds, "bytes_per_s": rate(s.backup_bytes, s.backup_seconds),
                       "in_flight": self.backups_in_flight(), "skipped_no_host_room": s.backups_skipped},
            "evictions": {
                "device": {"kept_on_host": s.evicted_to_host, "dropped": s.evicted_dropped,
                           "pages": s.evicted_pages, "snapshots": s.evicted_snapshots},
                "host": {"count": s.host_evictions, "pages": s.host_evicted_pages},
            },
            "snapshots": {"taken": s.snapshots_taken, "skipped_no_room": s.snapshots_skipped},
        })
    }
}
