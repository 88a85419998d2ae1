//! One data core's replica of the routing state: the prefix tree of routed prompts plus the
//! verified residency mirror of the engines' blocks. Answers lookups with a per-backend match;
//! applies writes ([`WriteOp`]) made here or on other cores.
//!
//! Pure: time and events are arguments. Scoring is not here (see `router.rs`).

use std::num::NonZeroU32;

use myelin_art::{
    BlockChain, InsertOutcome, MatchSegment, PrefixTree, TreeConfig, TreeMatch, TreeStats,
};

use crate::backend::BackendId;
use crate::error::RoutingError;
use crate::mirror::{MirrorTrust, ResidencyMirror};
use crate::replica::{MirrorChange, WriteOp};

/// Sizing of a [`Shard`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardConfig {
    /// Tokens per block (must match the engines' KV block size for the mirror to line up).
    pub block_size: u32,
    /// Bound on distinct prefix blocks in this shard's tree (LRU eviction of cold leaves).
    pub max_blocks: usize,
}

impl Default for ShardConfig {
    fn default() -> Self {
        let tree = TreeConfig::default();
        Self {
            block_size: tree.block_size,
            max_blocks: tree.max_blocks,
        }
    }
}

/// One backend's part of a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendMatch {
    pub backend: BackendId,
    /// Longest prefix of the prompt this backend was routed (history), in blocks.
    pub matched_blocks: u32,
    /// When it last routed through its deepest matched node (0 when `matched_blocks` is 0).
    pub last_routed_ms: u64,
    /// Residency stamp stored with that use (see [`Shard::learn_chain`]).
    pub residency_stamp: u64,
    /// `Some(n)` when the backend's KV-event mirror is live: it verifiably holds the first `n`
    /// blocks of the prompt and not block `n`. `None`: nothing verified.
    pub verified_resident_blocks: Option<u32>,
    /// The live mirror is partial: it holds the first `n` blocks, and block `n` is unknown
    /// (see [`MirrorTrust::Partial`]).
    pub verified_partial: bool,
}

/// Result of a shard lookup, for every backend, in one walk. Plain data, `Send`: it crosses
/// executors by message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Tokens per block.
    pub block_size: u32,
    /// Full blocks in the prompt.
    pub prompt_blocks: u32,
    /// When the lookup ran (caller's ms clock).
    pub looked_up_at_ms: u64,
    /// Backends with a historical match or a live mirror, sorted by id.
    pub backends: Vec<BackendMatch>,
    /// Use records along the matched path (for residency estimators).
    pub segments: Vec<MatchSegment>,
}

impl PrefixMatch {
    /// The entry of `backend`, if it matched anything or has a live mirror.
    pub fn backend(&self, backend: BackendId) -> Option<&BackendMatch> {
        self.backends
            .binary_search_by_key(&backend, |entry| entry.backend)
            .ok()
            .map(|index| &self.backends[index])
    }

    /// Historical matched blocks of `backend` (0 when absent).
    pub fn matched_blocks_of(&self, backend: BackendId) -> u32 {
        self.backend(backend)
            .map_or(0, |entry| entry.matched_blocks)
    }
}

/// One core's replica of the routing state.
pub struct Shard {
    tree: PrefixTree,
    mirror: ResidencyMirror,
    /// Per backend: uses stamped below this were seen evicted ([`WriteOp::Evicted`]).
    evicted_below: Vec<(BackendId, u64)>,
}

/// Blocks per backend held by one shard (see [`Shard::blocks_by_backend`]), or by several
/// once added up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockCounts {
    /// Blocks of learned routes in the prefix tree, by backend id.
    pub routed: Vec<(BackendId, usize)>,
    /// Blocks the verified mirror holds, by backend id.
    pub mirrored: Vec<(BackendId, usize)>,
}

impl BlockCounts {
    /// Adds another count's figures to these.
    pub fn add(&mut self, other: &BlockCounts) {
        fn merge(into: &mut Vec<(BackendId, usize)>, from: &[(BackendId, usize)]) {
            for &(backend, blocks) in from {
                match into.iter_mut().find(|(held, _)| *held == backend) {
                    Some((_, total)) => *total += blocks,
                    None => into.push((backend, blocks)),
                }
            }
            into.sort_unstable_by_key(|(backend, _)| *backend);
        }
        merge(&mut self.routed, &other.routed);
        merge(&mut self.mirrored, &other.mirrored);
    }

    /// Routed blocks of `backend`.
    pub fn routed_of(&self, backend: BackendId) -> usize {
        Self::of(&self.routed, backend)
    }

    /// Mirrored blocks of `backend`.
    pub fn mirrored_of(&self, backend: BackendId) -> usize {
        Self::of(&self.mirrored, backend)
    }

    fn of(list: &[(BackendId, usize)], backend: BackendId) -> usize {
        list.iter()
            .find(|(held, _)| *held == backend)
            .map_or(0, |(_, blocks)| *blocks)
    }
}

