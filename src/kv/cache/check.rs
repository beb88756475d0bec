//! The audit: every page, slot and snapshot reference on both tiers accounted for by the tree,
//! the running requests and the copies in flight (tests and debug runs call it after every
//! operation, so a leak or a double free shows where it happens).

use crate::backend::Backend;
use crate::kv::ids::UnitId;
use crate::kv::units::UnitAllocator;

use super::{PrefixCache, Request};

impl<B: Backend> PrefixCache<B> {
    /// Audits the books: allocators consistent on both tiers, tree consistent, and every
    /// reference accounted for by the tree, the `running` requests and the copies in flight.
    pub fn check(&self, running: &[&Request]) -> std::result::Result<(), String> {
        self.pools.check()?;
        self.tree.check()?;
        let held = self.tree.held();
        let mut pages = held.pages.clone();
        let mut snaps = held.snapshots.clone();
        if let Some(h) = &self.host {
            for b in &h.backups {
                pages.extend_from_slice(&b.pages);
                snaps.extend_from_slice(&b.snaps);
            }
        }
        let mut slots = vec![false; self.pools.slot_allocator().capacity()];
        for r in running {
            pages.extend_from_slice(r.kv.pages());
            if let Some((_, s)) = r.latest {
                snaps.push(s);
            }
            if let Some(l) = &r.loading {
                for (_, loaded) in &l.nodes {
                    pages.extend_from_slice(loaded);
                }
                if l.snap.3 {
                    snaps.push(l.snap.2);
                }
            }
            if std::mem::replace(&mut slots[r.kv.slot() as usize], true) {
                return Err(format!("slot {} used by two requests", r.kv.slot()));
            }
        }
        audit(self.pools.page_allocator(), pages, "page")?;
        audit(self.pools.snapshot_allocator(), snaps, "snapshot")?;
        let used_slots = self.pools.slot_allocator().used_count();
        if used_slots != running.len() {
            return Err(format!(
                "{used_slots} slots in use for {} requests",
                running.len()
            ));
        }
        if let Some(h) = &self.host {
            h.pools.check()?;
            audit(h.pools.page_allocator(), held.host_pages, "host page")?;
            audit(
                h.pools.snapshot_allocator(),
                held.host_snapshots,
                "host snapshot",
            )?;
        } else if !held.host_pages.is_empty() || !held.host_snapshots.is_empty() {
            return Err("host units in the tree without a host tier".into());
        }
        Ok(())
    }
}

/// Every unit of `alloc` has exactly as many references as `holders` lists it.
fn audit<I: UnitId>(
    alloc: &UnitAllocator<I>,
    holders: Vec<I>,
    what: &str,
) -> std::result::Result<(), String> {
    let mut want = vec![0u32; alloc.capacity()];
    for u in holders {
        want[u.index()] += 1;
    }
    for (u, &want) in want.iter().enumerate() {
        let got = alloc.refs(I::from_index(u));
        if got != want {
            return Err(format!("{what} {u}: {got} references, {want} holders"));
        }
    }
    Ok(())
}
