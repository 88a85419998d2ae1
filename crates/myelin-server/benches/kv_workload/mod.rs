//! A synthetic but consistent KV-event stream of 8 vLLM engines under heavy churn, encoded
//! with the project's own vLLM 0.22 / 0.33 encoders (`myelin_kv_events::encode_batch`, the
//! ones the simulator publishes with), and the router-side path it drives: decode
//! (`decode_live`) + translation (`KvFeed::apply`) on the subscriber side, the control core's
//! wrapping into one shared `Arc<[WriteOp]>` per batch and its fan-out to the data cores, and
//! the replica's `Shard::apply`. Shared by the `kv_feed` (throughput) and `kv_feed_lag`
//! (event-to-routable lag) benches.
//!
//! Each engine models vLLM's prefix-cache block pool at capacity: one batch per scheduler step,
//! holding 1 to 6 `BlockStored` events of 1 to 16 blocks (16 tokens each, ids over a 128k
//! vocabulary, the parent hash of the block before them, or none for a new prompt; a quarter of
//! new prompts start with one of 64 shared 2-block system prompts, so some chains are held by
//! several engines) and, to make room, one single-hash `BlockRemoved` per evicted block, as
//! vLLM emits them. Evictions take the tail of another request's chain (children before
//! parents, never the chain being extended), so every parent and every removal is one the
//! router saw: nothing is skipped as an orphan, as with a healthy live stream.

#![allow(dead_code)]

pub mod cpu_time;

use std::num::NonZeroU32;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use myelin_kv_events::wire::KV_CACHE_SPEC_FULL_ATTENTION;
use myelin_kv_events::{
    BlockRemoved, BlockStored, DecodedEvent, EventBatch, KvEvent, MEDIUM_GPU, WireVersion,
    decode_live, encode_batch,
};
use myelin_routing::{BackendId, MirrorChange, MirrorTrust, Shard, ShardConfig, WriteOp};
use myelin_server::kv_feed::KvFeed;
use myelin_server::kv_subscriber::FeedEvent;

/// Engines behind the router.
pub const ENGINES: usize = 8;
/// Data cores the control core fans out to.
pub const DATA_CORES: usize = 8;
/// vLLM's default block size.
pub const BLOCK_SIZE: u32 = 16;
/// Prefix-cache blocks per engine (an 8B model on an 80 GB GPU holds about 30k).
pub const CAPACITY_BLOCKS: usize = 32 * 1024;
/// Longest request chain (8k tokens): a longer one starts a new prompt instead.
const MAX_CHAIN_BLOCKS: usize = 512;
/// Shared system prompts (2 blocks each) that new prompts may start with.
const SHARED_PREFIXES: usize = 64;
const VOCABULARY: u64 = 128_000;

/// SplitMix64: deterministic, dependency-free.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `low..=high`.
    pub fn range(&mut self, low: usize, high: usize) -> usize {
        low + (self.next_u64() % (high - low + 1) as u64) as usize
    }

    fn token(&mut self) -> u32 {
        (self.next_u64() % VOCABULARY) as u32
    }
}

/// One engine's block pool, as far as its events go.
struct EngineModel {
    rng: Rng,
    /// Engine block hashes of each cached request chain, root first.
    chains: Vec<Vec<u64>>,
    cached_blocks: usize,
}

impl EngineModel {
    fn new(seed: u64) -> EngineModel {
        EngineModel {
            rng: Rng::new(seed),
            chains: Vec::new(),
            cached_blocks: 0,
        }
    }

