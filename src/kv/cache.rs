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

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::backend::{Backend, CopyDirection, Ticket};
use crate::config::params::WritePolicy;
use crate::error::{Error, Result};

use super::hicache::HostPools;
use super::layout::PoolId;
use super::pools::{KvPools, SeqKv};
use super::radix::{Evicted, NodeId, RadixTree, Snap};
use super::state::{self, SequenceState};

/// A load-back in flight for a request.
#[derive(Debug)]
struct Loading {
    ticket: Arc<Ticket>,
    /// Nodes being filled and the device pages they get.
    nodes: Vec<(NodeId, Vec<u32>)>,
    /// The snapshot node, its boundary, the device unit to restore from, and whether that unit
    /// was loaded by this request (then the tree adopts it).
    snap: (NodeId, u32, u32, bool),
    /// The whole reusable prefix's device pages, in order.
    pages: Vec<u32>,
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
    latest: Option<(usize, u32)>,
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

/// Cache counters since creation.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct CacheStats {
    pub requests: u64,
    pub hits: u64,
    pub reused_tokens: u64,
    pub device_hits: u64,
    pub device_hit_tokens: u64,
    pub host_hits: u64,
    pub host_hit_tokens: u64,
    pub snapshots_taken: u64,
    /// Snapshot points skipped because no snapshot unit could be freed.
    pub snapshots_skipped: u64,
    pub loadbacks: u64,
    pub loadback_tokens: u64,
    pub loadback_bytes: u64,
    pub loadback_seconds: f64,
    /// Host hits served as misses because device pages for the load could not be found.
    pub loadbacks_skipped: u64,
    pub backups: u64,
    pub backup_tokens: u64,
    pub backup_bytes: u64,
    pub backup_seconds: f64,
    /// Backups not made because the host tier had no room.
    pub backups_skipped: u64,
    /// Device evictions that kept a host copy (made earlier, or written back just then).
    pub evicted_to_host: u64,
    /// Device evictions that dropped the prefix (no host copy).
    pub evicted_dropped: u64,
    pub evicted_pages: u64,
    pub evicted_snapshots: u64,
    /// Host copies dropped to make room or by a flush.
    pub host_evictions: u64,
    pub host_evicted_pages: u64,
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
    pages: Vec<u32>,
    snaps: Vec<u32>,
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
        pages: Option<&mut Vec<u32>>,
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

    // --- starting ------------------------------------------------------------------------

    /// Starts a request for `prompt`: takes a slot and, on a hit, restores the deepest cached
    /// snapshot and shares the pages before it — at once for a device hit; for a host hit the
    /// missing pages and snapshot are loaded back first (`is_loading` until `complete_load`).
    /// At least the last prompt token is always computed (its logits start generation).
    pub fn start(&mut self, salt: Option<&str>, prompt: &[u32]) -> Result<Request> {
        if prompt.is_empty() {
            return Err(Error::invalid_argument(
                "an empty prompt: pass at least one token",
            ));
        }
        let kv = self.pools.open()?;
        self.stats.requests += 1;
        let with_host = self.host.is_some();
        let m = if self.reuse {
            self.tree
                .match_prefix(salt, &prompt[..prompt.len() - 1], with_host)
        } else {
            super::radix::Match::default()
        };
        if self.policy() == Some(WritePolicy::WriteThroughSelective) {
            for node in &m.second_hits {
                self.backup(*node);
            }
        }
        let mut req = Request {
            kv,
            salt: salt.map(str::to_owned),
            prompt_len: prompt.len(),
            lock: m.lock,
            reused: 0,
            reused_host: 0,
            latest: None,
            loading: None,
            // Cached pages run past the deepest snapshot: several prompts share them (a system
            // prompt) but nobody could resume there until a state is captured at the end.
            branch: (m.matched_tokens > m.reusable_tokens).then_some(m.matched_tokens),
        };
        let (Some((snap_node, snap)), Some(_)) = (m.snapshot, m.lock) else {
            return Ok(req);
        };
        if let (true, Some(unit)) = (m.load.is_empty(), snap.device) {
            self.pools.share_pages(&mut req.kv, &m.pages);
            if let Err(e) = self.pools.restore(&req.kv, unit) {
                self.release(req);
                return Err(e);
            }
            self.pools.set_position(&mut req.kv, m.reusable_tokens);
            req.reused = m.reusable_tokens;
            self.stats.hits += 1;
            self.stats.device_hits += 1;
            self.stats.reused_tokens += req.reused as u64;
            self.stats.device_hit_tokens += req.reused as u64;
            return Ok(req);
        }
        match self.start_load(&m, snap_node, snap) {
            Some(loading) => req.loading = Some(loading),
            None => {
                // No device room for the load: a cold start.
                self.stats.loadbacks_skipped += 1;
                if let Some(node) = req.lock.take() {
                    self.tree.unlock(node);
                }
            }
        }
        Ok(req)
    }

