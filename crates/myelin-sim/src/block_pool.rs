//! The KV block pool of one simulated engine: fixed-size blocks with reference counts, the
//! prefix-cache map from block hash to cached blocks, and the LRU queue of free blocks with lazy
//! eviction. Mirrors vLLM v1's `BlockPool`; records the KV events vLLM would publish.
//!
//! Sans-IO: no clock, no sockets. The engine model drives it.

use std::collections::HashMap;

use myelin_kv_events::{
    AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, MEDIUM_GPU,
    wire::KV_CACHE_SPEC_FULL_ATTENTION,
};

/// Index of a physical block in the pool.
pub type BlockId = u32;

const NO_BLOCK: BlockId = BlockId::MAX;

/// What a request's blocks are keyed by besides their tokens (vLLM's block-hash extra keys):
/// its LoRA adapter's name, in every block, and its `cache_salt`, in the first block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheKeys {
    pub lora: Option<String>,
    pub salt: Option<String>,
}

impl CacheKeys {
    /// Block `index`'s extra keys, in vLLM's order (adapter, then salt).
    pub fn of_block(&self, index: usize) -> Vec<&str> {
        let salt = self.salt.as_deref().filter(|_| index == 0);
        self.lora.as_deref().into_iter().chain(salt).collect()
    }

    /// `extra_keys` of a `BlockStored` of `count` blocks from block `first`, as vLLM 0.17+
    /// publishes them (`None` when no block has any).
    pub fn event_keys(&self, first: usize, count: usize) -> Option<Vec<Option<Vec<ExtraKey>>>> {
        if self.lora.is_none() && (self.salt.is_none() || first > 0) {
            return None;
        }
        let blocks = (first..first + count)
            .map(|index| {
                let keys = self.of_block(index);
                (!keys.is_empty()).then(|| {
                    keys.into_iter()
                        .map(|key| ExtraKey::Str(key.to_string()))
                        .collect()
                })
            })
            .collect();
        Some(blocks)
    }
}

#[derive(Clone, Debug, Default)]
struct Block {
    ref_count: u32,
    /// The prefix-cache hash while the block is registered in the cache (even when free).
    cached_hash: Option<BlockHash>,
}

/// Free blocks, least recently freed first: an intrusive doubly linked list over block ids so a
/// prefix hit can take a block out of the middle in O(1), as vLLM's `FreeKVCacheBlockQueue`.
#[derive(Clone, Debug)]
struct FreeBlockQueue {
    previous: Vec<BlockId>,
    next: Vec<BlockId>,
    queued: Vec<bool>,
    head: BlockId,
    tail: BlockId,
    len: usize,
}

impl FreeBlockQueue {
    /// All blocks free, in id order (vLLM's initial order).
    fn with_all(num_blocks: usize) -> Self {
        let mut queue = FreeBlockQueue {
            previous: vec![NO_BLOCK; num_blocks],
            next: vec![NO_BLOCK; num_blocks],
            queued: vec![false; num_blocks],
            head: NO_BLOCK,
            tail: NO_BLOCK,
            len: 0,
        };
        for block in 0..num_blocks {
            queue.push_back(block as BlockId);
        }
        queue
    }

    fn push_back(&mut self, block: BlockId) {
        let index = block as usize;
        debug_assert!(!self.queued[index]);
        self.previous[index] = self.tail;
        self.next[index] = NO_BLOCK;
        if self.tail == NO_BLOCK {
            self.head = block;
        } else {
            self.next[self.tail as usize] = block;
        }
        self.tail = block;
        self.queued[index] = true;
        self.len += 1;
    }

    fn remove(&mut self, block: BlockId) {
        let index = block as usize;
        debug_assert!(self.queued[index]);
        let (previous, next) = (self.previous[index], self.next[index]);
        if previous == NO_BLOCK {
            self.head = next;
        } else {
            self.next[previous as usize] = next;
        }
        if next == NO_BLOCK {
            self.tail = previous;
        } else {
            self.previous[next as usize] = previous;
        }
        self.previous[index] = NO_BLOCK;
        self.next[index] = NO_BLOCK;
        self.queued[index] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<BlockId> {
        let head = self.head;
        if head == NO_BLOCK {
            return None;
        }
        self.remove(head);
        Some(head)
    }

    fn iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cursor = self.head;
        std::iter::from_fn(move || {
            if cursor == NO_BLOCK {
                return None;
            }
            let block = cursor;
            cursor = self.next[block as usize];
            Some(block)
        })
    }
}

