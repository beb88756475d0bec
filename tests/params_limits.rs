//! Regression tests for hostile params documents (issue 12, hardening): inputs that used to take
//! minutes and gigabytes (a 10 MB unknown key, a 100 MB enum value, a million devices) and
//! duplicate keys that were silently resolved last-wins. Each test asserts the outcome — status
//! and message — which the documented size caps (docs/params.md, "Limits") make deterministic;
//! none measures time.

mod common;

use common::assert_short;

use dsv4::config::params::MAX_DEVICES;
use dsv4::config::{Params, MAX_PROBLEMS};
use dsv4::{Error, ErrorKind};
use serde_json::{json, Map, Value};

const MB: usize = 1 << 20;

fn params_err(doc: &Value) -> Error {
    let err = Params::from_value(doc).expect_err("should be refused");
    assert_eq!(err.kind(), ErrorKind::Config, "{err}");
    err
}

#[test]
fn a_10_mb_unknown_key_is_named_shortened_without_a_suggestion() {
    let key = "k".repeat(10 * MB);
    let err = params_err(&json!({ key.clone(): 1 }));
    assert_short(&err);
    let m = err.message();
    assert!(m.starts_with("params: unknown key `kkkk"), "{m}");
    assert!(m.contains("(10485760 bytes)"), "{m}");
    assert!(
        m.contains("the keys of the top level are model_path, backend"),
        "{m}"
    );
    // The same key inside a section, spelled like a real key repeated.
    let near = "page_size".repeat(MB);
    let m = params_err(&json!({"kv": { near: 256 }})).to_string();
    assert!(m.contains("unknown key `kv.page_sizepage_size"), "{m}");
    assert!(m.contains("the keys of `kv` are dtype"), "{m}");
    assert!(!m.contains("did you mean"), "{m}");
}

#[test]
fn a_100_mb_enum_value_is_reported_truncated() {
    let value = "cuda".repeat(25 * MB);
    let err = params_err(&json!({ "backend": value }));
    assert_short(&err);
    let m = err.message();
    assert!(
        m.contains("`backend` = \"cudacudacuda") && m.contains("… (104857600 bytes)\""),
        "{m}"
    );
    assert!(m.contains("is not one of cpu, cuda"), "{m}");
    assert!(!m.contains("did you mean"), "{m}");
}

#[test]
fn huge_strings_in_other_kinds_are_shortened_too() {
    let big = "9".repeat(10 * MB);
    for (doc, needle) in [
        (
            json!({"threads": big}),
            "`threads` must be an integer, got string \"999",
        ),
        (
            json!({"kv": {"device_memory_bytes": big.clone() + "X"}}),
            "unknown unit `X`",
        ),
        (json!({"model_path": big}), "is longer than 4096 bytes"),
        (
            json!({"metrics": {"labels": {"a": big}}}),
            "label values are at most 1024 bytes",
        ),
    ] {
        let err = params_err(&doc);
        assert_short(&err);
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
    }
}

#[test]
fn a_million_devices_are_refused_by_the_cap() {
    let many: Vec<u64> = (0..1_000_000).collect();
    let err = params_err(&json!({ "devices": many }));
    assert_eq!(
        err.message(),
        "params: `devices` lists 1000000 entries; at most 1024 are accepted: list the GPUs this \
         engine uses, each once"
    );
    // Up to the cap, distinct indices pass and a repeat is found wherever it is.
    let all: Vec<usize> = (0..MAX_DEVICES).collect();
    let p = Params::from_value(&json!({ "devices": all })).unwrap();
    assert_eq!(p.devices.len(), MAX_DEVICES);
    let mut repeat: Vec<usize> = (0..MAX_DEVICES - 1).collect();
    repeat.push(MAX_DEVICES - 2);
    let m = params_err(&json!({ "devices": repeat })).to_string();
    assert!(m.contains("`devices` lists GPU 1022 twice"), "{m}");
}

#[test]
fn a_params_document_over_1_mib_is_refused_before_parsing() {
    // Today's code parsed this and then spent minutes on the did-you-mean of the key.
    let text = format!(r#"{{"{}": 1}}"#, "k".repeat(10 * MB));
    for err in [
        Params::from_json(&text).unwrap_err(),
        Params::from_json_bytes(text.as_bytes()).unwrap_err(),
    ] {
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(
            err.message()
                .starts_with("params are 10485767 bytes; the limit is 1048576 bytes (1 MiB)"),
            "{err}"
        );
    }
    let devices = format!(r#"{{"devices": [{}0]}}"#, "0, ".repeat(MB / 2));
    let err = Params::from_json(&devices).unwrap_err();
    assert!(
        err.message().contains("the limit is 1048576 bytes"),
        "{err}"
    );
}

#[test]
fn a_flood_of_problems_lists_the_first_fifty_and_counts_the_rest() {
    let doc: Map<String, Value> = (0..100_000)
        .map(|i| (format!("unknown_{i}"), json!(i)))
        .collect();
    let err = params_err(&Value::Object(doc));
    let lines: Vec<&str> = err.message().lines().collect();
    assert_eq!(lines[0], "100000 problems in params, the first 50 listed:");
    assert_eq!(lines.len(), 1 + MAX_PROBLEMS + 1);
    assert_eq!(lines[1], "  - unknown key `unknown_0`: the keys of the top level are model_path, backend, devices, threads, role, parallel, model, kv, hicache, admission, scheduler, numerics, metrics, pd (docs/params.md lists them all)");
    assert_eq!(
        *lines.last().unwrap(),
        "  … and 99950 more: fix these and validate again"
    );
}

#[test]
fn duplicate_params_keys_are_refused_naming_the_key() {
    for (text, path) in [
        (
            r#"{"kv": {"page_size": 128, "page_size": 512}}"#,
            "kv.page_size",
        ),
        (
            r#"{"backend": "cpu", "threads": 2, "backend": "cuda"}"#,
            "backend",
        ),
        (r#"{"kv": {}, "kv": {"page_size": 128}}"#, "kv"),
        (
            r#"{"metrics": {"labels": {"a": "x", "a": "y"}}}"#,
            "metrics.labels.a",
        ),
    ] {
        for err in [
            Params::from_json(text).unwrap_err(),
            Params::from_json_bytes(text.as_bytes()).unwrap_err(),
        ] {
            assert_eq!(err.kind(), ErrorKind::Config, "{text}");
            assert!(
                err.message().starts_with(&format!(
                    "params: key `{path}` appears twice in the same object"
                )),
                "{text}: {err}"
            );
            assert!(err.message().contains("delete one of them"), "{err}");
        }
    }
    // The same leaf name in two sections is not a duplicate.
    let p = Params::from_json(r#"{"kv": {"dtype": "f32"}, "model": {"weight_dtype": "f32"}}"#);
    assert!(p.is_ok(), "{p:?}");
}