    /// Queues the load-back of a host hit; None when the device pages cannot be found.
    fn start_load(
        &mut self,
        m: &super::radix::Match,
        snap_node: NodeId,
        snap: Snap,
    ) -> Option<Loading> {
        let pages_needed: usize = m.load.iter().map(|(_, h)| h.len()).sum();
        let snap_needed = usize::from(snap.device.is_none());
        if self.pools.page_allocator().free_count() < pages_needed
            || self.pools.snapshot_allocator().free_count() < snap_needed
        {
            self.evict_until(|p| {
                p.page_allocator().free_count() >= pages_needed
                    && p.snapshot_allocator().free_count() >= snap_needed
            });
        }
        let pages = self.pools.alloc_pages(pages_needed)?;
        let snap_unit = match snap.device {
            Some(u) => (u, false),
            None => match self.pools.alloc_snapshot() {
                Some(u) => (u, true),
                None => {
                    for p in pages {
                        self.pools.release_page(p);
                    }
                    return None;
                }
            },
        };
        let ticket = Ticket::new();
        let host = self.host.as_ref().expect("host hits need the host tier");
        let mut nodes = Vec::new();
        let mut pairs = Vec::new();
        let mut next = pages.iter().copied();
        for (node, host_pages) in &m.load {
            let device: Vec<u32> = next.by_ref().take(host_pages.len()).collect();
            pairs.extend(device.iter().copied().zip(host_pages.iter().copied()));
            nodes.push((*node, device));
        }
        let mut queued =
            host.pools
                .copy_pages(&self.pools, CopyDirection::FromHost, &pairs, &ticket);
        if queued.is_ok() && snap_unit.1 {
            let host_unit = snap
                .host
                .expect("a host snapshot when there is no device copy");
            queued = host.pools.copy_snapshots(
                &self.pools,
                CopyDirection::FromHost,
                &[(snap_unit.0, host_unit)],
                &ticket,
            );
        }
        if let Err(e) = queued {
            // The parts already queued write into the pages taken above: let them land
            // before those pages go back, then serve the request as a cold start.
            ticket.seal();
            ticket.wait();
            log::error!("a load-back could not be queued ({e}); the request starts cold");
            for p in pages {
                self.pools.release_page(p);
            }
            if snap_unit.1 {
                self.pools.release_snapshot(snap_unit.0);
            }
            return None;
        }
        for (node, _) in &nodes {
            self.tree.set_loading(*node);
        }
        ticket.seal();
        self.host
            .as_mut()
            .expect("checked")
            .loads
            .push(ticket.clone());
        let mut all = m.pages.clone();
        all.extend_from_slice(&pages);
        Some(Loading {
            ticket,
            nodes,
            snap: (snap_node, snap.end, snap_unit.0, snap_unit.1),
            pages: all,
            resume: m.reusable_tokens,
            host_tokens: m.reusable_tokens - m.device_tokens,
        })
    }

    /// Waits up to `wait` for `req`'s load-back to land (without completing it).
    pub fn wait_load(&self, req: &Request, wait: Duration) {
        if let Some(loading) = &req.loading {
            loading.ticket.wait_timeout(wait);
        }
    }

