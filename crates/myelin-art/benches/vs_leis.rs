//! Criterion comparison of `PrefixTree` with a Leis-style byte-wise ART baseline
//! (`leis_art`) on the `tree` bench's 100k-prefix dataset: lookup and insert of 512- and
//! 8,192-token prompts, and memory per stored block (printed once).

mod leis_art;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use leis_art::{BLOCK_TOKENS, LeisArt, encode_key};
use myelin_art::{BackendId, PrefixTree, TreeConfig, TreeMatch};

// The `tree` bench's dataset, same generator and seed.
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

/// 98k chats (one of 256 system prompts + a user turn, 512 tokens) and 2k long conversations
/// (8,192 tokens): 100k prefixes.
fn corpus() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
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
    (chats, longs)
}

/// Consecutive users of one system prompt land on different backends (as in the `tree` bench).
fn backend_of(index: usize) -> BackendId {
    BackendId((index / SYSTEM_PROMPTS) as u32 % BACKENDS)
}

/// Minimum over `batches` of the mean time of `per_batch` calls, in ns: an estimate of the
/// uncontended cost on a shared machine.
fn min_nanos(batches: usize, per_batch: usize, mut operation: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..batches {
        let start = Instant::now();
        for _ in 0..per_batch {
            operation();
        }
        best = best.min(start.elapsed().as_nanos() as f64 / per_batch as f64);
    }
    best
}

