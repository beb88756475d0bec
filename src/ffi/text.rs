//! Text across the ABI: tokenize, detokenize, a streaming detokenizer handle and the chat
//! template. All of it runs on the caller's thread against the tokenizer the engine loaded at
//! creation: no call here waits on the engine thread or on a request.

use std::ffi::c_char;

use super::boundary::{c_bytes, guard, write_text};
use super::engine::{dsv4_engine, engine_ref};
use super::status::dsv4_status;
use crate::error::{Error, ErrorKind, Result};
use crate::tokenizer::Detokenizer;

fn utf8<'a>(bytes: &'a [u8], name: &str) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        Error::invalid_argument(format!("{name} is not valid UTF-8 ({e}): pass UTF-8 text"))
    })
}

/// Tokenizes the NUL-terminated UTF-8 `text` with the checkpoint's `tokenizer.json`, as Hugging
/// Face `tokenizers`' `encode(text, add_special_tokens)` does: `add_special` nonzero adds what
/// the tokenizer's post-processor adds (DeepSeek: the BOS token); special-token text in `text`
/// (e.g. `<｜User｜>`) becomes its id either way.
///
/// `*n` receives the number of ids; they are written to `ids` when `cap >= *n`. `ids = NULL,
/// cap = 0` asks for the count only; a `cap` that is too small writes no ids and returns
/// `DSV4_ERR_BUFFER_TOO_SMALL`. A checkpoint without `tokenizer.json` (or with one that did not
/// load): `DSV4_ERR_UNSUPPORTED`, the message says why (pass token ids instead). NULL `engine`,
/// `text` or `n`, or text that is not UTF-8: `DSV4_ERR_INVALID_ARGUMENT`. Thread-safe; never
/// waits on the engine thread.
///
/// # Safety
/// `engine` is a live handle; `text` is NUL-terminated; `ids` is NULL or valid for `cap`
/// `int32_t` writes; `n` is valid for one `size_t` write.
#[no_mangle]
pub unsafe extern "C" fn dsv4_tokenize(
    engine: *const dsv4_engine,
    text: *const c_char,
    add_special: i32,
    ids: *mut i32,
    cap: usize,
    n: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        // SAFETY: forwarded from the caller's contract.
        let text = utf8(unsafe { c_bytes(text, "text") }?, "text")?;
        if n.is_null() {
            return Err(Error::invalid_argument(
                "n is NULL: pass the address of a size_t to receive the number of ids",
            ));
        }
        let out = engine.text().tokenize(text, add_special != 0)?;
        // SAFETY: non-NULL and valid for one write per the contract.
        unsafe { n.write(out.len()) };
        if ids.is_null() {
            return match cap {
                0 => Ok(()),
                cap => Err(Error::invalid_argument(format!(
                    "ids is NULL but cap is {cap}: pass an array of cap int32_t, or cap = 0 to \
                     ask for the count"
                ))),
            };
        }
        if cap < out.len() {
            return Err(Error::new(
                ErrorKind::BufferTooSmall,
                format!(
                    "the text is {} ids but cap is {cap}: call again with an array of *n int32_t",
                    out.len()
                ),
            ));
        }
        // Ids are below the vocabulary size, which loading checked fits in i32: exact cast.
        let out: Vec<i32> = out.iter().map(|&id| id as i32).collect();
        // SAFETY: `ids` is valid for `cap >= out.len()` writes; `out` is our own vector.
        unsafe { std::ptr::copy_nonoverlapping(out.as_ptr(), ids, out.len()) };
        Ok(())
    })
}

/// Writes the text of `n` token ids (special tokens included, as `tokenizers`'
/// `decode(ids, skip_special_tokens=False)`) with the `(buf, cap, needed)` convention. Bytes
/// that do not form valid UTF-8 (ids ending inside a character) become U+FFFD. `ids` may be
/// NULL when `n` is 0. An id outside the vocabulary: `DSV4_ERR_INVALID_ARGUMENT`. No
/// `tokenizer.json`: `DSV4_ERR_UNSUPPORTED`. Thread-safe; never waits on the engine thread.
///
/// # Safety
/// `engine` is a live handle; `ids` is valid for `n` reads (or NULL with `n = 0`); `buf` is NULL
/// or valid for `cap` bytes; `needed` is NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_detokenize(
    engine: *const dsv4_engine,
    ids: *const i32,
    n: usize,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        let ids: &[i32] = match (ids.is_null(), n) {
            (_, 0) => &[],
            (true, n) => {
                return Err(Error::invalid_argument(format!(
                    "ids is NULL but n is {n}: pass an array of n token ids"
                )))
            }
            // SAFETY: non-NULL and valid for `n` reads per the contract.
            (false, n) => unsafe { std::slice::from_raw_parts(ids, n) },
        };
        let text = engine.text().detokenize(ids)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// Renders `tokenizer_config.json`'s `chat_template` for `messages_json` (a JSON array of