    /// Finishes `req`'s load-back if it has landed (waiting up to `wait`); returns whether the
    /// request can run. An error (the backend could not restore the loaded snapshot into the
    /// request's slot) leaves the request's references consistent: end it with `abort`.
    pub fn complete_load(&mut self, req: &mut Request, wait: Duration) -> Result<bool> {
        let Some(loading) = &req.loading else {
            return Ok(true);
        };
        if !loading.ticket.is_done() && !loading.ticket.wait_timeout(wait) {
            return Ok(false);
        }
        let l = req.loading.take().expect("checked");
        // The allocation references of the loaded pages and snapshot move to the tree.
        for (node, pages) in l.nodes {
            self.tree.set_device(node, pages);
        }
        self.pools.share_pages(&mut req.kv, &l.pages);
        let (node, end, unit, loaded) = l.snap;
        let restored = self.pools.restore(&req.kv, unit);
        if loaded && !self.tree.set_snap_device(node, end, unit) {
            self.pools.release_snapshot(unit);
        }
        restored?;
        self.pools.set_position(&mut req.kv, l.resume);
        req.reused = l.resume;
        req.reused_host = l.host_tokens;
        let bytes = l.ticket.bytes();
        self.stats.hits += 1;
        self.stats.host_hits += 1;
        self.stats.reused_tokens += l.resume as u64;
        self.stats.host_hit_tokens += l.host_tokens as u64;
        self.stats.device_hit_tokens += (l.resume - l.host_tokens) as u64;
        self.stats.loadbacks += 1;
        self.stats.loadback_tokens += l.host_tokens as u64;
        self.stats.loadback_bytes += bytes;
        self.stats.loadback_seconds += l.ticket.seconds();
        Ok(true)
    }

    // --- growing -------------------------------------------------------------------------

    /// Whether `tokens` is a prompt snapshot point of `req`.
    fn is_snapshot_point(&self, req: &Request, tokens: usize) -> bool {
        let page = self.pools.page_size();
        let last_boundary = req.prompt_len / page * page;
        tokens > 0
            && (tokens.is_multiple_of(self.interval)
                || tokens == last_boundary
                || Some(tokens) == req.branch)
    }

    /// Where the current prefill chunk of `req` must end at the latest: the next prompt
    /// snapshot point after its position, or the end of the prompt.
    pub fn chunk_limit(&self, req: &Request) -> usize {
        let page = self.pools.page_size();
        let pos = req.position();
        let mut at = (pos / page + 1) * page;
        while at < req.prompt_len {
            if self.is_snapshot_point(req, at) {
                return at;
            }
            at += page;
        }
        req.prompt_len
    }

    /// Gives `req` pages for its first `tokens` tokens, evicting cached prefixes when the
    /// free pages run short. All or nothing: `DSV4_ERR_CAPACITY` leaves `req` unchanged.
    pub fn reserve(&mut self, req: &mut Request, tokens: usize) -> Result<()> {
        let missing = self
            .pools
            .pages_for(tokens)
            .saturating_sub(req.kv.pages().len());
        if missing > self.pools.page_allocator().free_count() {
            self.evict_until(|pools| pools.page_allocator().free_count() >= missing);
        }
        self.pools.reserve(&mut req.kv, tokens)
    }

    /// A snapshot unit, evicting cached prefixes if needed; `None` when none can be freed.
    fn snapshot_unit(&mut self) -> Option<u32> {
        if let Some(s) = self.pools.alloc_snapshot() {
            return Some(s);
        }
        self.evict_until(|pools| pools.snapshot_allocator().free_count() > 0);
        self.pools.alloc_snapshot()
    }

