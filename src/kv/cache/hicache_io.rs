//! Copy control for the host tier: backups (device → host, asynchronous; their device pages
//! stay referenced until they land), load-backs of host hits (host → device into pages the
//! request owns until the tree adopts them), and polling for what landed. Copies run in
//! submission order on one queue, which is what makes freeing a host unit with a copy still
//! queued safe.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{Backend, CopyDirection, Ticket};
use crate::error::Result;

use super::{Backup, Loading, PrefixCache, Request};
use crate::kv::ids::{HostPageId, HostSnapshotId, PageId, SnapshotId};
use crate::kv::radix::{Match, NodeId, Snap};

impl<B: Backend> PrefixCache<B> {
    /// Queues the load-back of a host hit; None when the device pages cannot be found.
    pub(super) fn start_load(
        &mut self,
        m: &Match,
        snap_node: NodeId,
        snap: Snap,
    ) -> Option<Loading> {
        let pages_needed: usize = m.load.iter().map(|(_, h)| h.len()).sum();
        let snap_needed = usize::from(snap.device.is_none());
        if self.pools.page_allocator().free_count() < pages_needed
            || self.pools.snapshot_allocator().free_count() < snap_needed
        {
            self.evict_until(|p| {
                p.page_allocator().free_count() >= pages_needed
                    && p.snapshot_allocator().free_count() >= snap_needed
            });
        }
        let pages = self.pools.alloc_pages(pages_needed)?;
        let snap_unit = match snap.device {
            Some(u) => (u, false),
            None => match self.pools.alloc_snapshot() {
                Some(u) => (u, true),
                None => {
                    for p in pages {
                        self.pools.release_page(p);
                    }
                    return None;
                }
            },
        };
        let ticket = Ticket::new();
        let host = self.host.as_ref().expect("host hits need the host tier");
        let mut nodes = Vec::new();
        let mut pairs = Vec::new();
        let mut next = pages.iter().copied();
        for (node, host_pages) in &m.load {
            let device: Vec<PageId> = next.by_ref().take(host_pages.len()).collect();
            pairs.extend(device.iter().copied().zip(host_pages.iter().copied()));
            nodes.push((*node, device));
        }
        let mut queued =
            host.pools
                .copy_pages(&self.pools, CopyDirection::FromHost, &pairs, &ticket);
        if queued.is_ok() && snap_unit.1 {
            let host_unit = snap
                .host
                .expect("a host snapshot when there is no device copy");
            queued = host.pools.copy_snapshots(
                &self.pools,
                CopyDirection::FromHost,
                &[(snap_unit.0, host_unit)],
                &ticket,
            );
        }
        if let Err(e) = queued {
            // The parts already queued write into the pages taken above: let them land
            // before those pages go back, then serve the request as a cold start.
            ticket.seal();
            ticket.wait();
            log::error!("a load-back could not be queued ({e}); the request starts cold");
            for p in pages {
                self.pools.release_page(p);
            }
            if snap_unit.1 {
                self.pools.release_snapshot(snap_unit.0);
            }
            return None;
        }
        for (node, _) in &nodes {
            self.tree.set_loading(*node);
        }
        ticket.seal();
        self.host
            .as_mut()
            .expect("checked")
            .loads
            .push(ticket.clone());
        let mut all = m.pages.clone();
        all.extend_from_slice(&pages);
        Some(Loading {
            ticket,
            nodes,
            snap: (snap_node, snap.end, snap_unit.0, snap_unit.1),
            pages: all,
            resume: m.reusable_tokens,
            host_tokens: m.reusable_tokens - m.device_tokens,
        })
    }

    /// Waits up to `wait` for `req`'s load-back to land (without completing it).
    pub fn wait_load(&self, req: &Request, wait: Duration) {
        if let Some(loading) = &req.loading {
            loading.ticket.wait_timeout(wait);
        }
    }

    /// Finishes `req`'s load-back if it has landed (waiting up to `wait`); returns whether the
    /// request can run. An error (the backend could not restore the loaded snapshot into the
    /// request's slot) leaves the request's references consistent: end it with `abort`.
    pub fn complete_load(&mut self, req: &mut Request, wait: Duration) -> Result<bool> {
        let Some(loading) = &req.loading else {
            return Ok(true);
        };
        if !loading.ticket.is_done() && !loading.ticket.wait_timeout(wait) {
            return Ok(false);
        }
        let l = req.loading.take().expect("checked");
        // The allocation references of the loaded pages and snapshot move to the tree.
        for (node, pages) in l.nodes {
            self.tree.set_device(node, pages);
        }
        self.pools.share_pages(&mut req.kv, &l.pages);
        let (node, end, unit, loaded) = l.snap;
        let restored = self.pools.restore(&req.kv, unit);
        if loaded && !self.tree.set_snap_device(node, end, unit) {
            self.pools.release_snapshot(unit);
        }
        restored?;
        self.pools.set_position(&mut req.kv, l.resume);
        req.reused = l.resume;
        req.reused_host = l.host_tokens;
        let bytes = l.ticket.bytes();
        self.stats.hits += 1;
        self.stats.host_hits += 1;
        self.stats.reused_tokens += l.resume as u64;
        self.stats.host_hit_tokens += l.host_tokens as u64;
        self.stats.device_hit_tokens += (l.resume - l.host_tokens) as u64;
        self.stats.loadbacks += 1;
        self.stats.loadback_tokens += l.host_tokens as u64;
        self.stats.loadback_bytes += bytes;
        self.stats.loadback_seconds += l.ticket.seconds();
        Ok(true)
    }

