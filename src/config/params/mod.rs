//! Engine parameters: one JSON document, merged over the defaults, validated in full.
//!
//! [`Params::from_json`] is the only way in: it rejects invalid UTF-8 and JSON, unknown keys
//! (with a "did you mean"), wrong types, bad units and out-of-range values, and cross-key
//! conflicts, all in one [`ErrorKind::Config`] error.

pub mod schema;
mod validate;

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::config::json::{parse_strict, JsonError};
use crate::config::problems_error;
use crate::config::size::{describe, parse_size, shorten};
use crate::error::{Error, ErrorKind, Result};
use schema::KEYS;
use validate::Problems;

pub use validate::{
    closest, MAX_DEVICES, MAX_DOCUMENT_BYTES, MAX_LABELS, MAX_LABEL_VALUE_BYTES, MAX_PATH_BYTES,
    MAX_SUGGEST_CHARS, RESERVED_LABELS,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Cuda,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Unified,
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    /// `native` for a checkpoint with FP8 / FP4 matrices (the official release), else `f32`.
    Auto,
    F32,
    Bf16,
    /// As stored: FP8 / FP4 kept and decoded inside the kernels, bf16 kept, f32 / f16 as f32.
    Native,
}

impl WeightDtype {
    /// What `auto` means for `model`: `native` when it stores FP8 or FP4 matrices, else `f32`;
    /// any other choice is itself.
    pub fn resolve(self, model: &crate::config::ModelConfig) -> WeightDtype {
        use crate::config::model::{DenseFormat, ExpertFormat};
        match self {
            WeightDtype::Auto => {
                let low = matches!(model.dense_format, DenseFormat::Fp8Block { .. })
                    || matches!(model.expert_format, ExpertFormat::Fp4 { .. });
                if low {
                    WeightDtype::Native
                } else {
                    WeightDtype::F32
                }
            }
            other => other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::Auto => "auto",
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::Native => "native",
        }
    }
}

/// `kv.dtype`: the format of compressed and window KV rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// f32 on the CPU backend, fp8 on CUDA.
    Auto,
    F32,
    Bf16,
    Fp8,
}

/// `kv.indexer_dtype`: the format of CSA indexer key rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexerDtype {
    /// f32 on the CPU backend, fp8 on CUDA.
    Auto,
    F32,
    Bf16,
    Fp8,
    Fp4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WritePolicy {
    WriteThrough,
    WriteThroughSelective,
    WriteBack,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulerPolicy {
    Fcfs,
    Lpm,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NumericsMode {
    Exact,
    Official,
}

/// A size in bytes; reads integers and unit strings, writes integers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let value = Value::deserialize(deserializer)?;
        parse_size(&value)
            .map(Bytes)
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for Bytes {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.0)
    }
}

/// `hicache.numa_node`: the GPU's node, or a fixed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaNode {
    Auto,
    Index(u32),
}

impl<'de> Deserialize<'de> for NumaNode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(s) if s == "auto" => Ok(Self::Auto),
            v => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Self::Index)
                .ok_or_else(|| serde::de::Error::custom(format!("bad numa node {v}"))),
        }
    }
}

