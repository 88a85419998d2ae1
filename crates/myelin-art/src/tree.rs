//! The prefix tree: block-granular, path-compressed radix tree over block chain hashes with
//! per-backend entries, one-walk longest-prefix lookup for every backend, and LRU-bounded size.
//!
//! Holds the tree algorithms only; hashing is in `hash.rs`, node layout in `node.rs`.

use std::num::NonZeroU32;

use crate::error::ConfigError;
use crate::hash::{BlockChain, chain_hashes_into};
use crate::node::{BackendId, Entries, Entry, NIL, Node, NodeId};

/// Tokens per block unless configured (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Stored blocks unless configured: ~15-20 MiB per shard at the 13-19 bytes per block measured
/// on realistic trees (docs/performance.md).
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 20;

const ROOT: NodeId = 0;

/// What freeing a subtree released.
#[derive(Default)]
struct Freed {
    blocks: usize,
    claims: usize,
}

/// Sizing of a [`PrefixTree`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeConfig {
    /// Tokens per block; prefixes match in whole blocks.
    pub block_size: u32,
    /// Upper bound on distinct stored blocks; beyond it the coldest leaves are evicted.
    pub max_blocks: usize,
}

impl Default for TreeConfig {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            max_blocks: DEFAULT_MAX_BLOCKS,
        }
    }
}

/// What one backend matched of a looked-up chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendPrefix {
    pub backend: BackendId,
    /// Longest prefix of the chain, in blocks, this backend was routed.
    pub matched_blocks: u32,
    /// When (caller's ms clock) this backend was last routed a prefix covering its deepest
    /// matched block: the oldest use among its matched blocks.
    pub last_routed_ms: u64,
    /// The caller's residency stamp recorded with that use (see [`PrefixTree::insert_chain`]).
    pub residency_stamp: u64,
}

/// A run of matched blocks `[start_block, end_block)` held by one backend with one use record:
/// lets a residency estimator age each block, not just the deepest one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchSegment {
    pub backend: BackendId,
    pub start_block: u32,
    pub end_block: u32,
    pub last_routed_ms: u64,
    pub residency_stamp: u64,
}

/// Result of a lookup: every backend's longest match, found in one walk. `Send`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeMatch {
    /// Backends with at least one matched block, sorted by id.
    pub backends: Vec<BackendPrefix>,
    /// Use records along the matched path, in walk order (shallow first).
    pub segments: Vec<MatchSegment>,
    /// Deepest match over all backends, in blocks.
    pub matched_blocks: u32,
}

impl TreeMatch {
    /// Clears the result, keeping allocations for reuse.
    pub fn clear(&mut self) {
        self.backends.clear();
        self.segments.clear();
        self.matched_blocks = 0;
    }

    /// Matched blocks of `backend` (0 when it matched nothing).
    pub fn matched_blocks_of(&self, backend: BackendId) -> u32 {
        self.backends
            .binary_search_by_key(&backend, |prefix| prefix.backend)
            .map(|index| self.backends[index].matched_blocks)
            .unwrap_or(0)
    }
}

/// Effect of one insert.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InsertOutcome {
    /// Blocks the tree did not hold before (for any backend).
    pub new_blocks: usize,
    /// Blocks evicted (all backends) to stay within `max_blocks`.
    pub evicted_blocks: usize,
}

/// Size figures of a tree.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Distinct blocks stored.
    pub stored_blocks: usize,
    /// Sum over backends of the blocks each holds (a block held by 3 backends counts 3).
    pub backend_blocks: usize,
    /// Live nodes, root included.
    pub nodes: usize,
    /// Bytes held (struct, arena, node heap allocations).
    pub memory_bytes: usize,
}

/// Adaptive, path-compressed radix tree over block chains with per-backend entries.
///
/// See the crate docs for the design and an example.
pub struct PrefixTree {
    block_size: NonZeroU32,
    max_blocks: usize,
    nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    /// Most recently used non-root node; every node sits nearer the head than its descendants,
    /// so the tail is always a leaf: the coldest leaf.
    lru_head: NodeId,
    lru_tail: NodeId,
    stored_blocks: usize,
    live_nodes: usize,
    /// Scratch path of the last insert, kept to avoid an allocation per insert.
    insert_path: Vec<NodeId>,
}

