//! Pools + prefix tree: how a request's state is started (from a cache hit when possible),
//! grown, snapshotted and ended, with every page, slot and snapshot reference accounted for.
//!
//! A request holds one reference on each page of its page table (shared or its own), one slot
//! and, while decoding, the snapshot of its latest page boundary. The tree holds one reference
//! on each page and snapshot it adopted. A match locks the tree path it resumes from until the
//! request ends, so nodes in use are never evicted; under pressure the tree gives back its
//! least recently used unlocked leaves.

use crate::backend::Backend;
use crate::error::{Error, Result};

use super::pools::{KvPools, SeqKv};
use super::radix::{Evicted, NodeId, RadixTree};

/// One request's KV state and cache bookkeeping.
#[derive(Debug)]
pub struct Request {
    kv: SeqKv,
    salt: Option<String>,
    prompt_len: usize,
    lock: Option<NodeId>,
    /// Tokens skipped thanks to a cache hit.
    reused: usize,
    /// The snapshot of the latest page boundary passed while decoding: `(tokens, snapshot)`.
    latest: Option<(usize, u32)>,
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

    /// Prompt tokens taken from the cache (the request starts computing here).
    pub fn reused_tokens(&self) -> usize {
        self.reused
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }
}

/// Cache counters since creation.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub requests: u64,
    pub hits: u64,
    pub reused_tokens: u64,
    pub snapshots_taken: u64,
    /// Snapshot points skipped because no snapshot unit could be freed.
    pub snapshots_skipped: u64,
    pub evicted_pages: u64,
    pub evicted_snapshots: u64,
}

/// The KV pools of one engine with exact prefix reuse.
pub struct PrefixCache<B: Backend> {
    pools: KvPools<B>,
    tree: RadixTree,
    interval: usize,
    stats: CacheStats,
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
        })
    }

    pub fn pools(&self) -> &KvPools<B> {
        &self.pools
    }

    pub fn pools_mut(&mut self) -> &mut KvPools<B> {
        &mut self.pools
    }

    pub fn tree(&self) -> &RadixTree {
        &self.tree
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Starts a request for `prompt`: takes a slot and, on a hit, restores the deepest cached
    /// snapshot and shares the pages before it. At least the last prompt token is always
    /// computed (its logits start generation).
    pub fn start(&mut self, salt: Option<&str>, prompt: &[u32]) -> Result<Request> {
        if prompt.is_empty() {
            return Err(Error::invalid_argument(
                "an empty prompt: pass at least one token",
            ));
        }
        let mut kv = self.pools.open()?;
        self.stats.requests += 1;
        let m = self.tree.match_prefix(salt, &prompt[..prompt.len() - 1]);
        let mut reused = 0;
        if let (Some(snap), Some(_)) = (m.snapshot, m.lock) {
            self.pools.share_pages(&mut kv, &m.pages);
            self.pools.restore(&kv, snap);
            self.pools.set_position(&mut kv, m.reusable_tokens);
            reused = m.reusable_tokens;
            self.stats.hits += 1;
            self.stats.reused_tokens += reused as u64;
        }
        Ok(Request {
            kv,
            salt: salt.map(str::to_owned),
            prompt_len: prompt.len(),
            lock: m.lock,
            reused,
            latest: None,
        })
    }

    /// Whether `tokens` is a prompt snapshot point of `req`.
    fn is_snapshot_point(&self, req: &Request, tokens: usize) -> bool {
        let page = self.pools.page_size();
        let last_boundary = req.prompt_len / page * page;
        tokens > 0 && (tokens.is_multiple_of(self.interval) || tokens == last_boundary)
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

    fn evict_until(&mut self, enough: impl Fn(&KvPools<B>) -> bool) -> bool {
        if enough(&self.pools) {
            return true;
        }
        let (pools, stats) = (&mut self.pools, &mut self.stats);
        self.tree.evict(|Evicted { pages, snapshots }| {
            stats.evicted_pages += pages.len() as u64;
            stats.evicted_snapshots += snapshots.len() as u64;
            for p in pages {
                pools.release_page(p);
            }
            for s in snapshots {
                pools.release_snapshot(s);
            }
            enough(pools)
        })
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
        if pos == 0 || !pos.is_multiple_of(page) || pos <= req.reused {
            return Ok(());
        }
        if pos <= req.prompt_len {
            if !self.is_snapshot_point(req, pos) {
                return Ok(());
            }
            let salt = req.salt.clone();
            if self.tree.has_snapshot(salt.as_deref(), tokens) {
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
    /// the end; the tree takes references on what it adopts.
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
        for p in adopted.pages {
            self.pools.retain_page(p);
        }
        for s in adopted.snapshots {
            self.pools.retain_snapshot(s);
        }
    }

    /// Ends a finished request: its sequence up to the latest captured page boundary goes into
    /// the cache, then every reference it held is released.
    pub fn finish(&mut self, mut req: Request, tokens: &[u32]) {
        if let Some((at, snap)) = req.latest.take() {
            if at <= tokens.len() {
                self.insert(&req, &tokens[..at], Some(snap));
            }
            self.pools.release_snapshot(snap);
        }
        self.release(req);
    }

    /// Ends a request without caching anything more (abort, error).
    pub fn abort(&mut self, mut req: Request) {
        if let Some((_, snap)) = req.latest.take() {
            self.pools.release_snapshot(snap);
        }
        self.release(req);
    }

    fn release(&mut self, req: Request) {
        if let Some(node) = req.lock {
            self.tree.unlock(node);
        }
        self.pools.close(req.kv);
    }

    /// Evicts cached prefixes (least recently used unlocked leaves first) until at least
    /// `pages` pages and `snapshots` snapshot units are free; false when that is impossible.
    pub fn evict(&mut self, pages: usize, snapshots: usize) -> bool {
        self.evict_until(|p| {
            p.page_allocator().free_count() >= pages
                && p.snapshot_allocator().free_count() >= snapshots
        })
    }

    /// Drops every unlocked cached prefix (pages and snapshots go back to the pools).
    pub fn clear(&mut self) {
        self.evict_until(|_| false);
    }

    /// Audits the books: allocators consistent, tree consistent, and every page and snapshot
    /// reference accounted for by the tree plus the `running` requests.
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
        let mut slots = vec![false; self.pools.slot_allocator().capacity()];
        for r in running {
            for &p in r.kv.pages() {
                page_refs[p as usize] += 1;
            }
            if let Some((_, s)) = r.latest {
                snap_refs[s as usize] += 1;
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
        Ok(())
    }
}
