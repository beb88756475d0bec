//! libucp's C API, declared by hand from the UCX 1.13 headers and loaded at run time
//! (`libloading`), so the crate builds and runs on machines without UCX; only
//! `pd.transport = "ucx"` needs it.
//!
//! Every parameter struct starts with a `field_mask` naming the fields set: later UCX releases
//! only append fields, so these 1.13 layouts stay valid against a newer libucp (for example the
//! CUDA-enabled one of the `libucx-cu13` wheel). The sizes are checked against the 1.13 header's
//! `sizeof` in this module's tests.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::Path;

/// `ucs_status_t`.
pub type Status = c_int;
pub const UCS_OK: Status = 0;
pub const UCS_INPROGRESS: Status = 1;
pub const UCS_ERR_CANCELED: Status = -16;
/// Below every error code: a `ucs_status_ptr_t` at or above it (as unsigned) is an error.
const UCS_ERR_LAST: isize = -100;

pub type Handle = *mut c_void;

/// `UCP_API_MAJOR` / `UCP_API_MINOR` of the headers these declarations follow.
pub const API_MAJOR: c_uint = 1;
pub const API_MINOR: c_uint = 13;

pub const FEATURE_RMA: u64 = 2;
pub const FEATURE_WAKEUP: u64 = 16;
pub const FEATURE_AM: u64 = 64;

pub const PARAM_FIELD_FEATURES: u64 = 1;
pub const PARAM_FIELD_MT_WORKERS_SHARED: u64 = 32;
pub const PARAM_FIELD_NAME: u64 = 256;

pub const WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1;
pub const WORKER_PARAM_FIELD_EVENTS: u64 = 4;
pub const THREAD_MODE_SINGLE: c_int = 0;
pub const WAKEUP_RMA: u64 = 1;
pub const WAKEUP_TX: u64 = 1024;
pub const WAKEUP_RX: u64 = 2048;

pub const LISTENER_PARAM_FIELD_SOCK_ADDR: u64 = 1;
pub const LISTENER_PARAM_FIELD_CONN_HANDLER: u64 = 4;
pub const LISTENER_ATTR_FIELD_SOCKADDR: u64 = 1;
pub const CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR: u64 = 1;

pub const EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 2;
pub const EP_PARAM_FIELD_ERR_HANDLER: u64 = 4;
pub const EP_PARAM_FIELD_SOCK_ADDR: u64 = 16;
pub const EP_PARAM_FIELD_FLAGS: u64 = 32;
pub const EP_PARAM_FIELD_CONN_REQUEST: u64 = 64;
pub const EP_PARAMS_FLAGS_CLIENT_SERVER: c_uint = 1;
pub const ERR_HANDLING_MODE_PEER: c_int = 1;
pub const EP_CLOSE_FLAG_FORCE: u32 = 1;

pub const OP_ATTR_FIELD_CALLBACK: u32 = 2;
pub const OP_ATTR_FIELD_USER_DATA: u32 = 4;
pub const OP_ATTR_FIELD_FLAGS: u32 = 16;
pub const OP_ATTR_FIELD_MEMORY_TYPE: u32 = 64;
pub const OP_ATTR_FIELD_MEMH: u32 = 256;
pub const AM_SEND_FLAG_REPLY: u32 = 1;

pub const AM_HANDLER_PARAM_FIELD_ID: u64 = 1;
pub const AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 2;
pub const AM_HANDLER_PARAM_FIELD_CB: u64 = 4;
pub const AM_HANDLER_PARAM_FIELD_ARG: u64 = 8;
pub const AM_FLAG_WHOLE_MSG: u32 = 1;
pub const AM_RECV_ATTR_FIELD_REPLY_EP: u64 = 1;
pub const AM_RECV_ATTR_FLAG_DATA: u64 = 65536;
pub const AM_RECV_ATTR_FLAG_RNDV: u64 = 131072;