/// Length of the common prefix of two hash runs (compares 8 at a time first: vectorizes).
#[inline]
fn common_prefix_len(left: &[u64], right: &[u64]) -> usize {
    let limit = left.len().min(right.len());
    let mut index = 0;
    while index + 8 <= limit && left[index..index + 8] == right[index..index + 8] {
        index += 8;
    }
    while index < limit && left[index] == right[index] {
        index += 1;
    }
    index
}

fn to_u32(value: usize) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

impl PrefixTree {
    /// An empty tree. Fails on a zero block size.
    pub fn new(config: TreeConfig) -> Result<Self, ConfigError> {
        let block_size = NonZeroU32::new(config.block_size).ok_or(ConfigError::ZeroBlockSize)?;
        let mut root = Node::empty();
        root.live = true;
        Ok(Self {
            block_size,
            max_blocks: config.max_blocks,
            nodes: vec![root],
            free_nodes: Vec::new(),
            lru_head: NIL,
            lru_tail: NIL,
            stored_blocks: 0,
            live_nodes: 1,
            insert_path: Vec::new(),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }

    /// Configured bound on stored blocks.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Hashes `tokens` into this tree's block chain.
    pub fn chain(&self, tokens: &[u32]) -> BlockChain {
        BlockChain::new(tokens, self.block_size)
    }

    /// Records that `backend` was routed `tokens` at `now_ms` (see [`Self::insert_chain`]).
    pub fn insert(&mut self, tokens: &[u32], backend: BackendId, now_ms: u64) -> InsertOutcome {
        let mut hashes = Vec::new();
        chain_hashes_into(tokens, self.block_size, &mut hashes);
        self.insert_chain(&hashes, backend, now_ms, 0)
    }

    /// Longest match of `tokens` for every backend (see [`Self::lookup_chain_into`]).
    pub fn lookup(&self, tokens: &[u32]) -> TreeMatch {
        let mut hashes = Vec::new();
        chain_hashes_into(tokens, self.block_size, &mut hashes);
        let mut result = TreeMatch::default();
        self.lookup_chain_into(&hashes, &mut result);
        result
    }

    /// Longest match of the chain `hashes` for every backend.
    pub fn lookup_chain(&self, hashes: &[u64]) -> TreeMatch {
        let mut result = TreeMatch::default();
        self.lookup_chain_into(hashes, &mut result);
        result
    }

    /// One walk from the root along `hashes`: for each backend, the longest prefix it holds.
    /// Reuses `out`'s allocations. Read-only: lookups do not refresh recency (inserts do).
    pub fn lookup_chain_into(&self, hashes: &[u64], out: &mut TreeMatch) {
        out.clear();
        let mut node_id = ROOT;
        let mut depth = 0usize;
        while let Some(&next_hash) = hashes.get(depth) {
            let Some(child_id) = self.nodes[node_id as usize].children.get(next_hash) else {
                break;
            };
            let child = &self.nodes[child_id as usize];
            let matched = common_prefix_len(&child.hashes, &hashes[depth..]);
            let start_block = to_u32(depth);
            // Backends in a child are a subset of those in its parent, and both lists are
            // sorted: merge in one pass instead of searching per entry.
            let mut cursor = 0usize;
            for entry in child.entries.iter() {
                let covered = entry.covered_blocks.min(to_u32(matched));
                if covered == 0 {
                    continue;
                }
                let end_block = start_block + covered;
                out.segments.push(MatchSegment {
                    backend: entry.backend,
                    start_block,
                    end_block,
                    last_routed_ms: entry.last_routed_ms,
                    residency_stamp: entry.residency_stamp,
                });
                let prefix = BackendPrefix {
                    backend: entry.backend,
                    matched_blocks: end_block,
                    last_routed_ms: entry.last_routed_ms,
                    residency_stamp: entry.residency_stamp,
                };
                while cursor < out.backends.len() && out.backends[cursor].backend < entry.backend {
                    cursor += 1;
                }
                if cursor < out.backends.len() && out.backends[cursor].backend == entry.backend {
                    out.backends[cursor] = prefix;
                } else {
                    out.backends.insert(cursor, prefix);
                }
                cursor += 1;
            }
            depth += matched;
            if matched < child.hashes.len() {
                break;
            }
            node_id = child_id;
        }
        out.matched_blocks = out
            .backends
            .iter()
            .map(|prefix| prefix.matched_blocks)
            .max()
            .unwrap_or(0);
    }

    /// Records that `backend` was routed the chain `hashes` at `now_ms`: it now holds every
    /// block of the chain. `residency_stamp` is an opaque caller value stored with the use
    /// (e.g. the backend's cumulative admitted-block counter, for a residency estimator).
    ///
    /// A chain longer than `max_blocks` is truncated to `max_blocks`. Evicts the coldest leaves
    /// if the tree grows past `max_blocks`; the chain just inserted is the hottest, so it stays.
    pub fn insert_chain(
        &mut self,
        hashes: &[u64],
        backend: BackendId,
        now_ms: u64,
        residency_stamp: u64,
    ) -> InsertOutcome {
        let hashes = &hashes[..hashes.len().min(self.max_blocks)];
        let mut outcome = InsertOutcome::default();
        if hashes.is_empty() {
            return outcome;
        }
        let mut path = std::mem::take(&mut self.insert_path);
        path.clear();
        let mut node_id = ROOT;
        let mut depth = 0usize;
        while depth < hashes.len() {
            let rest = &hashes[depth..];
            let Some(child_id) = self.nodes[node_id as usize].children.get(rest[0]) else {
                let leaf = self.allocate(Node {
                    hashes: rest.into(),
                    entries: Entries::One(Entry {
                        backend,
                        covered_blocks: to_u32(rest.len()),
                        last_routed_ms: now_ms,
                        residency_stamp,
                    }),
                    parent: node_id,
                    ..Node::empty()
                });
                self.nodes[node_id as usize].children.insert(rest[0], leaf);
                self.stored_blocks += rest.len();
                outcome.new_blocks += rest.len();
                path.push(leaf);
                break;
            };
            let run_len = self.nodes[child_id as usize].hashes.len();
            let matched = common_prefix_len(&self.nodes[child_id as usize].hashes, rest);
            if matched < run_len {
                // The chain diverges or ends inside the run: split there, so the use recorded
                // below (time, stamp, recency) covers exactly the blocks this chain touched.
                // On divergence the next iteration hangs the new leaf under the upper half.
                self.split(child_id, matched);
            }
            self.record_use(child_id, backend, to_u32(matched), now_ms, residency_stamp);
            path.push(child_id);
            depth += matched;
            node_id = child_id;
        }
        // Deepest first, so each node ends nearer the head than its descendants.
        for &id in path.iter().rev() {
            self.lru_move_to_head(id);
        }
        self.insert_path = path;
        while self.stored_blocks > self.max_blocks {
            let victim = self.lru_tail;
            if victim == NIL {
                break;
            }
            outcome.evicted_blocks += self.free_subtree(victim).blocks;
        }
        outcome
    }

    /// Forgets that `backend` holds the last block of the chain `hashes`, and every block below
    /// it (without that block, nothing deeper can match for it). Returns the number of
    /// (block, backend) claims removed. Blocks nobody holds any more are freed.
    pub fn remove_block(&mut self, hashes: &[u64], backend: BackendId) -> usize {
        if hashes.is_empty() {
            return 0;
        }
        let target_depth = hashes.len() - 1;
        let mut node_id = ROOT;
        let mut depth = 0usize;
        loop {
            let Some(child_id) = self.nodes[node_id as usize].children.get(hashes[depth]) else {
                return 0;
            };
            let child = &self.nodes[child_id as usize];
            let matched = common_prefix_len(&child.hashes, &hashes[depth..]);
            if depth + matched < hashes.len() {
                if matched < child.hashes.len() {
                    return 0; // the chain is not in the tree
                }
                depth += matched;
                node_id = child_id;
                continue;
            }
            // The target block is in this node, at this offset.
            let offset = to_u32(target_depth - depth);
            let Ok(index) = child.entry_index(backend) else {
                return 0;
            };
            let entry = child.entries[index];
            if entry.covered_blocks <= offset {
                return 0;
            }
            let run_len = to_u32(child.hashes.len());
            let mut removed = (entry.covered_blocks - offset) as usize;
            if offset == 0 {
                self.nodes[child_id as usize].entries.remove(index);
            } else {
                self.nodes[child_id as usize].entries[index].covered_blocks = offset;
            }
            if entry.covered_blocks == run_len {
                for grandchild in self.nodes[child_id as usize].children.ids() {
                    removed += self.strip_backend(grandchild, backend);
                }
            }
            removed += self.normalize(child_id);
            return removed;
        }
    }

    /// Forgets `backend` everywhere. Returns the number of (block, backend) claims removed.
    pub fn remove_backend(&mut self, backend: BackendId) -> usize {
        let mut removed = 0;
        for child in self.nodes[ROOT as usize].children.ids() {
            removed += self.strip_backend(child, backend);
        }
        removed
    }

    /// Distinct blocks stored.
    pub fn stored_blocks(&self) -> usize {
        self.stored_blocks
    }

    /// Live nodes, root included.
    pub fn node_count(&self) -> usize {
        self.live_nodes
    }

    /// Bytes held by the tree: the struct, the node arena and every node's heap allocations.
    /// Walks the arena (O(nodes)): meant for metrics, not for the request path.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free_nodes.capacity() * std::mem::size_of::<NodeId>()
            + self.insert_path.capacity() * std::mem::size_of::<NodeId>()
            + self.nodes.iter().map(Node::heap_bytes).sum::<usize>()
    }

    /// Size figures (walks the arena).
    pub fn stats(&self) -> TreeStats {
        let backend_blocks = self
            .nodes
            .iter()
            .filter(|node| node.live)
            .flat_map(|node| node.entries.iter())
            .map(|entry| entry.covered_blocks as usize)
            .sum();
        TreeStats {
            stored_blocks: self.stored_blocks,
            backend_blocks,
            nodes: self.live_nodes,
            memory_bytes: self.memory_bytes(),
        }
    }

    /// Blocks each backend holds in the tree, by backend id (walks the arena: for the admin
    /// API, not the request path).
    pub fn blocks_by_backend(&self) -> Vec<(BackendId, usize)> {
        let mut counts: Vec<(BackendId, usize)> = Vec::new();
        self.count_blocks_by_backend(0, usize::MAX, &mut counts);
        counts.sort_unstable_by_key(|(backend, _)| *backend);
        counts
    }

    /// Adds the blocks each backend holds in arena slots `from..from + slots` to `counts`
    /// (unsorted); returns where the next slice starts, `None` past the end. A walk in slices
    /// lets the caller yield between them (the tree may change meanwhile: the sum is then of
    /// no single moment, which an admin view can live with).
    pub fn count_blocks_by_backend(
        &self,
        from: usize,
        slots: usize,
        counts: &mut Vec<(BackendId, usize)>,
    ) -> Option<usize> {
        let end = from.saturating_add(slots).min(self.nodes.len());
        for entry in self.nodes[from.min(end)..end]
            .iter()
            .filter(|node| node.live)
            .flat_map(|node| node.entries.iter())
        {
            match counts
                .iter_mut()
                .find(|(backend, _)| *backend == entry.backend)
            {
                Some((_, blocks)) => *blocks += entry.covered_blocks as usize,
                None => counts.push((entry.backend, entry.covered_blocks as usize)),
            }
        }
        (end < self.nodes.len()).then_some(end)
    }

    /// Live nodes whose child index is the large form (a hash map, beyond 16 children); for
    /// tests and fuzzing, which must reach it and its shrink back to a vector. O(nodes).
    #[doc(hidden)]
    pub fn large_child_indexes(&self) -> usize {
        self.nodes
            .iter()
            .filter(|node| node.live && node.children.is_large())
            .count()
    }

    /// Checks every structural invariant; for tests and fuzzing. O(nodes).
    pub fn check_invariants(&self) -> Result<(), String> {
        let root = &self.nodes[ROOT as usize];
        if !root.hashes.is_empty() || !root.entries.is_empty() || root.parent != NIL {
            return Err("root must be empty and parentless".into());
        }
        let mut seen_live = 1usize;
        let mut blocks = 0usize;
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let node = &self.nodes[id as usize];
            if !node.live {
                return Err(format!("node {id} reachable but not live"));
            }
            for (key, child_id) in node.children.pairs() {
                let child = &self.nodes[child_id as usize];
                seen_live += 1;
                blocks += child.hashes.len();
                if child.parent != id {
                    return Err(format!("node {child_id}: parent {} != {id}", child.parent));
                }
                if child.hashes.first() != Some(&key) {
                    return Err(format!("node {child_id}: key does not match first hash"));
                }
                if child.entries.is_empty() {
                    return Err(format!("node {child_id}: no entries"));
                }
                if !child
                    .entries
                    .windows(2)
                    .all(|w| w[0].backend < w[1].backend)
                {
                    return Err(format!("node {child_id}: entries not sorted/unique"));
                }
                let run = to_u32(child.hashes.len());
                if child
                    .entries
                    .iter()
                    .any(|e| e.covered_blocks == 0 || e.covered_blocks > run)
                {
                    return Err(format!("node {child_id}: entry coverage out of range"));
                }
                if child.max_covered() != run {
                    return Err(format!("node {child_id}: run longer than any entry"));
                }
                if id != ROOT {
                    for entry in child.entries.iter() {
                        let full_in_parent = node
                            .entry_index(entry.backend)
                            .map(|i| node.entries[i].covered_blocks == to_u32(node.hashes.len()))
                            .unwrap_or(false);
                        if !full_in_parent {
                            return Err(format!(
                                "node {child_id}: {} not prefix-closed",
                                entry.backend
                            ));
                        }
                    }
                }
                stack.push(child_id);
            }
        }
        if seen_live != self.live_nodes {
            return Err(format!(
                "live count {} != reachable {seen_live}",
                self.live_nodes
            ));
        }
        if blocks != self.stored_blocks {
            return Err(format!("stored {} != counted {blocks}", self.stored_blocks));
        }
        // Recency list: every non-root node once, each nearer the head than its descendants.
        let mut position = vec![usize::MAX; self.nodes.len()];
        let mut cursor = self.lru_head;
        let mut previous = NIL;
        let mut index = 0usize;
        while cursor != NIL {
            if position[cursor as usize] != usize::MAX {
                return Err("recency list has a cycle".into());
            }
            if self.nodes[cursor as usize].lru_prev != previous {
                return Err("recency list back link broken".into());
            }
            position[cursor as usize] = index;
            index += 1;
            previous = cursor;
            cursor = self.nodes[cursor as usize].lru_next;
        }
        if previous != self.lru_tail {
            return Err("recency tail mismatch".into());
        }
        if index + 1 != self.live_nodes {
            return Err(format!(
                "recency list has {index} nodes, want {}",
                self.live_nodes - 1
            ));
        }
        for (id, node) in self.nodes.iter().enumerate() {
            if node.live
                && id != ROOT as usize
                && node.parent != ROOT
                && position[id] <= position[node.parent as usize]
            {
                return Err(format!("node {id} more recent than its parent"));
            }
        }
        Ok(())
    }

