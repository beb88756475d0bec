//! The panic boundary, the thread-local last error, and the argument and output conventions
//! every entry point shares (docs/architecture.md "C API rules").

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::status::{dsv4_status, status_of, DSV4_ERR_INTERNAL, DSV4_OK};
use crate::error::{Error, Result};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (interior NULs become spaces).
pub(crate) fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Runs an entry point's body: `Ok` → `DSV4_OK`; `Err` → its status, with the message kept as
/// the last error; a panic → `DSV4_ERR_INTERNAL`, never an unwind into C.
pub(crate) fn guard(body: impl FnOnce() -> Result<()>) -> dsv4_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => DSV4_OK,
        Ok(Err(error)) => {
            set_last_error(error.message());
            status_of(error.kind())
        }
        Err(payload) => {
            let message = format!(
                "internal error: {} (this is a dsv4 bug; please report it with this message)",
                panic_text(payload.as_ref())
            );
            log::error!("{message}");
            set_last_error(&message);
            DSV4_ERR_INTERNAL
        }
    }
}

fn panic_text(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-text payload".to_string()
    }
}

/// A required NUL-terminated string argument, as bytes (UTF-8 is checked by the caller, which
/// knows which status an invalid encoding deserves).
///
/// # Safety
/// `ptr` is NULL or points to a NUL-terminated string that outlives the call.
pub(crate) unsafe fn c_bytes<'a>(ptr: *const c_char, name: &str) -> Result<&'a [u8]> {
    if ptr.is_null() {
        return Err(Error::invalid_argument(format!(
            "{name} is NULL: pass a NUL-terminated string"
        )));
    }
    // SAFETY: non-NULL and NUL-terminated per this function's contract.
    Ok(unsafe { CStr::from_ptr(ptr) }.to_bytes())
}

/// Writes `text` with the `(buf, cap, needed)` convention: `*needed` (when non-NULL) gets the
/// size including the terminating NUL; `buf = NULL, cap = 0` only asks for that size; a buffer
/// that is too small is left untouched and gets `DSV4_ERR_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is NULL or valid for `cap` bytes of writes; `needed` is NULL or valid for one write.
pub(crate) unsafe fn write_text(
    text: &str,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> Result<()> {
    let size = text.len() + 1;
    if !needed.is_null() {
        // SAFETY: non-NULL and valid for a write per this function's contract.
        unsafe { needed.write(size) };
    }
    if buf.is_null() {
        return match (cap, needed.is_null()) {
            (0, false) => Ok(()),
            (0, true) => Err(Error::invalid_argument(
                "buf and needed are both NULL: pass needed to learn the size, or a buffer",
            )),
            (cap, _) => Err(Error::invalid_argument(format!(
                "buf is NULL but cap is {cap}: pass a buffer of cap bytes, or cap = 0 to ask \
                 for the size"
            ))),
        };
    }
    if cap < size {
        return Err(Error::new(
            crate::error::ErrorKind::BufferTooSmall,
            format!(
                "the output needs {size} bytes (including the terminating NUL) but cap is {cap}: \
                 call again with a buffer of *needed bytes"
            ),
        ));
    }
    // SAFETY: `buf` is valid for `cap >= size` bytes; the source is a live &str of size - 1
    // bytes, and the regions cannot overlap (one is ours, one the caller's).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), size - 1);
        buf.add(size - 1).write(0);
    }
    Ok(())
}

/// The message of the last failed dsv4 call on this thread; `""` if none has failed. Never NULL.
/// The string belongs to dsv4 and stays valid until the next failing call on the same thread;
/// copy it to keep it. Successful calls leave it unchanged.
#[no_mangle]
pub extern "C" fn dsv4_last_error() -> *const c_char {
    catch_unwind(|| LAST_ERROR.with(|slot| slot.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::status::*;

    fn last_error() -> String {
        // SAFETY: dsv4_last_error never returns NULL and the string lives until the next error.
        unsafe { CStr::from_ptr(dsv4_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn panics_become_internal_errors_with_a_message() {
        let status = guard(|| panic!("boom {}", 42));
        assert_eq!(status, DSV4_ERR_INTERNAL);
        assert!(last_error().contains("internal error: boom 42"));
        assert_eq!(guard(|| Ok(())), DSV4_OK);
        assert!(
            last_error().contains("boom 42"),
            "success keeps the last error"
        );
        assert_eq!(guard(|| Err(Error::config("bad"))), DSV4_ERR_CONFIG);
        assert_eq!(last_error(), "bad");
    }

    #[test]
    fn the_output_convention_reports_sizes_and_never_overflows() {
        let mut needed = 0usize;
        // SAFETY (all calls): pointers are to live locals of the stated sizes.
        unsafe {
            assert!(write_text("hello", std::ptr::null_mut(), 0, &mut needed).is_ok());
            assert_eq!(needed, 6);
            let mut small = [b'x' as c_char; 5];
            let err = write_text("hello", small.as_mut_ptr(), 5, &mut needed).unwrap_err();
            assert_eq!(status_of(err.kind()), DSV4_ERR_BUFFER_TOO_SMALL);
            assert!(small.iter().all(|&c| c == b'x' as c_char), "untouched");
            let mut exact = [0 as c_char; 6];
            write_text("hello", exact.as_mut_ptr(), 6, std::ptr::null_mut()).unwrap();
            assert_eq!(CStr::from_ptr(exact.as_ptr()).to_str().unwrap(), "hello");
            let err = write_text("x", std::ptr::null_mut(), 0, std::ptr::null_mut()).unwrap_err();
            assert_eq!(status_of(err.kind()), DSV4_ERR_INVALID_ARGUMENT);
            let err = write_text("x", std::ptr::null_mut(), 8, &mut needed).unwrap_err();
            assert_eq!(status_of(err.kind()), DSV4_ERR_INVALID_ARGUMENT);
        }
    }

    #[test]
    fn the_last_error_is_per_thread() {
        set_last_error("main thread");
        std::thread::spawn(|| assert_eq!(last_error(), ""))
            .join()
            .unwrap();
        assert_eq!(last_error(), "main thread");
    }
}
