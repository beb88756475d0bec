//! Forwards the crate's `log` records to a callback the host registers.

use std::cell::Cell;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Once, RwLock};

use log::{Level, LevelFilter, Log, Metadata, Record};

use super::boundary::guard;
use super::status::dsv4_status;
use crate::error::Error;

/// Logging is off.
pub const DSV4_LOG_OFF: i32 = 0;
/// Errors only.
pub const DSV4_LOG_ERROR: i32 = 1;
/// Errors and warnings.
pub const DSV4_LOG_WARN: i32 = 2;
/// Adds lifecycle information (engine start, plan, allocation times).
pub const DSV4_LOG_INFO: i32 = 3;
/// Adds per-step details.
pub const DSV4_LOG_DEBUG: i32 = 4;
/// Everything.
pub const DSV4_LOG_TRACE: i32 = 5;

/// Receives one log record: its level (`DSV4_LOG_ERROR` … `DSV4_LOG_TRACE`), the Rust module
/// that wrote it (e.g. `"dsv4::plan"`) and the message. Both strings are NUL-terminated and valid
/// only during the call.
#[allow(non_camel_case_types)]
pub type dsv4_log_fn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        level: i32,
        target: *const c_char,
        message: *const c_char,
    ),
>;

#[derive(Clone, Copy)]
struct Sink {
    callback: unsafe extern "C" fn(*mut c_void, i32, *const c_char, *const c_char),
    user_data: usize,
}

static SINK: RwLock<Option<Sink>> = RwLock::new(None);
static INSTALL: Once = Once::new();
static BRIDGE: Bridge = Bridge;

thread_local! {
    // A callback that calls back into dsv4 must not re-enter the bridge.
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

struct Bridge;

impl Log for Bridge {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) || IN_CALLBACK.with(Cell::get) {
            return;
        }
        let Ok(sink) = SINK.read() else { return };
        let Some(sink) = *sink else { return };
        let text = |s: String| CString::new(s.replace('\0', " ")).unwrap_or_default();
        let target = text(record.target().to_string());
        let message = text(record.args().to_string());
        let level = match record.level() {
            Level::Error => DSV4_LOG_ERROR,
            Level::Warn => DSV4_LOG_WARN,
            Level::Info => DSV4_LOG_INFO,
            Level::Debug => DSV4_LOG_DEBUG,
            Level::Trace => DSV4_LOG_TRACE,
        };
        IN_CALLBACK.with(|flag| flag.set(true));
        // SAFETY: the host registered this function for exactly this signature; the strings
        // live until the call returns; user_data is passed back unchanged.
        unsafe {
            (sink.callback)(
                sink.user_data as *mut c_void,
                level,
                target.as_ptr(),
                message.as_ptr(),
            )
        };
        IN_CALLBACK.with(|flag| flag.set(false));
    }

    fn flush(&self) {}
}

fn filter(level: i32) -> LevelFilter {
    match level {
        DSV4_LOG_ERROR => LevelFilter::Error,
        DSV4_LOG_WARN => LevelFilter::Warn,
        DSV4_LOG_INFO => LevelFilter::Info,
        DSV4_LOG_DEBUG => LevelFilter::Debug,
        DSV4_LOG_TRACE => LevelFilter::Trace,
        _ => LevelFilter::Off,
    }
}

/// Sends dsv4's log records up to `max_level` (`DSV4_LOG_OFF` … `DSV4_LOG_TRACE`) to `callback`
/// with `user_data`. A NULL `callback` or `DSV4_LOG_OFF` stops logging.
///
/// The callback is process-global and is called from any dsv4 thread (engine, copy, transfer
/// threads), possibly from several at once: it must be thread-safe, must not unwind or throw,
/// and should return quickly. Records a callback triggers by calling dsv4 are dropped. When this
/// function returns, the previous callback is no longer running or going to be called, so its
/// `user_data` may be freed; do not call it from inside a callback (it would deadlock).
///
/// Returns `DSV4_ERR_INVALID_ARGUMENT` for a level outside 0..5, and `DSV4_ERR_UNSUPPORTED` when
/// another logger already owns this copy of the Rust `log` facade (only possible when dsv4 is
/// linked into a Rust program as an rlib).
#[no_mangle]
pub extern "C" fn dsv4_set_log_callback(
    max_level: i32,
    callback: dsv4_log_fn,
    user_data: *mut c_void,
) -> dsv4_status {
    guard(|| {
        if !(DSV4_LOG_OFF..=DSV4_LOG_TRACE).contains(&max_level) {
            return Err(Error::invalid_argument(format!(
                "max_level = {max_level} is not a log level: use DSV4_LOG_OFF (0) … \
                 DSV4_LOG_TRACE (5)"
            )));
        }
        let mut installed = Ok(());
        INSTALL.call_once(|| installed = log::set_logger(&BRIDGE));
        let ours = std::ptr::addr_eq(log::logger() as *const dyn Log, &BRIDGE as *const Bridge);
        if installed.is_err() || !ours {
            return Err(Error::unsupported(
                "another logger is installed in this process's Rust `log` facade; dsv4 logs \
                 through it instead",
            ));
        }
        let sink = callback.map(|callback| Sink {
            callback,
            user_data: user_data as usize,
        });
        // Taking the write lock waits for callbacks in flight on other threads to finish.
        *SINK.write().unwrap_or_else(|e| e.into_inner()) = sink;
        log::set_max_level(if sink.is_some() {
            filter(max_level)
        } else {
            LevelFilter::Off
        });
        Ok(())
    })
}