    fn allocate(&mut self, mut node: Node) -> NodeId {
        node.live = true;
        node.lru_prev = NIL;
        node.lru_next = NIL;
        self.live_nodes += 1;
        if let Some(id) = self.free_nodes.pop() {
            self.nodes[id as usize] = node;
            id
        } else {
            self.nodes.push(node);
            to_u32(self.nodes.len() - 1)
        }
    }

    /// Splits `id` after `keep` blocks: `id` keeps the upper run, a new node below it takes the
    /// rest, the children and the entries' coverage beyond `keep`.
    fn split(&mut self, id: NodeId, keep: usize) {
        let node = &mut self.nodes[id as usize];
        let lower_hashes: Box<[u64]> = node.hashes[keep..].into();
        node.hashes = node.hashes[..keep].into();
        let lower_children = std::mem::replace(&mut node.children, crate::node::Children::new());
        let keep_u32 = to_u32(keep);
        let mut lower_entries = Vec::new();
        for entry in node.entries.iter_mut() {
            if entry.covered_blocks > keep_u32 {
                lower_entries.push(Entry {
                    covered_blocks: entry.covered_blocks - keep_u32,
                    ..*entry
                });
                entry.covered_blocks = keep_u32;
            }
        }
        let lower_key = lower_hashes[0];
        let grandchildren = lower_children.ids();
        let lower = self.allocate(Node {
            hashes: lower_hashes,
            children: lower_children,
            entries: Entries::from(lower_entries),
            parent: id,
            ..Node::empty()
        });
        for grandchild in grandchildren {
            self.nodes[grandchild as usize].parent = lower;
        }
        self.nodes[id as usize].children.insert(lower_key, lower);
        self.lru_insert_after(id, lower);
    }

