//! The versioned structs across the ABI (`dsv4_request`, `dsv4_event`, `dsv4_metrics`): how a
//! caller's `struct_size` is checked, and the only copies that touch a caller's struct.
//!
//! The rules (the header's preamble states them for callers):
//! - Fields are only appended. Version 1's size of each struct is a frozen literal next to the
//!   struct, with compile-time asserts of every version-1 offset; a field appended later starts
//!   at or after the previous version's size (never in its tail padding, which an older
//!   caller's struct_size covers with garbage), asserted there too.
//! - `struct_size` must lie in `[version 1, Layout::max]`; anything else is an uninitialised
//!   field and is refused with `DSV4_ERR_INVALID_ARGUMENT` naming the field and the fix.
//! - Input ([`read_in`]): the library starts from the struct's defaults — which are not all
//!   zero — and overlays `min(struct_size, sizeof)` bytes of the caller's struct, so a field the
//!   caller's version lacks takes its default, and nothing past the caller's `struct_size` is
//!   read. Bytes past what the library knows (a newer caller) are ignored, whatever they hold:
//!   a newer field the library cannot honour is the caller's to avoid (it can compare
//!   `dsv4_version`), the wasmtime / llama.cpp convention.
//! - Output ([`write_out`]): at most `min(struct_size, sizeof)` bytes are written, and the
//!   written struct's `struct_size` says how many, so a caller reads a newer field only when its
//!   offset is below it.

use crate::error::{Error, Result};

/// A repr(C) struct every bit pattern of which is a valid value (integers, floats, raw
/// pointers, nested such structs), so bytes copied from a caller make a valid value.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs whose fields are all plain data as above (no
/// references, `bool`, enums or `NonNull`).
pub(super) unsafe trait PlainData: Copy {}

/// One versioned struct: its C name and the bounds of `struct_size`.
pub(super) struct Layout {
    /// The C type, e.g. `dsv4_request`.
    pub name: &'static str,
    /// `sizeof` of version 1 (frozen).
    pub v1: usize,
    /// The largest `struct_size` accepted: far beyond any future version, small enough that
    /// an uninitialised field is caught instead of trusted.
    pub max: usize,
}

impl Layout {
    /// Checks a caller's `struct_size`; `field` says where it came from (e.g.
    /// `request->struct_size`), `how` how to set it.
    pub fn check(&self, field: &str, size: usize, how: &str) -> Result<()> {
        let name = self.name;
        if size < self.v1 {
            return Err(Error::invalid_argument(format!(
                "{field} = {size} is smaller than version 1 of {name} ({} bytes): {how}",
                self.v1
            )));
        }
        if size > self.max {
            return Err(Error::invalid_argument(format!(
                "{field} = {size} is larger than any {name} (at most {} bytes); it looks \
                 uninitialised: {how}",
                self.max
            )));
        }
        Ok(())
    }
}

/// The caller's struct at `src` (of `size` bytes, already checked) over `defaults`: the first
/// `min(size, sizeof(T))` bytes come from the caller, the rest keep their defaults. Never reads
/// past `size` bytes; bytes past `sizeof(T)` are ignored.
///
/// # Safety
/// `src` is valid for `size` bytes of reads (any alignment).
pub(super) unsafe fn read_in<T: PlainData>(src: *const T, size: usize, defaults: T) -> T {
    let mut local = defaults;
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `src` is readable for `size >= n` bytes per the contract; `local` is a live local
    // of `size_of::<T>() >= n` bytes; they do not overlap; byte copies need no alignment, and
    // any bytes make a valid `T` (`PlainData`).
    unsafe {
        std::ptr::copy_nonoverlapping(src.cast::<u8>(), (&mut local as *mut T).cast::<u8>(), n)
    };
    local
}

/// Writes the first `min(size, sizeof(T))` bytes of `value` to `dst` and returns that count;
/// nothing at or past it is touched.
///
/// # Safety
/// `dst` is valid for `size` bytes of writes (any alignment) and does not overlap `value`.
pub(super) unsafe fn write_out<T: PlainData>(value: &T, dst: *mut T, size: usize) -> usize {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `dst` is writable for `size >= n` bytes per the contract; `value` is readable for
    // `size_of::<T>() >= n`; no overlap per the contract; byte copies need no alignment.
    unsafe { std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), dst.cast::<u8>(), n) };
    n
}