/// The block pool.
#[derive(Clone, Debug)]
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    free_queue: FreeBlockQueue,
    /// Cached blocks by hash. Several physical copies of one hash can exist (two requests that
    /// computed the same block); lookups use the first.
    cached: HashMap<BlockHash, Vec<BlockId>>,
    events: Vec<KvEvent>,
    evictions: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks of `block_size` tokens.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        BlockPool {
            block_size,
            blocks: vec![Block::default(); num_blocks],
            free_queue: FreeBlockQueue::with_all(num_blocks),
            cached: HashMap::new(),
            events: Vec::new(),
            evictions: 0,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks (cached or not).
    pub fn num_free(&self) -> usize {
        self.free_queue.len
    }

    /// Distinct hashes currently cached (free or in use).
    pub fn num_cached_hashes(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of blocks held by requests (vLLM's `kv_cache_usage_perc`: free cached blocks
    /// do not count).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / self.blocks.len() as f64
    }

    /// Cached blocks evicted so far (each emitted a `BlockRemoved`).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Reference count of `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].ref_count
    }

    /// The cached block holding `hash`, if any.
    pub fn cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        self.cached
            .get(hash)
            .and_then(|copies| copies.first().copied())
    }

    /// Number of leading hashes of `chain` that are cached.
    pub fn cached_prefix_blocks(&self, chain: &[BlockHash]) -> usize {
        chain
            .iter()
            .take_while(|hash| self.cached.contains_key(hash))
            .count()
    }

    /// Cached copies per wire hash: what a mirror fed by this pool's events must hold.
    pub fn cached_copies(&self) -> HashMap<u64, usize> {
        self.cached
            .iter()
            .map(|(hash, copies)| (hash.wire_u64(), copies.len()))
            .collect()
    }

    /// Sum of all reference counts.
    pub fn total_references(&self) -> u64 {
        self.blocks
            .iter()
            .map(|block| u64::from(block.ref_count))
            .sum()
    }

    /// Hashes of free cached blocks in eviction order (next evicted first).
    pub fn eviction_order(&self) -> Vec<BlockHash> {
        self.free_queue
            .iter()
            .filter_map(|block| self.blocks[block as usize].cached_hash)
            .collect()
    }

    /// Takes a reference on blocks found in the prefix cache, pulling free ones out of the LRU
    /// queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            if self.blocks[block as usize].ref_count == 0 {
                self.free_queue.remove(block);
            }
            self.blocks[block as usize].ref_count += 1;
        }
    }

    /// Takes `count` blocks from the head of the free queue, evicting their cached hashes
    /// (lazy eviction: `BlockRemoved` is emitted only now). `None` if not enough are free.
    pub fn allocate(&mut self, count: usize) -> Option<Vec<BlockId>> {
        if count > self.num_free() {
            return None;
        }
        let mut allocated = Vec::with_capacity(count);
        for _ in 0..count {
            let block = self.free_queue.pop_front()?;
            self.evict(block);
            self.blocks[block as usize].ref_count = 1;
            allocated.push(block);
        }
        Some(allocated)
    }

    /// Drops one reference on each block of a request. Blocks are released tail first so a
    /// request's last blocks are evicted before its first ones (they are less likely shared).
    pub fn free(&mut self, request_blocks: &[BlockId]) {
        for &block in request_blocks.iter().rev() {
            let entry = &mut self.blocks[block as usize];
            debug_assert!(entry.ref_count > 0);
            entry.ref_count = entry.ref_count.saturating_sub(1);
            if entry.ref_count == 0 {
                self.free_queue.push_back(block);
            }
        }
    }

    /// Registers newly full blocks in the prefix cache and records one `BlockStored` for them.
    /// `hashes[i]` and `token_ids[i*block_size..]` belong to `blocks[i]`; `parent` is the hash
    /// of the block before `blocks[0]` in the request.
    /// `keys`: the request's extra keys; `first_index`: the index of `blocks[0]` in the
    /// request (the salt belongs to block 0 only).
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        token_ids: &[u32],
        keys: &CacheKeys,
        first_index: usize,
    ) {
        debug_assert_eq!(blocks.len(), hashes.len());
        if blocks.is_empty() {
            return;
        }
        for (&block, hash) in blocks.iter().zip(hashes) {
            debug_assert!(self.blocks[block as usize].cached_hash.is_none());
            self.blocks[block as usize].cached_hash = Some(*hash);
            self.cached.entry(*hash).or_default().push(block);
        }
        self.events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(BlockHash::wire_u64).collect(),
            parent_block_hash: parent.map(|hash| hash.wire_u64()),
            token_ids: token_ids.to_vec(),
            block_size: u32::try_from(self.block_size).unwrap_or(u32::MAX),
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_string()),
            lora_name: keys.lora.clone(),
            extra_keys: keys.event_keys(first_index, blocks.len()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.to_string()),
            kv_cache_spec_sliding_window: None,
        }));
    }

    /// Drops every cached hash, as vLLM's `reset_prefix_cache`: refused (false) while any block
    /// is held by a request. Records `AllBlocksCleared` on success.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free() != self.blocks.len() {
            return false;
        }
        for block in &mut self.blocks {
            block.cached_hash = None;
        }
        self.cached.clear();
        self.events
            .push(KvEvent::AllBlocksCleared(AllBlocksCleared));
        true
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    fn evict(&mut self, block: BlockId) {
        let Some(hash) = self.blocks[block as usize].cached_hash.take() else {
            return;
        };
        if let Some(copies) = self.cached.get_mut(&hash) {
            copies.retain(|&copy| copy != block);
            if copies.is_empty() {
                self.cached.remove(&hash);
            }
        }
        self.evictions += 1;
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![hash.wire_u64()],
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: Some(0),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use myelin_kv_events::hash_block_tokens;

    fn hash_of(seed: u32) -> BlockHash {
        hash_block_tokens(None, &[seed; 4])
    }

    #[test]
    fn free_queue_is_lru_with_middle_removal() {
        let mut queue = FreeBlockQueue::with_all(4);
        queue.remove(1);
        queue.push_back(1);
        assert_eq!(queue.iter().collect::<Vec<_>>(), vec![0, 2, 3, 1]);
        assert_eq!(queue.pop_front(), Some(0));
        queue.remove(1);
        assert_eq!(queue.iter().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(queue.len, 2);
    }

    #[test]
    fn eviction_is_lazy_and_emits_removed_on_reuse() {
        let mut pool = BlockPool::new(2, 4);
        let blocks = pool.allocate(2).expect("two free blocks");
        pool.cache_full_blocks(
            &blocks,
            &[hash_of(1), hash_of(2)],
            None,
            &[0; 8],
            &CacheKeys::default(),
            0,
        );
        pool.free(&blocks);
        let stored = pool.take_events();
        assert_eq!(stored.len(), 1);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.cached_prefix_blocks(&[hash_of(1), hash_of(2)]), 2);
        // Freed tail first: block of hash 2 is evicted first.
        assert_eq!(pool.eviction_order(), vec![hash_of(2), hash_of(1)]);
        let reused = pool.allocate(1).expect("a free block");
        assert_eq!(reused, vec![blocks[1]]);
        let events = pool.take_events();
        assert_eq!(
            events,
            vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![hash_of(2).wire_u64()],
                medium: Some(MEDIUM_GPU.to_string()),
                group_idx: Some(0),
            })]
        );
        assert_eq!(pool.evictions(), 1);
        assert!(pool.cached_block(&hash_of(1)).is_some());
        assert!(pool.cached_block(&hash_of(2)).is_none());
    }

    #[test]
    fn touch_takes_cached_blocks_out_of_the_free_queue() {
        let mut pool = BlockPool::new(3, 4);
        let blocks = pool.allocate(1).expect("free");
        pool.cache_full_blocks(
            &blocks,
            &[hash_of(7)],
            None,
            &[7; 4],
            &CacheKeys::default(),
            0,
        );
        pool.free(&blocks);
        assert_eq!(pool.num_free(), 3);
        pool.touch(&blocks);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.ref_count(blocks[0]), 1);
        assert!(pool.usage() > 0.3);
        assert!(!pool.reset_prefix_cache());
        pool.free(&blocks);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.num_cached_hashes(), 0);
        let events = pool.take_events();
        assert_eq!(
            events.last(),
            Some(&KvEvent::AllBlocksCleared(AllBlocksCleared))
        );
    }
}
