//! Pool regions: every device and host pool publishes its memory as one `{pool, tier, addr,
//! len}` region (what a copy engine or a transport registers once). Checked here: each region's
//! length is the planned pool bytes, regions do not overlap, bytes read through the published
//! address equal bytes read through the backend (device) or the host tier's own reader, and a
//! sequence state's regions locate inside them (bounds-checked).

mod common;

use dsv4::backend::{CopyDirection, Ticket};
use dsv4::kv::hicache::HostPools;
use dsv4::kv::{state, HostPageId, KvPools, PageId, PoolId, PoolRegion, RegionTier};
use serde_json::json;

#[test]
fn every_pool_publishes_one_region_of_its_planned_bytes() {
    let model = common::model("flash-like");
    let plan = common::plan_for_model_doc(
        &model,
        json!({
            "kv": {"device_memory_bytes": "2MiB", "max_running_requests": 4},
            "hicache": {"enabled": true, "ratio": 1.5},
        }),
    );
    let mut pools = KvPools::new(model.backend_arc(), &plan).unwrap();
    let host = HostPools::new(&plan, model.backend(), 1).unwrap();
    let device = pools.regions();
    let host_regions = host.regions();
    assert_eq!(
        device.iter().map(|r| r.pool).collect::<Vec<_>>(),
        PoolId::ALL
    );
    assert_eq!(host_regions.len(), 4);
    for r in &device {
        assert_eq!(r.tier, RegionTier::Device);
        assert_eq!(
            r.len as u64,
            plan.pool(r.pool).unwrap().device_bytes(),
            "{r:?}"
        );
    }
    for r in &host_regions {
        assert_eq!(r.tier, RegionTier::Host);
        assert_eq!(
            r.len as u64,
            plan.pool(r.pool).unwrap().host_bytes(),
            "{r:?}"
        );
    }
    let mut all: Vec<&PoolRegion> = device.iter().chain(&host_regions).collect();
    all.retain(|r| r.len > 0);
    assert!(all.len() >= 8, "most pools hold bytes: {all:?}");
    all.sort_by_key(|r| r.addr);
    for w in all.windows(2) {
        assert!(
            w[0].addr + w[0].len as u64 <= w[1].addr,
            "{:?} overlaps {:?}",
            w[0],
            w[1]
        );
    }

    // Device: a pattern written through the backend reads back the same through the address.
    for r in device.iter().filter(|r| r.len > 0) {
        for offset in [0, r.len / 2, r.len.saturating_sub(24)] {
            let n = 24.min(r.len - offset);
            let pattern: Vec<u8> = (0..n)
                .map(|i| (i as u8).wrapping_mul(7) ^ (r.pool.index() as u8) ^ (offset as u8))
                .collect();
            pools.write_bytes(r.pool, offset, &pattern).unwrap();
            let (mut via_backend, mut via_addr) = (vec![0; n], vec![0; n]);
            pools.read_bytes(r.pool, offset, &mut via_backend).unwrap();
            pools
                .read_mapped(r.addr + offset as u64, &mut via_addr)
                .unwrap();
            assert_eq!(via_backend, pattern, "{r:?} at {offset}");
            assert_eq!(via_addr, pattern, "{r:?} at {offset}");
        }
        // Past the end (straddling it) is refused, not read.
        let end = r.addr + r.len as u64;
        assert!(pools.read_mapped(end - 1, &mut [0; 2]).is_err(), "{r:?}");
    }
    assert!(pools.read_mapped(0, &mut [0; 1]).is_err());

    // Host: a page copied down by the tier copy reads the same through the host reader and
    // through the address.
    let page_bytes = plan.pool(PoolId::C4Kv).unwrap().shape.unit_bytes as usize;
    let pattern: Vec<u8> = (0..64).map(|i| 200 - i as u8).collect();
    pools
        .write_bytes(PoolId::C4Kv, page_bytes, &pattern)
        .unwrap();
    let ticket = Ticket::new();
    host.copy_pages(
        &pools,
        CopyDirection::ToHost,
        &[(PageId(1), HostPageId(2))],
        &ticket,
    )
    .unwrap();
    ticket.seal();
    ticket.wait();
    let c4 = host_regions
        .iter()
        .find(|r| r.pool == PoolId::C4Kv)
        .unwrap();
    let (mut via_host, mut via_addr) = (vec![0; 64], vec![0; 64]);
    host.read(PoolId::C4Kv, 2, &mut via_host);
    host.read_mapped(c4.addr + 2 * page_bytes as u64, &mut via_addr)
        .unwrap();
    assert_eq!(via_host, pattern);
    assert_eq!(via_addr, pattern);
    assert!(host
        .read_mapped(c4.addr + c4.len as u64 - 8, &mut [0; 16])
        .is_err());
}

#[test]
fn sequence_state_regions_locate_inside_their_pool_regions() {
    let model = common::model("pro-like");
    let mut pools = common::pools(&model);
    let mut seq = pools.open().unwrap();
    pools.reserve(&mut seq, 300).unwrap();
    // Give every byte the sequence owns a recognisable value.
    for (i, r) in pools.regions().into_iter().enumerate() {
        let fill: Vec<u8> = (0..r.len)
            .map(|b| (b as u8) ^ (i as u8).wrapping_mul(37))
            .collect();
        pools.write_bytes(r.pool, 0, &fill).unwrap();
    }
    seq.advance(300);
    let exported = state::export(&pools, &seq);
    let bytes = state::read(&pools, &exported).unwrap();
    let device = pools.regions();
    let mut at = 0;
    for r in &exported.regions {
        let (addr, len) = r.locate(&device).unwrap();
        let mut via_addr = vec![0; len];
        pools.read_mapped(addr, &mut via_addr).unwrap();
        assert_eq!(via_addr, bytes[at..at + len], "{r:?}");
        at += len;
    }
    assert_eq!(at, bytes.len());
    // Bounds-checked: a region moved past its pool's end, or on a tier not given, is refused.
    let mut moved = exported.regions[0];
    moved.offset = device[moved.pool.index()].len - moved.len + 1;
    assert!(moved.locate(&device).is_err());
    let mut host_side = exported.regions[0];
    host_side.tier = RegionTier::Host;
    assert!(host_side.locate(&device).is_err());
    pools.close(seq);
}
