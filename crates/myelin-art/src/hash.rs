//! Block chain hashing: a fixed, portable 64-bit hash of each full block of a token sequence,
//! chained through its parent so a hash names a whole prefix (vLLM-style), plus [`BlockChain`].
//!
//! The hash is stable across processes, platforms and releases (its test vectors are pinned in
//! the tests): the replicated prefix trees, the verified residency mirror and peer routers depend on every
//! core and every peer computing the same value. It is fast (a few cycles per token), not
//! cryptographic: a collision only mis-scores one request, it never breaks correctness.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::num::NonZeroU32;

/// A map keyed by chain hashes, which are uniform 64-bit values already: hashing them again
/// would only cost time.
pub type ChainHashMap<V> = HashMap<u64, V, BuildHasherDefault<ChainHashKeyHasher>>;

/// The hasher of [`ChainHashMap`]: a `u64` key is its own hash.
#[derive(Default)]
pub struct ChainHashKeyHasher(u64);

impl Hasher for ChainHashKeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

/// Chain hash of the (virtual) empty prefix: the parent of every first block.
pub const ROOT_CHAIN_HASH: u64 = 0x6d79_656c_696e_0001;

/// Number of per-position secret pairs; positions beyond wrap with a per-lap offset.
const SECRET_PAIRS: usize = 16;
/// Golden-ratio increment, used to seed the secrets and to offset wrapped positions.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
/// Fixed seed of the secret table (never change: it would re-key every stored prefix).
const SECRET_SEED: u64 = 0x243f_6a88_85a3_08d3;

const SECRETS: [u64; 2 * SECRET_PAIRS] = make_secrets();
const FINAL_MIX_A: u64 = 0xa076_1d64_78bd_642f;
const FINAL_MIX_B: u64 = 0xe703_7ed1_a0b4_28db;
const FINAL_MIX_C: u64 = 0x8ebc_6af0_9c88_c6e3;

/// splitmix64 (Steele, Lea, Flood 2014) run at compile time: well-spread odd-ish constants.
const fn make_secrets() -> [u64; 2 * SECRET_PAIRS] {
    let mut out = [0u64; 2 * SECRET_PAIRS];
    let mut state = SECRET_SEED;
    let mut index = 0;
    while index < out.len() {
        state = state.wrapping_add(GOLDEN_GAMMA);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out[index] = (z ^ (z >> 31)) | 1;
        index += 1;
    }
    out
}

/// 64x64 -> 128-bit multiply folded back to 64 bits (the mixing step of wyhash/foldhash).
#[inline(always)]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

#[inline(always)]
fn secret_pair(position: usize) -> (u64, u64) {
    let slot = position % SECRET_PAIRS;
    let lap_offset = ((position / SECRET_PAIRS) as u64).wrapping_mul(GOLDEN_GAMMA);
    (
        SECRETS[2 * slot].wrapping_add(lap_offset),
        SECRETS[2 * slot + 1].wrapping_add(lap_offset),
    )
}

/// Hash of `block` (the tokens of one block) chained onto the hash of its parent prefix.
///
/// Each group of four tokens is multiplied with its own position secrets, so groups are
/// independent multiplies the CPU overlaps; only the final multiply depends on the parent.
#[inline]
pub fn chain_hash(parent: u64, block: &[u32]) -> u64 {
    match <&[u32; 16]>::try_from(block) {
        Ok(block16) => finish(parent, block_sum_16(block16), 16),
        Err(_) => finish(parent, block_sum(block), block.len() as u64),
    }
}

#[inline(always)]
fn pack(low: u32, high: u32) -> u64 {
    u64::from(low) | (u64::from(high) << 32)
}

/// The group sum of any block length (groups of four tokens, the last one zero-padded).
#[inline(always)]
fn block_sum(block: &[u32]) -> u64 {
    let mut sum: u64 = 0;
    let mut groups = block.chunks_exact(4);
    let mut position = 0;
    for group in &mut groups {
        let (secret_low, secret_high) = secret_pair(position);
        sum = sum.wrapping_add(folded_multiply(
            pack(group[0], group[1]) ^ secret_low,
            pack(group[2], group[3]) ^ secret_high,
        ));
        position += 1;
    }
    let remainder = groups.remainder();
    if !remainder.is_empty() {
        let mut padded = [0u32; 4];
        padded[..remainder.len()].copy_from_slice(remainder);
        let (secret_low, secret_high) = secret_pair(position);
        sum = sum.wrapping_add(folded_multiply(
            pack(padded[0], padded[1]) ^ secret_low,
            pack(padded[2], padded[3]) ^ secret_high,
        ));
    }
    sum
}

