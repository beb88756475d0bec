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
static TOTALS: Mutex<BTreeMap<String, (u64, f64)>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// Ops running on this thread: one op calling another (routing runs the gate product)
    /// counts once, as the outer op.
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// One op's calls and wall seconds since recording started.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTime {
    /// The op, products with their shape and storage: `matmul 1 x 1024 -> 2048 fp8`.
    pub op: String,
    pub calls: u64,
    pub seconds: f64,
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
        .map(|(op, (calls, seconds))| OpTime { op, calls, seconds })
        .collect();
    v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    v
}

fn totals() -> std::sync::MutexGuard<'static, BTreeMap<String, (u64, f64)>> {
    TOTALS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Times the op it was made for until dropped (nothing when recording is off).
pub(super) struct OpTimer(Option<(String, Instant)>);

/// A timer for an op named `name`.
pub(super) fn op(name: &'static str) -> OpTimer {
    op_with(|| name.to_string())
}

/// A timer for an op whose label `label` makes (only called while recording).
pub(super) fn op_with(label: impl FnOnce() -> String) -> OpTimer {
    if !ON.load(Ordering::Relaxed) {
        return OpTimer(None);
    }
    let outer = DEPTH.with(|d| {
        d.set(d.get() + 1);
        d.get() == 1
    });
    OpTimer(Some((
        if outer { label() } else { String::new() },
        Instant::now(),
    )))
}

impl Drop for OpTimer {
    fn drop(&mut self) {
        let Some((label, start)) = self.0.take() else {
            return;
        };
        let seconds = start.elapsed().as_secs_f64();
        DEPTH.with(|d| d.set(d.get() - 1));
        if !label.is_empty() {
            let mut t = totals();
            let e = t.entry(label).or_default();
            e.0 += 1;
            e.1 += seconds;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The label's entry, if recorded (other tests may record their own ops meanwhile).
    fn entry(label: &str) -> Option<(u64, f64)> {
        totals().get(label).copied()
    }

    #[test]
    fn ops_are_timed_only_while_recording_and_nested_ops_count_once() {
        {
            let _t = op("op_times test: before");
        }
        assert_eq!(entry("op_times test: before"), None);
        record_op_times(true);
        for _ in 0..3 {
            let _outer = op_with(|| "op_times test: outer".to_string());
            let _inner = op("op_times test: inner");
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
        assert!(take_op_times()
            .iter()
            .any(|t| t.op == "op_times test: outer" && t.calls == 3));
    }
}
