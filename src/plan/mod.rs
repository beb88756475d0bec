//! The memory planner: model config + params → every pool's geometry, device and host bytes per
//! rank, token capacity, and whether the host tier fits its NUMA node. Pure computation from
//! `config.json` and params (no weights read, no GPU needed); the engine sizes its pools from the
//! same [`Plan`], so nothing else computes these numbers.

mod geometry;
pub mod numa;
mod pool_id;
pub mod reserve;
mod text;
mod weights;

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::config::params::{Backend, IndexerDtype, KvDtype, Params};
use crate::config::size::{grouped, human_bytes};
use crate::config::tensors::{checkpoint_tensors, Dtype, TensorSpec};
use crate::config::{AttentionKind, ModelConfig};
use crate::error::{Error, ErrorKind, Result};
pub use geometry::{
    indexer_codec, indexer_row_bytes, kv_codec, kv_row_bytes, Geometry, PoolShape, Unit,
};
use numa::{MemoryProbe, NodeMemory, SystemProbe};
pub use pool_id::PoolId;
pub use reserve::{Held, Registry, Reservation};

/// HiCache ratio used when neither `hicache.ratio` nor `hicache.size_bytes` is set.
pub const DEFAULT_HICACHE_RATIO: f64 = 2.0;

/// One pool with its units on each tier.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolPlan {
    pub shape: PoolShape,
    pub device_units: u64,
    pub host_units: u64,
}

impl PoolPlan {
    /// Which pool this is.
    pub fn id(&self) -> PoolId {
        self.shape.id
    }

    pub fn device_bytes(&self) -> u64 {
        self.device_units * self.shape.unit_bytes
    }

    pub fn host_bytes(&self) -> u64 {
        self.host_units * self.shape.unit_bytes
    }
}

/// How the host tier was sized.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HiCacheMode {
    Off,
    Ratio { ratio: f64, defaulted: bool },
    Size { budget_bytes: u64 },
}

/// The NUMA fit check.
#[derive(Debug, Clone, PartialEq)]
pub struct NumaFit {
    pub node: Option<NodeMemory>,
    /// "gpu", "process" or "hicache.numa_node".
    pub source: &'static str,
    pub cgroup_limit_bytes: Option<u64>,
    /// Free bytes on the node, capped by what the cgroup still allows.
    pub free_bytes: u64,
    /// Whether the cgroup's room, not the node, set `free_bytes`.
    pub capped_by_cgroup: bool,
    /// What other live engines of this process reserved on the node; the part they have not
    /// touched yet (`outstanding_bytes`) is not in `free_bytes` but is spoken for.
    pub others: Held,
    /// Host memory this plan needs.
    pub required_bytes: u64,
    /// `required_bytes <= free_bytes - others.outstanding_bytes`.
    pub fits: bool,
    pub reason: String,
}

/// The device KV budget and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceBudget {
    pub bytes: u64,
    pub source: String,
}

/// A complete per-rank memory plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub model: ModelConfig,
    pub params: Params,
    pub kv_dtype: KvDtype,
    pub indexer_dtype: IndexerDtype,
    pub geometry: Geometry,
    pub pools: Vec<PoolPlan>,
    pub weights: BTreeMap<Dtype, u64>,
    pub params_total: u64,
    pub budget: DeviceBudget,
    pub max_context_tokens: u64,
    pub hicache: HiCacheMode,
    pub numa: NumaFit,
    /// Decisions the operator did not spell out, stated so nothing is silent.
    pub notes: Vec<String>,
}

