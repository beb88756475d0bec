//! Params and the memory planner across the ABI: JSON text in, JSON or text out.

use std::ffi::c_char;

use serde_json::Value;

use super::boundary::{c_bytes, guard, write_text};
use super::status::dsv4_status;
use crate::config::params::{defaults_document, Params};
use crate::error::Result;
use crate::plan;

/// # Safety
/// `params_json` is NULL or a NUL-terminated string.
unsafe fn params_arg(params_json: *const c_char) -> Result<Params> {
    // SAFETY: forwarded from the caller's contract.
    let bytes = unsafe { c_bytes(params_json, "params_json") }?;
    Params::from_json_bytes(bytes)
}

fn pretty(value: &Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// Writes the full default params document (JSON, every key documented in docs/params.md).
///
/// Output follows the `(buf, cap, needed)` convention: `*needed` receives the size including the
/// terminating NUL; pass `buf = NULL, cap = 0` to ask for it; a smaller `cap` writes nothing and
/// returns `DSV4_ERR_BUFFER_TOO_SMALL`. Thread-safe, does not block.
///
/// # Safety
/// `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_params_default(
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        let text = pretty(&Value::Object(defaults_document()));
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// Validates a params document (JSON; a partial document is merged over the defaults) and writes
/// the resolved document: every default filled in, every size in bytes.
///
/// Every problem is reported at once in a `DSV4_ERR_CONFIG` message, one line per problem, each
/// naming the key, the value and the fix (invalid UTF-8 and JSON are `DSV4_ERR_CONFIG` too).
/// Does not read `model_path`: `dsv4_plan` checks the params against the model. Output follows
/// the `(buf, cap, needed)` convention (`buf = NULL, cap = 0` validates and reports the size).
/// Thread-safe, does not block.
///
/// # Safety
/// `params_json` is a NUL-terminated string; `buf` is NULL or valid for `cap` bytes; `needed` is
/// NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_params_validate(
    params_json: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let params = unsafe { params_arg(params_json) }?;
        let text = pretty(&params.to_json_value());
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// Computes the per-rank memory plan for a params document and writes it as JSON (docs/plan.md
/// describes every field): pool geometry, device and host units and bytes per pool, totals,
/// token capacity, the HiCache sizing, and whether the host memory fits its NUMA node.
///
/// Reads `model_path`'s config.json only (no weights, no GPU). A plan that does not fit its NUMA
/// node is still returned (`numa.fits = false` with the reason); `dsv4_engine_create` refuses
/// it. Errors: `DSV4_ERR_CONFIG` (params invalid or contradicting the model, budget too small),
/// `DSV4_ERR_IO` (no config.json at `model_path`), `DSV4_ERR_MODEL_FORMAT` (config.json broken).
///
/// The plan includes live free-memory readings, so its size can change between a size query and
/// the call that fills the buffer: on `DSV4_ERR_BUFFER_TOO_SMALL` retry with the new `*needed`.
/// Thread-safe; reads a few files under /proc and /sys.
///
/// # Safety
/// As `dsv4_params_validate`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_plan(
    params_json: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let params = unsafe { params_arg(params_json) }?;
        let text = pretty(&plan::plan(&params)?.to_json());
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// The same plan as `dsv4_plan`, as an aligned human-readable table ending in a `summary` block
/// of `key: value` lines. Same arguments, errors and retry advice as `dsv4_plan`.
///
/// # Safety
/// As `dsv4_params_validate`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_plan_text(
    params_json: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let params = unsafe { params_arg(params_json) }?;
        let text = plan::plan(&params)?.to_text();
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::{CStr, CString};

    use super::*;
    use crate::ffi::status::*;

    type Call = unsafe extern "C" fn(*const c_char, *mut c_char, usize, *mut usize) -> dsv4_status;

    /// The status of `call` on `doc` (a size query) and the message it left.
    fn outcome(call: Call, doc: &str) -> (dsv4_status, String) {
        let doc = CString::new(doc).unwrap();
        let mut needed = 0usize;
        // SAFETY: a NUL-terminated document, no output buffer, a live `needed`.
        let status = unsafe { call(doc.as_ptr(), std::ptr::null_mut(), 0, &mut needed) };
        // SAFETY: dsv4_last_error never returns NULL.
        let message = unsafe { CStr::from_ptr(crate::ffi::dsv4_last_error()) };
        (status, message.to_string_lossy().into_owned())
    }

    #[test]
    fn metrics_labels_the_exposition_or_prometheus_sets_are_refused_by_name() {
        let reserved = crate::config::params::RESERVED_LABELS;
        // Prometheus's target labels, named here rather than read from the list.
        for target in ["job", "instance"] {
            assert!(reserved.contains(&target), "{target}");
        }
        for name in reserved {
            let doc = format!(r#"{{"metrics": {{"labels": {{"zone": "a", "{name}": "x"}}}}}}"#);
            let (status, message) = outcome(dsv4_params_validate, &doc);
            assert_eq!(status, DSV4_ERR_CONFIG, "{name}: {message}");
            assert!(
                message.contains(&format!("label name \"{name}\" is reserved"))
                    && message.contains(&format!("rename it, e.g. \"cluster_{name}\"")),
                "{name}: {message}"
            );
            let renamed = doc.replace(&format!("\"{name}\""), &format!("\"cluster_{name}\""));
            assert_eq!(
                outcome(dsv4_params_validate, &renamed).0,
                DSV4_OK,
                "{renamed}"
            );
        }
    }

    #[test]
    fn a_hicache_size_that_plans_no_host_tier_is_refused_by_both_plans() {
        let doc = format!(
            r#"{{"model_path": "{}/tests/fixtures/flash-like/hf-f32",
                 "kv": {{"device_memory_bytes": "32MiB", "page_size": 128}},
                 "hicache": {{"enabled": true, "size_bytes": 150}}}}"#,
            env!("CARGO_MANIFEST_DIR")
        );
        for call in [dsv4_plan as Call, dsv4_plan_text] {
            let (status, message) = outcome(call, &doc);
            assert_eq!(status, DSV4_ERR_CONFIG, "{message}");
            assert!(
                message.contains("HiCache would be enabled with no host tier")
                    && message.contains("did you mean \"150GB\"?"),
                "{message}"
            );
        }
        // The params alone are valid: only the model's geometry says 150 B is too small.
        assert_eq!(outcome(dsv4_params_validate, &doc).0, DSV4_OK);
    }
}
