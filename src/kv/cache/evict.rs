//! Eviction: least recently used unlocked leaves first, on each tier. The tree hands out one
//! pass at a time (the nodes evictable when it began, in LRU order); a device victim keeps its
//! host copy when it has one (write_back writes it back first), a host victim only loses its
//! host copy unless it is a host-only leaf. What the tree gives back is released here.

use crate::backend::Backend;
use crate::config::params::WritePolicy;

use super::{PrefixCache, Tier};
use crate::kv::hicache::HostPools;
use crate::kv::pools::KvPools;
use crate::kv::radix::{EvictTier, Evicted, NodeId};

impl<B: Backend> PrefixCache<B> {
    /// Frees host units (evicting host copies, least recently used first) until `pages` host
    /// pages and `snaps` host snapshots are free.
    pub(super) fn host_room(&mut self, pages: usize, snaps: usize) -> bool {
        let enough = |h: &HostPools| {
            h.page_allocator().free_count() >= pages && h.snapshot_allocator().free_count() >= snaps
        };
        loop {
            let Some(host) = &self.host else { return false };
            if enough(&host.pools) {
                return true;
            }
            let Some(mut pass) = self.tree.eviction_pass(EvictTier::Host) else {
                return false;
            };
            while let Some(v) = self.tree.next_victim(&mut pass) {
                if enough(&self.host.as_ref().expect("checked").pools) {
                    return true;
                }
                let ev = self.tree.drop_host(v);
                self.stats.host_evictions += 1;
                self.stats.host_evicted_pages += ev.host_pages.len() as u64;
                self.give_back(ev);
            }
        }
    }

    fn give_back(&mut self, ev: Evicted) {
        for p in ev.pages {
            self.pools.release_page(p);
        }
        for s in ev.snapshots {
            self.pools.release_snapshot(s);
        }
        if let Some(h) = &mut self.host {
            for p in ev.host_pages {
                h.pools.page_allocator_mut().release(p);
            }
            for s in ev.host_snapshots {
                h.pools.snapshot_allocator_mut().release(s);
            }
        }
    }

    /// Device eviction of one node per the write policy.
    fn evict_device_node(&mut self, v: NodeId, keep_host: bool) {
        if keep_host && !self.tree.has_host_copy(v) && self.policy() == Some(WritePolicy::WriteBack)
        {
            if let Some(t) = self.backup(v) {
                // Written back synchronously: the device pages are needed now.
                t.wait();
                self.poll();
            }
        }
        let ev = if keep_host && self.tree.has_host_copy(v) {
            self.stats.evicted_to_host += 1;
            self.tree.drop_device(v)
        } else {
            self.stats.evicted_dropped += 1;
            self.tree.remove_subtree(v)
        };
        self.stats.evicted_pages += ev.pages.len() as u64;
        self.stats.evicted_snapshots += ev.snapshots.len() as u64;
        self.give_back(ev);
    }

    pub(super) fn evict_until(&mut self, enough: impl Fn(&KvPools<B>) -> bool) -> bool {
        self.poll();
        if self.evict_device_until(&enough, true) {
            return true;
        }
        // Backups in flight still hold device pages: let them land, then try again.
        if self.backups_in_flight() > 0 {
            self.wait_backups();
            return self.evict_device_until(&enough, true);
        }
        false
    }

    fn evict_device_until(
        &mut self,
        enough: &dyn Fn(&KvPools<B>) -> bool,
        keep_host: bool,
    ) -> bool {
        loop {
            if enough(&self.pools) {
                return true;
            }
            let Some(mut pass) = self.tree.eviction_pass(EvictTier::Device) else {
                return false;
            };
            while let Some(v) = self.tree.next_victim(&mut pass) {
                if enough(&self.pools) {
                    return true;
                }
                self.evict_device_node(v, keep_host);
            }
        }
    }

    /// Evicts cached prefixes (least recently used unlocked leaves first) until at least
    /// `pages` pages and `snapshots` snapshot units are free; false when that is impossible.
    pub fn evict(&mut self, pages: usize, snapshots: usize) -> bool {
        self.evict_until(|p| {
            p.page_allocator().free_count() >= pages
                && p.snapshot_allocator().free_count() >= snapshots
        })
    }

    /// Drops every unlocked cached prefix from `tier` (flushing the device keeps host copies;
    /// with write_back they are written first).
    pub fn flush(&mut self, tier: Tier) {
        self.poll();
        match tier {
            Tier::Device => {
                self.evict_device_until(&|_| false, true);
            }
            Tier::Host => {
                self.host_room(usize::MAX, usize::MAX);
            }
            Tier::All => {
                self.wait_backups();
                self.host_room(usize::MAX, usize::MAX);
                self.evict_device_until(&|_| false, false);
            }
        }
    }

    /// Drops every unlocked cached prefix on both tiers.
    pub fn clear(&mut self) {
        self.flush(Tier::All);
    }
}
