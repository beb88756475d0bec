//! Reused buffers for the states a prefill sends. A state is copied out of the pools into a
//! buffer at hand-over and kept until its room ends (the decode's ACK, or a failure) and no
//! frame or RMA put still holds it. A fresh buffer costs a page fault per 4 KiB page on first
//! write, and freeing it unmaps it again (glibc maps anything over its mmap threshold, at most
//! 32 MiB, straight from the kernel): for a real model's state of tens of MB that is tens of
//! milliseconds of faults on the engine thread per room, and the unmapping on whichever
//! thread ends the room. Buffers whose room is done come back here and serve the next rooms;
//! what is kept is bounded.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};

/// The most bytes of idle buffers kept for reuse; beyond it a returned buffer is freed.
/// Enough for the rooms a busy prefill has on the wire at once (a Flash-sized 8k-token state
/// is ~13 MB), small next to the pools.
pub const KEEP_BYTES: usize = 256 << 20;
/// The most idle buffers kept (a small list: taking one scans it).
pub const KEEP_BUFFERS: usize = 64;

/// The idle buffers; cheap to clone (shared).
#[derive(Clone, Default)]
pub struct StateBuffers {
    idle: Arc<Mutex<Idle>>,
}

#[derive(Default)]
struct Idle {
    buffers: Vec<Vec<u8>>,
    /// Capacity of `buffers`, summed.
    bytes: usize,
}

/// A state's bytes, going back to their [`StateBuffers`] when dropped.
pub struct StateBuf {
    bytes: Vec<u8>,
    home: Option<Arc<Mutex<Idle>>>,
}

impl StateBuffers {
    pub fn new() -> Self {
        Self::default()
    }

    /// A buffer of `len` bytes whose contents are unspecified (zeros or a former state's
    /// bytes): the caller writes every byte. The idle buffer with the least capacity that
    /// holds `len` is reused; without one, a fresh buffer.
    pub fn take(&self, len: usize) -> StateBuf {
        let reused = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let best = idle
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            best.map(|i| {
                let b = idle.buffers.swap_remove(i);
                idle.bytes -= b.capacity();
                b
            })
        };
        let bytes = match reused {
            Some(mut b) => {
                // Shortening keeps the old bytes (no memset); only a longer length zeroes its
                // tail.
                b.resize(len, 0);
                b
            }
            None => vec![0; len],
        };
        StateBuf {
            bytes,
            home: Some(self.idle.clone()),
        }
    }

    /// Idle buffers and their bytes (capacity).
    pub fn idle(&self) -> (usize, usize) {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        (idle.buffers.len(), idle.bytes)
    }
}

/// Bytes that go back to no pool (early pieces, tests).
impl From<Vec<u8>> for StateBuf {
    fn from(bytes: Vec<u8>) -> Self {
        Self { bytes, home: None }
    }
}

impl Deref for StateBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl DerefMut for StateBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
}

impl AsRef<[u8]> for StateBuf {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for StateBuf {
    fn drop(&mut self) {
        let Some(home) = self.home.take() else {
            return;
        };
        let bytes = std::mem::take(&mut self.bytes);
        let cap = bytes.capacity();
        if cap == 0 {
            return;
        }
        let mut idle = home.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.buffers.len() < KEEP_BUFFERS && idle.bytes + cap <= KEEP_BYTES {
            idle.bytes += cap;
            idle.buffers.push(bytes);
            return;
        }
        drop(idle);
        // Freed outside this list's lock (an unmap can take a while); the caller may still
        // hold its own (the node's table, when a room ends).
        drop(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_returned_buffer_serves_the_next_state_of_no_greater_size() {
        let pool = StateBuffers::new();
        let mut a = pool.take(1000);
        assert_eq!(a.len(), 1000);
        a[999] = 7;
        let at = a.as_ptr();
        drop(a);
        assert_eq!(pool.idle(), (1, 1000));
        // Smaller: the same memory, shortened without zeroing.
        let b = pool.take(600);
        assert_eq!((b.len(), b.as_ptr()), (600, at));
        assert_eq!(pool.idle(), (0, 0));
        drop(b);
        // Larger than any idle buffer: a fresh one, zeroed; the idle one stays.
        let c = pool.take(5000);
        assert!(c.iter().all(|&x| x == 0));
        assert_eq!(pool.idle().0, 1);
        drop(c);
        assert_eq!(pool.idle().0, 2);
        // The smallest that holds the length is chosen.
        let d = pool.take(900);
        assert_eq!(d.as_ptr(), at);
        // Growing within the capacity zeroes only the new tail.
        drop(d);
        let e = pool.take(1000);
        assert_eq!(e.as_ptr(), at);
        assert_eq!(
            e[999], 0,
            "the tail past the shortened length is zeroed again"
        );
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let pool = StateBuffers::new();
        let held: Vec<_> = (0..KEEP_BUFFERS + 5).map(|_| pool.take(10)).collect();
        drop(held);
        assert_eq!(pool.idle().0, KEEP_BUFFERS);
        let pool = StateBuffers::new();
        let big: Vec<_> = (0..3).map(|_| pool.take(KEEP_BYTES / 2)).collect();
        drop(big);
        let (n, bytes) = pool.idle();
        assert_eq!(n, 2);
        assert!(bytes <= KEEP_BYTES);
        // Detached bytes go nowhere.
        drop(StateBuf::from(vec![1; 100]));
        assert_eq!(pool.idle().0, 2);
    }

    #[test]
    fn buffers_cross_threads() {
        let pool = StateBuffers::new();
        let b = Arc::new(pool.take(4096));
        let t = {
            let b = b.clone();
            std::thread::spawn(move || b.len())
        };
        assert_eq!(t.join().unwrap(), 4096);
        drop(b);
        assert_eq!(pool.idle().0, 1);
    }
}
