//! Requests and events across the ABI: submit, poll, callbacks, abort and shutdown.

use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Arc;
use std::time::Duration;

use super::boundary::guard;
use super::engine::{dsv4_engine, engine_ref};
use super::status::{dsv4_status, status_of, DSV4_OK};
use super::versioned::{assert_offsets, read_in, write_out, Layout, PlainData};
use crate::engine::{Event, EventCallback, EventKind, FinishReason, RequestSpec, ShutdownMode};
use crate::engine::{SamplingParams, MAX_STOP_SEQUENCE_TOKENS};
use crate::error::{Error, Result};

/// A TOKEN event: one generated token (`token`, and `logprob` when asked for).
pub const DSV4_EVENT_TOKEN: i32 = 1;
/// The request ended normally; `finish_reason` says why. Terminal.
pub const DSV4_EVENT_FINISHED: i32 = 2;
/// The request ended with an error; `status` says which. Terminal.
pub const DSV4_EVENT_ERROR: i32 = 3;

/// Not finished (TOKEN and ERROR events).
pub const DSV4_FINISH_NONE: i32 = 0;
/// `max_new_tokens` generated, or the context limit reached.
pub const DSV4_FINISH_LENGTH: i32 = 1;
/// A stop token, the model's EOS (unless `ignore_eos`) or the last token of a stop sequence
/// was generated (it is the last TOKEN event).
pub const DSV4_FINISH_STOP: i32 = 2;
/// `dsv4_abort`, or an abort shutdown.
pub const DSV4_FINISH_ABORTED: i32 = 3;
/// `deadline_ms` or `admission.queue_timeout_ms` passed.
pub const DSV4_FINISH_TIMEOUT: i32 = 4;
/// Prefill role: the decode engine confirmed it received the request's KV and state; it
/// continues the request (its TOKEN events come from the decode engine).
pub const DSV4_FINISH_TRANSFERRED: i32 = 5;

const FINISH_NAMES: &[(i32, &str)] = &[
    (DSV4_FINISH_NONE, "none\0"),
    (DSV4_FINISH_LENGTH, "length\0"),
    (DSV4_FINISH_STOP, "stop\0"),
    (DSV4_FINISH_ABORTED, "aborted\0"),
    (DSV4_FINISH_TIMEOUT, "timeout\0"),
    (DSV4_FINISH_TRANSFERRED, "transferred\0"),
];

/// The name of a `DSV4_FINISH_*` value: `"none"`, `"length"`, `"stop"`, `"aborted"`,
/// `"timeout"`, `"transferred"` (the words OpenAI-style servers report), and `"unknown"` for
/// any other value (never NULL, like `dsv4_status_name`, so it can go straight to printf).
/// The string is static: never free it. Thread-safe.
#[no_mangle]
pub extern "C" fn dsv4_finish_reason_name(reason: i32) -> *const c_char {
    FINISH_NAMES
        .iter()
        .find(|(code, _)| *code == reason)
        .map_or("unknown\0", |(_, name)| name)
        .as_ptr()
        .cast()
}

/// Shutdown: every accepted request runs to its end.
pub const DSV4_SHUTDOWN_DRAIN: i32 = 0;
/// Shutdown: every accepted request ends now with FINISHED / ABORTED.
pub const DSV4_SHUTDOWN_ABORT: i32 = 1;

