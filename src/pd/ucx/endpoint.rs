//! A UCP endpoint (one connection to a peer's worker): active messages out, RMA puts into the
//! peer's registered memory, flushes, and the remote keys unpacked on it.

use std::any::Any;
use std::cell::Cell;
use std::ffi::{c_uint, c_void};
use std::rc::Rc;
use std::time::Duration;

use super::request::Request;
use super::sockaddr;
use super::sys::{self, Handle};
use super::worker::{on_ep_error, Core, EpTarget};

/// Names an endpoint in the worker's queues (messages' `from`, errors): its handle's address,
/// the same on both the endpoint and the `reply_ep` UCX hands an active message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EpKey(usize);

impl EpKey {
    pub(super) fn of(h: Handle) -> EpKey {
        EpKey(h as usize)
    }
}

struct EpInner {
    core: Rc<Core>,
    h: Handle,
    closed: Cell<bool>,
}

impl Drop for EpInner {
    fn drop(&mut self) {
        if self.closed.get() {
            return;
        }
        // Not closed by its owner: force-closed (what is in flight is cancelled), waited for.
        let mut rp = sys::RequestParam::empty();
        rp.op_attr_mask = sys::OP_ATTR_FIELD_FLAGS;
        rp.flags = sys::EP_CLOSE_FLAG_FORCE;
        // SAFETY: this endpoint's handle, closed once.
        let ptr = unsafe { (self.core.ctx.api.ucp_ep_close_nbx)(self.h, &rp) };
        if let Ok(mut r) = Request::start(&self.core, ptr, "ucp_ep_close_nbx", None) {
            let _ = r.wait(Duration::from_secs(5));
        }
    }
}

/// Zeros after a peer's packed remote key: UCX reads a key without its length.
const RKEY_PAD: usize = 64 << 10;

/// One connection to a peer's worker. Closed (forcibly) on drop if not [`Self::close`]d.
pub struct Endpoint {
    inner: Rc<EpInner>,
}

impl Endpoint {
    pub(super) fn create(core: &Rc<Core>, target: EpTarget) -> Result<Endpoint, String> {
        let mut params = sys::EpParams {
            field_mask: sys::EP_PARAM_FIELD_ERR_HANDLING_MODE | sys::EP_PARAM_FIELD_ERR_HANDLER,
            address: std::ptr::null(),
            err_mode: sys::ERR_HANDLING_MODE_PEER,
            err_handler: Some(on_ep_error),
            err_arg: Rc::as_ptr(core).cast_mut().cast(),
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: sys::SockAddr {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: sys::SockAddr {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        };
        let storage;
        let what = match target {
            EpTarget::Request(req) => {
                params.field_mask |= sys::EP_PARAM_FIELD_CONN_REQUEST;
                params.conn_request = req;
                "accepting a UCX connection".to_string()
            }
            EpTarget::Address(addr) => {
                let (s, len) = sockaddr::to_c(&addr);
                storage = s;
                params.field_mask |= sys::EP_PARAM_FIELD_SOCK_ADDR | sys::EP_PARAM_FIELD_FLAGS;
                params.flags = sys::EP_PARAMS_FLAGS_CLIENT_SERVER;
                params.sockaddr = sys::SockAddr {
                    addr: (&storage as *const libc::sockaddr_storage).cast(),
                    addrlen: len,
                };
                format!("connecting to ucx://{addr}")
            }
        };
        let api = &core.ctx.api;
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: live worker; `params` and the address it points to live across the call; the
        // error handler's argument is the core, which outlives the endpoint (it holds an Rc).
        let status = unsafe { (api.ucp_ep_create)(core.h, &params, &mut h) };
        api.check(status, &what)?;
        Ok(Endpoint {
            inner: Rc::new(EpInner {
                core: core.clone(),
                h,
                closed: Cell::new(false),
            }),
        })
    }

    pub fn key(&self) -> EpKey {
        EpKey::of(self.inner.h)
    }

    /// Sends active message `id` (`header`, then `data`); the receiver's `from` names the
    /// connection it came on. `data` is kept (not copied) until UCX is done with it.
    pub fn send<B: AsRef<[u8]> + 'static>(
        &self,
        id: u32,
        header: Vec<u8>,
        data: B,
    ) -> Result<Request, String> {
        let keep: Box<(Vec<u8>, B)> = Box::new((header, data));
        let (h, d) = (keep.0.as_slice(), keep.1.as_ref());
        let mut rp = sys::RequestParam::empty();
        rp.op_attr_mask = sys::OP_ATTR_FIELD_FLAGS;
        rp.flags = sys::AM_SEND_FLAG_REPLY;
        let core = &self.inner.core;
        // SAFETY: live endpoint; the header and data are borrowed from the boxed `keep` (after
        // boxing, so they do not move), which the request holds until UCX is done with them.
        let ptr = unsafe {
            (core.ctx.api.ucp_am_send_nbx)(
                self.inner.h,
                id as c_uint,
                h.as_ptr().cast(),
                h.len(),
                d.as_ptr().cast(),
                d.len(),
                &rp,
            )
        };
        Request::start(core, ptr, "ucp_am_send_nbx", Some(keep as Box<dyn Any>))
    }

    /// Writes `data` at `remote_addr` in the peer's memory registered under `rkey`.
    pub fn put<B: AsRef<[u8]> + 'static>(
        &self,
        data: B,
        remote_addr: u64,
        rkey: &RemoteKey,
    ) -> Result<Request, String> {
        if rkey.ep != self.key() {
            return Err(
                "a remote key is used on an endpoint other than the one it was \
                        unpacked on (a dsv4 bug)"
                    .into(),
            );
        }
        let keep = Box::new(data);
        let bytes = (*keep).as_ref();
        let rp = sys::RequestParam::empty();
        let core = &self.inner.core;
        // SAFETY: live endpoint and remote key; the bytes are the boxed value's, taken after
        // boxing (they do not move), and the request keeps the box until UCX is done with them.
        let p = unsafe {
            (core.ctx.api.ucp_put_nbx)(
                self.inner.h,
                bytes.as_ptr().cast::<c_void>(),
                bytes.len(),
                remote_addr,
                rkey.h,
                &rp,
            )
        };
        Request::start(core, p, "ucp_put_nbx", Some(keep as Box<dyn Any>))
    }