impl Shard {
    /// An empty shard. Fails on a zero block size.
    pub fn new(config: ShardConfig) -> Result<Self, RoutingError> {
        let tree = PrefixTree::new(TreeConfig {
            block_size: config.block_size,
            max_blocks: config.max_blocks,
        })?;
        Ok(Self {
            tree,
            mirror: ResidencyMirror::default(),
            evicted_below: Vec::new(),
        })
    }

    pub fn block_size(&self) -> NonZeroU32 {
        self.tree.block_size()
    }

    /// Hashes a prompt with this shard's block size (do it once per request).
    pub fn chain(&self, tokens: &[u32]) -> BlockChain {
        self.tree.chain(tokens)
    }

    /// [`Self::chain`] in the cache namespace whose root is `root` ([`crate::namespace_root`]).
    pub fn chain_in(&self, root: u64, tokens: &[u32]) -> BlockChain {
        BlockChain::in_namespace(root, tokens, self.block_size())
    }

    /// Per-backend match of `tokens` (hashes them; see [`Self::lookup_chain`]).
    pub fn lookup(&self, tokens: &[u32], now_ms: u64) -> PrefixMatch {
        let chain = self.chain(tokens);
        self.lookup_hashes(chain.hashes(), now_ms)
    }

    /// Per-backend match of a prompt's chain: historical depth from the tree and, for backends
    /// with a live mirror, the verified resident depth.
    pub fn lookup_chain(
        &self,
        chain: &BlockChain,
        now_ms: u64,
    ) -> Result<PrefixMatch, RoutingError> {
        self.check_block_size(chain)?;
        Ok(self.lookup_hashes(chain.hashes(), now_ms))
    }

    fn lookup_hashes(&self, hashes: &[u64], now_ms: u64) -> PrefixMatch {
        let mut found = TreeMatch::default();
        self.tree.lookup_chain_into(hashes, &mut found);
        let verified = self.mirror.resident_prefixes(hashes);
        let mut backends: Vec<BackendMatch> = found
            .backends
            .iter()
            .map(|prefix| BackendMatch {
                backend: prefix.backend,
                matched_blocks: prefix.matched_blocks,
                last_routed_ms: prefix.last_routed_ms,
                residency_stamp: prefix.residency_stamp,
                verified_resident_blocks: None,
                verified_partial: false,
            })
            .collect();
        for (backend, resident_blocks) in verified {
            match backends.binary_search_by_key(&backend, |entry| entry.backend) {
                Ok(index) => {
                    backends[index].verified_resident_blocks = Some(resident_blocks);
                    backends[index].verified_partial = self.mirror.is_partial(backend);
                }
                Err(index) => backends.insert(
                    index,
                    BackendMatch {
                        backend,
                        matched_blocks: 0,
                        last_routed_ms: 0,
                        residency_stamp: 0,
                        verified_resident_blocks: Some(resident_blocks),
                        verified_partial: self.mirror.is_partial(backend),
                    },
                ),
            }
        }
        PrefixMatch {
            block_size: self.tree.block_size().get(),
            prompt_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
            looked_up_at_ms: now_ms,
            backends,
            segments: found.segments,
        }
    }

    /// Records that `backend` was routed `tokens` at `now_ms`.
    pub fn learn(&mut self, tokens: &[u32], backend: BackendId, now_ms: u64) -> InsertOutcome {
        let chain = self.chain(tokens);
        self.tree.insert_chain(chain.hashes(), backend, now_ms, 0)
    }

    /// Records that `backend` was routed the prompt of `chain` at `now_ms`. `residency_stamp`
    /// is kept with the use for the residency estimator (e.g. the backend's cumulative
    /// admitted-block counter at routing time); pass 0 if unused.
    pub fn learn_chain(
        &mut self,
        chain: &BlockChain,
        backend: BackendId,
        now_ms: u64,
        residency_stamp: u64,
    ) -> Result<InsertOutcome, RoutingError> {
        self.check_block_size(chain)?;
        Ok(self
            .tree
            .insert_chain(chain.hashes(), backend, now_ms, residency_stamp))
    }

    /// Applies one write (made on this core or received from another). A learn whose chain
    /// was hashed with another block size is ignored (every core hashes with the same one).
    pub fn apply(&mut self, op: &WriteOp) {
        match op {
            WriteOp::Learn {
                chain,
                backend,
                at_ms,
                residency_stamp,
            } => {
                let _ = self.learn_chain(chain, *backend, *at_ms, *residency_stamp);
            }
            WriteOp::Mirror { backend, changes } => {
                for change in changes.iter() {
                    match *change {
                        MirrorChange::Stored(chain) => self.apply_block_stored(*backend, chain),
                        MirrorChange::Removed(chain) => self.apply_block_removed(*backend, chain),
                        MirrorChange::Cleared => self.clear_mirror(*backend),
                    }
                }
            }
            WriteOp::MirrorLive { backend, trust } => self.set_mirror_trust(*backend, *trust),
            WriteOp::Evicted { backend, stamp } => self.mark_evicted_below(*backend, *stamp),
        }
    }