/// A generation request (version 1: 128 bytes, up to `logprobs`; version 2 appends `pd_room` and
/// `pd_peer`: 144 bytes; version 3 appends the stop sequences and `ignore_eos`: 176 bytes).
/// Initialise with `dsv4_request_init`, then set
/// fields. Fields are only appended in later versions; `struct_size` tells the library which
/// you have, and a field your version lacks takes its default (which is not always zero).
/// Every pointer is read during `dsv4_submit` only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_request {
    /// `sizeof(dsv4_request)` as compiled by the caller.
    pub struct_size: u32,
    /// Prompt token ids (required, at least one).
    pub prompt: *const i32,
    pub prompt_len: usize,
    /// Default 128; at least 1.
    pub max_new_tokens: u32,
    /// Extra stopping tokens; the model's EOS stops too unless `ignore_eos` is set.
    pub stop_tokens: *const i32,
    pub stop_tokens_len: usize,
    /// Default 1.0; 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: i32,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0 = off.
    pub min_p: f32,
    /// 0 = drawn from the engine's RNG; the same seed gives the same tokens.
    pub seed: u64,
    /// Added to the logits of these tokens before sampling.
    pub logit_bias_tokens: *const i32,
    pub logit_bias_values: *const f32,
    pub logit_bias_len: usize,
    /// Higher runs first among waiting requests; default 0.
    pub priority: i32,
    /// From submit, covering waiting and running; 0 = none.
    pub deadline_ms: u32,
    /// NUL-terminated; NULL = none. Requests share cached prefixes only with the same salt.
    pub cache_salt: *const c_char,
    /// Echoed in every event of the request.
    pub user_tag: u64,
    /// Non-zero: fill `dsv4_event.logprob`.
    pub logprobs: u8,
    /// PD roles (`role` = prefill or decode): the room the host's router gave this request on
    /// both engines; required and non-zero there, unique among one engine's live requests
    /// (a second live request with the same room is `DSV4_ERR_INVALID_ARGUMENT`). Must be 0 in
    /// the unified role. (Appended after version 1.)
    pub pd_room: u64,
    /// Decode role: the prefill engine's endpoint, NUL-terminated (`tcp://host:port`, what
    /// `dsv4_pd_endpoint` returned there); NULL elsewhere. (Appended after version 1.)
    pub pd_peer: *const c_char,
    /// Stop token sequences, flattened: the tokens of every sequence one after another
    /// (`stop_sequence_lens[0]` tokens of the first, then the second's, …). The request
    /// finishes with `DSV4_FINISH_STOP` once its generated tokens (never the prompt) end with
    /// one of them. Its tokens are emitted as TOKEN events as they arrive (the match is known
    /// only at its last token), so the matched sequence is part of the output, its last token
    /// the last TOKEN event; a host that hides stop text trims it. (Appended after version 2.)
    pub stop_sequences: *const i32,
    /// `stop_sequences_len` lengths, each at least 1; together at most 4096 tokens.
    /// (Appended after version 2.)
    pub stop_sequence_lens: *const usize,
    /// The number of stop sequences; 0 = none. (Appended after version 2.)
    pub stop_sequences_len: usize,
    /// Non-zero: the model's EOS tokens (`eos_token_ids` in `dsv4_model_info`) do not end the
    /// request; they are emitted like any other token. Stop tokens, stop sequences and
    /// `max_new_tokens` still end it. (Appended after version 2.)
    pub ignore_eos: u8,
}

/// One event (version 1: 88 bytes, up to `elapsed_us`). Fields are only appended in later
/// versions: read one appended after version 1 only if its offset is below `struct_size`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_event {
    /// Bytes of this struct the library filled (`sizeof(dsv4_event)` of version 1 or later).
    pub struct_size: u32,
    pub request_id: u64,
    pub user_tag: u64,
    /// `DSV4_EVENT_TOKEN`, `DSV4_EVENT_FINISHED` or `DSV4_EVENT_ERROR`.
    pub kind: i32,
    /// TOKEN events: the token id; otherwise −1.
    pub token: i32,
    /// TOKEN events with `logprobs` set: the token's log-probability under the model's
    /// distribution with the logit bias applied (before temperature and filters); otherwise 0.
    pub logprob: f32,
    /// `DSV4_FINISH_*`.
    pub finish_reason: i32,
    /// ERROR events: why (a `DSV4_ERR_*`); otherwise `DSV4_OK`.
    pub status: dsv4_status,
    pub prompt_tokens: u32,
    /// Prompt tokens reused from the device prefix cache (not recomputed).
    pub cached_tokens_device: u32,
    /// Prompt tokens loaded back from the host tier (HiCache).
    pub cached_tokens_host: u32,
    pub generated_tokens: u32,
    /// Submit → running.
    pub queue_us: u64,
    /// Submit → first token (0 before it).
    pub ttft_us: u64,
    /// Submit → this event.
    pub elapsed_us: u64,
    /// ERROR events: a NUL-terminated message naming the cause and the fix; NULL otherwise.
    /// Owned by the library: valid until the next `dsv4_poll` on the same thread (polling) or
    /// until the callback returns (push mode). Copy it to keep it. (Appended after version 1.)
    pub message: *const c_char,
}

/// Receives one event in push mode. Called on the engine thread, one event at a time, never
/// concurrently; `event` is valid during the call only. It must not block for long (the engine
/// waits). It may call `dsv4_submit`, `dsv4_abort` and the metrics functions; calls that wait
/// for the engine thread (`dsv4_score`, `dsv4_cache_stats`, `dsv4_cache_flush`,
/// `dsv4_set_event_callback`, `dsv4_engine_shutdown`) return `DSV4_ERR_INVALID_ARGUMENT` there.
#[allow(non_camel_case_types)]
pub type dsv4_event_fn =
    Option<unsafe extern "C" fn(event: *const dsv4_event, user_data: *mut c_void)>;