    /// The events of one scheduler step.
    fn step(&mut self, shared: &[Vec<u32>]) -> Vec<KvEvent> {
        let mut events = Vec::new();
        for _ in 0..self.rng.range(1, 6) {
            let blocks = self.rng.range(1, 16);
            // Extend a running request's chain (half the time), or start a new prompt.
            let extend = (!self.chains.is_empty() && self.rng.range(0, 1) == 0)
                .then(|| self.rng.range(0, self.chains.len() - 1))
                .filter(|&chain| self.chains[chain].len() + blocks <= MAX_CHAIN_BLOCKS);
            let extend = self.evict_for(blocks, extend, &mut events);
            let mut token_ids = Vec::with_capacity(blocks * BLOCK_SIZE as usize);
            if extend.is_none() && self.rng.range(0, 3) == 0 {
                let prefix = &shared[self.rng.range(0, shared.len() - 1)];
                token_ids.extend_from_slice(&prefix[..prefix.len().min(token_ids.capacity())]);
            }
            while token_ids.len() < blocks * BLOCK_SIZE as usize {
                token_ids.push(self.rng.token());
            }
            let block_hashes: Vec<u64> = (0..blocks).map(|_| self.rng.next_u64()).collect();
            let parent_block_hash = match extend {
                Some(chain) => {
                    let parent = self.chains[chain].last().copied();
                    self.chains[chain].extend_from_slice(&block_hashes);
                    parent
                }
                None => {
                    self.chains.push(block_hashes.clone());
                    None
                }
            };
            self.cached_blocks += blocks;
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size: BLOCK_SIZE,
                lora_id: None,
                medium: Some(MEDIUM_GPU.to_string()),
                lora_name: None,
                extra_keys: None,
                group_idx: Some(0),
                kv_cache_spec_kind: Some(KV_CACHE_SPEC_FULL_ATTENTION.to_string()),
                kv_cache_spec_sliding_window: None,
            }));
        }
        events
    }

    /// Evicts chain tails until `incoming` more blocks fit, sparing the chain `keep` (a
    /// running request's blocks are in use); returns `keep`'s index afterwards.
    fn evict_for(
        &mut self,
        incoming: usize,
        keep: Option<usize>,
        events: &mut Vec<KvEvent>,
    ) -> Option<usize> {
        let kept = keep.map(|index| self.chains.swap_remove(index));
        while self.cached_blocks + incoming > CAPACITY_BLOCKS && !self.chains.is_empty() {
            let victim = self.rng.range(0, self.chains.len() - 1);
            let Some(hash) = self.chains[victim].pop() else {
                unreachable!("empty chains are dropped at once")
            };
            if self.chains[victim].is_empty() {
                self.chains.swap_remove(victim);
            }
            self.cached_blocks -= 1;
            events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![hash],
                medium: Some(MEDIUM_GPU.to_string()),
                group_idx: Some(0),
            }));
        }
        kept.map(|chain| {
            self.chains.push(chain);
            self.chains.len() - 1
        })
    }
}

/// One live ZMQ message as the subscriber receives it: `[topic, seq, payload]`.
pub struct Message {
    pub engine: u32,
    pub frames: [Vec<u8>; 3],
    /// Blocks stored plus blocks removed in it.
    pub block_events: u64,
}

/// The stream: engines' state after a warm-up to steady state, then the measured batches,
/// interleaved round-robin over the engines as the control core receives them.
pub struct Workload {
    /// Each engine's translator after the warm-up.
    pub warm_feeds: Vec<KvFeed>,
    /// The mirror changes of the warm-up, per engine, to bring a replica to the same state.
    pub warm_changes: Vec<(u32, Vec<MirrorChange>)>,
    /// The measured batches: (engine, batch).
    pub batches: Vec<(u32, EventBatch)>,
    /// Blocks stored plus blocks removed in `batches`.
    pub block_events: u64,
}

fn block_events(events: &[KvEvent]) -> u64 {
    events
        .iter()
        .map(|event| match event {
            KvEvent::BlockStored(stored) => stored.block_hashes.len() as u64,
            KvEvent::BlockRemoved(removed) => removed.block_hashes.len() as u64,
            KvEvent::AllBlocksCleared(_) => 0,
        })
        .sum()
}

pub fn block_size() -> NonZeroU32 {
    NonZeroU32::new(BLOCK_SIZE).expect("non-zero")
}

