//! The KV pools: allocated bytes equal the plan's, capacity errors leave nothing behind, and
//! eviction under pressure never touches what running requests hold.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{full, ids, max_diff, model, plan_for, pools_with};
use dsv4::backend::cpu::CpuBackend;
use dsv4::error::ErrorKind;
use dsv4::kv::{KvPools, PrefixCache};
use dsv4::model::{Chunk, Logits};
use serde_json::json;

#[test]
fn allocated_bytes_equal_the_plan() {
    let backend = Arc::new(CpuBackend::new(1).unwrap());
    let flash = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/deepseek-v4-flash");
    let fixture = common::fixture("pro-like/hf-f32");
    let cases = [
        (
            &flash,
            json!({"dtype": "fp8", "indexer_dtype": "fp4", "device_memory_bytes": "1GiB",
                        "max_running_requests": 8, "page_size": 256}),
        ),
        (
            &flash,
            json!({"dtype": "bf16", "indexer_dtype": "fp8", "device_memory_bytes": "1GiB",
                        "max_running_requests": 4}),
        ),
        (&fixture, json!({})),
        (
            &fixture,
            json!({"dtype": "fp8", "indexer_dtype": "bf16", "snapshot_fraction": 0.0}),
        ),
    ];
    for (dir, kv) in cases {
        let plan = plan_for(dir, kv.clone());
        let pools = KvPools::new(backend.clone(), &plan).unwrap();
        let mut total = 0;
        for (id, bytes) in pools.allocated_bytes() {
            let planned = plan.pool(id).unwrap().device_bytes();
            assert_eq!(bytes, planned, "{kv}: pool {}", id.name());
            total += bytes;
        }
        // Measured from the allocations themselves, not from the layout.
        assert_eq!(backend.allocated_bytes(), total, "{kv}");
        assert_eq!(total, plan.device_bytes(), "{kv}");
        assert!(total <= plan.budget.bytes, "{kv}: over budget");
        drop(pools);
        assert_eq!(backend.allocated_bytes(), 0, "{kv}: pool memory not freed");
    }
}

