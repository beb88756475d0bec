//! The prefix tree: token pages → KV pages and snapshots, one tree per `cache_salt`.
//!
//! Edges hold whole pages of tokens (compressed: one node per run of pages without a branch).
//! A node may hold snapshots at some of its page boundaries; a hit resumes at the deepest
//! snapshot not beyond the matched length, because the window ring cannot be rebuilt from a
//! short tail. The tree only records ids: the caller owns the pools and turns the ids the tree
//! adopts or evicts into references (see `cache`).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A node of the tree.
pub type NodeId = u32;

const NONE: NodeId = NodeId::MAX;

#[derive(Debug, Default)]
struct Node {
    parent: NodeId,
    /// Whole pages of tokens on the edge into this node.
    tokens: Vec<u32>,
    /// One KV page per page of `tokens`.
    pages: Vec<u32>,
    /// `(pages from the edge's start, snapshot)`: a snapshot of the state after that many of
    /// the edge's pages; sorted.
    snapshots: Vec<(u32, u32)>,
    /// Children by a hash of their first page (verified against the tokens on lookup).
    children: HashMap<u64, NodeId>,
    /// Matches holding this node or a descendant.
    locks: u32,
    last_used: u64,
    live: bool,
}

/// What a lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    /// Tokens of the longest cached page-aligned prefix.
    pub matched_tokens: usize,
    /// Tokens a request can skip: the deepest snapshot within the matched prefix (0 = none).
    pub reusable_tokens: usize,
    /// The KV pages of the reusable prefix.
    pub pages: Vec<u32>,
    /// The snapshot to restore (present iff `reusable_tokens > 0`).
    pub snapshot: Option<u32>,
    /// The locked node (present iff `reusable_tokens > 0`); pass it to [`RadixTree::unlock`].
    pub lock: Option<NodeId>,
}

/// What an insertion took over from the caller (one reference each).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub pages: Vec<u32>,
    pub snapshots: Vec<u32>,
}

/// What an eviction gave back (one reference each).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Evicted {
    pub pages: Vec<u32>,
    pub snapshots: Vec<u32>,
}

/// A radix tree over page-sized token runs, one root per cache salt.
#[derive(Debug)]
pub struct RadixTree {
    page: usize,
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    roots: HashMap<Option<String>, NodeId>,
    clock: u64,
    pages_held: usize,
    snapshots_held: usize,
}

/// A fast 64-bit hash of one page of token ids (FxHash's multiply-rotate over pairs).
fn page_hash(tokens: &[u32]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = tokens.len() as u64;
    let mut pairs = tokens.chunks_exact(2);
    for p in &mut pairs {
        let x = u64::from(p[0]) | (u64::from(p[1]) << 32);
        h = (h.rotate_left(5) ^ x).wrapping_mul(K);
    }
    if let [last] = pairs.remainder() {
        h = (h.rotate_left(5) ^ u64::from(*last)).wrapping_mul(K);
    }
    h
}

impl RadixTree {
    /// A tree for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        assert!(page_size > 0);
        Self {
            page: page_size,
            nodes: Vec::new(),
            free: Vec::new(),
            roots: HashMap::new(),
            clock: 0,
            pages_held: 0,
            snapshots_held: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page
    }

    /// KV pages the tree holds a reference on.
    pub fn pages_held(&self) -> usize {
        self.pages_held
    }

    pub fn snapshots_held(&self) -> usize {
        self.snapshots_held
    }

