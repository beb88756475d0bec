//! The prefix cache and its host tier across the ABI: statistics and flushes.

use std::ffi::c_char;

use super::boundary::{c_bytes, guard};
use super::engine::{dsv4_engine, engine_ref, engine_text};
use super::status::dsv4_status;
use crate::error::Error;
use crate::kv::cache::Tier;

/// Writes the prefix cache's state as JSON: per pool and tier (`device`, `host`) the used and
/// total units and bytes; hits and hit tokens by tier; load-backs and backups (count, tokens,
/// bytes, seconds, bytes/s, in flight, skipped); evictions by tier and reason; the write policy.
/// docs/hicache.md lists every field. `(buf, cap, needed)` convention; thread-safe; blocks
/// until the engine thread answers (between forward steps); from a callback (a dsv4 thread):
/// `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid
/// for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_cache_stats(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        engine_text(engine, buf, cap, needed, |e| {
            Ok(serde_json::to_string_pretty(&e.cache_stats()?).unwrap_or_default())
        })
    }
}

/// Drops every unlocked cached prefix from one tier: `"device"` (host copies are kept; with
/// `write_back` the device copies are written to the host first), `"host"`, or `"all"`.
/// Prefixes in use by running requests stay. Thread-safe; blocks until done; from a callback
/// (a dsv4 thread): `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle; `tier` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn dsv4_cache_flush(
    engine: *const dsv4_engine,
    tier: *const c_char,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        // SAFETY: forwarded from the caller's contract.
        let tier = match unsafe { c_bytes(tier, "tier") }? {
            b"device" => Tier::Device,
            b"host" => Tier::Host,
            b"all" => Tier::All,
            other => {
                return Err(Error::invalid_argument(format!(
                    "tier = \"{}\": use \"device\", \"host\" or \"all\"",
                    String::from_utf8_lossy(other)
                )))
            }
        };
        engine.flush_cache(tier).map(|_| ())
    })
}
