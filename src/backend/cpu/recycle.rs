//! Large f32 buffers of the CPU backend kept for reuse, so a step's big intermediate tensors
//! land in pages that are already resident.
//!
//! Why: glibc serves an allocation above its mmap threshold (at most 32 MiB, and every one
//! above 64 MiB from a thread's arena) with a fresh mapping, and gives the top of a thread
//! arena's heap back to the kernel when it is freed; either way the next allocation of that
//! size faults its pages in again, 4 KiB at a time. A 512-token prefill of the bench's large
//! model allocates hundreds of MiB of such tensors (product outputs, split parts, widened
//! weight blocks, the indexer's scores) and paid ~35 thousand page faults a prefill for them
//! (`perf stat -e page-faults`: 250 against 80 thousand for six prefills); keeping them here
//! made the prefill ~8 % faster (docs/model.md §4.2, stop 43). A buffer comes back when its
//! tensor drops (or its op is done with it) and goes to the next op needing about that size.
//!
//! Buffers are kept only while a CPU backend lives: when the last one is dropped the idle
//! buffers are freed, and a tensor dropped after that frees its own (a host that closes its
//! engines gets the memory back).
//!
//! Only buffers of at least [`MIN_BYTES`] are kept (malloc serves smaller ones from its
//! heap without faults), at most [`MAX_IDLE_BYTES`] of them idle at once (the rest are
//! freed as before), and a request takes a buffer at most twice its size, so a small tensor
//! never pins a huge buffer.
//!
//! Kept buffers are the prefill's working memory, outside the memory plan: a burst of long
//! prompts of different lengths leaves buffers of many sizes behind, up to [`MAX_IDLE_BYTES`].
//! A server whose resident memory stayed there between bursts looked like a leak against its
//! plan (hundreds of MiB over a few bursts), so an engine with nothing to compute hands back
//! the buffers idle for [`IDLE_KEEP`] ([`release_idle`]), and malloc its free pages: the next
//! burst's first steps fault them in again, the steps within a burst still reuse them.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Buffers smaller than this go back to malloc.
pub const MIN_BYTES: usize = 1 << 20;
/// Idle bytes kept at most; a buffer handed back beyond it is freed.
pub const MAX_IDLE_BYTES: usize = 1 << 30;
/// How long an idle engine keeps a buffer nobody took ([`release_idle`]).
pub const IDLE_KEEP: Duration = Duration::from_secs(2);

const F32: usize = std::mem::size_of::<f32>();

#[derive(Default)]
struct Idle {
    /// Kept buffers and when each was handed back, any order (a step holds a few dozen sizes
    /// at most).
    buffers: Vec<(Vec<f32>, Instant)>,
    /// Sum of their capacities, in bytes.
    bytes: usize,
}

/// A set of kept buffers; the backend's tensors use the process's one ([`zeroed`], [`give`]).
pub struct Recycler {
    idle: Mutex<Idle>,
    max_idle_bytes: usize,
    /// Backends alive: buffers are kept only while there is one.
    backends: AtomicUsize,
}

static POOL: Recycler = Recycler::new(MAX_IDLE_BYTES);

impl Recycler {
    pub const fn new(max_idle_bytes: usize) -> Self {
        Recycler {
            idle: Mutex::new(Idle {
                buffers: Vec::new(),
                bytes: 0,
            }),
            max_idle_bytes,
            backends: AtomicUsize::new(0),
        }
    }

    /// A backend that will use these buffers started.
    pub fn opened(&self) {
        self.backends.fetch_add(1, Ordering::SeqCst);
    }

