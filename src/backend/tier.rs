//! Asynchronous copies between pool buffers and host memory (the HiCache tiers), with
//! completion tracking. The CPU backend runs them on a copy-engine thread; a CUDA backend maps
//! the same calls onto a copy stream and events (one ticket part per layer if it wants
//! per-layer completion).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// An address in host memory that an asynchronous copy reads or writes. Its owner keeps the
/// memory alive, and the range untouched, until the copy's ticket completes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostPtr(pub *mut u8);

// SAFETY: a plain address handed to the copy engine; the owner's protocol (above) guarantees
// the memory outlives the copy and is not accessed concurrently.
unsafe impl Send for HostPtr {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyDirection {
    /// Pool → host (backup).
    ToHost,
    /// Host → pool (load-back).
    FromHost,
}

/// One contiguous copy: `len` bytes at `pool_offset` of a pool buffer and at `host`.
#[derive(Debug, Clone, Copy)]
pub struct TierCopy {
    pub pool_offset: usize,
    pub host: HostPtr,
    pub len: usize,
}

/// Completion of a batch of copies, part by part. A ticket starts open; every `copy_tier`
/// call adds a part; `seal` says no more parts come. It is done when sealed and every part
/// has landed.
pub struct Ticket {
    /// Parts not yet landed, plus one until sealed.
    pending: AtomicUsize,
    bytes: AtomicU64,
    started: Instant,
    finished: Mutex<Option<Instant>>,
    cv: Condvar,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("done", &self.is_done())
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl Ticket {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            pending: AtomicUsize::new(1),
            bytes: AtomicU64::new(0),
            started: Instant::now(),
            finished: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    /// Registers one more part (called by the backend when it queues copies).
    pub fn add_part(&self) {
        self.pending.fetch_add(1, Ordering::SeqCst);
    }

    /// One part has landed (called by the copy engine).
    pub fn complete_part(&self, bytes: u64) {
        self.bytes.fetch_add(bytes, Ordering::SeqCst);
        self.release();
    }

    /// No more parts will be added.
    pub fn seal(&self) {
        self.release();
    }

    fn release(&self) {
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            let mut f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
            *f = Some(Instant::now());
            self.cv.notify_all();
        }
    }

    pub fn is_done(&self) -> bool {
        self.pending.load(Ordering::SeqCst) == 0
    }

    /// Blocks until done.
    pub fn wait(&self) {
        let mut f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        while f.is_none() {
            f = self.cv.wait(f).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks until done or `timeout`; returns whether done.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let Some(deadline) = Instant::now().checked_add(timeout) else {
            self.wait();
            return true;
        };
        let mut f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        while f.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            f = self
                .cv
                .wait_timeout(f, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Bytes copied so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// Seconds from creation to completion (so far, if not done).
    pub fn seconds(&self) -> f64 {
        let f = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        f.unwrap_or_else(Instant::now)
            .duration_since(self.started)
            .as_secs_f64()
    }
}