    /// Records that `backend`'s uses stamped below `stamp` are evicted (keeps the largest).
    pub fn mark_evicted_below(&mut self, backend: BackendId, stamp: u64) {
        match self.evicted_below.iter_mut().find(|(id, _)| *id == backend) {
            Some((_, held)) => *held = (*held).max(stamp),
            None => self.evicted_below.push((backend, stamp)),
        }
    }

    /// Uses of `backend` stamped below this are known evicted (0: none known).
    pub fn evicted_below(&self, backend: BackendId) -> u64 {
        self.evicted_below
            .iter()
            .find(|(id, _)| *id == backend)
            .map_or(0, |(_, stamp)| *stamp)
    }

    /// Forgets `backend`'s history of the last block of `chain_prefix` (chain hashes from the
    /// first block) and everything below it. Returns the (block, backend) claims removed.
    pub fn forget_block(&mut self, chain_prefix: &[u64], backend: BackendId) -> usize {
        self.tree.remove_block(chain_prefix, backend)
    }

    /// Forgets `backend` entirely: history, mirror contents and mirror liveness.
    pub fn remove_backend(&mut self, backend: BackendId) -> usize {
        self.mirror.clear_backend(backend);
        self.mirror.set_live(backend, false);
        self.evicted_below.retain(|(id, _)| *id != backend);
        self.tree.remove_backend(backend)
    }

    /// Marks `backend`'s KV-event mirror live (in sync) or not. While not live its mirror is
    /// ignored (residency `auto` falls back to the estimate for it).
    pub fn set_mirror_live(&mut self, backend: BackendId, live: bool) {
        self.mirror.set_live(backend, live);
    }

    /// [`Self::set_mirror_live`], a partial mirror included (see [`MirrorTrust::Partial`]).
    pub fn set_mirror_trust(&mut self, backend: BackendId, trust: MirrorTrust) {
        self.mirror.set_trust(backend, trust);
    }

    /// Whether `backend`'s mirror is live and partial.
    pub fn mirror_partial(&self, backend: BackendId) -> bool {
        self.mirror.is_partial(backend)
    }

    pub fn mirror_live(&self, backend: BackendId) -> bool {
        self.mirror.is_live(backend)
    }

    /// KV event: `backend` stored the block with chain hash `block_hash` (refcounted copies).
    pub fn apply_block_stored(&mut self, backend: BackendId, block_hash: u64) {
        self.mirror.block_stored(backend, block_hash);
    }

    /// KV event: `backend` evicted one copy of the block with chain hash `block_hash`.
    pub fn apply_block_removed(&mut self, backend: BackendId, block_hash: u64) {
        self.mirror.block_removed(backend, block_hash);
    }

    /// KV event AllBlocksCleared, or a mirror resync: drops every mirrored block of `backend`.
    pub fn clear_mirror(&mut self, backend: BackendId) {
        self.mirror.clear_backend(backend);
    }

    /// A write of `backend`'s mirror may have been lost before it reached this replica: its
    /// mirror is not routed on until it is cleared and rebuilt (a snapshot begins with a clear).
    pub fn mark_mirror_untrusted(&mut self, backend: BackendId) {
        self.mirror.mark_untrusted(backend);
    }

    /// Read access to the verified mirror.
    pub fn mirror(&self) -> &ResidencyMirror {
        &self.mirror
    }

    /// Blocks each backend holds in the prefix tree, in arena slots `from..from + slots`,
    /// added to `counts`; the next slice's start, `None` past the end (see
    /// [`myelin_art::PrefixTree::count_blocks_by_backend`]).
    pub fn count_routed_blocks(
        &self,
        from: usize,
        slots: usize,
        counts: &mut Vec<(BackendId, usize)>,
    ) -> Option<usize> {
        self.tree.count_blocks_by_backend(from, slots, counts)
    }

    /// Blocks each backend holds in the verified mirror, by backend id (O(backends)).
    pub fn mirrored_blocks_by_backend(&self) -> Vec<(BackendId, usize)> {
        self.mirror.blocks_by_backend()
    }

    /// Blocks each backend holds, by backend id: in the prefix tree (routes learned here) and
    /// in the verified mirror (its KV events). Walks the tree in one go: for tests (the admin
    /// API walks it in slices, [`Self::count_routed_blocks`]).
    pub fn blocks_by_backend(&self) -> BlockCounts {
        BlockCounts {
            routed: self.tree.blocks_by_backend(),
            mirrored: self.mirror.blocks_by_backend(),
        }
    }

    /// Size figures of the prefix tree.
    pub fn tree_stats(&self) -> TreeStats {
        self.tree.stats()
    }

    /// Bytes held by the tree and the mirror (O(nodes): for metrics, not the request path).
    pub fn memory_bytes(&self) -> usize {
        self.tree.memory_bytes() + self.mirror.memory_bytes()
    }

    fn check_block_size(&self, chain: &BlockChain) -> Result<(), RoutingError> {
        let shard = self.tree.block_size().get();
        let chain = chain.block_size().get();
        if chain == shard {
            Ok(())
        } else {
            Err(RoutingError::BlockSizeMismatch { chain, shard })
        }
    }
}
