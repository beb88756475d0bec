//! The Prometheus text exposition (format 0.0.4) of a metrics snapshot. Names are `dsv4_` +
//! SGLang's where SGLang has the series, so existing dashboards carry over; `metrics.labels`
//! go on every sample.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::health::NodeHealth;
use super::metrics::{Histogram, MetricsSnapshot, Outcome, Rejection, Units};

/// Renders `m` with `labels` (already validated: Prometheus label names) on every sample.
pub fn render(
    m: &MetricsSnapshot,
    labels: &BTreeMap<String, String>,
    health: &NodeHealth,
) -> String {
    let mut out = Exposition {
        text: String::with_capacity(16 * 1024),
        base: labels.iter().map(|(k, v)| (k.clone(), escape(v))).collect(),
    };
    let o = &mut out;
    let c = &m.cache;
    let t = &m.kv_transfer;

    let gauges: [(&str, &str, f64); 5] = [
        (
            "num_running_reqs",
            "Requests taking part in forward steps.",
            m.running as f64,
        ),
        (
            "num_queue_reqs",
            "Accepted requests waiting to run.",
            m.queued as f64,
        ),
        (
            "num_queue_tokens",
            "Prompt tokens accepted and not yet prefilled.",
            m.queued_tokens as f64,
        ),
        (
            "num_loading_reqs",
            "Requests waiting for their prefix to be loaded back from the host tier.",
            m.loading as f64,
        ),
        (
            "token_usage",
            "Device KV pages in use over device KV pages.",
            m.token_usage(),
        ),
    ];
    for (name, help, value) in gauges {
        o.single("gauge", name, help, value);
    }

    let pools: [(&str, &str, Units); 5] = [
        ("pages", "device", m.pools.device_pages),
        ("slots", "device", m.pools.device_slots),
        ("snapshots", "device", m.pools.device_snapshots),
        ("pages", "host", m.pools.host_pages),
        ("snapshots", "host", m.pools.host_snapshots),
    ];
    type Field = fn(&Units) -> u64;
    let series: [(&str, &str, Field); 4] = [
        (
            "kv_used_units",
            "KV units in use, per pool kind and tier.",
            |u| u.used,
        ),
        (
            "kv_capacity_units",
            "KV units, per pool kind and tier.",
            |u| u.total,
        ),
        (
            "kv_used_bytes",
            "Bytes of KV units in use, per pool kind and tier.",
            |u| u.used_bytes,
        ),
        (
            "kv_capacity_bytes",
            "Bytes of KV units, per pool kind and tier.",
            |u| u.total_bytes,
        ),
    ];
    for (name, help, get) in series {
        o.header(name, help, "gauge");
        for (pool, tier, units) in &pools {
            if *tier == "host" && units.total == 0 {
                continue;
            }
            o.sample(name, &[("pool", pool), ("tier", tier)], get(units) as f64);
        }
    }

    let counters: [(&str, &str, f64); 22] = [
        ("num_requests_total", "Requests accepted by submit.", m.requests as f64),
        (
            "num_aborted_requests_total",
            "Requests ended by an abort (dsv4_abort or an abort shutdown).",
            m.finished(Outcome::Aborted) as f64,
        ),
        (
            "num_timed_out_requests_total",
            "Requests ended by their deadline or the queue timeout.",
            m.finished(Outcome::Timeout) as f64,
        ),
        (
            "num_retractions_total",
            "Running requests retracted (pages freed, requeued, recomputed) when the pools ran out.",
            m.retractions as f64,
        ),
        ("prompt_tokens_total", "Prompt tokens of requests that started running.", m.prompt_tokens as f64),
        ("generation_tokens_total", "Generated tokens.", m.generation_tokens as f64),
        ("forward_steps_total", "Forward steps run.", m.forward_steps as f64),
        (
            "forward_tokens_total",
            "Tokens computed by forward steps (prefill and decode).",
            m.forward_tokens as f64,
        ),
        ("hicache_loadback_total", "Host-tier hits loaded back into device pages.", c.loadbacks as f64),
        ("hicache_loadback_tokens_total", "Tokens loaded back from the host tier.", c.loadback_tokens as f64),
        ("hicache_loadback_bytes_total", "Bytes loaded back from the host tier.", c.loadback_bytes as f64),
        ("hicache_loadback_seconds_total", "Seconds spent by load-back copies.", c.loadback_seconds),
        (
            "hicache_loadback_skipped_total",
            "Host hits served as misses for lack of device pages.",
            c.loadbacks_skipped as f64,
        ),
        ("hicache_backup_total", "Cached prefixes backed up to the host tier.", c.backups as f64),
        ("hicache_backup_tokens_total", "Tokens backed up to the host tier.", c.backup_tokens as f64),
        ("hicache_backup_bytes_total", "Bytes backed up to the host tier.", c.backup_bytes as f64),
        ("hicache_backup_seconds_total", "Seconds spent by backup copies.", c.backup_seconds),
        (
            "hicache_backup_skipped_total",
            "Backups not made because the host tier had no room.",
            c.backups_skipped as f64,
        ),
        (
            "kv_transfer_requests_total",
            "Requests whose KV was transferred between prefill and decode engines.",
            t.requests as f64,
        ),
        ("kv_transfer_bytes_total", "KV bytes transferred between prefill and decode engines.", t.bytes as f64),
        (
            "kv_transfer_early_bytes_total",
            "KV bytes sent (prefill) or received (decode) while the prompt was still computing.",
            t.early_bytes as f64,
        ),
        (
            "kv_transfer_rma_bytes_total",
            "KV bytes written by RMA straight into the decode engine's pool memory (UCX).",
            t.rma_bytes as f64,
        ),
    ];
    for (name, help, value) in counters {
        o.single("counter", name, help, value);
    }
    o.single(
        "counter",
        "kv_transfer_seconds_total",
        "Seconds spent transferring KV.",
        t.seconds,
    );
    o.header(
        "kv_transfer_failures_total",
        "PD rooms that failed, by reason (timeout, peer_dead, aborted, layout, mismatch, \
         checksum, capacity).",
        "counter",
    );
    for (i, reason) in crate::pd::FailReason::ALL.iter().enumerate() {
        o.sample(
            "kv_transfer_failures_total",
            &[("reason", reason.label())],
            m.pd.failures[i] as f64,
        );
    }
    let g = &m.pd;
    for (name, help, value) in [
        (
            "num_prefill_bootstrap_queue_reqs",
            "Prefill engine: rooms waiting for a decode engine's claim.",
            g.prefill_bootstrap,
        ),
        (
            "num_prefill_inflight_queue_reqs",
            "Prefill engine: claimed rooms whose KV is being computed or sent.",
            g.prefill_inflight,
        ),
        (
            "num_decode_prealloc_queue_reqs",
            "Decode engine: rooms waiting for their destination pages.",
            g.decode_prealloc,
        ),
        (
            "num_decode_transfer_queue_reqs",
            "Decode engine: rooms reserved and claimed, their KV arriving.",
            g.decode_transfer,
        ),
        (
            "pd_pages_held",
            "Device KV pages held by requests whose PD room is in flight.",
            g.pages_held,
        ),
        (
            "pd_early_claims",
            "Prefill engine: claims that arrived before their request.",
            g.early_claims,
        ),
        ("pd_peers", "Connected PD peer engines.", g.peers),
        (
            "pd_authenticated",
            "1: PD peers must prove they hold pd.auth_key_file's secret; 0: anyone who reaches \
             pd.listen is a peer (loopback, or pd.insecure_no_auth).",
            g.authenticated,
        ),
    ] {
        o.single("gauge", name, help, value as f64);
    }

    o.header(
        "num_finished_requests_total",
        "Accepted requests that ended, by how they ended.",
        "counter",
    );
    for outcome in Outcome::ALL {
        let labels = [("finish_reason", outcome.label())];
        o.sample(
            "num_finished_requests_total",
            &labels,
            m.finished(outcome) as f64,
        );
    }
    o.header(
        "num_rejected_requests_total",
        "Submits refused at once, by reason.",
        "counter",
    );
    for r in Rejection::ALL {
        o.sample(
            "num_rejected_requests_total",
            &[("reason", r.label())],
            m.rejected(r) as f64,
        );
    }
    o.header(
        "cached_tokens_total",
        "Prompt tokens served from the prefix cache instead of computed, by tier.",
        "counter",
    );
    o.sample(
        "cached_tokens_total",
        &[("cache_source", "device")],
        m.cached_tokens_device as f64,
    );
    o.sample(
        "cached_tokens_total",
        &[("cache_source", "host")],
        m.cached_tokens_host as f64,
    );
    o.header(
        "kv_evictions_total",
        "Cached prefixes evicted, by tier and what happened to them.",
        "counter",
    );
    let evictions = [
        ("device", "kept_on_host", c.evicted_to_host),
        ("device", "dropped", c.evicted_dropped),
        ("host", "dropped", c.host_evictions),
    ];
    for (tier, outcome, n) in evictions {
        o.sample(
            "kv_evictions_total",
            &[("tier", tier), ("outcome", outcome)],
            n as f64,
        );
    }

    let histograms: [(&str, &str, &Histogram); 5] = [
        (
            "time_to_first_token_seconds",
            "Submit to first token.",
            &m.ttft,
        ),
        (
            "inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            &m.itl,
        ),
        (
            "e2e_request_latency_seconds",
            "Submit to terminal event, every accepted request.",
            &m.e2e,
        ),
        (
            "queue_time_seconds",
            "Submit to the start of running.",
            &m.queue_time,
        ),
        (
            "forward_step_seconds",
            "Duration of one forward step.",
            &m.step_time,
        ),
    ];
    for (name, help, h) in histograms {
        o.histogram(name, help, h);
    }
    // PD engines only, labelled with their side, so one dashboard shows both ends of a
    // transfer (the GB/s panel is rate(kv_transfer_bytes_total) / rate(kv_transfer_seconds_total)).
    if !m.pd.side.is_empty() {
        let side = [("side", m.pd.side)];
        let pd: [(&str, &str, &Histogram); 3] = [
            (
                "kv_transfer_latency_seconds",
                "PD rooms transferred: claim to done.",
                &m.transfer_latency,
            ),
            (
                "kv_transfer_room_bytes",
                "PD rooms transferred: state bytes per room.",
                &m.transfer_bytes,
            ),
            (
                "kv_transfer_claim_wait_seconds",
                "PD rooms claimed: registration to claim (prefill: waiting for the decode's \
                 claim; decode: waiting for destination pages).",
                &m.claim_wait,
            ),
        ];
        for (name, help, h) in pd {
            o.histogram_with(name, help, &side, h);
        }
    }
    render_health(o, health);
    out.text
}

