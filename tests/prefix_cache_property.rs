//! Randomized property test of the prefix cache on small pools: thousands of start (match +
//! lock), prefill, decode, finish (insert + unlock), abort and eviction operations, several
//! seeds. After every operation: no page, slot or snapshot leaked or freed twice, every
//! reference accounted for (tree + running requests), capacities respected; every hit hands
//! out pages and a restored state holding exactly that prefix's data.
//!
//! "Compute" is simulated: a page gets a digest of the tokens up to its end when it fills, a
//! slot gets a digest of the tokens so far at each page boundary (where snapshots copy it).

mod common;

use dsv4::backend::cpu::CpuBackend;
use dsv4::error::ErrorKind;
use std::time::Duration;

use dsv4::config::params::WritePolicy;
use dsv4::kv::cache::Tier;
use dsv4::kv::hicache::HostPools;
use dsv4::kv::{KvPools, PoolId, PrefixCache, Request};
use serde_json::json;

const PAGE: usize = 128;

fn digest(salt: Option<&str>, tokens: &[u32]) -> [u8; 16] {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut g: u64 = tokens.len() as u64;
    for b in salt.unwrap_or("\u{0}").bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    for &t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
        g = g.rotate_left(7) ^ h;
    }
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&h.to_le_bytes());
    out[8..].copy_from_slice(&g.to_le_bytes());
    out
}

struct Running {
    req: Request,
    salt: Option<String>,
    tokens: Vec<u32>,
    prompt_len: usize,
}

fn tag(pools: &KvPools<CpuBackend>, pool: PoolId, unit_index: u32) -> [u8; 16] {
    let mut out = [0u8; 16];
    let unit = pools.layout().unit_bytes(pool);
    pools
        .read_bytes(pool, unit_index as usize * unit, &mut out)
        .unwrap();
    out
}

fn write_tag(pools: &mut KvPools<CpuBackend>, pool: PoolId, unit_index: u32, tag: [u8; 16]) {
    let unit = pools.layout().unit_bytes(pool);
    pools
        .write_bytes(pool, unit_index as usize * unit, &tag)
        .unwrap();
}

/// "Computes" `r` up to `end`: tags every page that fills and the slot at page boundaries.
fn compute(cache: &mut PrefixCache<CpuBackend>, r: &mut Running, end: usize) {
    let start = r.req.position();
    let salt = r.salt.as_deref();
    let pools = cache.pools_mut();
    for boundary in (start / PAGE + 1) * PAGE..=end {
        if boundary.is_multiple_of(PAGE) {
            let page = r.req.kv().pages()[boundary / PAGE - 1].get();
            write_tag(
                pools,
                PoolId::C4Kv,
                page,
                digest(salt, &r.tokens[..boundary]),
            );
        }
    }
    r.req.kv_mut().advance(end - start);
    if end.is_multiple_of(PAGE) {
        let slot = r.req.kv().slot();
        write_tag(pools, PoolId::Swa, slot, digest(salt, &r.tokens[..end]));
    }
}

fn check_hit(cache: &PrefixCache<CpuBackend>, r: &Running) {
    let reused = r.req.reused_tokens();
    if reused == 0 {
        return;
    }
    let salt = r.salt.as_deref();
    let pools = cache.pools();
    assert_eq!(
        tag(pools, PoolId::Swa, r.req.kv().slot()),
        digest(salt, &r.tokens[..reused]),
        "restored state is not the snapshot of the reused prefix"
    );
    for (i, &page) in r.req.kv().pages()[..reused / PAGE].iter().enumerate() {
        assert_eq!(
            tag(pools, PoolId::C4Kv, page.get()),
            digest(salt, &r.tokens[..(i + 1) * PAGE]),
            "shared page {i} does not hold its prefix's data"
        );
    }
}

