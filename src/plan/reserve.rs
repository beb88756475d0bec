//! Host memory reserved by the live engines of this process, per NUMA node.
//!
//! The fit check compares a plan's requirement with the node's free memory, but an engine's KV
//! pools and host tier are mapped lazily: right after creation they hold address space, not
//! memory, so free memory does not show them, and four engines that each fit alone could all be
//! accepted on a machine that holds one. Every engine therefore holds a [`Reservation`] of what
//! its plan requires for its whole life, and the fit check ([`super::plan`]) subtracts what the
//! other live engines reserved and have not touched yet.
//!
//! **Not touched yet.** Pages an engine has touched (its weights at once, pool pages as requests
//! use them) are already missing from free memory; subtracting its whole reservation again
//! would count them twice. The registry cannot see which pages each engine touched, so it
//! estimates: the growth of the process's anonymous resident memory (`RssAnon` in
//! `/proc/self/status`) since the first of the live reservations was taken is attributed to the
//! engines (to each node in proportion to what is reserved there), capped at what they
//! reserved; the rest of their reservations is counted as still to come. The estimate errs
//! towards admitting an engine when the host application itself allocates a lot while engines
//! live (its growth is credited to the engines), and towards refusing when the host frees memory
//! it held before (growth is floored at zero). Without `/proc` nothing is credited: whole
//! reservations are subtracted (conservative).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::{bytes_both, fit_reason, Plan};
use crate::config::size::human_bytes;
use crate::error::{Error, ErrorKind, Result};

/// What the other live engines of the process hold on one node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    /// Live reservations on the node.
    pub engines: usize,
    /// Their total.
    pub reserved_bytes: u64,
    /// The part estimated to be touched already (so already missing from free memory).
    pub resident_bytes: u64,
    /// `reserved_bytes - resident_bytes`: what the fit check subtracts from free memory.
    pub outstanding_bytes: u64,
    /// "engine #1 (deepseek-v4-flash): 15.00 GiB", one per reservation.
    pub reservations: Vec<String>,
}

impl Held {
    /// "2 other engines of this process have reserved 30.00 GiB on this node (engine #1 (…):
    /// 15.00 GiB, engine #2 (…): 15.00 GiB), an estimated 1.20 GiB of it touched so far".
    pub fn describe(&self) -> String {
        format!(
            "{} other engine{} of this process {} reserved {} on this node ({}), an estimated {} \
             of it touched so far",
            self.engines,
            if self.engines == 1 { "" } else { "s" },
            if self.engines == 1 { "has" } else { "have" },
            human_bytes(self.reserved_bytes),
            self.reservations.join(", "),
            human_bytes(self.resident_bytes)
        )
    }
}

/// A set of reservations; [`Registry::process`] is the one every engine uses (tests may make
/// their own).
#[derive(Clone)]
pub struct Registry {
    inner: Arc<Mutex<Inner>>,
    /// The process's anonymous resident bytes, when they can be read.
    resident: fn() -> Option<u64>,
}

#[derive(Default)]
struct Inner {
    next_id: u64,
    live: BTreeMap<u64, Entry>,
    /// Resident bytes when the oldest live reservation was taken (`None` while none lives).
    base_resident: Option<u64>,
}

struct Entry {
    node: u32,
    bytes: u64,
    label: String,
}

impl Registry {
    /// The registry of this process.
    pub fn process() -> Registry {
        static PROCESS: OnceLock<Registry> = OnceLock::new();
        PROCESS.get_or_init(Registry::new).clone()
    }

    /// An empty registry reading this process's resident memory.
    pub fn new() -> Self {
        Self::with_resident_reader(process_anon_resident)
    }