/// Releases `user_data` once the library no longer calls the callback it was registered with.
#[allow(non_camel_case_types)]
pub type dsv4_drop_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

// SAFETY: repr(C); integers, floats and raw pointers only.
unsafe impl PlainData for dsv4_request {}
// SAFETY: repr(C); integers and a raw pointer only.
unsafe impl PlainData for dsv4_event {}

/// `sizeof(dsv4_request)` of version 1, frozen: callers built against that header pass it.
const REQUEST_V1: usize = 128;
assert_offsets!(dsv4_request {
    struct_size: 0,
    prompt: 8,
    prompt_len: 16,
    max_new_tokens: 24,
    stop_tokens: 32,
    stop_tokens_len: 40,
    temperature: 48,
    top_k: 52,
    top_p: 56,
    min_p: 60,
    seed: 64,
    logit_bias_tokens: 72,
    logit_bias_values: 80,
    logit_bias_len: 88,
    priority: 96,
    deadline_ms: 100,
    cache_salt: 104,
    user_tag: 112,
    logprobs: 120,
});
// A field appended to dsv4_request starts at or after REQUEST_V1 (its offset asserted here),
// and `request_defaults` gives its default: callers of version 1 do not have it.
assert_offsets!(dsv4_request {
    pd_room: REQUEST_V1,
    pd_peer: 136,
});
/// `sizeof(dsv4_request)` of version 2 (up to `pd_peer`), frozen.
const REQUEST_V2: usize = 144;
assert_offsets!(dsv4_request {
    stop_sequences: REQUEST_V2,
    stop_sequence_lens: 152,
    stop_sequences_len: 160,
    ignore_eos: 168,
});
const _: () = assert!(std::mem::size_of::<dsv4_request>() == 176);
const REQUEST: Layout = Layout {
    name: "dsv4_request",
    v1: REQUEST_V1,
    max: 1024,
};

/// `sizeof(dsv4_event)` of version 1 (up to `elapsed_us`), frozen: callers built against that
/// header keep working; they are written this many bytes per event.
const EVENT_V1: usize = 88;
assert_offsets!(dsv4_event {
    struct_size: 0,
    request_id: 8,
    user_tag: 16,
    kind: 24,
    token: 28,
    logprob: 32,
    finish_reason: 36,
    status: 40,
    prompt_tokens: 44,
    cached_tokens_device: 48,
    cached_tokens_host: 52,
    generated_tokens: 56,
    queue_us: 64,
    ttft_us: 72,
    elapsed_us: 80,
});
// Appended after version 1: at or after its size, never in its tail.
assert_offsets!(dsv4_event { message: EVENT_V1 });
const EVENT_SIZE: usize = std::mem::size_of::<dsv4_event>();
/// `dsv4_poll`'s element size is at most 1024 bytes: far beyond any future dsv4_event, small
/// enough that an uninitialised `struct_size` is caught instead of used as a stride.
const EVENT: Layout = Layout {
    name: "dsv4_event",
    v1: EVENT_V1,
    max: 1024,
};

thread_local! {
    /// The messages of the events the last `dsv4_poll` on this thread returned.
    static POLLED_MESSAGES: std::cell::RefCell<Vec<CString>> = const {
        std::cell::RefCell::new(Vec::new())
    };
}

/// The C text of an event's message (interior NULs become spaces).
fn c_message(e: &Event) -> Option<CString> {
    e.message()
        .map(|m| CString::new(m.replace('\0', " ")).unwrap_or_default())
}

/// The C struct of one event: the one place an [`Event`] becomes a `dsv4_event`.
fn to_c(e: &Event, message: *const c_char) -> dsv4_event {
    let s = e.stats();
    dsv4_event {
        struct_size: EVENT_SIZE as u32,
        request_id: e.request_id(),
        user_tag: e.user_tag(),
        kind: match e.kind() {
            EventKind::Token => DSV4_EVENT_TOKEN,
            EventKind::Finished => DSV4_EVENT_FINISHED,
            EventKind::Error => DSV4_EVENT_ERROR,
        },
        // Token ids are below the vocabulary size, which the config caps far below i32::MAX.
        token: e.token_id().map_or(-1, |t| t as i32),
        logprob: e.logprob(),
        finish_reason: match e.finish_reason() {
            None => DSV4_FINISH_NONE,
            Some(FinishReason::Length) => DSV4_FINISH_LENGTH,
            Some(FinishReason::Stop) => DSV4_FINISH_STOP,
            Some(FinishReason::Aborted) => DSV4_FINISH_ABORTED,
            Some(FinishReason::Timeout) => DSV4_FINISH_TIMEOUT,
            Some(FinishReason::Transferred) => DSV4_FINISH_TRANSFERRED,
        },
        status: e.error_kind().map_or(DSV4_OK, status_of),
        prompt_tokens: s.prompt_tokens,
        cached_tokens_device: s.cached_tokens_device,
        cached_tokens_host: s.cached_tokens_host,
        generated_tokens: s.generated_tokens,
        queue_us: s.queue_us,
        ttft_us: s.ttft_us,
        elapsed_us: s.elapsed_us,
        message,
    }
}

