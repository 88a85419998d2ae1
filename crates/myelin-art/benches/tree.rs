//! Criterion benchmarks of the prefix tree: lookup and insert of 512- and 8,192-token prompts
//! over a tree holding 100k prefixes, chain hashing alone, a flat per-block hash-map baseline,
//! and memory per stored block (printed once).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use myelin_art::{BackendId, PrefixTree, ROOT_CHAIN_HASH, TreeConfig, chain_hash};

#[path = "../../../benches/support/corpus.rs"]
#[allow(dead_code)] // each bench uses part of the shared dataset module
mod dataset;

const BLOCK_SIZE: u32 = 16;
use dataset::{
    BACKENDS, CHAT_PREFIXES, Corpus, LONG_PREFIXES, LONG_TOKENS, SYSTEM_TOKENS, min_nanos,
};

/// The dataset's seed (the routing bench uses another).
const SEED: u64 = 0x9e37_79b9_7f4a_7c15;

fn build_tree(corpus: &Corpus) -> PrefixTree {
    let mut tree = PrefixTree::new(TreeConfig {
        block_size: BLOCK_SIZE,
        max_blocks: usize::MAX,
    })
    .expect("valid config");
    for (index, prompt) in corpus.prefixes().enumerate() {
        tree.insert(prompt, backend_of(index), index as u64);
    }
    tree
}

fn backend_of(index: usize) -> BackendId {
    BackendId(dataset::backend_index(index))
}

