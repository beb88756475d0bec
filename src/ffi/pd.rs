//! Prefill/decode disaggregation across the ABI: the endpoint a PD engine is reached at.

use std::ffi::c_char;

use super::engine::{dsv4_engine, engine_text};
use super::status::dsv4_status;

/// Writes the address PD peers reach this engine at, NUL-terminated: `tcp://host:port` from
/// `pd.advertise`, else the address `pd.listen` bound (its port filled in when it was 0). The
/// host's router hands a prefill engine's endpoint to decode engines as `dsv4_request.pd_peer`.
/// `(buf, cap, needed)` convention; thread-safe, does not block. `DSV4_ERR_INVALID_ARGUMENT` in
/// the unified role (it has no endpoint).
///
/// # Safety
/// `engine` is a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid
/// for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_pd_endpoint(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    // SAFETY: forwarded from the caller's contract.
    unsafe { engine_text(engine, buf, cap, needed, |e| e.pd_endpoint()) }
}