/// The defaults of every field (`dsv4_request_init`'s; a field appended later gets its own
/// here, which callers of older versions then receive on submit).
fn request_defaults(struct_size: u32) -> dsv4_request {
    dsv4_request {
        struct_size,
        prompt: std::ptr::null(),
        prompt_len: 0,
        max_new_tokens: 128,
        stop_tokens: std::ptr::null(),
        stop_tokens_len: 0,
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        logit_bias_tokens: std::ptr::null(),
        logit_bias_values: std::ptr::null(),
        logit_bias_len: 0,
        priority: 0,
        deadline_ms: 0,
        cache_salt: std::ptr::null(),
        user_tag: 0,
        logprobs: 0,
        pd_room: 0,
        pd_peer: std::ptr::null(),
        stop_sequences: std::ptr::null(),
        stop_sequence_lens: std::ptr::null(),
        stop_sequences_len: 0,
        ignore_eos: 0,
    }
}

/// Fills `*request` with the defaults (max_new_tokens 128, temperature 1, top_p 1, everything
/// else off or empty) and sets its `struct_size` field to the `struct_size` argument. Pass
/// `sizeof(dsv4_request)`: at least version 1's size and at most 1024, else
/// `DSV4_ERR_INVALID_ARGUMENT`. Writes exactly
/// `struct_size` bytes: the fields this library knows, then zeros (fields of a newer header
/// than the library's, which `dsv4_submit` ignores).
///
/// # Safety
/// `request` is valid for `struct_size` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn dsv4_request_init(
    request: *mut dsv4_request,
    struct_size: usize,
) -> dsv4_status {
    guard(|| {
        if request.is_null() {
            return Err(Error::invalid_argument(
                "request is NULL: pass a dsv4_request to fill",
            ));
        }
        REQUEST.check("struct_size", struct_size, "pass sizeof(dsv4_request)")?;
        // SAFETY: `request` is valid for `struct_size` bytes of writes per the contract;
        // `write_out` writes at most that many, the zeros cover the rest of them.
        unsafe {
            let known = write_out(&request_defaults(struct_size as u32), request, struct_size);
            std::ptr::write_bytes(request.cast::<u8>().add(known), 0, struct_size - known);
            // The tail padding after `ignore_eos` is no field, and a Rust value's padding
            // bytes are unspecified: zero it, so that an older caller sees zeros in every byte
            // past its own struct that it does not know (tests/c/abi_v1_test.c checks).
            let pad = std::mem::offset_of!(dsv4_request, ignore_eos) + 1;
            if known > pad {
                std::ptr::write_bytes(request.cast::<u8>().add(pad), 0, known - pad);
            }
        }
        Ok(())
    })
}

/// # Safety
/// `ptr` is NULL (then `len` must be 0) or valid for `len` reads.
unsafe fn ids<'a>(ptr: *const i32, len: usize, what: &str) -> Result<&'a [i32]> {
    if len == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Error::invalid_argument(format!(
            "{what} is NULL but its length is {len}"
        )));
    }
    // SAFETY: non-NULL and valid for `len` reads per the contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

fn non_negative(v: &[i32], what: &str) -> Result<Vec<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| {
                Error::invalid_argument(format!("{what} token id {t} at index {i} is negative"))
            })
        })
        .collect()
}