    fn record_use(
        &mut self,
        id: NodeId,
        backend: BackendId,
        covered_blocks: u32,
        now_ms: u64,
        residency_stamp: u64,
    ) {
        let node = &mut self.nodes[id as usize];
        match node.entry_index(backend) {
            Ok(index) => {
                let entry = &mut node.entries[index];
                entry.covered_blocks = entry.covered_blocks.max(covered_blocks);
                // The newest use wins whatever order uses arrive in (replicas on other cores
                // apply the same uses in another order and must end up equal).
                if now_ms > entry.last_routed_ms {
                    entry.residency_stamp = residency_stamp;
                } else if now_ms == entry.last_routed_ms {
                    entry.residency_stamp = entry.residency_stamp.max(residency_stamp);
                }
                entry.last_routed_ms = entry.last_routed_ms.max(now_ms);
            }
            Err(index) => node.entries.insert(
                index,
                Entry {
                    backend,
                    covered_blocks,
                    last_routed_ms: now_ms,
                    residency_stamp,
                },
            ),
        }
    }

    /// Removes `backend` from the subtree at `start`; returns the claims removed.
    fn strip_backend(&mut self, start: NodeId, backend: BackendId) -> usize {
        let mut removed = 0usize;
        let mut stack = vec![start];
        while let Some(id) = stack.pop() {
            let node = &mut self.nodes[id as usize];
            // Prefix closure: a backend absent here is absent from the whole subtree.
            let Ok(index) = node.entry_index(backend) else {
                continue;
            };
            let entry = node.entries.remove(index);
            removed += entry.covered_blocks as usize;
            let held_whole_run = entry.covered_blocks as usize == node.hashes.len();
            let run_survives =
                !node.entries.is_empty() && node.max_covered() as usize == node.hashes.len();
            if run_survives {
                if held_whole_run {
                    stack.extend(node.children.ids());
                }
            } else {
                // Nobody else holds the whole run, so the children held only `backend`.
                removed += self.normalize(id);
            }
        }
        removed
    }