    /// An empty registry with another source of resident bytes (tests).
    pub fn with_resident_reader(resident: fn() -> Option<u64>) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner::default())),
            resident,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the map half-updated (single inserts
        // and removes), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What live reservations hold on `node`.
    pub fn held(&self, node: u32) -> Held {
        let inner = self.lock();
        self.held_locked(&inner, node)
    }

    fn held_locked(&self, inner: &Inner, node: u32) -> Held {
        let total: u64 = inner.live.values().map(|e| e.bytes).sum();
        let on_node: Vec<(&u64, &Entry)> =
            inner.live.iter().filter(|(_, e)| e.node == node).collect();
        let reserved: u64 = on_node.iter().map(|(_, e)| e.bytes).sum();
        let growth = match (inner.base_resident, (self.resident)()) {
            (Some(base), Some(now)) => now.saturating_sub(base),
            _ => 0,
        };
        let resident = if total == 0 {
            0
        } else {
            ((growth as u128 * reserved as u128 / total as u128) as u64).min(reserved)
        };
        Held {
            engines: on_node.len(),
            reserved_bytes: reserved,
            resident_bytes: resident,
            outstanding_bytes: reserved - resident,
            reservations: on_node
                .iter()
                .map(|(id, e)| format!("engine #{id} ({}): {}", e.label, human_bytes(e.bytes)))
                .collect(),
        }
    }

    /// Re-checks `plan`'s fit against the reservations live now and, when it still fits,
    /// reserves its requirement on its node until the returned guard is dropped. Check and
    /// insert happen under one lock, so engines created at the same time cannot both take the
    /// last free memory. `Capacity` (with the plan's fix and the other engines' reservations)
    /// when it does not fit.
    pub fn acquire(&self, plan: &Plan) -> Result<Reservation> {
        let n = &plan.numa;
        let Some(node) = n.node.as_ref() else {
            if n.required_bytes == 0 {
                return Ok(self.insert(&mut self.lock(), plan, 0, 0));
            }
            return Err(Error::new(ErrorKind::Capacity, n.reason.clone()));
        };
        let mut inner = self.lock();
        let held = self.held_locked(&inner, node.index);
        let (fits, reason) = fit_reason(
            &plan.params,
            n.required_bytes,
            node.index,
            n.free_bytes,
            n.capped_by_cgroup,
            &held,
        );
        if !fits {
            return Err(Error::new(ErrorKind::Capacity, reason));
        }
        log::info!(
            "reserved {} of host memory on NUMA node {} ({reason})",
            bytes_both(n.required_bytes),
            node.index
        );
        Ok(self.insert(&mut inner, plan, node.index, n.required_bytes))
    }

    fn insert(&self, inner: &mut Inner, plan: &Plan, node: u32, bytes: u64) -> Reservation {
        if inner.live.is_empty() {
            inner.base_resident = (self.resident)();
        }
        inner.next_id += 1;
        let id = inner.next_id;
        inner.live.insert(
            id,
            Entry {
                node,
                bytes,
                label: plan.model.name.clone(),
            },
        );
        Reservation {
            registry: self.clone(),
            id,
            node,
            bytes,
        }
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

/// Host memory one live engine counts on, released when dropped.
pub struct Reservation {
    registry: Registry,
    id: u64,
    node: u32,
    bytes: u64,
}

impl Reservation {
    /// [`Registry::acquire`] on the process registry: what `Engine::create` holds for the
    /// engine's lifetime.
    pub fn acquire(plan: &Plan) -> Result<Self> {
        Registry::process().acquire(plan)
    }

    /// "engine #3" in other engines' messages.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn node(&self) -> u32 {
        self.node
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation")
            .field("id", &self.id)
            .field("node", &self.node)
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut inner = self.registry.lock();
        inner.live.remove(&self.id);
        if inner.live.is_empty() {
            inner.base_resident = None;
        }
    }
}

/// `RssAnon` of /proc/self/status in bytes: anonymous pages only, so the checkpoint files
/// mapped while loading (page cache, reclaimable) are not taken for engine memory.
fn process_anon_resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reports_anonymous_resident_memory() {
        let rss = process_anon_resident().expect("RssAnon in /proc/self/status");
        assert!(rss > 0);
    }
}
