//! Checks that the benchmark-only Leis-style ART baseline (`benches/leis_art`) answers exactly
//! like `PrefixTree` on a random workload, so `benches/vs_leis.rs` compares like with like.

#[path = "../benches/leis_art/mod.rs"]
mod leis_art;

use leis_art::{BLOCK_TOKENS, LeisArt, encode_key};
use myelin_art::{BackendId, PrefixTree, TreeConfig, TreeMatch};

/// xorshift64*: deterministic workload without a dependency.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, bound: u64) -> u64 {
        (self.next() >> 16) % bound
    }

    /// Mostly small token ids (siblings then differ in the last key byte, and fan-outs grow
    /// through Node4/16/48/256), sometimes large ones (differ in earlier bytes).
    fn token(&mut self) -> u32 {
        if self.below(8) == 0 {
            self.below(128_000) as u32
        } else {
            self.below(300) as u32
        }
    }
}

fn backends_of(found: &TreeMatch) -> Vec<(BackendId, u32, u64, u64)> {
    found
        .backends
        .iter()
        .map(|prefix| {
            (
                prefix.backend,
                prefix.matched_blocks,
                prefix.last_routed_ms,
                prefix.residency_stamp,
            )
        })
        .collect()
}

#[test]
fn leis_baseline_agrees_with_prefix_tree_on_a_random_workload() {
    let mut random = Random(0x5eed_1e15_a27b_a5e1);
    let mut tree = PrefixTree::new(TreeConfig {
        block_size: BLOCK_TOKENS as u32,
        max_blocks: usize::MAX,
    })
    .expect("valid config");
    let mut leis = LeisArt::new();
    let mut prompts: Vec<Vec<u32>> = vec![Vec::new()];
    let mut key = Vec::new();
    let mut from_tree = TreeMatch::default();
    let mut from_leis = TreeMatch::default();
    let mut from_key = TreeMatch::default();
    for step in 0..4_000u64 {
        // A new prompt: some whole blocks of an earlier one, cut anywhere inside a block
        // sometimes, then fresh tokens (a partial trailing block now and then).
        let base = &prompts[random.below(prompts.len() as u64) as usize];
        let keep_blocks = random.below(base.len() as u64 / BLOCK_TOKENS as u64 + 1) as usize;
        let mut prompt = base[..keep_blocks * BLOCK_TOKENS].to_vec();
        if random.below(4) == 0 && keep_blocks * BLOCK_TOKENS < base.len() {
            let rest = &base[keep_blocks * BLOCK_TOKENS..];
            let shared_tokens = random.below(rest.len().min(BLOCK_TOKENS) as u64) as usize;
            prompt.extend_from_slice(&rest[..shared_tokens]);
        }
        let new_tokens = random.below(4 * BLOCK_TOKENS as u64) as usize + 1;
        for _ in 0..new_tokens {
            prompt.push(random.token());
        }
        let backend = BackendId(random.below(5) as u32);
        let stamp = random.below(1_000);
        tree.insert_chain(tree.chain(&prompt).hashes(), backend, step, stamp);
        leis.insert(&prompt, backend, step, stamp);
        assert_eq!(leis.stored_blocks(), tree.stored_blocks(), "step {step}");
        assert_eq!(
            leis.backend_blocks(),
            tree.stats().backend_blocks,
            "step {step}"
        );
        prompts.push(prompt);

        // Look up a stored prompt, cut and perturbed at a random token, plus some tokens.
        let probe_base = &prompts[random.below(prompts.len() as u64) as usize];
        let mut probe = probe_base.clone();
        if !probe.is_empty() && random.below(2) == 0 {
            let at = random.below(probe.len() as u64) as usize;
            probe[at] = random.token();
        }
        for _ in 0..random.below(2 * BLOCK_TOKENS as u64) {
            probe.push(random.token());
        }
        tree.lookup_chain_into(tree.chain(&probe).hashes(), &mut from_tree);
        leis.lookup(&probe, &mut key, &mut from_leis);
        assert_eq!(
            backends_of(&from_leis),
            backends_of(&from_tree),
            "step {step}"
        );
        assert_eq!(from_leis.matched_blocks, from_tree.matched_blocks);
        encode_key(&probe, &mut key);
        leis.lookup_key(&key, &mut from_key);
        assert_eq!(from_key, from_leis);
    }
    let memory = leis.memory();
    assert!(
        memory.nodes_by_kind.iter().all(|&count| count > 0),
        "every node type is exercised: {memory:?}"
    );
    assert_eq!(memory.stored_blocks, tree.stored_blocks());
    assert_eq!(memory.backend_blocks, tree.stats().backend_blocks);
    assert!(memory.total_bytes() >= memory.node_bytes + memory.entry_heap_bytes);
    assert!(memory.arena_capacity_bytes >= memory.node_bytes);
}

#[test]
fn detaching_an_insert_restores_the_tree() {
    let mut random = Random(42);
    let mut leis = LeisArt::new();
    let system: Vec<u32> = (0..4 * BLOCK_TOKENS).map(|_| random.token()).collect();
    let mut key = Vec::new();
    let mut before = TreeMatch::default();
    let mut after = TreeMatch::default();
    for user in 0..100u32 {
        let mut chat = system.clone();
        chat.extend((0..2 * BLOCK_TOKENS as u32).map(|offset| user * 1_000 + offset));
        leis.insert(&chat, BackendId(user % 3), u64::from(user), 0);
    }
    let stored = leis.stored_blocks();
    let claims = leis.backend_blocks();
    let mut fresh = system.clone();
    fresh.extend((0..8 * BLOCK_TOKENS as u32).map(|offset| 900_000 + offset));
    leis.lookup(&fresh, &mut key, &mut before);
    let inserted = leis.insert(&fresh, BackendId(7), 1_000, 0);
    assert_eq!(inserted.new_blocks, 8);
    assert_eq!(leis.stored_blocks(), stored + 8);
    let attachment = inserted
        .attachment
        .expect("the fresh blocks hang below the system prompt");
    leis.detach(attachment);
    assert_eq!(leis.stored_blocks(), stored);
    assert_eq!(
        leis.backend_blocks(),
        claims + 4,
        "backend 7 still holds the system prompt"
    );
    leis.lookup(&fresh, &mut key, &mut after);
    assert_eq!(after.matched_blocks, 4);
    assert_eq!(after.matched_blocks, before.matched_blocks);
}
