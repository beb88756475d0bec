//! Status codes. The values are part of the ABI and never change.

use std::ffi::c_char;

use crate::error::ErrorKind;

/// Result of every dsv4 function that can fail: `DSV4_OK` (0) or a negative `DSV4_ERR_*` code.
/// On failure `dsv4_last_error()` says what went wrong and how to fix it.
#[allow(non_camel_case_types)]
pub type dsv4_status = i32;

/// Success.
pub const DSV4_OK: dsv4_status = 0;
/// A caller error: a NULL pointer, a bad size or id. Includes NULL arguments.
pub const DSV4_ERR_INVALID_ARGUMENT: dsv4_status = -1;
/// Invalid engine parameters, or parameters that contradict the model.
pub const DSV4_ERR_CONFIG: dsv4_status = -2;
/// A file is missing or unreadable (e.g. no config.json at `model_path`).
pub const DSV4_ERR_IO: dsv4_status = -3;
/// A checkpoint or config.json does not have the expected structure.
pub const DSV4_ERR_MODEL_FORMAT: dsv4_status = -4;
/// Not enough pages, slots or memory for the request.
pub const DSV4_ERR_CAPACITY: dsv4_status = -5;
/// Admission control refused the request (queue length or queued tokens).
pub const DSV4_ERR_QUEUE_FULL: dsv4_status = -6;
/// A deadline passed.
pub const DSV4_ERR_TIMEOUT: dsv4_status = -7;
/// The request was aborted.
pub const DSV4_ERR_ABORTED: dsv4_status = -8;
/// Moving KV state between prefill and decode engines failed.
pub const DSV4_ERR_KV_TRANSFER: dsv4_status = -9;
/// The output buffer is too small; `*needed` holds the size to retry with.
pub const DSV4_ERR_BUFFER_TOO_SMALL: dsv4_status = -10;
/// Valid, but not supported by this build or backend yet.
pub const DSV4_ERR_UNSUPPORTED: dsv4_status = -11;
/// The engine is shutting down or shut down.
pub const DSV4_ERR_SHUTDOWN: dsv4_status = -12;
/// The named object (request id, …) does not exist.
pub const DSV4_ERR_NOT_FOUND: dsv4_status = -13;
/// A bug in dsv4 (including a caught panic). Please report it with dsv4_last_error().
pub const DSV4_ERR_INTERNAL: dsv4_status = -99;

pub(crate) fn status_of(kind: ErrorKind) -> dsv4_status {
    match kind {
        ErrorKind::InvalidArgument => DSV4_ERR_INVALID_ARGUMENT,
        ErrorKind::Config => DSV4_ERR_CONFIG,
        ErrorKind::Io => DSV4_ERR_IO,
        ErrorKind::ModelFormat => DSV4_ERR_MODEL_FORMAT,
        ErrorKind::Capacity => DSV4_ERR_CAPACITY,
        ErrorKind::QueueFull => DSV4_ERR_QUEUE_FULL,
        ErrorKind::Timeout => DSV4_ERR_TIMEOUT,
        ErrorKind::Aborted => DSV4_ERR_ABORTED,
        ErrorKind::KvTransfer => DSV4_ERR_KV_TRANSFER,
        ErrorKind::BufferTooSmall => DSV4_ERR_BUFFER_TOO_SMALL,
        ErrorKind::Unsupported => DSV4_ERR_UNSUPPORTED,
        ErrorKind::Shutdown => DSV4_ERR_SHUTDOWN,
        ErrorKind::NotFound => DSV4_ERR_NOT_FOUND,
        ErrorKind::Internal => DSV4_ERR_INTERNAL,
    }
}

const NAMES: &[(dsv4_status, &str)] = &[
    (DSV4_OK, "DSV4_OK\0"),
    (DSV4_ERR_INVALID_ARGUMENT, "DSV4_ERR_INVALID_ARGUMENT\0"),
    (DSV4_ERR_CONFIG, "DSV4_ERR_CONFIG\0"),
    (DSV4_ERR_IO, "DSV4_ERR_IO\0"),
    (DSV4_ERR_MODEL_FORMAT, "DSV4_ERR_MODEL_FORMAT\0"),
    (DSV4_ERR_CAPACITY, "DSV4_ERR_CAPACITY\0"),
    (DSV4_ERR_QUEUE_FULL, "DSV4_ERR_QUEUE_FULL\0"),
    (DSV4_ERR_TIMEOUT, "DSV4_ERR_TIMEOUT\0"),
    (DSV4_ERR_ABORTED, "DSV4_ERR_ABORTED\0"),
    (DSV4_ERR_KV_TRANSFER, "DSV4_ERR_KV_TRANSFER\0"),
    (DSV4_ERR_BUFFER_TOO_SMALL, "DSV4_ERR_BUFFER_TOO_SMALL\0"),
    (DSV4_ERR_UNSUPPORTED, "DSV4_ERR_UNSUPPORTED\0"),
    (DSV4_ERR_SHUTDOWN, "DSV4_ERR_SHUTDOWN\0"),
    (DSV4_ERR_NOT_FOUND, "DSV4_ERR_NOT_FOUND\0"),
    (DSV4_ERR_INTERNAL, "DSV4_ERR_INTERNAL\0"),
];

/// The name of a status code, e.g. `"DSV4_ERR_CONFIG"`; `"DSV4_STATUS_UNKNOWN"` for values
/// dsv4 never returns. The string is static: never free it. Thread-safe.
#[no_mangle]
pub extern "C" fn dsv4_status_name(status: dsv4_status) -> *const c_char {
    NAMES
        .iter()
        .find(|(code, _)| *code == status)
        .map_or("DSV4_STATUS_UNKNOWN\0", |(_, name)| name)
        .as_ptr()
        .cast()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_distinct_named_status() {
        use ErrorKind::*;
        let kinds = [
            InvalidArgument,
            Config,
            Io,
            ModelFormat,
            Capacity,
            QueueFull,
            Timeout,
            Aborted,
            KvTransfer,
            BufferTooSmall,
            Unsupported,
            Shutdown,
            NotFound,
            Internal,
        ];
        let mut codes: Vec<dsv4_status> = kinds.iter().map(|&k| status_of(k)).collect();
        for code in &codes {
            assert!(NAMES.iter().any(|(c, _)| c == code));
        }
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), kinds.len());
        assert!(NAMES.iter().all(|(_, name)| name.ends_with('\0')));
    }
}
