//! Prefill/decode disaggregation: a prefill engine computes a prompt's KV and state and hands
//! them to a decode engine, which generates the rest.
//!
//! The protocol (docs/pd.md): the decode reserves the destination under its own admission,
//! connects to the prefill (one connection per peer, shared by its rooms) and claims the room
//! with its request's digest and the destination units; the prefill runs the prompt and sends
//! the state header (regions, position, RNG state, first token), the bytes in capped DATA
//! frames, and a DONE frame with the length and a CRC-32C of everything sent; the decode checks
//! every length and the checksum, writes the state into its pools and acknowledges. Rooms only
//! move forward ([`room::RoomState`]); every failure ends the room on both sides with a reason.
//!
//! `wire`: frames; `room`: room states and failure reasons; `link`: one connection's reader
//! and writer threads and heartbeats; `node`: the listener, the rooms and their deadlines;
//! `ucx_port`: the UCX thread, with `rma`: the state written straight into the decode's memory;
//! `wake`: the listener's wait, which a shutdown ends. Who may be a peer (docs/security.md):
//! `auth` (the key file, proofs, keyed digests), `handshake` (the challenge-response as
//! frames), `seal` (every frame's MAC on an authenticated link), `tls` (TCP links encrypted,
//! the handshake bound to the session), `bounds` (what a peer may hold: links, handshakes,
//! queued bytes, time).

pub mod auth;
#[cfg(test)]
mod batching_tests;
pub mod bounds;
pub mod buffers;
mod deferred;
pub mod handshake;
pub mod in_order;
pub mod incoming;
pub mod limits;
pub mod link;
pub mod node;
pub mod rma;
#[cfg(test)]
mod rma_tests;
pub mod room;
pub mod seal;
#[cfg(test)]
mod test_rooms;
pub mod tls;
pub mod ucx;
pub mod ucx_faults;
pub mod ucx_port;
mod wake;
pub mod wire;

pub use bounds::PeerBounds;
pub use buffers::{StateBuf, StateBuffers};
pub use node::{Config, Delivery, Node, Notice, PdStats, Sink};
pub use room::{FailReason, RoomState};
pub use wire::{Claim, Side, StateHeader, StateInfo};