    /// Restores the run/entry invariants of `id` after entries shrank: frees it if nobody holds
    /// it, otherwise trims its run to the longest entry (freeing children then orphaned).
    /// Returns the (block, backend) claims freed with it.
    fn normalize(&mut self, id: NodeId) -> usize {
        let node = &self.nodes[id as usize];
        if node.entries.is_empty() {
            return self.free_subtree(id).claims;
        }
        let keep = node.max_covered() as usize;
        let mut claims = 0usize;
        if keep < node.hashes.len() {
            for child in self.nodes[id as usize].children.ids() {
                claims += self.free_subtree(child).claims;
            }
            let node = &mut self.nodes[id as usize];
            self.stored_blocks -= node.hashes.len() - keep;
            node.hashes = node.hashes[..keep].into();
        }
        claims
    }

    /// Detaches `id` from its parent and frees it and all its descendants.
    fn free_subtree(&mut self, id: NodeId) -> Freed {
        let parent = self.nodes[id as usize].parent;
        if let Some(&key) = self.nodes[id as usize].hashes.first() {
            self.nodes[parent as usize].children.remove(key);
        }
        let mut freed = Freed::default();
        let mut stack = vec![id];
        while let Some(current) = stack.pop() {
            self.lru_unlink(current);
            let node = std::mem::replace(&mut self.nodes[current as usize], Node::empty());
            freed.blocks += node.hashes.len();
            freed.claims += node
                .entries
                .iter()
                .map(|entry| entry.covered_blocks as usize)
                .sum::<usize>();
            stack.extend(node.children.ids());
            self.free_nodes.push(current);
            self.live_nodes -= 1;
        }
        self.stored_blocks -= freed.blocks;
        freed
    }

