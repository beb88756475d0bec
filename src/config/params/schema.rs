//! Every engine parameter: its path in the JSON document, type, default, unit and a one-line
//! description. The defaults document, validation and docs/params.md all follow this table (a test
//! checks that docs/params.md documents every key with its default).

/// The JSON shape a key accepts.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    /// One of a fixed set of strings.
    Choice(&'static [&'static str]),
    /// Any string (or null when `nullable`).
    Text {
        nullable: bool,
    },
    /// An integer within `[min, max]` (or null).
    Int {
        min: u64,
        max: u64,
        nullable: bool,
    },
    /// A number within the bounds; `*_open` excludes the bound itself.
    Float {
        min: f64,
        min_open: bool,
        max: f64,
        max_open: bool,
        nullable: bool,
    },
    Bool,
    /// Bytes: an integer, or a string with a unit ("150GB", "140GiB").
    Size {
        nullable: bool,
    },
    /// A list of distinct GPU indices.
    Devices,
    /// A map of Prometheus label names to values.
    Labels,
    /// A list of hosts (`10.0.0.5`, `prefill-1`) or `host:port` entries.
    Hosts,
    /// `"auto"` or a node index.
    NumaNode,
    /// A PD endpoint `tcp://host:port` (or null when `nullable`); `connectable` refuses port 0
    /// and the wildcard hosts (an address peers are told to use, not one to bind).
    Endpoint {
        nullable: bool,
        connectable: bool,
    },
}

/// One parameter.
#[derive(Debug, Clone, Copy)]
pub struct KeySpec {
    /// Dotted path: `kv.page_size`.
    pub path: &'static str,
    pub kind: Kind,
    /// The default as a JSON literal.
    pub default: &'static str,
    /// Unit shown in docs and messages ("" for unit-less keys).
    pub unit: &'static str,
    /// What to do when the value is out of range; appended to range errors.
    pub hint: &'static str,
}

const fn key(path: &'static str, kind: Kind, default: &'static str) -> KeySpec {
    KeySpec {
        path,
        kind,
        default,
        unit: "",
        hint: "",
    }
}

const fn int(min: u64, max: u64) -> Kind {
    Kind::Int {
        min,
        max,
        nullable: false,
    }
}

const fn opt_int(min: u64, max: u64) -> Kind {
    Kind::Int {
        min,
        max,
        nullable: true,
    }
}

impl KeySpec {
    const fn unit(mut self, unit: &'static str) -> Self {
        self.unit = unit;
        self
    }

    const fn hint(mut self, hint: &'static str) -> Self {
        self.hint = hint;
        self
    }

    /// `kv` for `kv.page_size`; `""` for top-level keys.
    pub fn section(&self) -> &'static str {
        match self.path.rfind('.') {
            Some(i) => &self.path[..i],
            None => "",
        }
    }

    /// `page_size` for `kv.page_size`.
    pub fn leaf(&self) -> &'static str {
        match self.path.rfind('.') {
            Some(i) => &self.path[i + 1..],
            None => self.path,
        }
    }
}

/// Sections of the document, in order.
pub const SECTIONS: &[&str] = &[
    "parallel",
    "model",
    "kv",
    "hicache",
    "admission",
    "scheduler",
    "numerics",
    "metrics",
    "pd",
];

const U32: u64 = u32::MAX as u64;
const U53: u64 = (1 << 53) - 1;