/// messages, e.g. `[{"role": "user", "content": "Hi"}]`) as `transformers`'
/// `apply_chat_template(messages, tokenize=False, add_generation_prompt=...)` does, with the
/// config's special tokens (`bos_token`, `eos_token`, ...) in the context. `add_generation_prompt`
/// nonzero appends the assistant turn's opening. The result is text: tokenize it with
/// `add_special = 0` (the template already wrote BOS). `(buf, cap, needed)` convention.
///
/// No `tokenizer_config.json` or no `chat_template` in it: `DSV4_ERR_UNSUPPORTED`. Messages
/// that are not a JSON array, or that the template refuses (its `raise_exception`, e.g. an
/// unknown role; the message is the template's): `DSV4_ERR_INVALID_ARGUMENT`. Thread-safe;
/// never waits on the engine thread.
///
/// # Safety
/// `engine` is a live handle; `messages_json` is NUL-terminated; `buf` is NULL or valid for
/// `cap` bytes; `needed` is NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_chat_apply(
    engine: *const dsv4_engine,
    messages_json: *const c_char,
    add_generation_prompt: i32,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        // SAFETY: forwarded from the caller's contract.
        let messages = utf8(
            unsafe { c_bytes(messages_json, "messages_json") }?,
            "messages_json",
        )?;
        let text = engine
            .text()
            .chat_apply(messages, add_generation_prompt != 0)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&text, buf, cap, needed) }
    })
}

/// A streaming detokenizer: feed it a request's output ids one at a time and it returns the
/// text each completes, holding back the bytes of a character split across ids, so the pieces
/// concatenate to exactly `dsv4_detokenize` of all the ids. Opaque; one per stream. Not
/// thread-safe: use a handle from one thread at a time. It keeps its own reference to the
/// tokenizer, so it may outlive the engine that made it.
#[allow(non_camel_case_types)]
pub struct dsv4_detokenizer {
    inner: Detokenizer,
}

/// Creates a streaming detokenizer over `engine`'s tokenizer; `*out` receives the handle (NULL
/// on failure). Free it with `dsv4_detokenizer_destroy`. No `tokenizer.json`:
/// `DSV4_ERR_UNSUPPORTED`. NULL `engine` or `out`: `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `engine` is a live handle; `out` is valid for one pointer write.
#[no_mangle]
pub unsafe extern "C" fn dsv4_detokenizer_create(
    engine: *const dsv4_engine,
    out: *mut *mut dsv4_detokenizer,
) -> dsv4_status {
    guard(|| {
        if out.is_null() {
            return Err(Error::invalid_argument(
                "out is NULL: pass the address of a dsv4_detokenizer * to receive the handle",
            ));
        }
        // SAFETY: non-NULL and valid for one write per the contract.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: forwarded from the caller's contract.
        let engine = unsafe { engine_ref(engine) }?;
        let inner = engine.text().detokenizer()?;
        // SAFETY: as above.
        unsafe { out.write(Box::into_raw(Box::new(dsv4_detokenizer { inner }))) };
        Ok(())
    })
}

/// Feeds one token id and writes the text it completes (often `""`: an id that ends inside a
/// character, and ids after it, wait for the rest) with the `(buf, cap, needed)` convention.
/// Only a call that writes the text advances the stream: asking for the size (`buf = NULL,
/// cap = 0`), a buffer that is too small (`DSV4_ERR_BUFFER_TOO_SMALL`) and an id outside the
/// vocabulary (`DSV4_ERR_INVALID_ARGUMENT`) leave the detokenizer unchanged, so call again with
/// the same id (and a buffer of `*needed` bytes). NULL `detokenizer`: `DSV4_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `detokenizer` is NULL or a live handle not used concurrently; `buf` is NULL or valid for
/// `cap` bytes; `needed` is NULL or valid for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn dsv4_detokenizer_feed(
    detokenizer: *mut dsv4_detokenizer,
    token: i32,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> dsv4_status {
    guard(|| {
        // SAFETY: NULL or a live handle used by this thread only, per the contract.
        let d = unsafe { detokenizer.as_mut() }.ok_or_else(|| {
            Error::invalid_argument(
                "detokenizer is NULL: pass a handle from dsv4_detokenizer_create",
            )
        })?;
        // Advance a copy and keep it only once the text is delivered, so a retry with a larger
        // buffer feeds the same id again without duplicating or losing text.
        let mut next = d.inner.clone();
        let piece = next.feed(token)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { write_text(&piece, buf, cap, needed) }?;
        if !buf.is_null() {
            d.inner = next;
        }
        Ok(())
    })
}

/// Frees a streaming detokenizer. NULL is ignored. Text still held back (an incomplete
/// character at the end of the stream) is dropped; `dsv4_detokenize` of all the ids shows it as
/// U+FFFD.
///
/// # Safety
/// `detokenizer` is NULL or a live handle from `dsv4_detokenizer_create`, not yet destroyed.
#[no_mangle]
pub unsafe extern "C" fn dsv4_detokenizer_destroy(detokenizer: *mut dsv4_detokenizer) {
    if detokenizer.is_null() {
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the handle came from Box::into_raw in dsv4_detokenizer_create, destroyed once.
        drop(unsafe { Box::from_raw(detokenizer) });
    }));
}
