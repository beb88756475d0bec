//! A UCP worker: the progress engine every endpoint, listener and operation of one thread runs
//! on. Incoming connections, endpoint errors and active messages are queued by its callbacks
//! (which run inside [`Worker::progress`]) and taken from the queues by the owner.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use super::context::Context;
use super::endpoint::{Endpoint, EpKey};
use super::sockaddr;
use super::sys::{self, Handle, StatusPtr};

/// An active message as it arrived: its id, header and data, and the endpoint it came on
/// (the sender's connection as seen here) when the sender asked for replies.
#[derive(Debug)]
pub struct Message {
    pub id: u32,
    pub header: Vec<u8>,
    pub data: Vec<u8>,
    pub from: Option<EpKey>,
}

/// What the callbacks queue for the owner.
#[derive(Default)]
pub(super) struct Events {
    pub(super) conn_requests: VecDeque<Handle>,
    pub(super) errors: Vec<(EpKey, String)>,
    pub(super) messages: VecDeque<Message>,
    /// Rendezvous messages announced: UCX's data descriptor and the message to fill.
    announced: Vec<(*mut c_void, Message)>,
    /// Rendezvous messages whose data is still arriving: the request and the message it fills.
    receiving: Vec<(*mut c_void, Message)>,
}

/// Receive buffers kept for reuse at most.
const SPARE_BUFFERS: usize = 64;

/// A buffer of `len` bytes for rendezvous data: a spare one when one is large enough.
fn buffer(core: &Core, len: usize) -> Vec<u8> {
    let mut spare = core.spare.borrow_mut();
    match spare.iter().position(|b| b.len() >= len) {
        Some(i) => {
            let mut b = spare.swap_remove(i);
            b.truncate(len);
            b
        }
        None => vec![0u8; len],
    }
}

/// What an active-message handler is registered with.
struct AmArg {
    core: *const Core,
    id: u32,
    /// Header and data bytes above these are refused (the peer is reported, as an endpoint
    /// error): a peer cannot make this side allocate what it likes.
    max_header: usize,
    max_data: usize,
}

/// The worker itself, shared by its endpoints, listeners and requests (destroyed after them).
pub(super) struct Core {
    pub(super) ctx: Arc<Context>,
    pub(super) h: Handle,
    efd: RawFd,
    pub(super) events: RefCell<Events>,
    /// Receive buffers handed back ([`Worker::recycle`]), each initialised to its capacity:
    /// rendezvous data lands in one instead of a fresh zeroed allocation per message.
    spare: RefCell<Vec<Vec<u8>>>,
    /// Callback arguments of the active-message handlers. Boxed: UCX holds their addresses,
    /// which must not move when the Vec grows.
    #[allow(clippy::vec_box)]
    am_args: RefCell<Vec<Box<AmArg>>>,
}

impl Core {
    /// Runs UCX's progress until it has nothing more to do; returns how much it did.
    pub(super) fn progress(&self) -> usize {
        let api = &self.ctx.api;
        let mut done = 0;
        loop {
            // SAFETY: the worker is live and used from its owning thread only (!Send types).
            let n = unsafe { (api.ucp_worker_progress)(self.h) } as usize;
            done += n;
            if n == 0 {
                break;
            }
        }
        // Rendezvous data: receive what was announced (outside the callback, as UCX asks).
        let announced = std::mem::take(&mut self.events.borrow_mut().announced);
        for (desc, mut message) in announced {
            let rp = sys::RequestParam::empty();
            let len = message.data.len();
            // SAFETY: `desc` is UCX's descriptor of a message whose callback returned
            // UCS_INPROGRESS; the buffer is `len` bytes and stays put (the Vec moves with the
            // message, its heap block does not) until the request completes or is cancelled
            // with the core.
            let ptr = unsafe {
                (api.ucp_am_recv_data_nbx)(self.h, desc, message.data.as_mut_ptr().cast(), len, &rp)
            };
            let mut ev = self.events.borrow_mut();
            match StatusPtr::of(ptr) {
                StatusPtr::Done => ev.messages.push_back(message),
                StatusPtr::Pending(p) => ev.receiving.push((p, message)),
                StatusPtr::Failed(status) => log::warn!(
                    "active message {}: receiving its {len} bytes failed: {}",
                    message.id,
                    api.status_text(status)
                ),
            }
            done += 1;
        }
        if done > 0 {
            // The receives just started may complete with more progress.
            // SAFETY: as above.
            while unsafe { (api.ucp_worker_progress)(self.h) } > 0 {}
        }
        // Rendezvous data that finished arriving.
        let mut ev = self.events.borrow_mut();
        let mut i = 0;
        while i < ev.receiving.len() {
            let p = ev.receiving[i].0;
            // SAFETY: `p` is a live receive request of this worker.
            let status = unsafe { (api.ucp_request_check_status)(p) };
            if status == sys::UCS_INPROGRESS {
                i += 1;
                continue;
            }
            // SAFETY: completed; freed once and forgotten.
            unsafe { (api.ucp_request_free)(p) };
            let (_, message) = ev.receiving.swap_remove(i);
            if status == sys::UCS_OK {
                ev.messages.push_back(message);
            } else {
                log::warn!(
                    "active message {}: its data did not arrive: {}",
                    message.id,
                    api.status_text(status)
                );
            }
            done += 1;
        }
        done
    }