/// Plans for `params`, reading `config.json` at `params.model_path` and this machine's memory.
pub fn plan(params: &Params) -> Result<Plan> {
    let Some(path) = params.model_path.as_deref() else {
        return Err(Error::config(
            "`model_path` is not set: point it at a DeepSeek V4 checkpoint directory, or at \
             configs/deepseek-v4-flash to plan without weights",
        ));
    };
    let started = std::time::Instant::now();
    let model = ModelConfig::load(Path::new(path))?;
    let plan = plan_with(params, model, &SystemProbe::new())?;
    log::info!(
        "planned {}: device KV {}, host tier {}, NUMA {} ({:.1} ms)",
        plan.model.name,
        bytes_both(plan.device_bytes()),
        bytes_both(plan.host_bytes()),
        if plan.numa.fits {
            "fits"
        } else {
            "does not fit"
        },
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(plan)
}

/// Plans with an explicit model and memory probe (tests describe any machine this way),
/// counting the reservations of this process's live engines.
pub fn plan_with(params: &Params, model: ModelConfig, probe: &dyn MemoryProbe) -> Result<Plan> {
    plan_in(params, model, probe, &Registry::process())
}

/// [`plan_with`] against an explicit set of engine reservations.
pub fn plan_in(
    params: &Params,
    model: ModelConfig,
    probe: &dyn MemoryProbe,
    registry: &Registry,
) -> Result<Plan> {
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    check_against_model(params, &model, &mut problems);
    if !problems.is_empty() {
        return Err(Error::from_problems(
            ErrorKind::Config,
            "params for this model",
            &problems,
        ));
    }
    let (kv_dtype, indexer_dtype) = (params.kv_dtype(), params.indexer_dtype());
    if params.kv.dtype == KvDtype::Auto || params.kv.indexer_dtype == IndexerDtype::Auto {
        notes.push(format!(
            "kv.dtype / kv.indexer_dtype \"auto\" → {} / {} on the {} backend",
            kv_name(kv_dtype),
            indexer_name(indexer_dtype),
            backend_name(params.backend)
        ));
    }
    let page_size = u64::from(params.kv.page_size);
    let geometry = Geometry::new(&model, page_size, kv_dtype, indexer_dtype);
    let weights = weights::per_rank(&model, params);
    let weight_bytes: u64 = weights.values().sum();
    let params_total = checkpoint_tensors(&model)
        .iter()
        .map(TensorSpec::elements)
        .sum();

    let budget = device_budget(params, weight_bytes, probe, &mut notes)?;
    let (page_units, snapshot_units) = device_units(params, &geometry, &budget)?;
    let max_running = u64::from(params.kv.max_running_requests);
    let max_context_tokens = params
        .kv
        .max_context_tokens
        .unwrap_or(model.max_position_embeddings);
    let (hicache, host_pages, host_snapshots) =
        host_units(params, &geometry, page_units, snapshot_units, &mut notes)?;

    let pools: Vec<PoolPlan> = geometry
        .all()
        .into_iter()
        .map(|shape| {
            let (device_units, host_units) = match shape.unit {
                Unit::Page => (page_units, host_pages),
                Unit::Slot => (max_running, 0),
                Unit::Snapshot => (snapshot_units, host_snapshots),
            };
            PoolPlan {
                shape: shape.clone(),
                device_units,
                host_units,
            }
        })
        .collect();

    let host_bytes: u64 = pools.iter().map(PoolPlan::host_bytes).sum();
    let device_bytes: u64 = pools.iter().map(PoolPlan::device_bytes).sum();
    let numa = numa_fit(
        params,
        probe,
        registry,
        host_bytes,
        device_bytes,
        weight_bytes,
    );

    let pages_per_context = max_context_tokens.div_ceil(page_size);
    if geometry.page_bytes() > 0 && pages_per_context > page_units {
        notes.push(format!(
            "one request of kv.max_context_tokens = {} needs {} pages but the device pool holds \
             {}: such requests are refused with DSV4_ERR_CAPACITY; raise the device budget or \
             lower kv.max_context_tokens",
            grouped(max_context_tokens),
            grouped(pages_per_context),
            grouped(page_units)
        ));
    }
    if snapshot_units > 0 && snapshot_units < 2 * max_running {
        notes.push(format!(
            "the device holds {snapshot_units} prefix-cache snapshots for {max_running} running \
             requests, and each decoding request keeps one at its latest page boundary: prompt \
             snapshots will be evicted almost as soon as they are taken (few cache hits); raise \
             kv.snapshot_fraction or the device budget, or lower kv.max_running_requests"
        ));
    }
    Ok(Plan {
        model,
        params: params.clone(),
        kv_dtype,
        indexer_dtype,
        geometry,
        pools,
        weights,
        params_total,
        budget,
        max_context_tokens,
        hicache,
        numa,
        notes,
    })
}

fn check_against_model(params: &Params, model: &ModelConfig, problems: &mut Vec<String>) {
    let (tp, ep) = (params.parallel.tp as usize, params.parallel.ep as usize);
    for (what, n) in [
        ("num_attention_heads", model.num_heads),
        ("o_groups", model.o_groups),
        ("vocab_size", model.vocab_size),
    ] {
        if n % tp != 0 {
            problems.push(format!(
                "`parallel.tp` = {tp} does not divide the model's {what} = {n}: use a divisor"
            ));
        }
    }
    if !model.n_routed_experts.is_multiple_of(ep) {
        problems.push(format!(
            "`parallel.ep` = {ep} does not divide the model's {} routed experts: use a divisor",
            model.n_routed_experts
        ));
    }
    if let Some(ctx) = params.kv.max_context_tokens {
        if ctx > model.max_position_embeddings {
            problems.push(format!(
                "`kv.max_context_tokens` = {ctx} exceeds the model's max_position_embeddings = \
                 {}: lower it",
                model.max_position_embeddings
            ));
        }
    }
    let page = params.kv.page_size as usize;
    for (what, ratio) in [("CSA", model.csa_ratio), ("HCA", model.hca_ratio)] {
        if ratio > 0 && !page.is_multiple_of(ratio) {
            problems.push(format!(
                "`kv.page_size` = {page} is not a multiple of the model's {what} compression ratio \
                 {ratio}: compressed rows would straddle pages; use {}",
                page.next_multiple_of(ratio)
            ));
        }
    }
    if params.indexer_dtype() == IndexerDtype::Fp4 && !model.index_head_dim.is_multiple_of(32) {
        problems.push(format!(
            "`kv.indexer_dtype` = fp4 needs index_head_dim to be a multiple of 32, the model has \
             {}: use fp8",
            model.index_head_dim
        ));
    }
}

fn device_budget(
    params: &Params,
    weight_bytes: u64,
    probe: &dyn MemoryProbe,
    notes: &mut Vec<String>,
) -> Result<DeviceBudget> {
    if let Some(bytes) = params.kv.device_memory_bytes {
        return Ok(DeviceBudget {
            bytes: bytes.0,
            source: "kv.device_memory_bytes".into(),
        });
    }
    let (fraction, stated) = match params.kv.device_memory_fraction {
        Some(f) => (f, true),
        None => match params.backend {
            Backend::Cuda => (0.9, false),
            // Host RAM is shared with the weights, the host tier and everything else.
            Backend::Cpu => (0.25, false),
        },
    };
    let (total, total_source) = match (params.backend, params.kv.device_total_bytes) {
        (_, Some(total)) => (total.0, "kv.device_total_bytes".to_string()),
        (Backend::Cpu, None) => {
            let free: u64 = probe.nodes().iter().map(|n| n.free_bytes).sum();
            let free = match probe.cgroup() {
                Some((limit, usage)) => free.min(limit.saturating_sub(usage)),
                None => free,
            };
            (free, "host memory available to this process".to_string())
        }
        (Backend::Cuda, None) => match probe.gpu_free(&params.devices) {
            Ok(found) => found,
            Err(why) => {
                return Err(Error::config(format!(
                    "`kv.device_memory_fraction`{} needs the GPU's free memory, which the \
                     driver could not tell ({}): set `kv.device_memory_bytes` (or \
                     `kv.device_total_bytes`, e.g. \"141GB\" for an H200)",
                    if stated { "" } else { " (default 0.9 on cuda)" },
                    why.trim_start_matches("backend = cuda: ")
                )))
            }
        },
    };
    let Some(usable) = total.checked_sub(weight_bytes).filter(|&u| u > 0) else {
        return Err(Error::config(format!(
            "the weights need {} per rank but the device has {} ({total_source}): add ranks \
             (parallel.tp / parallel.ep), use bf16 weights, or set kv.device_memory_bytes",
            bytes_both(weight_bytes),
            bytes_both(total)
        )));
    };
    let bytes = (usable as f64 * fraction) as u64;
    let source = format!(
        "{} × ({} {total_source} − {} weights)",
        fraction,
        human_bytes(total),
        human_bytes(weight_bytes)
    );
    if !stated {
        notes.push(format!(
            "neither kv.device_memory_bytes nor kv.device_memory_fraction is set: the KV budget \
             is {source} = {}",
            bytes_both(bytes)
        ));
    }
    Ok(DeviceBudget {
        bytes,
        source: if stated {
            format!("kv.device_memory_fraction: {source}")
        } else {
            source
        },
    })
}

/// Splits the device budget: slots first, then `snapshot_fraction` of the rest for snapshots,
/// then whole pages from what remains.
fn device_units(params: &Params, geometry: &Geometry, budget: &DeviceBudget) -> Result<(u64, u64)> {
    let max_running = u64::from(params.kv.max_running_requests);
    let slots = max_running * geometry.slot_bytes();
    let Some(rest) = budget.bytes.checked_sub(slots) else {
        return Err(Error::config(format!(
            "the device KV budget {} ({}) cannot hold the fixed state of kv.max_running_requests \
             = {max_running} ({} each, {} in all): raise the budget or lower \
             kv.max_running_requests to {}",
            bytes_both(budget.bytes),
            budget.source,
            bytes_both(geometry.slot_bytes()),
            bytes_both(slots),
            budget.bytes / geometry.slot_bytes().max(1)
        )));
    };
    let snapshot_bytes = geometry.snapshots.unit_bytes;
    let snapshots = ((rest as f64 * params.kv.snapshot_fraction) as u64)
        .checked_div(snapshot_bytes)
        .unwrap_or(0);
    let page_bytes = geometry.page_bytes();
    let pages = (rest - snapshots * snapshot_bytes)
        .checked_div(page_bytes)
        .unwrap_or(0);
    Ok((pages, snapshots))
}

fn host_units(
    params: &Params,
    geometry: &Geometry,
    device_pages: u64,
    device_snapshots: u64,
    notes: &mut Vec<String>,
) -> Result<(HiCacheMode, u64, u64)> {
    let h = &params.hicache;
    if !h.enabled {
        if h.ratio.is_some() || h.size_bytes.is_some() {
            notes.push(
                "hicache.ratio / hicache.size_bytes are set but hicache.enabled is false: no \
                 host tier is planned"
                    .into(),
            );
        }
        return Ok((HiCacheMode::Off, 0, 0));
    }
    if let Some(budget) = h.size_bytes {
        let split = SizeSplit::new(geometry, device_pages, device_snapshots);
        let (pages, snapshots) = (split.pages.units(budget.0), split.snapshots.units(budget.0));
        split.refuse_empty_pools(budget.0, h.size_bytes_spelling.bare_number)?;
        return Ok((
            HiCacheMode::Size {
                budget_bytes: budget.0,
            },
            pages,
            snapshots,
        ));
    }
    let (ratio, defaulted) = match h.ratio {
        Some(r) => (r, false),
        None => {
            notes.push(format!(
                "neither hicache.ratio nor hicache.size_bytes is set: host tier = \
                 {DEFAULT_HICACHE_RATIO} × the device pages and snapshots"
            ));
            (DEFAULT_HICACHE_RATIO, true)
        }
    };
    let scale = |units: u64| (units as f64 * ratio).floor() as u64;
    Ok((
        HiCacheMode::Ratio { ratio, defaulted },
        scale(device_pages),
        scale(device_snapshots),
    ))
}

/// Below this, a bare-number `hicache.size_bytes` is taken for a size in GB written without its
/// unit (SGLang's `--hicache-size` is in GB): a real host tier is gigabytes.
const BARE_GB_SUSPECT_BELOW: u64 = 1_000_000;

/// One budget of `hicache.size_bytes` split over the host tier's two kinds of unit in proportion
/// to their device bytes, so pages and snapshots get the same effective ratio. In integers: a
/// share is ⌊budget × weight ÷ (total × unit)⌋ units, the total never exceeds the budget, and
/// the smallest budget that gives a share one unit is exact.
struct SizeSplit {
    pages: Share,
    snapshots: Share,
}

/// One kind of host unit in a [`SizeSplit`].
struct Share {
    what: &'static str,
    unit_bytes: u64,
    /// The share's device bytes.
    weight: u64,
    /// Device bytes of both shares together.
    total: u64,
}

impl Share {
    fn units(&self, budget: u64) -> u64 {
        let whole = u128::from(self.total) * u128::from(self.unit_bytes);
        if whole == 0 {
            return 0;
        }
        let units = u128::from(budget) * u128::from(self.weight) / whole;
        u64::try_from(units).unwrap_or(u64::MAX)
    }

    /// Whether the host tier is meant to hold this kind of unit (it has device units, as
    /// `hicache.ratio` would mirror).
    fn mirrored(&self) -> bool {
        self.weight > 0 && self.unit_bytes > 0
    }

    /// The smallest budget giving this share one unit: ⌈total × unit ÷ weight⌉.
    fn smallest_budget(&self) -> u64 {
        let whole = u128::from(self.total) * u128::from(self.unit_bytes);
        u64::try_from(whole.div_ceil(u128::from(self.weight.max(1)))).unwrap_or(u64::MAX)
    }
}

impl SizeSplit {
    fn new(geometry: &Geometry, device_pages: u64, device_snapshots: u64) -> Self {
        let page_bytes = geometry.page_bytes();
        let snapshot_bytes = geometry.snapshots.unit_bytes;
        let (mut page_dev, snap_dev) =
            (device_pages * page_bytes, device_snapshots * snapshot_bytes);
        // No device pages or snapshots at all: the whole budget goes to pages.
        if page_dev + snap_dev == 0 {
            page_dev = 1;
        }
        let total = page_dev + snap_dev;
        Self {
            pages: Share {
                what: "pages",
                unit_bytes: page_bytes,
                weight: page_dev,
                total,
            },
            snapshots: Share {
                what: "snapshots",
                unit_bytes: snapshot_bytes,
                weight: snap_dev,
                total,
            },
        }
    }

    /// Refuses a budget that leaves a mirrored kind of unit with none on the host: the engine
    /// would run with HiCache enabled and no host tier (or one that cannot hold a cached
    /// prefix's snapshot), which is never what the operator meant.
    fn refuse_empty_pools(&self, budget: u64, bare_number: bool) -> Result<()> {
        let mirrored: Vec<&Share> = [&self.pages, &self.snapshots]
            .into_iter()
            .filter(|s| s.mirrored())
            .collect();
        let empty: Vec<&Share> = mirrored
            .iter()
            .copied()
            .filter(|s| s.units(budget) == 0)
            .collect();
        if empty.is_empty() {
            return Ok(());
        }
        let smallest = mirrored
            .iter()
            .map(|s| s.smallest_budget())
            .max()
            .unwrap_or(budget);
        let missing: Vec<String> = empty
            .iter()
            .map(|s| format!("{} ({} B each)", s.what, grouped(s.unit_bytes)))
            .collect();
        let outcome = if empty.len() == mirrored.len() {
            "no host tier".to_string()
        } else {
            format!("a host tier that holds no {}", empty[0].what)
        };
        let guess = if bare_number && budget < BARE_GB_SUSPECT_BELOW {
            format!(
                "; did you mean \"{budget}GB\"? (a bare number is bytes; SGLang's --hicache-size \
                 is in GB)"
            )
        } else {
            String::new()
        };
        Err(Error::config(format!(
            "`hicache.size_bytes` = {} B leaves the host tier no {}: HiCache would be enabled \
             with {outcome}. Split in proportion to device bytes, the smallest size that gives \
             {} at least one host unit each is {}: raise hicache.size_bytes to at least that, \
             or set hicache.enabled to false{guess}",
            grouped(budget),
            missing.join(" and no "),
            mirrored
                .iter()
                .map(|s| s.what)
                .collect::<Vec<_>>()
                .join(" and "),
            bytes_both(smallest)
        )))
    }
}

fn numa_fit(
    params: &Params,
    probe: &dyn MemoryProbe,
    registry: &Registry,
    host_bytes: u64,
    device_bytes: u64,
    weight_bytes: u64,
) -> NumaFit {
    // On the CPU backend "device" pools and weights are host RAM too.
    let required = match params.backend {
        Backend::Cpu => host_bytes + device_bytes + weight_bytes,
        Backend::Cuda => host_bytes,
    };
    let gpu_visible = false; // The CUDA backend will report its GPU's node here.
    let cgroup = probe.cgroup();
    let (node, source) = match numa::choose_node(probe, params.hicache.numa_node, gpu_visible) {
        Ok(found) => found,
        Err(reason) => {
            return NumaFit {
                node: None,
                source: "hicache.numa_node",
                cgroup_limit_bytes: cgroup.map(|(l, _)| l),
                free_bytes: 0,
                capped_by_cgroup: false,
                others: Held::default(),
                required_bytes: required,
                fits: required == 0,
                reason,
            }
        }
    };
    let cgroup_room = cgroup.map(|(limit, usage)| limit.saturating_sub(usage));
    let free = cgroup_room.map_or(node.free_bytes, |room| room.min(node.free_bytes));
    let capped = cgroup_room.is_some_and(|room| room < node.free_bytes);
    let others = registry.held(node.index);
    let (fits, reason) = fit_reason(params, required, node.index, free, capped, &others);
    NumaFit {
        node: Some(node),
        source,
        cgroup_limit_bytes: cgroup.map(|(l, _)| l),
        free_bytes: free,
        capped_by_cgroup: capped,
        others,
        required_bytes: required,
        fits,
        reason,
    }
}

/// Whether `required` bytes fit in `free` less what other engines reserved and have not
/// touched yet (`held`), and the reason in words, with the fix when they do not.
fn fit_reason(
    params: &Params,
    required: u64,
    node: u32,
    free: u64,
    capped: bool,
    held: &Held,
) -> (bool, String) {
    let what = match params.backend {
        Backend::Cpu => "weights + KV pools + host tier (CPU backend: all in host RAM)",
        Backend::Cuda => "the HiCache host tier",
    };
    if required == 0 {
        return (true, "no host memory is needed (HiCache off)".to_string());
    }
    let limited_by = if capped {
        " (capped by the cgroup memory limit)"
    } else {
        ""
    };
    let available = free.saturating_sub(held.outstanding_bytes);
    let fits = required <= available;
    let room = if held.engines == 0 {
        format!("{} free{limited_by}", bytes_both(free))
    } else {
        format!(
            "{} available: {} free{limited_by} less {} that other engines will still touch \
             ({})",
            bytes_both(available),
            human_bytes(free),
            human_bytes(held.outstanding_bytes),
            held.describe()
        )
    };
    if fits {
        return (
            true,
            format!(
                "{what} needs {} and NUMA node {node} has {room}",
                bytes_both(required)
            ),
        );
    }
    let fix = match (params.backend, params.hicache.size_bytes.is_some()) {
        (Backend::Cpu, true) if params.hicache.enabled => {
            "lower hicache.size_bytes or kv.device_memory_bytes, or use bf16 weights"
        }
        (Backend::Cpu, false) if params.hicache.enabled => {
            "lower hicache.ratio or kv.device_memory_bytes, or use bf16 weights"
        }
        (Backend::Cpu, _) => "lower kv.device_memory_bytes, or use bf16 weights",
        (Backend::Cuda, true) => {
            "lower hicache.size_bytes or set hicache.numa_node to a node with more free memory"
        }
        (Backend::Cuda, false) => {
            "lower hicache.ratio (or set hicache.size_bytes) or set hicache.numa_node to a \
             node with more free memory"
        }
    };
    let also = if held.engines == 0 {
        ""
    } else {
        ", or destroy one of those engines first"
    };
    (
        false,
        format!(
            "{what} needs {} but NUMA node {node} has only {room}: {fix}{also}",
            bytes_both(required)
        ),
    )
}

/// "150,000,000,000 B (139.70 GiB)".
pub fn bytes_both(bytes: u64) -> String {
    format!("{} B ({})", grouped(bytes), human_bytes(bytes))
}

fn kv_name(d: KvDtype) -> &'static str {
    match d {
        KvDtype::Auto => "auto",
        KvDtype::F32 => "f32",
        KvDtype::Bf16 => "bf16",
        KvDtype::Fp8 => "fp8",
    }
}

