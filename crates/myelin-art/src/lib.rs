//! Adaptive radix tree over token-id prefixes, block-granular, bounded memory.
//!
//! A [`PrefixTree`] records which backends (inference engines) were routed which prompt
//! prefixes, and answers, in one walk, "for every backend, how many leading blocks of this prompt
//! has it been routed?". Prompts are split into blocks of `block_size` tokens (16 by default,
//! vLLM's), each block named by its [chain hash](chain_hash) (a hash of the block's tokens and
//! its parent's hash, so one 64-bit value names a whole prefix, as vLLM's block hashes do).
//!
//! The tree is a radix tree whose edges are runs of whole blocks (path compression: a branch-free
//! run of any length is one node) and whose child index adapts to fan-out (one child inline, a
//! linear-scanned vector up to 16, a hash map beyond; the roles of Node4/16 and Node48/256 in
//! Leis et al.'s ART). Every node carries per-backend entries: how many of its blocks the backend holds,
//! when it last routed through them (caller's clock), and an opaque residency stamp. Size is
//! bounded by `max_blocks`; inserts past it evict the least recently inserted leaves. See
//! `docs/art.md` for the design and its measurements.
//!
//! The crate does no I/O and reads no clock: time is an argument.
//!
//! ```
//! use myelin_art::{BackendId, PrefixTree, TreeConfig};
//!
//! let mut tree = PrefixTree::new(TreeConfig { block_size: 4, max_blocks: 1_000 })?;
//! let system: Vec<u32> = (0..8).collect(); // two blocks
//! let mut chat_a = system.clone();
//! chat_a.extend([100, 101, 102, 103]);
//! tree.insert(&chat_a, BackendId(1), 1_000);
//! tree.insert(&system, BackendId(2), 2_000);
//!
//! let mut chat_b = chat_a.clone();
//! chat_b.extend([7, 7, 7, 7, 7]); // the trailing partial block is never matched
//! let found = tree.lookup(&chat_b);
//! assert_eq!(found.matched_blocks_of(BackendId(1)), 3);
//! assert_eq!(found.matched_blocks_of(BackendId(2)), 2);
//!
//! // Backend 1 evicted the third block: its match falls back to the shared system prompt.
//! let chain = tree.chain(&chat_a);
//! tree.remove_block(chain.hashes(), BackendId(1));
//! assert_eq!(tree.lookup(&chat_b).matched_blocks_of(BackendId(1)), 2);
//! # Ok::<(), myelin_art::ConfigError>(())
//! ```

mod error;
mod hash;
pub mod model;
mod node;
mod tree;

pub use error::ConfigError;
pub use hash::{
    BlockChain, ChainHashKeyHasher, ChainHashMap, ROOT_CHAIN_HASH, chain_hash, chain_hashes_from,
    chain_hashes_into, namespace_root,
};
pub use node::BackendId;
pub use tree::{
    BackendPrefix, DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BLOCKS, InsertOutcome, MatchSegment, PrefixTree,
    TreeConfig, TreeMatch, TreeStats,
};