/// The flattened stop sequences of `r`, split by their lengths. The total is checked against
/// the cap before it is read, so a garbage length cannot make this read far.
///
/// # Safety
/// `r.stop_sequence_lens` is valid for `stop_sequences_len` reads and `r.stop_sequences` for
/// their sum.
unsafe fn stop_sequences_of(r: &dsv4_request) -> Result<Vec<Vec<u32>>> {
    let n = r.stop_sequences_len;
    if n == 0 {
        return Ok(Vec::new());
    }
    if r.stop_sequence_lens.is_null() {
        return Err(Error::invalid_argument(format!(
            "stop_sequence_lens is NULL but stop_sequences_len is {n}: pass one length per \
             stop sequence"
        )));
    }
    if n > MAX_STOP_SEQUENCE_TOKENS {
        return Err(Error::invalid_argument(format!(
            "stop_sequences_len = {n}: at most {MAX_STOP_SEQUENCE_TOKENS} stop sequences (and \
             tokens) per request; keep fewer"
        )));
    }
    // SAFETY: non-NULL and valid for `n` reads per the contract.
    let lens = unsafe { std::slice::from_raw_parts(r.stop_sequence_lens, n) };
    let mut total = 0usize;
    for (i, &len) in lens.iter().enumerate() {
        if len == 0 {
            return Err(Error::invalid_argument(format!(
                "stop_sequence_lens[{i}] is 0: each stop sequence needs at least one token"
            )));
        }
        total = total.saturating_add(len);
    }
    if total > MAX_STOP_SEQUENCE_TOKENS {
        return Err(Error::invalid_argument(format!(
            "the stop sequences hold {total} tokens together, more than \
             {MAX_STOP_SEQUENCE_TOKENS}: keep fewer or shorter stop sequences"
        )));
    }
    // SAFETY: valid for the sum of the lengths per the contract.
    let flat = unsafe { ids(r.stop_sequences, total, "stop_sequences") }?;
    let flat = non_negative(flat, "stop sequence")?;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    for &len in lens {
        out.push(flat[at..at + len].to_vec());
        at += len;
    }
    Ok(out)
}

/// # Safety
/// `r`'s pointers honour their lengths.
unsafe fn spec_of(r: &dsv4_request) -> Result<RequestSpec> {
    // SAFETY: forwarded.
    let prompt = unsafe { ids(r.prompt, r.prompt_len, "prompt") }?;
    // SAFETY: forwarded.
    let stops = unsafe { ids(r.stop_tokens, r.stop_tokens_len, "stop_tokens") }?;
    // SAFETY: forwarded.
    let bias_tokens = unsafe { ids(r.logit_bias_tokens, r.logit_bias_len, "logit_bias_tokens") }?;
    let bias_values: &[f32] = if r.logit_bias_len == 0 {
        &[]
    } else if r.logit_bias_values.is_null() {
        return Err(Error::invalid_argument(
            "logit_bias_values is NULL but logit_bias_len is not 0",
        ));
    } else {
        // SAFETY: non-NULL and valid for `logit_bias_len` reads per the contract.
        unsafe { std::slice::from_raw_parts(r.logit_bias_values, r.logit_bias_len) }
    };
    let cache_salt = if r.cache_salt.is_null() {
        None
    } else {
        // SAFETY: a NUL-terminated string per the contract.
        let s = unsafe { CStr::from_ptr(r.cache_salt) };
        Some(
            s.to_str()
                .map_err(|_| Error::invalid_argument("cache_salt is not valid UTF-8"))?
                .to_owned(),
        )
    };
    let pd_peer = if r.pd_peer.is_null() {
        None
    } else {
        // SAFETY: a NUL-terminated string per the contract.
        let s = unsafe { CStr::from_ptr(r.pd_peer) };
        Some(
            s.to_str()
                .map_err(|_| Error::invalid_argument("pd_peer is not valid UTF-8"))?
                .to_owned(),
        )
    };
    // SAFETY: forwarded.
    let stop_sequences = unsafe { stop_sequences_of(r) }?;
    if r.top_k < 0 {
        return Err(Error::invalid_argument(format!(
            "top_k = {} must be ≥ 0 (0 = off)",
            r.top_k
        )));
    }
    Ok(RequestSpec {
        prompt: non_negative(prompt, "prompt")?,
        max_new_tokens: r.max_new_tokens,
        stop_tokens: non_negative(stops, "stop")?,
        stop_sequences,
        ignore_eos: r.ignore_eos != 0,
        sampling: SamplingParams {
            temperature: r.temperature,
            top_k: r.top_k as u32,
            top_p: r.top_p,
            min_p: r.min_p,
            logit_bias: non_negative(bias_tokens, "logit_bias")?
                .into_iter()
                .zip(bias_values.iter().copied())
                .collect(),
        },
        seed: r.seed,
        priority: r.priority,
        deadline_ms: r.deadline_ms,
        cache_salt,
        user_tag: r.user_tag,
        logprobs: r.logprobs != 0,
        pd_room: r.pd_room,
        pd_peer,
    })
}

