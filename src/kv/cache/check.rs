//! The audit: every page, slot and snapshot reference on both tiers accounted for by the tree,
//! the running requests and the copies in flight (tests and debug runs call it after every
//! operation, so a leak or a double free shows where it happens).

use crate::backend::Backend;

use super::{PrefixCache, Request};

impl<B: Backend> PrefixCache<B> {
    /// Audits the books: allocators consistent on both tiers, tree consistent, and every
    /// reference accounted for by the tree, the `running` requests and the copies in flight.
    pub fn check(&self, running: &[&Request]) -> std::result::Result<(), String> {
        self.pools.check()?;
        self.tree.check()?;
        let held = self.tree.held();
        let mut page_refs = vec![0u32; self.pools.page_allocator().capacity()];
        let mut snap_refs = vec![0u32; self.pools.snapshot_allocator().capacity()];
        for &p in &held.pages {
            page_refs[p as usize] += 1;
        }
        for &s in &held.snapshots {
            snap_refs[s as usize] += 1;
        }
        if let Some(h) = &self.host {
            for b in &h.backups {
                b.pages.iter().for_each(|&p| page_refs[p as usize] += 1);
                b.snaps.iter().for_each(|&s| snap_refs[s as usize] += 1);
            }
        }
        let mut slots = vec![false; self.pools.slot_allocator().capacity()];
        for r in running {
            for &p in r.kv.pages() {
                page_refs[p as usize] += 1;
            }
            if let Some((_, s)) = r.latest {
                snap_refs[s as usize] += 1;
            }
            if let Some(l) = &r.loading {
                for (_, pages) in &l.nodes {
                    pages.iter().for_each(|&p| page_refs[p as usize] += 1);
                }
                if l.snap.3 {
                    snap_refs[l.snap.2 as usize] += 1;
                }
            }
            if std::mem::replace(&mut slots[r.kv.slot() as usize], true) {
                return Err(format!("slot {} used by two requests", r.kv.slot()));
            }
        }
        for (p, &want) in page_refs.iter().enumerate() {
            let got = self.pools.page_allocator().refs(p as u32);
            if got != want {
                return Err(format!("page {p}: {got} references, {want} holders"));
            }
        }
        for (s, &want) in snap_refs.iter().enumerate() {
            let got = self.pools.snapshot_allocator().refs(s as u32);
            if got != want {
                return Err(format!("snapshot {s}: {got} references, {want} holders"));
            }
        }
        let used_slots = self.pools.slot_allocator().used_count();
        if used_slots != running.len() {
            return Err(format!(
                "{used_slots} slots in use for {} requests",
                running.len()
            ));
        }
        if let Some(h) = &self.host {
            h.pools.check()?;
            for (alloc, held, what) in [
                (h.pools.page_allocator(), &held.host_pages, "host page"),
                (
                    h.pools.snapshot_allocator(),
                    &held.host_snapshots,
                    "host snapshot",
                ),
            ] {
                let mut refs = vec![0u32; alloc.capacity()];
                held.iter().for_each(|&u| refs[u as usize] += 1);
                for (u, &want) in refs.iter().enumerate() {
                    if alloc.refs(u as u32) != want {
                        return Err(format!(
                            "{what} {u}: {} references, {want} holders",
                            alloc.refs(u as u32)
                        ));
                    }
                }
            }
        } else if !held.host_pages.is_empty() || !held.host_snapshots.is_empty() {
            return Err("host units in the tree without a host tier".into());
        }
        Ok(())
    }
}
