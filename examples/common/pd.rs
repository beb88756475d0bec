//! A router in front of a prefill engine and a decode engine in this process (`make demo`'s PD
//! section, `bench_transfer`): each request gets a room (a fresh non-zero u64) and goes to both
//! engines, the decode with `pd_peer` = the prefill's endpoint. The decode emits every TOKEN
//! and the terminal event; the prefill's events are drained here (TRANSFERRED, or a failure).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use dsv4::engine::{Engine, Event, EventKind, FinishReason, MetricsSnapshot, RequestSpec};
use dsv4::pd::FailReason;

use super::agentic::Serve;

pub struct Pair {
    pub prefill: Engine,
    pub decode: Engine,
    peer: String,
    next_room: AtomicU64,
    /// Prefill requests aborted because the decode refused their twin (see `submit`).
    undone: Mutex<HashSet<u64>>,
    pub undone_count: AtomicUsize,
    /// Prefill requests that ended other than TRANSFERRED (and were not undone by us).
    pub prefill_errors: AtomicUsize,
    pub first_prefill_error: Mutex<Option<String>>,
}

impl Pair {
    pub fn new(prefill: Engine, decode: Engine) -> dsv4::error::Result<Self> {
        let peer = prefill.pd_endpoint()?;
        Ok(Self {
            prefill,
            decode,
            peer,
            next_room: AtomicU64::new(1),
            undone: Mutex::new(HashSet::new()),
            undone_count: AtomicUsize::new(0),
            prefill_errors: AtomicUsize::new(0),
            first_prefill_error: Mutex::new(None),
        })
    }

    /// Submits `spec` under a fresh room; the decode's request id. The prefill goes first: a
    /// prefill refusal (its queue full) then leaves nothing to undo, and it is the refusal a
    /// client retries. The decode's admission bound is sized to cover what the prefill admits,
    /// so it should not refuse; if it does, the prefill's twin is aborted (it would otherwise
    /// compute a prompt nobody claims and hold its pages for `pd.bootstrap_timeout_ms`).
    pub fn submit_room(&self, spec: RequestSpec) -> dsv4::error::Result<u64> {
        let room = self.next_room.fetch_add(1, Ordering::Relaxed);
        let mut on_p = spec.clone();
        on_p.pd_room = room;
        let pid = self.prefill.submit(on_p)?;
        let mut on_d = spec;
        on_d.pd_room = room;
        on_d.pd_peer = Some(self.peer.clone());
        match self.decode.submit(on_d) {
            Ok(id) => Ok(id),
            Err(e) => {
                self.undone.lock().unwrap().insert(pid);
                self.undone_count.fetch_add(1, Ordering::Relaxed);
                let _ = self.prefill.abort(pid);
                Err(e)
            }
        }
    }

    /// Drains the prefill's events (waiting up to `timeout` for the first); how many ended.
    pub fn poll_prefill(&self, timeout: Duration) -> usize {
        let mut ended = 0;
        for e in self.prefill.poll(512, Some(timeout)).expect("poll") {
            if !e.is_terminal() {
                continue;
            }
            ended += 1;
            let undone = self.undone.lock().unwrap().remove(&e.request_id());
            if e.finish_reason() != Some(FinishReason::Transferred) && !undone {
                self.prefill_errors.fetch_add(1, Ordering::Relaxed);
                let mut first = self.first_prefill_error.lock().unwrap();
                if first.is_none() {
                    *first = Some(format!(
                        "{:?} {:?}: {}",
                        e.kind(),
                        e.finish_reason(),
                        e.message().unwrap_or("")
                    ));
                }
            }
        }
        ended
    }
}

impl Serve for Pair {
    fn vocab_size(&self) -> usize {
        self.decode.vocab_size()
    }

    fn submit(&self, spec: RequestSpec) -> dsv4::error::Result<u64> {
        self.submit_room(spec)
    }

    fn poll_events(&self, timeout: Duration) -> Vec<Event> {
        self.poll_prefill(Duration::ZERO);
        self.decode.poll(512, Some(timeout)).expect("poll")
    }
}

/// Rooms one side transferred and failed, its transfer rate, and its per-room bytes
/// histogram, on one line each.
pub fn room_lines(side: &str, m: &MetricsSnapshot) -> Vec<String> {
    let k = &m.kv_transfer;
    let failures: Vec<String> = FailReason::ALL
        .iter()
        .zip(m.pd.failures)
        .filter(|(_, n)| *n > 0)
        .map(|(r, n)| format!("{} {n}", r.label()))
        .collect();
    let h = &m.transfer_bytes;
    let buckets: Vec<String> = h
        .counts
        .iter()
        .enumerate()
        .filter(|(_, &n)| n > 0)
        .map(|(i, n)| {
            let kib = |b: f64| b / 1024.0;
            match (i.checked_sub(1).map(|j| h.bounds[j]), h.bounds.get(i)) {
                (None, Some(&hi)) => format!("≤ {} KiB: {n}", kib(hi)),
                (Some(lo), Some(&hi)) => format!("({}, {}] KiB: {n}", kib(lo), kib(hi)),
                (Some(lo), None) => format!("> {} KiB: {n}", kib(lo)),
                (None, None) => unreachable!("a histogram has at least one bound"),
            }
        })
        .collect();
    vec![
        format!(
            "{side:<8}{} rooms transferred, {:.1} MiB in {:.2} s claim → done ({:.4} GB/s, \
             mean {:.1} ms per room); failures: {}",
            k.requests,
            k.bytes as f64 / 1048576.0,
            k.seconds,
            gbps(k.bytes, k.seconds),
            1e3 * k.seconds / k.requests.max(1) as f64,
            if failures.is_empty() {
                "none".to_string()
            } else {
                failures.join(", ")
            }
        ),
        format!(
            "{:<8}bytes per room: {} rooms, mean {:.0} KiB; {}",
            "",
            h.count,
            h.sum / h.count.max(1) as f64 / 1024.0,
            buckets.join(", ")
        ),
    ]
}

/// Gigabytes (10⁹ bytes) per second; 0 for no time.
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// A TOKEN event that is its request's first.
pub fn is_first_token(e: &Event) -> bool {
    e.kind() == EventKind::Token && e.stats().generated_tokens == 1
}