    fn lru_unlink(&mut self, id: NodeId) {
        let (prev, next) = {
            let node = &self.nodes[id as usize];
            (node.lru_prev, node.lru_next)
        };
        if prev == NIL {
            if self.lru_head == id {
                self.lru_head = next;
            }
        } else {
            self.nodes[prev as usize].lru_next = next;
        }
        if next == NIL {
            if self.lru_tail == id {
                self.lru_tail = prev;
            }
        } else {
            self.nodes[next as usize].lru_prev = prev;
        }
        let node = &mut self.nodes[id as usize];
        node.lru_prev = NIL;
        node.lru_next = NIL;
    }

    fn lru_move_to_head(&mut self, id: NodeId) {
        if self.lru_head == id {
            return;
        }
        self.lru_unlink(id);
        let old_head = self.lru_head;
        self.nodes[id as usize].lru_next = old_head;
        if old_head == NIL {
            self.lru_tail = id;
        } else {
            self.nodes[old_head as usize].lru_prev = id;
        }
        self.lru_head = id;
    }

    /// Links `id` just behind `anchor` (one step colder).
    fn lru_insert_after(&mut self, anchor: NodeId, id: NodeId) {
        let next = self.nodes[anchor as usize].lru_next;
        {
            let node = &mut self.nodes[id as usize];
            node.lru_prev = anchor;
            node.lru_next = next;
        }
        self.nodes[anchor as usize].lru_next = id;
        if next == NIL {
            self.lru_tail = id;
        } else {
            self.nodes[next as usize].lru_prev = id;
        }
    }
}
