//! The library version; the header's `DSV4_VERSION_*` macros come from the same Cargo.toml.

use std::ffi::c_char;

/// The library's version, `"MAJOR.MINOR.PATCH"`, as built. Compare it with `DSV4_VERSION_STRING`
/// to detect a header/library mismatch. The string is static: never free it. Thread-safe.
#[no_mangle]
pub extern "C" fn dsv4_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
