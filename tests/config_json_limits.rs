//! Regression tests for hostile `config.json` files (issue 12, hardening): duplicate keys that
//! were silently resolved last-wins, and values that ran for minutes (`hc_sinkhorn_iters` = 10⁹),
//! allocated by a number of the file's choosing or gave NaN logits (a negative `rms_norm_eps`).
//! Each refusal names the key, the value and the accepted range (docs/params.md, "Limits").

mod common;

use common::assert_short;

use dsv4::config::ModelConfig;
use dsv4::{Error, ErrorKind};
use serde_json::{json, Map, Value};

const MB: usize = 1 << 20;

/// The published V4-Flash config.json, as a JSON object to mutate.
fn flash() -> Map<String, Value> {
    let text = include_str!("../configs/deepseek-v4-flash/config.json");
    match serde_json::from_str(text).unwrap() {
        Value::Object(obj) => obj,
        _ => unreachable!(),
    }
}

fn config_err(obj: &Map<String, Value>) -> Error {
    let text = serde_json::to_string(obj).unwrap();
    let err = ModelConfig::from_json_str(&text, "flash").expect_err("should be refused");
    assert_eq!(err.kind(), ErrorKind::ModelFormat, "{err}");
    assert_short(&err);
    err
}

#[test]
fn duplicate_config_json_keys_are_refused_naming_the_key() {
    let text = include_str!("../configs/deepseek-v4-flash/config.json");
    assert!(ModelConfig::from_json_str(text, "flash").is_ok());
    let twice = text.replacen("{", r#"{"hc_sinkhorn_iters": 1000000000,"#, 1);
    let err = ModelConfig::from_json_str(&twice, "flash").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelFormat);
    assert!(
        err.message()
            .starts_with("key `hc_sinkhorn_iters` appears twice in the same object"),
        "{err}"
    );
    let nested = text.replacen(r#""factor""#, r#""factor": 1, "factor""#, 1);
    let err = ModelConfig::from_json_str(&nested, "flash").unwrap_err();
    assert!(
        err.message()
            .starts_with("key `rope_scaling.factor` appears twice"),
        "{err}"
    );
}

#[test]
fn absurd_config_json_values_are_refused_with_key_value_and_range() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "hc_sinkhorn_iters",
            json!(1_000_000_000u64),
            "`hc_sinkhorn_iters` = 1000000000 is above the maximum 1000",
        ),
        (
            "num_hidden_layers",
            json!(1_000_000_000_000u64),
            "`num_hidden_layers` = 1000000000000 is above the maximum 1024",
        ),
        (
            "vocab_size",
            json!(u64::MAX),
            "`vocab_size` = 18446744073709551615 is above the maximum 16777216",
        ),
        (
            "hc_mult",
            json!(100_000),
            "`hc_mult` = 100000 is above the maximum 64",
        ),
        (
            "max_position_embeddings",
            json!(1u64 << 40),
            "`max_position_embeddings` = 1099511627776 is above the maximum 4294967296",
        ),
        (
            "eos_token_id",
            json!(129_280),
            "`eos_token_id` 129280 is not below `vocab_size` 129280: token ids run from 0 to \
             129279",
        ),
        (
            "bos_token_id",
            json!(200_000),
            "`bos_token_id` 200000 is not below `vocab_size` 129280",
        ),
        (
            "eos_token_id",
            json!((0..10_000).collect::<Vec<u32>>()),
            "`eos_token_id` lists 10000 token ids; at most 64 are accepted",
        ),
        (
            "rms_norm_eps",
            json!(-1e-6),
            "`rms_norm_eps` = -1e-6 is out of range: it must be between 1e-12 and 0.1",
        ),
        (
            "rms_norm_eps",
            json!(0),
            "`rms_norm_eps` = 0.0 is out of range",
        ),
        ("hc_eps", json!(1e-300), "`hc_eps` = 1e-300 is out of range"),
        (
            "routed_scaling_factor",
            json!(-1.5),
            "`routed_scaling_factor` = -1.5 must be greater than 0",
        ),
        (
            "swiglu_limit",
            json!(-10.0),
            "`swiglu_limit` = -10.0 is negative",
        ),
        (
            "rope_theta",
            json!(0),
            "`rope_theta` = 0.0 must be greater than 0",
        ),
        (
            "sliding_window",
            json!(1u64 << 40),
            "`sliding_window` = 1099511627776 is above the maximum 65536",
        ),
    ];
    for (key, value, needle) in cases {
        let mut obj = flash();
        obj.insert(key.to_string(), value.clone());
        let err = config_err(&obj);
        assert!(err.message().contains(needle), "{key} = {value}: {err}");
    }
}

#[test]
fn a_huge_config_json_is_refused_before_parsing() {
    let mut obj = flash();
    obj.insert("padding".into(), json!("x".repeat(2 * MB)));
    let text = serde_json::to_string(&obj).unwrap();
    let err = ModelConfig::from_json_str(&text, "flash").unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ModelFormat);
    assert!(
        err.message().contains("the limit is 1048576 bytes"),
        "{err}"
    );
}

#[test]
fn a_config_json_with_100_000_bad_entries_lists_fifty() {
    let mut obj = flash();
    obj.insert("layer_types".into(), json!(vec!["nope"; 100_000]));
    let err = config_err(&obj);
    let m = err.message();
    assert!(
        m.starts_with("100002 problems in DeepSeek V4 config.json, the first 50 listed:"),
        "{m}"
    );
    assert!(
        m.ends_with("… and 99952 more: fix these and validate again"),
        "{m}"
    );
}

/// Found by tests/config_property.rs: unsupported enum-like strings in config.json were echoed
/// whole (a 64 KiB `expert_dtype` made a 64 KiB message); they are quoted shortened like params.
#[test]
fn long_unsupported_strings_are_quoted_shortened() {
    let long = "x".repeat(100_000);
    // (`dtype` is read only in the official form; this is the Hugging Face one.)
    for key in ["expert_dtype", "scoring_func", "torch_dtype", "model_type"] {
        let mut c = flash();
        c.insert(key.into(), Value::String(long.clone()));
        let text = serde_json::to_string(&c).unwrap();
        let err = ModelConfig::from_json_str(&text, "flash").expect_err(key);
        assert_short(&err);
        assert!(
            err.message().contains("(100000 bytes)"),
            "{key}: {err:.300}"
        );
    }
}
