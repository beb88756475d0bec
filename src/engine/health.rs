//! Node-health facts for the Prometheus exposition, gathered per scrape: the engine's state,
//! how long since its last forward step (a stall detector), the build, the process's resident
//! memory, every NUMA node's memory and where the host tier's pools live.

use std::time::{Duration, Instant};

use super::shared::EngineState;
use crate::plan::numa::NodeMemory;

/// One scrape's node-health facts.
#[derive(Debug, Clone)]
pub struct NodeHealth {
    pub state: EngineState,
    /// Since the engine thread last finished a forward step, or since the engine was created
    /// when it has run none.
    pub since_last_step: Duration,
    pub version: &'static str,
    pub backend: &'static str,
    pub role: &'static str,
    /// `VmRSS` of /proc/self/status; `None` where it cannot be read.
    pub resident_bytes: Option<u64>,
    /// Every NUMA node, in index order.
    pub numa: Vec<NodeMemory>,
    /// `(node, pool, bytes)` of each host-tier pool (HiCache pages and snapshots).
    pub host_tier: Vec<(u32, &'static str, u64)>,
}

impl EngineState {
    /// The state's number: what the C API's `dsv4_engine_state` and the exposition's
    /// `dsv4_engine_state` report (ffi/ checks it against the header's constants).
    pub fn code(self) -> i32 {
        match self {
            EngineState::Loading => 0,
            EngineState::Ready => 1,
            EngineState::Draining => 2,
            EngineState::Stopped => 3,
            EngineState::Failed => 4,
        }
    }
}

/// When the engine thread last finished a forward step, as microseconds since the engine's
/// creation (0 = none yet), written by the engine thread and read by scrapes without a lock.
#[derive(Debug)]
pub struct StepClock {
    created: Instant,
    last_step_us: std::sync::atomic::AtomicU64,
}

impl Default for StepClock {
    fn default() -> Self {
        Self {
            created: Instant::now(),
            last_step_us: Default::default(),
        }
    }
}

impl StepClock {
    pub fn stepped(&self) {
        // At least 1, so a step in the creation's first microsecond still counts.
        let us = (self.created.elapsed().as_micros() as u64).max(1);
        self.last_step_us
            .store(us, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn since_last_step(&self) -> Duration {
        let at = self.last_step_us.load(std::sync::atomic::Ordering::Relaxed);
        self.created
            .elapsed()
            .saturating_sub(Duration::from_micros(at))
    }
}

/// The process's resident set (`VmRSS`), from /proc/self/status.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}
