//! Reference-counted unit allocation (pages, slots, snapshots): a free list and one count per
//! unit. Allocation is all-or-nothing, so a request that cannot get everything it asked for
//! leaves the pool exactly as it found it.

/// Hands out the units `0..capacity` of one pool.
#[derive(Debug, Clone)]
pub struct UnitAllocator {
    /// References held on each unit; 0 = free.
    refs: Vec<u32>,
    /// Free units; the most recently freed is reused first (its memory is likely warm).
    free: Vec<u32>,
}

impl UnitAllocator {
    pub fn new(capacity: usize) -> Self {
        Self {
            refs: vec![0; capacity],
            free: (0..capacity as u32).rev().collect(),
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
    pub fn alloc(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let units = self.free.split_off(self.free.len() - n);
        for &u in &units {
            debug_assert_eq!(
                self.refs[u as usize], 0,
                "unit {u} on the free list is in use"
            );
            self.refs[u as usize] = 1;
        }
        Some(units)
    }

    /// One more reference on a unit in use.
    pub fn retain(&mut self, unit: u32) {
        let r = &mut self.refs[unit as usize];
        assert!(*r > 0, "retain of free unit {unit}");
        *r += 1;
    }

    /// Drops one reference; returns true when the unit became free.
    pub fn release(&mut self, unit: u32) -> bool {
        let r = &mut self.refs[unit as usize];
        assert!(*r > 0, "release of free unit {unit} (double free)");
        *r -= 1;
        if *r == 0 {
            self.free.push(unit);
            true
        } else {
            false
        }
    }

    pub fn refs(&self, unit: u32) -> u32 {
        self.refs[unit as usize]
    }

    /// Checks the free list against the counts: every free unit listed once, no used unit listed.
    pub fn check(&self) -> Result<(), String> {
        let mut listed = vec![false; self.refs.len()];
        for &u in &self.free {
            let u = u as usize;
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

    #[test]
    fn allocation_is_all_or_nothing_and_counted() {
        let mut a = UnitAllocator::new(4);
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
        let mut a = UnitAllocator::new(2);
        let x = a.alloc(1).unwrap();
        a.release(x[0]);
        a.release(x[0]);
    }
}