fn benches(criterion: &mut Criterion) {
    let corpus = dataset::corpus(SEED);
    let mut tree = build_tree(&corpus);
    let stats = tree.stats();
    eprintln!(
        "tree: {} prefixes, {} stored blocks, {} (block, backend) claims, {} nodes, {} bytes \
         = {:.1} bytes/stored block, {:.1} bytes/(block, backend)",
        CHAT_PREFIXES + LONG_PREFIXES,
        stats.stored_blocks,
        stats.backend_blocks,
        stats.nodes,
        stats.memory_bytes,
        stats.memory_bytes as f64 / stats.stored_blocks as f64,
        stats.memory_bytes as f64 / stats.backend_blocks as f64,
    );

    let chat_hit = &corpus.chats[12_345];
    let long_hit = &corpus.longs[777];
    let mut long_partial = corpus.longs[778].clone();
    long_partial[LONG_TOKENS / 2] ^= 1; // diverges half way
    let long_chain = tree.chain(long_hit);

    eprintln!(
        "uncontended estimates (min of 300 batches of 20): hash 8192 {:.0} ns, lookup 512 {:.0} ns, \
         lookup 8192 {:.0} ns, lookup 8192 prehashed {:.0} ns",
        min_nanos(300, 20, || {
            black_box(tree.chain(black_box(long_hit)));
        }),
        min_nanos(300, 20, || {
            black_box(tree.lookup(black_box(chat_hit)));
        }),
        min_nanos(300, 20, || {
            black_box(tree.lookup(black_box(long_hit)));
        }),
        min_nanos(300, 20, || {
            black_box(tree.lookup_chain(black_box(long_chain.hashes())));
        }),
    );

    let mut group = criterion.benchmark_group("art");
    group.bench_function("hash/8192_tokens", |bench| {
        bench.iter(|| tree.chain(black_box(long_hit)))
    });
    group.bench_function("lookup/512_tokens_hit", |bench| {
        bench.iter(|| tree.lookup(black_box(chat_hit)))
    });
    group.bench_function("lookup/8192_tokens_hit", |bench| {
        bench.iter(|| tree.lookup(black_box(long_hit)))
    });
    group.bench_function("lookup/8192_tokens_diverging_half_way", |bench| {
        bench.iter(|| tree.lookup(black_box(&long_partial)))
    });
    group.bench_function("lookup_chain/8192_tokens_hit_prehashed", |bench| {
        bench.iter(|| tree.lookup_chain(black_box(long_chain.hashes())))
    });

    // Baseline: one hash-map probe per block (how per-block-hash indexes look prefixes up).
    let mut flat: HashMap<u64, Vec<BackendId>> = HashMap::new();
    for (index, prompt) in corpus.chats.iter().chain(&corpus.longs).enumerate() {
        let mut parent = ROOT_CHAIN_HASH;
        for block in prompt.chunks_exact(BLOCK_SIZE as usize) {
            parent = chain_hash(parent, block);
            let holders = flat.entry(parent).or_default();
            let backend = backend_of(index);
            if !holders.contains(&backend) {
                holders.push(backend);
            }
        }
    }
    group.bench_function("baseline_flat_hashmap/8192_tokens_hit_prehashed", |bench| {
        bench.iter(|| {
            let mut matched: Vec<(BackendId, u32)> = Vec::new();
            for (depth, hash) in black_box(long_chain.hashes()).iter().enumerate() {
                let Some(holders) = flat.get(hash) else { break };
                for &backend in holders {
                    match matched.iter_mut().find(|(b, _)| *b == backend) {
                        Some(slot) => slot.1 = depth as u32 + 1,
                        None => matched.push((backend, depth as u32 + 1)),
                    }
                }
            }
            matched
        })
    });
    drop(flat);

    // Inserts at steady state: the tree is at its bound, so every insert also evicts.
    let stored = tree.stored_blocks();
    let mut tree_at_bound = PrefixTree::new(TreeConfig {
        block_size: BLOCK_SIZE,
        max_blocks: stored,
    })
    .expect("valid config");
    std::mem::swap(&mut tree, &mut tree_at_bound);
    drop(tree_at_bound);
    let tree = &mut tree;
    for (index, prompt) in corpus.chats.iter().chain(&corpus.longs).enumerate() {
        tree.insert(prompt, backend_of(index), index as u64);
    }
    let mut now_ms = 1_000_000u64;
    let mut fresh_chat = corpus.chats[1].clone();
    group.bench_function("insert/512_tokens_new_user_turn_at_bound", |bench| {
        bench.iter(|| {
            now_ms += 1;
            // A new user turn after a shared system prompt: 16 new blocks.
            fresh_chat[SYSTEM_TOKENS] = now_ms as u32;
            tree.insert(
                black_box(&fresh_chat),
                BackendId(now_ms as u32 % BACKENDS),
                now_ms,
            )
        })
    });
    let mut fresh_long = corpus.longs[1].clone();
    group.bench_function("insert/8192_tokens_new_conversation_at_bound", |bench| {
        bench.iter(|| {
            now_ms += 1;
            // 496 new blocks after a shared system prompt.
            fresh_long[SYSTEM_TOKENS] = now_ms as u32;
            tree.insert(
                black_box(&fresh_long),
                BackendId(now_ms as u32 % BACKENDS),
                now_ms,
            )
        })
    });
    let mut grown = corpus.longs[2].clone();
    let extension = corpus.systems[3].clone();
    group.bench_function("insert/8192_tokens_known_prefix_refresh", |bench| {
        bench.iter(|| {
            now_ms += 1;
            grown.truncate(LONG_TOKENS);
            grown[LONG_TOKENS - 1] = extension[(now_ms % 16) as usize];
            tree.insert(black_box(&grown), BackendId(0), now_ms)
        })
    });
    group.finish();
    eprintln!(
        "uncontended estimates (min of 300 batches of 20): insert 512 at bound {:.0} ns, \
         insert 8192 at bound {:.0} ns",
        min_nanos(300, 20, || {
            now_ms += 1;
            fresh_chat[SYSTEM_TOKENS] = now_ms as u32;
            black_box(tree.insert(&fresh_chat, backend_of(now_ms as usize), now_ms));
        }),
        min_nanos(300, 20, || {
            now_ms += 1;
            fresh_long[SYSTEM_TOKENS] = now_ms as u32;
            black_box(tree.insert(&fresh_long, backend_of(now_ms as usize), now_ms));
        }),
    );
    let stats = tree.stats();
    eprintln!(
        "tree after inserts at bound: {} stored blocks (bound {stored}), {} nodes, {:.1} bytes/stored block",
        stats.stored_blocks,
        stats.nodes,
        stats.memory_bytes as f64 / stats.stored_blocks as f64,
    );
}

criterion_group! {
    name = art;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(art);
