//! HiCache: exactness of host hits on every write policy, compute overlapping a load-back,
//! host pools sized exactly as planned, and refusal of a host tier the NUMA node cannot hold.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use dsv4::backend::cpu::CpuBackend;
use dsv4::config::params::{Params, WritePolicy};
use dsv4::engine::{Engine, Event, EventKind, RequestSpec, SamplingParams, ShutdownMode};
use dsv4::error::ErrorKind;
use dsv4::kv::cache::Tier;
use dsv4::kv::hicache::HostPools;
use dsv4::kv::{KvPools, PrefixCache};
use dsv4::model::Model;
use serde_json::{json, Value};

fn engine(hicache: Value) -> Engine {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "threads": 2,
        "kv": {"device_memory_bytes": "32MiB", "max_running_requests": 4, "page_size": 128},
        "hicache": hicache,
    });
    Engine::create(Params::from_value(&doc).unwrap()).unwrap()
}

/// Greedy tokens with their log-probabilities, and the terminal event.
fn generate(engine: &Engine, prompt: &[u32]) -> (Vec<(u32, f32)>, Event) {
    let spec = RequestSpec {
        prompt: prompt.to_vec(),
        max_new_tokens: 16,
        logprobs: true,
        sampling: SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(1, -1000.0)],
            ..SamplingParams::default()
        },
        ..RequestSpec::default()
    };
    let id = engine.submit(spec).unwrap();
    let mut tokens = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline);
        for e in engine.poll(64, Some(Duration::from_millis(100))).unwrap() {
            assert_eq!(e.request_id(), id);
            match e.kind() {
                EventKind::Token => tokens.push((e.token_id().unwrap(), e.logprob())),
                EventKind::Finished => return (tokens, e),
                EventKind::Error => panic!("request failed: {e:?}"),
            }
        }
    }
}

#[test]
fn device_hits_host_hits_and_write_back_round_trips_give_identical_tokens() {
    let ids = common::ids("flash-like");
    let prompt = &ids[..300];
    let (reference, cold) = generate(&engine(json!({"enabled": false})), prompt);
    assert_eq!(
        cold.stats().cached_tokens_device + cold.stats().cached_tokens_host,
        0
    );

    let through = engine(json!({"enabled": true, "ratio": 2.0, "write_policy": "write_through"}));
    let (first, _) = generate(&through, prompt);
    assert_eq!(first, reference, "cold run with a host tier");
    let (device_hit, e) = generate(&through, prompt);
    assert_eq!(device_hit, reference);
    assert_eq!(
        (e.stats().cached_tokens_device, e.stats().cached_tokens_host),
        (256, 0)
    );
    through.flush_cache(Tier::Device).unwrap();
    let (host_hit, e) = generate(&through, prompt);
    assert_eq!(
        host_hit, reference,
        "bit-identical tokens and log-probabilities"
    );
    assert_eq!(
        (e.stats().cached_tokens_device, e.stats().cached_tokens_host),
        (0, 256)
    );
    let stats = through.cache_stats().unwrap();
    assert_eq!(stats["hits"]["host"], 1);
    assert!(stats["loadback"]["bytes"].as_u64().unwrap() > 0);
    assert_eq!(
        stats["backup"]["count"], 1,
        "one node (2 pages + its snapshot): {stats}"
    );
    assert_eq!(stats["write_policy"], "write_through");
    // Flushing the host tier too leaves nothing to hit.
    through.flush_cache(Tier::All).unwrap();
    let (_, e) = generate(&through, prompt);
    assert_eq!(
        e.stats().cached_tokens_device + e.stats().cached_tokens_host,
        0
    );

    let back = engine(json!({"enabled": true, "ratio": 2.0, "write_policy": "write_back"}));
    generate(&back, prompt);
    assert_eq!(
        back.cache_stats().unwrap()["backup"]["count"],
        0,
        "write_back waits for eviction"
    );
    back.flush_cache(Tier::Device).unwrap();
    let stats = back.cache_stats().unwrap();
    assert!(
        stats["evictions"]["device"]["kept_on_host"]
            .as_u64()
            .unwrap()
            > 0,
        "{stats}"
    );
    let (round_trip, e) = generate(&back, prompt);
    assert_eq!(round_trip, reference);
    assert_eq!(
        (e.stats().cached_tokens_device, e.stats().cached_tokens_host),
        (0, 256)
    );

    let selective =
        engine(json!({"enabled": true, "ratio": 2.0, "write_policy": "write_through_selective"}));
    generate(&selective, prompt);
    assert_eq!(selective.cache_stats().unwrap()["backup"]["count"], 0);
    generate(&selective, prompt); // first hit
    generate(&selective, prompt); // second hit: backed up now
    selective.flush_cache(Tier::Device).unwrap();
    let (again, e) = generate(&selective, prompt);
    assert_eq!(again, reference);
    assert_eq!(e.stats().cached_tokens_host, 256);
    selective.shutdown(ShutdownMode::Drain, None).unwrap();
}