/// [`block_sum`] specialised to the default block size (same value; fully unrolled).
#[inline(always)]
fn block_sum_16(block: &[u32; 16]) -> u64 {
    let group = |index: usize| {
        folded_multiply(
            pack(block[4 * index], block[4 * index + 1]) ^ SECRETS[2 * index],
            pack(block[4 * index + 2], block[4 * index + 3]) ^ SECRETS[2 * index + 1],
        )
    };
    (group(0).wrapping_add(group(1))).wrapping_add(group(2).wrapping_add(group(3)))
}

/// Folds the block's group sum into its parent's hash. One multiply depends on the parent, so
/// hashing a long prompt is bound by multiply throughput, not by a latency chain; both factors
/// carry the parent so no block value can make the result ignore its prefix.
#[inline(always)]
fn finish(parent: u64, sum: u64, length: u64) -> u64 {
    let block_value = sum.wrapping_add(length.rotate_left(32) ^ FINAL_MIX_C);
    folded_multiply(
        block_value ^ parent ^ FINAL_MIX_A,
        parent.rotate_left(29) ^ FINAL_MIX_B,
    )
}

/// Parent of the roots of named namespaces ([`namespace_root`]): no block chains onto it, so
/// a namespace's root is never the hash of some first block of the plain namespace.
const NAMESPACE_DOMAIN: u64 = 0x6d79_656c_696e_6e73;

/// The root a namespace's chains hang from instead of [`ROOT_CHAIN_HASH`]: prompts hashed in
/// two namespaces never share a block, so nothing learned in one matches the other. `words`
/// names the namespace (the caller's encoding); empty is the plain namespace, whose root is
/// [`ROOT_CHAIN_HASH`].
pub fn namespace_root(words: &[u32]) -> u64 {
    if words.is_empty() {
        ROOT_CHAIN_HASH
    } else {
        chain_hash(NAMESPACE_DOMAIN, words)
    }
}

/// Appends the chain hash of every *full* block of `tokens` to `out` (a trailing partial block
/// is not hashed: engines only cache full blocks).
pub fn chain_hashes_into(tokens: &[u32], block_size: NonZeroU32, out: &mut Vec<u64>) {
    chain_hashes_from(ROOT_CHAIN_HASH, tokens, block_size, out);
}

/// [`chain_hashes_into`] in the namespace whose root is `root` ([`namespace_root`]).
pub fn chain_hashes_from(root: u64, tokens: &[u32], block_size: NonZeroU32, out: &mut Vec<u64>) {
    let block_size = block_size.get() as usize;
    out.reserve(tokens.len() / block_size);
    let mut parent = root;
    for block in tokens.chunks_exact(block_size) {
        parent = chain_hash(parent, block);
        out.push(parent);
    }
}

/// The block chain of one prompt: the chain hash of each full block.
///
/// Computed once per request on the accepting core; the local replica reads it by reference
/// and the learn broadcast shares it with the other cores behind an `Arc`. `Send`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockChain {
    block_size: NonZeroU32,
    hashes: Vec<u64>,
}

impl BlockChain {
    /// Hashes `tokens` block by block.
    pub fn new(tokens: &[u32], block_size: NonZeroU32) -> Self {
        Self::in_namespace(ROOT_CHAIN_HASH, tokens, block_size)
    }

    /// Hashes `tokens` block by block from the namespace root `root` ([`namespace_root`]).
    pub fn in_namespace(root: u64, tokens: &[u32], block_size: NonZeroU32) -> Self {
        let mut hashes = Vec::new();
        chain_hashes_from(root, tokens, block_size, &mut hashes);
        Self { block_size, hashes }
    }

    /// Builds a chain from hashes computed elsewhere (e.g. from KV events' token ids).
    pub fn from_hashes(hashes: Vec<u64>, block_size: NonZeroU32) -> Self {
        Self { block_size, hashes }
    }

