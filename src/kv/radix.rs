//! The prefix tree: token pages → KV pages and snapshots on two tiers (device, host), one tree
//! per `cache_salt`.
//!
//! Edges hold whole pages of tokens (compressed: one node per run of pages without a branch).
//! A node's pages live on the device, on the host (HiCache), or both; device residency is
//! closed towards the root (a device-resident node's parent is device-resident). A node may
//! hold snapshots at some of its page boundaries, each with a device and/or host copy. A hit
//! resumes at the deepest snapshot not beyond the matched length, because the window ring
//! cannot be rebuilt from a short tail; host-only parts of that prefix are loaded back first.
//! The tree records ids only: the caller owns the pools, turns what the tree adopts or gives
//! back into references, and runs the copies.

use std::collections::{BTreeSet, HashMap};
use std::ops::Bound;

pub use super::ids::NodeId;
use super::ids::{HostPageId, HostSnapshotId, PageId, SnapshotId, UnitId};

const NONE: NodeId = NodeId(u32::MAX);

/// One snapshot boundary of a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snap {
    /// Pages from the edge's start (the boundary is at the end of that many pages).
    pub end: u32,
    pub device: Option<SnapshotId>,
    pub host: Option<HostSnapshotId>,
}

#[derive(Debug, Default, Clone)]
struct Node {
    parent: NodeId,
    /// Whole pages of tokens on the edge into this node.
    tokens: Vec<u32>,
    /// Device KV pages, one per page of tokens; empty when not on the device.
    device: Vec<PageId>,
    /// Host copies; empty when not backed up.
    host: Vec<HostPageId>,
    snaps: Vec<Snap>,
    /// Children by a hash of their first page (verified against the tokens on lookup).
    children: HashMap<u64, NodeId>,
    /// Matches holding this node or a descendant.
    locks: u32,
    last_used: u64,
    /// Matches that reused this node (write_through_selective backs up on the second).
    hits: u32,
    /// Device pages are being loaded back from the host.
    loading: bool,
    live: bool,
    /// Children holding device pages (a node is a device leaf when this is 0).
    device_children: u32,
    /// Per tier (`EvictTier` order): `(last_used, stamp)` while the node is in that tier's
    /// evictable set; the stamp orders its entry against the start of an eviction pass.
    listed: [Option<(u64, u64)>; 2],
}

impl Node {
    /// Pages on the edge (every node holds them on at least one tier).
    fn pages(&self) -> usize {
        self.device.len().max(self.host.len())
    }
}

/// Where a hit resumes from and what it must load first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// Tokens of the longest cached page-aligned prefix (either tier).
    pub matched_tokens: usize,
    /// Tokens a request can skip: the deepest snapshot within the matched prefix (0 = none).
    pub reusable_tokens: usize,
    /// Of those, the prefix whose pages are already on the device.
    pub device_tokens: usize,
    /// Device pages of `[0, device_tokens)`.
    pub pages: Vec<PageId>,
    /// Host-only nodes covering `[device_tokens, reusable_tokens)`, in order, with their host
    /// pages: load them back, then `set_device`.
    pub load: Vec<(NodeId, Vec<HostPageId>)>,
    /// The snapshot to restore: its node, boundary and copies.
    pub snapshot: Option<(NodeId, Snap)>,
    /// The locked node (present iff `reusable_tokens > 0`); pass it to [`RadixTree::unlock`].
    pub lock: Option<NodeId>,
    /// Device-resident nodes of the hit that just reached their second hit.
    pub second_hits: Vec<NodeId>,
}

/// What an insertion took over from the caller (one reference each).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Adopted {
    pub pages: Vec<PageId>,
    pub snapshots: Vec<SnapshotId>,
    /// Nodes that received device pages or snapshots, for write-through backups.
    pub nodes: Vec<NodeId>,
}

/// What the tree gave back (one reference each), by tier.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Evicted {
    pub pages: Vec<PageId>,
    pub snapshots: Vec<SnapshotId>,
    pub host_pages: Vec<HostPageId>,
    pub host_snapshots: Vec<HostSnapshotId>,
}

impl Evicted {
    fn absorb(&mut self, other: Evicted) {
        self.pages.extend(other.pages);
        self.snapshots.extend(other.snapshots);
        self.host_pages.extend(other.host_pages);
        self.host_snapshots.extend(other.host_snapshots);
    }
}

/// Which copy of a node an eviction pass removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictTier {
    Device,
    Host,
}

/// One eviction pass over a tier: the nodes evictable when it began, least recently used first
/// (`(last_used, id)` order). A node that becomes evictable during the pass (the parent of an
/// evicted leaf) waits for the next pass, even when it is older than the victims still to come:
/// that is the order eviction has always had, and the tests and goldens pin it.
///
/// A pass is a cursor into the tier's ordered set of evictable nodes, so each victim costs
/// O(log n) instead of a scan and sort of the whole tree per pass. Entries added after the pass
/// began carry a later stamp and are stepped over.
#[derive(Debug)]
pub struct EvictionPass {
    tier: EvictTier,
    /// Entries stamped up to this one were in the set when the pass began.
    start: u64,
    /// The last entry the pass went past.
    after: Option<(u64, NodeId)>,
}

