//! The memory planner against DeepSeek V4-Flash's published numbers (docs/model.md §3.2)
//! and the HiCache sizing rules. Expected values are literals from the model reference, never
//! numbers computed by planner code.

mod common;

use common::machine::Machine;

use std::path::Path;

use dsv4::config::{ModelConfig, Params};
use dsv4::plan::{plan_with, Plan};
use dsv4::ErrorKind;
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;

/// A machine described by the test: nodes with (total, free) bytes and an optional cgroup.
fn model(name: &str) -> ModelConfig {
    ModelConfig::load(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("configs")
            .join(name),
    )
    .unwrap()
}

fn flash_plan(overrides: Value, machine: &Machine) -> Plan {
    let mut doc = json!({
        "model_path": "configs/deepseek-v4-flash",
        "backend": "cuda",
        "kv": {"dtype": "fp8", "indexer_dtype": "fp8", "page_size": 256,
               "device_memory_bytes": "40GiB", "max_running_requests": 64}
    });
    merge(&mut doc, overrides);
    let params = Params::from_value(&doc).unwrap();
    plan_with(&params, model("deepseek-v4-flash"), machine).unwrap()
}

fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k).or_insert(Value::Null), v);
            }
        }
        (slot, v) => *slot = v,
    }
}

/// Bytes per token per layer of a paged pool.
fn per_token_per_layer(plan: &Plan, pool: &str) -> f64 {
    let p = plan.pool_named(pool).unwrap();
    p.shape.unit_bytes as f64 / (plan.geometry.page_size as f64 * p.shape.layers as f64)
}

#[test]
fn flash_fp8_pool_geometry_matches_the_model_reference() {
    let plan = flash_plan(json!({}), &Machine::big());
    // §3.2: 21 CSA and 20 HCA layers; FP8 rows of 584 B; indexer rows of 132 B.
    assert_eq!(plan.pool_named("c4_kv").unwrap().shape.layers, 21);
    assert_eq!(plan.pool_named("c128_kv").unwrap().shape.layers, 20);
    assert_eq!(plan.pool_named("c4_kv").unwrap().shape.row_bytes, 584);
    assert_eq!(plan.pool_named("c4_indexer").unwrap().shape.row_bytes, 132);
    // CSA 146 B/token per layer, HCA 4.56 B/token per layer, indexer 33 B/token per layer.
    assert_eq!(per_token_per_layer(&plan, "c4_kv"), 146.0);
    assert_eq!(per_token_per_layer(&plan, "c4_indexer"), 33.0);
    assert!((per_token_per_layer(&plan, "c128_kv") - 4.56).abs() < 0.01);
    // Growing total ≈ 3850 B/token.
    let growing = plan.geometry.page_bytes() as f64 / 256.0;
    assert!((growing - 3850.0).abs() < 1.0, "{growing}");
    // Fixed per request: SWA rings 44 layers × 128 × 584 B = 3.29 MB.
    let swa = plan.pool_named("swa").unwrap();
    assert_eq!(swa.shape.layers, 44);
    assert_eq!(swa.shape.unit_bytes, 44 * 128 * 584);
    // Compressor frontiers: 21 × 80 KiB + 20 × 512 KiB ≈ 11.6 MiB per request.
    let frontiers: u64 = ["c4_state", "c4_indexer_state", "c128_state"]
        .iter()
        .map(|p| plan.pool_named(p).unwrap().shape.unit_bytes)
        .sum();
    assert_eq!(frontiers, 21 * 80 * 1024 + 20 * 512 * 1024);
    assert!((frontiers as f64 / (1 << 20) as f64 - 11.6).abs() < 0.05);
    // A snapshot at a 128-aligned boundary: the SWA window + C4 halos ≈ 420 KiB (§6.2).
    let halos: u64 = plan
        .pool_named("snapshots")
        .unwrap()
        .shape
        .components
        .iter()
        .filter(|(name, _)| name.ends_with("halo"))
        .map(|(_, b)| b)
        .sum();
    assert_eq!(halos, 21 * (16 + 4) * 1024);
}

