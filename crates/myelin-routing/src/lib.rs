//! Sans-IO routing core: prefix-tree replica, residency, load view, scoring policies.
//!
//! The request path, per request, on the core that accepted it:
//!
//! 1. hash the prompt once ([`Shard::chain`], or `myelin_art::BlockChain::new`);
//! 2. look it up in this core's own replica ([`Shard::lookup_chain`] → [`PrefixMatch`]);
//! 3. score with the local [`Router`] and the backends' health and load ([`BackendView`]) →
//!    [`Decision`];
//! 4. after proxying, record what was routed ([`WriteOp::Learn`], applied with
//!    [`Shard::apply`] here and sent to every other core's replica).
//!
//! KV events (decoded on the control core, sent to every replica as [`WriteOp::Mirror`]) feed
//! the verified mirror. Nothing here does I/O or reads a clock: time (`now_ms`, caller's
//! milliseconds) is an argument.
//!
//! ```
//! use myelin_routing::{
//!     BackendId, BackendState, BackendView, Policy, ResidencyMode, Router, RouterConfig, Shard,
//!     ShardConfig,
//! };
//!
//! let mut shard = Shard::new(ShardConfig { block_size: 4, max_blocks: 10_000 })?;
//! let mut router = Router::new(Policy::Prefix, ResidencyMode::Auto, RouterConfig::default());
//! let backends = [
//!     BackendView::new(BackendId(0), BackendState::Up, 0),
//!     BackendView::new(BackendId(1), BackendState::Up, 0),
//! ];
//!
//! let prompt: Vec<u32> = (0..64).collect();
//! let chain = shard.chain(&prompt);
//!
//! // First time: nothing cached anywhere; a backend is picked and the shard learns it.
//! let first = router.decide(64, &shard.lookup_chain(&chain, 1_000)?, &backends)?;
//! shard.learn_chain(&chain, first.backend, 1_000, 0)?;
//!
//! // Same prefix again: the backend that holds it wins.
//! let again = router.decide(64, &shard.lookup_chain(&chain, 2_000)?, &backends)?;
//! assert_eq!(again.backend, first.backend);
//! assert_eq!(again.expected_cached_tokens, 64.0);
//!
//! // Its KV-event mirror goes live: it stored the prompt's blocks, then evicted the first one.
//! // A prefix missing its first block is unusable: nothing counts as cached there any more,
//! // and choosing elsewhere for that reason is a residency downgrade.
//! shard.set_mirror_live(first.backend, true);
//! for &block_hash in chain.hashes() {
//!     shard.apply_block_stored(first.backend, block_hash);
//! }
//! shard.apply_block_removed(first.backend, chain.hashes()[0]);
//! let after_eviction = router.decide(64, &shard.lookup_chain(&chain, 3_000)?, &backends)?;
//! assert!(after_eviction.residency_downgrade);
//! assert_ne!(after_eviction.backend, first.backend);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backend;
mod error;
mod mirror;
mod namespace;
mod pinned;
mod policy;
mod replica;
mod residency;
mod router;
mod shard;
mod ttft;

pub use backend::{BackendId, BackendState, BackendView, MemoryPressure};
pub use error::{NoBackend, ParseNameError, RoutingError};
pub use mirror::{MirrorTrust, ResidencyMirror};
pub use myelin_art::{
    BlockChain, ChainHashMap, InsertOutcome, MatchSegment, ROOT_CHAIN_HASH, TreeStats, chain_hash,
};
pub use namespace::namespace_root;
pub use pinned::PinnedBlocks;
pub use policy::Policy;
pub use replica::{MirrorChange, WriteOp};
pub use residency::{
    CALIBRATION_RATE, CALIBRATION_SCALE_BOUNDS, DEFAULT_EDGE, DEFAULT_MIN_ROOM_FRACTION,
    DEFAULT_RECALIBRATION, DEFAULT_SHARPNESS, EstimateInput, MISS_MIN_ROOM_FRACTION,
    PlaceholderEstimator, PressureEstimator, ResidencyEstimator, ResidencyMode, ReuseObservation,
    ReuseProbe, RoomCalibration, block_stamps, expected_cached_tokens, observe_reuse, recalibrate,
    uncalibrate,
};
pub use router::{
    Candidate, CostModel, DEFAULT_DECODE_STEP_TOKENS, DEFAULT_EXTRA_PREFILL_PERCENT,
    DEFAULT_EXTRA_PREFILL_RAMP_PERCENT, DEFAULT_LOAD_BOUND_TOKENS, DEFAULT_MAX_PREFIX_HOMES,
    Decision, MEMORY_FULL_UTILIZATION, Router, RouterConfig, admission_wait_tokens,
};
pub use shard::{BackendMatch, BlockCounts, PrefixMatch, Shard, ShardConfig};
pub use ttft::{
    DEFAULT_ENGINE_TIMING, EngineQueue, EngineTiming, KvMemory, PredictionError,
    TIMING_BOUND_FACTOR, TIMING_FORGETTING, TIMING_PRIOR_WEIGHT, TIMING_PROPORTION_WEIGHT,
    TimingFit, TtftPrediction, memory_wait_steps, predict_ttft, prefill_pairs,
};
