//! UCX (libucp), loaded at run time: the layer `pd.transport = "ucx"` is built on. A
//! [`Context`] per process, a [`Worker`] per progress thread, [`Endpoint`]s to peers with active
//! messages for control frames and RMA puts for page bytes, straight into memory a peer
//! [`Context::register`]ed and whose packed remote key it sent over.
//!
//! Nothing here links against UCX: `sys` resolves the ~35 entry points from `libucp.so.0` (or
//! the library `pd.ucx_library` names) when a context is made, and a machine without it gets an
//! error naming the package to install.

mod context;
mod endpoint;
pub mod lanes;
mod request;
mod sockaddr;
pub mod sys;
mod worker;

pub use context::{Context, Registered};
pub use endpoint::{Endpoint, EpKey, RemoteKey};
pub use request::Request;
pub use worker::{Listener, Message, Worker};
