//! Property tests over the two JSON documents an operator writes: the params and `config.json`.
//! Random valid documents must be accepted and round-trip; random mutations of them (wrong types,
//! huge numbers and strings, unknown keys, deep nesting, broken text, duplicate keys) must give
//! `Ok` or a clean error of the right kind with a short, non-empty message — never a panic, an
//! abort or a message that echoes megabytes. Case counts keep each property to about a second.

use dsv4::config::model::{EPS_RANGE, INT_LIMITS};
use dsv4::config::params::schema::{KeySpec, Kind, KEYS, SECTIONS};
use dsv4::config::{ModelConfig, Params};
use dsv4::{Error, ErrorKind};
use proptest::prelude::*;
use proptest::sample::{select, subsequence};
use serde_json::{json, Map, Number, Value};

/// The longest message a refusal may have: 50 listed problems of a few hundred bytes each.
const MAX_MESSAGE: usize = 64 << 10;

/// 512 cases a property (well under a second each); failures are shrunk and printed, not saved.
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Hostile JSON values.

fn hostile_string() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z_]{0,12}",
        "\\PC{0,16}",
        select(vec![
            "",
            "cpu",
            "cuda",
            "auto",
            "fp8",
            "write_through",
            "lpm",
            "150GB",
            "-1GiB",
            "0B",
            "1e400",
            "99999999999PB",
            "1.5.5GiB",
            "NaN",
            "inf",
            "-0",
            "0x10",
            " 7 ",
        ])
        .prop_map(str::to_string),
        (0usize..100_000).prop_map(|n| "x".repeat(n)),
        (0usize..20_000).prop_map(|n| "9".repeat(n)),
    ]
}

fn hostile_scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("JSON numbers are finite", |f| {
            Number::from_f64(f).map(Value::Number)
        }),
        select(vec![
            0u64,
            1,
            127,
            128,
            129,
            256,
            1000,
            1001,
            1024,
            1025,
            4096,
            4097,
            65_536,
            65_537,
            u64::from(u32::MAX),
            u64::from(u32::MAX) + 1,
            1 << 53,
            u64::MAX,
        ])
        .prop_map(Value::from),
        select(vec![-1i64, -128, i64::MIN]).prop_map(Value::from),
        select(vec![
            0.0f64, -0.0, 1e-300, -1e-6, 0.5, 1.0, 1.5, 1e300, -1e300
        ])
        .prop_map(|f| json!(f)),
        hostile_string().prop_map(Value::from),
    ]
}

fn hostile_value() -> impl Strategy<Value = Value> {
    hostile_scalar().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{0,10}", inner), 0..6)
                .prop_map(|members| Value::Object(members.into_iter().collect())),
        ]
    })
}