/// Submits a request. Never blocks: it is accepted (`*request_id` set, events follow) or
/// refused at once with nothing allocated and no event: `DSV4_ERR_INVALID_ARGUMENT` (bad
/// fields, each named), `DSV4_ERR_CAPACITY` (longer than `kv.max_context_tokens` or than the
/// pools can ever hold), `DSV4_ERR_QUEUE_FULL` (`admission.max_queued_requests` or
/// `admission.max_queued_tokens`; the message names the limit and the current queue; on a PD
/// engine also `pd.max_rooms`), `DSV4_ERR_SHUTDOWN`. Everything the request points to is copied
/// before returning. Every accepted request gets exactly one terminal event (FINISHED or
/// ERROR). On a prefill engine that is FINISHED with `DSV4_FINISH_TRANSFERRED` once the decode
/// engine has the request (no TOKEN events); a failed room ends it on both engines with ERROR
/// `DSV4_ERR_KV_TRANSFER` or `DSV4_ERR_TIMEOUT` (docs/pd.md).
/// `request->struct_size` below version 1 or above 1024: `DSV4_ERR_INVALID_ARGUMENT`. Only
/// `struct_size` bytes are read; fields past them take their defaults, and bytes past the
/// fields this library knows (a newer header) are ignored.
///
/// # Safety
/// `engine` is a live handle; `request` points to an initialised request of
/// `request->struct_size` bytes whose pointers are valid for their lengths; `request_id` is
/// valid for one write.
#[no_mangle]
pub unsafe extern "C" fn dsv4_submit(
    engine: *const dsv4_engine,
    request: *const dsv4_request,
    request_id: *mut u64,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        if request.is_null() || request_id.is_null() {
            return Err(Error::invalid_argument(
                "request or request_id is NULL: pass a dsv4_request and a uint64_t to receive the id",
            ));
        }
        // SAFETY: non-NULL; its first field, struct_size, is readable per the contract (an
        // unaligned read: the library assumes nothing of the caller's alignment).
        let size = unsafe { std::ptr::addr_of!((*request).struct_size).read_unaligned() } as usize;
        REQUEST.check(
            "request->struct_size",
            size,
            "initialise the request with dsv4_request_init(&r, sizeof r)",
        )?;
        // SAFETY: readable for `size` bytes per the contract; `read_in` reads no more.
        let local = unsafe { read_in(request, size, request_defaults(size as u32)) };
        // SAFETY: the caller's pointers, copied by value, honour their lengths per the contract.
        let spec = unsafe { spec_of(&local) }?;
        let id = engine.submit(spec)?;
        // SAFETY: non-NULL and valid for one write per the contract.
        unsafe { request_id.write(id) };
        Ok(())
    })
}

/// Takes up to `cap` queued events into `events`, `*n_out` of them. Set `events[0].struct_size
/// = sizeof(dsv4_event)` before the call: it gives the array's element size (so callers built
/// against an older header keep working: each element gets at most that many bytes, and its
/// `struct_size` says how many were written: the smaller of yours and the library's); a size
/// below version 1 or above 1024 is `DSV4_ERR_INVALID_ARGUMENT`. Bytes of an element past what
/// the library writes are left untouched. `timeout_ms`: −1 waits for an event (or until the
/// engine has stopped and every event is taken, or a callback is set), 0 never blocks, > 0
/// waits at most that long; a timeout is `DSV4_OK` with `*n_out == 0`. While an event
/// callback is set: `DSV4_ERR_UNSUPPORTED`. `cap == 0` or NULL pointers:
/// `DSV4_ERR_INVALID_ARGUMENT`. Once the engine has stopped (shut down or failed) and every
/// event is taken, every call returns at once with `*n_out == 0`: a poll loop ends when it
/// reads `DSV4_STATE_STOPPED` or `DSV4_STATE_FAILED` from `dsv4_engine_state` (set once every
/// event is queued, so one more poll after it takes what is left) rather than spin.
/// Thread-safe: concurrent pollers each get different events. Events' `message` strings stay
/// valid until the next `dsv4_poll` on the same thread.
///
/// Unpolled events are bounded by `admission.max_unpolled_events`: at that many the engine
/// pauses every request whose events wait (no token is lost, deadlines still apply) and
/// resumes them as the host polls.
///
/// # Safety
/// `engine` is a live handle; `events` is valid for `cap` elements of `events[0].struct_size`
/// bytes; `n_out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn dsv4_poll(
    engine: *const dsv4_engine,
    events: *mut dsv4_event,
    cap: usize,
    n_out: *mut usize,
    timeout_ms: i32,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        if events.is_null() || n_out.is_null() {
            return Err(Error::invalid_argument(
                "events or n_out is NULL: pass an array of dsv4_event and a size_t",
            ));
        }
        // SAFETY: non-NULL and valid for one write.
        unsafe { n_out.write(0) };
        if cap == 0 {
            return Err(Error::invalid_argument(
                "cap is 0: pass room for at least one event",
            ));
        }
        // SAFETY: non-NULL; the first element's struct_size is readable per the contract.
        let stride = unsafe { std::ptr::addr_of!((*events).struct_size).read_unaligned() } as usize;
        EVENT.check(
            "events[0].struct_size",
            stride,
            "set it to sizeof(dsv4_event) before each call",
        )?;
        let timeout = match timeout_ms {
            t if t < 0 => None,
            t => Some(Duration::from_millis(t as u64)),
        };
        let got = engine.poll(cap, timeout)?;
        // The caller's elements may be older (shorter) than ours: write its part only.
        let written = stride.min(EVENT_SIZE);
        POLLED_MESSAGES.with(|kept| {
            let mut kept = kept.borrow_mut();
            kept.clear();
            for (i, e) in got.iter().enumerate() {
                let message = match c_message(e) {
                    Some(m) => {
                        kept.push(m);
                        kept.last().map_or(std::ptr::null(), |m| m.as_ptr())
                    }
                    None => std::ptr::null(),
                };
                let mut c = to_c(e, message);
                c.struct_size = written as u32;
                // SAFETY: `i < cap` elements of `stride` bytes each are writable per the
                // contract; `write_out` writes at most `stride` bytes of the i-th; the source
                // is a live local.
                unsafe {
                    let at = events.cast::<u8>().add(i * stride).cast::<dsv4_event>();
                    write_out(&c, at, stride);
                }
            }
        });
        // SAFETY: as above.
        unsafe { n_out.write(got.len()) };
        Ok(())
    })
}

