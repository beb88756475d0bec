//! Pools + prefix tree (+ the optional host tier): how a request's state is started (from a
//! device or host hit when possible), grown, snapshotted and ended, with every page, slot and
//! snapshot reference accounted for on both tiers.
//!
//! A request holds one reference on each page of its page table (shared or its own), one slot
//! and, while decoding, the snapshot of its latest page boundary. The tree holds one reference
//! on each device page and snapshot it adopted, and on each host unit. A backup in flight holds
//! a reference on the device pages it reads; a load-back owns the device pages it fills until
//! the tree adopts them. A match locks the tree path it resumes from until the request ends, so
//! nodes in use are never evicted from either tier. Copies run in submission order (one copy
//! queue), which is what makes freeing a host unit with a copy still queued safe.
//!
//! The code is split by job: `lifecycle` (start, reserve, after_step, finish, abort),
//! `snapshots` (where prompt snapshots are taken), `hicache_io` (backups, load-backs and
//! their polling), `evict` (both tiers' LRU eviction and flushes), `transfer` (export and
//! import of a running request), `stats` (counters and the JSON report) and `check` (the
//! audit of every reference).

mod check;
mod evict;
mod hicache_io;
mod lifecycle;
mod snapshots;
mod stats;
mod transfer;

use std::sync::Arc;

use crate::backend::{Backend, Ticket};
use crate::config::params::WritePolicy;
use crate::error::{Error, Result};

use super::hicache::HostPools;
use super::ids::{PageId, SnapshotId};
use super::pools::{KvPools, SeqKv};
use super::radix::{NodeId, RadixTree};
pub use stats::CacheStats;

/// A load-back in flight for a request.
#[derive(Debug)]
struct Loading {
    ticket: Arc<Ticket>,
    /// Nodes being filled and the device pages they get.
    nodes: Vec<(NodeId, Vec<PageId>)>,
    /// The snapshot node, its boundary, the device unit to restore from, and whether that unit
    /// was loaded by this request (then the tree adopts it).
    snap: (NodeId, u32, SnapshotId, bool),
    /// The whole reusable prefix's device pages, in order.
    pages: Vec<PageId>,
    resume: usize,
    host_tokens: usize,
}

/// One request's KV state and cache bookkeeping.
#[derive(Debug)]
pub struct Request {
    kv: SeqKv,
    salt: Option<String>,
    prompt_len: usize,
    lock: Option<NodeId>,
    /// Tokens skipped thanks to a cache hit, and how many of them came from the host tier.
    reused: usize,
    reused_host: usize,
    /// The snapshot of the latest page boundary passed while decoding: `(tokens, snapshot)`.
    latest: Option<(usize, SnapshotId)>,
    loading: Option<Loading>,
    /// Where this prompt leaves the cached pages with no snapshot there (a branch point): it
    /// is snapshotted too, so the next prompt sharing that prefix can resume at it.
    branch: Option<usize>,
}

impl Request {
    pub fn kv(&self) -> &SeqKv {
        &self.kv
    }

    pub fn kv_mut(&mut self) -> &mut SeqKv {
        &mut self.kv
    }

    pub fn position(&self) -> usize {
        self.kv.position()
    }

    /// Prompt tokens taken from the cache (the request starts computing here), once any
    /// load-back has landed.
    pub fn reused_tokens(&self) -> usize {
        self.reused
    }

    /// Of those, tokens loaded back from the host tier.
    pub fn reused_host_tokens(&self) -> usize {
        self.reused_host
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// A load-back from the host tier is still in flight: the request cannot run yet.
    pub fn is_loading(&self) -> bool {
        self.loading.is_some()
    }
}

/// Which tier a flush empties.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Device copies (host copies stay; write_back writes back first).
    Device,
    /// Host copies.
    Host,
    /// Both.
    All,
}

struct HostTier {
    pools: HostPools,
    policy: WritePolicy,
    backups: Vec<Backup>,
    /// Load-backs in flight (their requests track them; kept here so drop waits for them).
    loads: Vec<Arc<Ticket>>,
}

/// A backup in flight: the device units it reads stay referenced until it lands.
struct Backup {
    ticket: Arc<Ticket>,
    pages: Vec<PageId>,
    snaps: Vec<SnapshotId>,
    tokens: usize,
}