/// The node-health and build series.
fn render_health(o: &mut Exposition, h: &NodeHealth) {
    o.single(
        "gauge",
        "engine_state",
        "The engine's state, as DSV4_STATE_*: 0 loading, 1 ready, 2 draining, 3 stopped, \
         4 failed (dsv4_engine_state gives the reason).",
        h.state.code() as f64,
    );
    o.single(
        "gauge",
        "seconds_since_last_step",
        "Seconds since the engine thread last finished a forward step (since creation before \
         the first): growing while requests run means the engine is stalled.",
        // Milliseconds are enough for a stall detector and keep the text's length steady.
        (h.since_last_step.as_secs_f64() * 1e3).round() / 1e3,
    );
    o.header(
        "build_info",
        "The library's version, backend and role (value 1).",
        "gauge",
    );
    o.sample(
        "build_info",
        &[
            ("version", h.version),
            ("backend", h.backend),
            ("role", h.role),
        ],
        1.0,
    );
    if let Some(bytes) = h.resident_bytes {
        o.single(
            "gauge",
            "process_resident_memory_bytes",
            "Resident memory of the process hosting the engine (VmRSS).",
            bytes as f64,
        );
    }
    let nodes: Vec<(String, &crate::plan::numa::NodeMemory)> =
        h.numa.iter().map(|n| (n.index.to_string(), n)).collect();
    type NodeField = fn(&crate::plan::numa::NodeMemory) -> u64;
    let numa: [(&str, &str, NodeField); 2] = [
        (
            "numa_node_memory_total_bytes",
            "Memory of each NUMA node.",
            |n| n.total_bytes,
        ),
        (
            "numa_node_memory_free_bytes",
            "Free memory of each NUMA node (the system's available memory on a one-node \
             machine), as the HiCache fit check reads it.",
            |n| n.free_bytes,
        ),
    ];
    for (name, help, get) in numa {
        o.header(name, help, "gauge");
        for (node, n) in &nodes {
            o.sample(name, &[("node", node)], get(n) as f64);
        }
    }
    if !h.host_tier.is_empty() {
        o.header(
            "host_tier_bytes",
            "Bytes of each host-tier (HiCache) pool and the NUMA node it is planned on.",
            "gauge",
        );
        for (node, pool, bytes) in &h.host_tier {
            o.sample(
                "host_tier_bytes",
                &[("node", &node.to_string()), ("pool", pool)],
                *bytes as f64,
            );
        }
    }
}

