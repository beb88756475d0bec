//! Putting numbered items back in the order they were sent: what the UCX transport does with
//! its active messages, which UCX may complete out of order (a rendezvous message after a later
//! eager one) while the protocol needs them in order (DONE after the last DATA).

use std::collections::BTreeMap;

/// Items numbered 0, 1, 2, … by the sender, accepted in any order and handed on in order.
pub struct InOrder<T> {
    next: u64,
    early: BTreeMap<u64, T>,
    /// Items held ahead of a missing one at most: a peer cannot make the receiver hold what
    /// it likes.
    limit: usize,
}

impl<T> InOrder<T> {
    pub fn new(limit: usize) -> Self {
        Self {
            next: 0,
            early: BTreeMap::new(),
            limit,
        }
    }

    /// The number of the item due next.
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Item `seq`: the items now in turn, in order (none while an earlier one is missing). An
    /// item numbered twice, or too far ahead, is the sender's error.
    pub fn accept(&mut self, seq: u64, item: T) -> Result<Vec<T>, String> {
        if seq < self.next || self.early.contains_key(&seq) {
            return Err(format!("frame {seq} arrived twice"));
        }
        if seq > self.next {
            if self.early.len() >= self.limit {
                return Err(format!(
                    "more than {} frames arrived ahead of frame {}",
                    self.limit, self.next
                ));
            }
            self.early.insert(seq, item);
            return Ok(Vec::new());
        }
        let mut out = vec![item];
        self.next += 1;
        while let Some(x) = self.early.remove(&self.next) {
            out.push(x);
            self.next += 1;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_come_out_in_order_whatever_order_they_arrive_in() {
        // Every permutation of 5 items: the output is 0..5 in order, each item once.
        let mut perm: Vec<u64> = (0..5).collect();
        let mut count = 0;
        loop {
            let mut q = InOrder::new(8);
            let mut out = Vec::new();
            for &s in &perm {
                out.extend(q.accept(s, s).unwrap());
            }
            assert_eq!(out, (0..5).collect::<Vec<_>>(), "arrival order {perm:?}");
            count += 1;
            // Next permutation (lexicographic).
            let Some(i) = (0..perm.len() - 1).rev().find(|&i| perm[i] < perm[i + 1]) else {
                break;
            };
            let j = (i + 1..perm.len())
                .rev()
                .find(|&j| perm[j] > perm[i])
                .unwrap();
            perm.swap(i, j);
            perm[i + 1..].reverse();
        }
        assert_eq!(count, 120);
    }

    #[test]
    fn repeats_and_runaway_senders_are_errors() {
        let mut q = InOrder::new(2);
        assert_eq!(q.accept(0, 'a').unwrap(), vec!['a']);
        assert!(q
            .accept(0, 'x')
            .unwrap_err()
            .contains("frame 0 arrived twice"));
        assert!(q.accept(2, 'c').unwrap().is_empty());
        assert!(q
            .accept(2, 'x')
            .unwrap_err()
            .contains("frame 2 arrived twice"));
        assert!(q.accept(3, 'd').unwrap().is_empty());
        let e = q.accept(4, 'e').unwrap_err();
        assert!(
            e.contains("more than 2 frames arrived ahead of frame 1"),
            "{e}"
        );
        assert_eq!(q.accept(1, 'b').unwrap(), vec!['b', 'c', 'd']);
    }
}
