//! A sequence's bytes spread over memory: `(address, length)` spans in the state's byte order,
//! and which pieces of memory hold state bytes `start..end`. A decode's destination is one
//! ([`super::Landing`], written by its own reader); a prefill writing that destination by RMA
//! maps the decode's addresses the same way (`pd::rma`).

/// `(address, length)` spans in state byte order; spans that follow each other in memory are
/// merged (consecutive pages of one pool make one span: fewer, longer pieces).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spans {
    spans: Vec<(u64, u64)>,
    /// The state offset each span starts at.
    starts: Vec<u64>,
    len: u64,
}

impl Spans {
    /// The spans of `parts`, in order; `None` when their total length overflows.
    pub fn new(parts: impl IntoIterator<Item = (u64, u64)>) -> Option<Self> {
        let mut s = Spans::default();
        for (addr, n) in parts {
            if n == 0 {
                continue;
            }
            addr.checked_add(n)?;
            let start = s.len;
            s.len = s.len.checked_add(n)?;
            if let Some(last) = s.spans.last_mut().filter(|l| l.0 + l.1 == addr) {
                last.1 += n;
                continue;
            }
            s.starts.push(start);
            s.spans.push((addr, n));
        }
        Some(s)
    }

    /// Bytes the spans hold.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The merged spans, in order.
    pub fn spans(&self) -> &[(u64, u64)] {
        &self.spans
    }

    /// `(address, length)` pieces holding state bytes `start..end`, in order (empty outside
    /// `0..len`; `end` is clamped to `len`).
    pub fn pieces(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = end.min(self.len);
        // The span holding `start`: the last one starting at or before it.
        let first = self
            .starts
            .partition_point(|&s| s <= start)
            .saturating_sub(1);
        self.spans[first..]
            .iter()
            .zip(&self.starts[first..])
            .take_while(move |(_, &s)| s < end)
            .filter_map(move |(&(addr, n), &s)| {
                let (from, to) = (start.max(s), end.min(s + n));
                (to > from).then(|| (addr + (from - s), to - from))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces match a byte-by-byte walk of the spans for every range.
    #[test]
    fn pieces_cover_exactly_the_bytes_asked_for() {
        // The 2nd span follows the 1st in memory (merged); a 0-length span is dropped.
        let parts = [(1000, 5), (1005, 3), (50, 0), (2000, 7), (10, 4)];
        let s = Spans::new(parts).unwrap();
        assert_eq!(s.spans(), &[(1000, 8), (2000, 7), (10, 4)]);
        assert_eq!(s.len(), 19);
        let byte_addr: Vec<u64> = parts
            .iter()
            .flat_map(|&(a, n)| (a..a + n).collect::<Vec<_>>())
            .collect();
        for start in 0..=19u64 {
            for end in start..=21u64 {
                let got: Vec<u64> = s
                    .pieces(start, end)
                    .flat_map(|(a, n)| (a..a + n).collect::<Vec<_>>())
                    .collect();
                let want = &byte_addr[start as usize..(end.min(19)) as usize];
                assert_eq!(got, want, "{start}..{end}");
            }
        }
        assert_eq!(Spans::new([(u64::MAX - 1, 4)]), None);
        assert!(Spans::new([]).unwrap().pieces(0, 5).next().is_none());
    }
}