fn indexer_name(d: IndexerDtype) -> &'static str {
    match d {
        IndexerDtype::Auto => "auto",
        IndexerDtype::F32 => "f32",
        IndexerDtype::Bf16 => "bf16",
        IndexerDtype::Fp8 => "fp8",
        IndexerDtype::Fp4 => "fp4",
    }
}

fn backend_name(b: Backend) -> &'static str {
    match b {
        Backend::Cpu => "cpu",
        Backend::Cuda => "cuda",
    }
}

impl Plan {
    /// Pool `id`'s plan (every plan from [`plan`] has all of [`PoolId::ALL`]).
    pub fn pool(&self, id: PoolId) -> Option<&PoolPlan> {
        self.pools.iter().find(|p| p.shape.id == id)
    }

    /// The pool called `name` in reports (`"c4_kv"`, …), for callers holding a name.
    pub fn pool_named(&self, name: &str) -> Option<&PoolPlan> {
        self.pool(PoolId::from_name(name)?)
    }

    pub fn device_bytes(&self) -> u64 {
        self.pools.iter().map(PoolPlan::device_bytes).sum()
    }

    pub fn host_bytes(&self) -> u64 {
        self.pools.iter().map(PoolPlan::host_bytes).sum()
    }

    pub fn device_pages(&self) -> u64 {
        self.pool(PoolId::C4Kv).map_or(0, |p| p.device_units)
    }

