//! Reference-counted unit allocation (pages, slots, snapshots): a free list and one count per
//! unit. Allocation is all-or-nothing, so a request that cannot get everything it asked for
//! leaves the pool exactly as it found it. Generic over the id type, so each pool's allocator
//! hands out and takes back only its own kind of id ([`super::ids`]).

pub use super::ids::UnitId;

/// Hands out the units `0..capacity` of one pool, as ids of type `I`.
#[derive(Debug, Clone)]
pub struct UnitAllocator<I: UnitId = u32> {
    /// References held on each unit; 0 = free.
    refs: Vec<u32>,
    /// Free units; the most recently freed is reused first (its memory is likely warm).
    free: Vec<I>,
}

/// The counts of an allocator whatever its id type (for gauges and reports).
pub trait UnitCounts {
    fn capacity(&self) -> usize;
    fn free_count(&self) -> usize;
    fn used_count(&self) -> usize;
}

impl<I: UnitId> UnitCounts for UnitAllocator<I> {
    fn capacity(&self) -> usize {
        self.refs.len()
    }

    fn free_count(&self) -> usize {
        self.free.len()
    }

    fn used_count(&self) -> usize {
        self.refs.len() - self.free.len()
    }
}

impl<I: UnitId> UnitAllocator<I> {
    pub fn new(capacity: usize) -> Self {
        Self {
            refs: vec![0; capacity],
            free: (0..capacity).rev().map(I::from_index).collect(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.refs.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.refs.len() - self.free.len()
    }

    /// `n` units with one reference each, or `None` (and nothing taken) when fewer are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<I>> {
        if n > self.free.len() {
            return None;
        }
        let mut units = self.free.split_off(self.free.len() - n);
        // Ascending: units adjacent in number are adjacent in memory, so a sequence's pages
        // in order make long contiguous runs (one region per run for a transfer's reads and
        // a backup's copies) whenever the free list holds runs, as it does after a release.
        units.sort_unstable_by_key(|u| u.index());
        for &u in &units {
            debug_assert_eq!(
                self.refs[u.index()],
                0,
                "unit {u} on the free list is in use"
            );
            self.refs[u.index()] = 1;
        }
        Some(units)
    }

    /// One more reference on a unit in use.
    pub fn retain(&mut self, unit: I) {
        let r = &mut self.refs[unit.index()];
        assert!(*r > 0, "retain of free unit {unit}");
        *r += 1;
    }

    /// Drops one reference; returns true when the unit became free.
    pub fn release(&mut self, unit: I) -> bool {
        let r = &mut self.refs[unit.index()];
        assert!(*r > 0, "release of free unit {unit} (double free)");
        *r -= 1;
        if *r == 0 {
            self.free.push(unit);
            true
        } else {
            false
        }
    }

    pub fn refs(&self, unit: I) -> u32 {
        self.refs[unit.index()]
    }

    /// Whether `unit` is one of this pool's units and in use.
    pub fn is_held(&self, unit: I) -> bool {
        self.refs.get(unit.index()).is_some_and(|&r| r > 0)
    }

    /// Checks the free list against the counts: every free unit listed once, no used unit listed.
    pub fn check(&self) -> Result<(), String> {
        let mut listed = vec![false; self.refs.len()];
        for &u in &self.free {
            let u = u.index();
            if listed[u] {
                return Err(format!("unit {u} is on the free list twice"));
            }
            if self.refs[u] != 0 {
                return Err(format!(
                    "unit {u} is free-listed with {} references",
                    self.refs[u]
                ));
            }
            listed[u] = true;
        }
        match (0..self.refs.len()).find(|&u| self.refs[u] == 0 && !listed[u]) {
            Some(u) => Err(format!(
                "unit {u} has no references but is not on the free list (leaked)"
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::ids::PageId;

    #[test]
    fn allocation_is_all_or_nothing_and_counted() {
        let mut a = UnitAllocator::<PageId>::new(4);
        let x = a.alloc(3).unwrap();
        assert_eq!(a.alloc(2), None);
        assert_eq!(a.free_count(), 1);
        a.retain(x[0]);
        assert!(!a.release(x[0]));
        assert!(a.release(x[0]));
        assert_eq!(a.free_count(), 2);
        a.check().unwrap();
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut a = UnitAllocator::<u32>::new(2);
        let x = a.alloc(1).unwrap();
        a.release(x[0]);
        a.release(x[0]);
    }
}