    /// Copies what `node` has on the device and not on the host (pages, snapshots) to the
    /// host tier, asynchronously. Skipped (counted) when the host has no room.
    pub(super) fn backup(&mut self, node: NodeId) -> Option<Arc<Ticket>> {
        if self.host.is_none() || !self.tree.is_live(node) {
            return None;
        }
        let (pages, snaps) = if self.tree.has_host_copy(node) {
            (Vec::new(), self.tree.snaps_without_host(node))
        } else {
            self.tree.device_data(node)
        };
        if pages.is_empty() && snaps.is_empty() {
            return None;
        }
        // Keep this node out of host eviction while making room for it.
        self.tree.lock(node);
        let room = self.host_room(pages.len(), snaps.len());
        self.tree.unlock(node);
        if !room {
            self.stats.backups_skipped += 1;
            return None;
        }
        let host = self.host.as_mut().expect("checked");
        let host_pages = host.pools.page_allocator_mut().alloc(pages.len())?;
        let host_snaps = host.pools.snapshot_allocator_mut().alloc(snaps.len())?;
        let ticket = Ticket::new();
        let page_pairs: Vec<(PageId, HostPageId)> = pages
            .iter()
            .copied()
            .zip(host_pages.iter().copied())
            .collect();
        let snap_pairs: Vec<(SnapshotId, HostSnapshotId)> = snaps
            .iter()
            .map(|s| s.1)
            .zip(host_snaps.iter().copied())
            .collect();
        let queued = host
            .pools
            .copy_pages(&self.pools, CopyDirection::ToHost, &page_pairs, &ticket)
            .and_then(|()| {
                host.pools
                    .copy_snapshots(&self.pools, CopyDirection::ToHost, &snap_pairs, &ticket)
            });
        ticket.seal();
        if let Err(e) = queued {
            // Let the parts already queued land before their host units go back.
            ticket.wait();
            log::error!("a backup to the host tier could not be queued ({e}); skipped");
            for u in host_pages.into_iter() {
                host.pools.page_allocator_mut().release(u);
            }
            for u in host_snaps.into_iter() {
                host.pools.snapshot_allocator_mut().release(u);
            }
            self.stats.backups_skipped += 1;
            return None;
        }
        for &p in &pages {
            self.pools.retain_page(p);
        }
        for s in &snaps {
            self.pools.retain_snapshot(s.1);
        }
        let host_snap_entries: Vec<(u32, HostSnapshotId)> = snaps
            .iter()
            .map(|s| s.0)
            .zip(host_snaps.iter().copied())
            .collect();
        self.tree.set_host(node, host_pages, &host_snap_entries);
        let tokens = pages.len() * self.pools.page_size();
        self.host.as_mut().expect("checked").backups.push(Backup {
            ticket: ticket.clone(),
            pages,
            snaps: snaps.iter().map(|s| s.1).collect(),
            tokens,
        });
        Some(ticket)
    }

    /// Completes landed backups (their device references go back). Call regularly.
    pub fn poll(&mut self) {
        let Some(host) = &mut self.host else { return };
        host.loads.retain(|t| !t.is_done());
        let mut landed = Vec::new();
        host.backups.retain(|b| {
            if b.ticket.is_done() {
                landed.push((
                    b.pages.clone(),
                    b.snaps.clone(),
                    b.tokens,
                    b.ticket.bytes(),
                    b.ticket.seconds(),
                ));
                false
            } else {
                true
            }
        });
        for (pages, snaps, tokens, bytes, seconds) in landed {
            for p in pages {
                self.pools.release_page(p);
            }
            for s in snaps {
                self.pools.release_snapshot(s);
            }
            self.stats.backups += 1;
            self.stats.backup_tokens += tokens as u64;
            self.stats.backup_bytes += bytes;
            self.stats.backup_seconds += seconds;
        }
    }

    /// Copies still in flight (backups, not counting load-backs, which requests track).
    pub fn backups_in_flight(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.backups.len())
    }

    /// Waits for every backup in flight.
    pub fn wait_backups(&mut self) {
        if let Some(h) = &self.host {
            for b in &h.backups {
                b.ticket.wait();
            }
        }
        self.poll();
    }
}