#[test]
fn flash_fp4_indexer_and_bf16_rows_match_the_model_reference() {
    let plan = flash_plan(json!({"kv": {"indexer_dtype": "fp4"}}), &Machine::big());
    assert_eq!(plan.pool_named("c4_indexer").unwrap().shape.row_bytes, 68);
    assert_eq!(per_token_per_layer(&plan, "c4_indexer"), 17.0);
    let growing = plan.geometry.page_bytes() as f64 / 256.0;
    assert!((growing - 3514.0).abs() < 1.0, "{growing}");

    let bf16 = flash_plan(
        json!({"kv": {"dtype": "bf16", "indexer_dtype": "bf16"}}),
        &Machine::big(),
    );
    assert_eq!(per_token_per_layer(&bf16, "c4_kv"), 256.0);
    assert_eq!(per_token_per_layer(&bf16, "c4_indexer"), 64.0);
    assert_eq!(per_token_per_layer(&bf16, "c128_kv"), 8.0);
    // 6880 B/token all-bf16, ≈ 5.77 MB of SWA rings.
    assert_eq!(bf16.geometry.page_bytes() / 256, 6880);
    assert_eq!(
        bf16.pool_named("swa").unwrap().shape.unit_bytes,
        44 * 128 * 1024
    );
}

#[test]
fn the_device_budget_is_split_slots_then_snapshots_then_pages() {
    let plan = flash_plan(json!({}), &Machine::big());
    let budget = 40 * GIB;
    let slots: u64 = ["swa", "c4_state", "c4_indexer_state", "c128_state"]
        .iter()
        .map(|p| plan.pool_named(p).unwrap().device_bytes())
        .sum();
    assert_eq!(plan.pool_named("swa").unwrap().device_units, 64);
    let snapshots = plan.pool_named("snapshots").unwrap();
    let rest = budget - slots;
    // 10 % of the rest (the default snapshot_fraction), in whole snapshots.
    assert_eq!(
        snapshots.device_units,
        (rest as f64 * 0.1) as u64 / snapshots.shape.unit_bytes
    );
    // Pages take what is left, in whole pages, and the total never exceeds the budget.
    let page_bytes = plan.geometry.page_bytes();
    assert_eq!(
        plan.device_pages(),
        (rest - snapshots.device_bytes()) / page_bytes
    );
    assert!(plan.device_bytes() <= budget);
    assert!(budget - plan.device_bytes() < page_bytes);
    // All three paged pools share one page count (one page id addresses all three).
    for pool in ["c4_kv", "c4_indexer", "c128_kv"] {
        assert_eq!(
            plan.pool_named(pool).unwrap().device_units,
            plan.device_pages()
        );
    }
    assert_eq!(plan.device_tokens(), plan.device_pages() * 256);
}

#[test]
fn hicache_ratio_multiplies_device_pages_and_snapshots() {
    let plan = flash_plan(
        json!({"hicache": {"enabled": true, "ratio": 2.0}}),
        &Machine::big(),
    );
    for pool in ["c4_kv", "c4_indexer", "c128_kv", "snapshots"] {
        let p = plan.pool_named(pool).unwrap();
        assert_eq!(p.host_units, 2 * p.device_units, "{pool}");
    }
    for pool in ["swa", "c4_state", "c4_indexer_state", "c128_state"] {
        assert_eq!(plan.pool_named(pool).unwrap().host_units, 0, "{pool}");
    }
    assert!((plan.effective_ratio() - 2.0).abs() < 1e-12);
    assert_eq!(plan.host_tokens(), 2 * plan.device_tokens());
}

