//! Wall time of each CPU backend op while recording is on (`bench_forward --op-times`): what
//! a decode step or a prefill spends its time on, measured on the thread that runs the step,
//! so the time a product waits for its last part and the serial stretches between products
//! count where a sampling profile spreads them over worker threads. Products are labelled by
//! shape and storage format. Off by default: an op then pays one relaxed atomic load.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

static ON: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<String, Total>> = Mutex::new(BTreeMap::new());

/// One label's calls, seconds, weight bytes read and FLOPs.
#[derive(Debug, Default, Clone, Copy)]
struct Total {
    calls: u64,
    seconds: f64,
    bytes: u64,
    flops: u64,
}

thread_local! {
    /// Ops running on this thread: one op calling another (routing runs the gate product)
    /// counts once, as the outer op.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// One op's calls and wall seconds since recording started; for products, the weight bytes
/// they read and their FLOPs (0 for other ops).
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op, products with their shape and storage: `matmul 1 x 1024 -> 2048 fp8`.
    pub op: String,
    pub calls: u64,
    pub seconds: f64,
    pub bytes: u64,
    pub flops: u64,
}

/// Starts (clearing what was recorded) or stops recording the ops' times, process-wide.
pub fn record_op_times(on: bool) {
    if on {
        totals().clear();
    }
    ON.store(on, Ordering::Relaxed);
}

/// What was recorded, the most time first.
pub fn take_op_times() -> Vec<OpTime> {
    let mut v: Vec<OpTime> = std::mem::take(&mut *totals())
        .into_iter()
        .map(|(op, t)| OpTime {
            op,
            calls: t.calls,
            seconds: t.seconds,
            bytes: t.bytes,
            flops: t.flops,
        })
        .collect();
    v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    v
}

fn totals() -> std::sync::MutexGuard<'static, BTreeMap<String, Total>> {
    TOTALS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Times the op it was made for until dropped (nothing when recording is off). Only the
/// outermost op of a thread keeps what it records; an inner one only holds its depth.
pub(super) struct OpTimer {
    counted: bool,
    outer: Option<Outer>,
}

/// What the outermost op of a thread records: its label, weight bytes, FLOPs and start.
struct Outer {
    label: String,
    bytes: u64,
    flops: u64,
    start: Instant,
}

/// A timer for an op named `name`.
pub(super) fn op(name: &'static str) -> OpTimer {
    product(|| name.to_string(), || (0, 0))
}

/// A timer for an op whose label `label` makes, reading `work()` = (weight bytes, FLOPs)
/// (both only called while recording).
pub(super) fn product(
    label: impl FnOnce() -> String,
    work: impl FnOnce() -> (u64, u64),
) -> OpTimer {
    if !ON.load(Ordering::Relaxed) {
        return OpTimer {
            counted: false,
            outer: None,
        };
    }
    let depth = DEPTH.with(|d| {
        d.set(d.get() + 1);
        d.get()
    });
    let outer = (depth == 1).then(|| {
        let (bytes, flops) = work();
        Outer {
            label: label(),
            bytes,
            flops,
            start: Instant::now(),
        }
    });
    OpTimer {
        counted: true,
        outer,
    }
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        if self.counted {
            DEPTH.with(|d| d.set(d.get() - 1));
        }
        if let Some(o) = self.outer.take() {
            let seconds = o.start.elapsed().as_secs_f64();
            let mut t = totals();
            let e = t.entry(o.label).or_default();
            e.calls += 1;
            e.seconds += seconds;
            e.bytes += o.bytes;
            e.flops += o.flops;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The label's calls and seconds, if recorded (other tests may record their own ops
    /// meanwhile).
    fn entry(label: &str) -> Option<(u64, f64)> {
        totals().get(label).map(|t| (t.calls, t.seconds))
    }

    #[test]
    fn ops_are_timed_only_while_recording_and_nested_ops_count_once() {
        {
            let _t = op("op_times test: before");
        }
        assert_eq!(entry("op_times test: before"), None);
        record_op_times(true);
        for _ in 0..3 {
            let _outer = product(|| "op_times test: outer".to_string(), || (1000, 24));
            let _inner = product(|| "op_times test: inner".to_string(), || (7, 7));
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        record_op_times(false);
        {
            let _t = op("op_times test: after");
        }
        let (calls, seconds) = entry("op_times test: outer").expect("recorded");
        assert_eq!(calls, 3);
        assert!(seconds >= 0.006, "{seconds}");
        assert_eq!(entry("op_times test: inner"), None);
        assert_eq!(entry("op_times test: after"), None);
        // The outer op's work three times; the inner's counted nowhere.
        assert!(take_op_times().iter().any(
            |t| t.op == "op_times test: outer" && (t.calls, t.bytes, t.flops) == (3, 3000, 72)
        ));
    }
}