#[test]
fn a_forward_step_completes_while_a_load_back_is_in_flight() {
    let model: Model<CpuBackend> = common::model("flash-like");
    let plan = common::plan_for_model_doc(
        &model,
        json!({"kv": {}, "hicache": {"enabled": true, "ratio": 2.0, "write_policy": "write_through"}}),
    );
    let pools = KvPools::new(model.backend_arc(), &plan).unwrap();
    let host = HostPools::new(&plan, model.backend(), 2).unwrap();
    let mut cache = PrefixCache::new(pools, 128)
        .unwrap()
        .with_host(host, WritePolicy::WriteThrough);
    let ids = common::ids("flash-like");
    let vocab = model.config.vocab_size;
    // Cache A's prefix on both tiers, then drop the device copy.
    let a = &ids[..300];
    let mut req = cache.start(None, a).unwrap();
    common::prefill(&model, &mut cache, &mut req, a).unwrap();
    cache.finish(req, a);
    cache.wait_backups();
    cache.flush(Tier::Device);
    // Slow copies down so the load-back stays in flight.
    model.backend().throttle_tier_copies(Some(100_000.0));
    let mut b = cache.start(None, a).unwrap();
    assert!(b.is_loading(), "a host hit loads back");
    // Another request computes meanwhile.
    let c_prompt = &ids[150..200];
    let mut c = cache.start(None, c_prompt).unwrap();
    let t = Instant::now();
    let c_logits = common::prefill(&model, &mut cache, &mut c, c_prompt).unwrap();
    assert!(
        !cache.complete_load(&mut b, Duration::ZERO).unwrap(),
        "the load-back landed too early to show overlap"
    );
    eprintln!(
        "forward step done in {:.1} ms with the load-back still in flight",
        t.elapsed().as_secs_f64() * 1e3
    );
    cache.finish(c, c_prompt);
    model.backend().throttle_tier_copies(None);
    assert!(cache
        .complete_load(&mut b, Duration::from_secs(30))
        .unwrap());
    assert_eq!((b.reused_tokens(), b.reused_host_tokens()), (256, 256));
    let b_logits = common::prefill(&model, &mut cache, &mut b, a).unwrap();
    cache.finish(b, a);
    cache.check(&[]).unwrap();
    // Both equal scratch.
    let mut fresh = common::pools(&model);
    let scratch_a = common::full(&model, &mut fresh, a);
    assert!(common::max_diff(&b_logits, &scratch_a[299 * vocab..]) <= 1e-4);
    let scratch_c = common::full(&model, &mut fresh, c_prompt);
    assert!(common::max_diff(&c_logits, &scratch_c[49 * vocab..]) <= 1e-4);
}

#[test]
fn host_pools_hold_exactly_the_planned_bytes() {
    let model: Model<CpuBackend> = common::model("pro-like");
    for hicache in [
        json!({"enabled": true, "ratio": 2.0}),
        json!({"enabled": true, "ratio": 0.5}),
        json!({"enabled": true, "size_bytes": "48MiB"}),
    ] {
        let plan =
            common::plan_for_model_doc(&model, json!({"kv": {}, "hicache": hicache.clone()}));
        let host = HostPools::new(&plan, model.backend(), 2).unwrap();
        let mut total = 0;
        for (id, bytes) in host.allocated_bytes() {
            assert_eq!(
                bytes,
                plan.pool(id).unwrap().host_bytes(),
                "{hicache}: {}",
                id.name()
            );
            total += bytes;
        }
        assert_eq!(total, plan.host_bytes(), "{hicache}");
        if let Some(size) = hicache.get("size_bytes") {
            assert!(total <= 48 << 20, "{size}: {total}");
        }
        for r in host.reports() {
            assert!(r.seconds > 0.0);
        }
    }
}

#[test]
fn a_host_tier_larger_than_the_numa_node_is_refused_at_create() {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "kv": {"device_memory_bytes": "32MiB", "page_size": 128},
        "hicache": {"enabled": true, "size_bytes": "64TB"},
    });
    let err = Engine::create(Params::from_value(&doc).unwrap())
        .err()
        .unwrap();
    assert_eq!(err.kind(), ErrorKind::Capacity);
    let m = err.message();
    assert!(m.contains("NUMA node") && m.contains("free"), "{m}");
    assert!(m.contains("lower hicache.size_bytes"), "{m}");
}

#[test]
fn a_host_size_that_plans_no_host_tier_is_refused_at_create() {
    let doc = json!({
        "model_path": common::fixture("flash-like/hf-f32").to_str().unwrap(),
        "kv": {"device_memory_bytes": "32MiB", "page_size": 128},
        "hicache": {"enabled": true, "size_bytes": 150},
    });
    let err = Engine::create(Params::from_value(&doc).unwrap())
        .err()
        .unwrap();
    assert_eq!(err.kind(), ErrorKind::Config);
    let m = err.message();
    assert!(
        m.contains("HiCache would be enabled with no host tier"),
        "{m}"
    );
    assert!(m.contains("did you mean \"150GB\"?"), "{m}");
}

#[test]
fn cache_stats_report_every_pool_on_both_tiers() {
    let e = engine(json!({"enabled": true, "ratio": 1.0}));
    let s = e.cache_stats().unwrap();
    let pools: HashMap<String, Value> = serde_json::from_value(s["pools"].clone()).unwrap();
    for name in ["c4_kv", "c4_indexer", "c128_kv", "snapshots"] {
        let p = &pools[name];
        assert!(p["device"]["total_units"].as_u64().unwrap() > 0, "{name}");
        assert!(p["host"]["total_bytes"].as_u64().unwrap() > 0, "{name}");
    }
    assert!(
        pools["swa"].get("host").is_none(),
        "slots have no host tier"
    );
}