#[test]
fn hicache_size_is_split_by_device_bytes_and_never_exceeded() {
    // The SGLang incident: a PD prefill node with a small device pool. ratio 2 gives a host tier
    // of a few GB; 150 GB gives 150 GB.
    let prefill = json!({"role": "prefill", "kv": {"device_memory_bytes": "2GiB",
                                                   "max_running_requests": 8}});
    let mut by_ratio = prefill.clone();
    merge(
        &mut by_ratio,
        json!({"hicache": {"enabled": true, "ratio": 2.0}}),
    );
    let by_ratio = flash_plan(by_ratio, &Machine::big());
    let mut by_size = prefill;
    merge(
        &mut by_size,
        json!({"hicache": {"enabled": true, "size_bytes": "150GB"}}),
    );
    let by_size = flash_plan(by_size, &Machine::big());

    assert!(by_ratio.host_bytes() < 5_000_000_000);
    let budget = 150_000_000_000u64;
    let host = by_size.host_bytes();
    assert!(host <= budget);
    let slack = by_size.geometry.page_bytes() + by_size.geometry.snapshots.unit_bytes;
    assert!(
        budget - host < slack,
        "{host} wastes more than one page and one snapshot"
    );
    // Pages and snapshots get the same effective ratio (up to one unit of rounding).
    let ratio_of = |pool: &str| {
        let p = by_size.pool_named(pool).unwrap();
        p.host_units as f64 / p.device_units as f64
    };
    let (pages, snaps) = (ratio_of("c4_kv"), ratio_of("snapshots"));
    assert!((pages - snaps).abs() / pages < 0.01, "{pages} vs {snaps}");
    assert!(
        (by_size.effective_ratio() - host as f64 / by_size.device_bytes_mirrored()).abs() < 1e-9
    );
    let report = by_size.to_json();
    assert_eq!(report["hicache"]["mode"], "size");
    assert_eq!(report["hicache"]["budget_bytes"], json!(budget));
    assert_eq!(report["totals"]["host_bytes"], json!(host));
}

trait Mirrored {
    fn device_bytes_mirrored(&self) -> f64;
}

impl Mirrored for Plan {
    fn device_bytes_mirrored(&self) -> f64 {
        ["c4_kv", "c4_indexer", "c128_kv", "snapshots"]
            .iter()
            .map(|p| self.pool_named(p).unwrap().device_bytes() as f64)
            .sum()
    }
}

#[test]
fn a_snapshot_pool_smaller_than_twice_the_running_requests_is_noted() {
    let warned = |plan: &Plan| {
        plan.notes
            .iter()
            .any(|n| n.contains("prefix-cache snapshots for"))
    };
    let roomy = flash_plan(json!({}), &Machine::big());
    assert!(roomy.pool_named("snapshots").unwrap().device_units >= 2 * 64);
    assert!(!warned(&roomy));
    let tight = flash_plan(json!({"kv": {"snapshot_fraction": 0.001}}), &Machine::big());
    let units = tight.pool_named("snapshots").unwrap().device_units;
    assert!(units > 0 && units < 2 * 64, "{units}");
    assert!(warned(&tight), "{:?}", tight.notes);
    let off = flash_plan(json!({"kv": {"snapshot_fraction": 0.0}}), &Machine::big());
    assert!(!warned(&off), "snapshots disabled on purpose: no note");
}

#[test]
fn hicache_without_ratio_or_size_uses_ratio_two_and_says_so() {
    let plan = flash_plan(json!({"hicache": {"enabled": true}}), &Machine::big());
    assert!((plan.effective_ratio() - 2.0).abs() < 1e-12);
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("neither hicache.ratio nor hicache.size_bytes")));
    assert_eq!(plan.to_json()["hicache"]["mode"], "ratio");
}

#[test]
fn numa_fit_uses_the_chosen_node_and_the_cgroup_limit() {
    let size = json!({"hicache": {"enabled": true, "size_bytes": "150GB"}});
    // Process on node 1 with 900 GiB free: fits.
    let plan = flash_plan(size.clone(), &Machine::big());
    assert!(plan.numa.fits, "{}", plan.numa.reason);
    assert_eq!(plan.numa.node.as_ref().unwrap().index, 1);
    // A cgroup with 100 GiB of room: does not fit, and says which knob to turn.
    let boxed = Machine {
        cgroup: Some((128 * GIB, 28 * GIB)),
        ..Machine::big()
    };
    let plan = flash_plan(size.clone(), &boxed);
    assert!(!plan.numa.fits);
    assert_eq!(plan.numa.free_bytes, 100 * GIB);
    assert!(
        plan.numa
            .reason
            .contains("capped by the cgroup memory limit"),
        "{}",
        plan.numa.reason
    );
    assert!(
        plan.numa.reason.contains("lower hicache.size_bytes"),
        "{}",
        plan.numa.reason
    );
    // An explicit node index that does not exist.
    let mut missing = size;
    merge(&mut missing, json!({"hicache": {"numa_node": 7}}));
    let plan = flash_plan(missing, &Machine::big());
    assert!(!plan.numa.fits);
    assert!(plan
        .numa
        .reason
        .contains("hicache.numa_node = 7 does not exist on this machine (nodes: 0, 1)"));
}