    /// Tokens per block this chain was hashed with.
    pub fn block_size(&self) -> NonZeroU32 {
        self.block_size
    }

    /// Chain hash of each full block, first block first.
    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// True when the prompt is shorter than one block.
    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK_16: NonZeroU32 = NonZeroU32::new(16).unwrap();

    #[test]
    fn hash_is_pinned_across_releases() {
        // Shards, peers and the residency mirror must agree on these values forever.
        let block: Vec<u32> = (1..=16).collect();
        assert_eq!(chain_hash(ROOT_CHAIN_HASH, &block), PINNED_FIRST_BLOCK);
        assert_eq!(chain_hash(PINNED_FIRST_BLOCK, &block), PINNED_SECOND_BLOCK);
        assert_eq!(chain_hash(ROOT_CHAIN_HASH, &[]), PINNED_EMPTY);
    }

    const PINNED_FIRST_BLOCK: u64 = 0x782e_82ce_67c6_2113;
    const PINNED_SECOND_BLOCK: u64 = 0x6597_e8c1_727e_6bac;
    const PINNED_EMPTY: u64 = 0x6877_9306_0eae_2a47;

    #[test]
    fn specialised_block_size_matches_the_generic_path() {
        let block: Vec<u32> = (0..16).map(|token| token * 7_919 + 3).collect();
        let generic = finish(42, block_sum(&block), 16);
        assert_eq!(chain_hash(42, &block), generic);
    }

    #[test]
    fn hash_depends_on_order_parent_and_length() {
        let block: Vec<u32> = (1..=16).collect();
        let mut swapped = block.clone();
        swapped.swap(0, 4);
        let base = chain_hash(ROOT_CHAIN_HASH, &block);
        assert_ne!(base, chain_hash(ROOT_CHAIN_HASH, &swapped));
        assert_ne!(base, chain_hash(ROOT_CHAIN_HASH ^ 1, &block));
        assert_ne!(
            chain_hash(ROOT_CHAIN_HASH, &[1, 2, 3]),
            chain_hash(ROOT_CHAIN_HASH, &[1, 2, 3, 0])
        );
        // Groups must not commute: swapping two whole 4-token groups changes the hash.
        let mut group_swapped = block.clone();
        group_swapped[..4].copy_from_slice(&block[4..8]);
        group_swapped[4..8].copy_from_slice(&block[..4]);
        assert_ne!(base, chain_hash(ROOT_CHAIN_HASH, &group_swapped));
    }

    #[test]
    fn chain_covers_only_full_blocks_and_chains_parents() {
        let tokens: Vec<u32> = (0..40).collect();
        let chain = BlockChain::new(&tokens, BLOCK_16);
        assert_eq!(chain.len(), 2);
        assert_eq!(
            chain.hashes()[0],
            chain_hash(ROOT_CHAIN_HASH, &tokens[..16])
        );
        assert_eq!(
            chain.hashes()[1],
            chain_hash(chain.hashes()[0], &tokens[16..32])
        );
        let short = BlockChain::new(&tokens[..5], BLOCK_16);
        assert!(short.is_empty());
    }

    #[test]
    fn namespaces_share_no_block_and_the_plain_one_is_the_root() {
        let tokens: Vec<u32> = (0..48).collect();
        assert_eq!(namespace_root(&[]), ROOT_CHAIN_HASH);
        let plain = BlockChain::new(&tokens, BLOCK_16);
        assert_eq!(
            BlockChain::in_namespace(ROOT_CHAIN_HASH, &tokens, BLOCK_16),
            plain
        );
        let a = BlockChain::in_namespace(namespace_root(&[1, 2]), &tokens, BLOCK_16);
        let b = BlockChain::in_namespace(namespace_root(&[1, 3]), &tokens, BLOCK_16);
        for chain in [&a, &b] {
            assert_eq!(chain.len(), 3);
            assert!(
                chain
                    .hashes()
                    .iter()
                    .all(|hash| !plain.hashes().contains(hash))
            );
        }
        assert!(a.hashes().iter().all(|hash| !b.hashes().contains(hash)));
        // A namespace's root is not the first block of the plain namespace with those tokens.
        let words: Vec<u32> = (0..16).collect();
        assert_ne!(namespace_root(&words), plain.hashes()[0]);
    }
}
