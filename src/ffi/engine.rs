//! Engine handles across the ABI: create, destroy, score, model info.

use std::ffi::c_char;

use super::boundary::{c_bytes, guard, write_text};
use super::status::dsv4_status;
use crate::config::params::Params;
use crate::engine::Engine;
use crate::error::{Error, ErrorKind};

/// An engine: a loaded model, its KV pools and prefix cache, and the engine thread that runs
/// every request. Opaque; create with `dsv4_engine_create`, free with `dsv4_engine_destroy`.
/// Engine handles are thread-safe: any function taking one may be called from several threads
/// at once (each function says whether it blocks).
#[allow(non_camel_case_types)]
pub struct dsv4_engine {
    inner: Engine,
}

/// # Safety
/// `engine` is NULL or a live handle from `dsv4_engine_create`.
pub(super) unsafe fn engine_ref<'a>(engine: *const dsv4_engine) -> Result<&'a Engine, Error> {
    // SAFETY: forwarded from the caller's contract; the handle stays alive for the call.
    unsafe { engine.as_ref() }.map(|e| &e.inner).ok_or_else(|| {
        Error::invalid_argument("engine is NULL: pass a handle from dsv4_engine_create")
    })
}

/// Writes the text `make` produces from a live engine with the `(buf, cap, needed)` convention.
///
/// # Safety
/// `engine` is NULL or a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL
/// or valid for one `size_t`.
pub(super) unsafe fn engine_text(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
    make: impl FnOnce(&Engine) -> Result<String, Error>,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let text = make(unsafe { engine_ref(engine) }?)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// Creates an engine from a params document (JSON, merged over the defaults): validates the
/// params, computes the memory plan and refuses a plan that does not fit this machine
/// (`DSV4_ERR_CAPACITY`, with the plan's reason), then loads config.json and the weights at
/// `model_path` and allocates the KV pools exactly as the plan sizes them (on the CPU backend
/// in host memory, mapped lazily). Blocks while the weights load.
///
/// On success `*out` receives the handle; on failure `*out` is set to NULL and nothing stays
/// allocated. Errors: `DSV4_ERR_CONFIG` (params), `DSV4_ERR_IO` (files missing or unreadable),
/// `DSV4_ERR_MODEL_FORMAT` (checkpoint problems, each tensor named), `DSV4_ERR_CAPACITY`,
/// `DSV4_ERR_UNSUPPORTED` (valid params this build does not implement yet: backend cuda,
/// tp/ep > 1). A prefill or decode engine (`role`) also binds `pd.listen`: `DSV4_ERR_CONFIG`
/// when it cannot (the port is taken, the address is not on this host).
///
/// # Safety
/// `params_json` is a NUL-terminated string; `out` is valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn dsv4_engine_create(
    params_json: *const c_char,
    out: *mut *mut dsv4_engine,
) -> dsv4_status {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid_argument(
                "out is NULL: pass the address of a dsv4_engine*",
            ));
        }
        // SAFETY: `out` is non-NULL and valid for a write per this function's contract.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: forwarded from the caller's contract.
        let params = Params::from_json_bytes(unsafe { c_bytes(params_json, "params_json") }?)?;
        let engine = Box::new(dsv4_engine {
            inner: Engine::create(params)?,
        });
        // SAFETY: as above.
        unsafe { out.write(Box::into_raw(engine)) };
        Ok(())
    })
}

/// Destroys an engine and frees everything it holds. NULL is ignored. A live engine is first shut
/// down with `DSV4_SHUTDOWN_ABORT`: every request in flight ends with FINISHED / ABORTED (an event
/// callback still receives those terminal events; unpolled events are dropped), then the engine
/// thread and the backend's threads are joined (no dsv4 code of this engine runs after it
/// returns). The handle must not be used afterwards and no other call may be using it
/// concurrently. From a callback it stops the engine but cannot join its threads: don't.
///
/// # Safety
/// `engine` is NULL or a live handle from `dsv4_engine_create`, not yet destroyed.
#[no_mangle]
pub unsafe extern "C" fn dsv4_engine_destroy(engine: *mut dsv4_engine) {
    if engine.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the handle came from Box::into_raw in dsv4_engine_create and is destroyed once.
        drop(unsafe { Box::from_raw(engine) });
    }));
}

/// Runs one fresh sequence of `n_tokens` token ids through the model and writes the logits of
/// every position, row-major `[n_tokens, vocab]` f32, to `logits_out`. `logits_len` counts
/// floats: fewer than `n_tokens × vocab` returns `DSV4_ERR_BUFFER_TOO_SMALL` (the message
/// states the number needed) and writes nothing. Blocks while the forward pass runs;
/// thread-safe (calls on one engine share its KV pools and run one at a time); from a
/// callback (a dsv4 thread): `DSV4_ERR_INVALID_ARGUMENT`.
///
/// Errors: `DSV4_ERR_INVALID_ARGUMENT` for NULL pointers, `n_tokens == 0`, more tokens than
/// `kv.max_context_tokens`, or a token id outside the vocabulary (the message names its
/// position and value); `DSV4_ERR_CAPACITY` when the sequence needs more KV pages than the
/// pools hold (raise `kv.device_memory_bytes`).
///
/// # Safety
/// `engine` is a live handle; `tokens` is valid for `n_tokens` reads; `logits_out` is valid for
/// `logits_len` float writes.
#[no_mangle]
pub unsafe extern "C" fn dsv4_score(
    engine: *const dsv4_engine,
    tokens: *const i32,
    n_tokens: usize,
    logits_out: *mut f32,
    logits_len: usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        if n_tokens == 0 {
            return Err(Error::invalid_argument(
                "n_tokens is 0: pass at least one token",
            ));
        }
        if tokens.is_null() {
            return Err(Error::invalid_argument(
                "tokens is NULL: pass an array of n_tokens ids",
            ));
        }
        if logits_out.is_null() {
            return Err(Error::invalid_argument(
                "logits_out is NULL: pass an array for the logits",
            ));
        }
        let vocab = engine.vocab_size();
        let needed = n_tokens.checked_mul(vocab).ok_or_else(|| {
            Error::invalid_argument(format!("n_tokens = {n_tokens} is too large"))
        })?;
        if logits_len < needed {
            return Err(Error::new(
                ErrorKind::BufferTooSmall,
                format!(
                    "logits_out holds {logits_len} floats but {n_tokens} tokens × {vocab} vocab \
                     = {needed} are needed"
                ),
            ));
        }
        // SAFETY: `tokens` is non-NULL and valid for `n_tokens` reads per the contract.
        let ids = unsafe { std::slice::from_raw_parts(tokens, n_tokens) };
        let logits = engine.score(ids)?;
        // SAFETY: `logits_out` is valid for `logits_len >= needed == logits.len()` writes; the
        // source is our own vector, so the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(logits.as_ptr(), logits_out, logits.len()) };
        Ok(())
    })
}

/// Writes a JSON summary of the loaded model: configuration, layer kinds, parameter count and
/// resident bytes by dtype. `(buf, cap, needed)` convention; thread-safe, does not block.
///
/// # Safety
/// `engine` is a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid
/// for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_model_info(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        engine_text(engine, buf, cap, needed, |e| {
            Ok(serde_json::to_string_pretty(&e.model_info()).unwrap_or_default())
        })
    }
}