struct Exposition {
    text: String,
    base: Vec<(String, String)>,
}

impl Exposition {
    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.text, "# HELP dsv4_{name} {help}");
        let _ = writeln!(self.text, "# TYPE dsv4_{name} {kind}");
    }

    /// A family with one unlabelled sample.
    fn single(&mut self, kind: &str, name: &str, help: &str, value: f64) {
        self.header(name, help, kind);
        self.sample(name, &[], value);
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let _ = write!(self.text, "dsv4_{name}");
        let all: Vec<(&str, &str)> = self
            .base
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(labels.iter().copied())
            .collect();
        if !all.is_empty() {
            self.text.push('{');
            for (i, (k, v)) in all.iter().enumerate() {
                if i > 0 {
                    self.text.push(',');
                }
                let _ = write!(self.text, "{k}=\"{v}\"");
            }
            self.text.push('}');
        }
        let _ = writeln!(self.text, " {}", number(value));
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.histogram_with(name, help, &[], h);
    }

    /// A histogram family with `labels` on every sample (before `le`).
    fn histogram_with(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (i, c) in h.cumulative().into_iter().enumerate() {
            let le = h.bounds.get(i).map_or("+Inf".to_string(), |b| number(*b));
            let with_le: Vec<(&str, &str)> = labels
                .iter()
                .copied()
                .chain([("le", le.as_str())])
                .collect();
            self.sample(&bucket, &with_le, c as f64);
        }
        self.sample(&format!("{name}_sum"), labels, h.sum);
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

/// Label values: backslash, double quote and line feed are escaped (the text format's rules).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::params::RESERVED_LABELS;
    use crate::engine::shared::EngineState;
    use crate::plan::numa::NodeMemory;

    fn health() -> NodeHealth {
        NodeHealth {
            state: EngineState::Draining,
            since_last_step: std::time::Duration::from_millis(1500),
            version: "0.1.0",
            backend: "cpu",
            role: "decode",
            resident_bytes: Some(123 << 20),
            numa: vec![
                NodeMemory {
                    index: 0,
                    total_bytes: 64 << 30,
                    free_bytes: 10 << 30,
                },
                NodeMemory {
                    index: 1,
                    total_bytes: 64 << 30,
                    free_bytes: 20 << 30,
                },
            ],
            host_tier: vec![(1, "pages", 4 << 30), (1, "snapshots", 1 << 30)],
        }
    }

    #[test]
    fn node_health_series() {
        let text = render(&MetricsSnapshot::default(), &BTreeMap::new(), &health());
        for line in [
            "dsv4_engine_state 2",
            "dsv4_seconds_since_last_step 1.5",
            r#"dsv4_build_info{version="0.1.0",backend="cpu",role="decode"} 1"#,
            "dsv4_process_resident_memory_bytes 128974848",
            r#"dsv4_numa_node_memory_total_bytes{node="1"} 68719476736"#,
            r#"dsv4_numa_node_memory_free_bytes{node="0"} 10737418240"#,
            r#"dsv4_host_tier_bytes{node="1",pool="snapshots"} 1073741824"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        // Without HiCache or /proc there is no series rather than a zero.
        let mut bare = health();
        bare.host_tier.clear();
        bare.resident_bytes = None;
        let text = render(&MetricsSnapshot::default(), &BTreeMap::new(), &bare);
        assert!(!text.contains("dsv4_host_tier_bytes") && !text.contains("resident"));
    }

    /// The label names of every sample in `text`, read with the text format's rules (a value
    /// is quoted, with `\\`, `\"` and `\n` escapes), so a value holding `,` or `=` is no name.
    fn label_names(text: &str) -> std::collections::BTreeSet<String> {
        let mut names = std::collections::BTreeSet::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some(open) = line.find('{') else { continue };
            let mut rest = &line[open + 1..];
            while !rest.starts_with('}') {
                let (name, after) = rest.split_once("=\"").expect("name=\"value\"");
                names.insert(name.to_string());
                let mut chars = after.char_indices();
                let end = loop {
                    match chars.next().expect("a closing quote") {
                        (_, '\\') => {
                            chars.next();
                        }
                        (i, '"') => break i,
                        _ => {}
                    }
                };
                rest = after[end + 1..].trim_start_matches(',');
            }
        }
        names
    }

    /// A snapshot with every family that is emitted only sometimes switched on: host-tier units
    /// (HiCache), a PD side (the transfer histograms), NUMA nodes and host-tier pools, and
    /// observations in every histogram and counter.
    fn everything() -> MetricsSnapshot {
        let mut m = MetricsSnapshot::default();
        let units = Units {
            used: 3,
            total: 10,
            used_bytes: 300,
            total_bytes: 1000,
        };
        m.pools = crate::engine::PoolGauges {
            device_pages: units,
            device_slots: units,
            device_snapshots: units,
            host_pages: units,
            host_snapshots: units,
        };
        m.pd.side = "prefill";
        m.pd.failures = [1; 7];
        m.finished = [2; Outcome::ALL.len()];
        m.rejected = [1; Rejection::ALL.len()];
        for h in [
            &mut m.ttft,
            &mut m.itl,
            &mut m.e2e,
            &mut m.queue_time,
            &mut m.step_time,
            &mut m.transfer_latency,
            &mut m.claim_wait,
        ] {
            h.observe(0.3);
        }
        m.transfer_bytes.observe(1e6);
        m
    }

    #[test]
    fn every_label_of_the_exposition_is_reserved() {
        let configured = BTreeMap::from([("zone".to_string(), "a,b=\"c\\".to_string())]);
        let text = render(&everything(), &configured, &health());
        // Every family that depends on the snapshot is present.
        for family in [
            "dsv4_kv_used_units{zone=\"a,b=\\\"c\\\\\",pool=\"pages\",tier=\"host\"}",
            "dsv4_kv_transfer_latency_seconds_bucket{zone=",
            "dsv4_host_tier_bytes{",
            "dsv4_numa_node_memory_free_bytes{",
        ] {
            assert!(text.contains(family), "{family} missing from\n{text}");
        }
        let mut emitted = label_names(&text);
        assert!(
            emitted.remove("zone"),
            "the configured label is on the samples"
        );
        for name in &emitted {
            assert!(
                RESERVED_LABELS.contains(&name.as_str()),
                "the exposition emits label `{name}`, which RESERVED_LABELS does not list: \
                 metrics.labels could then repeat it"
            );
        }
        // The converse: every reserved name is emitted, except Prometheus's target labels.
        let unused: Vec<&str> = RESERVED_LABELS
            .iter()
            .copied()
            .filter(|n| !emitted.contains(*n))
            .collect();
        assert_eq!(unused, ["job", "instance"]);
    }

    #[test]
    fn every_sample_carries_the_configured_labels_escaped() {
        let mut m = MetricsSnapshot::default();
        m.ttft.observe(0.003);
        let labels = BTreeMap::from([("zone".to_string(), "a\"b\\c\nd".to_string())]);
        let text = render(&m, &labels, &health());
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(
                line.starts_with("dsv4_") && line.contains(r#"{zone="a\"b\\c\nd""#),
                "{line}"
            );
        }
        assert!(text.contains(
            r#"dsv4_time_to_first_token_seconds_bucket{zone="a\"b\\c\nd",le="0.005"} 1"#
        ));
        assert!(text.contains(
            r#"dsv4_time_to_first_token_seconds_bucket{zone="a\"b\\c\nd",le="0.0025"} 0"#
        ));
    }
}