/// `value` wrapped in `depth` arrays or objects (past serde_json's 128-level limit too).
fn nested(value: Value, depth: usize, in_objects: bool) -> Value {
    (0..depth).fold(value, |v, _| {
        if in_objects {
            json!({ "a": v })
        } else {
            json!([v])
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Params documents.

fn valid_value(spec: &KeySpec) -> BoxedStrategy<Value> {
    match spec.kind {
        Kind::Choice(choices) => select(choices).prop_map(Value::from).boxed(),
        Kind::Text { nullable } => {
            let mut paths = vec![json!("/models/DeepSeek-V4-Flash"), json!("configs/x")];
            if nullable {
                paths.push(Value::Null);
            }
            select(paths).boxed()
        }
        Kind::Int { min, max, nullable } => {
            let n = prop_oneof![Just(min), Just(max), min..=max].prop_map(Value::from);
            if nullable {
                prop_oneof![n, Just(Value::Null)].boxed()
            } else {
                n.boxed()
            }
        }
        Kind::Float {
            min, max, nullable, ..
        } => {
            // Strictly inside the range, so open and closed bounds both accept it.
            let x = (0.001f64..0.999).prop_map(move |u| json!(min + (max - min) * u));
            if nullable {
                prop_oneof![x, Just(Value::Null)].boxed()
            } else {
                x.boxed()
            }
        }
        Kind::Bool => any::<bool>().prop_map(Value::from).boxed(),
        Kind::Size { nullable } => {
            let mut sizes = vec![json!(4096), json!("1GiB"), json!("150GB"), json!(150e9)];
            if nullable {
                sizes.push(Value::Null);
            }
            select(sizes).boxed()
        }
        Kind::Devices => subsequence((0u32..16).collect::<Vec<_>>(), 0..4)
            .prop_map(|d| json!(d))
            .boxed(),
        Kind::Hosts => prop::collection::vec("[a-z][a-z0-9.-]{0,8}(:[1-9][0-9]{0,3})?", 0..3)
            .prop_map(|h| json!(h))
            .boxed(),
        // Names the exposition puts on its own series are refused: not valid params.
        Kind::Labels => {
            let name = "[a-z][a-z0-9_]{0,8}".prop_filter("a reserved label", |n: &String| {
                !dsv4::config::params::RESERVED_LABELS.contains(&n.as_str())
            });
            prop::collection::btree_map(name, "[a-z0-9-]{0,8}", 0..3)
                .prop_map(|labels| json!(labels))
                .boxed()
        }
        Kind::NumaNode => {
            prop_oneof![Just(json!("auto")), (0u64..=4096).prop_map(Value::from)].boxed()
        }
        Kind::Endpoint {
            nullable,
            connectable,
        } => {
            let mut endpoints = vec![
                json!("tcp://10.0.0.5:7000"),
                json!("tcp://[::1]:7001"),
                json!("tcp://prefill-0.example:65535"),
            ];
            if !connectable {
                endpoints.push(json!("tcp://0.0.0.0:0"));
            }
            if nullable {
                endpoints.push(Value::Null);
            }
            select(endpoints).boxed()
        }
    }
}

fn set_path(doc: &mut Map<String, Value>, path: &str, value: Value) {
    match path.split_once('.') {
        None => {
            doc.insert(path.to_string(), value);
        }
        Some((section, leaf)) => {
            let entry = doc.entry(section.to_string()).or_insert_with(|| json!({}));
            if !entry.is_object() {
                *entry = json!({});
            }
            entry
                .as_object_mut()
                .unwrap()
                .insert(leaf.to_string(), value);
        }
    }
}

fn get_path<'a>(doc: &'a Map<String, Value>, path: &str) -> Option<&'a Value> {
    match path.split_once('.') {
        None => doc.get(path),
        Some((section, leaf)) => doc.get(section)?.get(leaf),
    }
}

fn remove_path(doc: &mut Map<String, Value>, path: &str) {
    match path.split_once('.') {
        None => {
            doc.remove(path);
        }
        Some((section, leaf)) => {
            if let Some(Value::Object(s)) = doc.get_mut(section) {
                s.remove(leaf);
            }
        }
    }
}

/// Makes a document of individually valid values satisfy the cross-key rules that
/// docs/params.md states, so that it must be accepted.
fn repair(doc: &mut Map<String, Value>) {
    let int = |doc: &Map<String, Value>, path: &str, default: u64| {
        get_path(doc, path)
            .and_then(Value::as_u64)
            .unwrap_or(default)
    };
    let page = int(doc, "kv.page_size", 256).max(128) / 128 * 128;
    if get_path(doc, "kv.page_size").is_some() {
        set_path(doc, "kv.page_size", json!(page));
    }
    if let Some(interval) = get_path(doc, "kv.snapshot_interval_tokens").and_then(Value::as_u64) {
        set_path(
            doc,
            "kv.snapshot_interval_tokens",
            json!(page * (interval / page).clamp(1, 1 << 20)),
        );
    }
    let set =
        |doc: &Map<String, Value>, path: &str| get_path(doc, path).is_some_and(|v| !v.is_null());
    if set(doc, "kv.device_memory_bytes") {
        remove_path(doc, "kv.device_memory_fraction");
        remove_path(doc, "kv.device_total_bytes");
    }
    if set(doc, "hicache.ratio") {
        remove_path(doc, "hicache.size_bytes");
    }
    if get_path(doc, "hicache.enabled") == Some(&json!(true)) {
        set_path(doc, "kv.prefix_cache", json!(true));
    }
    let batch = int(doc, "scheduler.max_batch_tokens", 8192);
    if int(doc, "scheduler.chunked_prefill_tokens", 2048) > batch {
        set_path(doc, "scheduler.chunked_prefill_tokens", json!(batch));
    }
    if get_path(doc, "backend") == Some(&json!("cuda"))
        && get_path(doc, "devices").is_some_and(|d| d == &json!([]))
    {
        set_path(doc, "devices", json!([0]));
    }
    // The endpoints' scheme is the transport's.
    if let Some(t) = get_path(doc, "pd.transport").and_then(Value::as_str) {
        let t = t.to_string();
        for key in ["pd.listen", "pd.advertise"] {
            if let Some(e) = get_path(doc, key).and_then(Value::as_str) {
                let rest = e.split_once("://").map_or(e, |(_, r)| r).to_string();
                set_path(doc, key, json!(format!("{t}://{rest}")));
            }
        }
    }
    // A dead peer must be noticed before a transfer times out: shorten the heartbeat.
    let misses = int(doc, "pd.heartbeat_misses", 3);
    let timeout = int(doc, "pd.transfer_timeout_ms", 30000);
    if int(doc, "pd.heartbeat_interval_ms", 1000) * misses >= timeout {
        if timeout > misses {
            set_path(
                doc,
                "pd.heartbeat_interval_ms",
                json!((timeout - 1) / misses),
            );
        } else {
            set_path(doc, "pd.heartbeat_interval_ms", json!(1));
            set_path(doc, "pd.heartbeat_misses", json!(1));
            set_path(doc, "pd.transfer_timeout_ms", json!(timeout.max(2)));
        }
    }
}

fn valid_params() -> impl Strategy<Value = Map<String, Value>> {
    let members: Vec<BoxedStrategy<Option<(&'static str, Value)>>> = KEYS
        .iter()
        .map(|spec| prop::option::of(valid_value(spec).prop_map(move |v| (spec.path, v))).boxed())
        .collect();
    members.prop_map(|members| {
        let mut doc = Map::new();
        for (path, value) in members.into_iter().flatten() {
            set_path(&mut doc, path, value);
        }
        repair(&mut doc);
        doc
    })
}

#[derive(Debug, Clone)]
enum Mutation {
    /// A known key (or a whole section) gets a hostile value.
    Set(String, Value),
    /// An unknown key, at the top level or in a section.
    Unknown(Option<&'static str>, String, Value),
    /// A known key's value nested far deeper than JSON allows.
    Deep(String, usize, bool),
    Remove(String),
}

fn any_path() -> impl Strategy<Value = String> {
    let mut paths: Vec<String> = KEYS.iter().map(|k| k.path.to_string()).collect();
    paths.extend(SECTIONS.iter().map(|s| s.to_string()));
    select(paths)
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any_path(), hostile_value()).prop_map(|(p, v)| Mutation::Set(p, v)),
        2 => (prop::option::of(select(SECTIONS)), hostile_string(), hostile_value())
            .prop_map(|(s, k, v)| Mutation::Unknown(s, k, v)),
        1 => (any_path(), 0usize..300, any::<bool>()).prop_map(|(p, d, o)| Mutation::Deep(p, d, o)),
        1 => any_path().prop_map(Mutation::Remove),
    ]
}

fn apply(doc: &mut Map<String, Value>, m: Mutation) {
    match m {
        Mutation::Set(path, value) => set_path(doc, &path, value),
        Mutation::Unknown(section, key, value) => match section {
            Some(s) => set_path(doc, &format!("{s}.{key}"), value),
            None => {
                doc.insert(key, value);
            }
        },
        Mutation::Deep(path, depth, in_objects) => {
            let value = get_path(doc, &path).cloned().unwrap_or(json!(1));
            set_path(doc, &path, nested(value, depth, in_objects));
        }
        Mutation::Remove(path) => remove_path(doc, &path),
    }
}

/// A refusal is a config error whose message is non-empty and short.
fn assert_clean(err: &Error, kind: ErrorKind) -> Result<(), TestCaseError> {
    prop_assert_eq!(err.kind(), kind, "{}", err);
    prop_assert!(!err.message().trim().is_empty());
    prop_assert!(
        err.message().len() <= MAX_MESSAGE,
        "a {}-byte message: {:.300}",
        err.message().len(),
        err.message()
    );
    Ok(())
}

/// Equal documents, except that floats may differ in their last bit: serde_json (built without
/// its `float_roundtrip` feature) parses a 17-digit decimal to within one ulp, not exactly, so
/// `0.45980781877346083` written out and read back can come back as `0.4598078187734608`.
fn same_document(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            (x - y).abs() <= f64::EPSILON * x.abs().max(y.abs())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_document(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((kx, x), (ky, y))| kx == ky && same_document(x, y))
        }
        _ => a == b,
    }
}

