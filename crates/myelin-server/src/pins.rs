//! The router's own view of an engine's KV memory: the prompt blocks its requests in flight
//! hold there, a block shared by several of them counted once (docs/routing.md, "KV memory
//! without the engine's figures").
//!
//! Requests sharing a prefix may arrive on different data cores, so each core counting its own
//! would count a shared prefix once per core. Instead every block is counted on the core that
//! owns its chain hash (hash modulo the data cores), whichever core the request is on; the
//! tokens beyond the last full block are the request's own and count on its core. The cores'
//! counts add up to the distinct blocks. Owning blocks, not prompts, spreads the work: real
//! traffic shares its first blocks (the chat template's header, the system prompt), and an
//! owner per prompt would put every request's counting on one core.
//!
//! A request's pin and, when it ends, its unpin go to every other data core with the next
//! flush (one shared batch per round, like learned routes). A dropped unpin would leave blocks
//! held forever, so every core also sends the others the keys of its live requests every resync
//! interval; a core drops any pin from that core not listed (the mesh is FIFO per pair of
//! cores: a pin sent before the list arrives before it).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use myelin_routing::BlockChain;

use crate::backends::BackendId;

/// A request's prompt as the backend's KV memory holds it: its full blocks by chain hash (shared
/// with other requests of the same prefix) and the tokens beyond them (the last partial block,
/// and what was not tokenized, counted as its own).
#[derive(Debug, Clone)]
pub struct PromptBlocks {
    pub chain: Arc<BlockChain>,
    pub tail_tokens: u64,
}

impl PromptBlocks {
    /// `prompt_tokens` (the whole prompt's count) of which `chain` hashes the first full blocks.
    pub fn new(chain: Arc<BlockChain>, prompt_tokens: u64) -> Self {
        let hashed = chain.len() as u64 * u64::from(chain.block_size().get());
        PromptBlocks {
            tail_tokens: prompt_tokens.saturating_sub(hashed),
            chain,
        }
    }

    /// The hashes of this prompt's blocks that data core `shard` of `shards` counts.
    pub fn owned(&self, shard: usize, shards: usize) -> impl Iterator<Item = u64> + '_ {
        let shards = shards.max(1) as u64;
        self.chain
            .hashes()
            .iter()
            .copied()
            .filter(move |hash| hash % shards == shard as u64)
    }

    /// Tokens `blocks` blocks amount to.
    pub fn block_tokens(&self, blocks: u64) -> u64 {
        blocks * u64::from(self.chain.block_size().get())
    }
}

/// A pin or unpin of one request's prompt, applied on every data core.
#[derive(Debug, Clone)]
pub struct PinChange {
    /// The core the request is on, and its key there.
    pub from: usize,
    pub key: u64,
    pub backend: BackendId,
    /// `Some`: pin these blocks; `None`: release what `key` pinned.
    pub prompt: Option<PromptBlocks>,
}

/// The pins a core holds, for requests of every core (its own included).
#[derive(Debug, Default)]
pub struct OwnedPins {
    pins: HashMap<(usize, u64), (BackendId, PromptBlocks)>,
}

impl OwnedPins {
    /// Records a pin; `false` when the key was pinned already (nothing to count again).
    pub fn pin(&mut self, from: usize, key: u64, backend: BackendId, prompt: PromptBlocks) -> bool {
        match self.pins.entry((from, key)) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert((backend, prompt));
                true
            }
        }
    }

    /// Removes a pin; what it held, `None` when unknown (dropped, or reconciled away).
    pub fn unpin(&mut self, from: usize, key: u64) -> Option<(BackendId, PromptBlocks)> {
        self.pins.remove(&(from, key))
    }

    /// Removes every pin of core `from` whose key is not in `live`: what they held.
    pub fn reconcile(
        &mut self,
        from: usize,
        live: &BTreeSet<u64>,
    ) -> Vec<(BackendId, PromptBlocks)> {
        let dead: Vec<(usize, u64)> = self
            .pins
            .keys()
            .filter(|(core, key)| *core == from && !live.contains(key))
            .copied()
            .collect();
        dead.into_iter()
            .filter_map(|key| self.pins.remove(&key))
            .collect()
    }

    /// Pins held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.pins.len()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn prompt(tokens: u32) -> PromptBlocks {
        let ids: Vec<u32> = (0..tokens).collect();
        PromptBlocks::new(
            Arc::new(BlockChain::new(&ids, NonZeroU32::new(16).unwrap())),
            u64::from(tokens),
        )
    }

    #[test]
    fn every_block_is_counted_on_one_core_and_the_partial_block_is_the_tail() {
        let long = prompt(200);
        assert_eq!(long.tail_tokens, 8);
        assert_eq!(long.block_tokens(12), 192);
        // The 12 full blocks are split over 4 cores, each on exactly one.
        let mut counted: Vec<u64> = (0..4).flat_map(|shard| long.owned(shard, 4)).collect();
        counted.sort_unstable();
        let mut all = long.chain.hashes().to_vec();
        all.sort_unstable();
        assert_eq!(counted, all);
        // A sibling's shared blocks go to the same cores as the first prompt's.
        let sibling = prompt(100);
        for shard in 0..4 {
            let mine: Vec<u64> = long.owned(shard, 4).collect();
            assert!(sibling.owned(shard, 4).all(|hash| mine.contains(&hash)));
        }
        // One core counts everything.
        assert_eq!(long.owned(0, 1).count(), 12);
        // A prompt tokenized only in part: the rest counts as its own tail.
        assert_eq!(
            PromptBlocks::new(long.chain.clone(), 1_000).tail_tokens,
            808
        );
    }

    #[test]
    fn reconciling_drops_only_the_listed_cores_pins_it_did_not_list() {
        let mut owned = OwnedPins::default();
        assert!(owned.pin(1, 10, BackendId(0), prompt(32)));
        assert!(
            !owned.pin(1, 10, BackendId(0), prompt(32)),
            "a key is pinned once"
        );
        assert!(owned.pin(1, 11, BackendId(2), prompt(32)));
        assert!(owned.pin(2, 10, BackendId(0), prompt(32)));
        // Core 1 lists only key 11 as live: its key 10 lost its unpin.
        let dropped = owned.reconcile(1, &BTreeSet::from([11]));
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].0, BackendId(0));
        assert_eq!(owned.len(), 2);
        assert!(owned.unpin(1, 10).is_none());
        assert_eq!(
            owned.unpin(1, 11).map(|(backend, _)| backend),
            Some(BackendId(2))
        );
        assert_eq!(
            owned.unpin(2, 10).map(|(backend, _)| backend),
            Some(BackendId(0))
        );
        assert_eq!(owned.len(), 0);
    }
}
