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
/// resident bytes by dtype, and the facts a server needs: `vocab_size`, `bos_token_id` (null
/// when config.json has none), `eos_token_ids` (an array: every id that ends a request unless
/// `ignore_eos`), `max_position_embeddings` (the model's) and `context_limit` (what one request
/// can hold, prompt and output together: the smaller of `kv.max_context_tokens` and the device
/// KV pages), `has_tokenizer` (the model directory's `tokenizer.json` loaded and fits the
/// vocabulary: `dsv4_tokenize` works) and `has_chat_template` (its `tokenizer_config.json` has a
/// `chat_template` that compiles: `dsv4_chat_apply` works); when either is false, those calls
/// say why. `(buf, cap, needed)` convention; thread-safe, does not block.
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

/// `dsv4_engine_state`: loading its weights. `dsv4_engine_create` returns only once loading
/// has finished, so no engine handle reports it; it is for hosts that report a state before
/// they have a handle.
pub const DSV4_STATE_LOADING: i32 = 0;
/// Accepting requests.
pub const DSV4_STATE_READY: i32 = 1;
/// A shutdown began (`dsv4_engine_shutdown`, drain, or an abort still ending requests):
/// submits are refused; the requests in flight are still running.
pub const DSV4_STATE_DRAINING: i32 = 2;
/// Shut down: every request has ended and the engine thread has stopped.
pub const DSV4_STATE_STOPPED: i32 = 3;
/// The engine thread failed: every request got an ERROR event and every later call on the
/// handle fails with the same message; destroy the engine and create a new one.
pub const DSV4_STATE_FAILED: i32 = 4;

/// Where the engine stands: `*state` gets a `DSV4_STATE_*` and `reason` a sentence for a health
/// endpoint or a log (e.g. `ready: 2 requests in flight`, `shutting down (drain): 3 requests
/// still running`, `the engine thread failed: <its error>`). The state is checked in this
/// order: FAILED, STOPPED, DRAINING, READY (never LOADING: a handle exists only once loaded).
///
/// `reason` follows the `(buf, cap, needed)` convention, with one addition: `reason = NULL,
/// cap = 0, needed = NULL` asks for the state alone. `*state` is written whenever `engine` and
/// `state` are valid, also when the reason does not fit (`DSV4_ERR_BUFFER_TOO_SMALL`). Works on
/// a stopped or failed engine (that is when it matters). Thread-safe, never blocks, may be
/// called from a callback. NULL `engine` or `state`: `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle; `state` is valid for one `int32_t`; `reason` is NULL or valid for
/// `cap` bytes; `needed` is NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_engine_state(
    engine: *const dsv4_engine,
    state: *mut i32,
    reason: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        if state.is_null() {
            return Err(Error::invalid_argument(
                "state is NULL: pass the address of an int32_t to receive a DSV4_STATE_*",
            ));
        }
        let (s, text) = engine.state();
        // SAFETY: non-NULL and valid for one write per the contract.
        unsafe { state.write(s.code()) };
        if reason.is_null() && cap == 0 && needed.is_null() {
            return Ok(());
        }
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, reason, cap, needed) }
    })
}

/// Writes the params this engine runs with, as JSON: every default filled in, every size in
/// bytes (what `dsv4_params_validate` returns for the document it was created from). Feeding it
/// back to `dsv4_params_validate` or `dsv4_engine_create` gives the same params. `(buf, cap,
/// needed)` convention; thread-safe, never blocks.
///
/// # Safety
/// `engine` is a live handle; `buf` is NULL or valid for `cap` bytes; `needed` is NULL or valid
/// for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_params_resolved(
    engine: *const dsv4_engine,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        engine_text(engine, buf, cap, needed, |e| {
            Ok(serde_json::to_string_pretty(&e.params().to_json_value()).unwrap_or_default())
        })
    }
}

#[cfg(test)]
mod tests {
    /// The engine numbers its states as the header does (`EngineState::code`, also what the
    /// Prometheus exposition's dsv4_engine_state reports).
    #[test]
    fn engine_state_codes_are_the_header_constants() {
        use crate::engine::EngineState;
        for (s, code) in [
            (EngineState::Loading, DSV4_STATE_LOADING),
            (EngineState::Ready, DSV4_STATE_READY),
            (EngineState::Draining, DSV4_STATE_DRAINING),
            (EngineState::Stopped, DSV4_STATE_STOPPED),
            (EngineState::Failed, DSV4_STATE_FAILED),
        ] {
            assert_eq!(s.code(), code, "{s:?}");
        }
    }

    use super::*;
    use crate::ffi::status::*;
    use std::ffi::CStr;