    pub fn host_pages(&self) -> u64 {
        self.pool(PoolId::C4Kv).map_or(0, |p| p.host_units)
    }

    /// Host bytes ÷ device bytes over the pools the host tier mirrors (pages and snapshots).
    pub fn effective_ratio(&self) -> f64 {
        let mirrored = |f: fn(&PoolPlan) -> u64| -> u64 {
            self.pools
                .iter()
                .filter(|p| p.shape.unit != Unit::Slot)
                .map(f)
                .sum()
        };
        let device = mirrored(PoolPlan::device_bytes);
        if device == 0 {
            0.0
        } else {
            mirrored(PoolPlan::host_bytes) as f64 / device as f64
        }
    }

    pub fn device_tokens(&self) -> u64 {
        self.device_pages() * self.geometry.page_size
    }

    pub fn host_tokens(&self) -> u64 {
        self.host_pages() * self.geometry.page_size
    }

    /// Requests of `max_context_tokens` that fit in device pages at once (and in slots).
    pub fn max_full_context_requests(&self) -> u64 {
        let per_request = self.max_context_tokens.div_ceil(self.geometry.page_size);
        let by_pages = if self.geometry.page_bytes() == 0 {
            u64::MAX
        } else {
            self.device_pages() / per_request.max(1)
        };
        by_pages.min(u64::from(self.params.kv.max_running_requests))
    }

