//! Engines count against each other's memory (issue 12): the fit check subtracts what other
//! live engines of the process reserved and have not touched yet, a reservation lasts as long
//! as its engine, and the touched part is not counted twice.

mod common;

use common::machine::Machine;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use dsv4::config::size::human_bytes;
use dsv4::config::{ModelConfig, Params};
use dsv4::engine::Engine;
use dsv4::plan::{self, plan_in, Plan, Registry};
use dsv4::ErrorKind;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

/// Nodes with (total, free) bytes, the process on node 0, no cgroup limit.
fn tiny() -> ModelConfig {
    ModelConfig::from_json_str(&dsv4::model::tiny::config_json().to_string(), "dsv4-tiny").unwrap()
}

/// A CPU plan whose requirement is `device` bytes of KV pools plus the tiny model's weights.
fn cpu_plan(machine: &Machine, registry: &Registry, device: &str, extra: Value) -> Plan {
    let mut doc = json!({
        "backend": "cpu",
        "kv": {"device_memory_bytes": device, "max_running_requests": 4},
        "hicache": {"enabled": false}
    });
    if let Value::Object(extra) = extra {
        for (k, v) in extra {
            doc[k] = v;
        }
    }
    plan_in(
        &Params::from_value(&doc).unwrap(),
        tiny(),
        machine,
        registry,
    )
    .unwrap()
}

/// Resident bytes the test registries read: engines "touch" memory by raising it.
static RESIDENT: AtomicU64 = AtomicU64::new(0);

fn resident() -> Option<u64> {
    Some(RESIDENT.load(Ordering::SeqCst))
}

/// The four-engines-on-23-GiB case: the second 15 GiB engine is refused naming the first's
/// reservation, and accepted once the first is gone.
#[test]
fn a_second_engine_that_would_overcommit_is_refused_until_the_first_is_dropped() {
    let machine = Machine::with_nodes(vec![(24 * GIB, 23 * GIB)]);
    let registry = Registry::with_resident_reader(|| None);
    let first_plan = cpu_plan(&machine, &registry, "15GiB", json!({}));
    assert!(first_plan.numa.fits, "{}", first_plan.numa.reason);
    let first = registry.acquire(&first_plan).unwrap();
    assert!(first.bytes() > 15 * GIB && first.bytes() < 15 * GIB + GIB / 8);

    let second_plan = cpu_plan(&machine, &registry, "15GiB", json!({}));
    let n = &second_plan.numa;
    assert!(!n.fits, "{}", n.reason);
    assert_eq!(
        n.free_bytes,
        23 * GIB,
        "free memory is reported as the node has it"
    );
    assert_eq!(n.others.engines, 1);
    assert_eq!(n.others.reserved_bytes, first.bytes());
    assert_eq!(n.others.outstanding_bytes, first.bytes());
    let reason = &n.reason;
    let held = human_bytes(first.bytes());
    assert!(
        reason.contains(&format!("less {held} that other engines will still touch")),
        "{reason}"
    );
    assert!(
        reason.contains(&format!(
            "1 other engine of this process has reserved {held} on this node (engine #{} \
             (dsv4-tiny): {held})",
            first.id()
        )),
        "{reason}"
    );
    assert!(
        reason.contains("lower kv.device_memory_bytes")
            && reason.ends_with("or destroy one of those engines first"),
        "{reason}"
    );
    let e = registry.acquire(&second_plan).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert_eq!(e.message(), reason);
    let json = second_plan.to_json();
    assert_eq!(json["numa"]["other_engines"]["engines"], 1);
    assert_eq!(
        json["numa"]["other_engines"]["outstanding_bytes"],
        first.bytes()
    );

    drop(first);
    let again = cpu_plan(&machine, &registry, "15GiB", json!({}));
    assert!(again.numa.fits, "{}", again.numa.reason);
    assert_eq!(again.numa.others.engines, 0);
    registry.acquire(&again).unwrap();
}

/// Plans made at the same time both fit alone; only the first reservation is granted, because
/// acquire re-checks under the registry's lock.
#[test]
fn acquire_rechecks_against_reservations_taken_after_the_plan() {
    let machine = Machine::with_nodes(vec![(24 * GIB, 23 * GIB)]);
    let registry = Registry::with_resident_reader(|| None);
    let a = cpu_plan(&machine, &registry, "12GiB", json!({}));
    let b = cpu_plan(&machine, &registry, "12GiB", json!({}));
    assert!(a.numa.fits && b.numa.fits);
    let _a = registry.acquire(&a).unwrap();
    let e = registry.acquire(&b).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert!(
        e.message().contains("1 other engine of this process"),
        "{e}"
    );
    // Four small engines fit where two large ones did not.
    let small: Vec<_> = (0..4)
        .map(|_| {
            let p = cpu_plan(&machine, &registry, "2GiB", json!({}));
            registry.acquire(&p).unwrap()
        })
        .collect();
    let held = registry.held(0);
    assert_eq!(held.engines, 5);
    assert_eq!(held.reservations.len(), 5);
    drop(small);
    assert_eq!(registry.held(0).engines, 1);
}