    /// Sleeps until the worker has something to progress, `also` is readable, or `timeout`
    /// passes. True when `also` is readable.
    pub(super) fn wait(&self, timeout: Duration, also: Option<RawFd>) -> bool {
        // SAFETY: the worker is live; arming has no other precondition.
        let status = unsafe { (self.ctx.api.ucp_worker_arm)(self.h) };
        if status != sys::UCS_OK {
            // UCS_ERR_BUSY: events are pending already — progress again at once.
            return false;
        }
        let mut fds = [
            libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: also.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.as_millis().min(c_int::MAX as u128) as c_int;
        // SAFETY: `fds` is a valid array of 2 pollfd (a negative fd is ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        n > 0 && fds[1].revents & libc::POLLIN != 0
    }
}

impl Drop for Core {
    fn drop(&mut self) {
        let api = &self.ctx.api;
        let ev = self.events.get_mut();
        for (desc, _) in ev.announced.drain(..) {
            // SAFETY: an announced descriptor never received: released once.
            unsafe { (api.ucp_am_data_release)(self.h, desc) };
        }
        // Receives still in flight: their buffers are kept until the worker is gone (UCX may
        // write into them until then).
        let mut receiving_into = Vec::new();
        for (p, message) in ev.receiving.drain(..) {
            // SAFETY: live requests of this worker: cancelled, then released to UCX, which
            // frees them when they end (at the latest with the worker below).
            unsafe {
                (api.ucp_request_cancel)(self.h, p);
                (api.ucp_request_free)(p);
            }
            receiving_into.push(message);
        }
        for c in ev.conn_requests.drain(..) {
            // Never accepted: connection requests belong to a listener already gone; UCX
            // releases them with the worker.
            let _ = c;
        }
        // SAFETY: every endpoint, listener and request holds an Rc to this core, so none is
        // left; the worker is destroyed once.
        unsafe { (api.ucp_worker_destroy)(self.h) };
        drop(receiving_into);
    }
}

/// A worker, for the thread that made it (not `Send`: UCX runs it single-threaded).
pub struct Worker {
    pub(super) core: Rc<Core>,
}

impl Worker {
    pub fn new(ctx: &Arc<Context>) -> Result<Worker, String> {
        let api = &ctx.api;
        let params = sys::WorkerParams {
            field_mask: sys::WORKER_PARAM_FIELD_THREAD_MODE,
            thread_mode: sys::THREAD_MODE_SINGLE,
            cpu_mask: [0; 16],
            events: 0,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        };
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: live context, a valid 1.13 params struct, an out-pointer.
        let status = unsafe { (api.ucp_worker_create)(ctx.h, &params, &mut h) };
        api.check(status, "ucp_worker_create")?;
        let mut efd: c_int = -1;
        // SAFETY: the worker was just made; `efd` is an out-pointer.
        let status = unsafe { (api.ucp_worker_get_efd)(h, &mut efd) };
        if let Err(e) = api.check(status, "ucp_worker_get_efd") {
            // SAFETY: the worker above, destroyed once.
            unsafe { (api.ucp_worker_destroy)(h) };
            return Err(e);
        }
        Ok(Worker {
            core: Rc::new(Core {
                ctx: ctx.clone(),
                h,
                efd,
                events: RefCell::new(Events::default()),
                spare: RefCell::new(Vec::new()),
                am_args: RefCell::new(Vec::new()),
            }),
        })
    }

    /// The worker's handle, for `ucp_worker_signal` from another thread while it lives.
    pub fn raw(&self) -> Handle {
        self.core.h
    }

    /// Runs UCX's progress (callbacks included) until idle; how much it did.
    pub fn progress(&self) -> usize {
        self.core.progress()
    }

    /// Sleeps until there is something to progress, `also` is readable (true) or `timeout`.
    pub fn wait(&self, timeout: Duration, also: Option<RawFd>) -> bool {
        self.core.wait(timeout, also)
    }