/// Every key, in document order.
pub const KEYS: &[KeySpec] = &[
    key("model_path", Kind::Text { nullable: true }, "null"),
    key("backend", Kind::Choice(&["cpu", "cuda"]), "\"cpu\""),
    key("devices", Kind::Devices, "[0]"),
    key("threads", int(0, 4096), "0")
        .unit("threads")
        .hint("0 uses every core the process may run on"),
    key("role", Kind::Choice(&["unified", "prefill", "decode"]), "\"unified\""),
    key("parallel.tp", int(1, 1024), "1").unit("ranks"),
    key("parallel.ep", int(1, 1024), "1").unit("ranks"),
    key(
        "model.weight_dtype",
        Kind::Choice(&["auto", "f32", "bf16", "native"]),
        "\"auto\"",
    ),
    key("kv.dtype", Kind::Choice(&["auto", "f32", "bf16", "fp8"]), "\"auto\""),
    key(
        "kv.indexer_dtype",
        Kind::Choice(&["auto", "f32", "bf16", "fp8", "fp4"]),
        "\"auto\"",
    ),
    key("kv.page_size", int(128, 1 << 20), "256")
        .unit("tokens")
        .hint("use a multiple of 128 such as 128 or 256"),
    key("kv.device_memory_bytes", Kind::Size { nullable: true }, "null").unit("bytes"),
    key(
        "kv.device_memory_fraction",
        Kind::Float {
            min: 0.0,
            min_open: true,
            max: 1.0,
            max_open: false,
            nullable: true,
        },
        "null",
    )
    .hint("use a fraction such as 0.85"),
    key("kv.device_total_bytes", Kind::Size { nullable: true }, "null").unit("bytes"),
    key("kv.max_running_requests", int(1, 1 << 20), "32").unit("requests"),
    key("kv.max_context_tokens", opt_int(1, U53), "null").unit("tokens"),
    key("kv.snapshot_interval_tokens", opt_int(128, U53), "null").unit("tokens"),
    key(
        "kv.snapshot_fraction",
        Kind::Float {
            min: 0.0,
            min_open: false,
            max: 1.0,
            max_open: true,
            nullable: false,
        },
        "0.1",
    )
    .hint("use a fraction such as 0.1; 0 disables prefix snapshots"),
    key("kv.prefix_cache", Kind::Bool, "true"),
    key("kv.prefault", Kind::Bool, "false"),
    key("hicache.enabled", Kind::Bool, "false"),
    key(
        "hicache.ratio",
        Kind::Float {
            min: 0.0,
            min_open: true,
            max: 1e6,
            max_open: false,
            nullable: true,
        },
        "null",
    )
    .unit("× device")
    .hint("the host tier holds ratio × the device pages; use e.g. 2.0, or set hicache.enabled to false"),
    key("hicache.size_bytes", Kind::Size { nullable: true }, "null").unit("bytes"),
    key(
        "hicache.write_policy",
        Kind::Choice(&["write_through", "write_through_selective", "write_back"]),
        "\"write_through\"",
    ),
    key("hicache.numa_node", Kind::NumaNode, "\"auto\""),
    key("admission.max_queued_requests", int(1, U32), "256")
        .unit("requests")
        .hint("dsv4 never queues without a bound"),
    key("admission.max_queued_tokens", int(1, U53), "262144")
        .unit("tokens")
        .hint("dsv4 never queues without a bound"),
    key("admission.max_unpolled_events", int(1, U32), "65536")
        .unit("events")
        .hint("past it the engine pauses the requests whose events wait; poll more often or raise it"),
    key("admission.queue_timeout_ms", int(0, U32), "60000")
        .unit("ms")
        .hint("0 disables the timeout"),
    key("scheduler.chunked_prefill_tokens", int(1, U32), "2048").unit("tokens"),
    key("scheduler.max_batch_tokens", int(1, U32), "8192").unit("tokens"),
    key("scheduler.policy", Kind::Choice(&["fcfs", "lpm"]), "\"fcfs\""),
    key("scheduler.lpm_max_waiting", int(1, U32), "128")
        .unit("requests")
        .hint("above this many waiting requests lpm orders them first come first served"),
    key("numerics.mode", Kind::Choice(&["exact", "official"]), "\"exact\""),
    key("metrics.labels", Kind::Labels, "{}"),
    key(
        "pd.listen",
        Kind::Endpoint {
            nullable: false,
            connectable: false,
        },
        "\"tcp://127.0.0.1:0\"",
    ),
    key(
        "pd.advertise",
        Kind::Endpoint {
            nullable: true,
            connectable: true,
        },
        "null",
    ),
    key("pd.transport", Kind::Choice(&["tcp", "ucx"]), "\"tcp\""),
    key("pd.ucx_library", Kind::Text { nullable: true }, "null"),
    key("pd.ucx_rma", Kind::Bool, "true"),
    key("pd.ucx_rma_emulated", Kind::Bool, "false"),
    key("pd.bootstrap_timeout_ms", int(1, U32), "30000").unit("ms"),
    key("pd.transfer_timeout_ms", int(1, U32), "30000").unit("ms"),
    key("pd.heartbeat_interval_ms", int(1, U32), "1000").unit("ms"),
    key("pd.heartbeat_misses", int(1, 1000), "3").unit("heartbeats"),
    key("pd.max_rooms", int(1, 1 << 20), "256").unit("rooms"),
    key("pd.max_links", int(1, 65536), "256").unit("links"),
    key("pd.max_handshakes", int(1, 4096), "32").unit("connections"),
    key("pd.handshake_timeout_ms", int(1, 600_000), "5000").unit("ms"),
    key("pd.max_outbox_bytes", int(1 << 20, 1 << 40), "67108864").unit("bytes"),
    key("pd.auth_key_file", Kind::Text { nullable: true }, "null"),
    key("pd.insecure_no_auth", Kind::Bool, "false"),
    key("pd.tls", Kind::Bool, "false"),
    key("pd.tls_cert_file", Kind::Text { nullable: true }, "null"),
    key("pd.tls_key_file", Kind::Text { nullable: true }, "null"),
    key("pd.tls_ca_file", Kind::Text { nullable: true }, "null"),
    key("pd.allowed_peers", Kind::Hosts, "[]"),
];

