//! One engine's KV-cache events turned into changes of the verified residency mirror, keyed by
//! the router's own chain hashes (every data core's replica applies them).
//!
//! The engine names a block by its own hash (vLLM: sha256 of the parent's hash and the block's
//! tokens, with a seed the router cannot always know), the router by its 64-bit chain hash of
//! the same tokens. Like Dynamo, the router does not try to reproduce the engine's hash: a
//! `BlockStored` event carries the blocks' token ids, so the router hashes them itself,
//! continuing the chain from the parent block, and remembers engine hash -> chain hash to
//! resolve later parents and removals. A block whose parent it never saw (stored
//! before the router subscribed, in a gap of the stream) cannot be placed in a chain and is
//! skipped; replaying the engine's buffered history at subscription narrows that window.
//!
//! Pure and synchronous: the subscriber thread feeds it decoded events in stream order.

use std::collections::HashMap;
use std::num::NonZeroU32;

use myelin_kv_events::decode::{DecodedEvent, MirrorFilter};
use myelin_kv_events::wire::{BlockRemoved, BlockStored, ExtraKey, KvEvent};
pub use myelin_routing::MirrorChange;
use myelin_routing::{chain_hash, namespace_root};

/// Engine blocks remembered per backend before the map is reset (a stream that lost its
/// removals would otherwise grow it forever; a real engine holds far fewer blocks). A reset
/// leaves the mirror inexact (blocks the engine still holds are forgotten and their
/// extensions become orphans), so the feed reports itself [`KvFeed::overflowed`] until the
/// engine clears its cache or restarts.
pub const MAX_TRACKED_BLOCKS: usize = 4 << 20;

/// Why events or blocks were not applied, for metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FeedCounters {
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Blocks of another medium (CPU offload), another KV-cache group (sliding window) or
    /// another instance (`locality` REMOTE).
    pub skipped_other_cache: u64,
    /// LoRA blocks of an engine that names its adapters by id only (vLLM before 0.14): their
    /// namespace is unknown. Named adapters' blocks are mirrored in the adapter's namespace.
    pub skipped_lora: u64,
    /// Blocks whose extra keys the feed cannot place in a namespace (multimodal or
    /// prompt-embeds keys, strings past the LoRA name and the first block's salt).
    pub skipped_extra_keys: u64,
    /// Blocks of another block size than the router's (`--block-size`).
    pub skipped_block_size: u64,
    /// Events whose token ids do not cover their blocks.
    pub skipped_malformed: u64,
    /// Stored blocks whose parent the feed never saw.
    pub skipped_orphan: u64,
    /// Removals of blocks the feed never saw stored.
    pub unknown_removals: u64,
    /// Times the tracked-block map passed its bound and was reset.
    pub overflow_clears: u64,
    /// The block size of the last event skipped for its block size (0: none was).
    pub foreign_block_size: u32,
}

#[derive(Debug, Clone, Copy)]
struct KnownBlock {
    chain: u64,
    copies: u32,
}

/// Engine block hash -> what the feed knows of it. foldhash rather than SipHash: two or
/// three probes per block event make the hash a visible share of the translation cost
/// (benches/kv_feed.rs), and the keys come from one engine, not from clients.
type BlockMap = HashMap<u64, KnownBlock, foldhash::fast::RandomState>;

/// The translator of one backend's stream.
#[derive(Debug, Clone)]
pub struct KvFeed {
    filter: MirrorFilter,
    block_size: NonZeroU32,
    blocks: BlockMap,
    /// [`MAX_TRACKED_BLOCKS`], smaller in tests.
    max_tracked: usize,
    /// The map was reset at its bound since the engine last cleared its cache.
    overflowed: bool,
    pub counters: FeedCounters,
}

impl KvFeed {
    pub fn new(block_size: NonZeroU32) -> KvFeed {
        KvFeed {
            filter: MirrorFilter::default(),
            block_size,
            blocks: BlockMap::default(),
            max_tracked: MAX_TRACKED_BLOCKS,
            overflowed: false,
            counters: FeedCounters::default(),
        }
    }

