//! Memory per stored block, on a representative shape (shared system prompts, per-user turns,
//! several backends) and on the adversarial shape (a branch at every block).

use myelin_art::{BackendId, PrefixTree, TreeConfig};

/// xorshift64* (Vigna 2016).
fn next_token(state: &mut u64) -> u32 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as u32 % 128_000
}

#[test]
fn representative_tree_stays_within_64_bytes_per_block_per_backend() {
    let mut state = 7u64;
    let systems: Vec<Vec<u32>> = (0..32)
        .map(|_| (0..256).map(|_| next_token(&mut state)).collect())
        .collect();
    let mut tree = PrefixTree::new(TreeConfig::default()).unwrap();
    for chat in 0..5_000usize {
        let mut prompt = systems[chat % systems.len()].clone();
        let user_tokens = 64 + (chat % 7) * 64;
        prompt.extend((0..user_tokens).map(|_| next_token(&mut state)));
        tree.insert(&prompt, BackendId((chat % 3) as u32), chat as u64);
    }
    let stats = tree.stats();
    let per_claim = stats.memory_bytes as f64 / stats.backend_blocks as f64;
    let per_block = stats.memory_bytes as f64 / stats.stored_blocks as f64;
    println!(
        "representative: {} blocks, {} claims, {} nodes, {} bytes: {per_block:.1} B/block, \
         {per_claim:.1} B/(block, backend)",
        stats.stored_blocks, stats.backend_blocks, stats.nodes, stats.memory_bytes
    );
    assert!(per_claim <= 64.0, "{per_claim} bytes per block per backend");
    assert!(per_block <= 64.0, "{per_block} bytes per stored block");
}

#[test]
fn branch_at_every_block_is_the_worst_case() {
    // Each prompt extends a random earlier one by one block: every node is one block long.
    let mut state = 11u64;
    let mut tree = PrefixTree::new(TreeConfig {
        block_size: 16,
        max_blocks: usize::MAX,
    })
    .unwrap();
    let mut prompts: Vec<Vec<u32>> = vec![Vec::new()];
    for index in 0..20_000usize {
        let parent = prompts[(next_token(&mut state) as usize) % prompts.len()].clone();
        let mut prompt = parent;
        prompt.extend((0..16).map(|_| next_token(&mut state)));
        tree.insert(&prompt, BackendId(0), index as u64);
        prompts.push(prompt);
    }
    let stats = tree.stats();
    let per_block = stats.memory_bytes as f64 / stats.stored_blocks as f64;
    println!(
        "worst case: {} blocks, {} nodes, {} bytes: {per_block:.1} B/block",
        stats.stored_blocks, stats.nodes, stats.memory_bytes
    );
    assert_eq!(stats.stored_blocks, 20_000);
    // One node per block: the node header dominates. Bounded, but above the 64-byte target.
    assert!(per_block < 200.0, "{per_block}");
}