/// A radix tree over page-sized token runs, one root per cache salt.
#[derive(Debug, Clone)]
pub struct RadixTree {
    page: usize,
    nodes: Vec<Node>,
    free: Vec<NodeId>,
    roots: HashMap<Option<String>, NodeId>,
    clock: u64,
    pages_held: usize,
    snapshots_held: usize,
    host_pages_held: usize,
    host_snapshots_held: usize,
    /// Per tier: the evictable nodes by `(last_used, id)`, kept exact on every change of a
    /// node's locks, residency, children or LRU time (`refresh`).
    evictable: [BTreeSet<(u64, NodeId)>; 2],
    /// Counts insertions into `evictable` (an entry's stamp).
    stamp: u64,
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
            host_pages_held: 0,
            host_snapshots_held: 0,
            evictable: [BTreeSet::new(), BTreeSet::new()],
            stamp: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page
    }

    /// Device KV pages the tree holds a reference on.
    pub fn pages_held(&self) -> usize {
        self.pages_held
    }

    pub fn snapshots_held(&self) -> usize {
        self.snapshots_held
    }

    pub fn host_pages_held(&self) -> usize {
        self.host_pages_held
    }

    pub fn host_snapshots_held(&self) -> usize {
        self.host_snapshots_held
    }

    /// Nodes in the tree (roots included).
    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    fn new_node(&mut self, node: Node) -> NodeId {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id.index()] = node;
                id
            }
            None => {
                self.nodes.push(node);
                NodeId::from_index(self.nodes.len() - 1)
            }
        }
    }

    fn n(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    fn n_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.nodes[id.index()]
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Puts `id` into, out of, or at its new place in each tier's evictable set after anything
    /// its evictability or LRU time depends on changed. O(1) when nothing moved.
    fn refresh(&mut self, id: NodeId) {
        let n = self.n(id);
        let base = n.live && n.parent != NONE && n.locks == 0 && !n.loading;
        let want = [
            (base && !n.device.is_empty() && n.device_children == 0).then_some(n.last_used),
            (base && !n.host.is_empty() && (!n.device.is_empty() || n.children.is_empty()))
                .then_some(n.last_used),
        ];
        for (tier, want) in want.into_iter().enumerate() {
            let have = self.n(id).listed[tier];
            if have.map(|e| e.0) == want {
                continue;
            }
            if let Some((key, _)) = have {
                self.evictable[tier].remove(&(key, id));
            }
            let entry = want.map(|key| {
                self.evictable[tier].insert((key, id));
                self.stamp += 1;
                (key, self.stamp)
            });
            self.n_mut(id).listed[tier] = entry;
        }
    }

    /// Takes `id` out of both evictable sets (before it is freed).
    fn unlist(&mut self, id: NodeId) {
        for tier in 0..2 {
            if let Some((key, _)) = self.n_mut(id).listed[tier].take() {
                self.evictable[tier].remove(&(key, id));
            }
        }
    }

    /// One more (or one fewer) device-resident child of `parent`.
    fn count_device_child(&mut self, parent: NodeId, added: bool) {
        if parent == NONE {
            return;
        }
        let n = self.n_mut(parent);
        if added {
            n.device_children += 1;
        } else {
            n.device_children -= 1;
        }
        self.refresh(parent);
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

    fn on_device(&self, id: NodeId) -> bool {
        let n = self.n(id);
        !n.device.is_empty() && !n.loading
    }

    fn on_host(&self, id: NodeId) -> bool {
        let n = self.n(id);
        !n.host.is_empty() && !n.loading
    }

    /// Finds the longest cached prefix of `tokens` under `salt` (host copies count when
    /// `with_host`), locks the path to the deepest snapshot in it and counts a hit on the nodes
    /// before it. A host-only node the resume point falls inside is split there, so loads are
    /// whole nodes. Ids come without new references: the lock keeps them alive.
    pub fn match_prefix(&mut self, salt: Option<&str>, tokens: &[u32], with_host: bool) -> Match {
        let mut m = Match::default();
        let Some(&root) = self.roots.get(&salt.map(str::to_owned)) else {
            return m;
        };
        let now = self.tick();
        let p = self.page;
        // (node, start page, matched pages, on device)
        let mut path: Vec<(NodeId, usize, usize, bool)> = Vec::new();
        let (mut node, mut depth) = (root, 0);
        let mut best: Option<(usize, usize, Snap)> = None; // (boundary pages, path index, snap)
        while tokens.len() >= (depth + 1) * p {
            let rest = &tokens[depth * p..];
            let Some(child) = self.child(node, &rest[..p]) else {
                break;
            };
            let device = self.on_device(child);
            let usable = device || (with_host && self.on_host(child));
            if !usable {
                break;
            }
            let k = self.common_pages(&self.n(child).tokens, rest);
            self.n_mut(child).last_used = now;
            path.push((child, depth, k, device));
            let usable = |s: &&Snap| {
                s.end as usize <= k && (s.device.is_some() || (with_host && s.host.is_some()))
            };
            if let Some(&s) = self.n(child).snaps.iter().rev().find(usable) {
                best = Some((depth + s.end as usize, path.len() - 1, s));
            }
            depth += k;
            if k < self.n(child).pages() {
                break;
            }
            node = child;
        }
        m.matched_tokens = depth * p;
        let Some((resume, at, snap)) = best else {
            for &(id, ..) in &path {
                self.refresh(id);
            }
            return m;
        };
        for &(id, ..) in &path[at + 1..] {
            self.refresh(id);
        }
        path.truncate(at + 1);
        // Split the holder at the boundary so the lock and any load cover whole nodes.
        let (holder, start, _, _) = path[at];
        let within = resume - start;
        let holder = if within < self.n(holder).pages() {
            self.split(holder, within)
        } else {
            holder
        };
        path[at].0 = holder;
        for &(id, start, _, device) in &path {
            let n = self.n_mut(id);
            n.hits += 1;
            if n.hits == 2 && device {
                m.second_hits.push(id);
            }
            let take = (resume - start).min(n.pages());
            if device {
                m.pages.extend_from_slice(&n.device[..take]);
                m.device_tokens = (start + take) * p;
            } else {
                m.load.push((id, n.host[..take].to_vec()));
            }
        }
        m.reusable_tokens = resume * p;
        m.snapshot = Some((holder, snap));
        m.lock = Some(holder);
        self.lock(holder);
        // Locked now, so this only drops stale entries of nodes the walk touched.
        for &(id, ..) in &path {
            self.refresh(id);
        }
        m
    }

    /// What [`Self::match_prefix`] would let a request skip, without locking, splitting or
    /// touching LRU order: `(reusable tokens, of which already on the device)`, and the device
    /// pages of that device prefix appended to `pages` when given. The scheduler asks this of
    /// every waiting request, so it must not disturb the cache.
    pub fn peek(
        &self,
        salt: Option<&str>,
        tokens: &[u32],
        with_host: bool,
        mut pages: Option<&mut Vec<PageId>>,
    ) -> (usize, usize) {
        let Some(&root) = self.roots.get(&salt.map(str::to_owned)) else {
            return (0, 0);
        };
        let p = self.page;
        let first = pages.as_ref().map_or(0, |v| v.len());
        let (mut node, mut depth, mut device_depth) = (root, 0, 0);
        let mut reusable = 0;
        while tokens.len() >= (depth + 1) * p {
            let rest = &tokens[depth * p..];
            let Some(child) = self.child(node, &rest[..p]) else {
                break;
            };
            let device = self.on_device(child);
            if !(device || (with_host && self.on_host(child))) {
                break;
            }
            let c = self.n(child);
            let k = self.common_pages(&c.tokens, rest);
            let usable = |s: &&Snap| {
                s.end as usize <= k && (s.device.is_some() || (with_host && s.host.is_some()))
            };
            if let Some(s) = c.snaps.iter().rev().find(usable) {
                reusable = depth + s.end as usize;
            }
            depth += k;
            if device {
                device_depth = depth;
                if let Some(v) = pages.as_mut() {
                    v.extend_from_slice(&c.device[..k]);
                }
            }
            if k < c.pages() {
                break;
            }
            node = child;
        }
        let on_device = reusable.min(device_depth);
        if let Some(v) = pages {
            v.truncate(first + on_device);
        }
        (reusable * p, on_device * p)
    }

    /// Device pages held by unlocked nodes: what eviction could give back (those not also
    /// referenced elsewhere).
    pub fn unlocked_device_pages(&self) -> impl Iterator<Item = PageId> + '_ {
        self.nodes
            .iter()
            .filter(|n| n.live && n.parent != NONE && n.locks == 0 && !n.loading)
            .flat_map(|n| n.device.iter().copied())
    }

    /// Whether a device snapshot exists for exactly `tokens` (whole pages) under `salt`.
    pub fn has_device_snapshot(&self, salt: Option<&str>, tokens: &[u32]) -> bool {
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
                return c
                    .snaps
                    .iter()
                    .any(|s| s.end as usize == k && s.device.is_some());
            }
            if k < c.pages() {
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
            let (first, parent) = (n.locks == 1, n.parent);
            if first {
                self.refresh(node);
            }
            node = parent;
        }
    }

    /// Releases a lock taken by [`match_prefix`](Self::match_prefix) or [`lock`](Self::lock).
    pub fn unlock(&mut self, mut node: NodeId) {
        while node != NONE {
            let n = self.n_mut(node);
            assert!(n.locks > 0, "unlock of an unlocked node");
            n.locks -= 1;
            let (last, parent) = (n.locks == 0, n.parent);
            if last {
                self.refresh(node);
            }
            node = parent;
        }
    }

    /// Splits `node`'s edge after `k` pages; returns the new upper node (the old id keeps the
    /// lower part, so locks held on it stay valid).
    fn split(&mut self, node: NodeId, k: usize) -> NodeId {
        let p = self.page;
        let n = self.n_mut(node);
        debug_assert!(k > 0 && k < n.pages());
        let tokens = n.tokens.drain(..k * p).collect::<Vec<_>>();
        fn take<T>(v: &mut Vec<T>, k: usize) -> Vec<T> {
            if v.is_empty() {
                Vec::new()
            } else {
                v.drain(..k).collect()
            }
        }
        let device = take(&mut n.device, k);
        let host = take(&mut n.host, k);
        let (upper_snaps, lower_snaps): (Vec<Snap>, Vec<Snap>) =
            n.snaps.iter().partition(|s| s.end as usize <= k);
        n.snaps = lower_snaps
            .into_iter()
            .map(|s| Snap {
                end: s.end - k as u32,
                ..s
            })
            .collect();
        let (parent, locks, last_used, hits, loading) =
            (n.parent, n.locks, n.last_used, n.hits, n.loading);
        let lower_key = page_hash(&n.tokens[..p]);
        let upper_key = page_hash(&tokens[..p]);
        // The lower part holds device pages exactly when the upper part does.
        let device_children = u32::from(!device.is_empty());
        let upper = self.new_node(Node {
            parent,
            tokens,
            device,
            host,
            snaps: upper_snaps,
            children: HashMap::from([(lower_key, node)]),
            locks,
            last_used,
            hits,
            loading,
            live: true,
            device_children,
            listed: [None; 2],
        });
        self.n_mut(node).parent = upper;
        self.n_mut(parent).children.insert(upper_key, upper);
        self.refresh(upper);
        self.refresh(node);
        upper
    }

    /// Records that `tokens` (whole pages) are cached in device `pages`, with `snapshots` as
    /// `(tokens, snapshot)` at page boundaries within them. Parts already on the device keep
    /// their pages and snapshots; host-only parts get these device pages. Returns what the
    /// tree took a reference on.
    pub fn insert(
        &mut self,
        salt: Option<&str>,
        tokens: &[u32],
        pages: &[PageId],
        snapshots: &[(usize, SnapshotId)],
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
                        device: pages[depth..n_pages].to_vec(),
                        last_used: now,
                        live: true,
                        ..Node::default()
                    });
                    self.n_mut(node).children.insert(h, leaf);
                    self.count_device_child(node, true);
                    adopted.pages.extend_from_slice(&pages[depth..n_pages]);
                    adopted.nodes.push(leaf);
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
            if self.n(next).loading {
                // Being loaded back: its pages arrive whole; leave it (and below) alone.
                break;
            }
            let next = if k < self.n(next).pages() {
                self.split(next, k)
            } else {
                next
            };
            let n = self.n_mut(next);
            n.last_used = now;
            if n.device.is_empty() && !n.loading {
                // Host-only: this request's pages put it back on the device.
                n.device = pages[depth..depth + k].to_vec();
                adopted.pages.extend_from_slice(&n.device);
                adopted.nodes.push(next);
                self.pages_held += k;
                self.count_device_child(node, true);
            }
            path.push((next, depth));
            depth += k;
            node = next;
        }
        for &(id, _) in &path {
            self.refresh(id);
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
            if n.device.is_empty() {
                continue;
            }
            match n.snaps.binary_search_by_key(&end, |s| s.end) {
                Err(i) => n.snaps.insert(
                    i,
                    Snap {
                        end,
                        device: Some(snap),
                        host: None,
                    },
                ),
                Ok(i) if n.snaps[i].device.is_none() => n.snaps[i].device = Some(snap),
                Ok(_) => continue,
            }
            adopted.snapshots.push(snap);
            if !adopted.nodes.contains(&holder) {
                adopted.nodes.push(holder);
            }
            self.snapshots_held += 1;
        }
        adopted
    }

    // --- tiers -------------------------------------------------------------------------------

    /// The node's device pages and device snapshot units (for a backup).
    pub fn device_data(&self, id: NodeId) -> (Vec<PageId>, Vec<(u32, SnapshotId)>) {
        let n = self.n(id);
        let snaps = n
            .snaps
            .iter()
            .filter_map(|s| s.device.map(|d| (s.end, d)))
            .collect();
        (n.device.clone(), snaps)
    }

    pub fn has_host_copy(&self, id: NodeId) -> bool {
        !self.n(id).host.is_empty()
    }

    /// Snapshots with a device copy but no host copy, as `(end, device unit)`.
    pub fn snaps_without_host(&self, id: NodeId) -> Vec<(u32, SnapshotId)> {
        self.n(id)
            .snaps
            .iter()
            .filter(|s| s.host.is_none())
            .filter_map(|s| s.device.map(|d| (s.end, d)))
            .collect()
    }

    pub fn hits(&self, id: NodeId) -> u32 {
        self.n(id).hits
    }

    pub fn is_live(&self, id: NodeId) -> bool {
        self.nodes.get(id.index()).is_some_and(|n| n.live)
    }

    /// Records host copies: the node's pages (when `pages` is not empty) and snapshots by
    /// boundary. The tree takes the references.
    pub fn set_host(
        &mut self,
        id: NodeId,
        pages: Vec<HostPageId>,
        snaps: &[(u32, HostSnapshotId)],
    ) {
        let n = self.n_mut(id);
        let mut added = (0, 0);
        if !pages.is_empty() {
            debug_assert!(n.host.is_empty() && pages.len() == n.pages());
            added.0 = pages.len();
            n.host = pages;
        }
        for &(end, unit) in snaps {
            if let Some(s) = n
                .snaps
                .iter_mut()
                .find(|s| s.end == end && s.host.is_none())
            {
                s.host = Some(unit);
                added.1 += 1;
            }
        }
        self.host_pages_held += added.0;
        self.host_snapshots_held += added.1;
        self.refresh(id);
    }

    /// Marks host-only nodes as loading (not usable by other matches until `set_device`).
    pub fn set_loading(&mut self, id: NodeId) {
        self.n_mut(id).loading = true;
        self.refresh(id);
    }

    /// A load-back landed: the node's device pages (the tree takes the references).
    pub fn set_device(&mut self, id: NodeId, pages: Vec<PageId>) {
        let n = self.n_mut(id);
        debug_assert!(n.device.is_empty() && pages.len() == n.pages());
        n.loading = false;
        let parent = n.parent;
        self.pages_held += pages.len();
        let added = !pages.is_empty();
        self.n_mut(id).device = pages;
        self.refresh(id);
        if added {
            self.count_device_child(parent, true);
        }
    }

    /// A snapshot's device copy was loaded back: the tree takes the reference (false when
    /// the entry no longer wants one; the caller keeps it).
    pub fn set_snap_device(&mut self, id: NodeId, end: u32, unit: SnapshotId) -> bool {
        if !self.is_live(id) {
            return false;
        }
        match self
            .n_mut(id)
            .snaps
            .iter_mut()
            .find(|s| s.end == end && s.device.is_none())
        {
            Some(s) => {
                s.device = Some(unit);
                self.snapshots_held += 1;
                true
            }
            None => false,
        }
    }

    /// Starts an eviction pass over `tier`; `None` when nothing is evictable there.
    pub fn eviction_pass(&self, tier: EvictTier) -> Option<EvictionPass> {
        (!self.evictable[tier as usize].is_empty()).then_some(EvictionPass {
            tier,
            start: self.stamp,
            after: None,
        })
    }

    /// The pass's next victim: the least recently used node that was evictable when the pass
    /// began and still is. O(log n), plus one step per node that became evictable meanwhile.
    pub fn next_victim(&self, pass: &mut EvictionPass) -> Option<NodeId> {
        let tier = pass.tier as usize;
        let from = pass.after.map_or(Bound::Unbounded, Bound::Excluded);
        for &(key, id) in self.evictable[tier].range((from, Bound::Unbounded)) {
            pass.after = Some((key, id));
            let (_, stamp) = self.n(id).listed[tier].expect("a listed node");
            if stamp <= pass.start {
                return Some(id);
            }
        }
        None
    }

    /// Unlocked device-resident nodes with no device-resident child, least recently used
    /// first: the candidates for device eviction, by a scan and sort of the whole tree (the
    /// reference `eviction_pass` is checked against).
    pub fn device_victims(&self) -> Vec<NodeId> {
        let mut v: Vec<(u64, NodeId)> = (0..self.nodes.len())
            .map(NodeId::from_index)
            .filter(|&id| self.device_evictable(id))
            .map(|id| (self.n(id).last_used, id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|x| x.1).collect()
    }

    pub fn device_evictable(&self, id: NodeId) -> bool {
        let n = self.n(id);
        n.live
            && n.parent != NONE
            && n.locks == 0
            && !n.loading
            && !n.device.is_empty()
            && n.children.values().all(|&c| self.n(c).device.is_empty())
    }

    /// Unlocked nodes with a host copy, least recently used first: host-only leaves (removed
    /// when evicted) and device-resident nodes (which only lose their host copy). A scan and
    /// sort, like [`Self::device_victims`].
    pub fn host_victims(&self) -> Vec<NodeId> {
        let mut v: Vec<(u64, NodeId)> = (0..self.nodes.len())
            .map(NodeId::from_index)
            .filter(|&id| self.host_evictable(id))
            .map(|id| (self.n(id).last_used, id))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|x| x.1).collect()
    }

    pub fn host_evictable(&self, id: NodeId) -> bool {
        let n = self.n(id);
        n.live
            && n.parent != NONE
            && n.locks == 0
            && !n.loading
            && !n.host.is_empty()
            && (!n.device.is_empty() || n.children.is_empty())
    }

    pub fn parent(&self, id: NodeId) -> Option<NodeId> {
        let p = self.n(id).parent;
        (p != NONE && self.n(p).parent != NONE).then_some(p)
    }

    /// Device eviction of a node with a host copy: its device pages and device snapshots go
    /// back; snapshots without a host copy are gone.
    pub fn drop_device(&mut self, id: NodeId) -> Evicted {
        let n = self.n_mut(id);
        let mut out = Evicted {
            pages: std::mem::take(&mut n.device),
            ..Evicted::default()
        };
        n.snaps.retain_mut(|s| {
            if let Some(d) = s.device.take() {
                out.snapshots.push(d);
            }
            s.host.is_some()
        });
        self.pages_held -= out.pages.len();
        self.snapshots_held -= out.snapshots.len();
        let parent = self.n(id).parent;
        self.refresh(id);
        if !out.pages.is_empty() {
            self.count_device_child(parent, false);
        }
        out
    }

    /// Host eviction: a device-resident node loses its host copy; a host-only leaf goes.
    pub fn drop_host(&mut self, id: NodeId) -> Evicted {
        if self.n(id).device.is_empty() {
            return self.remove_subtree(id);
        }
        let n = self.n_mut(id);
        let mut out = Evicted {
            host_pages: std::mem::take(&mut n.host),
            ..Evicted::default()
        };
        n.snaps.retain_mut(|s| {
            if let Some(h) = s.host.take() {
                out.host_snapshots.push(h);
            }
            s.device.is_some()
        });
        self.host_pages_held -= out.host_pages.len();
        self.host_snapshots_held -= out.host_snapshots.len();
        self.refresh(id);
        out
    }

    /// Removes `id` and everything below it (none of it may be locked).
    pub fn remove_subtree(&mut self, id: NodeId) -> Evicted {
        let p = self.page;
        let mut out = Evicted::default();
        let children: Vec<NodeId> = self.n(id).children.values().copied().collect();
        for c in children {
            out.absorb(self.remove_subtree(c));
        }
        self.unlist(id);
        let n = std::mem::take(self.n_mut(id));
        debug_assert_eq!(n.locks, 0, "removing a locked node");
        let key = page_hash(&n.tokens[..p]);
        if n.parent != NONE && self.n(n.parent).live {
            self.n_mut(n.parent).children.remove(&key);
            if n.device.is_empty() {
                self.refresh(n.parent);
            } else {
                self.count_device_child(n.parent, false);
            }
        }
        self.free.push(id);
        self.pages_held -= n.device.len();
        self.host_pages_held -= n.host.len();
        out.pages.extend(n.device);
        out.host_pages.extend(n.host);
        for s in n.snaps {
            if let Some(d) = s.device {
                out.snapshots.push(d);
                self.snapshots_held -= 1;
            }
            if let Some(h) = s.host {
                out.host_snapshots.push(h);
                self.host_snapshots_held -= 1;
            }
        }
        out
    }

    /// Every page and snapshot the tree holds, by tier (for audits).
    pub fn held(&self) -> Evicted {
        let mut out = Evicted::default();
        for n in self.nodes.iter().filter(|n| n.live) {
            out.pages.extend_from_slice(&n.device);
            out.host_pages.extend_from_slice(&n.host);
            out.snapshots
                .extend(n.snaps.iter().filter_map(|s| s.device));
            out.host_snapshots
                .extend(n.snaps.iter().filter_map(|s| s.host));
        }
        out
    }

    /// Checks the tree's structure: parent links, edge sizes, tiers, child keys, lock counts.
    pub fn check(&self) -> Result<(), String> {
        let p = self.page;
        let mut counts = [0usize; 4];
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.live {
                continue;
            }
            let id = NodeId::from_index(id);
            counts[0] += n.device.len();
            counts[1] += n.snaps.iter().filter(|s| s.device.is_some()).count();
            counts[2] += n.host.len();
            counts[3] += n.snaps.iter().filter(|s| s.host.is_some()).count();
            if n.parent != NONE {
                let pages = n.tokens.len() / p;
                if n.tokens.is_empty() || n.tokens.len() % p != 0 {
                    return Err(format!("node {id}: {} tokens", n.tokens.len()));
                }
                for (tier, len) in [("device", n.device.len()), ("host", n.host.len())] {
                    if len != 0 && len != pages {
                        return Err(format!("node {id}: {len} {tier} pages for {pages}"));
                    }
                }
                if n.device.is_empty() && n.host.is_empty() && !n.loading {
                    return Err(format!("node {id} holds nothing"));
                }
                let parent = self.n(n.parent);
                if parent.children.get(&page_hash(&n.tokens[..p])) != Some(&id) {
                    return Err(format!("node {id} is not its parent's child"));
                }
                if !n.device.is_empty()
                    && parent.parent != NONE
                    && parent.device.is_empty()
                    && !parent.loading
                {
                    return Err(format!("node {id} is on the device but its parent is not"));
                }
                if n.snaps.iter().any(|s| {
                    s.end == 0 || s.end as usize > pages || (s.device.is_none() && s.host.is_none())
                }) {
                    return Err(format!("node {id}: bad snapshot entry"));
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
            let device_children = n
                .children
                .values()
                .filter(|&&c| !self.n(c).device.is_empty())
                .count();
            if n.device_children as usize != device_children {
                return Err(format!(
                    "node {id}: counts {} device children, has {device_children}",
                    n.device_children
                ));
            }
        }
        // The evictable sets are exactly what a scan finds, under the current LRU times.
        for (tier, scan) in [self.device_victims(), self.host_victims()]
            .into_iter()
            .enumerate()
        {
            let listed: Vec<NodeId> = self.evictable[tier].iter().map(|e| e.1).collect();
            if listed != scan {
                return Err(format!(
                    "evictable set {tier}: {listed:?}, a scan finds {scan:?}"
                ));
            }
            for &(key, id) in &self.evictable[tier] {
                if self.n(id).listed[tier].map(|e| e.0) != Some(key) || key != self.n(id).last_used
                {
                    return Err(format!("node {id}: stale evictable entry {key}"));
                }
            }
        }
        let listed = self
            .nodes
            .iter()
            .map(|n| n.listed.iter().flatten().count())
            .sum::<usize>();
        if listed != self.evictable[0].len() + self.evictable[1].len() {
            return Err(format!("{listed} nodes think they are listed"));
        }
        let books = [
            self.pages_held,
            self.snapshots_held,
            self.host_pages_held,
            self.host_snapshots_held,
        ];
        if counts != books {
            return Err(format!("counted {counts:?} (pages, snapshots, host pages, host snapshots), books say {books:?}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(ids: &[u32]) -> Vec<PageId> {
        ids.iter().map(|&i| PageId(i)).collect()
    }

    fn sn(at: &[(usize, u32)]) -> Vec<(usize, SnapshotId)> {
        at.iter().map(|&(t, i)| (t, SnapshotId(i))).collect()
    }

    fn toks(seed: u32, pages: usize) -> Vec<u32> {
        (0..pages as u32 * 4).map(|i| seed * 1000 + i).collect()
    }

    #[test]
    fn a_hit_resumes_at_the_deepest_snapshot_within_the_match() {
        let mut t = RadixTree::new(4);
        let a = toks(1, 5);
        let adopted = t.insert(
            None,
            &a,
            &pg(&[10, 11, 12, 13, 14]),
            &sn(&[(8, 100), (16, 101)]),
        );
        assert_eq!(adopted.pages, pg(&[10, 11, 12, 13, 14]));
        assert_eq!(adopted.snapshots, vec![SnapshotId(100), SnapshotId(101)]);
        // Diverges in page 4 (index 3): matched 3 pages, resumes at 2.
        let mut b = a.clone();
        b[13] = 7;
        let m = t.match_prefix(None, &b, true);
        assert_eq!(
            (m.matched_tokens, m.reusable_tokens, m.device_tokens),
            (12, 8, 8)
        );
        assert_eq!(m.pages, pg(&[10, 11]));
        assert_eq!(m.snapshot.unwrap().1.device, Some(SnapshotId(100)));
        // Locked: nothing can be evicted above the lock.
        let holder = m.lock.unwrap();
        assert!(!t.device_evictable(holder));
        t.unlock(holder);
        t.check().unwrap();
        // Other salts never share.
        assert_eq!(t.match_prefix(Some("x"), &a, true).reusable_tokens, 0);
    }

    #[test]
    fn host_copies_survive_device_eviction_and_hits_name_what_to_load() {
        let mut t = RadixTree::new(4);
        let a = toks(1, 4);
        let adopted = t.insert(None, &a, &pg(&[1, 2, 3, 4]), &sn(&[(8, 50), (16, 51)]));
        let node = adopted.nodes[0];
        let host = [90, 91, 92, 93].map(HostPageId).to_vec();
        t.set_host(
            node,
            host,
            &[(2, HostSnapshotId(70)), (4, HostSnapshotId(71))],
        );
        assert_eq!(t.device_victims(), vec![node]);
        let gone = t.drop_device(node);
        assert_eq!(
            (gone.pages.clone(), gone.snapshots.clone()),
            (pg(&[1, 2, 3, 4]), vec![SnapshotId(50), SnapshotId(51)])
        );
        t.check().unwrap();
        // Device-only matching finds nothing; with the host tier the whole prefix is there.
        assert_eq!(t.match_prefix(None, &a, false).reusable_tokens, 0);
        let m = t.match_prefix(None, &a[..15], true);
        assert_eq!((m.reusable_tokens, m.device_tokens), (8, 0));
        assert_eq!(m.load.len(), 1);
        assert_eq!(
            m.load[0].1,
            vec![HostPageId(90), HostPageId(91)],
            "split at the resume point"
        );
        assert_eq!(m.snapshot.unwrap().1.host, Some(HostSnapshotId(70)));
        let (holder, _) = m.snapshot.unwrap();
        t.set_loading(holder);
        t.set_device(holder, pg(&[5, 6]));
        t.set_snap_device(holder, 2, SnapshotId(52));
        t.unlock(m.lock.unwrap());
        t.check().unwrap();
        let again = t.match_prefix(None, &a[..15], true);
        assert_eq!((again.reusable_tokens, again.device_tokens), (8, 8));
        assert_eq!(again.pages, pg(&[5, 6]));
        t.unlock(again.lock.unwrap());
        // Host eviction of the host-only lower half removes it.
        let victims = t.host_victims();
        let lower = *victims.iter().find(|&&v| t.n(v).device.is_empty()).unwrap();
        let gone = t.drop_host(lower);
        assert_eq!(gone.host_pages, vec![HostPageId(92), HostPageId(93)]);
        assert_eq!(gone.host_snapshots, vec![HostSnapshotId(71)]);
        t.check().unwrap();
    }

    #[test]
    fn a_parent_freed_mid_pass_waits_for_the_next_pass() {
        let mut t = RadixTree::new(4);
        // X and Y share their first page (P) and branch into leaves A and B; Z is leaf C.
        let x = toks(1, 2);
        let mut y = x.clone();
        y[5] = 0;
        t.insert(None, &x, &pg(&[1, 2]), &[]);
        t.insert(None, &y, &pg(&[1, 3]), &[]);
        t.insert(None, &toks(2, 1), &pg(&[4]), &[]);
        // LRU times: A 1, P 2, B 2, C 3. Once A and B are gone P is older than C, but it was
        // not evictable when the pass began: C goes first, P in the next pass.
        let mut order = Vec::new();
        while let Some(mut pass) = t.eviction_pass(EvictTier::Device) {
            while let Some(v) = t.next_victim(&mut pass) {
                order.push(t.remove_subtree(v).pages);
                t.check().unwrap();
            }
        }
        assert_eq!(order, vec![pg(&[2]), pg(&[3]), pg(&[4]), pg(&[1])]);
        assert_eq!(t.node_count(), 1, "only the root is left");
    }

    #[test]
    fn inserting_a_branch_splits_the_edge_and_keeps_existing_pages() {
        let mut t = RadixTree::new(4);
        let a = toks(1, 4);
        t.insert(None, &a, &pg(&[1, 2, 3, 4]), &sn(&[(16, 50)]));
        let mut b = a.clone();
        b[9] = 0; // differs in page 2
        let adopted = t.insert(None, &b, &pg(&[7, 8, 9, 10]), &sn(&[(8, 60), (16, 61)]));
        assert_eq!(adopted.pages, pg(&[9, 10]), "shared pages stay the tree's");
        assert_eq!(adopted.snapshots, vec![SnapshotId(60), SnapshotId(61)]);
        t.check().unwrap();
        assert_eq!(t.pages_held(), 6);
        let m = t.match_prefix(None, &a, true);
        assert_eq!(
            (m.reusable_tokens, m.pages.clone()),
            (16, pg(&[1, 2, 3, 4]))
        );
        t.unlock(m.lock.unwrap());
        let m = t.match_prefix(None, &b, true);
        assert_eq!(
            (m.reusable_tokens, m.pages.clone()),
            (16, pg(&[1, 2, 9, 10]))
        );
        t.unlock(m.lock.unwrap());
        // Device victims: the two leaves (oldest first), then the shared part.
        let v = t.device_victims();
        assert_eq!(v.len(), 2);
        let mut gone = Evicted::default();
        for id in v {
            gone.absorb(t.remove_subtree(id));
        }
        let shared = t.device_victims();
        assert_eq!(shared.len(), 1);
        gone.absorb(t.remove_subtree(shared[0]));
        let mut pages = gone.pages.clone();
        pages.sort_unstable();
        assert_eq!(pages, pg(&[1, 2, 3, 4, 9, 10]));
        assert_eq!(t.pages_held(), 0);
        t.check().unwrap();
    }
}