    /// A backend stopped; after the last one, the idle buffers are freed.
    pub fn closed(&self) {
        if self.backends.fetch_sub(1, Ordering::SeqCst) == 1 {
            let freed = std::mem::take(&mut *self.idle());
            drop(freed);
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Idle> {
        // A panic while holding the lock leaves the list consistent (push/swap_remove only).
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A kept buffer whose capacity is in `[len, 2 len]`, the smallest such, with the values
    /// it held (callers clear or truncate it).
    fn reuse(&self, len: usize) -> Option<Vec<f32>> {
        if len * F32 < MIN_BYTES {
            return None;
        }
        let mut idle = self.idle();
        let at = idle
            .buffers
            .iter()
            .enumerate()
            .filter(|(_, (b, _))| b.capacity() >= len && b.capacity() / 2 <= len)
            .min_by_key(|(_, (b, _))| b.capacity())
            .map(|(i, _)| i)?;
        let (buffer, _) = idle.buffers.swap_remove(at);
        idle.bytes -= buffer.capacity() * F32;
        Some(buffer)
    }

    /// `len` zeros (what `vec![0.0; len]` gives), in a kept buffer when one fits.
    pub fn zeroed(&self, len: usize) -> Vec<f32> {
        self.sized(len, false)
    }

    /// `len` values for the caller to overwrite, every one: a kept buffer's earlier values
    /// where it had them (no pass zeroing what is about to be written), zeros elsewhere.
    pub fn overwritten(&self, len: usize) -> Vec<f32> {
        self.sized(len, true)
    }

    /// `len` values: a kept buffer's first ones where `keep` (zeros past what it held),
    /// else zeros; a fresh zeroed allocation when no buffer fits.
    fn sized(&self, len: usize, keep: bool) -> Vec<f32> {
        let Some(mut buffer) = self.reuse(len) else {
            return vec![0.0; len];
        };
        if keep {
            buffer.truncate(len);
        } else {
            buffer.clear();
        }
        buffer.resize(len, 0.0);
        buffer
    }

    /// An empty vector with room for `len` values (what `Vec::with_capacity(len)` gives), in
    /// a kept buffer when one fits.
    pub fn with_capacity(&self, len: usize) -> Vec<f32> {
        match self.reuse(len) {
            Some(mut buffer) => {
                buffer.clear();
                buffer
            }
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps `buffer` for reuse (a large one, while there is room), or frees it.
    pub fn give(&self, buffer: Vec<f32>) {
        let bytes = buffer.capacity() * F32;
        if bytes < MIN_BYTES || self.backends.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut idle = self.idle();
        if idle.bytes + bytes <= self.max_idle_bytes {
            idle.bytes += bytes;
            idle.buffers.push((buffer, Instant::now()));
            return;
        }
        drop(idle);
        drop(buffer);
    }

    /// Frees the buffers handed back more than `keep` ago (at `now`); the bytes freed.
    pub fn release_older_than(&self, keep: Duration, now: Instant) -> usize {
        let mut idle = self.idle();
        let (old, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut idle.buffers)
            .into_iter()
            .partition(|(_, since)| now.saturating_duration_since(*since) > keep);
        idle.buffers = kept;
        let freed: usize = old.iter().map(|(b, _)| b.capacity() * F32).sum();
        idle.bytes -= freed;
        drop(idle);
        drop(old);
        freed
    }

    /// Idle buffers and their bytes.
    #[cfg(test)]
    pub fn idle_now(&self) -> (usize, usize) {
        let idle = self.idle();
        (idle.buffers.len(), idle.bytes)
    }
}

/// A CPU backend started: large buffers are kept while one lives.
pub fn backend_opened() {
    POOL.opened()
}

/// A CPU backend stopped: after the last one, the kept buffers are freed.
pub fn backend_closed() {
    POOL.closed()
}

/// `len` zeros, in one of the process's kept buffers when one fits.
pub fn zeroed(len: usize) -> Vec<f32> {
    POOL.zeroed(len)
}

/// `len` values for the caller to overwrite, every one (no zeroing pass over a kept buffer).
pub fn overwritten(len: usize) -> Vec<f32> {
    POOL.overwritten(len)
}

/// An empty vector with room for `len` values, in a kept buffer when one fits.
pub fn with_capacity(len: usize) -> Vec<f32> {
    POOL.with_capacity(len)
}

/// `values` copied (what `values.to_vec()` gives), into a kept buffer when one fits.
pub fn copied(values: &[f32]) -> Vec<f32> {
    let mut out = with_capacity(values.len());
    out.extend_from_slice(values);
    out
}

/// Hands `buffer` to the process's kept buffers (a large one, while there is room), or frees it.
pub fn give(buffer: Vec<f32>) {
    POOL.give(buffer)
}

/// An engine has nothing to compute: the process's buffers idle for [`IDLE_KEEP`] are freed,
/// and when that freed any, malloc returns its free pages to the kernel (buffers under its
/// mmap threshold came from its heaps, which keep freed memory otherwise).
pub fn release_idle() {
    if POOL.release_older_than(IDLE_KEEP, Instant::now()) > 0 {
        trim_malloc();
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim_malloc() {
    // SAFETY: malloc_trim only returns free heap memory to the kernel; it reads and writes no
    // memory of ours and is safe to call from any thread at any time.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim_malloc() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_buffers_come_back_zeroed_and_small_ones_are_not_kept() {
        let pool = Recycler::new(6 << 20);
        pool.opened();
        let len = (3 << 20) / F32 + 7;
        let mut a = pool.zeroed(len);
        a.iter_mut().for_each(|x| *x = 5.0);
        let ptr = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.idle_now().0, 1);
        let b = pool.zeroed(len - 3);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer is reused");
        assert_eq!(b.len(), len - 3);
        assert!(b.iter().all(|&x| x == 0.0), "a reused buffer is zeroed");
        pool.give(b);
        // A request of less than half its capacity does not take it.
        let c = pool.zeroed(len / 2 - 1);
        assert_ne!(c.as_ptr(), ptr);
        let d = pool.with_capacity(len);
        assert_eq!(d.as_ptr(), ptr);
        assert!(d.is_empty() && d.capacity() >= len);
        assert_eq!(pool.idle_now(), (0, 0));
        // `overwritten` leaves a kept buffer's values (the caller writes them all).
        let mut e = d;
        e.resize(len, 2.0);
        pool.give(e);
        let f = pool.overwritten(len - 1);
        assert_eq!(f.as_ptr(), ptr);
        assert_eq!(f.len(), len - 1);
        assert!(f.iter().all(|&x| x == 2.0));
        let d = f;
        // Small buffers are not kept; past the idle limit, buffers are freed.
        pool.give(vec![0.0f32; 1000]);
        assert_eq!(pool.idle_now(), (0, 0));
        pool.give(c);
        pool.give(d);
        let kept = pool.idle_now();
        assert_eq!(kept.0, 2);
        pool.give(vec![0.0; len]);
        assert_eq!(
            pool.idle_now(),
            kept,
            "a third buffer would pass 6 MiB idle"
        );
    }

    #[test]
    fn buffers_are_kept_only_while_a_backend_lives() {
        let pool = Recycler::new(64 << 20);
        let len = (2 << 20) / F32;
        pool.give(vec![0.0; len]);
        assert_eq!(pool.idle_now().0, 0, "no backend: freed");
        pool.opened();
        pool.opened();
        pool.give(vec![0.0; len]);
        pool.closed();
        assert_eq!(pool.idle_now().0, 1, "one backend still lives");
        pool.closed();
        assert_eq!(pool.idle_now(), (0, 0), "the last one freed them");
        pool.give(vec![0.0; len]);
        assert_eq!(pool.idle_now().0, 0);
    }

    #[test]
    fn idle_buffers_are_freed_after_the_keep_time_and_fresh_ones_stay() {
        let pool = Recycler::new(64 << 20);
        pool.opened();
        let len = (2 << 20) / F32;
        let t0 = Instant::now();
        pool.give(vec![0.0; len]);
        pool.give(vec![0.0; 2 * len]);
        assert_eq!(pool.idle_now(), (2, 3 * len * F32));
        // Nothing older than a second yet.
        assert_eq!(pool.release_older_than(Duration::from_secs(1), t0), 0);
        assert_eq!(pool.idle_now().0, 2);
        // A buffer taken and handed back again is fresh; the other one is released.
        let again = pool.zeroed(2 * len);
        std::thread::sleep(Duration::from_millis(30));
        pool.give(again);
        let later = Instant::now();
        assert_eq!(
            pool.release_older_than(Duration::from_millis(20), later),
            len * F32
        );
        assert_eq!(pool.idle_now(), (1, 2 * len * F32));
        assert_eq!(
            pool.release_older_than(Duration::ZERO, later + Duration::from_millis(1)),
            2 * len * F32
        );
        assert_eq!(pool.idle_now(), (0, 0));
        pool.closed();
    }

    #[test]
    fn copied_is_to_vec() {
        let values: Vec<f32> = (0..(1 << 19)).map(|i| i as f32).collect();
        assert_eq!(copied(&values), values);
        assert_eq!(copied(&[1.0, 2.0]), vec![1.0, 2.0]);
    }
}