#[test]
fn a_request_larger_than_the_pools_gets_capacity_and_leaves_nothing_behind() {
    let m = model("flash-like");
    // 4 slots (~208 KiB each) use most of 960 KiB; a few pages (~24.5 KiB) remain.
    let mut kv = pools_with(
        &m,
        json!({"device_memory_bytes": "960KiB", "max_running_requests": 4, "snapshot_fraction": 0.0}),
    );
    let pages = kv.page_allocator().capacity();
    assert!((1..8).contains(&pages), "{pages} pages");
    let mut seq = kv.open().unwrap();
    kv.reserve(&mut seq, 128).unwrap();
    let e = kv.reserve(&mut seq, (pages + 1) * 128).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert!(e.message().contains("raise kv.device_memory_bytes"), "{e}");
    assert_eq!(seq.pages().len(), 1, "a failed reserve took pages");
    assert_eq!(kv.page_allocator().free_count(), pages - 1);
    // A forward step past the reserved pages is refused, not run.
    let ids = ids("flash-like");
    let e = m
        .forward(
            &mut kv,
            &mut [Chunk {
                tokens: &ids[..200],
                seq: &mut seq,
                logits: Logits::Last,
            }],
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    assert!(e.message().contains("reserve them first"), "{e}");
    assert_eq!(seq.position(), 0);
    // Slots run out too.
    let others: Vec<_> = (0..3).map(|_| kv.open().unwrap()).collect();
    let e = kv.open().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert!(e.message().contains("raise kv.max_running_requests"), "{e}");
    for s in others {
        kv.close(s);
    }
    kv.close(seq);
    kv.check().unwrap();
    assert_eq!(
        kv.page_allocator().used_count() + kv.slot_allocator().used_count(),
        0
    );
}

#[test]
fn eviction_under_pressure_spares_requests_in_flight() {
    let m = model("flash-like");
    let ids = ids("flash-like");
    let vocab = m.config.vocab_size;
    // ~8 pages, 2 slots, a few snapshots.
    let pools = pools_with(
        &m,
        json!({"device_memory_bytes": "748KiB", "max_running_requests": 2, "snapshot_fraction": 0.4}),
    );
    let pages = pools.page_allocator().capacity();
    assert!((6..14).contains(&pages), "{pages} pages");
    let mut cache = PrefixCache::new(pools, 128).unwrap();
    // A caches 2 pages with snapshots at 128 and 256.
    let a_prompt = &ids[..300];
    let mut a = cache.start(None, a_prompt).unwrap();
    common::prefill(&m, &mut cache, &mut a, a_prompt).unwrap();
    cache.finish(a, a_prompt);
    assert_eq!(cache.tree().pages_held(), 2);
    // B hits at 256 and holds the lock while C puts the pools under pressure.
    let mut b_prompt = ids[..256].to_vec();
    b_prompt.extend_from_slice(&ids[..40]);
    let mut b = cache.start(None, &b_prompt).unwrap();
    assert_eq!(b.reused_tokens(), 256);
    let shared = b.kv().pages().to_vec();
    let c_prompt: Vec<u32> = ids
        .iter()
        .rev()
        .copied()
        .cycle()
        .take((pages - 2) * 128)
        .collect();
    let mut c = cache.start(None, &c_prompt).unwrap();
    assert_eq!(c.reused_tokens(), 0);
    // C needs every page but B's two: the tree's references on them are dropped (nothing
    // else is evictable) but B's own references keep them.
    common::prefill(&m, &mut cache, &mut c, &c_prompt).unwrap();
    assert_eq!(cache.pools().page_allocator().free_count(), 0);
    for &p in &shared {
        assert!(cache.pools().page_allocator().refs(p) >= 1);
    }
    // C cannot grow further: capacity, nothing changed, B still intact.
    let held = c.kv().pages().len();
    let e = cache.reserve(&mut c, c_prompt.len() + 128).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Capacity);
    assert_eq!(c.kv().pages().len(), held);
    cache.check(&[&b, &c]).unwrap();
    cache.abort(c);
    // B continues exactly.
    let last = common::prefill(&m, &mut cache, &mut b, &b_prompt).unwrap();
    let mut fresh = pools_with(&m, json!({}));
    let scratch = full(&m, &mut fresh, &b_prompt);
    let diff = max_diff(&last, &scratch[(b_prompt.len() - 1) * vocab..]);
    assert!(diff <= 1e-4, "B after pressure: {diff}");
    cache.finish(b, &b_prompt);
    cache.check(&[]).unwrap();
}

#[test]
fn pool_accesses_outside_a_buffer_are_errors_naming_the_access_not_panics() {
    let backend = Arc::new(CpuBackend::new(1).unwrap());
    let plan = plan_for(&common::fixture("pro-like/hf-f32"), json!({}));
    let mut pools = KvPools::new(backend, &plan).unwrap();
    let (id, bytes) = pools.allocated_bytes()[0];
    assert_eq!(id, dsv4::kv::layout::PoolId::ALL[0]);
    let end = bytes as usize;
    // The last byte reads; one past it does not, and neither does a length that wraps.
    let mut one = [0u8; 1];
    pools.read_bytes(id, end - 1, &mut one).unwrap();
    for (offset, len) in [(end, 1), (end - 1, 2), (usize::MAX, 1)] {
        let mut out = vec![0u8; len];
        let e = pools.read_bytes(id, offset, &mut out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal);
        assert!(
            e.message().contains(&format!(
                "{len} bytes at offset {offset} is outside the {end}-byte buffer"
            )),
            "{e}"
        );
        let e = pools.write_bytes(id, offset, &out).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
    }
    // A refused write changed nothing.
    let mut last = [0u8; 1];
    pools.read_bytes(id, end - 1, &mut last).unwrap();
    assert_eq!(last, one);
}