    /// The JSON report (see docs/plan.md for every field).
    pub fn to_json(&self) -> Value {
        let m = &self.model;
        let mut pools = Map::new();
        for p in &self.pools {
            let s = &p.shape;
            let mut pool = json!({
                "unit": s.unit,
                "layers": s.layers,
                "row_bytes": s.row_bytes,
                "rows_per_unit": s.rows_per_unit,
                "unit_bytes": s.unit_bytes,
                "device": {"units": p.device_units, "bytes": p.device_bytes()},
                "host": {"units": p.host_units, "bytes": p.host_bytes()},
            });
            if !s.components.is_empty() {
                let parts: Map<String, Value> = s
                    .components
                    .iter()
                    .map(|(name, bytes)| (name.to_string(), json!(bytes)))
                    .collect();
                pool["components"] = Value::Object(parts);
            }
            pools.insert(s.id.name().to_string(), pool);
        }
        let weights: Map<String, Value> = self
            .weights
            .iter()
            .map(|(dtype, bytes)| (dtype.name().to_string(), json!(bytes)))
            .collect();
        let (mode, ratio, budget) = match self.hicache {
            HiCacheMode::Off => ("off", None, None),
            HiCacheMode::Ratio { ratio, .. } => ("ratio", Some(ratio), None),
            HiCacheMode::Size { budget_bytes } => ("size", None, Some(budget_bytes)),
        };
        let n = &self.numa;
        json!({
            "model": {
                "name": m.name,
                "config_form": m.form,
                "layers": m.num_layers,
                "mtp_layers": m.num_mtp_layers,
                "layer_kinds": {
                    "swa": m.count(AttentionKind::Swa),
                    "csa": m.count(AttentionKind::Csa),
                    "hca": m.count(AttentionKind::Hca),
                },
                "hidden_size": m.hidden_size,
                "vocab_size": m.vocab_size,
                "head_dim": m.head_dim,
                "sliding_window": m.sliding_window,
                "compress_ratios": {"csa": m.csa_ratio, "hca": m.hca_ratio},
                "max_position_embeddings": m.max_position_embeddings,
                "params_total": self.params_total,
            },
            "deployment": {
                "backend": self.params.backend,
                "role": self.params.role,
                "devices": self.params.devices,
                "page_size": self.geometry.page_size,
                "weight_dtype": self.params.model.weight_dtype.resolve(&self.model).name(),
                "kv_dtype": kv_name(self.kv_dtype),
                "indexer_dtype": indexer_name(self.indexer_dtype),
                "max_running_requests": self.params.kv.max_running_requests,
                "max_context_tokens": self.max_context_tokens,
            },
            "parallel": {"tp": self.params.parallel.tp, "ep": self.params.parallel.ep},
            "pools": pools,
            "totals": {
                "device_bytes": self.device_bytes(),
                "host_bytes": self.host_bytes(),
                "weights_bytes": weights,
                "device_budget_bytes": self.budget.bytes,
                "device_budget_source": self.budget.source,
                "slot_bytes": self.geometry.slot_bytes(),
                "page_bytes": self.geometry.page_bytes(),
            },
            "capacity": {
                "device_tokens": self.device_tokens(),
                "host_tokens": self.host_tokens(),
                "max_full_context_requests": self.max_full_context_requests(),
            },
            "hicache": {
                "enabled": self.params.hicache.enabled,
                "mode": mode,
                "ratio": ratio,
                "budget_bytes": budget,
                "effective_ratio": self.effective_ratio(),
                "write_policy": self.params.hicache.write_policy,
            },
            "numa": {
                "node": n.node.as_ref().map(|node| node.index),
                "source": n.source,
                "total_bytes": n.node.as_ref().map_or(0, |node| node.total_bytes),
                "free_bytes": n.free_bytes,
                "cgroup_limit_bytes": n.cgroup_limit_bytes,
                "other_engines": {
                    "engines": n.others.engines,
                    "reserved_bytes": n.others.reserved_bytes,
                    "resident_bytes": n.others.resident_bytes,
                    "outstanding_bytes": n.others.outstanding_bytes,
                },
                "required_bytes": n.required_bytes,
                "fits": n.fits,
                "reason": n.reason,
            },
            "notes": self.notes,
        })
    }

    /// The same plan as an aligned, human-readable table.
    pub fn to_text(&self) -> String {
        text::render(self)
    }
}