    /// The router's block size, which every mirrored block must have.
    pub fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }

    /// Whether the tracked-block map was reset at its bound since the engine last cleared its
    /// cache: the mirror then misses blocks the engine holds and must not be trusted.
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Engine blocks currently tracked.
    pub fn tracked_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The whole mirror this feed has built, as changes that rebuild it from anything:
    /// `Cleared`, then one `Stored` per copy of every block (to resync a replica that missed
    /// some of the feed's changes).
    pub fn snapshot(&self, out: &mut Vec<MirrorChange>) {
        out.push(MirrorChange::Cleared);
        for block in self.blocks.values() {
            for _ in 0..block.copies {
                out.push(MirrorChange::Stored(block.chain));
            }
        }
    }

    /// Appends the mirror updates `decoded` implies to `out` (none for events about another
    /// cache than the engine's own GPU cache of its full-attention group).
    pub fn apply(&mut self, decoded: &DecodedEvent, out: &mut Vec<MirrorChange>) {
        if !self.filter.accepts(decoded) {
            self.counters.skipped_other_cache += match &decoded.event {
                KvEvent::BlockStored(stored) => stored.block_hashes.len() as u64,
                KvEvent::BlockRemoved(removed) => removed.block_hashes.len() as u64,
                KvEvent::AllBlocksCleared(_) => 0,
            };
            return;
        }
        match &decoded.event {
            KvEvent::BlockStored(stored) => self.stored(stored, out),
            KvEvent::BlockRemoved(removed) => self.removed(removed, out),
            KvEvent::AllBlocksCleared(_) => self.clear(out),
        }
    }

    /// The engine lost everything (cache reset, or it restarted: its sequence went back).
    pub fn clear(&mut self, out: &mut Vec<MirrorChange>) {
        self.blocks.clear();
        self.overflowed = false;
        out.push(MirrorChange::Cleared);
    }

    fn stored(&mut self, stored: &BlockStored, out: &mut Vec<MirrorChange>) {
        let blocks = stored.block_hashes.len() as u64;
        if stored.lora_id.is_some() && stored.lora_name.is_none() {
            self.counters.skipped_lora += blocks;
            return;
        }
        let Some(salt) = chain_salt(stored) else {
            self.counters.skipped_extra_keys += blocks;
            return;
        };
        if stored.block_size != self.block_size.get() {
            self.counters.skipped_block_size += blocks;
            self.counters.foreign_block_size = stored.block_size;
            return;
        }
        let size = self.block_size.get() as usize;
        if stored.token_ids.len() != stored.block_hashes.len() * size {
            self.counters.skipped_malformed += blocks;
            return;
        }
        let mut parent_chain = match stored.parent_block_hash {
            None => namespace_root(stored.lora_name.as_deref(), salt),
            Some(parent) => match self.blocks.get(&parent) {
                Some(known) => known.chain,
                None => {
                    self.counters.skipped_orphan += blocks;
                    return;
                }
            },
        };
        if self.blocks.len() + stored.block_hashes.len() > self.max_tracked {
            self.blocks.clear();
            self.overflowed = true;
            self.counters.overflow_clears += 1;
            out.push(MirrorChange::Cleared);
        }
        for (&engine_hash, tokens) in stored
            .block_hashes
            .iter()
            .zip(stored.token_ids.chunks_exact(size))
        {
            let chain = chain_hash(parent_chain, tokens);
            match self.blocks.get_mut(&engine_hash) {
                // Another copy of the same block (vLLM computes a prefix twice when two
                // requests prefill it at once, and announces and evicts each copy).
                Some(known) if known.chain == chain => {
                    known.copies = known.copies.saturating_add(1);
                }
                // The engine reuses a hash for other tokens (another parent, a new hash seed):
                // the old block is gone from the engine's index, so its copies leave the
                // mirror too, or they would stay resident forever.
                Some(known) => {
                    for _ in 0..known.copies {
                        out.push(MirrorChange::Removed(known.chain));
                    }
                    *known = KnownBlock { chain, copies: 1 };
                }
                None => {
                    self.blocks
                        .insert(engine_hash, KnownBlock { chain, copies: 1 });
                }
            }
            out.push(MirrorChange::Stored(chain));
            self.counters.stored_blocks += 1;
            parent_chain = chain;
        }
    }

    fn removed(&mut self, removed: &BlockRemoved, out: &mut Vec<MirrorChange>) {
        // (A removal names engine hashes only: the namespace came with the stored block.)
        for engine_hash in &removed.block_hashes {
            let Some(known) = self.blocks.get_mut(engine_hash) else {
                self.counters.unknown_removals += 1;
                continue;
            };
            let chain = known.chain;
            known.copies -= 1;
            if known.copies == 0 {
                self.blocks.remove(engine_hash);
            }
            out.push(MirrorChange::Removed(chain));
            self.counters.removed_blocks += 1;
        }
    }
}

