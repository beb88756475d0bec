//! Small weight buffers packed together on 2 MiB pages.
//!
//! Why: glibc gives every buffer from 128 KiB up (its mmap threshold) a mapping of its own, and
//! a mapping under 2 MiB holds no 2 MiB page, so `huge_pages` cannot put a small matrix on huge
//! pages: each of its 4 KiB pages costs a TLB miss and stops the hardware prefetcher. The
//! bench model's ~1 MB FP8 products ran at 18–25 GB/s in place, 24–27 with every weight on
//! huge pages (docs/model.md, stop 46). Buffers under 2 MiB are copied into shared chunks of
//! 2 MiB-aligned memory advised for huge pages, each starting on a cache line; a chunk is
//! freed when the last buffer in it is dropped.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// One huge page: buffers this size or larger keep their own allocation (`huge_pages`
/// reserves theirs).
const HUGE: usize = 2 << 20;

/// A chunk's size: eight huge pages.
const CHUNK: usize = 16 << 20;

/// Each buffer starts on a cache line.
const LINE: usize = 64;

/// The process's weights' arena.
static SHARED: Arena = Arena::new();

/// Where small buffers are packed: the chunk being filled and the first free byte in it (the
/// arena does not keep a chunk alive: its buffers do).
struct Arena {
    current: Mutex<(Weak<Chunk>, usize)>,
}

/// `CHUNK` bytes, 2 MiB-aligned, written once per buffer (while only the writer can reach
/// that range) and read-only afterwards.
struct Chunk {
    ptr: NonNull<u8>,
}

// SAFETY: a chunk is plain memory; each range is written once before any `Bytes` can read it,
// and only read afterwards.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    fn layout() -> Layout {
        Layout::from_size_align(CHUNK, HUGE).expect("a valid layout")
    }

    fn new() -> Option<Arc<Self>> {
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc(Self::layout()) })?;
        // SAFETY: the range is this allocation; the advice changes how it is mapped, never a
        // byte (a failure leaves 4 KiB pages).
        unsafe { libc::madvise(ptr.as_ptr().cast(), CHUNK, libc::MADV_HUGEPAGE) };
        Some(Arc::new(Self { ptr }))
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout()) };
    }
}

/// Immutable weight bytes: their own vector, or a range of a shared chunk.
#[derive(Clone)]
pub(crate) struct Bytes(Repr);

#[derive(Clone)]
enum Repr {
    Own(Vec<u8>),
    Packed {
        chunk: Arc<Chunk>,
        at: usize,
        len: usize,
    },
}

impl Bytes {
    /// `data`, copied into a shared huge-page chunk when it is under 2 MiB (and not empty),
    /// else kept as it is.
    pub(crate) fn pack(data: Vec<u8>) -> Self {
        SHARED.pack(data)
    }
}

impl Arena {
    const fn new() -> Self {
        Self {
            current: Mutex::new((Weak::new(), CHUNK)),
        }
    }

    fn pack(&self, data: Vec<u8>) -> Bytes {
        let len = data.len();
        if len == 0 || len >= HUGE {
            return Bytes(Repr::Own(data));
        }
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let (chunk, at) = match current.0.upgrade() {
            Some(chunk) if current.1 + len <= CHUNK => (chunk, current.1),
            _ => match Chunk::new() {
                Some(chunk) => (chunk, 0),
                None => return Bytes(Repr::Own(data)),
            },
        };
        *current = (Arc::downgrade(&chunk), (at + len).next_multiple_of(LINE));
        drop(current);
        // SAFETY: `at..at + len` lies inside the chunk (checked above) and no other `Bytes`
        // covers it: the range was handed out just now, under the lock, to this call only.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), chunk.ptr.as_ptr().add(at), len) };
        Bytes(Repr::Packed { chunk, at, len })
    }
}

impl Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Own(v) => v,
            // SAFETY: the range was written in `pack` before this value existed, lies inside
            // the chunk this value keeps alive, and is never written again.
            Repr::Packed { chunk, at, len } => unsafe {
                std::slice::from_raw_parts(chunk.ptr.as_ptr().add(*at), *len)
            },
        }
    }
}

impl fmt::Debug for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let packed = matches!(self.0, Repr::Packed { .. });
        write!(f, "Bytes({} bytes, packed: {packed})", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(seed: usize, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8 ^ seed as u8)
            .collect()
    }

    /// Buffers under 2 MiB, packed from several threads at once, keep every byte, share
    /// 2 MiB-aligned chunks (each starting on a cache line), larger ones keep their own
    /// vector, and the chunks are freed with their last buffer.
    #[test]
    fn small_buffers_share_chunks_keep_their_bytes_and_free_them() {
        // An arena of its own: other tests of the crate pack weights into the shared one.
        let arena = Arena::new();
        let arena = &arena;
        let sizes = [
            1 << 20,
            3000,
            1_500_000,
            64,
            700_001,
            (2 << 20) - 1,
            2 << 20,
            5 << 20,
        ];
        let packed: Vec<Vec<(usize, Bytes)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|t| {
                    s.spawn(move || {
                        (0..12)
                            .map(|i| {
                                let len = sizes[(i + t) % sizes.len()];
                                (t * 100 + i, arena.pack(pattern(t * 100 + i, len)))
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all: Vec<&(usize, Bytes)> = packed.iter().flatten().collect();
        for (seed, b) in &all {
            assert_eq!(&b[..], &pattern(*seed, b.len())[..], "buffer {seed}");
            match &b.0 {
                Repr::Packed { chunk, at, len } => {
                    assert!(*len < HUGE && at % LINE == 0 && at + len <= CHUNK);
                    assert_eq!(chunk.ptr.as_ptr() as usize % HUGE, 0);
                }
                Repr::Own(v) => assert!(v.len() >= HUGE, "{} bytes kept apart", v.len()),
            }
        }
        // Ranges in one chunk never overlap.
        let mut ranges: Vec<(usize, usize)> = all
            .iter()
            .filter_map(|(_, b)| match &b.0 {
                Repr::Packed { chunk, at, len } => {
                    let base = chunk.ptr.as_ptr() as usize + at;
                    Some((base, base + len))
                }
                Repr::Own(_) => None,
            })
            .collect();
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
        // As many chunks as the small buffers' bytes need (~31 MB: two), all freed with them.
        let small: usize = all.iter().map(|(_, b)| b.len()).filter(|&n| n < HUGE).sum();
        let mut chunks: Vec<Weak<Chunk>> = Vec::new();
        for (_, b) in &all {
            if let Repr::Packed { chunk, .. } = &b.0 {
                if !chunks.iter().any(|c| c.ptr_eq(&Arc::downgrade(chunk))) {
                    chunks.push(Arc::downgrade(chunk));
                }
            }
        }
        assert!(
            chunks.len() >= small.div_ceil(CHUNK) && small > CHUNK,
            "{} chunks for {small} bytes",
            chunks.len()
        );
        drop(packed);
        assert!(chunks.iter().all(|c| c.upgrade().is_none()));
    }
}