impl Workload {
    /// A warm-up to steady state, then `steps` measured batches per engine.
    pub fn generate(steps: usize, seed: u64) -> Workload {
        let mut shared_rng = Rng::new(seed ^ 0x5eed);
        let shared: Vec<Vec<u32>> = (0..SHARED_PREFIXES)
            .map(|_| {
                (0..2 * BLOCK_SIZE)
                    .map(|_| shared_rng.token())
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut models: Vec<EngineModel> = (0..ENGINES)
            .map(|engine| EngineModel::new(seed.wrapping_add(engine as u64 * 7919)))
            .collect();
        let mut warm_feeds: Vec<KvFeed> = (0..ENGINES).map(|_| KvFeed::new(block_size())).collect();
        let mut warm_changes = Vec::new();
        // Warm-up: fill every pool, then churn through it once more (steady state).
        for (engine, model) in models.iter_mut().enumerate() {
            let mut stored = 0;
            while stored < 2 * CAPACITY_BLOCKS {
                let events = model.step(&shared);
                for event in &events {
                    if let KvEvent::BlockStored(event) = event {
                        stored += event.block_hashes.len();
                    }
                }
                let mut changes = Vec::new();
                for event in events {
                    let decoded = DecodedEvent {
                        event,
                        locality: None,
                    };
                    warm_feeds[engine].apply(&decoded, &mut changes);
                }
                warm_changes.push((engine as u32, changes));
            }
        }
        let mut batches = Vec::with_capacity(steps * ENGINES);
        let mut total_events = 0;
        for step in 0..steps {
            for (engine, model) in models.iter_mut().enumerate() {
                let events = model.step(&shared);
                total_events += block_events(&events);
                let batch = EventBatch {
                    ts: 1_767_225_600.0 + step as f64 * 0.02,
                    events,
                    data_parallel_rank: Some(0),
                };
                batches.push((engine as u32, batch));
            }
        }
        Workload {
            warm_feeds,
            warm_changes,
            batches,
            block_events: total_events,
        }
    }

    /// The measured batches as live messages, engine `e` publishing in `version(e)`'s layout.
    pub fn messages(&self, version: impl Fn(usize) -> WireVersion) -> Vec<Message> {
        let mut sequences = [1_000u64; ENGINES];
        self.batches
            .iter()
            .map(|(engine, batch)| {
                let seq = &mut sequences[*engine as usize];
                *seq += 1;
                Message {
                    engine: *engine,
                    frames: [
                        Vec::new(),
                        seq.to_be_bytes().to_vec(),
                        encode_batch(batch, version(*engine as usize)),
                    ],
                    block_events: block_events(&batch.events),
                }
            })
            .collect()
    }

    /// A replica (one data core's `Shard`) in the warm-up's end state, every mirror live.
    pub fn warm_shard(&self) -> Shard {
        let mut shard = Shard::new(ShardConfig {
            block_size: BLOCK_SIZE,
            max_blocks: 1 << 20,
        })
        .expect("shard");
        for engine in 0..ENGINES as u32 {
            shard.apply(&WriteOp::MirrorLive {
                backend: BackendId(engine),
                trust: MirrorTrust::Exact,
            });
        }
        for (engine, changes) in &self.warm_changes {
            shard.apply(&WriteOp::Mirror {
                backend: BackendId(*engine),
                changes: changes.as_slice().into(),
            });
        }
        shard
    }
}

/// The subscriber side of one message: decode the frames, translate every event; `None` when
/// it produced no change (the subscriber then sends nothing). What `kv_subscriber`'s
/// `Follower::apply` does, minus its metrics.
pub fn subscriber_side(feeds: &mut [KvFeed], message: &Message) -> Option<FeedEvent> {
    let live = decode_live(&message.frames).expect("bench messages decode");
    let mut updates = Vec::new();
    let feed = &mut feeds[message.engine as usize];
    for event in &live.batch.events {
        feed.apply(event, &mut updates);
    }
    (!updates.is_empty()).then_some(FeedEvent::Updates {
        backend: BackendId(message.engine),
        updates,
    })
}

/// The control core's part for one `FeedEvent`: wrap in one shared write batch, as
/// `control::feed_loop` + `broadcast_write` do, and send it to every data core's queue. The
/// queues are crossbeam channels standing in for the glommio mesh (`try_send` on a shared
/// channel per core).
pub fn control_side(event: FeedEvent, data_cores: &[Sender<WriteBatch>]) {
    if let FeedEvent::Updates { backend, updates } = event {
        let op = WriteOp::Mirror {
            backend,
            changes: updates.into(),
        };
        let batch: WriteBatch = Arc::from(vec![op]);
        for core in data_cores {
            let _ = core.try_send(batch.clone());
        }
    }
}

/// One shared write batch, as the mesh carries it (`Message::Writes`).
pub type WriteBatch = Arc<[WriteOp]>;

/// `DATA_CORES` unbounded queues.
pub fn data_core_queues() -> (Vec<Sender<WriteBatch>>, Vec<Receiver<WriteBatch>>) {
    (0..DATA_CORES)
        .map(|_| crossbeam_channel::unbounded())
        .unzip()
}

/// What the data core does with one received batch.
pub fn replica_side(shard: &mut Shard, batch: &[WriteOp]) {
    for op in batch {
        shard.apply(op);
    }
}
