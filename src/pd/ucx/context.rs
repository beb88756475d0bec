//! A UCP context (the library's per-process state, with the features PD needs: RMA, active
//! messages, wake-ups) and memory registered with it, whose packed remote key a peer unpacks
//! to write into it.

use std::ffi::{c_void, CString};
use std::path::Path;
use std::sync::Arc;

use super::sys::{self, Api, Handle};

/// A loaded libucp and one context over it. Shared by the workers made from it.
pub struct Context {
    pub(super) api: Arc<Api>,
    pub(super) h: Handle,
}

// SAFETY: a UCP context is thread-safe for the calls made on it here (worker creation, memory
// map/unmap, rkey packing); `mt_workers_shared` is off, so each worker stays on one thread.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Loads libucp (`library`, else `libucp.so.0`) and makes a context. `tls`, when given,
    /// overrides `UCX_TLS` (the transports UCX may use, e.g. `"tcp,self,sm"`); every other
    /// `UCX_*` variable of the environment applies as UCX documents.
    pub fn new(library: Option<&Path>, tls: Option<&str>) -> Result<Arc<Context>, String> {
        let api = Arc::new(Api::load(library)?);
        let mut config: Handle = std::ptr::null_mut();
        // SAFETY: null prefix and file name read the default UCX_ environment; `config` is an
        // out-pointer.
        let status =
            unsafe { (api.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
        api.check(status, "ucp_config_read")?;
        let result = Self::init(&api, config, tls);
        // SAFETY: `config` came from ucp_config_read and is released once, after init copied it.
        unsafe { (api.ucp_config_release)(config) };
        let h = result?;
        Ok(Arc::new(Context { api, h }))
    }

    fn init(api: &Api, config: Handle, tls: Option<&str>) -> Result<Handle, String> {
        if let Some(tls) = tls {
            let value = CString::new(tls).map_err(|_| format!("UCX_TLS {tls:?} holds a NUL"))?;
            // SAFETY: both strings are NUL-terminated and live across the call.
            let status =
                unsafe { (api.ucp_config_modify)(config, c"TLS".as_ptr(), value.as_ptr()) };
            api.check(status, &format!("UCX_TLS={tls}"))?;
        }
        let params = sys::Params {
            field_mask: sys::PARAM_FIELD_FEATURES
                | sys::PARAM_FIELD_MT_WORKERS_SHARED
                | sys::PARAM_FIELD_NAME,
            features: sys::FEATURE_RMA | sys::FEATURE_AM | sys::FEATURE_WAKEUP,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: c"dsv4".as_ptr(),
        };
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: `params` is a valid 1.13 ucp_params_t whose field_mask names only the fields
        // set; `config` is live; `h` is an out-pointer.
        let status = unsafe {
            (api.ucp_init_version)(sys::API_MAJOR, sys::API_MINOR, &params, config, &mut h)
        };
        api.check(status, &format!("ucp_init ({})", api.path))?;
        Ok(h)
    }

    /// The loaded library (for `ucp_worker_signal` from other threads).
    pub fn api_handle(&self) -> Arc<Api> {
        self.api.clone()
    }

    /// Registers `len` bytes at `addr` for local use and for remote reads and writes by peers
    /// holding its [`Registered::rkey`].
    ///
    /// # Safety
    /// The memory must stay allocated until the returned registration is dropped, and no peer
    /// may write into it after that.
    pub unsafe fn register(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
    ) -> Result<Registered, String> {
        let params = sys::MemMapParams {
            field_mask: sys::MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::MEM_MAP_PARAM_FIELD_LENGTH
                | sys::MEM_MAP_PARAM_FIELD_PROT,
            address: addr.cast::<c_void>(),
            length: len,
            flags: 0,
            prot: sys::MEM_MAP_PROT_LOCAL_READ
                | sys::MEM_MAP_PROT_LOCAL_WRITE
                | sys::MEM_MAP_PROT_REMOTE_READ
                | sys::MEM_MAP_PROT_REMOTE_WRITE,
            memory_type: 0,
        };
        let api = &self.api;
        let mut memh: Handle = std::ptr::null_mut();
        // SAFETY: the context is live; the caller vouches for the memory; `memh` is an
        // out-pointer.
        let status = unsafe { (api.ucp_mem_map)(self.h, &params, &mut memh) };
        api.check(status, &format!("ucp_mem_map of {len} bytes"))?;
        let mut registered = Registered {
            ctx: self.clone(),
            memh,
            addr: addr as u64,
            len,
            rkey: Vec::new(),
        };
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `memh` is the live registration above; the out-pointers are valid.
        let status = unsafe { (api.ucp_rkey_pack)(self.h, memh, &mut buf, &mut size) };
        api.check(status, "ucp_rkey_pack")?;
        // SAFETY: ucp_rkey_pack returned `size` readable bytes at `buf`, released right after
        // the copy.
        let rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { (api.ucp_rkey_buffer_release)(buf) };
        registered.rkey = rkey;
        Ok(registered)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the last reference: every worker and registration holds an Arc to it.
        unsafe { (self.api.ucp_cleanup)(self.h) };
    }
}

/// Memory registered with a context; unregistered on drop.
pub struct Registered {
    ctx: Arc<Context>,
    memh: Handle,
    /// The memory's address, as a peer names it in a put.
    pub addr: u64,
    pub len: usize,
    /// The packed remote key a peer unpacks ([`super::Endpoint::unpack_rkey`]) to write here.
    pub rkey: Vec<u8>,
}

// SAFETY: the handle is only passed back to ucp_mem_unmap, which may run on any thread.
unsafe impl Send for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        // SAFETY: `memh` is this registration's, unmapped once.
        let status = unsafe { (self.ctx.api.ucp_mem_unmap)(self.ctx.h, self.memh) };
        if status != sys::UCS_OK {
            log::warn!("ucp_mem_unmap: {}", self.ctx.api.status_text(status));
        }
    }
}