pub const MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1;
pub const MEM_MAP_PARAM_FIELD_LENGTH: u64 = 2;
pub const MEM_MAP_PARAM_FIELD_PROT: u64 = 8;
pub const MEM_MAP_PROT_LOCAL_READ: c_uint = 1;
pub const MEM_MAP_PROT_LOCAL_WRITE: c_uint = 2;
pub const MEM_MAP_PROT_REMOTE_READ: c_uint = 256;
pub const MEM_MAP_PROT_REMOTE_WRITE: c_uint = 512;

/// `ucp_params_t` (80 bytes in 1.13).
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (200 bytes in 1.13).
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: [u64; 16],
    pub events: u64,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct SockAddr {
    pub addr: *const libc::sockaddr,
    pub addrlen: libc::socklen_t,
}

pub type ConnHandler = unsafe extern "C" fn(conn_request: Handle, arg: *mut c_void);
pub type ErrHandler = unsafe extern "C" fn(arg: *mut c_void, ep: Handle, status: Status);
pub type SendCallback =
    unsafe extern "C" fn(request: *mut c_void, status: Status, user: *mut c_void);
pub type AmRecvCallback = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const AmRecvParam,
) -> Status;
pub type RecvDataCallback =
    unsafe extern "C" fn(request: *mut c_void, status: Status, length: usize, user: *mut c_void);

/// `ucp_listener_params_t` (56 bytes).
#[repr(C)]
pub struct ListenerParams {
    pub field_mask: u64,
    pub sockaddr: SockAddr,
    pub accept_handler: [*mut c_void; 2],
    pub conn_handler: Option<ConnHandler>,
    pub conn_arg: *mut c_void,
}

/// `ucp_listener_attr_t` (136 bytes).
#[repr(C)]
pub struct ListenerAttr {
    pub field_mask: u64,
    pub sockaddr: libc::sockaddr_storage,
}

/// `ucp_conn_request_attr_t` (144 bytes).
#[repr(C)]
pub struct ConnRequestAttr {
    pub field_mask: u64,
    pub client_address: libc::sockaddr_storage,
    pub client_id: u64,
}

/// `ucp_ep_params_t` (104 bytes).
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    pub err_mode: c_int,
    pub err_handler: Option<ErrHandler>,
    pub err_arg: *mut c_void,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: SockAddr,
    pub conn_request: Handle,
    pub name: *const c_char,
    pub local_sockaddr: SockAddr,
}

/// `ucp_request_param_t` (72 bytes). `cb` is a union of callback types: which one is read
/// depends on the operation ([`SendCallback`] for sends, puts and flushes, [`RecvDataCallback`]
/// for `ucp_am_recv_data_nbx`).
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *const c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: Handle,
}

