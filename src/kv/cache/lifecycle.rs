//! A request's life in the cache: started (from a device hit at once, or from a host hit once
//! its load-back lands), given pages, snapshotted and inserted as it passes snapshot points,
//! and ended — finished (its sequence is cached) or aborted (nothing more is cached).

use std::time::Duration;

use crate::backend::Backend;
use crate::config::params::WritePolicy;
use crate::error::{Error, Result};
use crate::kv::ids::SnapshotId;
use crate::kv::radix::Match;

use super::{PrefixCache, Request};

impl<B: Backend> PrefixCache<B> {
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
            Match::default()
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
            if let Err(e) = self.pools.capture_into(&req.kv, snap) {
                // The unit is ours alone: give it back with the error.
                self.pools.release_snapshot(snap);
                return Err(e);
            }
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
            if let Err(e) = self.pools.capture_into(&req.kv, snap) {
                // Taken out of `latest` (or fresh): nobody else holds it.
                self.pools.release_snapshot(snap);
                return Err(e);
            }
            self.stats.snapshots_taken += 1;
            req.latest = Some((pos, snap));
        }
        Ok(())
    }

    /// Inserts `tokens` (cut to whole pages) with `req`'s pages and an optional snapshot at
    /// the end; the tree takes references on what it adopts; write_through backs it up.
    fn insert(&mut self, req: &Request, tokens: &[u32], snapshot: Option<SnapshotId>) {
        let page = self.pools.page_size();
        let n = tokens.len() / page * page;
        if n == 0 {
            return;
        }
        let snaps: Vec<(usize, SnapshotId)> = snapshot.map(|s| (n, s)).into_iter().collect();
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
}