fn property(seed: u64, ops: usize, host: Option<WritePolicy>) {
    let model = common::model("flash-like");
    // Small pools: 4 slots, a handful of snapshots, ~36 pages; a host tier of 1.5× that.
    let policy = host.map(|p| serde_json::to_value(p).unwrap());
    let plan = common::plan_for_model_doc(
        &model,
        json!({
            "kv": {"device_memory_bytes": "2MiB", "max_running_requests": 4, "snapshot_fraction": 0.3},
            "hicache": {"enabled": host.is_some(), "ratio": 1.5, "write_policy": policy.unwrap_or(json!("write_through"))},
        }),
    );
    let pools = KvPools::new(model.backend_arc(), &plan).unwrap();
    let (pages_cap, snaps_cap) = (
        pools.page_allocator().capacity(),
        pools.snapshot_allocator().capacity(),
    );
    assert!(
        (10..40).contains(&pages_cap) && (2..10).contains(&snaps_cap),
        "{pages_cap} pages, {snaps_cap} snapshots"
    );
    let mut cache = PrefixCache::new(pools, 256).unwrap();
    if let Some(policy) = host {
        let host_pools = HostPools::new(&plan, model.backend(), 1).unwrap();
        cache = cache.with_host(host_pools, policy);
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    let bases: Vec<Vec<u32>> = (0..4)
        .map(|b| (0..1500).map(|i| ((i * 7 + b * 13) % 384) as u32).collect())
        .collect();
    let salts = [None, Some("a"), Some("b")];
    let mut running: Vec<Running> = Vec::new();
    let (mut hits, mut capacity_errors, mut finished) = (0, 0, 0);
    for _ in 0..ops {
        match rng.usize(..10) {
            0..=2 if running.len() < 5 => {
                let base = &bases[rng.usize(..bases.len())];
                let len = 1 + rng.usize(..1400);
                let mut prompt = base[..len].to_vec();
                if rng.usize(..3) == 0 {
                    let at = rng.usize(..len);
                    prompt[at] = (prompt[at] + 1) % 384;
                }
                let salt = salts[rng.usize(..salts.len())];
                match cache.start(salt, &prompt) {
                    Ok(req) => {
                        let r = Running {
                            salt: salt.map(str::to_owned),
                            prompt_len: prompt.len(),
                            tokens: prompt,
                            req,
                        };
                        if !r.req.is_loading() {
                            check_hit(&cache, &r);
                            if r.req.reused_tokens() > 0 {
                                hits += 1;
                            }
                        }
                        running.push(r);
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
                        assert_eq!(running.len(), 4, "slots refused with free slots");
                        capacity_errors += 1;
                    }
                }
            }
            3..=6 if !running.is_empty() => {
                let i = rng.usize(..running.len());
                let r = &mut running[i];
                if r.req.is_loading() {
                    assert!(cache
                        .complete_load(&mut r.req, Duration::from_secs(10))
                        .unwrap());
                    check_hit(&cache, r);
                    if r.req.reused_tokens() > 0 {
                        hits += 1;
                    }
                    continue;
                }
                let pos = r.req.position();
                let end = if pos < r.prompt_len {
                    cache.chunk_limit(&r.req)
                } else {
                    if r.tokens.len() == pos {
                        r.tokens.push(rng.usize(..384) as u32);
                    }
                    pos + 1
                };
                let before = r.req.kv().pages().to_vec();
                match cache.reserve(&mut r.req, end) {
                    Ok(()) => {
                        compute(&mut cache, r, end);
                        cache.after_step(&mut r.req, &r.tokens[..end]).unwrap();
                    }
                    Err(e) => {
                        assert_eq!(e.kind(), ErrorKind::Capacity, "{e}");
                        assert_eq!(
                            r.req.kv().pages(),
                            &before[..],
                            "failed reserve changed the page table"
                        );
                        capacity_errors += 1;
                        // The engine would preempt: abort it.
                        let r = running.swap_remove(i);
                        cache.abort(r.req);
                    }
                }
            }
            7 if !running.is_empty() => {
                let r = running.swap_remove(rng.usize(..running.len()));
                let n = r.req.position();
                cache.finish(r.req, &r.tokens[..n]);
                finished += 1;
            }
            8 if !running.is_empty() => {
                let r = running.swap_remove(rng.usize(..running.len()));
                cache.abort(r.req);
            }
            9 if rng.usize(..4) == 0 => {
                cache.poll();
                match rng.usize(..3) {
                    0 => cache.flush(Tier::Device),
                    1 => cache.flush(Tier::Host),
                    _ => cache.wait_backups(),
                }
            }
            _ => {
                let want = rng.usize(..pages_cap + 1);
                cache.evict(want, rng.usize(..snaps_cap + 1));
            }
        }
        let refs: Vec<&Request> = running.iter().map(|r| &r.req).collect();
        if let Err(e) = cache.check(&refs) {
            panic!("seed {seed}: {e}");
        }
    }
    for r in running.drain(..) {
        cache.abort(r.req);
    }
    cache.clear();
    cache.check(&[]).unwrap();
    let pools = cache.pools();
    assert_eq!(pools.page_allocator().used_count(), 0);
    assert_eq!(pools.snapshot_allocator().used_count(), 0);
    assert_eq!(pools.slot_allocator().used_count(), 0);
    if let Some(h) = cache.host_pools() {
        assert_eq!(h.page_allocator().used_count(), 0, "host pages");
        assert_eq!(h.snapshot_allocator().used_count(), 0, "host snapshots");
    }
    eprintln!(
        "seed {seed} ({host:?}): {pages_cap} pages, {snaps_cap} snapshots, 4 slots; {ops} ops, {hits} hits, {finished} finished, {capacity_errors} capacity refusals, {:?}",
        cache.stats()
    );
    assert!(
        hits > 20,
        "seed {seed}: too few hits ({hits}) to exercise reuse"
    );
    assert!(capacity_errors > 0, "seed {seed}: pools never ran out");
}

#[test]
fn random_operations_keep_the_books_exact() {
    for seed in [1, 2, 3, 4, 5] {
        property(seed, 3000, None);
    }
}

#[test]
fn with_a_host_tier_under_every_write_policy() {
    for (seed, policy) in [
        (11, WritePolicy::WriteThrough),
        (12, WritePolicy::WriteThroughSelective),
        (13, WritePolicy::WriteBack),
        (14, WritePolicy::WriteThrough),
        (15, WritePolicy::WriteBack),
    ] {
        property(seed, 3000, Some(policy));
    }
}