/// The `cache_salt` a `BlockStored` event's extra keys name (`Some(None)`: none), or `None`
/// when they hold what the feed cannot place: every block's keys must be the LoRA name (when
/// the event names one) and, on a chain's first block only, one more string, the salt (vLLM
/// hashes `lora name, multimodal keys, cache salt` in that order, the salt into the first
/// block alone).
fn chain_salt(stored: &BlockStored) -> Option<Option<&str>> {
    let Some(blocks) = &stored.extra_keys else {
        return Some(None);
    };
    let mut salt = None;
    for (index, keys) in blocks.iter().enumerate() {
        let mut keys = keys.as_deref().unwrap_or_default().iter();
        if let Some(adapter) = &stored.lora_name {
            match keys.next() {
                Some(ExtraKey::Str(name)) if name == adapter => {}
                _ => return None,
            }
        }
        match (keys.next(), keys.next()) {
            (None, _) => {}
            (Some(ExtraKey::Str(key)), None)
                if index == 0 && stored.parent_block_hash.is_none() =>
            {
                salt = Some(key.as_str());
            }
            _ => return None,
        }
    }
    Some(salt)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use myelin_kv_events::wire::{AllBlocksCleared, KV_CACHE_SPEC_FULL_ATTENTION, MEDIUM_GPU};
    use myelin_routing::{BlockChain, ROOT_CHAIN_HASH};

    fn feed() -> KvFeed {
        KvFeed::new(NonZeroU32::new(4).unwrap())
    }

    pub(crate) fn local(event: KvEvent) -> DecodedEvent {
        DecodedEvent {
            event,
            locality: None,
        }
    }

    /// A `BlockStored` of 4-token blocks.
    pub(crate) fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> DecodedEvent {
        local(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: 4,
            lora_id: None,
            medium: Some(MEDIUM_GPU.into()),
            lora_name: None,
            extra_keys: None,
            group_idx: Some(0),
            kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.into()),
            kv_cache_spec_sliding_window: None,
        }))
    }

    fn removed(hashes: &[u64]) -> DecodedEvent {
        local(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: Some(MEDIUM_GPU.into()),
            group_idx: None,
        }))
    }

    #[test]
    fn stored_blocks_get_the_routers_chain_hashes() {
        let tokens: Vec<u32> = (1..=12).collect();
        let chain = BlockChain::new(&tokens, NonZeroU32::new(4).unwrap());
        let mut feed = feed();
        let mut out = Vec::new();
        // The engine stores the first block, then the next two in a second event.
        feed.apply(&stored(&[101], None, &tokens[..4]), &mut out);
        feed.apply(&stored(&[102, 103], Some(101), &tokens[4..]), &mut out);
        let want: Vec<MirrorChange> = chain
            .hashes()
            .iter()
            .map(|&hash| MirrorChange::Stored(hash))
            .collect();
        assert_eq!(out, want);
        out.clear();
        feed.apply(&removed(&[103, 999]), &mut out);
        assert_eq!(out, vec![MirrorChange::Removed(chain.hashes()[2])]);
        assert_eq!(feed.counters.unknown_removals, 1);
        assert_eq!(feed.tracked_blocks(), 2);
    }

    #[test]
    fn copies_are_counted_and_orphans_and_foreign_caches_skipped() {
        let tokens: Vec<u32> = (1..=4).collect();
        let mut feed = feed();
        let mut out = Vec::new();
        feed.apply(&stored(&[7], None, &tokens), &mut out);
        feed.apply(&stored(&[7], None, &tokens), &mut out);
        feed.apply(&removed(&[7]), &mut out);
        assert_eq!(feed.tracked_blocks(), 1, "one copy is left");
        feed.apply(&removed(&[7]), &mut out);
        assert_eq!(feed.tracked_blocks(), 0);
        assert_eq!(out.len(), 4);

        out.clear();
        feed.apply(&stored(&[8], Some(12345), &tokens), &mut out);
        assert_eq!(feed.counters.skipped_orphan, 1);
        let KvEvent::BlockStored(mut cpu) = stored(&[9], None, &tokens).event else {
            unreachable!()
        };
        let mut apply = |stored: &BlockStored, locality: Option<&str>| {
            let decoded = DecodedEvent {
                event: KvEvent::BlockStored(stored.clone()),
                locality: locality.map(str::to_string),
            };
            feed.apply(&decoded, &mut out);
        };
        apply(&cpu, Some("REMOTE"));
        cpu.medium = Some("CPU".into());
        apply(&cpu, None);
        cpu.medium = None;
        cpu.kv_cache_spec_kind = Some("sliding_window".into());
        apply(&cpu, None);
        cpu.kv_cache_spec_kind = None;
        cpu.lora_id = Some(1);
        apply(&cpu, None);
        cpu.lora_id = None;
        cpu.extra_keys = Some(vec![Some(vec![ExtraKey::Other])]);
        apply(&cpu, None);
        cpu.extra_keys = None;
        cpu.block_size = 16;
        apply(&cpu, None);
        cpu.block_size = 4;
        cpu.token_ids.pop();
        apply(&cpu, None);
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(feed.counters.skipped_other_cache, 3);
        assert_eq!(feed.counters.skipped_lora, 1);
        assert_eq!(feed.counters.skipped_extra_keys, 1);
        assert_eq!(feed.counters.skipped_block_size, 1);
        assert_eq!(feed.counters.foreign_block_size, 16);
        assert_eq!(feed.counters.skipped_malformed, 1);
    }

    #[test]
    fn adapter_and_salted_blocks_are_mirrored_in_their_namespace() {
        let tokens: Vec<u32> = (1..=8).collect();
        let block_size = NonZeroU32::new(4).unwrap();
        let event = |hashes: &[u64], parent, tokens: &[u32], adapter: Option<&str>, keys| {
            let KvEvent::BlockStored(mut stored) = stored(hashes, parent, tokens).event else {
                unreachable!()
            };
            stored.lora_name = adapter.map(str::to_string);
            stored.extra_keys = keys;
            local(KvEvent::BlockStored(stored))
        };
        let text = |key: &str| ExtraKey::Str(key.to_string());
        let mut feed = feed();
        let mut out = Vec::new();
        // An adapter's request with a salt: the adapter's name on every block, the salt on the
        // first (as vLLM 0.17+ publishes them), the second block in a later event.
        feed.apply(
            &event(
                &[1],
                None,
                &tokens[..4],
                Some("sql"),
                Some(vec![Some(vec![text("sql"), text("tenant")])]),
            ),
            &mut out,
        );
        feed.apply(
            &event(
                &[2],
                Some(1),
                &tokens[4..],
                Some("sql"),
                Some(vec![Some(vec![text("sql")])]),
            ),
            &mut out,
        );
        // The base model's salted request, and an unsalted one.
        feed.apply(
            &event(
                &[3],
                None,
                &tokens[..4],
                None,
                Some(vec![Some(vec![text("tenant")])]),
            ),
            &mut out,
        );
        feed.apply(&event(&[4], None, &tokens[..4], None, None), &mut out);
        let chain = |adapter, salt| {
            BlockChain::in_namespace(namespace_root(adapter, salt), &tokens, block_size)
        };
        let adapter_salted = chain(Some("sql"), Some("tenant"));
        assert_eq!(
            out,
            vec![
                MirrorChange::Stored(adapter_salted.hashes()[0]),
                MirrorChange::Stored(adapter_salted.hashes()[1]),
                MirrorChange::Stored(chain(None, Some("tenant")).hashes()[0]),
                MirrorChange::Stored(BlockChain::new(&tokens, block_size).hashes()[0]),
            ]
        );
        // What cannot be placed is skipped: a salt on a later block, a block without the
        // adapter's name, two strings on a first block, a multimodal key.
        out.clear();
        for bad in [
            event(
                &[5],
                Some(4),
                &tokens[4..],
                None,
                Some(vec![Some(vec![text("x")])]),
            ),
            event(&[6], None, &tokens[..4], Some("sql"), Some(vec![None])),
            event(
                &[7],
                None,
                &tokens[..4],
                None,
                Some(vec![Some(vec![text("a"), text("b")])]),
            ),
            event(
                &[8],
                None,
                &tokens[..4],
                None,
                Some(vec![Some(vec![ExtraKey::Other])]),
            ),
        ] {
            feed.apply(&bad, &mut out);
        }
        assert!(out.is_empty(), "{out:?}");
        assert_eq!(feed.counters.skipped_extra_keys, 4);
    }

    #[test]
    fn a_hash_stored_again_for_other_tokens_replaces_its_block() {
        let (first, second): (Vec<u32>, Vec<u32>) = ((1..=4).collect(), (5..=8).collect());
        let root = |tokens: &[u32]| chain_hash(ROOT_CHAIN_HASH, tokens);
        let mut feed = feed();
        let mut out = Vec::new();
        feed.apply(&stored(&[7], None, &first), &mut out);
        feed.apply(&stored(&[7], None, &first), &mut out);
        out.clear();
        feed.apply(&stored(&[7], None, &second), &mut out);
        // Both copies of the old block leave the mirror; the new block is one copy.
        assert_eq!(
            out,
            vec![
                MirrorChange::Removed(root(&first)),
                MirrorChange::Removed(root(&first)),
                MirrorChange::Stored(root(&second)),
            ]
        );
        assert_eq!(feed.tracked_blocks(), 1);
        out.clear();
        feed.apply(&removed(&[7]), &mut out);
        assert_eq!(out, vec![MirrorChange::Removed(root(&second))]);
        assert_eq!(feed.tracked_blocks(), 0);
    }

    #[test]
    fn a_reset_at_the_bound_leaves_the_feed_overflowed_until_the_engine_clears() {
        let mut feed = feed();
        feed.max_tracked = 2;
        let mut out = Vec::new();
        let tokens: Vec<u32> = (1..=12).collect();
        feed.apply(&stored(&[1, 2], None, &tokens[..8]), &mut out);
        assert!(!feed.overflowed());
        out.clear();
        feed.apply(&stored(&[3], Some(2), &tokens[8..]), &mut out);
        assert!(feed.overflowed());
        assert_eq!(feed.counters.overflow_clears, 1);
        assert_eq!(out[0], MirrorChange::Cleared);
        assert_eq!(feed.tracked_blocks(), 1);
        feed.apply(
            &local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
            &mut out,
        );
        assert!(!feed.overflowed());
    }

    #[test]
    fn clearing_forgets_blocks() {
        let tokens: Vec<u32> = (1..=4).collect();
        let mut feed = feed();
        let mut out = Vec::new();
        feed.apply(&stored(&[7], None, &tokens), &mut out);
        out.clear();
        feed.apply(
            &local(KvEvent::AllBlocksCleared(AllBlocksCleared)),
            &mut out,
        );
        assert_eq!(out, vec![MirrorChange::Cleared]);
        assert_eq!(feed.tracked_blocks(), 0);
        out.clear();
        feed.apply(&removed(&[7]), &mut out);
        assert!(out.is_empty());
    }
}
