//! Criterion benchmarks of the prefix tree: lookup and insert of 512- and 8,192-token prompts
//! over a tree holding 100k prefixes, chain hashing alone, a flat per-block hash-map baseline,
//! and memory per stored block (printed once).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use myelin_art::{BackendId, PrefixTree, ROOT_CHAIN_HASH, TreeConfig, chain_hash};

const BLOCK_SIZE: u32 = 16;
const SYSTEM_PROMPTS: usize = 256;
const SYSTEM_TOKENS: usize = 256;
const CHAT_PREFIXES: usize = 98_000;
const CHAT_TOKENS: usize = 512;
const LONG_PREFIXES: usize = 2_000;
const LONG_TOKENS: usize = 8_192;
const BACKENDS: u32 = 8;

/// xorshift64* (Vigna 2016): deterministic tokens, no dependency.
struct Tokens(u64);

impl Tokens {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as u32 % 128_000
    }

    fn prompt(&mut self, system: &[u32], total: usize) -> Vec<u32> {
        let mut tokens = system.to_vec();
        while tokens.len() < total {
            tokens.push(self.next());
        }
        tokens
    }
}

/// 100k prefixes: 98k chats (one of 256 system prompts + a user turn, 512 tokens) and 2k long
/// conversations (8,192 tokens), spread over 8 backends so each system prompt is held by all 8.
struct Corpus {
    systems: Vec<Vec<u32>>,
    chats: Vec<Vec<u32>>,
    longs: Vec<Vec<u32>>,
}

fn corpus() -> Corpus {
    let mut random = Tokens(0x9e37_79b9_7f4a_7c15);
    let systems: Vec<Vec<u32>> = (0..SYSTEM_PROMPTS)
        .map(|_| random.prompt(&[], SYSTEM_TOKENS))
        .collect();
    let chats = (0..CHAT_PREFIXES)
        .map(|index| random.prompt(&systems[index % SYSTEM_PROMPTS], CHAT_TOKENS))
        .collect();
    let longs = (0..LONG_PREFIXES)
        .map(|index| random.prompt(&systems[index % SYSTEM_PROMPTS], LONG_TOKENS))
        .collect();
    Corpus {
        systems,
        chats,
        longs,
    }
}

fn build_tree(corpus: &Corpus) -> PrefixTree {
    let mut tree = PrefixTree::new(TreeConfig {
        block_size: BLOCK_SIZE,
        max_blocks: usize::MAX,
    })
    .expect("valid config");
    for (index, prompt) in corpus.chats.iter().chain(&corpus.longs).enumerate() {
        tree.insert(prompt, backend_of(index), index as u64);
    }
    tree
}

/// Prefix `index` goes to this backend: consecutive users of one system prompt land on
/// different backends, so shared blocks carry several entries.
fn backend_of(index: usize) -> BackendId {
    BackendId((index / SYSTEM_PROMPTS) as u32 % BACKENDS)
}

/// Minimum over `batches` of the mean time of `per_batch` calls, in ns: an estimate of the
/// uncontended cost on a shared machine, where criterion's means include other processes.
fn min_nanos(batches: usize, per_batch: usize, mut operation: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..batches {
        let start = std::time::Instant::now();
        for _ in 0..per_batch {
            operation();
        }
        best = best.min(start.elapsed().as_nanos() as f64 / per_batch as f64);
    }
    best
}

fn benches(criterion: &mut Criterion) {
    let corpus = corpus();
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