fn benches(criterion: &mut Criterion) {
    let setup_started = Instant::now();
    let (chats, longs) = corpus();
    let mut tree = PrefixTree::new(TreeConfig {
        block_size: BLOCK_TOKENS as u32,
        max_blocks: usize::MAX,
    })
    .expect("valid config");
    let mut leis = LeisArt::new();
    for (index, prompt) in chats.iter().chain(&longs).enumerate() {
        tree.insert(prompt, backend_of(index), index as u64);
        leis.insert(prompt, backend_of(index), index as u64, 0);
    }
    let stats = tree.stats();
    let memory = leis.memory();
    assert_eq!(memory.stored_blocks, stats.stored_blocks, "same dataset");
    assert_eq!(memory.backend_blocks, stats.backend_blocks, "same dataset");
    eprintln!(
        "setup {:.1} s; {} prefixes, {} stored blocks, {} (block, backend) claims",
        setup_started.elapsed().as_secs_f64(),
        CHAT_PREFIXES + LONG_PREFIXES,
        stats.stored_blocks,
        stats.backend_blocks,
    );
    eprintln!(
        "memory PrefixTree: {} nodes, {} bytes = {:.1} bytes/stored block, {:.1} bytes/(block, backend)",
        stats.nodes,
        stats.memory_bytes,
        stats.memory_bytes as f64 / stats.stored_blocks as f64,
        stats.memory_bytes as f64 / stats.backend_blocks as f64,
    );
    eprintln!(
        "memory Leis ART: nodes leaf/4/16/48/256 = {:?}, node bytes {} + entry heap {} = {} bytes \
         = {:.1} bytes/stored block, {:.1} bytes/(block, backend); arena capacity {} bytes",
        memory.nodes_by_kind,
        memory.node_bytes,
        memory.entry_heap_bytes,
        memory.total_bytes(),
        memory.total_bytes() as f64 / memory.stored_blocks as f64,
        memory.total_bytes() as f64 / memory.backend_blocks as f64,
        memory.arena_capacity_bytes,
    );

    let chat_hit = &chats[12_345];
    let long_hit = &longs[777];
    let chat_chain = tree.chain(chat_hit);
    let long_chain = tree.chain(long_hit);
    let mut chat_key = Vec::new();
    let mut long_key = Vec::new();
    encode_key(chat_hit, &mut chat_key);
    encode_key(long_hit, &mut long_key);
    let mut key_scratch = Vec::new();
    let mut found = TreeMatch::default();
    let mut found_leis = TreeMatch::default();
    for (prompt, blocks) in [(chat_hit, 32), (long_hit, 512)] {
        tree.lookup_chain_into(tree.chain(prompt).hashes(), &mut found);
        leis.lookup(prompt, &mut key_scratch, &mut found_leis);
        assert_eq!(found.backends, found_leis.backends, "same answers");
        assert_eq!(found.matched_blocks, blocks);
    }

    for (name, prompt, chain, key) in [
        ("512", chat_hit, &chat_chain, &chat_key),
        ("8192", long_hit, &long_chain, &long_key),
    ] {
        eprintln!(
            "uncontended estimates (min of 300 batches of 20), {name} tokens, ns: from tokens: \
             tree {:.0}, leis {:.0}; walk only (prehashed / pre-encoded): tree {:.0}, leis {:.0}; \
             hashing {:.0}, key encoding {:.0}",
            min_nanos(300, 20, || {
                black_box(tree.lookup(black_box(prompt)));
            }),
            min_nanos(300, 20, || {
                leis.lookup(black_box(prompt), &mut key_scratch, &mut found_leis);
                black_box(&found_leis);
            }),
            min_nanos(300, 20, || {
                tree.lookup_chain_into(black_box(chain.hashes()), &mut found);
                black_box(&found);
            }),
            min_nanos(300, 20, || {
                leis.lookup_key(black_box(key), &mut found_leis);
                black_box(&found_leis);
            }),
            min_nanos(300, 20, || {
                black_box(tree.chain(black_box(prompt)));
            }),
            min_nanos(300, 20, || {
                encode_key(black_box(prompt), &mut key_scratch);
                black_box(&key_scratch);
            }),
        );
    }

    let mut group = criterion.benchmark_group("vs_leis");
    for (name, prompt) in [("512", chat_hit), ("8192", long_hit)] {
        group.bench_function(format!("lookup/{name}_tokens_hit/prefix_tree"), |bench| {
            bench.iter(|| tree.lookup(black_box(prompt)))
        });
        group.bench_function(format!("lookup/{name}_tokens_hit/leis_art"), |bench| {
            bench.iter(|| {
                let mut out = TreeMatch::default();
                leis.lookup(black_box(prompt), &mut key_scratch, &mut out);
                out
            })
        });
    }
    for (name, chain, key) in [
        ("512", &chat_chain, &chat_key),
        ("8192", &long_chain, &long_key),
    ] {
        group.bench_function(
            format!("lookup_walk_only/{name}_tokens_hit/prefix_tree_prehashed"),
            |bench| {
                bench.iter(|| {
                    tree.lookup_chain_into(black_box(chain.hashes()), &mut found);
                    found.matched_blocks
                })
            },
        );
        group.bench_function(
            format!("lookup_walk_only/{name}_tokens_hit/leis_art_pre_encoded"),
            |bench| {
                bench.iter(|| {
                    leis.lookup_key(black_box(key), &mut found_leis);
                    found_leis.matched_blocks
                })
            },
        );
    }

    // Inserts of a new user turn (16 new blocks) and a new conversation (496 new blocks), each
    // diverging right after a shared system prompt. Only the insert is timed; it is then undone
    // (untimed) so both trees stay at the dataset's size for the whole measurement.
    let first_new_block = SYSTEM_TOKENS / BLOCK_TOKENS;
    let mut now_ms = 1_000_000u64;
    for (name, template) in [("512", &chats[1]), ("8192", &longs[1])] {
        let mut fresh = template.clone();
        group.bench_function(format!("insert/{name}_tokens_new/prefix_tree"), |bench| {
            bench.iter_custom(|iterations| {
                let mut timed = Duration::ZERO;
                for _ in 0..iterations {
                    now_ms += 1;
                    fresh[SYSTEM_TOKENS] = now_ms as u32;
                    let backend = BackendId(now_ms as u32 % BACKENDS);
                    let started = Instant::now();
                    black_box(tree.insert(black_box(&fresh), backend, now_ms));
                    timed += started.elapsed();
                    let chain = tree.chain(&fresh);
                    tree.remove_block(&chain.hashes()[..=first_new_block], backend);
                }
                timed
            })
        });
        group.bench_function(format!("insert/{name}_tokens_new/leis_art"), |bench| {
            bench.iter_custom(|iterations| {
                let mut timed = Duration::ZERO;
                for _ in 0..iterations {
                    now_ms += 1;
                    fresh[SYSTEM_TOKENS] = now_ms as u32;
                    let backend = BackendId(now_ms as u32 % BACKENDS);
                    let started = Instant::now();
                    let inserted = leis.insert(black_box(&fresh), backend, now_ms, 0);
                    timed += started.elapsed();
                    assert_eq!(
                        inserted.new_blocks,
                        fresh.len() / BLOCK_TOKENS - first_new_block
                    );
                    let attachment = inserted
                        .attachment
                        .expect("a fresh turn hangs below the system prompt");
                    leis.detach(attachment);
                }
                timed
            })
        });
    }
    group.finish();
    assert_eq!(leis.stored_blocks(), tree.stored_blocks(), "inserts undone");
    assert_eq!(
        leis.backend_blocks(),
        tree.stats().backend_blocks,
        "inserts undone"
    );
}

criterion_group! {
    name = vs_leis;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(vs_leis);