/// Asserts at compile time that each named field of `$t` sits at its version-1 offset.
macro_rules! assert_offsets {
    ($t:ty { $($field:ident: $offset:expr),* $(,)? }) => {
        const _: () = {
            $(assert!(
                std::mem::offset_of!($t, $field) == $offset,
                concat!(
                    stringify!($t), ".", stringify!($field),
                    " moved: fields of a released version never move (append new ones)"
                )
            );)*
        };
    };
}
pub(super) use assert_offsets;

#[cfg(test)]
mod tests {
    use super::*;

    /// A struct as version 2 of some header: `b` appended, defaulting to 7 (not zero).
    #[repr(C)]
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct V2 {
        struct_size: u32,
        a: u32,
        b: u64,
    }
    // SAFETY: repr(C), integers only.
    unsafe impl PlainData for V2 {}
    const V2_DEFAULTS: V2 = V2 {
        struct_size: 16,
        a: 1,
        b: 7,
    };

    #[test]
    fn an_older_caller_gets_the_defaults_of_the_fields_it_lacks() {
        // The caller has version 1 (8 bytes) followed by bytes that are not its own.
        let mut raw = [0xABu8; 16];
        raw[..4].copy_from_slice(&8u32.to_ne_bytes());
        raw[4..8].copy_from_slice(&5u32.to_ne_bytes());
        // SAFETY: `raw` is readable for 8 bytes.
        let got = unsafe { read_in(raw.as_ptr().cast::<V2>(), 8, V2_DEFAULTS) };
        assert_eq!(
            got,
            V2 {
                struct_size: 8,
                a: 5,
                b: 7
            }
        );
    }

    #[test]
    fn a_newer_caller_s_unknown_bytes_are_ignored() {
        let mut raw = [0xCDu8; 40];
        raw[..4].copy_from_slice(&40u32.to_ne_bytes());
        raw[4..8].copy_from_slice(&5u32.to_ne_bytes());
        raw[8..16].copy_from_slice(&9u64.to_ne_bytes());
        // SAFETY: `raw` is readable for 40 bytes.
        let got = unsafe { read_in(raw.as_ptr().cast::<V2>(), 40, V2_DEFAULTS) };
        assert_eq!((got.a, got.b), (5, 9));
    }

    #[test]
    fn output_stops_at_the_caller_s_size() {
        let mut raw = [0xEEu8; 24];
        let value = V2 {
            struct_size: 8,
            a: 3,
            b: 4,
        };
        // SAFETY: `raw` is writable for 8 bytes (and more).
        let n = unsafe { write_out(&value, raw.as_mut_ptr().cast::<V2>(), 8) };
        assert_eq!(n, 8);
        assert_eq!(&raw[4..8], &3u32.to_ne_bytes());
        assert!(raw[8..].iter().all(|&b| b == 0xEE), "wrote past 8 bytes");
        // A larger caller gets sizeof(V2) bytes, no more.
        let mut raw = [0xEEu8; 24];
        // SAFETY: `raw` is writable for 24 bytes.
        let n = unsafe { write_out(&value, raw.as_mut_ptr().cast::<V2>(), 24) };
        assert_eq!(n, 16);
        assert_eq!(&raw[8..16], &4u64.to_ne_bytes());
        assert!(raw[16..].iter().all(|&b| b == 0xEE), "wrote past sizeof");
    }

    #[test]
    fn sizes_outside_the_bounds_are_refused_naming_the_field_and_fix() {
        let l = Layout {
            name: "dsv4_thing",
            v1: 8,
            max: 64,
        };
        assert!(l.check("thing->struct_size", 8, "x").is_ok());
        assert!(l.check("thing->struct_size", 64, "x").is_ok());
        let small = l.check("thing->struct_size", 7, "set it to sizeof(dsv4_thing)");
        let msg = small.unwrap_err().message().to_string();
        assert!(
            msg.contains("thing->struct_size = 7 is smaller than version 1"),
            "{msg}"
        );
        assert!(msg.contains("set it to sizeof(dsv4_thing)"), "{msg}");
        let big = l.check(
            "thing->struct_size",
            0xdeadbeef,
            "set it to sizeof(dsv4_thing)",
        );
        let msg = big.unwrap_err().message().to_string();
        assert!(
            msg.contains("= 3735928559 is larger than any dsv4_thing"),
            "{msg}"
        );
        assert!(msg.contains("at most 64 bytes") && msg.contains("sizeof(dsv4_thing)"));
    }
}