    /// Nodes in the tree (roots included).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as NodeId
            }
        }
    }

    fn n(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    fn n_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The child of `node` whose edge starts with `page`, if any.
    fn child(&self, node: NodeId, page: &[u32]) -> Option<NodeId> {
        let &c = self.n(node).children.get(&page_hash(page))?;
        (self.n(c).tokens[..self.page] == *page).then_some(c)
    }

    /// Whole pages two token runs share from the start.
    fn common_pages(&self, a: &[u32], b: &[u32]) -> usize {
        let p = self.page;
        let n = a.len().min(b.len()) / p;
        (0..n)
            .find(|&i| a[i * p..(i + 1) * p] != b[i * p..(i + 1) * p])
            .unwrap_or(n)
    }

    /// Finds the longest cached prefix of `tokens` under `salt` and locks the path to the
    /// deepest snapshot in it. Pages and snapshot ids are returned without new references:
    /// the lock keeps them alive until [`unlock`](Self::unlock).
    pub fn match_prefix(&mut self, salt: Option<&str>, tokens: &[u32]) -> Match {
        let mut m = Match {
            matched_tokens: 0,
            reusable_tokens: 0,
            pages: Vec::new(),
            snapshot: None,
            lock: None,
        };
        let Some(&root) = self.roots.get(&salt.map(str::to_owned)) else {
            return m;
        };
        let now = self.tick();
        let p = self.page;
        let mut node = root;
        let mut depth = 0; // pages
        let mut pages = Vec::new();
        let mut best: Option<(usize, u32, NodeId)> = None;
        while tokens.len() >= (depth + 1) * p {
            let rest = &tokens[depth * p..];
            let Some(child) = self.child(node, &rest[..p]) else {
                break;
            };
            let k = self.common_pages(&self.n(child).tokens, rest);
            let c = self.n_mut(child);
            c.last_used = now;
            pages.extend_from_slice(&c.pages[..k]);
            if let Some(&(end, snap)) = c.snapshots.iter().rev().find(|s| s.0 as usize <= k) {
                best = Some((depth + end as usize, snap, child));
            }
            depth += k;
            if k < c.pages.len() {
                break;
            }
            node = child;
        }
        m.matched_tokens = depth * p;
        if let Some((at, snap, holder)) = best {
            pages.truncate(at);
            m.reusable_tokens = at * p;
            m.pages = pages;
            m.snapshot = Some(snap);
            m.lock = Some(holder);
            self.lock(holder);
        }
        m
    }

    /// Whether a snapshot exists for exactly `tokens` (a whole number of pages) under `salt`.
    pub fn has_snapshot(&self, salt: Option<&str>, tokens: &[u32]) -> bool {
        let p = self.page;
        let Some(&root) = self.roots.get(&salt.map(str::to_owned)) else {
            return false;
        };
        let want = tokens.len() / p;
        let (mut node, mut depth) = (root, 0);
        while depth < want {
            let rest = &tokens[depth * p..want * p];
            let Some(child) = self.child(node, &rest[..p]) else {
                return false;
            };
            let c = self.n(child);
            let k = self.common_pages(&c.tokens, rest);
            if depth + k == want {
                return c.snapshots.iter().any(|s| s.0 as usize == k);
            }
            if k < c.pages.len() {
                return false;
            }
            depth += k;
            node = child;
        }
        false
    }

    /// One more holder of `node` (and so of its ancestors).
    pub fn lock(&mut self, mut node: NodeId) {
        while node != NONE {
            let n = self.n_mut(node);
            n.locks += 1;
            node = n.parent;
        }
    }

    /// Releases a lock taken by [`match_prefix`](Self::match_prefix) or [`lock`](Self::lock).
    pub fn unlock(&mut self, mut node: NodeId) {
        while node != NONE {
            let n = self.n_mut(node);
            assert!(n.locks > 0, "unlock of an unlocked node");
            n.locks -= 1;
            node = n.parent;
        }
    }

    /// Splits `node`'s edge after `k` pages; returns the new upper node (the old id keeps the
    /// lower part, so locks held on it stay valid).
    fn split(&mut self, node: NodeId, k: usize) -> NodeId {
        let p = self.page;
        let n = self.n_mut(node);
        debug_assert!(k > 0 && k < n.pages.len());
        let tokens = n.tokens.drain(..k * p).collect::<Vec<_>>();
        let pages = n.pages.drain(..k).collect::<Vec<_>>();
        let (upper_snaps, lower_snaps): (Vec<_>, Vec<_>) =
            n.snapshots.iter().partition(|s| s.0 as usize <= k);
        n.snapshots = lower_snaps
            .into_iter()
            .map(|(end, s)| (end - k as u32, s))
            .collect();
        let (parent, locks, last_used) = (n.parent, n.locks, n.last_used);
        let lower_key = page_hash(&n.tokens[..p]);
        let upper_key = page_hash(&tokens[..p]);
        let upper = self.new_node(Node {
            parent,
            tokens,
            pages,
            snapshots: upper_snaps,
            children: HashMap::from([(lower_key, node)]),
            locks,
            last_used,
            live: true,
        });
        self.n_mut(node).parent = upper;
        self.n_mut(parent).children.insert(upper_key, upper);
        upper
    }

    /// Records that `tokens` (whole pages) are cached in `pages`, with `snapshots` as
    /// `(tokens, snapshot)` at page boundaries within them. Returns the ids the tree took a
    /// reference on; parts already cached keep their existing pages and snapshots (the
    /// caller's copies stay the caller's).
    pub fn insert(
        &mut self,
        salt: Option<&str>,
        tokens: &[u32],
        pages: &[u32],
        snapshots: &[(usize, u32)],
    ) -> Adopted {
        let p = self.page;
        let n_pages = tokens.len() / p;
        assert!(pages.len() >= n_pages, "fewer pages than token pages");
        let tokens = &tokens[..n_pages * p];
        let now = self.tick();
        let key = salt.map(str::to_owned);
        let root = match self.roots.get(&key) {
            Some(&r) => r,
            None => {
                let r = self.new_node(Node {
                    parent: NONE,
                    live: true,
                    ..Node::default()
                });
                self.roots.insert(key, r);
                r
            }
        };
        let mut adopted = Adopted::default();
        // (node, first page, pages) of every edge on the path.
        let mut path: Vec<(NodeId, usize)> = Vec::new();
        let (mut node, mut depth) = (root, 0);
        while depth < n_pages {
            let rest = &tokens[depth * p..];
            let h = page_hash(&rest[..p]);
            let next = match self.n(node).children.get(&h) {
                None => {
                    let leaf = self.new_node(Node {
                        parent: node,
                        tokens: rest.to_vec(),
                        pages: pages[depth..n_pages].to_vec(),
                        snapshots: Vec::new(),
                        children: HashMap::new(),
                        locks: 0,
                        last_used: now,
                        live: true,
                    });
                    self.n_mut(node).children.insert(h, leaf);
                    adopted.pages.extend_from_slice(&pages[depth..n_pages]);
                    self.pages_held += n_pages - depth;
                    path.push((leaf, depth));
                    depth = n_pages;
                    break;
                }
                Some(&c) if self.n(c).tokens[..p] != rest[..p] => {
                    // A 64-bit hash collision between different pages: leave the rest
                    // uncached rather than mix two prefixes.
                    log::debug!("prefix cache: page hash collision; not caching the rest");
                    break;
                }
                Some(&c) => c,
            };
            let k = self.common_pages(&self.n(next).tokens, rest);
            let next = if k < self.n(next).pages.len() {
                self.split(next, k)
            } else {
                next
            };
            self.n_mut(next).last_used = now;
            path.push((next, depth));
            depth += k;
            node = next;
        }
        for &(at, snap) in snapshots {
            if at == 0 || at % p != 0 || at / p > depth {
                continue;
            }
            let b = at / p;
            let Some(&(holder, start)) = path.iter().rev().find(|(_, start)| *start < b) else {
                continue;
            };
            let end = (b - start) as u32;
            let n = self.n_mut(holder);
            if let Err(i) = n.snapshots.binary_search_by_key(&end, |s| s.0) {
                n.snapshots.insert(i, (end, snap));
                adopted.snapshots.push(snap);
                self.snapshots_held += 1;
            }
        }
        adopted
    }

    /// Evicts unlocked leaves, least recently used first, handing each one's pages and
    /// snapshots to `give_back` until it returns true (enough freed) or nothing evictable is
    /// left. Returns whether `give_back` was satisfied.
    pub fn evict(&mut self, mut give_back: impl FnMut(Evicted) -> bool) -> bool {
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = BinaryHeap::new();
        for (id, n) in self.nodes.iter().enumerate() {
            if self.evictable(id as NodeId) {
                heap.push(Reverse((n.last_used, id as NodeId)));
            }
        }
        while let Some(Reverse((_, id))) = heap.pop() {
            if !self.evictable(id) {
                continue;
            }
            let parent = self.n(id).parent;
            let evicted = self.remove_leaf(id);
            let done = give_back(evicted);
            if done {
                return true;
            }
            if self.evictable(parent) {
                heap.push(Reverse((self.n(parent).last_used, parent)));
            }
        }
        false
    }

    fn evictable(&self, id: NodeId) -> bool {
        let n = self.n(id);
        n.live && n.parent != NONE && n.locks == 0 && n.children.is_empty()
    }

    fn remove_leaf(&mut self, id: NodeId) -> Evicted {
        let p = self.page;
        let n = std::mem::take(self.n_mut(id));
        let key = page_hash(&n.tokens[..p]);
        self.n_mut(n.parent).children.remove(&key);
        self.free.push(id);
        self.pages_held -= n.pages.len();
        self.snapshots_held -= n.snapshots.len();
        Evicted {
            pages: n.pages,
            snapshots: n.snapshots.into_iter().map(|s| s.1).collect(),
        }
    }

    /// Every page and snapshot the tree holds (for audits).
    pub fn held(&self) -> Evicted {
        let mut out = Evicted::default();
        for n in self.nodes.iter().filter(|n| n.live) {
            out.pages.extend_from_slice(&n.pages);
            out.snapshots.extend(n.snapshots.iter().map(|s| s.1));
        }
        out
    }

    /// Checks the tree's structure: parent links, edge sizes, child keys and lock counts.
    pub fn check(&self) -> Result<(), String> {
        let p = self.page;
        let mut pages = 0;
        let mut snaps = 0;
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.live {
                continue;
            }
            let id = id as NodeId;
            pages += n.pages.len();
            snaps += n.snapshots.len();
            if n.parent != NONE {
                if n.tokens.is_empty() || n.tokens.len() != n.pages.len() * p {
                    return Err(format!(
                        "node {id}: {} tokens for {} pages",
                        n.tokens.len(),
                        n.pages.len()
                    ));
                }
                let parent = self.n(n.parent);
                if parent.children.get(&page_hash(&n.tokens[..p])) != Some(&id) {
                    return Err(format!("node {id} is not its parent's child"));
                }
            }
            let child_locks: u32 = n.children.values().map(|&c| self.n(c).locks).sum();
            if n.locks < child_locks {
                return Err(format!(
                    "node {id}: {} locks < children's {child_locks}",
                    n.locks
                ));
            }
            for &c in n.children.values() {
                if self.n(c).parent != id || !self.n(c).live {
                    return Err(format!("node {id}: child {c} does not point back"));
                }
            }
            if n.snapshots
                .iter()
                .any(|s| s.0 == 0 || s.0 as usize > n.pages.len())
            {
                return Err(format!("node {id}: snapshot outside its edge"));
            }
        }
        if pages != self.pages_held || snaps != self.snapshots_held {
            return Err(format!(
                "counted {pages} pages / {snaps} snapshots, books say {} / {}",
                self.pages_held, self.snapshots_held
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(seed: u32, pages: usize) -> Vec<u32> {
        (0..pages as u32 * 4).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn a_hit_resumes_at_the_deepest_snapshot_within_the_match() {
        let mut t = RadixTree::new(4);
        let a = toks(1, 5);
        let adopted = t.insert(None, &a, &[10, 11, 12, 13, 14], &[(8, 100), (16, 101)]);
        assert_eq!(adopted.pages, vec![10, 11, 12, 13, 14]);
        assert_eq!(adopted.snapshots, vec![100, 101]);
        // Diverges in page 4 (index 3): matched 3 pages, resumes at 2.
        let mut b = a.clone();
        b[13] = 7;
        let m = t.match_prefix(None, &b);
        assert_eq!((m.matched_tokens, m.reusable_tokens), (12, 8));
        assert_eq!(m.pages, vec![10, 11]);
        assert_eq!(m.snapshot, Some(100));
        // Locked: nothing can be evicted.
        assert!(!t.evict(|_| false));
        t.unlock(m.lock.unwrap());
        t.check().unwrap();
        // Other salts never share.
        assert_eq!(t.match_prefix(Some("x"), &a).reusable_tokens, 0);
    }

    #[test]
    fn inserting_a_branch_splits_the_edge_and_keeps_existing_pages() {
        let mut t = RadixTree::new(4);
        let a = toks(1, 4);
        t.insert(None, &a, &[1, 2, 3, 4], &[(16, 50)]);
        let mut b = a.clone();
        b[9] = 0; // differs in page 2
        let adopted = t.insert(None, &b, &[7, 8, 9, 10], &[(8, 60), (16, 61)]);
        assert_eq!(adopted.pages, vec![9, 10], "shared pages stay the tree's");
        assert_eq!(adopted.snapshots, vec![60, 61]);
        t.check().unwrap();
        assert_eq!(t.pages_held(), 6);
        let m = t.match_prefix(None, &a);
        assert_eq!((m.reusable_tokens, m.pages.clone()), (16, vec![1, 2, 3, 4]));
        t.unlock(m.lock.unwrap());
        let m = t.match_prefix(None, &b);
        assert_eq!(
            (m.reusable_tokens, m.pages.clone()),
            (16, vec![1, 2, 9, 10])
        );
        t.unlock(m.lock.unwrap());
        // Eviction goes leaf by leaf, oldest first, then reaches the shared part.
        let mut freed = Vec::new();
        assert!(!t.evict(|e| {
            freed.push(e);
            false
        }));
        assert_eq!(freed.len(), 3);
        assert_eq!(freed[0].pages, vec![3, 4]);
        assert_eq!(freed[2].pages, vec![1, 2]);
        assert_eq!(freed[2].snapshots, vec![60]);
        assert_eq!(t.pages_held(), 0);
        t.check().unwrap();
    }
}
