//! Criterion benchmarks of the routing core: shard lookup (tree + verified mirror) and the
//! scoring decision, for 512- and 8,192-token prompts over a shard holding 100k prefixes.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use myelin_routing::{
    BackendId, BackendState, BackendView, Policy, PressureEstimator, ResidencyMode, Router,
    RouterConfig, Shard, ShardConfig,
};

#[path = "../../../benches/support/corpus.rs"]
#[allow(dead_code)] // each bench uses part of the shared dataset module
mod dataset;

const BLOCK_SIZE: u32 = 16;
use dataset::{BACKENDS, CHAT_PREFIXES, min_nanos};

fn backend_of(index: usize) -> BackendId {
    BackendId(dataset::backend_index(index))
}

fn benches(criterion: &mut Criterion) {
    let dataset::Corpus { chats, longs, .. } = dataset::corpus(0x2545_f491_4f6c_dd1d);
    let mut shard = Shard::new(ShardConfig {
        block_size: BLOCK_SIZE,
        max_blocks: 4 << 20,
    })
    .expect("valid config");
    for (index, prompt) in chats.iter().chain(&longs).enumerate() {
        let backend = backend_of(index);
        let chain = shard.chain(prompt);
        shard
            .learn_chain(&chain, backend, index as u64, 0)
            .expect("same block size");
        // Half the backends publish KV events: mirror what they were routed.
        if backend.0 < BACKENDS / 2 {
            for &hash in chain.hashes() {
                shard.apply_block_stored(backend, hash);
            }
        }
    }
    for backend in 0..BACKENDS / 2 {
        shard.set_mirror_live(BackendId(backend), true);
    }
    eprintln!(
        "shard: {} stored blocks, {} mirrored blocks, {} bytes",
        shard.tree_stats().stored_blocks,
        shard.mirror().block_count(),
        shard.memory_bytes()
    );

    // Both were routed to backend 0 (mirror live): the verified walk covers all their blocks.
    let chat = &chats[8];
    let long = &longs[400];
    assert_eq!(backend_of(8), BackendId(0));
    assert_eq!(backend_of(CHAT_PREFIXES + 400), BackendId(0));
    let chat_chain = shard.chain(chat);
    let long_chain = shard.chain(long);
    let views: Vec<BackendView> = (0..BACKENDS)
        .map(|id| BackendView::new(BackendId(id), BackendState::Up, u64::from(id) * 300))
        .collect();
    let many_views: Vec<BackendView> = (0..64)
        .map(|id| BackendView::new(BackendId(id), BackendState::Up, u64::from(id) * 37))
        .collect();

    let mut group = criterion.benchmark_group("routing");
    group.bench_function("shard_lookup/512_tokens_prehashed", |bench| {
        bench.iter(|| shard.lookup_chain(black_box(&chat_chain), 1))
    });
    group.bench_function("shard_lookup/8192_tokens_prehashed", |bench| {
        bench.iter(|| shard.lookup_chain(black_box(&long_chain), 1))
    });
    group.bench_function("shard_lookup/8192_tokens_from_tokens", |bench| {
        bench.iter(|| shard.lookup(black_box(long), 1))
    });
    let chat_match = shard.lookup_chain(&chat_chain, 1).expect("same block size");
    let long_match = shard.lookup_chain(&long_chain, 1).expect("same block size");
    let mut router = Router::new(Policy::Prefix, ResidencyMode::Auto, RouterConfig::default());
    group.bench_function("decide/prefix_auto_8_backends_512_tokens", |bench| {
        bench.iter(|| router.decide(512, black_box(&chat_match), black_box(&views)))
    });
    group.bench_function("decide/prefix_auto_8_backends_8192_tokens", |bench| {
        bench.iter(|| router.decide(8192, black_box(&long_match), black_box(&views)))
    });
    group.bench_function("decide/prefix_auto_64_backends_8192_tokens", |bench| {
        bench.iter(|| router.decide(8192, black_box(&long_match), black_box(&many_views)))
    });
    // The cache-pressure estimate on every matched block: 32,768-token engines that admitted
    // 20,000 tokens since the prefixes were learned (survivals in the middle of the curve),
    // with and without the recalibration map.
    let pressured: Vec<BackendView> = views
        .iter()
        .map(|view| view.clone().with_cache(Some(32_768), 20_000, 0))
        .collect();
    let mut estimate = Router::new(
        Policy::Prefix,
        ResidencyMode::Estimate,
        RouterConfig::default(),
    );
    group.bench_function("decide/prefix_estimate_8_backends_8192_tokens", |bench| {
        bench.iter(|| estimate.decide(8192, black_box(&long_match), black_box(&pressured)))
    });
    let mut unmapped = Router::with_estimator(
        Policy::Prefix,
        ResidencyMode::Estimate,
        RouterConfig::default(),
        PressureEstimator {
            recalibration: &[],
            ..PressureEstimator::default()
        },
    );
    group.bench_function(
        "decide/prefix_estimate_8_backends_8192_tokens_no_map",
        |bench| bench.iter(|| unmapped.decide(8192, black_box(&long_match), black_box(&pressured))),
    );
    let mut round_robin = Router::new(
        Policy::RoundRobin,
        ResidencyMode::Off,
        RouterConfig::default(),
    );
    group.bench_function("decide/round_robin_8_backends", |bench| {
        bench.iter(|| round_robin.decide(512, black_box(&chat_match), black_box(&views)))
    });
    group.finish();
    eprintln!(
        "uncontended estimates (min of 300 batches of 20): shard lookup 512 prehashed {:.0} ns, \
         shard lookup 8192 prehashed {:.0} ns, decide 8 backends 8192 {:.0} ns, \
         decide 64 backends 8192 {:.0} ns",
        min_nanos(300, 20, || {
            black_box(shard.lookup_chain(black_box(&chat_chain), 1).ok());
        }),
        min_nanos(300, 20, || {
            black_box(shard.lookup_chain(black_box(&long_chain), 1).ok());
        }),
        min_nanos(300, 20, || {
            black_box(
                router
                    .decide(8192, black_box(&long_match), black_box(&views))
                    .ok(),
            );
        }),
        min_nanos(300, 20, || {
            black_box(
                router
                    .decide(8192, black_box(&long_match), black_box(&many_views))
                    .ok(),
            );
        }),
    );
}

criterion_group! {
    name = routing;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = benches
}
criterion_main!(routing);