    /// Call after every forward step of `req`; `tokens` are all its tokens so far (prompt and
    /// generated, `req.position()` of them). At a prompt snapshot point the state is captured
    /// and the prefix inserted; at a page boundary while decoding the state is captured for
    /// insertion when the request finishes.
    pub fn after_step(&mut self, req: &mut Request, tokens: &[u32]) -> Result<()> {
        let pos = req.position();
        if tokens.len() != pos {
            return Err(Error::invalid_argument(format!(
                "after_step got {} tokens for a request at position {pos}",
                tokens.len()
            )));
        }
        let page = self.pools.page_size();
        if !self.reuse || pos == 0 || !pos.is_multiple_of(page) || pos <= req.reused {
            return Ok(());
        }
        if pos <= req.prompt_len {
            if !self.is_snapshot_point(req, pos) {
                return Ok(());
            }
            if self.tree.has_device_snapshot(req.salt.as_deref(), tokens) {
                // Another request cached this boundary first; only the pages may be new.
                self.insert(req, tokens, None);
                return Ok(());
            }
            let Some(snap) = self.snapshot_unit() else {
                self.stats.snapshots_skipped += 1;
                self.insert(req, tokens, None);
                return Ok(());
            };
            self.pools.capture_into(&req.kv, snap)?;
            self.stats.snapshots_taken += 1;
            self.insert(req, tokens, Some(snap));
            // The tree took its own reference if it adopted the snapshot.
            self.pools.release_snapshot(snap);
        } else {
            // Decoding: keep the latest boundary's state for `finish`.
            let snap = match req.latest.take() {
                Some((_, s)) => s,
                None => match self.snapshot_unit() {
                    Some(s) => s,
                    None => {
                        self.stats.snapshots_skipped += 1;
                        return Ok(());
                    }
                },
            };
            self.pools.capture_into(&req.kv, snap)?;
            self.stats.snapshots_taken += 1;
            req.latest = Some((pos, snap));
        }
        Ok(())
    }

    /// Inserts `tokens` (cut to whole pages) with `req`'s pages and an optional snapshot at
    /// the end; the tree takes references on what it adopts; write_through backs it up.
    fn insert(&mut self, req: &Request, tokens: &[u32], snapshot: Option<u32>) {
        let page = self.pools.page_size();
        let n = tokens.len() / page * page;
        if n == 0 {
            return;
        }
        let snaps: Vec<(usize, u32)> = snapshot.map(|s| (n, s)).into_iter().collect();
        let adopted = self
            .tree
            .insert(req.salt.as_deref(), &tokens[..n], req.kv.pages(), &snaps);
        for &p in &adopted.pages {
            self.pools.retain_page(p);
        }
        for &s in &adopted.snapshots {
            self.pools.retain_snapshot(s);
        }
        if self.policy() == Some(WritePolicy::WriteThrough) {
            for node in adopted.nodes {
                self.backup(node);
            }
        }
    }

    // --- the host tier ---------------------------------------------------------------------

    /// Copies what `node` has on the device and not on the host (pages, snapshots) to the
    /// host tier, asynchronously. Skipped (counted) when the host has no room.
    fn backup(&mut self, node: NodeId) -> Option<Arc<Ticket>> {
        if self.host.is_none() || !self.tree.is_live(node) {
            return None;
        }
        let (pages, snaps) = if self.tree.has_host_copy(node) {
            (Vec::new(), self.tree.snaps_without_host(node))
        } else {
            self.tree.device_data(node)
        };
        if pages.is_empty() && snaps.is_empty() {
            return None;
        }
        // Keep this node out of host eviction while making room for it.
        self.tree.lock(node);
        let room = self.host_room(pages.len(), snaps.len());
        self.tree.unlock(node);
        if !room {
            self.stats.backups_skipped += 1;
            return None;
        }
        let host = self.host.as_mut().expect("checked");
        let host_pages = host.pools.page_allocator_mut().alloc(pages.len())?;
        let host_snaps = host.pools.snapshot_allocator_mut().alloc(snaps.len())?;
        let ticket = Ticket::new();
        let page_pairs: Vec<(u32, u32)> = pages
            .iter()
            .copied()
            .zip(host_pages.iter().copied())
            .collect();
        let snap_pairs: Vec<(u32, u32)> = snaps
            .iter()
            .map(|s| s.1)
            .zip(host_snaps.iter().copied())
            .collect();
        let queued = host
            .pools
            .copy_pages(&self.pools, CopyDirection::ToHost, &page_pairs, &ticket)
            .and_then(|()| {
                host.pools
                    .copy_snapshots(&self.pools, CopyDirection::ToHost, &snap_pairs, &ticket)
            });
        ticket.seal();
        if let Err(e) = queued {
            // Let the parts already queued land before their host units go back.
            ticket.wait();
            log::error!("a backup to the host tier could not be queued ({e}); skipped");
            for u in host_pages.into_iter() {
                host.pools.page_allocator_mut().release(u);
            }
            for u in host_snaps.into_iter() {
                host.pools.snapshot_allocator_mut().release(u);
            }
            self.stats.backups_skipped += 1;
            return None;
        }
        for &p in &pages {
            self.pools.retain_page(p);
        }
        for s in &snaps {
            self.pools.retain_snapshot(s.1);
        }
        let host_snap_entries: Vec<(u32, u32)> = snaps
            .iter()
            .map(|s| s.0)
            .zip(host_snaps.iter().copied())
            .collect();
        self.tree.set_host(node, host_pages, &host_snap_entries);
        let tokens = pages.len() * self.pools.page_size();
        self.host.as_mut().expect("checked").backups.push(Backup {
            ticket: ticket.clone(),
            pages,
            snaps: snaps.iter().map(|s| s.1).collect(),
            tokens,
        });
        Some(ticket)
    }

