//! Snapshot policy: which page boundaries of a prompt get a snapshot (every
//! `kv.snapshot_interval_tokens`, the prompt's last boundary, and the branch point where a
//! prompt leaves cached pages with no snapshot at their end), where a prefill chunk must stop so
//! the capture is exact, and where a snapshot unit comes from.

use crate::backend::Backend;
use crate::kv::ids::SnapshotId;

use super::{PrefixCache, Request};

impl<B: Backend> PrefixCache<B> {
    /// Whether `tokens` is a prompt snapshot point of `req`.
    pub(super) fn is_snapshot_point(&self, req: &Request, tokens: usize) -> bool {
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

    /// A snapshot unit, evicting cached prefixes if needed; `None` when none can be freed.
    pub(super) fn snapshot_unit(&mut self) -> Option<SnapshotId> {
        if let Some(s) = self.pools.alloc_snapshot() {
            return Some(s);
        }
        self.evict_until(|pools| pools.snapshot_allocator().free_count() > 0);
        self.pools.alloc_snapshot()
    }
}