/// Names other engines use for our keys, so their users get pointed at the right one.
pub const ALIASES: &[(&str, &str)] = &[
    ("hicache_ratio", "hicache.ratio"),
    ("hicache_size", "hicache.size_bytes"),
    ("hicache_write_policy", "hicache.write_policy"),
    ("enable_hierarchical_cache", "hicache.enabled"),
    ("mem_fraction_static", "kv.device_memory_fraction"),
    ("gpu_memory_utilization", "kv.device_memory_fraction"),
    ("kv_cache_dtype", "kv.dtype"),
    ("max_running_requests", "kv.max_running_requests"),
    ("max_num_seqs", "kv.max_running_requests"),
    ("context_length", "kv.max_context_tokens"),
    ("max_model_len", "kv.max_context_tokens"),
    ("max_queued_requests", "admission.max_queued_requests"),
    ("chunked_prefill_size", "scheduler.chunked_prefill_tokens"),
    ("max_num_batched_tokens", "scheduler.max_batch_tokens"),
    ("max_prefill_tokens", "scheduler.max_batch_tokens"),
    ("schedule_policy", "scheduler.policy"),
    ("disable_radix_cache", "kv.prefix_cache"),
    ("enable_prefix_caching", "kv.prefix_cache"),
    ("tp_size", "parallel.tp"),
    ("tensor_parallel_size", "parallel.tp"),
    ("ep_size", "parallel.ep"),
    ("disaggregation_mode", "role"),
    ("model", "model_path"),
    ("numa_node", "hicache.numa_node"),
];

pub fn find(path: &str) -> Option<&'static KeySpec> {
    KEYS.iter().find(|k| k.path == path)
}

pub fn is_section(path: &str) -> bool {
    SECTIONS.contains(&path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cells of a Markdown table row (`\|` is a pipe inside a cell).
    fn table_cells(row: &str) -> Vec<String> {
        let mut cells = vec![String::new()];
        let mut chars = row.trim().trim_start_matches('|').chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '\\' if chars.peek() == Some(&'|') => {
                    cells.last_mut().unwrap().push('|');
                    chars.next();
                }
                '|' => cells.push(String::new()),
                c => cells.last_mut().unwrap().push(c),
            }
        }
        cells.iter().map(|c| c.trim().to_string()).collect()
    }

    /// docs/params.md documents every key with its default, and nothing else.
    #[test]
    fn docs_params_md_documents_every_key_and_default() {
        let doc = include_str!("../../../docs/params.md");
        let rows: Vec<&str> = doc.lines().filter(|l| l.starts_with("| `")).collect();
        for spec in KEYS {
            let prefix = format!("| `{}` |", spec.path);
            let row = rows
                .iter()
                .find(|r| r.starts_with(&prefix))
                .unwrap_or_else(|| panic!("docs/params.md does not document `{}`", spec.path));
            let cells = table_cells(row);
            assert_eq!(
                cells.get(3).map(String::as_str),
                Some(format!("`{}`", spec.default).as_str()),
                "default of `{}` in docs/params.md",
                spec.path
            );
            if !spec.unit.is_empty() {
                assert_eq!(
                    cells.get(2).map(String::as_str),
                    Some(spec.unit),
                    "unit of `{}`",
                    spec.path
                );
            }
        }
        for row in rows {
            let key = row
                .trim_start_matches("| `")
                .split('`')
                .next()
                .unwrap_or("");
            assert!(
                find(key).is_some(),
                "docs/params.md documents unknown key `{key}`"
            );
        }
    }
}
