//! The KV cache: DeepSeek V4 state in the pools the planner sizes (docs/kv-cache.md
//! "Pools"), and exact prefix reuse across requests.
//!
//! - [`ids`]: typed unit ids (device/host pages and snapshots, tree nodes).
//! - [`layout`]: where each layer's rows, rings and frontiers live in each pool.
//! - [`pools`]: the device pools, their allocators and the per-request handle [`SeqKv`].
//! - [`radix`]: the prefix tree over token pages, with snapshots at page boundaries.
//! - [`cache`]: pools + tree: starting, growing, snapshotting and ending requests.
//! - [`regions`]: each pool's memory as one `(addr, len)` region a transport can register.
//! - [`spans`]: a sequence's bytes spread over memory spans (a destination, local or remote).
//! - [`state`]: one sequence's state as byte regions: export, read, import into other pools.
//!
//! `kv` stores bytes in a geometry `plan` defines; it never imports `model`.

pub mod cache;
pub mod hicache;
pub mod ids;
pub mod landing;
pub mod layout;
pub mod pools;
pub mod radix;
pub mod regions;
pub mod spans;
pub mod state;
pub mod units;

pub use cache::{CacheStats, PrefixCache, Request};
pub use ids::{HostPageId, HostSnapshotId, NodeId, PageId, SnapshotId};
pub use landing::Landing;
pub use layout::{KvLayout, PoolId, Stream};
pub use pools::{KvPools, SeqKv};
pub use radix::RadixTree;
pub use regions::PoolRegion;
pub use state::{LayoutFingerprint, Region, RegionTier, SequenceState};
pub use units::{UnitAllocator, UnitCounts};
