//! Prefix ownership: which data core's shard owns a prompt, from the hash of its first block.
//!
//! Stable (a fixed hash, no per-process random state: every core and every peer agrees) and
//! uniform (the chain hash is well mixed; the range reduction is Lemire's multiply-shift).

use myelin_art::{BlockChain, ROOT_CHAIN_HASH, chain_hash};

/// The shard (0..n_shards) owning prompts whose first block is `first_block_tokens`.
///
/// Pass exactly the first block (`&tokens[..block_size]`), or the whole prompt when it is
/// shorter than a block. `n_shards == 0` is treated as 1.
pub fn owner_shard(first_block_tokens: &[u32], n_shards: usize) -> usize {
    owner_shard_of_key(chain_hash(ROOT_CHAIN_HASH, first_block_tokens), n_shards)
}

/// The shard owning the prompt `chain` was hashed from (same answer as [`owner_shard`]).
pub fn owner_shard_of_chain(chain: &BlockChain, n_shards: usize) -> usize {
    owner_shard_of_key(chain.owner_key(), n_shards)
}

/// The shard owning a prompt whose first block has chain hash `first_block_hash` (what the
/// KV-event path has when it sees a root block: no parent hash).
pub fn owner_shard_of_key(first_block_hash: u64, n_shards: usize) -> usize {
    let shards = n_shards.max(1) as u128;
    // Multiply-shift maps a uniform u64 onto 0..n without the bias or cost of `%`.
    ((u128::from(first_block_hash) * shards) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    /// xorshift64* (Vigna 2016): deterministic random tokens without a dependency.
    fn next_random(state: &mut u64) -> u64 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    #[test]
    fn ownership_is_uniform_chi_square() {
        // 200k random 16-token blocks over 7 shards. With 6 degrees of freedom the 99.99th
        // percentile of chi-square is ~27.9: a fair hash fails this about once in 10,000 seeds.
        const SHARDS: usize = 7;
        const SAMPLES: usize = 200_000;
        let mut state = 0x1234_5678_9abc_def1u64;
        let mut counts = [0usize; SHARDS];
        for _ in 0..SAMPLES {
            let block: Vec<u32> = (0..16)
                .map(|_| (next_random(&mut state) % 128_000) as u32)
                .collect();
            counts[owner_shard(&block, SHARDS)] += 1;
        }
        let expected = SAMPLES as f64 / SHARDS as f64;
        let chi_square: f64 = counts
            .iter()
            .map(|&count| (count as f64 - expected).powi(2) / expected)
            .sum();
        assert!(
            chi_square < 27.9,
            "chi-square {chi_square}, counts {counts:?}"
        );
    }

    #[test]
    fn ownership_is_uniform_on_near_identical_blocks() {
        // Prompts differing in one late token (templated traffic) must still spread.
        const SHARDS: usize = 4;
        let mut counts = [0usize; SHARDS];
        for user in 0..40_000u32 {
            let mut block = vec![151_644u32; 16];
            block[15] = user;
            counts[owner_shard(&block, SHARDS)] += 1;
        }
        let expected = 40_000.0 / SHARDS as f64;
        let chi_square: f64 = counts
            .iter()
            .map(|&count| (count as f64 - expected).powi(2) / expected)
            .sum();
        // 3 degrees of freedom: 99.99th percentile ~21.1.
        assert!(
            chi_square < 21.1,
            "chi-square {chi_square}, counts {counts:?}"
        );
    }

    #[test]
    fn ownership_is_stable_and_consistent() {
        let block: Vec<u32> = (1..=16).collect();
        // Pinned: a change here re-shards every deployment.
        assert_eq!(owner_shard(&block, 8), PINNED_OWNER_OF_1_TO_16_OVER_8);
        let tokens: Vec<u32> = (1..=40).collect();
        let chain = BlockChain::new(&tokens, NonZeroU32::new(16).unwrap());
        assert_eq!(
            owner_shard_of_chain(&chain, 8),
            owner_shard(&tokens[..16], 8)
        );
        assert_eq!(
            owner_shard_of_key(chain.hashes()[0], 8),
            owner_shard(&tokens[..16], 8)
        );
        let short = BlockChain::new(&tokens[..5], NonZeroU32::new(16).unwrap());
        assert_eq!(
            owner_shard_of_chain(&short, 8),
            owner_shard(&tokens[..5], 8)
        );
        assert_eq!(owner_shard(&block, 0), 0);
        assert_eq!(owner_shard(&block, 1), 0);
    }

    const PINNED_OWNER_OF_1_TO_16_OVER_8: usize = 3;
}