/// Memory an engine has already touched is missing from free memory; it is not subtracted a
/// second time through the reservation.
#[test]
fn touched_memory_is_not_counted_twice() {
    RESIDENT.store(3 * GIB, Ordering::SeqCst);
    let registry = Registry::with_resident_reader(resident);
    let machine = Machine::with_nodes(vec![(24 * GIB, 23 * GIB)]);
    let first = registry
        .acquire(&cpu_plan(&machine, &registry, "15GiB", json!({})))
        .unwrap();
    // The first engine loads and uses 10 GiB: the process grows by that much and the node's
    // free memory shrinks by it.
    RESIDENT.store(13 * GIB, Ordering::SeqCst);
    let machine = Machine::with_nodes(vec![(24 * GIB, 13 * GIB)]);
    let p = cpu_plan(&machine, &registry, "7GiB", json!({}));
    assert_eq!(p.numa.others.resident_bytes, 10 * GIB);
    assert_eq!(p.numa.others.outstanding_bytes, first.bytes() - 10 * GIB);
    // 13 GiB free less the ~5 GiB the first engine has still to touch leaves ~8 GiB.
    assert!(p.numa.fits, "{}", p.numa.reason);
    let p = cpu_plan(&machine, &registry, "9GiB", json!({}));
    assert!(!p.numa.fits, "{}", p.numa.reason);
    assert!(
        p.numa
            .reason
            .contains("an estimated 10.00 GiB of it touched so far"),
        "{}",
        p.numa.reason
    );
    // Growth beyond what engines reserved is not credited to them.
    RESIDENT.store(40 * GIB, Ordering::SeqCst);
    assert_eq!(registry.held(0).outstanding_bytes, 0);
    drop(first);
    assert_eq!(registry.held(0), plan::Held::default());
}

/// A reservation counts only on its own node.
#[test]
fn reservations_count_on_their_own_node() {
    let machine = Machine::with_nodes(vec![(24 * GIB, 20 * GIB), (24 * GIB, 20 * GIB)]);
    let registry = Registry::with_resident_reader(|| None);
    let on_one = cpu_plan(
        &machine,
        &registry,
        "15GiB",
        json!({"hicache": {"enabled": false, "numa_node": 1}}),
    );
    assert_eq!(on_one.numa.node.as_ref().unwrap().index, 1);
    let _held = registry.acquire(&on_one).unwrap();
    let on_zero = cpu_plan(&machine, &registry, "15GiB", json!({}));
    assert!(on_zero.numa.fits, "{}", on_zero.numa.reason);
    assert_eq!(on_zero.numa.others.engines, 0);
    let again_one = cpu_plan(
        &machine,
        &registry,
        "15GiB",
        json!({"hicache": {"enabled": false, "numa_node": 1}}),
    );
    assert!(!again_one.numa.fits);
}

// --- real engines against this machine ------------------------------------------------------

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flash-like/hf-f32")
}

fn engine_params(device_bytes: u64) -> Params {
    Params::from_value(&json!({
        "model_path": fixture().to_str().unwrap(),
        "threads": 1,
        "hicache": {"enabled": false},
        "kv": {"device_memory_bytes": device_bytes, "max_running_requests": 2}
    }))
    .unwrap()
}

fn anon_resident() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// Two engines that each take 60 % of this machine's free memory: before the registry both
/// were created (the pools map lazily, so free memory does not drop); now the second is
/// refused with DSV4_ERR_CAPACITY naming the first, and created once the first is destroyed.
#[test]
fn real_engines_are_refused_while_another_holds_the_memory() {
    let free = plan::plan(&engine_params(64 << 20))
        .unwrap()
        .numa
        .free_bytes;
    let big = free / 10 * 6;
    let before = anon_resident();
    let first = Engine::create(engine_params(big)).unwrap();
    // The pools are mapped, not touched: this is why free memory alone cannot tell.
    assert!(
        anon_resident().saturating_sub(before) < big / 4,
        "pools were touched at creation"
    );
    let e = match Engine::create(engine_params(big)) {
        Ok(_) => panic!("a second engine of 60 % of free memory was accepted"),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
    assert!(
        e.message().contains(&format!(
            "1 other engine of this process has reserved {} on this node (engine #",
            human_bytes(first.plan().numa.required_bytes)
        )),
        "{e}"
    );
    assert!(e.message().contains("destroy one of those engines"), "{e}");
    drop(first);
    let second = Engine::create(engine_params(big)).unwrap();
    assert_eq!(
        second.plan().numa.others.engines,
        0,
        "the first engine's reservation ended with it"
    );
}