impl Serialize for NumaNode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => serializer.serialize_str("auto"),
            Self::Index(n) => serializer.serialize_u32(*n),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Parallel {
    pub tp: u32,
    pub ep: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelParams {
    pub weight_dtype: WeightDtype,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvParams {
    pub dtype: KvDtype,
    pub indexer_dtype: IndexerDtype,
    pub page_size: u32,
    pub device_memory_bytes: Option<Bytes>,
    pub device_memory_fraction: Option<f64>,
    pub device_total_bytes: Option<Bytes>,
    pub max_running_requests: u32,
    pub max_context_tokens: Option<u64>,
    pub snapshot_interval_tokens: Option<u64>,
    pub snapshot_fraction: f64,
    pub prefix_cache: bool,
    /// Touch every page of the KV pools at start (see [`crate::kv::KvPools::prefault`]).
    pub prefault: bool,
}

impl KvParams {
    /// `snapshot_interval_tokens`, defaulting to 16 pages.
    pub fn snapshot_interval(&self) -> u64 {
        self.snapshot_interval_tokens
            .unwrap_or(16 * u64::from(self.page_size))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HiCacheParams {
    pub enabled: bool,
    pub ratio: Option<f64>,
    pub size_bytes: Option<Bytes>,
    /// How `size_bytes` was written. Not a setting: the resolved document writes bytes only.
    #[serde(skip)]
    pub size_bytes_spelling: Spelling,
    pub write_policy: WritePolicy,
    pub numa_node: NumaNode,
}

/// How the operator wrote a size, kept so a refusal can quote the likely intent: SGLang's
/// `--hicache-size 150` is in GB, so a bare `150` under `hicache.size_bytes` (150 bytes) is
/// almost certainly a unit mix-up. Two params that differ only in spelling are the same
/// settings, so every `Spelling` compares equal (a resolved document, which writes every size
/// as a bare number, parses back to equal params).
#[derive(Debug, Clone, Copy, Default)]
pub struct Spelling {
    /// Written as a bare JSON number (`150`, `150e9`), not as a string.
    pub bare_number: bool,
}

impl PartialEq for Spelling {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdmissionParams {
    pub max_queued_requests: u32,
    pub max_queued_tokens: u64,
    pub max_unpolled_events: u32,
    pub queue_timeout_ms: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerParams {
    pub chunked_prefill_tokens: u32,
    pub max_batch_tokens: u32,
    pub policy: SchedulerPolicy,
    pub lpm_max_waiting: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NumericsParams {
    pub mode: NumericsMode,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricsParams {
    /// Added to every exported series, in the caller's order.
    pub labels: BTreeMap<String, String>,
}

/// Prefill/decode disaggregation (read in the `prefill` and `decode` roles).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PdParams {
    /// `tcp://host:port` (or `ucx://`, with the ucx transport) to bind (port 0 picks one).
    pub listen: String,
    /// `tcp://host:port` peers connect to; `None`: the bound listen address.
    pub advertise: Option<String>,
    pub transport: PdTransport,
    /// The libucp to load for the ucx transport; `None`: `libucp.so.0` from the loader's path.
    pub ucx_library: Option<String>,
    /// With the ucx transport: a decode with host-memory pools registers them and prefills
    /// write states into them by RMA; false: state bytes go as active messages.
    pub ucx_rma: bool,
    /// With `ucx_rma`: RMA also over UCX transports that emulate puts with messages (tcp).
    pub ucx_rma_emulated: bool,
    pub bootstrap_timeout_ms: u32,
    /// One deadline from claim to done: waiting for data and transferring.
    pub transfer_timeout_ms: u32,
    pub heartbeat_interval_ms: u32,
    /// A peer silent for this many intervals is dead.
    pub heartbeat_misses: u32,
    /// Rooms in flight per engine.
    pub max_rooms: u32,
    /// Connections to peers at once (each holds two threads and a socket).
    pub max_links: u32,
    /// Connections still in their handshake at once (each holds a thread).
    pub max_handshakes: u32,
    /// A connection that has not finished its handshake by then is closed.
    pub handshake_timeout_ms: u32,
    /// Control frames queued for one peer: a peer that reads nothing while more pile up is
    /// dropped.
    pub max_outbox_bytes: u64,
    /// A file of one or two secrets (a line each): peers authenticate with them.
    pub auth_key_file: Option<String>,
    /// Lets an engine listening beyond loopback run without `auth_key_file`.
    pub insecure_no_auth: bool,
    /// Encrypts TCP links with TLS 1.3: a prefill presents `tls_cert_file` (with
    /// `tls_key_file`), a decode checks it against `tls_ca_file`.
    pub tls: bool,
    /// Prefill: its certificate chain (PEM).
    pub tls_cert_file: Option<String>,
    /// Prefill: the certificate's private key (PEM).
    pub tls_key_file: Option<String>,
    /// Decode: the CA certificates a prefill's certificate must chain to (PEM).
    pub tls_ca_file: Option<String>,
    /// Decode: the prefills `pd_peer` may name (hosts or host:port); empty: any.
    pub allowed_peers: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PdTransport {
    Tcp,
    /// UCX (libucp, loaded at run time): whatever transports UCX picks (`UCX_TLS`).
    Ucx,
}

impl PdTransport {
    /// The endpoint scheme: `tcp` or `ucx`.
    pub fn scheme(self) -> &'static str {
        match self {
            PdTransport::Tcp => "tcp",
            PdTransport::Ucx => "ucx",
        }
    }
}

/// A PD endpoint, `tcp://host:port` or `ucx://host:port`: the transport, the host (a name,
/// an IPv4 address or a bracketed IPv6 address) and the port. Checked when params are
/// validated; resolved when an engine binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub transport: PdTransport,
    pub host: String,
    pub port: u16,
}

impl Endpoint {
    /// Parses `tcp://host:port` or `ucx://host:port`, or says what is wrong and what a valid
    /// one looks like.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let example = "use tcp://HOST:PORT (or ucx://HOST:PORT with pd.transport = \"ucx\"), \
                       e.g. tcp://10.0.0.5:7000 or tcp://[::1]:7000";
        let (transport, rest) = if let Some(rest) = text.strip_prefix("tcp://") {
            (PdTransport::Tcp, rest)
        } else if let Some(rest) = text.strip_prefix("ucx://") {
            (PdTransport::Ucx, rest)
        } else {
            return Err(format!(
                "{} does not start with tcp:// or ucx://: {example}",
                shorten(text)
            ));
        };
        let Some((host, port)) = rest.rsplit_once(':') else {
            return Err(format!("{} has no port: {example}", shorten(text)));
        };
        let port: u16 = port.parse().map_err(|_| {
            format!(
                "{} has port {port:?}, not 0–65535: {example}",
                shorten(text)
            )
        })?;
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let name_ok = !bare.is_empty()
            && bare
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'));
        let ip_ok = bare.parse::<std::net::IpAddr>().is_ok();
        if !(name_ok || ip_ok) || (bare.contains(':') && !host.starts_with('[')) {
            return Err(format!(
                "{} has host {host:?}, which is not a name or an IP address (IPv6 in brackets): \
                 {example}",
                shorten(text)
            ));
        }
        Ok(Self {
            transport,
            host: bare.to_string(),
            port,
        })
    }

    /// `scheme://host:port`, IPv6 hosts in brackets.
    pub fn text(&self) -> String {
        let scheme = self.transport.scheme();
        if self.host.contains(':') {
            format!("{scheme}://[{}]:{}", self.host, self.port)
        } else {
            format!("{scheme}://{}:{}", self.host, self.port)
        }
    }
}

/// Validated engine parameters. docs/params.md describes every field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Params {
    pub model_path: Option<String>,
    pub backend: Backend,
    pub devices: Vec<u32>,
    pub threads: u32,
    pub role: Role,
    pub parallel: Parallel,
    pub model: ModelParams,
    pub kv: KvParams,
    pub hicache: HiCacheParams,
    pub admission: AdmissionParams,
    pub scheduler: SchedulerParams,
    pub numerics: NumericsParams,
    pub metrics: MetricsParams,
    pub pd: PdParams,
}

impl Default for Params {
    fn default() -> Self {
        serde_json::from_value(Value::Object(defaults_document()))
            .expect("the schema's defaults form a valid document")
    }
}

impl Params {
    /// Parses a params document (a partial one is merged over the defaults).
    pub fn from_json(text: &str) -> Result<Self> {
        check_document_size(text.len())?;
        let value = parse_strict(text).map_err(|e| match e {
            JsonError::Syntax {
                line,
                column,
                message,
            } => Error::config(format!(
                "params are not valid JSON (line {line}, column {column}): {message}"
            )),
            JsonError::DuplicateKey { .. } => Error::config(format!("params: {e}")),
        })?;
        Self::from_value(&value)
    }

    /// Like [`Self::from_json`], for raw bytes from a C caller: invalid UTF-8 is a config error.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self> {
        check_document_size(bytes.len())?;
        let text = std::str::from_utf8(bytes).map_err(|e| {
            Error::config(format!(
                "params are not valid UTF-8: invalid byte at offset {}; pass UTF-8 JSON text",
                e.valid_up_to()
            ))
        })?;
        Self::from_json(text)
    }

    pub fn from_value(value: &Value) -> Result<Self> {
        let Value::Object(doc) = value else {
            return Err(Error::config(format!(
                "params must be a JSON object such as {{\"model_path\": \"…\"}}, got {}",
                describe(value)
            )));
        };
        let mut problems = Problems::default();
        validate::check_document(doc, &mut problems);
        let mut merged = defaults_document();
        merge(&mut merged, doc);
        default_listen_for_the_transport(doc, &mut merged);
        // Cross-key checks read the merged document and skip values that already failed, so
        // one pass reports both kinds of problems.
        check_cross_keys(&merged, &mut problems);
        if !problems.0.is_empty() {
            return Err(problems_error(ErrorKind::Config, "params", &problems.0));
        }
        let bare_size = merged
            .get("hicache")
            .and_then(|h| h.get("size_bytes"))
            .is_some_and(Value::is_number);
        let mut params: Self = serde_json::from_value(Value::Object(merged))
            .map_err(|e| Error::internal(format!("validated params failed to deserialize: {e}")))?;
        params.hicache.size_bytes_spelling = Spelling {
            bare_number: bare_size,
        };
        Ok(params)
    }

    /// The full document with every default filled in and sizes in bytes.
    pub fn to_json_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// `kv.dtype` with `auto` resolved for the backend.
    pub fn kv_dtype(&self) -> KvDtype {
        match (self.kv.dtype, self.backend) {
            (KvDtype::Auto, Backend::Cpu) => KvDtype::F32,
            (KvDtype::Auto, Backend::Cuda) => KvDtype::Fp8,
            (other, _) => other,
        }
    }

    /// `kv.indexer_dtype` with `auto` resolved for the backend.
    pub fn indexer_dtype(&self) -> IndexerDtype {
        match (self.kv.indexer_dtype, self.backend) {
            (IndexerDtype::Auto, Backend::Cpu) => IndexerDtype::F32,
            (IndexerDtype::Auto, Backend::Cuda) => IndexerDtype::Fp8,
            (other, _) => other,
        }
    }
}

/// Refuses a document over [`MAX_DOCUMENT_BYTES`] before parsing it: a real one is a few KiB,
/// and the cap bounds the time and memory of everything after it.
fn check_document_size(len: usize) -> Result<()> {
    if len > MAX_DOCUMENT_BYTES {
        return Err(Error::config(format!(
            "params are {len} bytes; the limit is {MAX_DOCUMENT_BYTES} bytes (1 MiB): a params \
             document holds a few dozen keys — check that the right file or buffer was passed"
        )));
    }
    Ok(())
}

/// `pd.listen` left at its default follows `pd.transport`: `ucx://127.0.0.1:0` with ucx.
fn default_listen_for_the_transport(doc: &Map<String, Value>, merged: &mut Map<String, Value>) {
    let pd = doc.get("pd").and_then(Value::as_object);
    let transport = pd.and_then(|p| p.get("transport")).and_then(Value::as_str);
    let listen_set = pd.is_some_and(|p| p.get("listen").is_some());
    if transport == Some("ucx") && !listen_set {
        if let Some(Value::Object(pd)) = merged.get_mut("pd") {
            pd.insert("listen".into(), Value::from("ucx://127.0.0.1:0"));
        }
    }
}

/// Checks between keys, on the merged document. A value that failed its own check is skipped.
fn check_cross_keys(doc: &Map<String, Value>, problems: &mut Problems) {
    let get = |path: &str| -> Option<&Value> {
        let mut value = doc.get(path.split('.').next()?)?;
        for part in path.split('.').skip(1) {
            value = value.get(part)?;
        }
        (!value.is_null()).then_some(value)
    };
    let valid = |path: &str| -> Option<&Value> {
        let value = get(path)?;
        let spec = schema::find(path)?;
        validate::check_value(spec, value).ok().map(|_| value)
    };
    let uint = |path: &str| valid(path).and_then(Value::as_u64);
    let size = |path: &str| valid(path).and_then(|v| parse_size(v).ok());

    if let Some(page) = uint("kv.page_size") {
        if page % 128 != 0 {
            let (lower, upper) = (page / 128 * 128, page.div_ceil(128) * 128);
            let choices = if lower == 0 {
                upper.to_string()
            } else {
                format!("{lower} or {upper}")
            };
            problems.push(format!(
                "`kv.page_size` = {page} is not a multiple of 128: use {choices} (an HCA row \
                 covers 128 tokens and must not straddle pages)"
            ));
        }
        if let Some(interval) = uint("kv.snapshot_interval_tokens") {
            if interval % page != 0 {
                problems.push(format!(
                    "`kv.snapshot_interval_tokens` = {interval} is not a multiple of \
                     `kv.page_size` = {page}: use {} (snapshots are taken at page boundaries)",
                    (interval / page).max(1) * page
                ));
            }
        }
    }
    if get("kv.device_memory_bytes").is_some() && get("kv.device_memory_fraction").is_some() {
        problems.push(
            "both `kv.device_memory_bytes` and `kv.device_memory_fraction` are set: keep one",
        );
    }
    if let (Some(total), Some(budget)) = (
        size("kv.device_total_bytes"),
        size("kv.device_memory_bytes"),
    ) {
        if budget > total {
            problems.push(format!(
                "`kv.device_memory_bytes` = {budget} exceeds `kv.device_total_bytes` = {total}: \
                 lower it"
            ));
        }
    }
    let on = |path: &str| valid(path).and_then(Value::as_bool);
    if on("hicache.enabled") == Some(true) && on("kv.prefix_cache") == Some(false) {
        problems.push(
            "`hicache.enabled` is true but `kv.prefix_cache` is false: the host tier holds cached \
             prefixes, so enable the prefix cache or disable HiCache",
        );
    }
    if get("hicache.ratio").is_some() && get("hicache.size_bytes").is_some() {
        problems.push(
            "both `hicache.ratio` and `hicache.size_bytes` are set: keep one (DeepSeek V4 \
             accepts either; the plan shows what the other amounts to)",
        );
    }
    if let (Some(chunk), Some(batch)) = (
        uint("scheduler.chunked_prefill_tokens"),
        uint("scheduler.max_batch_tokens"),
    ) {
        if chunk > batch {
            problems.push(format!(
                "`scheduler.chunked_prefill_tokens` = {chunk} exceeds \
                 `scheduler.max_batch_tokens` = {batch}: a prefill chunk must fit in one batch; \
                 lower the first or raise the second"
            ));
        }
    }
    // The endpoints' scheme is the transport's.
    if let Some(transport) = valid("pd.transport").and_then(Value::as_str) {
        for key in ["pd.listen", "pd.advertise"] {
            let Some(text) = valid(key).and_then(Value::as_str) else {
                continue;
            };
            let scheme = text.split("://").next().unwrap_or("");
            if scheme != transport {
                problems.push(format!(
                    "`{key}` = {} does not match `pd.transport` = \"{transport}\": use \
                     {transport}://HOST:PORT, or set `pd.transport` to \"{scheme}\"",
                    shorten(text)
                ));
            }
        }
    }
    if let (Some(interval), Some(misses), Some(transfer)) = (
        uint("pd.heartbeat_interval_ms"),
        uint("pd.heartbeat_misses"),
        uint("pd.transfer_timeout_ms"),
    ) {
        if interval * misses >= transfer {
            problems.push(format!(
                "`pd.heartbeat_interval_ms` × `pd.heartbeat_misses` = {} ms is not below \
                 `pd.transfer_timeout_ms` = {transfer} ms: a dead peer would only be noticed after \
                 every transfer on it timed out; lower the interval or the misses, or raise the \
                 timeout",
                interval * misses
            ));
        }
    }
    let no_devices = valid("devices")
        .and_then(Value::as_array)
        .is_some_and(|d| d.is_empty());
    if valid("backend").and_then(Value::as_str) == Some("cuda") && no_devices {
        problems.push("`devices` is empty but `backend` is cuda: list the GPUs, e.g. [0]");
    }
}

/// The defaults, as a JSON object in document order.
pub fn defaults_document() -> Map<String, Value> {
    let mut doc = Map::new();
    for spec in KEYS {
        let value: Value =
            serde_json::from_str(spec.default).expect("schema defaults are JSON literals");
        let target = match spec.section() {
            "" => &mut doc,
            section => doc
                .entry(section.to_string())
                .or_insert_with(|| Value::Object(Map::new()))
                .as_object_mut()
                .expect("sections are objects"),
        };
        target.insert(spec.leaf().to_string(), value);
    }
    doc
}

/// Objects merge key by key; everything else (including arrays) replaces.
fn merge(base: &mut Map<String, Value>, over: &Map<String, Value>) {
    for (key, value) in over {
        match (base.get_mut(key), value) {
            (Some(Value::Object(b)), Value::Object(o)) if key != "labels" => merge(b, o),
            _ => {
                base.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(doc: Value) -> Error {
        Params::from_value(&doc).expect_err("should be rejected")
    }

    #[test]
    fn empty_document_gives_the_defaults() {
        let p = Params::from_json("{}").unwrap();
        assert_eq!(p, Params::default());
        assert_eq!(p.backend, Backend::Cpu);
        assert_eq!(p.kv.page_size, 256);
        assert_eq!(p.kv.snapshot_interval(), 4096);
        assert_eq!(p.kv_dtype(), KvDtype::F32);
        assert!(!p.hicache.enabled);
        assert_eq!(p.hicache.numa_node, NumaNode::Auto);
    }

    #[test]
    fn partial_documents_merge_over_defaults() {
        let p = Params::from_value(&json!({
            "backend": "cuda",
            "kv": {"page_size": 128, "device_memory_bytes": "60GiB"},
            "hicache": {"enabled": true, "size_bytes": "150GB", "numa_node": 1},
            "metrics": {"labels": {"cluster": "eu-1"}}
        }))
        .unwrap();
        assert_eq!(p.kv.page_size, 128);
        assert_eq!(p.kv.max_running_requests, 32);
        assert_eq!(p.kv.device_memory_bytes, Some(Bytes(60 << 30)));
        assert_eq!(p.hicache.size_bytes, Some(Bytes(150_000_000_000)));
        assert_eq!(p.hicache.numa_node, NumaNode::Index(1));
        assert_eq!(p.kv_dtype(), KvDtype::Fp8);
        assert_eq!(p.metrics.labels["cluster"], "eu-1");
        // The resolved document round-trips with sizes in bytes.
        let resolved = p.to_json_value();
        assert_eq!(resolved["hicache"]["size_bytes"], json!(150_000_000_000u64));
        assert_eq!(Params::from_value(&resolved).unwrap(), p);
    }

    #[test]
    fn invalid_json_and_utf8_are_config_errors() {
        let e = Params::from_json("{\"kv\": ").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.message().contains("not valid JSON (line 1"), "{e}");
        let e = Params::from_json_bytes(b"{\"model_path\": \"\xff\"}").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message()
                .contains("not valid UTF-8: invalid byte at offset 16"),
            "{e}"
        );
        let e = Params::from_json("[1, 2]").unwrap_err();
        assert!(e.message().contains("must be a JSON object"), "{e}");
    }

    #[test]
    fn every_problem_is_reported_in_one_error() {
        let e = err(json!({
            "backend": "gpu",
            "threads": -2,
            "kv": {"page_size": "256", "max_running_requests": 0,
                   "device_memory_bytes": "2 GBs"},
            "hicache": {"write_polcy": "write_back", "ratio": 0,
                        "size_bytes": -5, "enabled": "yes"},
            "admission": {"max_queued_requests": 1.5},
            "metrics": {"labels": {"bad-name": "x"}},
            "page_size": 256
        }));
        assert_eq!(e.kind(), ErrorKind::Config);
        let m = e.message();
        for needle in [
            "13 problems in params",
            "both `hicache.ratio` and `hicache.size_bytes` are set",
            "`backend` = \"gpu\" is not one of cpu, cuda",
            "`threads` = -2 is negative",
            "`kv.page_size` must be an integer, got string \"256\": write 256 without quotes",
            "`kv.max_running_requests` = 0 is below the minimum 1 requests",
            "`kv.device_memory_bytes`: unknown unit `GBs`",
            "unknown key `hicache.write_polcy` — did you mean `hicache.write_policy`?",
            "`hicache.ratio` = 0 is out of range: it must be > 0",
            "`hicache.size_bytes`: -5 is negative",
            "`hicache.enabled` must be true or false, got string \"yes\"",
            "`admission.max_queued_requests` must be an integer, got number 1.5",
            "label name \"bad-name\"",
            "unknown key `page_size` — did you mean `kv.page_size`?",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
    }

    #[test]
    fn cross_key_conflicts_name_both_keys() {
        let m = err(json!({
            "kv": {"page_size": 200, "device_memory_bytes": "1GiB",
                   "device_memory_fraction": 0.5, "snapshot_interval_tokens": 1100},
            "hicache": {"ratio": 2.0, "size_bytes": "150GB"},
            "scheduler": {"chunked_prefill_tokens": 9000, "max_batch_tokens": 8192}
        }))
        .to_string();
        for needle in [
            "`kv.page_size` = 200 is not a multiple of 128: use 128 or 256",
            "`kv.snapshot_interval_tokens` = 1100 is not a multiple of `kv.page_size` = 200: use 1000",
            "both `kv.device_memory_bytes` and `kv.device_memory_fraction` are set",
            "both `hicache.ratio` and `hicache.size_bytes` are set",
            "`scheduler.chunked_prefill_tokens` = 9000 exceeds `scheduler.max_batch_tokens`",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
    }

    #[test]
    fn sections_must_be_objects_and_devices_distinct() {
        let m = err(json!({"kv": 5, "model": "/models/x", "devices": [0, 0]})).to_string();
        assert!(
            m.contains("`kv` must be an object with keys dtype, indexer_dtype"),
            "{m}"
        );
        assert!(m.contains("did you mean `model_path`?"), "{m}");
        assert!(m.contains("`devices` lists GPU 0 twice"), "{m}");
    }

    /// Found by tests/config_property.rs: an index past u32 passed validation and then failed
    /// to deserialize, an INTERNAL error instead of CONFIG.
    #[test]
    fn device_indices_beyond_u32_are_a_config_error() {
        let e = err(json!({"devices": [4294967296u64]}));
        assert_eq!(e.kind(), crate::error::ErrorKind::Config, "{e}");
        assert!(
            e.to_string()
                .contains("`devices[0]` = 4294967296 is not a GPU index"),
            "{e}"
        );
    }

    #[test]
    fn choices_suggest_the_closest_value() {
        let m = err(json!({"hicache": {"write_policy": "write_trough"}})).to_string();
        assert!(m.contains("did you mean \"write_through\"?"), "{m}");
    }

    #[test]
    fn pd_endpoints_are_tcp_host_port() {
        for good in [
            "tcp://127.0.0.1:0",
            "tcp://prefill-3.example:7000",
            "tcp://0.0.0.0:65535",
        ] {
            Endpoint::parse(good).unwrap();
        }
        assert_eq!(
            Endpoint::parse("tcp://[::1]:7000").unwrap(),
            Endpoint {
                transport: PdTransport::Tcp,
                host: "::1".into(),
                port: 7000
            }
        );
        for (bad, says) in [
            ("10.0.0.5:7000", "does not start with tcp:// or ucx://"),
            ("tcp://prefill", "has no port"),
            ("tcp://prefill:70000", "not 0–65535"),
            ("tcp://::1:7000", "IPv6 in brackets"),
            ("tcp://a b:1", "not a name or an IP address"),
            ("tcp://:7000", "not a name or an IP address"),
        ] {
            let e = Endpoint::parse(bad).unwrap_err();
            assert!(
                e.contains(says) && e.contains("tcp://HOST:PORT"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn pd_keys_are_checked_in_every_role_with_the_fix_named() {
        let m = err(json!({"pd": {"listen": "10.0.0.5:7000", "advertise": "tcp://0.0.0.0:7000"}}))
            .to_string();
        assert!(
            m.contains("`pd.listen` = 10.0.0.5:7000 does not start with tcp:// or ucx://"),
            "{m}"
        );
        assert!(
            m.contains(
                "`pd.advertise` = tcp://0.0.0.0:7000 is not an address a peer can connect to"
            ),
            "{m}"
        );
        let m = err(json!({"pd": {"heartbeat_interval_ms": 10000}})).to_string();
        assert!(
            m.contains("= 30000 ms is not below `pd.transfer_timeout_ms` = 30000 ms"),
            "{m}"
        );
        let m = err(json!({"pd": {"transport": "rdma"}})).to_string();
        assert!(m.contains("pd.transport"), "{m}");
        // With ucx, the default listen address takes its scheme; a set one must match.
        let p = Params::from_value(&json!({"pd": {"transport": "ucx"}})).unwrap();
        assert_eq!(p.pd.listen, "ucx://127.0.0.1:0");
        let m = err(json!({"pd": {"transport": "ucx", "advertise": "tcp://10.0.0.5:7000"}}))
            .to_string();
        assert!(
            m.contains(
                "`pd.advertise` = tcp://10.0.0.5:7000 does not match `pd.transport` = \"ucx\""
            ),
            "{m}"
        );
        let p = Params::from_value(
            &json!({"role": "decode", "pd": {"advertise": "tcp://10.0.0.5:7000"}}),
        )
        .unwrap();
        assert_eq!(p.pd.advertise.as_deref(), Some("tcp://10.0.0.5:7000"));
        assert_eq!(
            (p.pd.listen.as_str(), p.pd.max_rooms, p.pd.heartbeat_misses),
            ("tcp://127.0.0.1:0", 256, 3)
        );
    }
}
