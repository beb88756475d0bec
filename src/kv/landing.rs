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
use super::spans::Spans;
use super::state;

/// The destination of one state: `len` bytes spread over host memory regions.
#[derive(Debug)]
pub struct Landing {
    spans: Spans,
}

impl Landing {
    /// `seq`'s destination in `pools`, or `None` when the pools are not host memory.
    pub fn of<B: Backend>(pools: &KvPools<B>, seq: &SeqKv) -> Option<Self> {
        let spans = state::landing_spans(pools, seq)?;
        // Addresses are used as pointers below: every one must be one on this machine.
        if spans
            .iter()
            .any(|&(a, n)| usize::try_from(a + n as u64).is_err())
        {
            return None;
        }
        Some(Self {
            spans: Spans::new(spans.into_iter().map(|(a, n)| (a, n as u64)))?,
        })
    }

    /// A destination over `spans` of host memory the caller owns (tests of the transports).
    #[cfg(test)]
    pub(crate) fn over(spans: &[(u64, u64)]) -> Self {
        Self {
            spans: Spans::new(spans.iter().copied()).expect("spans within the address space"),
        }
    }

    /// Bytes the destination takes.
    pub fn len(&self) -> usize {
        self.spans.len() as usize
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// The destination's memory: `(address, length)` spans in state byte order (what a
    /// transport writing it from another machine needs).
    pub fn spans(&self) -> &[(u64, u64)] {
        self.spans.spans()
    }

    /// `(address, length)` pieces of state bytes `start..end` (`end <= len`), in order.
    fn pieces(&self, start: usize, end: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        debug_assert!(start <= end && end <= self.len());
        // Addresses and lengths fit a usize: checked in `of`.
        self.spans
            .pieces(start as u64, end as u64)
            .map(|(a, n)| (a as usize, n as usize))
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
        self.pieces(start.min(self.len()), end.min(self.len()))
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
    /// As [`Self::read`].
    pub unsafe fn crc_append(&self, mut crc: u32, start: usize, end: usize) -> u32 {
        // SAFETY: the caller's contract is read's.
        unsafe { self.read(start, end, |bytes| crc = crate::crc::append(crc, bytes)) };
        crc
    }

    /// Hands state bytes `start..end` to `f`, a piece (a region's run) at a time, in order.
    ///
    /// # Safety
    /// The pages must still be reserved for this state and nobody may write bytes
    /// `start..end` meanwhile (they are in: only new ranges are written).
    pub unsafe fn read(&self, start: usize, end: usize, mut f: impl FnMut(&[u8])) {
        for (addr, n) in self.pieces(start.min(self.len()), end.min(self.len())) {
            // SAFETY: inside a reserved region (the caller's contract), initialised (pools
            // are zeroed at allocation), and not written while read.
            let bytes =
                unsafe { std::slice::from_raw_parts(std::ptr::with_exposed_provenance(addr), n) };
            f(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A landing over three separate buffers (standing in for regions of different pools).
    fn landing(bufs: &mut [Vec<u8>]) -> Landing {
        let spans = bufs
            .iter_mut()
            .map(|b| (b.as_mut_ptr().expose_provenance() as u64, b.len() as u64));
        Landing {
            spans: Spans::new(spans).unwrap(),
        }
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
