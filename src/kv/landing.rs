//! A destination's memory for a transport that writes a sequence state straight into it.
//!
//! A PD decode reserves its destination (a slot and pages) before the state arrives. On pools
//! in host memory (the CPU backend) the transport's reader thread receives the state's bytes
//! straight into those pages — no room buffer, no copy on the engine thread — through a
//! [`Landing`]: the destination's regions in the order the bytes arrive, as absolute
//! addresses. The engine keeps the pages reserved until the transport says it stopped
//! writing (`pd::Node::release_landing`), so the memory stays valid while a write is under
//! way without any lock.

use crate::backend::Backend;

use super::pools::{KvPools, SeqKv};
use super::state;

/// The destination of one state: `len` bytes spread over host memory regions.
#[derive(Debug)]
pub struct Landing {
    /// `(address, length)` of each region, in state byte order.
    spans: Vec<(usize, usize)>,
    /// The state offset each span starts at.
    starts: Vec<usize>,
    len: usize,
}

impl Landing {
    /// `seq`'s destination in `pools`, or `None` when the pools are not host memory.
    pub fn of<B: Backend>(pools: &KvPools<B>, seq: &SeqKv) -> Option<Self> {
        let spans = state::landing_spans(pools, seq)?;
        let mut starts = Vec::with_capacity(spans.len());
        let mut len = 0usize;
        let mut out = Vec::with_capacity(spans.len());
        for (addr, n) in spans {
            let addr = usize::try_from(addr).ok()?;
            len += n;
            // Regions that follow each other in memory (consecutive pages of one pool) make
            // one span: fewer, longer pieces per read.
            if let Some(last) = out
                .last_mut()
                .filter(|l: &&mut (usize, usize)| l.0 + l.1 == addr)
            {
                last.1 += n;
                continue;
            }
            starts.push(len - n);
            out.push((addr, n));
        }
        Some(Self {
            spans: out,
            starts,
            len,
        })
    }

    /// Bytes the destination takes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(address, length)` pieces of state bytes `start..end` (`end <= len`), in order.
    fn pieces(&self, start: usize, end: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        debug_assert!(start <= end && end <= self.len);
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

    /// The memory of state bytes `start..end` as slices to fill, in order.
    ///
    /// # Safety
    /// The destination's pages must still be reserved for this state (the engine has not
    /// been told the landing is released), and nothing else may access bytes `start..end`
    /// while the slices live (one reader per room; ranges already received are refused
    /// before this is called).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slices_mut(&self, start: usize, end: usize) -> Vec<&mut [u8]> {
        self.pieces(start.min(self.len), end.min(self.len))
            // SAFETY: each piece lies inside one region of a pool allocation the pools exposed
            // (`buffer_region`), reserved for this state and accessed by nobody else meanwhile
            // (the caller's contract); pieces of distinct regions do not overlap.
            .map(|(addr, n)| unsafe {
                std::slice::from_raw_parts_mut(std::ptr::with_exposed_provenance_mut(addr), n)
            })
            .collect()
    }

    /// Copies `data` into state bytes `start..start + data.len()`.
    ///
    /// # Safety
    /// As [`Self::slices_mut`].
    pub unsafe fn write(&self, start: usize, data: &[u8]) {
        let mut at = 0;
        // SAFETY: the caller's contract, as `slices_mut`'s.
        for s in unsafe { self.slices_mut(start, start + data.len()) } {
            s.copy_from_slice(&data[at..at + s.len()]);
            at += s.len();
        }
    }

    /// `crc` extended (CRC-32C) over state bytes `start..end`.
    ///
    /// # Safety
    /// The pages must still be reserved for this state and nobody may write bytes
    /// `start..end` meanwhile (they are in: only new ranges are written).
    pub unsafe fn crc_append(&self, mut crc: u32, start: usize, end: usize) -> u32 {
        for (addr, n) in self.pieces(start.min(self.len), end.min(self.len)) {
            // SAFETY: inside a reserved region (the caller's contract), initialised (pools
            // are zeroed at allocation), and not written while read.
            let bytes =
                unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance(addr), n) };
            crc = crate::crc::append(crc, bytes);
        }
        crc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A landing over three separate buffers (standing in for regions of different pools).
    fn landing(bufs: &mut [Vec<u8>]) -> Landing {
        let mut starts = Vec::new();
        let mut spans = Vec::new();
        let mut len = 0;
        for b in bufs.iter_mut() {
            starts.push(len);
            len += b.len();
            spans.push((b.as_mut_ptr().expose_provenance(), b.len()));
        }
        Landing { spans, starts, len }
    }

    #[test]
    fn writes_and_crcs_follow_the_regions_in_order() {
        let mut bufs = vec![vec![0u8; 5], vec![0u8; 3], vec![0u8; 7]];
        let l = landing(&mut bufs);
        let state: Vec<u8> = (1..=15).collect();
        // Written in three uneven frames that cross region boundaries.
        for (a, b) in [(0, 4), (4, 11), (11, 15)] {
            // SAFETY: the buffers outlive `l` here and nothing else touches them.
            unsafe { l.write(a, &state[a..b]) };
        }
        let crc = unsafe { l.crc_append(0, 0, 15) };
        drop(l);
        assert_eq!(bufs.concat(), state);
        assert_eq!(crc, crc32c::crc32c(&state));
        // A piece inside one region, and an empty range.
        let l = landing(&mut bufs);
        assert_eq!(
            unsafe { l.crc_append(0, 6, 8) },
            crc32c::crc32c(&state[6..8])
        );
        assert_eq!(unsafe { l.slices_mut(9, 9) }.len(), 0);
    }
}