#[test]
fn plans_refuse_budgets_and_parallelism_that_cannot_work() {
    let machine = Machine::big();
    let params = |doc: Value| Params::from_value(&doc).unwrap();
    let flash = || model("deepseek-v4-flash");
    // 64 requests × ~15 MB of fixed state do not fit in 512 MiB.
    let e = plan_with(
        &params(
            json!({"backend": "cuda", "kv": {"dtype": "fp8", "device_memory_bytes": "512MiB",
                       "max_running_requests": 64}}),
        ),
        flash(),
        &machine,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("lower kv.max_running_requests to 34"),
        "{e}"
    );
    let e = plan_with(
        &params(json!({"parallel": {"tp": 3, "ep": 7}, "kv": {"max_context_tokens": 2000000}})),
        flash(),
        &machine,
    )
    .unwrap_err();
    for needle in [
        "`parallel.tp` = 3 does not divide the model's num_attention_heads = 64",
        "`parallel.ep` = 7 does not divide the model's 256 routed experts",
        "`kv.max_context_tokens` = 2000000 exceeds the model's max_position_embeddings = 1048576",
    ] {
        assert!(e.message().contains(needle), "missing {needle:?}: {e}");
    }
    // A GPU fraction with no GPU to read says why and how to plan offline.
    let e = plan_with(&params(json!({"backend": "cuda"})), flash(), &machine).unwrap_err();
    assert!(e.message().contains("this probe reads no GPU"), "{e}");
    assert!(e.message().contains("set `kv.device_memory_bytes`"), "{e}");
    assert!(e.message().contains("`kv.device_total_bytes`"), "{e}");
    // With a GPU, the driver's free memory: 0.9 × (free − weights), per rank.
    struct WithGpu<'a>(&'a Machine, u64);
    impl dsv4::plan::numa::MemoryProbe for WithGpu<'_> {
        fn nodes(&self) -> Vec<dsv4::plan::numa::NodeMemory> {
            self.0.nodes()
        }
        fn process_node(&self) -> Option<u32> {
            self.0.process_node()
        }
        fn cgroup(&self) -> Option<(u64, u64)> {
            self.0.cgroup()
        }
        fn gpu_free(&self, _: &[u32]) -> Result<(u64, String), String> {
            Ok((self.1, "free memory of GPU 0 (a test H200, sm_90)".into()))
        }
    }
    let free = 140u64 << 30;
    let gpu = plan_with(
        &params(json!({"backend": "cuda", "parallel": {"ep": 8}})),
        flash(),
        &WithGpu(&machine, free),
    )
    .unwrap();
    let weights: u64 = gpu.weights.values().sum();
    assert_eq!(gpu.budget.bytes, ((free - weights) as f64 * 0.9) as u64);
    assert!(
        gpu.budget
            .source
            .contains("free memory of GPU 0 (a test H200, sm_90)"),
        "{}",
        gpu.budget.source
    );
    let ok = plan_with(
        &params(
            json!({"backend": "cuda", "kv": {"device_total_bytes": "141GB",
                       "device_memory_fraction": 0.9}, "parallel": {"ep": 8}}),
        ),
        flash(),
        &machine,
    )
    .unwrap();
    assert!(
        ok.budget
            .source
            .starts_with("kv.device_memory_fraction: 0.9 ×"),
        "{}",
        ok.budget.source
    );
}