    fn create() -> *mut dsv4_engine {
        let params = format!(
            "{{\"model_path\": \"{}/tests/fixtures/flash-like/hf-f32\", \"threads\": 1, \
             \"kv\": {{\"device_memory_bytes\": \"32MiB\", \"max_running_requests\": 4, \
             \"page_size\": 128}}}}\0",
            env!("CARGO_MANIFEST_DIR")
        );
        let mut engine = std::ptr::null_mut();
        // SAFETY: a NUL-terminated string and a live out pointer.
        let status = unsafe { dsv4_engine_create(params.as_ptr().cast(), &mut engine) };
        assert_eq!(status, DSV4_OK);
        engine
    }

    /// The state and reason through the C entry point.
    fn state_of(engine: *const dsv4_engine) -> (i32, String) {
        let mut state = -1;
        let mut buf = [0 as c_char; 512];
        let mut needed = 0;
        // SAFETY: live engine and locals of the stated sizes.
        let status =
            unsafe { dsv4_engine_state(engine, &mut state, buf.as_mut_ptr(), 512, &mut needed) };
        assert_eq!(status, DSV4_OK);
        // SAFETY: the call wrote a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap();
        assert_eq!(needed, text.len() + 1);
        (state, text.to_string())
    }

    #[test]
    fn engine_state_follows_the_buffer_convention_and_reports_a_failed_engine() {
        let engine = create();
        assert_eq!(
            state_of(engine),
            (DSV4_STATE_READY, "ready: 0 requests in flight".into())
        );
        let mut state = -1;
        let mut needed = 0;
        // SAFETY (all calls): live engine, live locals; NULLs where the contract allows them.
        unsafe {
            // The state alone: no reason buffer, no needed.
            let s = dsv4_engine_state(
                engine,
                &mut state,
                std::ptr::null_mut(),
                0,
                std::ptr::null_mut(),
            );
            assert_eq!((s, state), (DSV4_OK, DSV4_STATE_READY));
            // A small buffer: BUFFER_TOO_SMALL, untouched, the state still written.
            state = -1;
            let mut small = [b'x' as c_char; 4];
            let s = dsv4_engine_state(engine, &mut state, small.as_mut_ptr(), 4, &mut needed);
            assert_eq!(s, DSV4_ERR_BUFFER_TOO_SMALL);
            assert_eq!(state, DSV4_STATE_READY);
            assert_eq!(needed, "ready: 0 requests in flight".len() + 1);
            assert!(small.iter().all(|&c| c == b'x' as c_char));
            // A buffer without a capacity is a mistake, as everywhere else.
            let s = dsv4_engine_state(engine, &mut state, std::ptr::null_mut(), 8, &mut needed);
            assert_eq!(s, DSV4_ERR_INVALID_ARGUMENT);
            let s = dsv4_engine_state(
                engine,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
                &mut needed,
            );
            assert_eq!(s, DSV4_ERR_INVALID_ARGUMENT);
            let s = dsv4_engine_state(
                std::ptr::null(),
                &mut state,
                std::ptr::null_mut(),
                0,
                &mut needed,
            );
            assert_eq!(s, DSV4_ERR_INVALID_ARGUMENT);
        }
        // The engine thread dies: FAILED, with its error in the reason.
        // SAFETY: a live handle from dsv4_engine_create.
        unsafe { &*engine }
            .inner
            .inject_panic("injected for the test");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let (state, reason) = loop {
            let got = state_of(engine);
            if got.0 == DSV4_STATE_FAILED || std::time::Instant::now() > deadline {
                break got;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(state, DSV4_STATE_FAILED, "{reason}");
        assert!(
            reason.starts_with(
                "the engine thread failed: internal error: the engine thread \
                                panicked (injected for the test)"
            ),
            "{reason}"
        );
        assert!(
            reason.contains("destroy it and create a new one"),
            "{reason}"
        );
        // SAFETY: destroyed once.
        unsafe { dsv4_engine_destroy(engine) };
    }

    #[test]
    fn params_resolved_round_trips_through_the_validator() {
        let engine = create();
        let mut needed = 0;
        // SAFETY (all calls): live engine and buffers of the stated sizes.
        unsafe {
            let s = dsv4_params_resolved(engine, std::ptr::null_mut(), 0, &mut needed);
            assert_eq!(s, DSV4_OK);
            let mut buf = vec![0 as c_char; needed];
            let s = dsv4_params_resolved(engine, buf.as_mut_ptr(), needed, std::ptr::null_mut());
            assert_eq!(s, DSV4_OK);
            let text = CStr::from_ptr(buf.as_ptr()).to_str().unwrap();
            let parsed = Params::from_json(text).unwrap();
            assert_eq!(&parsed, (*engine).inner.params());
            assert_eq!(parsed.kv.max_running_requests, 4);
            let s = dsv4_params_resolved(engine, buf.as_mut_ptr(), needed - 1, &mut needed);
            assert_eq!(s, DSV4_ERR_BUFFER_TOO_SMALL);
            let s = dsv4_params_resolved(std::ptr::null(), buf.as_mut_ptr(), needed, &mut needed);
            assert_eq!(s, DSV4_ERR_INVALID_ARGUMENT);
            dsv4_engine_destroy(engine);
        }
    }
}