    /// Queues active messages of `id` for [`Self::take_message`]. A message with a header over
    /// `max_header` or data over `max_data` bytes is dropped and its endpoint reported in
    /// [`Self::take_errors`] (the peer broke the protocol).
    pub fn receive(&self, id: u32, max_header: usize, max_data: usize) -> Result<(), String> {
        let arg = Box::new(AmArg {
            core: Rc::as_ptr(&self.core),
            id,
            max_header,
            max_data,
        });
        let params = sys::AmHandlerParam {
            field_mask: sys::AM_HANDLER_PARAM_FIELD_ID
                | sys::AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::AM_HANDLER_PARAM_FIELD_CB
                | sys::AM_HANDLER_PARAM_FIELD_ARG,
            id,
            flags: sys::AM_FLAG_WHOLE_MSG,
            cb: Some(on_message),
            arg: (&*arg as *const AmArg).cast_mut().cast(),
        };
        let api = &self.core.ctx.api;
        // SAFETY: live worker; `arg` is boxed and kept with the core, which outlives every
        // callback (they run inside its progress).
        let status = unsafe { (api.ucp_worker_set_am_recv_handler)(self.core.h, &params) };
        api.check(status, &format!("active message handler {id}"))?;
        self.core.am_args.borrow_mut().push(arg);
        Ok(())
    }

    /// Whether rendezvous data is still arriving (progress must keep running: UCX may complete
    /// it without an event on the worker's file descriptor).
    pub fn receiving(&self) -> bool {
        let ev = self.core.events.borrow();
        !ev.receiving.is_empty() || !ev.announced.is_empty()
    }

    /// Hands a message's data buffer back for later messages to land in.
    pub fn recycle(&self, mut buf: Vec<u8>) {
        let mut spare = self.core.spare.borrow_mut();
        if spare.len() < SPARE_BUFFERS && buf.capacity() > 0 {
            // Initialised to its capacity (zeroing only what lies past its length).
            buf.resize(buf.capacity(), 0);
            spare.push(buf);
        }
    }

    pub fn take_message(&self) -> Option<Message> {
        self.core.events.borrow_mut().messages.pop_front()
    }

    /// Messages queued for [`Self::take_message`].
    pub fn queued(&self) -> usize {
        self.core.events.borrow().messages.len()
    }

    /// Drops what is queued for endpoint `ep` (messages, errors): called when it is closed, so
    /// that a later endpoint UCX allocates at the same address is not handed them.
    pub fn forget(&self, ep: EpKey) {
        let mut ev = self.core.events.borrow_mut();
        ev.messages.retain(|m| m.from != Some(ep));
        ev.errors.retain(|(e, _)| *e != ep);
    }

    /// Endpoints that failed (peer gone, connection reset, timeout) since the last call.
    pub fn take_errors(&self) -> Vec<(EpKey, String)> {
        std::mem::take(&mut self.core.events.borrow_mut().errors)
    }

    /// Listens on `addr` (port 0: any free port; [`Listener::local_addr`] tells which).
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener, String> {
        let (storage, len) = sockaddr::to_c(&addr);
        let params = sys::ListenerParams {
            field_mask: sys::LISTENER_PARAM_FIELD_SOCK_ADDR
                | sys::LISTENER_PARAM_FIELD_CONN_HANDLER,
            sockaddr: sys::SockAddr {
                addr: (&storage as *const libc::sockaddr_storage).cast(),
                addrlen: len,
            },
            accept_handler: [std::ptr::null_mut(); 2],
            conn_handler: Some(on_conn_request),
            conn_arg: Rc::as_ptr(&self.core).cast_mut().cast(),
        };
        let api = &self.core.ctx.api;
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: live worker; the address lives across the call; the callback argument is
        // the core, which outlives the listener (the listener holds an Rc to it).
        let status = unsafe { (api.ucp_listener_create)(self.core.h, &params, &mut h) };
        api.check(status, &format!("UCX listener on {addr}"))?;
        let mut listener = Listener {
            core: self.core.clone(),
            h,
            addr,
        };
        let mut attr = sys::ListenerAttr {
            field_mask: sys::LISTENER_ATTR_FIELD_SOCKADDR,
            // SAFETY: all-zero is a valid sockaddr_storage.
            sockaddr: unsafe { std::mem::zeroed() },
        };
        // SAFETY: live listener; `attr` is a valid out-struct.
        let status = unsafe { (api.ucp_listener_query)(h, &mut attr) };
        api.check(status, "ucp_listener_query")?;
        listener.addr = sockaddr::from_c(&attr.sockaddr)
            .ok_or_else(|| "the UCX listener's address is not IPv4 or IPv6".to_string())?;
        Ok(listener)
    }

