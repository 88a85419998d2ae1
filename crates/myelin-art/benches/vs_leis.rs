//! Criterion comparison of `PrefixTree` with a Leis-style byte-wise ART baseline
//! (`leis_art`) on the `tree` bench's 100k-prefix dataset: lookup and insert of 512- and
//! 8,192-token prompts, and memory per stored block (printed once).

mod leis_art;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use leis_art::{BLOCK_TOKENS, LeisArt, encode_key};
use myelin_art::{BackendId, PrefixTree, TreeConfig, TreeMatch};

#[path = "../../../benches/support/corpus.rs"]
#[allow(dead_code)] // each bench uses part of the shared dataset module
mod dataset;

use dataset::{BACKENDS, CHAT_PREFIXES, LONG_PREFIXES, SYSTEM_TOKENS, min_nanos};

/// The `tree` bench's dataset and seed.
fn corpus() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let dataset::Corpus { chats, longs, .. } = dataset::corpus(0x9e37_79b9_7f4a_7c15);
    (chats, longs)
}

fn backend_of(index: usize) -> BackendId {
    BackendId(dataset::backend_index(index))
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