/// Accepted params survive a trip through their resolved document: exactly as a value, and as
/// text up to the last bit of a float (see [`same_document`]).
fn assert_round_trip(p: &Params) -> Result<(), TestCaseError> {
    let resolved = p.to_json_value();
    prop_assert_eq!(&Params::from_value(&resolved).unwrap(), p);
    let text = serde_json::to_string(&resolved).unwrap();
    let again = Params::from_json(&text).unwrap().to_json_value();
    prop_assert!(same_document(&again, &resolved), "{again}\n{resolved}");
    Ok(())
}

/// The value and text paths agree, and each gives `Ok` or a clean config error.
fn check_params(doc: &Value) -> Result<(), TestCaseError> {
    let by_value = Params::from_value(doc);
    match &by_value {
        Ok(p) => assert_round_trip(p)?,
        Err(e) => assert_clean(e, ErrorKind::Config)?,
    }
    let text = serde_json::to_string(doc).unwrap();
    match (Params::from_json(&text), &by_value) {
        (Ok(p), Ok(q)) => prop_assert!(
            same_document(&p.to_json_value(), &q.to_json_value()),
            "{p:?}\n{q:?}"
        ),
        (Ok(p), Err(e)) => prop_assert!(false, "text accepted {p:?}, value refused: {e}"),
        // Text can fail where the value did not: over 1 MiB, or nested past 128 levels.
        (Err(e), _) => assert_clean(&e, ErrorKind::Config)?,
    }
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn valid_params_are_accepted_and_round_trip(doc in valid_params()) {
        let p = Params::from_value(&Value::Object(doc.clone()));
        prop_assert!(p.is_ok(), "{:#}\n{}", Value::Object(doc), p.unwrap_err());
        assert_round_trip(&p.unwrap())?;
    }

    #[test]
    fn mutated_params_are_accepted_or_refused_cleanly(
        doc in valid_params(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut doc = doc;
        for m in mutations {
            apply(&mut doc, m);
        }
        check_params(&Value::Object(doc))?;
    }

    #[test]
    fn any_json_value_as_params_is_accepted_or_refused_cleanly(doc in hostile_value()) {
        check_params(&doc)?;
    }

    #[test]
    fn broken_params_text_is_refused_cleanly(
        doc in valid_params(),
        cut in any::<prop::sample::Index>(),
        byte in any::<u8>(),
        at in any::<prop::sample::Index>(),
    ) {
        let text = serde_json::to_string(&Value::Object(doc)).unwrap().into_bytes();
        let truncated = &text[..cut.index(text.len())];
        let mut inserted = text.clone();
        inserted.insert(at.index(text.len() + 1), byte);
        for bytes in [truncated, inserted.as_slice()] {
            if let Err(e) = Params::from_json_bytes(bytes) {
                assert_clean(&e, ErrorKind::Config)?;
            }
        }
    }

    /// Any member written twice is refused, naming it — never silently last-wins.
    #[test]
    fn a_repeated_params_key_is_refused_by_name(
        doc in valid_params().prop_filter("a key to repeat", |d| !d.is_empty()),
        which in any::<prop::sample::Index>(),
        inner in any::<bool>(),
    ) {
        let members: Vec<(&String, &Value)> = doc.iter().collect();
        let (key, value) = members[which.index(members.len())];
        // Repeat the member itself, or (for a section) its first entry inside the section.
        let (path, section_text) = match value {
            Value::Object(section) if inner && !section.is_empty() => {
                let (leaf, leaf_value) = section.iter().next().unwrap();
                let body = serde_json::to_string(section).unwrap();
                let repeated = format!(
                    "{},{}:{}}}",
                    &body[..body.len() - 1],
                    json!(leaf),
                    leaf_value
                );
                (format!("{key}.{leaf}"), Some(repeated))
            }
            _ => (key.clone(), None),
        };
        let mut parts: Vec<String> = doc
            .iter()
            .map(|(k, v)| match (&section_text, k == key) {
                (Some(text), true) => format!("{}:{text}", json!(k)),
                _ => format!("{}:{v}", json!(k)),
            })
            .collect();
        if section_text.is_none() {
            parts.push(format!("{}:{value}", json!(key)));
        }
        let text = format!("{{{}}}", parts.join(","));
        let err = Params::from_json(&text).unwrap_err();
        assert_clean(&err, ErrorKind::Config)?;
        let expected = format!("params: key `{path}` appears twice in the same object");
        prop_assert!(err.message().starts_with(&expected), "{}", err);
    }
}

// ---------------------------------------------------------------------------------------------
// config.json.

fn published_configs() -> Vec<Map<String, Value>> {
    let object = |text: &str| match serde_json::from_str(text).unwrap() {
        Value::Object(o) => o,
        _ => unreachable!(),
    };
    let Value::Object(tiny) = dsv4::model::tiny::config_json() else {
        unreachable!()
    };
    vec![
        object(include_str!("../configs/deepseek-v4-flash/config.json")),
        object(include_str!("../configs/deepseek-v4-pro/config.json")),
        tiny,
    ]
}

/// Values aimed at the bounds: each limit, one past it, and the corner cases of every key.
fn boundary_value() -> impl Strategy<Value = Value> {
    let mut values: Vec<Value> = INT_LIMITS
        .iter()
        .flat_map(|&(_, max)| [json!(max), json!(max + 1)])
        .collect();
    values.extend([
        json!(0),
        json!(1),
        json!(2),
        json!(-1),
        json!(1e-13),
        json!(0.2),
    ]);
    select(values)
}

#[derive(Debug, Clone)]
enum ConfigMutation {
    Set(String, Value),
    /// A key one level down (`rope_scaling.factor`, `quantization_config.fmt`, …).
    SetInner(String, String, Value),
    Remove(String),
}

fn config_key() -> impl Strategy<Value = String> {
    let mut keys: Vec<String> = published_configs()
        .iter()
        .flat_map(|c| c.keys().cloned())
        .collect();
    keys.extend(INT_LIMITS.iter().map(|(k, _)| k.to_string()));
    keys.extend(
        [
            "dim",
            "n_layers",
            "norm_eps",
            "layer_types",
            "mlp_layer_types",
            "rope_parameters",
            "partial_rotary_factor",
            "max_seq_len",
            "n_hash_layers",
            "compress_rates",
        ]
        .map(str::to_string),
    );
    keys.sort();
    keys.dedup();
    select(keys)
}

fn config_mutation() -> impl Strategy<Value = ConfigMutation> {
    let value = prop_oneof![2 => hostile_value(), 1 => boundary_value()];
    prop_oneof![
        4 => (config_key(), value.clone()).prop_map(|(k, v)| ConfigMutation::Set(k, v)),
        2 => (
            select(vec!["rope_scaling", "rope_parameters", "quantization_config", "compress_rates"]),
            select(vec![
                "factor", "type", "rope_type", "original_max_position_embeddings", "beta_fast",
                "weight_block_size", "fmt", "quant_method", "main", "compress",
                "compressed_sparse_attention", "heavily_compressed_attention",
            ]),
            value,
        )
            .prop_map(|(o, k, v)| ConfigMutation::SetInner(o.into(), k.into(), v)),
        1 => config_key().prop_map(ConfigMutation::Remove),
    ]
}

fn apply_config(config: &mut Map<String, Value>, m: ConfigMutation) {
    match m {
        ConfigMutation::Set(key, value) => {
            config.insert(key, value);
        }
        ConfigMutation::SetInner(outer, key, value) => {
            let entry = config.entry(outer).or_insert_with(|| json!({}));
            if let Value::Object(inner) = entry {
                inner.insert(key, value);
            } else {
                *entry = json!({ key: value });
            }
        }
        ConfigMutation::Remove(key) => {
            config.remove(&key);
        }
    }
}

/// What an accepted config.json guarantees to the rest of dsv4.
fn assert_bounded(c: &ModelConfig) -> Result<(), TestCaseError> {
    let limit = |key: &str| INT_LIMITS.iter().find(|(k, _)| *k == key).unwrap().1 as usize;
    prop_assert!((1..=limit("hc_sinkhorn_iters")).contains(&c.hc_sinkhorn_iters));
    prop_assert!((1..=limit("num_hidden_layers")).contains(&c.num_layers));
    prop_assert_eq!(c.attention.len(), c.num_layers);
    prop_assert_eq!(c.mlp.len(), c.num_layers);
    prop_assert!((1..=limit("vocab_size")).contains(&c.vocab_size));
    prop_assert!(c.hc_mult <= limit("hc_mult"));
    prop_assert!(c.max_position_embeddings <= 1 << 32);
    for id in c.eos_token_ids.iter().chain(&c.bos_token_id) {
        prop_assert!(
            (*id as usize) < c.vocab_size,
            "token {} of {}",
            id,
            c.vocab_size
        );
    }
    prop_assert!(EPS_RANGE.contains(&c.rms_norm_eps), "{}", c.rms_norm_eps);
    prop_assert!(EPS_RANGE.contains(&c.hc_eps), "{}", c.hc_eps);
    prop_assert!(c.routed_scaling_factor > 0.0 && c.swiglu_limit >= 0.0);
    Ok(())
}

#[test]
fn published_configs_are_accepted_within_bounds() {
    for config in published_configs() {
        let c = ModelConfig::from_json_str(&Value::Object(config).to_string(), "published");
        assert_bounded(&c.unwrap()).unwrap();
    }
}

fn check_config(text: &str) -> Result<(), TestCaseError> {
    match ModelConfig::from_json_str(text, "fuzzed") {
        Ok(c) => assert_bounded(&c),
        Err(e) => assert_clean(&e, ErrorKind::ModelFormat),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn mutated_config_json_is_accepted_or_refused_cleanly(
        base in select(published_configs()),
        mutations in prop::collection::vec(config_mutation(), 1..4),
    ) {
        let mut config = base;
        for m in mutations {
            apply_config(&mut config, m);
        }
        check_config(&Value::Object(config).to_string())?;
    }

    #[test]
    fn any_json_value_as_config_json_is_refused_cleanly(value in hostile_value()) {
        check_config(&value.to_string())?;
    }

    #[test]
    fn broken_config_json_text_is_refused_cleanly(
        base in select(published_configs()),
        cut in any::<prop::sample::Index>(),
        repeat in any::<prop::sample::Index>(),
    ) {
        let text = Value::Object(base.clone()).to_string();
        let mut cut = cut.index(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        check_config(&text[..cut])?;
        // A member repeated at the end is refused by name.
        let members: Vec<(&String, &Value)> = base.iter().collect();
        let (key, value) = members[repeat.index(members.len())];
        let twice = format!("{},{}:{value}}}", &text[..text.len() - 1], json!(key));
        let err = ModelConfig::from_json_str(&twice, "fuzzed").unwrap_err();
        assert_clean(&err, ErrorKind::ModelFormat)?;
        prop_assert!(
            err.message().starts_with(&format!("key `{key}` appears twice")),
            "{}",
            err
        );
    }
}