    /// The next connection a listener of this worker was asked for, made into an endpoint.
    pub fn accept(&self) -> Option<Result<Endpoint, String>> {
        let req = self.core.events.borrow_mut().conn_requests.pop_front()?;
        Some(Endpoint::create(&self.core, EpTarget::Request(req)))
    }

    /// Connects to a UCX listener at `addr` (the connection completes as the worker
    /// progresses; operations may be queued on the endpoint at once).
    pub fn connect(&self, addr: SocketAddr) -> Result<Endpoint, String> {
        Endpoint::create(&self.core, EpTarget::Address(addr))
    }
}

/// Where a new endpoint goes.
pub(super) enum EpTarget {
    Request(Handle),
    Address(SocketAddr),
}

/// A UCX listener; stops listening on drop.
pub struct Listener {
    core: Rc<Core>,
    h: Handle,
    addr: SocketAddr,
}

impl Listener {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Refuses the next connection request queued on this listener's worker (the peer's
    /// endpoint fails at once, instead of connecting to be closed): `None` when none waits. A
    /// worker has at most one listener here, so every queued request is this listener's.
    pub fn reject_next(&self) -> Option<Result<(), String>> {
        let req = self.core.events.borrow_mut().conn_requests.pop_front()?;
        let api = &self.core.ctx.api;
        // SAFETY: a request this listener's connection handler queued, neither accepted nor
        // rejected before (popped from the queue once), on the worker's own thread.
        let status = unsafe { (api.ucp_listener_reject)(self.h, req) };
        Some(api.check(status, "ucp_listener_reject"))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: this listener's handle, destroyed once.
        unsafe { (self.core.ctx.api.ucp_listener_destroy)(self.h) };
    }
}

/// A listener's connection request: queued for [`Worker::accept`].
unsafe extern "C" fn on_conn_request(req: Handle, arg: *mut c_void) {
    // SAFETY: `arg` is the core that made the listener, alive while the listener is; this runs
    // inside its progress, on its thread, with no borrow of `events` held.
    let core = unsafe { &*(arg as *const Core) };
    core.events.borrow_mut().conn_requests.push_back(req);
}

/// An endpoint's failure: queued for [`Worker::take_errors`].
pub(super) unsafe extern "C" fn on_ep_error(arg: *mut c_void, ep: Handle, status: sys::Status) {
    // SAFETY: as in `on_conn_request`: `arg` is the endpoint's core.
    let core = unsafe { &*(arg as *const Core) };
    let text = core.ctx.api.status_text(status);
    core.events.borrow_mut().errors.push((EpKey::of(ep), text));
}

/// An active message: header and data copied (eager), or its data received into a buffer of
/// ours (rendezvous), then queued for [`Worker::take_message`].
unsafe extern "C" fn on_message(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::AmRecvParam,
) -> sys::Status {
    // SAFETY: `arg` is the boxed AmArg of `Worker::receive`, alive with the core.
    let arg = unsafe { &*(arg as *const AmArg) };
    let id = arg.id;
    // SAFETY: the core outlives its handlers; this runs inside its progress.
    let core = unsafe { &*arg.core };
    // SAFETY: UCX passes a valid param for the duration of the callback.
    let param = unsafe { &*param };
    let from = (param.recv_attr & sys::AM_RECV_ATTR_FIELD_REPLY_EP != 0)
        .then(|| EpKey::of(param.reply_ep));
    if header_length > arg.max_header || length > arg.max_data {
        if let Some(ep) = from {
            core.events.borrow_mut().errors.push((
                ep,
                format!(
                    "the peer sent an active message of {header_length} + {length} bytes, over \
                     the limits of {} + {}",
                    arg.max_header, arg.max_data
                ),
            ));
        }
        // Dropped: UCX releases eager data and a rendezvous descriptor when the callback
        // returns UCS_OK without taking them.
        return sys::UCS_OK;
    }
    let copy = |p: *const c_void, n: usize| -> Vec<u8> {
        if n == 0 || p.is_null() {
            Vec::new()
        } else {
            // SAFETY: UCX guarantees `n` readable bytes at `p` during the callback.
            unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n) }.to_vec()
        }
    };
    let mut message = Message {
        id,
        header: copy(header, header_length),
        data: Vec::new(),
        from,
    };
    if param.recv_attr & sys::AM_RECV_ATTR_FLAG_RNDV == 0 {
        message.data = copy(data, length);
        core.events.borrow_mut().messages.push_back(message);
        return sys::UCS_OK;
    }
    // Rendezvous: `data` is a descriptor; the bytes are received by the next progress (UCX
    // asks that it not be done inside this callback).
    message.data = buffer(core, length);
    core.events.borrow_mut().announced.push((data, message));
    sys::UCS_INPROGRESS
}
