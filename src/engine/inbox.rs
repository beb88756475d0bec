//! What callers hand the engine thread: accepted requests, aborts, a shutdown, and control
//! calls that want an answer. One lock orders them against the engine thread's decision to
//! stop, so a request accepted by `submit` is always seen by the engine thread (which then owes
//! it a terminal event), and a request refused with SHUTDOWN never is.
//!
//! Nothing here is sized by a user number: submits are bounded by admission (they are counted
//! in `queued_requests` before they are pushed), aborts by the live requests (one entry per id),
//! controls by the callers blocked waiting for their answers.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crossbeam_channel::Sender;
use serde_json::Value;

use super::event::EventCallback;
use super::shared::{ExportedSequence, Pending, PoolUsage, ShutdownMode};
use crate::error::Result;
use crate::kv::cache::Tier;
use crate::pd::Notice;

/// A call that waits for the engine thread's answer.
pub enum Control {
    SetCallback(Option<Arc<dyn EventCallback>>, Sender<()>),
    Score(Vec<u32>, Sender<Result<Vec<f32>>>),
    /// Drop every unlocked cached prefix of a tier; reports the device units still in use.
    FlushCache(Tier, Sender<PoolUsage>),
    /// The cache's per-pool, per-tier usage and counters.
    CacheStats(Sender<Value>),
    /// A decoding request's state (it keeps running).
    Export(u64, Sender<Result<ExportedSequence>>),
    /// Tests only: the engine thread panics with this message (the dead-engine path).
    #[cfg(test)]
    Panic(&'static str),
}

/// Everything taken from the inbox at once, in the order the engine thread handles it.
#[derive(Default)]
pub struct Batch {
    pub submits: Vec<Pending>,
    pub aborts: Vec<u64>,
    pub controls: Vec<Control>,
    pub shutdown: Option<ShutdownMode>,
    /// What the PD node reported (claims done, states arrived, rooms failed).
    pub pd: Vec<Notice>,
}

#[derive(Default)]
struct State {
    pd: Vec<Notice>,
    submits: VecDeque<Pending>,
    aborts: Vec<u64>,
    aborted: HashSet<u64>,
    controls: VecDeque<Control>,
    shutdown: Option<ShutdownMode>,
    /// Cleared by the first shutdown: later submits are refused.
    refusing: bool,
    /// The engine thread has stopped taking from the inbox.
    closed: bool,
    /// Something changed that an idle engine thread should look at (events were polled).
    woken: bool,
    /// The engine thread waits in `take` (whoever adds work wakes it, once).
    waiting: bool,
}

impl State {
    fn is_empty(&self) -> bool {
        self.submits.is_empty()
            && self.aborts.is_empty()
            && self.controls.is_empty()
            && self.pd.is_empty()
    }
}

#[derive(Default)]
pub struct Inbox {
    state: Mutex<State>,
    ready: Condvar,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every operation is a few pushes or a swap: a panic cannot leave it half-done.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Releases the lock, then wakes the engine thread if it waits in [`Self::take`] (it
    /// checked for work under the lock before it waited, so nothing is missed). Woken while
    /// the lock was still held, it would find the lock taken and sleep again until released:
    /// two context switches a wake-up instead of one, and on a machine with few cores the
    /// woken engine thread preempts the caller first (each decode submit of a burst, each
    /// PD notice did that).
    fn wake_after(&self, mut s: MutexGuard<'_, State>) {
        let waiting = std::mem::take(&mut s.waiting);
        drop(s);
        if waiting {
            self.ready.notify_one();
        }
    }

    /// Hands an accepted request to the engine thread; gives it back when a shutdown has
    /// begun (the caller refuses it with SHUTDOWN and undoes its admission).
    pub fn submit(&self, p: Pending) -> std::result::Result<(), Box<Pending>> {
        let mut s = self.lock();
        if s.refusing || s.closed {
            return Err(Box::new(p));
        }
        s.submits.push_back(p);
        self.wake_after(s);
        Ok(())
    }

    /// Asks the engine thread to end request `id`. Never blocks; repeated aborts of one id
    /// take one entry.
    pub fn abort(&self, id: u64) {
        let mut s = self.lock();
        if !s.closed && s.aborted.insert(id) {
            s.aborts.push(id);
            self.wake_after(s);
        }
    }

    /// Queues a control call; gives it back when the engine thread has stopped.
    pub fn control(&self, c: Control) -> std::result::Result<(), Control> {
        let mut s = self.lock();
        if s.closed {
            return Err(c);
        }
        s.controls.push_back(c);
        self.wake_after(s);
        Ok(())
    }

    /// Hands the engine thread a PD notice; dropped once it has stopped (its requests have
    /// all ended).
    pub fn pd_notice(&self, n: Notice) {
        let mut s = self.lock();
        if !s.closed {
            s.pd.push(n);
            self.wake_after(s);
        }
    }

    /// [`Self::pd_notice`] for several, with one wake-up.
    pub fn pd_notices(&self, ns: Vec<Notice>) {
        let mut s = self.lock();
        if !s.closed && !ns.is_empty() {
            s.pd.extend(ns);
            self.wake_after(s);
        }
    }

    /// Stops intake and asks the engine thread to stop; an abort overrides an earlier drain.
    pub fn shutdown(&self, mode: ShutdownMode) {
        let mut s = self.lock();
        s.refusing = true;
        if s.shutdown != Some(ShutdownMode::Abort) {
            s.shutdown = Some(mode);
        }
        self.wake_after(s);
    }

    /// The shutdown asked for, if any (an abort overrides a drain).
    pub fn shutdown_mode(&self) -> Option<ShutdownMode> {
        self.lock().shutdown
    }

    pub fn accepting(&self) -> bool {
        let s = self.lock();
        !s.refusing && !s.closed
    }

    /// Wakes an engine thread waiting in `take` (e.g. events were polled: paused requests
    /// may continue).
    pub fn wake(&self) {
        let mut s = self.lock();
        s.woken = true;
        self.wake_after(s);
    }

    /// Everything queued; when nothing is and `wait` is given, waits up to that long for
    /// something (or a wake-up) first.
    pub fn take(&self, wait: Option<Duration>) -> Batch {
        let mut s = self.lock();
        if let Some(wait) = wait {
            if s.is_empty() && !s.woken {
                s.waiting = true;
                s = self
                    .ready
                    .wait_timeout(s, wait)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                s.waiting = false;
            }
        }
        s.woken = false;
        s.aborted.clear();
        Batch {
            submits: s.submits.drain(..).collect(),
            aborts: std::mem::take(&mut s.aborts),
            controls: s.controls.drain(..).collect(),
            shutdown: s.shutdown,
            pd: std::mem::take(&mut s.pd),
        }
    }

    /// The engine thread's last step: closes the inbox if nothing arrived since its last
    /// `take` (then nothing else ever will); otherwise it must take and handle that first.
    pub fn close_if_empty(&self) -> bool {
        let mut s = self.lock();
        if s.submits.is_empty() && s.controls.is_empty() {
            s.closed = true;
            s.aborts.clear();
            true
        } else {
            false
        }
    }

    /// Closes the inbox whatever it holds (the engine thread died) and returns what was left.
    pub fn close(&self) -> Batch {
        let mut s = self.lock();
        s.closed = true;
        s.refusing = true;
        s.aborts.clear();
        Batch {
            submits: s.submits.drain(..).collect(),
            aborts: Vec::new(),
            controls: s.controls.drain(..).collect(),
            shutdown: s.shutdown,
            pd: std::mem::take(&mut s.pd),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_shutdown_submits_are_given_back_and_nothing_is_lost_before_it() {
        let inbox = Inbox::default();
        let pending = |id| Pending {
            id,
            spec: Default::default(),
            submitted: std::time::Instant::now(),
            max_gen: 1,
            import: None,
        };
        assert!(inbox.submit(pending(1)).is_ok());
        inbox.shutdown(ShutdownMode::Drain);
        assert!(!inbox.accepting());
        assert_eq!(inbox.submit(pending(2)).unwrap_err().id, 2);
        // The engine thread cannot close while request 1 is still unseen.
        assert!(!inbox.close_if_empty());
        let batch = inbox.take(None);
        assert_eq!(batch.submits.len(), 1);
        assert_eq!(batch.shutdown, Some(ShutdownMode::Drain));
        assert!(inbox.close_if_empty());
        let (tx, _rx) = crossbeam_channel::bounded(1);
        assert!(inbox.control(Control::CacheStats(tx)).is_err());
    }

    /// A waiting engine thread is woken by whatever arrives, every kind of call, each time
    /// (the wake-up goes after the lock is released, and only to a thread that waits); work
    /// that arrives while it is busy is taken without a wait.
    #[test]
    fn a_waiting_engine_thread_wakes_for_every_kind_of_work() {
        let inbox = Arc::new(Inbox::default());
        let calls: [fn(&Inbox); 6] = [
            |i| {
                let p = Pending {
                    id: 1,
                    spec: Default::default(),
                    submitted: std::time::Instant::now(),
                    max_gen: 1,
                    import: None,
                };
                assert!(i.submit(p).is_ok());
            },
            |i| i.abort(9),
            |i| i.pd_notice(Notice::Released { room: 3 }),
            |i| i.pd_notices(vec![Notice::Released { room: 4 }]),
            |i| i.wake(),
            |i| i.shutdown(ShutdownMode::Drain),
        ];
        for (n, call) in calls.iter().enumerate() {
            let waiter = {
                let inbox = inbox.clone();
                std::thread::spawn(move || {
                    let t = std::time::Instant::now();
                    let batch = inbox.take(Some(Duration::from_secs(30)));
                    let got = batch.submits.len() + batch.aborts.len() + batch.pd.len();
                    (t.elapsed(), got, batch.shutdown.is_some())
                })
            };
            // Until the waiter waits, a call finds nobody to wake and the waiter finds the
            // work without waiting: either way it returns at once.
            std::thread::sleep(Duration::from_millis(50));
            call(&inbox);
            let (waited, got, shutdown) = waiter.join().unwrap();
            assert!(
                waited < Duration::from_secs(10),
                "call {n}: woken after {waited:?}"
            );
            assert_eq!(got + usize::from(shutdown), usize::from(n != 4), "call {n}");
        }
        // Work queued while the engine thread is busy: taken at once, all of it.
        inbox.pd_notice(Notice::Released { room: 5 });
        inbox.pd_notice(Notice::Released { room: 6 });
        let t = std::time::Instant::now();
        assert_eq!(inbox.take(Some(Duration::from_secs(30))).pd.len(), 2);
        assert!(t.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn aborts_of_one_id_take_one_entry_and_abort_overrides_drain() {
        let inbox = Inbox::default();
        for _ in 0..10_000 {
            inbox.abort(7);
        }
        inbox.shutdown(ShutdownMode::Abort);
        inbox.shutdown(ShutdownMode::Drain);
        let batch = inbox.take(Some(Duration::ZERO));
        assert_eq!(batch.aborts, vec![7]);
        assert_eq!(batch.shutdown, Some(ShutdownMode::Abort));
    }
}
