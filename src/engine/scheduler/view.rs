//! What the scheduler may ask of the KV side: a running request's sequence ([`SeqView`]) and
//! the pools with their prefix cache ([`KvView`]). Read-only, so the scheduler decides and the
//! engine thread allocates; the scheduler's tests implement both over plain numbers.

use crate::backend::Backend;
use crate::kv::{PrefixCache, Request};

/// One running request's KV sequence, as the scheduler sees it.
pub trait SeqView {
    /// Tokens computed so far.
    fn position(&self) -> usize;
    /// Pages it holds (in the page pools; every page-pool kind holds the same count).
    fn pages_held(&self) -> usize;
}

/// The KV pools and the prefix cache, as the scheduler sees them.
pub trait KvView<S> {
    /// Pages a sequence of `tokens` tokens holds.
    fn pages_for(&self, tokens: usize) -> usize;
    /// Tokens of `tokens` the prefix cache would reuse for a request under `salt`.
    fn cached_prefix(&self, salt: Option<&str>, tokens: &[u32]) -> usize;
    /// For a request under `salt` with `tokens` that will grow to `target` tokens: the pages
    /// it needs of its own (beyond a cached prefix) and the pages free or reclaimable for it.
    fn page_budget(&self, salt: Option<&str>, tokens: &[u32], target: usize) -> (usize, usize);
    /// The position `seq`'s next prefill chunk must end at, at most (a snapshot point).
    fn chunk_limit(&self, seq: &S) -> usize;
}

impl SeqView for Request {
    fn position(&self) -> usize {
        Request::position(self)
    }

    fn pages_held(&self) -> usize {
        self.kv().pages().len()
    }
}

impl<B: Backend> KvView<Request> for PrefixCache<B> {
    fn pages_for(&self, tokens: usize) -> usize {
        self.pools().pages_for(tokens)
    }

    fn cached_prefix(&self, salt: Option<&str>, tokens: &[u32]) -> usize {
        self.peek(salt, tokens).0
    }

    fn page_budget(&self, salt: Option<&str>, tokens: &[u32], target: usize) -> (usize, usize) {
        PrefixCache::page_budget(self, salt, tokens, target)
    }

    fn chunk_limit(&self, seq: &Request) -> usize {
        PrefixCache::chunk_limit(self, seq)
    }
}