#[test]
fn expert_parallelism_divides_expert_weights_only() {
    let one = flash_plan(json!({}), &Machine::big());
    let eight = flash_plan(json!({"parallel": {"ep": 8}}), &Machine::big());
    let fp4 = |p: &Plan| p.weights[&dsv4::config::tensors::Dtype::Fp4E2m1];
    // 256 experts × 43 layers + 256 MTP experts, 3 matrices of 2048 × 4096 FP4 values each.
    assert_eq!(fp4(&one), 44 * 256 * 3 * 2048 * 4096 / 2);
    assert_eq!(fp4(&eight), fp4(&one) / 8);
    let fp8 = |p: &Plan| p.weights[&dsv4::config::tensors::Dtype::Fp8E4m3];
    assert_eq!(fp8(&one), fp8(&eight));
}

#[test]
fn the_json_report_has_the_documented_shape() {
    let plan = flash_plan(
        json!({"hicache": {"enabled": true, "ratio": 3}}),
        &Machine::big(),
    );
    let r = plan.to_json();
    for key in [
        "model", "parallel", "pools", "totals", "capacity", "hicache", "numa",
    ] {
        assert!(r.get(key).is_some(), "{key}");
    }
    let names: Vec<&String> = r["pools"].as_object().unwrap().keys().collect();
    assert_eq!(
        names,
        [
            "c4_kv",
            "c4_indexer",
            "c128_kv",
            "swa",
            "c4_state",
            "c4_indexer_state",
            "c128_state",
            "snapshots"
        ]
    );
    for (name, pool) in r["pools"].as_object().unwrap() {
        for key in ["unit", "layers", "row_bytes", "rows_per_unit", "unit_bytes"] {
            assert!(
                pool[key].is_number() || pool[key].is_string(),
                "{name}.{key}"
            );
        }
        for tier in ["device", "host"] {
            let units = pool[tier]["units"].as_u64().unwrap();
            let bytes = pool[tier]["bytes"].as_u64().unwrap();
            assert_eq!(
                bytes,
                units * pool["unit_bytes"].as_u64().unwrap(),
                "{name}.{tier}"
            );
        }
    }
    assert_eq!(r["pools"]["c4_kv"]["unit"], "page");
    assert_eq!(r["pools"]["swa"]["unit"], "slot");
    assert_eq!(r["pools"]["snapshots"]["unit"], "snapshot");
    assert_eq!(r["hicache"]["mode"], "ratio");
    assert!(r["hicache"]["budget_bytes"].is_null());
    assert_eq!(r["hicache"]["effective_ratio"], json!(3.0));
    assert_eq!(r["parallel"], json!({"tp": 1, "ep": 1}));
    assert!(r["totals"]["weights_bytes"]["fp8_e4m3"].as_u64().unwrap() > 0);
    assert!(r["capacity"]["max_full_context_requests"].is_u64());
    assert!(r["numa"]["fits"].is_boolean());
    let sum: u64 = r["pools"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| p["device"]["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(r["totals"]["device_bytes"].as_u64().unwrap(), sum);
}

#[test]
fn the_text_report_is_aligned_and_states_bytes() {
    let plan = flash_plan(
        json!({"hicache": {"enabled": true, "size_bytes": "150GB"}}),
        &Machine::big(),
    );
    let text = plan.to_text();
    assert!(text.contains("150,000,000,000 B (139.70 GiB)"), "{text}");
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("pool"))
        .take_while(|l| !l.is_empty())
        .collect();
    assert_eq!(table.len(), 10, "header + 8 pools + total:\n{text}");
    // Right-aligned numeric columns: every row ends at the same column.
    let width = table[0].len();
    assert!(table.iter().all(|l| l.len() == width), "{text}");
    assert!(
        text.contains("\nsummary\n  hicache: size 150,000,000,000 B\n"),
        "{text}"
    );
    assert!(text.contains("  fits NUMA node: yes"));
}

/// The documented rule for `hicache.size_bytes` B (docs/plan.md): a pool's share of B is in
/// proportion to its device bytes, so it holds ⌊B × device units ÷ mirrored device bytes⌋ host
/// units and gets one once B ≥ mirrored device bytes ÷ its device units. Returns that smallest
/// B for pages and for snapshots (`None` without device units). Device units do not depend on
/// the host tier, so they are read from a plan with a roomy one.
fn smallest_size_for_one_host_unit(kv: Value) -> (Option<u64>, Option<u64>) {
    let roomy = size_plan(kv, json!("150GB")).unwrap();
    let device = roomy.device_bytes_mirrored() as u64;
    let smallest = |pool: &str| {
        let units = roomy.pool_named(pool).unwrap().device_units;
        (units > 0).then(|| device.div_ceil(units))
    };
    (smallest("c4_kv"), smallest("snapshots"))
}

fn size_plan(kv: Value, size: Value) -> dsv4::Result<Plan> {
    let mut doc = json!({
        "model_path": "configs/deepseek-v4-flash",
        "backend": "cuda",
        "role": "prefill",
        "kv": {"dtype": "fp8", "indexer_dtype": "fp8", "page_size": 256,
               "device_memory_bytes": "2GiB", "max_running_requests": 8},
        "hicache": {"enabled": true, "size_bytes": size}
    });
    merge(&mut doc, json!({"kv": kv}));
    let params = Params::from_value(&doc).unwrap();
    plan_with(&params, model("deepseek-v4-flash"), &Machine::big())
}

#[test]
fn a_size_that_plans_an_empty_host_pool_is_refused_with_the_smallest_that_does_not() {
    let kv = json!({});
    let (Some(for_pages), Some(for_snapshots)) = smallest_size_for_one_host_unit(kv.clone()) else {
        panic!("pages and snapshots both have device units");
    };
    // Snapshots are the smaller device pool, so they set the minimum.
    assert!(for_pages < for_snapshots);
    let smallest = for_snapshots;

    let plan = size_plan(kv.clone(), json!(smallest)).unwrap();
    let host = |pool: &str| plan.pool_named(pool).unwrap().host_units;
    assert!(host("c4_kv") >= 1);
    assert_eq!(host("snapshots"), 1);

    let e = size_plan(kv.clone(), json!(smallest - 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    let m = e.message();
    let shown = dsv4::config::size::grouped(smallest);
    assert!(m.contains(&format!("is {shown} B (")), "{m}");
    assert!(m.contains("a host tier that holds no snapshots"), "{m}");
    assert!(!m.contains("no pages"), "{m}");
    assert!(m.contains("raise hicache.size_bytes"), "{m}");
    // Large, so no guess about GB.
    assert!(!m.contains("did you mean"), "{m}");

    // The incident: SGLang's `--hicache-size 150` carried over as a bare number of bytes.
    let m = size_plan(kv.clone(), json!(150)).unwrap_err().to_string();
    assert!(m.contains("`hicache.size_bytes` = 150 B"), "{m}");
    assert!(m.contains("no pages") && m.contains("no snapshots"), "{m}");
    assert!(
        m.contains("HiCache would be enabled with no host tier"),
        "{m}"
    );
    assert!(m.contains("did you mean \"150GB\"?"), "{m}");
    assert!(m.contains(&format!("is {shown} B (")), "{m}");
    // The same bytes written with a unit are no unit mix-up.
    let m = size_plan(kv.clone(), json!("150B"))
        .unwrap_err()
        .to_string();
    assert!(!m.contains("did you mean"), "{m}");
    // Enough for one page only: refused, naming the snapshots.
    let m = size_plan(kv, json!(for_pages)).unwrap_err().to_string();
    assert!(m.contains("a host tier that holds no snapshots"), "{m}");
}

#[test]
fn without_device_snapshots_only_pages_need_a_host_unit() {
    let kv = json!({"snapshot_fraction": 0.0});
    let (Some(smallest), None) = smallest_size_for_one_host_unit(kv.clone()) else {
        panic!("no device snapshots: only pages are mirrored");
    };
    let plan = size_plan(kv.clone(), json!(smallest)).unwrap();
    assert_eq!(plan.host_pages(), 1);
    assert_eq!(plan.pool_named("snapshots").unwrap().host_units, 0);
    let m = size_plan(kv, json!(smallest - 1)).unwrap_err().to_string();
    assert!(m.contains("no pages") && !m.contains("snapshots ("), "{m}");
    assert!(m.contains("gives pages at least one host unit each"), "{m}");
}