impl RequestParam {
    pub fn empty() -> Self {
        RequestParam {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: std::ptr::null(),
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }
}

/// `ucp_mem_map_params_t` (40 bytes).
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_am_handler_param_t` (32 bytes).
#[repr(C)]
pub struct AmHandlerParam {
    pub field_mask: u64,
    pub id: c_uint,
    pub flags: u32,
    pub cb: Option<AmRecvCallback>,
    pub arg: *mut c_void,
}

/// `ucp_am_recv_param_t` (16 bytes).
#[repr(C)]
pub struct AmRecvParam {
    pub recv_attr: u64,
    pub reply_ep: Handle,
}

/// A `ucs_status_ptr_t`: done at once, failed, or a request to wait on.
pub enum StatusPtr {
    Done,
    Failed(Status),
    Pending(*mut c_void),
}

impl StatusPtr {
    pub fn of(p: *mut c_void) -> StatusPtr {
        let raw = p as usize;
        if raw == 0 {
            StatusPtr::Done
        } else if raw >= UCS_ERR_LAST as usize {
            StatusPtr::Failed(p as isize as Status)
        } else {
            StatusPtr::Pending(p)
        }
    }
}

macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) $(-> $ret:ty)?;)*) => {
        /// The libucp entry points this crate uses, resolved once at load.
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,)*
            /// Where the library was found (for messages).
            pub path: String,
            // Last: the pointers above are valid while the library stays loaded.
            _lib: libloading::Library,
        }

        impl Api {
            fn resolve(lib: libloading::Library, path: String) -> Result<Api, String> {
                Ok(Api {
                    $($name: {
                        let symbol = concat!(stringify!($name), "\0").as_bytes();
                        // SAFETY: the symbol's C type is the one declared here, from the UCX
                        // 1.13 headers; the copied pointer outlives no `_lib`, which the
                        // struct owns.
                        unsafe {
                            *lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(symbol)
                                .map_err(|e| format!(
                                    "{path} lacks {}: {e}; UCX 1.13 or newer is needed",
                                    stringify!($name)
                                ))?
                        }
                    },)*
                    path,
                    _lib: lib,
                })
            }
        }
    };
}

api! {
    ucp_config_read: fn(*const c_char, *const c_char, *mut Handle) -> Status;
    ucp_config_modify: fn(Handle, *const c_char, *const c_char) -> Status;
    ucp_config_release: fn(Handle);
    ucp_init_version: fn(c_uint, c_uint, *const Params, Handle, *mut Handle) -> Status;
    ucp_cleanup: fn(Handle);
    ucp_worker_create: fn(Handle, *const WorkerParams, *mut Handle) -> Status;
    ucp_worker_destroy: fn(Handle);
    ucp_worker_progress: fn(Handle) -> c_uint;
    ucp_worker_get_efd: fn(Handle, *mut c_int) -> Status;
    ucp_worker_arm: fn(Handle) -> Status;
    ucp_worker_signal: fn(Handle) -> Status;
    ucp_worker_set_am_recv_handler: fn(Handle, *const AmHandlerParam) -> Status;
    ucp_listener_create: fn(Handle, *const ListenerParams, *mut Handle) -> Status;
    ucp_listener_destroy: fn(Handle);
    ucp_listener_query: fn(Handle, *mut ListenerAttr) -> Status;
    ucp_listener_reject: fn(Handle, Handle) -> Status;
    ucp_conn_request_query: fn(Handle, *mut ConnRequestAttr) -> Status;
    ucp_ep_create: fn(Handle, *const EpParams, *mut Handle) -> Status;
    ucp_ep_close_nbx: fn(Handle, *const RequestParam) -> *mut c_void;
    ucp_ep_flush_nbx: fn(Handle, *const RequestParam) -> *mut c_void;
    ucp_am_send_nbx: fn(Handle, c_uint, *const c_void, usize, *const c_void, usize,
                        *const RequestParam) -> *mut c_void;
    ucp_am_recv_data_nbx: fn(Handle, *mut c_void, *mut c_void, usize, *const RequestParam)
        -> *mut c_void;
    ucp_am_data_release: fn(Handle, *mut c_void);
    ucp_put_nbx: fn(Handle, *const c_void, usize, u64, Handle, *const RequestParam)
        -> *mut c_void;
    ucp_mem_map: fn(Handle, *const MemMapParams, *mut Handle) -> Status;
    ucp_mem_unmap: fn(Handle, Handle) -> Status;
    ucp_rkey_pack: fn(Handle, Handle, *mut *mut c_void, *mut usize) -> Status;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(Handle, *const c_void, *mut Handle) -> Status;
    ucp_rkey_destroy: fn(Handle);
    ucp_ep_print_info: fn(Handle, *mut libc::FILE);
    ucp_request_check_status: fn(*mut c_void) -> Status;
    ucp_request_free: fn(*mut c_void);
    ucp_request_cancel: fn(Handle, *mut c_void);
    ucs_status_string: fn(Status) -> *const c_char;
}

/// What a machine without UCX is told.
pub const INSTALL_HINT: &str = "install UCX (Debian/Ubuntu: apt install libucx0) or name a \
                                libucp with pd.ucx_library";

impl Api {
    /// Loads libucp: `path` when given (e.g. the CUDA-enabled one of the `libucx-cu13` wheel),
    /// else `libucp.so.0` from the loader's search path.
    pub fn load(path: Option<&Path>) -> Result<Api, String> {
        let name = path.map_or_else(
            || "libucp.so.0".to_string(),
            |p| p.to_string_lossy().into_owned(),
        );
        // SAFETY: loading libucp runs its initialisers (UCX's global setup), which have no
        // preconditions on the caller.
        let lib = unsafe { libloading::Library::new(&name) }
            .map_err(|e| format!("cannot load {name} ({e}): {INSTALL_HINT}"))?;
        Api::resolve(lib, name)
    }

    /// UCX's name for `status`.
    pub fn status_text(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a static NUL-terminated string for any code.
        let p = unsafe { (self.ucs_status_string)(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated and static (above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `UCS_OK`, else `what` with UCX's reason.
    pub fn check(&self, status: Status, what: &str) -> Result<(), String> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.status_text(status)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The 1.13 header's sizeof and offsetof, printed by a C program compiled against it.
    #[test]
    fn layouts_match_the_ucx_1_13_header() {
        assert_eq!(size_of::<Params>(), 80);
        assert_eq!(offset_of!(Params, mt_workers_shared), 48);
        assert_eq!(offset_of!(Params, name), 72);
        assert_eq!(size_of::<WorkerParams>(), 200);
        assert_eq!(offset_of!(WorkerParams, cpu_mask), 16);
        assert_eq!(offset_of!(WorkerParams, events), 144);
        assert_eq!(offset_of!(WorkerParams, event_fd), 160);
        assert_eq!(offset_of!(WorkerParams, name), 176);
        assert_eq!(size_of::<ListenerParams>(), 56);
        assert_eq!(offset_of!(ListenerParams, accept_handler), 24);
        assert_eq!(offset_of!(ListenerParams, conn_handler), 40);
        assert_eq!(size_of::<ListenerAttr>(), 136);
        assert_eq!(size_of::<ConnRequestAttr>(), 144);
        assert_eq!(size_of::<EpParams>(), 104);
        assert_eq!(offset_of!(EpParams, err_mode), 16);
        assert_eq!(offset_of!(EpParams, err_handler), 24);
        assert_eq!(offset_of!(EpParams, flags), 48);
        assert_eq!(offset_of!(EpParams, sockaddr), 56);
        assert_eq!(offset_of!(EpParams, conn_request), 72);
        assert_eq!(offset_of!(EpParams, local_sockaddr), 88);
        assert_eq!(size_of::<RequestParam>(), 72);
        assert_eq!(offset_of!(RequestParam, cb), 16);
        assert_eq!(offset_of!(RequestParam, memory_type), 48);
        assert_eq!(offset_of!(RequestParam, memh), 64);
        assert_eq!(size_of::<MemMapParams>(), 40);
        assert_eq!(offset_of!(MemMapParams, prot), 28);
        assert_eq!(size_of::<AmHandlerParam>(), 32);
        assert_eq!(offset_of!(AmHandlerParam, cb), 16);
        assert_eq!(size_of::<AmRecvParam>(), 16);
    }

    #[test]
    fn status_pointers_decode_as_ucx_macros_do() {
        assert!(matches!(
            StatusPtr::of(std::ptr::null_mut()),
            StatusPtr::Done
        ));
        let err = UCS_ERR_CANCELED as isize as *mut c_void;
        assert!(matches!(
            StatusPtr::of(err),
            StatusPtr::Failed(UCS_ERR_CANCELED)
        ));
        let req = 0x7f00_1234_5678usize as *mut c_void;
        assert!(matches!(StatusPtr::of(req), StatusPtr::Pending(p) if p == req));
    }

    #[test]
    fn a_missing_library_is_an_error_naming_the_package() {
        let Err(e) = Api::load(Some(Path::new("/nonexistent/libucp.so.0"))) else {
            panic!("a missing path loaded");
        };
        assert!(e.contains("libucx0") && e.contains("pd.ucx_library"), "{e}");
    }
}