/// The KV pools of one engine with exact prefix reuse on up to two tiers.
pub struct PrefixCache<B: Backend> {
    pools: KvPools<B>,
    tree: RadixTree,
    interval: usize,
    stats: CacheStats,
    host: Option<HostTier>,
    /// `kv.prefix_cache`: off, requests neither match nor insert (every prompt is computed).
    reuse: bool,
}

impl<B: Backend> PrefixCache<B> {
    /// `snapshot_interval` tokens between prompt snapshots (a multiple of the page size;
    /// `kv.snapshot_interval_tokens`).
    pub fn new(pools: KvPools<B>, snapshot_interval: usize) -> Result<Self> {
        let page = pools.page_size();
        if snapshot_interval == 0 || !snapshot_interval.is_multiple_of(page) {
            return Err(Error::config(format!(
                "kv.snapshot_interval_tokens = {snapshot_interval} is not a positive multiple of \
                 kv.page_size = {page}: use {}",
                snapshot_interval.max(1).next_multiple_of(page)
            )));
        }
        Ok(Self {
            tree: RadixTree::new(page),
            pools,
            interval: snapshot_interval,
            stats: CacheStats::default(),
            host: None,
            reuse: true,
        })
    }

    /// Turns prefix reuse off (`kv.prefix_cache = false`): the pools still serve requests, but
    /// nothing is matched, snapshotted or inserted.
    pub fn without_reuse(mut self) -> Self {
        self.reuse = false;
        self
    }

    /// Prompt tokens a request for `prompt` would skip right now, and how many of them are on
    /// the device: `(reusable, device)`. Read-only (no lock, no LRU touch).
    pub fn peek(&self, salt: Option<&str>, prompt: &[u32]) -> (usize, usize) {
        self.peek_into(salt, prompt, None)
    }

    /// [`Self::peek`], appending the device pages a hit would share to `pages`. Like `start`,
    /// it matches all but the last prompt token (that one is always computed).
    fn peek_into(
        &self,
        salt: Option<&str>,
        prompt: &[u32],
        pages: Option<&mut Vec<PageId>>,
    ) -> (usize, usize) {
        if !self.reuse || prompt.is_empty() {
            return (0, 0);
        }
        let with_host = self.host.is_some();
        self.tree
            .peek(salt, &prompt[..prompt.len() - 1], with_host, pages)
    }

    /// Pages a request for `prompt` would still need from the free pool to hold `tokens`
    /// tokens, and the pages that could be found for it: the free ones plus the cached ones
    /// eviction could give back (not counting the cached pages it would share, which it locks).
    pub fn page_budget(&self, salt: Option<&str>, prompt: &[u32], tokens: usize) -> (usize, usize) {
        let alloc = self.pools.page_allocator();
        let mut shared = Vec::new();
        self.peek_into(salt, prompt, Some(&mut shared));
        shared.sort_unstable();
        let reclaimable = self
            .tree
            .unlocked_device_pages()
            .filter(|&p| alloc.refs(p) == 1 && shared.binary_search(&p).is_err())
            .count();
        let need = self.pools.pages_for(tokens).saturating_sub(shared.len());
        (need, alloc.free_count() + reclaimable)
    }

    /// Adds the host tier with its write policy.
    pub fn with_host(mut self, host: HostPools, policy: WritePolicy) -> Self {
        self.host = Some(HostTier {
            pools: host,
            policy,
            backups: Vec::new(),
            loads: Vec::new(),
        });
        self
    }

    pub fn pools(&self) -> &KvPools<B> {
        &self.pools
    }

    pub fn pools_mut(&mut self) -> &mut KvPools<B> {
        &mut self.pools
    }

    pub fn host_pools(&self) -> Option<&HostPools> {
        self.host.as_ref().map(|h| &h.pools)
    }

    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    fn policy(&self) -> Option<WritePolicy> {
        self.host.as_ref().map(|h| h.policy)
    }
}

impl<B: Backend> Drop for PrefixCache<B> {
    /// Copies write into pool and host memory: they land before either is freed.
    fn drop(&mut self) {
        if let Some(h) = &self.host {
            for b in &h.backups {
                b.ticket.wait();
            }
            for t in &h.loads {
                t.wait();
            }
        }
    }
}