    /// Completes when every operation issued on this endpoint before it is complete at the
    /// peer: a put then reads back on the peer's side.
    pub fn flush(&self) -> Result<Request, String> {
        let rp = sys::RequestParam::empty();
        let core = &self.inner.core;
        // SAFETY: live endpoint.
        let p = unsafe { (core.ctx.api.ucp_ep_flush_nbx)(self.inner.h, &rp) };
        Request::start(core, p, "ucp_ep_flush_nbx", None)
    }

    /// UCX's own description of the endpoint's configuration (`ucp_ep_print_info`, what
    /// `ucx_info -e` prints): its lanes, their transports, and the RMA protocols per lane.
    pub fn describe(&self) -> Result<String, String> {
        let mut buf: *mut libc::c_char = std::ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: both out-pointers live across the call; the stream is closed below.
        let stream = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if stream.is_null() {
            return Err(format!(
                "open_memstream: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: live endpoint; `stream` is open until the fclose below.
        unsafe { (self.inner.core.ctx.api.ucp_ep_print_info)(self.inner.h, stream) };
        // SAFETY: `stream` is open and closed once; after fclose `buf` holds `len` bytes (and
        // a NUL) that we own and free once.
        let text = unsafe {
            libc::fclose(stream);
            if buf.is_null() {
                String::new()
            } else {
                let bytes = std::slice::from_raw_parts(buf.cast::<u8>(), len);
                let text = String::from_utf8_lossy(bytes).into_owned();
                libc::free(buf.cast());
                text
            }
        };
        Ok(text)
    }

    /// Unpacks a peer's packed remote key (its [`super::Registered::rkey`]) for puts on this
    /// endpoint.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey, String> {
        let core = &self.inner.core;
        let mut h: Handle = std::ptr::null_mut();
        // ucp_ep_rkey_unpack takes no length: it reads as far as the packed bytes say. A
        // short or garbled key from a peer must not make it read past our buffer, so it reads
        // a copy followed by zeros (as many as the longest key UCX packs, several times over).
        let mut padded = packed.to_vec();
        padded.resize(packed.len() + RKEY_PAD, 0);
        // SAFETY: live endpoint; `padded` lives across the call and holds the packed bytes
        // then RKEY_PAD zeros, so what UCX reads stays inside it; `h` is an out-pointer.
        let status = unsafe {
            (core.ctx.api.ucp_ep_rkey_unpack)(self.inner.h, padded.as_ptr().cast(), &mut h)
        };
        core.ctx.api.check(status, "ucp_ep_rkey_unpack")?;
        Ok(RemoteKey {
            core: core.clone(),
            ep: self.key(),
            h,
        })
    }

    /// Closes the endpoint: gracefully (pending operations complete first) or `force`d
    /// (cancelled). Remote keys unpacked on it are to be dropped only once the close
    /// completed: puts still in flight read their key as UCX progresses them.
    pub fn close(self, force: bool) -> Result<Request, String> {
        let mut rp = sys::RequestParam::empty();
        if force {
            rp.op_attr_mask = sys::OP_ATTR_FIELD_FLAGS;
            rp.flags = sys::EP_CLOSE_FLAG_FORCE;
        }
        let inner = &self.inner;
        inner.closed.set(true);
        // SAFETY: this endpoint's handle, closed once (`closed` keeps Drop from closing it).
        let p = unsafe { (inner.core.ctx.api.ucp_ep_close_nbx)(inner.h, &rp) };
        Request::start(&inner.core, p, "ucp_ep_close_nbx", None)
    }
}

/// A peer's remote key, unpacked on one endpoint; destroyed on drop. It may outlive the
/// endpoint's close (and should, while puts that use it are in flight): `ucp_rkey_destroy`
/// touches only the key and its worker's pool, not the endpoint (UCX 1.13 through 1.19).
pub struct RemoteKey {
    /// Keeps the worker (whose pool holds the key) alive.
    core: Rc<Core>,
    /// The endpoint it was unpacked on, the only one it is used with.
    ep: EpKey,
    h: Handle,
}

impl RemoteKey {
    /// Leaves the key to UCX, never destroyed (operations abandoned in flight may still read
    /// it), while releasing the worker it keeps alive, so the worker still goes on time.
    pub fn leak(self) {
        let key = std::mem::ManuallyDrop::new(self);
        // SAFETY: `core` is read out exactly once from a value that is never dropped or used
        // again (ManuallyDrop), so the Rc is released once and the key's handle stays alive.
        drop(unsafe { std::ptr::read(&key.core) });
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: this key's handle, destroyed once, on its worker's thread while the worker
        // lives (held here); the owner drops it only after the puts using it ended.
        unsafe { (self.core.ctx.api.ucp_rkey_destroy)(self.h) };
    }
}
