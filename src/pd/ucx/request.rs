//! One non-blocking UCP operation (a put, an active message, a flush, a close): done at once,
//! failed at once, or pending until the worker's progress completes it.

use std::any::Any;
use std::ffi::c_void;
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::sys::{self, StatusPtr};
use super::worker::Core;

enum State {
    Pending(*mut c_void),
    Ended(Result<(), String>),
}

/// An operation in flight. Owns whatever buffers the operation reads or writes (`keep`), so
/// they live until UCX is done with them. Dropping a pending request asks UCX to cancel it
/// (which UCX 1.13 does only for tag receives: a send, put, flush or close goes on) and
/// progresses the worker until it completes, at most 5 s; after that its buffers leak rather
/// than be freed under UCX. [`Self::abandon`] leaks them at once.
pub struct Request {
    core: Rc<Core>,
    state: State,
    what: &'static str,
    keep: Option<Box<dyn Any>>,
}

impl Request {
    /// The result of a `*_nbx` call. An immediate failure is an `Err`.
    pub(super) fn start(
        core: &Rc<Core>,
        ptr: *mut c_void,
        what: &'static str,
        keep: Option<Box<dyn Any>>,
    ) -> Result<Request, String> {
        let state = match StatusPtr::of(ptr) {
            StatusPtr::Done => State::Ended(Ok(())),
            StatusPtr::Failed(status) => return Err(core.ctx.api.check(status, what).unwrap_err()),
            StatusPtr::Pending(p) => State::Pending(p),
        };
        Ok(Request {
            core: core.clone(),
            state,
            what,
            keep,
        })
    }

    /// `None` while in flight; the outcome once done (call the worker's progress in between).
    pub fn poll(&mut self) -> Option<Result<(), String>> {
        if let State::Pending(p) = self.state {
            let api = &self.core.ctx.api;
            // SAFETY: `p` is a live request of this worker, not freed yet.
            let status = unsafe { (api.ucp_request_check_status)(p) };
            if status == sys::UCS_INPROGRESS {
                return None;
            }
            // SAFETY: completed, freed once; the state forgets the pointer.
            unsafe { (api.ucp_request_free)(p) };
            self.state = State::Ended(api.check(status, self.what));
        }
        match &self.state {
            State::Ended(r) => Some(r.clone()),
            State::Pending(_) => unreachable!("resolved above"),
        }
    }

    /// Progresses the worker until the operation is done or `timeout` passes.
    pub fn wait(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.poll() {
                return r;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!("{}: not done after {timeout:?}", self.what));
            }
            if self.core.progress() == 0 {
                self.core.wait(deadline - now, None);
            }
        }
    }
}

impl Request {
    /// Gives the operation up without waiting: its buffers and the request leak (the worker's
    /// teardown ends the operation). For shutdowns that must not wait on a dead peer.
    pub fn abandon(mut self) {
        if let State::Pending(_) = self.state {
            std::mem::forget(self.keep.take());
            self.state = State::Ended(Err("abandoned".into()));
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let State::Pending(p) = self.state else {
            return;
        };
        // SAFETY: `p` is a live request of this worker. Cancelling completes a receive at a
        // later progress; other operations complete on their own as the worker progresses.
        unsafe { (self.core.ctx.api.ucp_request_cancel)(self.core.h, p) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.poll().is_none() {
            if Instant::now() >= deadline {
                // UCX still holds the buffers: leaking them is the only safe choice left.
                log::error!(
                    "{}: still in flight 5 s after its cancel; its buffers leak",
                    self.what
                );
                std::mem::forget(self.keep.take());
                return;
            }
            self.core.progress();
        }
    }
}