struct CCallback {
    f: unsafe extern "C" fn(*const dsv4_event, *mut c_void),
    user_data: *mut c_void,
    on_drop: dsv4_drop_fn,
}

// SAFETY: the host registers `user_data` for use from the engine thread (documented on
// dsv4_set_event_callback); the library only passes it back to the host's own functions.
unsafe impl Send for CCallback {}
// SAFETY: as above; calls are never concurrent (one engine thread).
unsafe impl Sync for CCallback {}

impl EventCallback for CCallback {
    fn deliver(&self, event: &Event) {
        let message = c_message(event);
        let e = to_c(
            event,
            message.as_ref().map_or(std::ptr::null(), |m| m.as_ptr()),
        );
        // SAFETY: the host's function, called as registered; `e` lives for the call.
        unsafe { (self.f)(&e, self.user_data) };
    }
}

impl Drop for CCallback {
    fn drop(&mut self) {
        if let Some(d) = self.on_drop {
            // SAFETY: the host's release function for its own `user_data`, called once.
            unsafe { d(self.user_data) };
        }
    }
}

/// Push mode: every event goes to `callback(event, user_data)` on the engine thread, one at a
/// time, never concurrently; events queued before are delivered to it first. A NULL `callback`
/// returns to polling. While a callback is set, `dsv4_poll` returns `DSV4_ERR_UNSUPPORTED`.
/// When the callback is replaced, cleared or the engine destroyed, `on_drop(user_data)` (if not
/// NULL) is called once the library no longer uses it. Blocks until the engine thread has
/// switched; a `dsv4_poll` waiting meanwhile returns `DSV4_ERR_UNSUPPORTED`. From a callback
/// (a dsv4 thread): `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle; `callback` and `on_drop` are NULL or valid functions that may be
/// called from another thread with `user_data`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_set_event_callback(
    engine: *const dsv4_engine,
    callback: dsv4_event_fn,
    user_data: *mut c_void,
    on_drop: dsv4_drop_fn,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        let cb: Option<Arc<dyn EventCallback>> = callback.map(|f| {
            Arc::new(CCallback {
                f,
                user_data,
                on_drop,
            }) as Arc<dyn EventCallback>
        });
        if cb.is_none() {
            if let Some(d) = on_drop {
                // Nothing to register: hand user_data straight back.
                // SAFETY: the host's release function for its own data.
                unsafe { d(user_data) };
            }
        }
        engine.set_callback(cb)
    })
}

/// Ends a request: it gets FINISHED / ABORTED (its pages go back to the pools). Never blocks,
/// also from a callback and however many aborts are pending.
/// `DSV4_ERR_NOT_FOUND` for an unknown id or one that already had its terminal event.
///
/// # Safety
/// `engine` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn dsv4_abort(engine: *const dsv4_engine, request_id: u64) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        engine.abort(request_id)
    })
}

