//! Criterion benchmark of the KV-event decoder: a typical scheduler step (one BlockStored of
//! 4 blocks of 16 tokens, then 2 BlockRemoved) in the vLLM 0.22 array and 0.33 map layouts.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use myelin_kv_events::wire::KV_CACHE_SPEC_FULL_ATTENTION;
use myelin_kv_events::{
    BlockRemoved, BlockStored, EventBatch, KvEvent, MEDIUM_GPU, WireVersion, decode_batch,
    encode_batch,
};

const BLOCK_SIZE: u32 = 16;
const STORED_BLOCKS: u64 = 4;

fn typical_batch() -> EventBatch {
    // Token ids spread over a 128k vocabulary, as real prompts are (mostly 2- and 3-byte ints).
    let token_ids = (0..BLOCK_SIZE * STORED_BLOCKS as u32)
        .map(|index| index.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let hash = |index: u64| index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let removed = |index: u64| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![hash(index)],
            medium: Some(MEDIUM_GPU.to_string()),
            group_idx: Some(0),
        })
    };
    EventBatch {
        ts: 1_767_225_600.125,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: (1..=STORED_BLOCKS).map(hash).collect(),
                parent_block_hash: Some(hash(0)),
                token_ids,
                block_size: BLOCK_SIZE,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_string()),
                lora_name: None,
                extra_keys: None,
                group_idx: Some(0),
                kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.to_string()),
                kv_cache_spec_sliding_window: None,
            }),
            removed(100),
            removed(101),
        ],
        data_parallel_rank: Some(0),
    }
}

fn benches(criterion: &mut Criterion) {
    let batch = typical_batch();
    let mut group = criterion.benchmark_group("decode_batch");
    group.throughput(Throughput::Elements(1));
    for version in [WireVersion::V0_22, WireVersion::V0_33] {
        let payload = encode_batch(&batch, version);
        match decode_batch(&payload) {
            Ok(decoded) => assert_eq!(decoded.into_event_batch(), batch),
            Err(error) => panic!("the bench payload must decode: {error}"),
        }
        group.bench_function(format!("v{version}_{}_bytes", payload.len()), |bencher| {
            bencher.iter(|| decode_batch(black_box(&payload)))
        });
    }
    group.finish();
}

criterion_group!(decode, benches);
criterion_main!(decode);
