//! The CPU backend's tier copy engine: one thread that runs queued copies in order and
//! completes their tickets, so forward steps and copies overlap.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Sender};

use crate::backend::tier::{CopyDirection, HostPtr, Ticket, TierCopy};

struct Job {
    base: HostPtr,
    direction: CopyDirection,
    copies: Vec<TierCopy>,
    ticket: Arc<Ticket>,
}

/// The copy thread, started on first use and joined on drop.
#[derive(Default)]
pub(super) struct Copier {
    inner: Mutex<Option<(Sender<Job>, JoinHandle<()>)>>,
    /// Bytes per second (tests that need a copy still in flight); None = as fast as memcpy.
    throttle: Arc<Mutex<Option<f64>>>,
}

impl Copier {
    pub(super) fn submit(
        &self,
        base: *mut u8,
        direction: CopyDirection,
        copies: Vec<TierCopy>,
        ticket: &Arc<Ticket>,
    ) {
        ticket.add_part();
        let job = Job {
            base: HostPtr(base),
            direction,
            copies,
            ticket: Arc::clone(ticket),
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (tx, _) = inner.get_or_insert_with(|| {
            let (tx, rx) = unbounded::<Job>();
            let throttle = Arc::clone(&self.throttle);
            let handle = std::thread::Builder::new()
                .name("dsv4-copy".into())
                .spawn(move || {
                    crate::threads::mark_internal();
                    for job in rx {
                        run(job, &throttle);
                    }
                })
                .expect("spawning the copy thread");
            (tx, handle)
        });
        if let Err(e) = tx.send(job) {
            // The thread is gone (only during drop): complete the part so no one waits forever.
            e.0.ticket.complete_part(0);
        }
    }

    pub(super) fn set_throttle(&self, bytes_per_s: Option<f64>) {
        *self.throttle.lock().unwrap_or_else(|e| e.into_inner()) = bytes_per_s;
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        let taken = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((tx, handle)) = taken {
            drop(tx);
            let _ = handle.join();
        }
    }
}

fn run(job: Job, throttle: &Mutex<Option<f64>>) {
    let started = Instant::now();
    let mut bytes = 0u64;
    for c in &job.copies {
        // SAFETY: `base` is the first byte of a live pool buffer and `pool_offset + len` lies
        // within it; `host` points to `len` bytes of live host memory. The submitter keeps both
        // alive and untouched until the ticket completes (tier copy protocol, see
        // `Backend::copy_tier`), and the two sides are different allocations.
        unsafe {
            let pool = job.base.0.add(c.pool_offset);
            match job.direction {
                CopyDirection::ToHost => std::ptr::copy_nonoverlapping(pool, c.host.0, c.len),
                CopyDirection::FromHost => std::ptr::copy_nonoverlapping(c.host.0, pool, c.len),
            }
        }
        bytes += c.len as u64;
    }
    let limit = *throttle.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rate) = limit.filter(|r| *r > 0.0) {
        let due = Duration::from_secs_f64(bytes as f64 / rate);
        if let Some(left) = due.checked_sub(started.elapsed()) {
            std::thread::sleep(left);
        }
    }
    job.ticket.complete_part(bytes);
}