/// Stops intake (later `dsv4_submit` → `DSV4_ERR_SHUTDOWN`) and ends the requests in flight:
/// `DSV4_SHUTDOWN_DRAIN` lets every accepted request run to its end, `DSV4_SHUTDOWN_ABORT` ends
/// them now with FINISHED / ABORTED. Their terminal events stay pollable until destroy. Waits
/// for the engine thread to finish: `timeout_ms` −1 as long as it takes, ≥ 0 at most that long
/// (`DSV4_ERR_TIMEOUT` if still draining; the shutdown continues). Calling it again is allowed
/// (an abort overrides a drain). From a callback (a dsv4 thread): `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle.
#[no_mangle]
pub unsafe extern "C" fn dsv4_engine_shutdown(
    engine: *const dsv4_engine,
    mode: i32,
    timeout_ms: i32,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        let mode = match mode {
            DSV4_SHUTDOWN_DRAIN => ShutdownMode::Drain,
            DSV4_SHUTDOWN_ABORT => ShutdownMode::Abort,
            other => {
                return Err(Error::invalid_argument(format!(
                    "mode = {other}: use DSV4_SHUTDOWN_DRAIN (0) or DSV4_SHUTDOWN_ABORT (1)"
                )))
            }
        };
        let timeout = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        engine.shutdown(mode, timeout)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(reason: i32) -> &'static str {
        // SAFETY: the function returns a static NUL-terminated string, never NULL.
        unsafe { CStr::from_ptr(dsv4_finish_reason_name(reason)) }
            .to_str()
            .unwrap()
    }

    #[test]
    fn every_finish_reason_has_its_name_and_others_are_unknown() {
        assert_eq!(name(DSV4_FINISH_NONE), "none");
        assert_eq!(name(DSV4_FINISH_LENGTH), "length");
        assert_eq!(name(DSV4_FINISH_STOP), "stop");
        assert_eq!(name(DSV4_FINISH_ABORTED), "aborted");
        assert_eq!(name(DSV4_FINISH_TIMEOUT), "timeout");
        assert_eq!(name(DSV4_FINISH_TRANSFERRED), "transferred");
        for other in [-1, 6, 100, i32::MIN, i32::MAX] {
            assert_eq!(name(other), "unknown");
        }
        // The C names agree with the Rust ones for every reason an event can carry.
        for r in [
            FinishReason::Length,
            FinishReason::Stop,
            FinishReason::Aborted,
            FinishReason::Timeout,
            FinishReason::Transferred,
        ] {
            let e = Event::finished(
                crate::engine::Origin {
                    request_id: 1,
                    user_tag: 0,
                },
                r,
                Default::default(),
            );
            assert_eq!(name(to_c(&e, std::ptr::null()).finish_reason), r.name());
        }
    }

    #[test]
    fn flattened_stop_sequences_are_split_by_their_lengths() {
        let flat = [7, 8, 9, 10, 11, 12];
        let lens = [1usize, 2, 3];
        let mut r = request_defaults(std::mem::size_of::<dsv4_request>() as u32);
        r.stop_sequences = flat.as_ptr();
        r.stop_sequence_lens = lens.as_ptr();
        r.stop_sequences_len = 3;
        // SAFETY (all calls): the pointers are to live locals of the stated lengths.
        unsafe {
            assert_eq!(
                stop_sequences_of(&r).unwrap(),
                vec![vec![7], vec![8, 9], vec![10, 11, 12]]
            );
            let zero = [1usize, 0];
            r.stop_sequence_lens = zero.as_ptr();
            r.stop_sequences_len = 2;
            let e = stop_sequences_of(&r).unwrap_err();
            assert!(e.message().contains("stop_sequence_lens[1] is 0"), "{e}");
            r.stop_sequence_lens = std::ptr::null();
            let e = stop_sequences_of(&r).unwrap_err();
            assert!(e.message().contains("stop_sequence_lens is NULL"), "{e}");
            // A huge length is refused before anything is read past the arrays.
            let huge = [usize::MAX, 1];
            r.stop_sequence_lens = huge.as_ptr();
            let e = stop_sequences_of(&r).unwrap_err();
            assert!(e.message().contains("keep fewer or shorter"), "{e}");
            let neg = [3, -4];
            let one = [2usize];
            r.stop_sequences = neg.as_ptr();
            r.stop_sequence_lens = one.as_ptr();
            r.stop_sequences_len = 1;
            let e = stop_sequences_of(&r).unwrap_err();
            assert!(
                e.message().contains("token id -4 at index 1 is negative"),
                "{e}"
            );
            r.stop_sequences = std::ptr::null();
            let e = stop_sequences_of(&r).unwrap_err();
            assert!(e.message().contains("stop_sequences is NULL"), "{e}");
        }
        // Defaults: none, EOS honoured; an old caller's request gets them.
        let d = request_defaults(REQUEST_V2 as u32);
        assert_eq!((d.stop_sequences_len, d.ignore_eos), (0, 0));
    }
}