    /// Frees host units (evicting host copies, least recently used first) until `pages` host
    /// pages and `snaps` host snapshots are free.
    fn host_room(&mut self, pages: usize, snaps: usize) -> bool {
        let enough = |h: &HostPools| {
            h.page_allocator().free_count() >= pages && h.snapshot_allocator().free_count() >= snaps
        };
        loop {
            let Some(host) = &self.host else { return false };
            if enough(&host.pools) {
                return true;
            }
            let victims = self.tree.host_victims();
            if victims.is_empty() {
                return false;
            }
            for v in victims {
                if enough(&self.host.as_ref().expect("checked").pools) {
                    return true;
                }
                if self.tree.host_evictable(v) {
                    let ev = self.tree.drop_host(v);
                    self.stats.host_evictions += 1;
                    self.stats.host_evicted_pages += ev.host_pages.len() as u64;
                    self.give_back(ev);
                }
            }
        }
    }

    /// Completes landed backups (their device references go back). Call regularly.
    pub fn poll(&mut self) {
        let Some(host) = &mut self.host else { return };
        host.loads.retain(|t| !t.is_done());
        let mut landed = Vec::new();
        host.backups.retain(|b| {
            if b.ticket.is_done() {
                landed.push((
                    b.pages.clone(),
                    b.snaps.clone(),
                    b.tokens,
                    b.ticket.bytes(),
                    b.ticket.seconds(),
                ));
                false
            } else {
                true
            }
        });
        for (pages, snaps, tokens, bytes, seconds) in landed {
            for p in pages {
                self.pools.release_page(p);
            }
            for s in snaps {
                self.pools.release_snapshot(s);
            }
            self.stats.backups += 1;
            self.stats.backup_tokens += tokens as u64;
            self.stats.backup_bytes += bytes;
            self.stats.backup_seconds += seconds;
        }
    }

    /// Copies still in flight (backups, not counting load-backs, which requests track).
    pub fn backups_in_flight(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.backups.len())
    }

    /// Waits for every backup in flight.
    pub fn wait_backups(&mut self) {
        if let Some(h) = &self.host {
            for b in &h.backups {
                b.ticket.wait();
            }
        }
        self.poll();
    }

    fn give_back(&mut self, ev: Evicted) {
        for p in ev.pages {
            self.pools.release_page(p);
        }
        for s in ev.snapshots {
            self.pools.release_snapshot(s);
        }
        if let Some(h) = &mut self.host {
            for p in ev.host_pages {
                h.pools.page_allocator_mut().release(p);
            }
            for s in ev.host_snapshots {
                h.pools.snapshot_allocator_mut().release(s);
            }
        }
    }

    // --- eviction ----------------------------------------------------------------------------

    /// Device eviction of one node per the write policy.
    fn evict_device_node(&mut self, v: NodeId, keep_host: bool) {
        if keep_host && !self.tree.has_host_copy(v) && self.policy() == Some(WritePolicy::WriteBack)
        {
            if let Some(t) = self.backup(v) {
                // Written back synchronously: the device pages are needed now.
                t.wait();
                self.poll();
            }
        }
        let ev = if keep_host && self.tree.has_host_copy(v) {
            self.stats.evicted_to_host += 1;
            self.tree.drop_device(v)
        } else {
            self.stats.evicted_dropped += 1;
            self.tree.remove_subtree(v)
        };
        self.stats.evicted_pages += ev.pages.len() as u64;
        self.stats.evicted_snapshots += ev.snapshots.len() as u64;
        self.give_back(ev);
    }

    fn evict_until(&mut self, enough: impl Fn(&KvPools<B>) -> bool) -> bool {
        self.poll();
        if self.evict_device_until(&enough, true) {
            return true;
        }
        // Backups in flight still hold device pages: let them land, then try again.
        if self.backups_in_flight() > 0 {
            self.wait_backups();
            return self.evict_device_until(&enough, true);
        }
        false
    }

    fn evict_device_until(
        &mut self,
        enough: &dyn Fn(&KvPools<B>) -> bool,
        keep_host: bool,
    ) -> bool {
        loop {
            if enough(&self.pools) {
                return true;
            }
            let victims = self.tree.device_victims();
            if victims.is_empty() {
                return false;
            }
            for v in victims {
                if enough(&self.pools) {
                    return true;
                }
                if self.tree.device_evictable(v) {
                    self.evict_device_node(v, keep_host);
                }
            }
        }
    }

    /// Evicts cached prefixes (least recently used unlocked leaves first) until at least
    /// `pages` pages and `snapshots` snapshot units are free; false when that is impossible.
    pub fn evict(&mut self, pages: usize, snapshots: usize) -> bool {
        self.evict_until(|p| {
            p.page_allocator().free_count() >= pages
                && p.snapshot_allocator().free_count() >= snapshots
        })
    }

    /// Drops every unlocked cached prefix from `tier` (flushing the device keeps host copies;
    /// with write_back they are written first).
    pub fn flush(&mut self, tier: Tier) {
        self.poll();
        match tier {
            Tier::Device => {
                self.evict_device_until(&|_| false, true);
            }
            Tier::Host => {
                self.host_room(usize::MAX, usize::MAX);
            }
            Tier::All => {
                self.wait_backups();
                self.host_room(usize::MAX, usize::MAX);
                self.evict_device_until(&|_| false, false);
            }
        }
    }

    /// Drops every unlocked cached prefix on both tiers.
    pub fn clear(&mut self) {
        self.flush(Tier::All);
    }

    // --- moving a request to other pools ---------------------------------------------------

    /// The state of `req` in these pools ([`state::export`]): regions only, nothing copied;
    /// read them with [`state::read`] on [`Self::pools`] before `req` steps or ends.
    pub fn export(&self, req: &Request) -> Result<SequenceState> {
        if req.is_loading() {
            return Err(Error::invalid_argument(
                "the request is still loading its prefix back from the host tier: export it \
                 after complete_load returns true",
            ));
        }
        Ok(state::export(&self.pools, &req.kv))
    }

    /// A request rebuilt from an exported state and its bytes ([`state::import`]), evicting
    /// cached prefixes when the free pages run short (only once the state passed its checks).
    /// It continues a prompt of `prompt_len` tokens under `salt`: snapshots, insertion and
    /// `finish` work as for any request given all its tokens. It holds no tree lock and counts
    /// no reused tokens. Refusals take nothing (see [`state::import`]).
    pub fn import(
        &mut self,
        salt: Option<&str>,
        prompt_len: usize,
        state: &SequenceState,
        bytes: &[u8],
    ) -> Result<Request> {
        let pages = state::check_import(&self.pools, state, bytes)?;
        // Evicting cannot make a slot free.
        if pages > self.pools.page_allocator().free_count()
            && self.pools.slot_allocator().free_count() > 0
        {
            self.evict_until(|pools| pools.page_allocator().free_count() >= pages);
        }
        let kv = state::import(&mut self.pools, state, bytes)?;
        self.stats.requests += 1;
        Ok(Request {
            kv,
            salt: salt.map(str::to_owned),
            prompt_len,
            lock: None,
            reused: 0,
            reused_host: 0,
            latest: None,
            loading: None,
            branch: None,
        })
    }

    // --- ending ------------------------------------------------------------------------------

    /// Ends a finished request: its sequence up to the latest captured page boundary goes into
    /// the cache, then every reference it held is released.
    pub fn finish(&mut self, mut req: Request, tokens: &[u32]) {
        self.settle_load(&mut req);
        if let Some((at, snap)) = req.latest.take() {
            if at <= tokens.len() {
                self.insert(&req, &tokens[..at], Some(snap));
            }
            self.pools.release_snapshot(snap);
        }
        self.release(req);
    }

    /// Ends a request without caching anything more (abort, error). A load-back in flight is
    /// waited for (its pages are then the tree's).
    pub fn abort(&mut self, mut req: Request) {
        self.settle_load(&mut req);
        if let Some((_, snap)) = req.latest.take() {
            self.pools.release_snapshot(snap);
        }
        self.release(req);
    }

    /// Waits for a load-back in flight and hands its units to the tree, so `req` can be
    /// released (a failed restore only matters to a request that would run).
    fn settle_load(&mut self, req: &mut Request) {
        if let Err(e) = self.complete_load(req, Duration::MAX) {
            log::error!("ending a request whose load-back could not be restored: {e}");
        }
    }

    fn release(&mut self, req: Request) {
        if let Some(node) = req.lock {
            self.tree.unlock(node);
        }
        self.pools.close(req.kv);
    }

    // --- reports -----------------------------------------------------------------------------

    /// Per pool and tier: used / total units and bytes; the counters; the policy.
    pub fn stats_json(&self) -> Value {
        let mut pools = serde_json::Map::new();
        let layout = self.pools.layout();
        for id in PoolId::ALL {
            let unit = layout.unit_bytes(id) as u64;
            let (used, total) = match id {
                PoolId::C4Kv | PoolId::C4Indexer | PoolId::C128Kv => (
                    self.pools.page_allocator().used_count(),
                    self.pools.page_allocator().capacity(),
                ),
                PoolId::Snapshots => (
                    self.pools.snapshot_allocator().used_count(),
                    self.pools.snapshot_allocator().capacity(),
                ),
                _ => (
                    self.pools.slot_allocator().used_count(),
                    self.pools.slot_allocator().capacity(),
                ),
            };
            let mut entry = json!({"device": {
                "used_units": used, "total_units": total,
                "used_bytes": used as u64 * unit, "total_bytes": total as u64 * unit,
            }});
            if let Some(h) = &self.host {
                let host = match id {
                    PoolId::C4Kv | PoolId::C4Indexer | PoolId::C128Kv => {
                        Some(h.pools.page_allocator())
                    }
                    PoolId::Snapshots => Some(h.pools.snapshot_allocator()),
                    _ => None,
                };
                if let Some(a) = host {
                    entry["host"] = json!({
                        "used_units": a.used_count(), "total_units": a.capacity(),
                        "used_bytes": a.used_count() as u64 * unit,
                        "total_bytes": a.capacity() as u64 * unit,
                    });
                }
            }
            pools.insert(id.name().to_string(), entry);
        }
        let s = &self.stats;
        let rate = |bytes: u64, secs: f64| if secs > 0.0 { bytes as f64 / secs } else { 0.0 };
        json!({
            "page_size": self.pools.page_size(),
            "write_policy": self.policy().map(|p| serde_json::to_value(p).unwrap_or_default()),
            "pools": pools,
            "tree": {
                "nodes": self.tree.node_count(),
                "device_pages": self.tree.pages_held(),
                "device_snapshots": self.tree.snapshots_held(),
                "host_pages": self.tree.host_pages_held(),
                "host_snapshots": self.tree.host_snapshots_held(),
            },
            "requests": s.requests,
            "hits": {"total": s.hits, "device": s.device_hits, "host": s.host_hits},
            "hit_tokens": {"total": s.reused_tokens, "device": s.device_hit_tokens, "host": s.host_hit_tokens},
            "loadback": {"count": s.loadbacks, "tokens": s.loadback_tokens, "bytes": s.loadback_bytes,
                         "seconds": s.loadback_seconds, "bytes_per_s": rate(s.loadback_bytes, s.loadback_seconds),
                         "skipped_no_device_room": s.loadbacks_skipped},
            "backup": {"count": s.backups, "tokens": s.backup_tokens, "bytes": s.backup_bytes,
                       "seconds": s.backup_seconds, "bytes_per_s": rate(s.backup_bytes, s.backup_seconds),
                       "in_flight": self.backups_in_flight(), "skipped_no_host_room": s.backups_skipped},
            "evictions": {
                "device": {"kept_on_host": s.evicted_to_host, "dropped": s.evicted_dropped,
                           "pages": s.evicted_pages, "snapshots": s.evicted_snapshots},
                "host": {"count": s.host_evictions, "pages": s.host_evicted_pages},
            },
            "snapshots": {"taken": s.snapshots_taken, "skipped_no_room": s.snapshots_skipped},
        })
    }

    /// Audits the books: allocators consistent on both tiers, tree consistent, and every
    /// reference accounted for by the tree, the `running` requests and the copies in flight.
    pub fn check(&self, running: &[&Request]) -> std::result::Result<(), String> {
        self.pools.check()?;
        self.tree.check()?;
        let held = self.tree.held();
        let mut page_refs = vec![0u32; self.pools.page_allocator().capacity()];
        let mut snap_refs = vec![0u32; self.pools.snapshot_allocator().capacity()];
        for &p in &held.pages {
            page_refs[p as usize] += 1;
        }
        for &s in &held.snapshots {
            snap_refs[s as usize] += 1;
        }
        if let Some(h) = &self.host {
            for b in &h.backups {
                b.pages.iter().for_each(|&p| page_refs[p as usize] += 1);
                b.snaps.iter().for_each(|&s| snap_refs[s as usize] += 1);
            }
        }
        let mut slots = vec![false; self.pools.slot_allocator().capacity()];
        for r in running {
            for &p in r.kv.pages() {
                page_refs[p as usize] += 1;
            }
            if let Some((_, s)) = r.latest {
                snap_refs[s as usize] += 1;
            }
            if let Some(l) = &r.loading {
                for (_, pages) in &l.nodes {
                    pages.iter().for_each(|&p| page_refs[p as usize] += 1);
                }
                if l.snap.3 {
                    snap_refs[l.snap.2 as usize] += 1;
                }
            }
            if std::mem::replace(&mut slots[r.kv.slot() as usize], true) {
                return Err(format!("slot {} used by two requests", r.kv.slot()));
            }
        }
        for (p, &want) in page_refs.iter().enumerate() {
            let got = self.pools.page_allocator().refs(p as u32);
            if got != want {
                return Err(format!("page {p}: {got} references, {want} holders"));
            }
        }
        for (s, &want) in snap_refs.iter().enumerate() {
            let got = self.pools.snapshot_allocator().refs(s as u32);
            if got != want {
                return Err(format!("snapshot {s}: {got} references, {want} holders"));
            }
        }
        let used_slots = self.pools.slot_allocator().used_count();
        if used_slots != running.len() {
            return Err(format!(
                "{used_slots} slots in use for {} requests",
                running.len()
            ));
        }
        if let Some(h) = &self.host {
            h.pools.check()?;
            for (alloc, held, what) in [
                (h.pools.page_allocator(), &held.host_pages, "host page"),
                (
                    h.pools.snapshot_allocator(),
                    &held.host_snapshots,
                    "host snapshot",
                ),
            ] {
                let mut refs = vec![0u32; alloc.capacity()];
                held.iter().for_each(|&u| refs[u as usize] += 1);
                for (u, &want) in refs.iter().enumerate() {
                    if alloc.refs(u as u32) != want {
                        return Err(format!(
                            "{what} {u}: {} references, {want} holders",
                            alloc.refs(u as u32)
                        ));
                    }
                }
            }
        } else if !held.host_pages.is_empty() || !held.host_snapshots.is_empty() {
            return Err("host units in the tree without a host tier".into());
        }
        Ok(())
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
