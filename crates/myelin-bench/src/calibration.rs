//! Calibration of the residency estimate against the simulator's truth (`--calibration`).
//!
//! During a router leg the load generator keeps a replica of what the router knows: a
//! [`Shard`] learning every successful request's prompt on the backend that served it
//! (`x-myelin-backend`), stamped with a per-backend admitted-tokens counter counted as the
//! router counts it, the load each backend carries, and the closed loop the router runs on
//! the engines' reuse reports (eviction watermark and capacity correction). For a
//! deterministic sample of requests, at send time, every historically matched block of every
//! backend gets a predicted probability of residency from four predictors:
//!
//! - `pressure`: [`PressureEstimator`], the router's estimate (the block's survival, i.e. the
//!   product of the conditional probabilities the estimator writes);
//! - `one_minus_utilization`: 1 − the engine's KV utilization at that instant (Ranvier);
//! - `ttl_150s`: 1 if the block was last routed there within 150 simulated seconds, else 0
//!   (the approximate modes of Dynamo and the SGLang gateway);
//! - `lru_capacity`: 1 if the tokens admitted since the block's stamp plus its depth fit the
//!   capacity, else 0 (Dynamo's capacity-bounded LRU of what was sent);
//! - `pressure_pinned_blocks`, a diagnostic, not what the router does: the same estimator
//!   with the distinct prompt blocks of the requests in flight on the backend (each block
//!   once, however many prompts share it) and their output tokens counted as pinned (the
//!   engine holds a running request's blocks until it ends; the router's load counts the
//!   uncached prefill only until the first token);
//!
//! and the truth from the simulator's probe at the same instant: block i is resident iff
//! (i+1)·B ≤ the engine's cached prefix tokens. Per predictor: a reliability table (buckets
//! of width 0.1 of the prediction → samples, mean predicted, observed fraction) and the Brier
//! score. Per request: the replica's expected cached tokens on the chosen backend against the
//! engine's reported `cached_tokens`. docs/residency.md ("Calibration against the simulator")
//! has the method and the figures.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use myelin_routing::{
    BackendId, BackendMatch, BackendState, BackendView, BlockChain, MatchSegment, PinnedBlocks,
    PressureEstimator, ReuseProbe, RoomCalibration, Shard, ShardConfig, block_stamps,
    observe_reuse,
};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::legs::LegKind;
use crate::oracle::CacheOracle;
use crate::plot::PlotError;
use crate::rng;
use crate::workload::config::ClusterSettings;

/// Which legs measure calibration (`myelin bench --calibration`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CalibrationMode {
    /// Legs whose router runs the estimate: prefix+estimate and prefix+auto.
    Auto,
    /// Every leg routed by `myelin serve`.
    On,
    /// None.
    Off,
}

impl CalibrationMode {
    /// Whether a leg of `kind` measures calibration in this mode.
    pub fn applies_to(self, kind: LegKind) -> bool {
        use crate::legs::Residency;
        match self {
            CalibrationMode::Off => false,
            CalibrationMode::On => kind.uses_myelin_router(),
            CalibrationMode::Auto => {
                matches!(kind, LegKind::Prefix(Residency::Estimate | Residency::Auto))
            }
        }
    }
}

/// The fixed TTL of the `ttl_150s` baseline, simulated seconds.
pub const TTL_S: f64 = 150.0;
/// One request in this many is sampled (deterministically from the seed).
pub const SAMPLE_EVERY: u64 = 4;
/// A bucket needs this many samples for its calibration gap to count.
pub const MIN_BUCKET_SAMPLES: u64 = 100;
/// Width of a reliability bucket.
pub const BUCKET_WIDTH: f64 = 0.1;
const BUCKETS: usize = 10;
/// The rng stream of the sampling draw.
const SAMPLE_STREAM: u64 = 0x6361_6c69;

/// The predictors, in report order: (name, what it is).
pub const PREDICTORS: [(&str, &str); 5] = [
    (
        "pressure",
        "PressureEstimator (myelin's estimate): survival from the tokens admitted since the block's stamp against the room",
    ),
    (
        "one_minus_utilization",
        "1 - the engine's KV utilization at that instant (Ranvier)",
    ),
    (
        "ttl_150s",
        "1 if last routed there within 150 simulated s, else 0 (Dynamo / SGLang gateway approximate mode)",
    ),
    (
        "lru_capacity",
        "1 if tokens admitted since the stamp + the block's depth <= capacity, else 0 (Dynamo's capacity-bounded LRU)",
    ),
    (
        "pressure_pinned_blocks",
        "diagnostic, not the router's: PressureEstimator with the distinct prompt blocks and the output tokens of the requests in flight as load",
    ),
];

/// What a leg's calibration needs.
#[derive(Clone)]
pub struct CalibrationSetup {
    pub oracle: Arc<dyn CacheOracle>,
    pub engines: usize,
    pub block_size: u32,
    /// The engines' KV capacity in tokens (kv_blocks × block_size).
    pub capacity_tokens: u64,
    pub seed: u64,
    /// Simulated seconds per wall second.
    pub speedup: f64,
    /// One request in this many is sampled.
    pub sample_every: u64,
}

impl CalibrationSetup {
    /// The setup for a leg on `cluster` (the workload's settings) with the simulator's oracle.
    pub fn new(oracle: Arc<dyn CacheOracle>, cluster: &ClusterSettings, seed: u64) -> Self {
        Self {
            oracle,
            engines: cluster.engines as usize,
            block_size: cluster.block_size.max(1),
            capacity_tokens: u64::from(cluster.kv_blocks) * u64::from(cluster.block_size),
            seed,
            speedup: cluster.speedup,
            sample_every: SAMPLE_EVERY,
        }
    }
}

/// One bucket of a reliability table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// Predictions in `lower..upper` (the last bucket includes 1.0).
    pub lower: f64,
    pub upper: f64,
    /// Block samples.
    pub samples: u64,
    /// Distinct (request, backend) pairs those samples come from (blocks of one pair are
    /// strongly correlated).
    pub pairs: u64,
    /// Mean prediction (`None`: no samples).
    pub mean_predicted: Option<f64>,
    /// Fraction of the samples truly resident.
    pub observed: Option<f64>,
    /// The gap a perfectly calibrated predictor would stay under 95% of the time with this
    /// bucket's samples: 1.96 · sqrt(p(1 − p) / pairs), p the mean prediction, counting each
    /// (request, backend) pair as one independent outcome (its blocks move together).
    pub noise_95: Option<f64>,
    /// Pooled tables only, over 3 runs or more with at least [`MIN_BUCKET_SAMPLES`] samples
    /// here: 1.96 · sd / sqrt(runs) of the runs' own gaps (observed − predicted). Runs differ
    /// by more than their pairs explain (the traffic of one seed ages prefixes together), so
    /// this is the wider and more honest noise of a pooled bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_noise_95: Option<f64>,
}

impl Bucket {
    /// |observed − mean predicted|, `None` without samples.
    pub fn gap(&self) -> Option<f64> {
        Some((self.observed? - self.mean_predicted?).abs())
    }

    /// Whether the bucket has enough samples ([`MIN_BUCKET_SAMPLES`]) for its gap to count.
    pub fn counted(&self) -> bool {
        self.samples >= MIN_BUCKET_SAMPLES
    }

    /// Whether the gap exceeds both the target tolerance ([`GAP_TOLERANCE`]) and the
    /// sampling noise: the predictor is off here by more than this sample can explain.
    pub fn beyond_noise(&self) -> bool {
        let noise = self
            .noise_95
            .into_iter()
            .chain(self.run_noise_95)
            .reduce(f64::max);
        match (self.gap(), noise) {
            (Some(gap), Some(noise)) => gap > noise.max(GAP_TOLERANCE),
            _ => false,
        }
    }
}

/// Calibration tolerance per bucket (issue 10's target: within 0.02 of perfect calibration).
pub const GAP_TOLERANCE: f64 = 0.02;

/// One predictor over a leg.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PredictorCalibration {
    pub name: String,
    pub description: String,
    pub samples: u64,
    /// Mean squared error of the prediction against residency (0 or 1); `None`: no samples.
    pub brier: Option<f64>,
    /// Largest |observed − mean predicted| over buckets with at least
    /// [`MIN_BUCKET_SAMPLES`] samples.
    pub worst_gap: Option<f64>,
    /// Of those buckets: how many are within [`GAP_TOLERANCE`], and how many are off by more
    /// than both the tolerance and their sampling noise ([`Bucket::beyond_noise`]).
    pub buckets_counted: u32,
    pub buckets_within_tolerance: u32,
    pub buckets_beyond_noise: u32,
    pub buckets: Vec<Bucket>,
}

/// Per request: the replica's expected cached tokens on the chosen backend against what the
/// engine reported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CachedTokensError {
    /// Successful requests with a reported `cached_tokens`.
    pub requests: u64,
    /// Mean |reported − predicted|, tokens.
    pub mean_absolute_error_tokens: Option<f64>,
    /// Mean (reported − predicted), tokens: positive when the estimate is pessimistic.
    pub mean_error_tokens: Option<f64>,
    pub mean_predicted_tokens: Option<f64>,
    pub mean_reported_tokens: Option<f64>,
    /// The same error for history alone (every matched block counted resident).
    pub history_mean_absolute_error_tokens: Option<f64>,
}

/// One leg run's calibration (report.json `calibration[]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LegCalibration {
    pub leg: String,
    /// 1-based.
    pub repeat: u32,
    pub sample_every: u64,
    pub sampled_requests: u64,
    /// (request, backend) pairs with a historical match among the sampled requests.
    pub sampled_pairs: u64,
    pub capacity_tokens: u64,
    pub ttl_s: f64,
    /// The `pressure` predictor's sharpness k, edge e and recalibration knots (absent in
    /// reports of older builds).
    #[serde(default)]
    pub sharpness: Option<f64>,
    #[serde(default)]
    pub edge: Option<f64>,
    #[serde(default)]
    pub recalibration: Option<Vec<(f64, f64)>>,
    /// Wall time the replica and the sampling took on the load generator's thread, per
    /// request it saw, microseconds (included in the harness's CPU per request).
    pub cost_us_per_request: f64,
    pub predictors: Vec<PredictorCalibration>,
    pub cached_tokens: CachedTokensError,
}

/// Accumulates (prediction, outcome) samples into a reliability table and a Brier score.
#[derive(Debug, Clone, Default)]
pub struct Reliability {
    count: [u64; BUCKETS],
    pairs: [u64; BUCKETS],
    last_pair: [Option<u64>; BUCKETS],
    sum_predicted: [f64; BUCKETS],
    resident: [u64; BUCKETS],
    squared_error: f64,
}

/// The bucket of a prediction (clamped to 0..=1; 1.0 goes in the last bucket, NaN in the first).
pub fn bucket_of(predicted: f64) -> usize {
    if predicted.is_nan() {
        return 0;
    }
    // Multiplying (not dividing by the width) puts 0.3 in [0.3, 0.4): 0.3 / 0.1 < 3.
    ((predicted.clamp(0.0, 1.0) * BUCKETS as f64).floor() as usize).min(BUCKETS - 1)
}

impl Reliability {
    /// Adds one sample of pair `pair` (samples of a pair arrive together).
    pub fn add(&mut self, predicted: f64, resident: bool, pair: u64) {
        let predicted = if predicted.is_nan() {
            0.0
        } else {
            predicted.clamp(0.0, 1.0)
        };
        let bucket = bucket_of(predicted);
        self.count[bucket] += 1;
        self.sum_predicted[bucket] += predicted;
        if resident {
            self.resident[bucket] += 1;
        }
        if self.last_pair[bucket] != Some(pair) {
            self.last_pair[bucket] = Some(pair);
            self.pairs[bucket] += 1;
        }
        let outcome = if resident { 1.0 } else { 0.0 };
        self.squared_error += (predicted - outcome) * (predicted - outcome);
    }

    /// Samples added.
    pub fn samples(&self) -> u64 {
        self.count.iter().sum()
    }

    /// The mean squared error, `None` without samples.
    pub fn brier(&self) -> Option<f64> {
        let samples = self.samples();
        (samples > 0).then(|| self.squared_error / samples as f64)
    }

    /// The reliability table, every bucket (empty ones with `None` means).
    pub fn buckets(&self) -> Vec<Bucket> {
        (0..BUCKETS)
            .map(|bucket| {
                let count = self.count[bucket];
                let mean = |sum: f64| (count > 0).then(|| sum / count as f64);
                let pairs = self.pairs[bucket];
                let mean_predicted = mean(self.sum_predicted[bucket]);
                Bucket {
                    lower: bucket as f64 * BUCKET_WIDTH,
                    upper: (bucket + 1) as f64 * BUCKET_WIDTH,
                    samples: count,
                    pairs,
                    mean_predicted,
                    observed: mean(self.resident[bucket] as f64),
                    noise_95: mean_predicted
                        .filter(|_| pairs > 0)
                        .map(|p| 1.96 * (p * (1.0 - p) / pairs as f64).sqrt()),
                    run_noise_95: None,
                }
            })
            .collect()
    }

    /// Adds the counts of a summarized table (pooling runs: pairs of different runs are
    /// distinct pairs). Exact up to the rounding of the observed fractions back to counts.
    pub fn absorb(&mut self, summary: &PredictorCalibration) {
        for cell in &summary.buckets {
            let bucket = bucket_of(cell.lower + BUCKET_WIDTH / 2.0);
            let samples = cell.samples as f64;
            self.count[bucket] += cell.samples;
            self.pairs[bucket] += cell.pairs;
            self.last_pair[bucket] = None;
            self.sum_predicted[bucket] += cell.mean_predicted.unwrap_or(0.0) * samples;
            self.resident[bucket] += (cell.observed.unwrap_or(0.0) * samples).round() as u64;
        }
        self.squared_error += summary.brier.unwrap_or(0.0) * summary.samples as f64;
    }

    /// The predictor's summary.
    pub fn summarize(&self, name: &str, description: &str) -> PredictorCalibration {
        let mut summary = PredictorCalibration {
            name: name.to_string(),
            description: description.to_string(),
            samples: self.samples(),
            brier: self.brier(),
            worst_gap: None,
            buckets_counted: 0,
            buckets_within_tolerance: 0,
            buckets_beyond_noise: 0,
            buckets: self.buckets(),
        };
        summary.count_buckets();
        summary
    }
}

impl PredictorCalibration {
    /// Sets the worst gap and the bucket counts from the buckets.
    fn count_buckets(&mut self) {
        let counted: Vec<&Bucket> = self
            .buckets
            .iter()
            .filter(|bucket| bucket.counted())
            .collect();
        self.worst_gap = counted
            .iter()
            .filter_map(|bucket| bucket.gap())
            .reduce(f64::max);
        self.buckets_counted = counted.len() as u32;
        self.buckets_within_tolerance = counted
            .iter()
            .filter(|bucket| bucket.gap().is_some_and(|gap| gap <= GAP_TOLERANCE))
            .count() as u32;
        self.buckets_beyond_noise = counted
            .iter()
            .filter(|bucket| bucket.beyond_noise())
            .count() as u32;
    }
}

/// A request as the replica follows it, from send to end.
pub struct Ticket {
    chain: BlockChain,
    prompt_tokens: u64,
    output_tokens: u64,
    routed: Option<Routed>,
}

struct Routed {
    backend: usize,
    /// Prefill load still counted (until the first byte).
    prefill_pending: u64,
    decode: u64,
    probe: ReuseProbe,
    /// History's cached tokens on the chosen backend, within the reusable blocks.
    history_cached: f64,
}

/// The harness-side replica of the router's history and estimate, and the accumulators.
pub struct Calibrator {
    setup: CalibrationSetup,
    started: Instant,
    shard: Shard,
    estimator: PressureEstimator,
    admitted: Vec<u64>,
    load: Vec<u64>,
    /// Per backend: each prompt block of the requests in flight, with how many hold it (the
    /// diagnostic).
    pinned_blocks: Vec<PinnedBlocks>,
    /// Per backend: output tokens of the requests in flight (the diagnostic).
    pinned_output: Vec<u64>,
    rooms: Vec<RoomCalibration>,
    reliability: [Reliability; 5],
    sampled_requests: u64,
    sampled_pairs: u64,
    errors: ErrorSums,
    stamps: Vec<u64>,
    last_routed: Vec<u64>,
    survivals: Vec<f64>,
    pinned_survivals: Vec<f64>,
    /// Requests seen and the wall time spent on them, microseconds.
    requests_seen: u64,
    spent_us: f64,
}

#[derive(Default)]
struct ErrorSums {
    requests: u64,
    absolute: f64,
    signed: f64,
    predicted: f64,
    reported: f64,
    history_absolute: f64,
}

/// Fills `out` with each of the first `matched_blocks` blocks' last routing time, from the
/// lookup's use records (like [`block_stamps`]).
fn block_last_routed(matched: &BackendMatch, segments: &[MatchSegment], out: &mut Vec<u64>) {
    let blocks = matched.matched_blocks as usize;
    out.clear();
    out.resize(blocks, matched.last_routed_ms);
    for segment in segments.iter().filter(|s| s.backend == matched.backend) {
        let start = (segment.start_block as usize).min(blocks);
        let end = (segment.end_block as usize).min(blocks);
        for at in &mut out[start..end] {
            *at = segment.last_routed_ms;
        }
    }
}

impl Calibrator {
    /// A replica with empty history; times count from now.
    pub fn new(setup: CalibrationSetup) -> Result<Self, myelin_routing::RoutingError> {
        let shard = Shard::new(ShardConfig {
            block_size: setup.block_size,
            ..ShardConfig::default()
        })?;
        let engines = setup.engines;
        let mut rooms = vec![RoomCalibration::default(); engines];
        for room in &mut rooms {
            room.set_capacity(Some(setup.capacity_tokens));
        }
        Ok(Self {
            started: Instant::now(),
            shard,
            estimator: PressureEstimator::default(),
            admitted: vec![0; engines],
            load: vec![0; engines],
            pinned_blocks: vec![PinnedBlocks::default(); engines],
            pinned_output: vec![0; engines],
            rooms,
            reliability: Default::default(),
            sampled_requests: 0,
            sampled_pairs: 0,
            errors: ErrorSums::default(),
            stamps: Vec::new(),
            last_routed: Vec::new(),
            survivals: Vec::new(),
            pinned_survivals: Vec::new(),
            requests_seen: 0,
            spent_us: 0.0,
            setup,
        })
    }

    /// The replica's admitted-tokens counter of `backend`.
    pub fn admitted_tokens(&self, backend: usize) -> u64 {
        self.admitted.get(backend).copied().unwrap_or(0)
    }

    /// The replica's eviction watermark of `backend` (0: none).
    pub fn evicted_below(&self, backend: usize) -> u64 {
        self.shard.evicted_below(BackendId(backend as u32))
    }

    /// What the diagnostic counts as pinned on `backend`: the distinct prompt blocks of the
    /// requests in flight there, in tokens, plus their output tokens.
    pub fn pinned_tokens(&self, backend: usize) -> u64 {
        self.pinned_blocks[backend].distinct() as u64 * u64::from(self.setup.block_size)
            + self.pinned_output[backend]
    }

    /// Simulated milliseconds since the replica started.
    fn now_ms(&self) -> u64 {
        (self.started.elapsed().as_secs_f64() * self.setup.speedup * 1000.0) as u64
    }

    /// Whether request (`user`, `seq`) is sampled.
    pub fn is_sampled(&self, user: u32, seq: u64) -> bool {
        let index = (u64::from(user) << 40) ^ seq;
        rng::draw_below(
            self.setup.seed,
            SAMPLE_STREAM,
            index,
            self.setup.sample_every.max(1),
        ) == 0
    }

    fn view(&self, backend: usize) -> BackendView {
        BackendView::new(
            BackendId(backend as u32),
            BackendState::Up,
            self.load[backend],
        )
        .with_cache(
            self.rooms[backend].effective_capacity(),
            self.admitted[backend],
            self.shard.evicted_below(BackendId(backend as u32)),
        )
    }

    /// A request is about to be sent: hashes its prompt and, when it is sampled, scores every
    /// backend's historical match against the simulator's truth.
    pub fn on_send(&mut self, user: u32, seq: u64, tokens: &[u32], output_tokens: u32) -> Ticket {
        let started = Instant::now();
        let chain = self.shard.chain(tokens);
        if self.is_sampled(user, seq) {
            self.sample(&chain, tokens);
        }
        self.requests_seen += 1;
        self.spent_us += started.elapsed().as_secs_f64() * 1e6;
        Ticket {
            chain,
            prompt_tokens: tokens.len() as u64,
            output_tokens: u64::from(output_tokens),
            routed: None,
        }
    }

    fn sample(&mut self, chain: &BlockChain, tokens: &[u32]) {
        let now_ms = self.now_ms();
        let Ok(matched) = self.shard.lookup_chain(chain, now_ms) else {
            return;
        };
        let truths = self.setup.oracle.probe(tokens);
        let request = self.sampled_requests;
        self.sampled_requests += 1;
        let block = u64::from(self.setup.block_size);
        let ttl_ms = (TTL_S * 1000.0) as u64;
        for entry in matched
            .backends
            .iter()
            .filter(|entry| entry.matched_blocks > 0)
        {
            let backend = entry.backend.0 as usize;
            let Some(truth) = truths.get(backend) else {
                continue;
            };
            if backend >= self.setup.engines {
                continue;
            }
            self.sampled_pairs += 1;
            let pair = request * self.setup.engines as u64 + backend as u64;
            block_stamps(entry, &matched.segments, &mut self.stamps);
            block_last_routed(entry, &matched.segments, &mut self.last_routed);
            let view = self.view(backend);
            let mut survivals = std::mem::take(&mut self.survivals);
            self.estimator
                .survivals(&view, self.setup.block_size, &self.stamps, &mut survivals);
            let mut pinned_view = view.clone();
            pinned_view.load_tokens = self.pinned_tokens(backend);
            let mut pinned = std::mem::take(&mut self.pinned_survivals);
            self.estimator.survivals(
                &pinned_view,
                self.setup.block_size,
                &self.stamps,
                &mut pinned,
            );
            let free = truth.memory.map(|memory| 1.0 - memory.utilization);
            let admitted = self.admitted[backend];
            for (depth, survival) in survivals.iter().enumerate() {
                let end = (depth as u64 + 1) * block;
                let resident = end <= truth.cached_tokens;
                self.reliability[0].add(*survival, resident, pair);
                if let Some(free) = free {
                    self.reliability[1].add(free, resident, pair);
                }
                let fresh = now_ms.saturating_sub(self.last_routed[depth]) <= ttl_ms;
                self.reliability[2].add(if fresh { 1.0 } else { 0.0 }, resident, pair);
                let fits =
                    admitted.saturating_sub(self.stamps[depth]) + end <= self.setup.capacity_tokens;
                self.reliability[3].add(if fits { 1.0 } else { 0.0 }, resident, pair);
                self.reliability[4].add(pinned[depth], resident, pair);
            }
            self.survivals = survivals;
            self.pinned_survivals = pinned;
        }
    }

    /// The router answered: `backend` (the `x-myelin-backend` header) serves the request. As
    /// the router does on an answered request: the backend's admitted counter and load grow,
    /// then the prompt is learned there with the counter as its stamp.
    pub fn on_head(&mut self, ticket: &mut Ticket, backend: &str) {
        let Ok(backend) = backend.trim().parse::<usize>() else {
            return;
        };
        if backend >= self.setup.engines || ticket.routed.is_some() {
            return;
        }
        let started = Instant::now();
        self.route(ticket, backend);
        self.spent_us += started.elapsed().as_secs_f64() * 1e6;
    }

    fn route(&mut self, ticket: &mut Ticket, backend: usize) {
        let now_ms = self.now_ms();
        let block_size = self.setup.block_size;
        let block = f64::from(block_size);
        let id = BackendId(backend as u32);
        let Ok(matched) = self.shard.lookup_chain(&ticket.chain, now_ms) else {
            return;
        };
        self.stamps.clear();
        if let Some(entry) = matched.backend(id) {
            block_stamps(entry, &matched.segments, &mut self.stamps);
        }
        let view = self.view(backend);
        let mut survivals = std::mem::take(&mut self.survivals);
        self.estimator
            .survivals(&view, block_size, &self.stamps, &mut survivals);
        let mut probe = ReuseProbe {
            block_size,
            stamps: self.stamps.clone(),
            admitted_tokens: 0,
            load_tokens: self.load[backend],
            predicted_cached_tokens: 0.0,
            room_tokens: self.estimator.room_tokens(&view, block_size),
            prompt_tokens: ticket.prompt_tokens,
        };
        // What the engine can report reusing: the blocks within the prompt's first
        // `prompt − 1` tokens.
        let reusable = probe.reusable_blocks() as usize;
        let expected: f64 = survivals.iter().take(reusable).map(|s| s * block).sum();
        let history_cached = reusable as f64 * block;
        self.survivals = survivals;
        probe.predicted_cached_tokens = expected;
        let history_tokens = self.stamps.len() as u64 * u64::from(block_size);
        let admitted_prefill = ticket
            .prompt_tokens
            .saturating_sub(history_tokens.max(expected.round() as u64));
        let prefill = ticket.prompt_tokens.saturating_sub(expected.round() as u64);
        self.load[backend] += prefill + ticket.output_tokens;
        self.pinned_blocks[backend].pin(ticket.chain.hashes().iter().copied());
        self.pinned_output[backend] += ticket.output_tokens;
        self.admitted[backend] += admitted_prefill + ticket.output_tokens;
        probe.admitted_tokens = self.admitted[backend];
        let _ = self
            .shard
            .learn_chain(&ticket.chain, id, now_ms, self.admitted[backend]);
        ticket.routed = Some(Routed {
            backend,
            prefill_pending: prefill,
            decode: ticket.output_tokens,
            probe,
            history_cached,
        });
    }

    /// The first bytes of the answer arrived: the prompt's prefill is done.
    pub fn on_first_byte(&mut self, ticket: &mut Ticket) {
        if let Some(routed) = ticket.routed.as_mut() {
            let load = &mut self.load[routed.backend];
            *load = load.saturating_sub(routed.prefill_pending);
            routed.prefill_pending = 0;
        }
    }

    /// The request ended (`cached_tokens`: the engine's reuse report, when it succeeded):
    /// its load goes; the report feeds the closed loop and the predicted-vs-reported error.
    pub fn on_end(&mut self, ticket: Ticket, cached_tokens: Option<u32>) {
        let Some(routed) = ticket.routed else {
            return;
        };
        let backend = routed.backend;
        self.load[backend] =
            self.load[backend].saturating_sub(routed.prefill_pending + routed.decode);
        self.pinned_blocks[backend].unpin(ticket.chain.hashes().iter().copied());
        self.pinned_output[backend] =
            self.pinned_output[backend].saturating_sub(ticket.output_tokens);
        let Some(reported) = cached_tokens.map(u64::from) else {
            return;
        };
        let started = Instant::now();
        let probe = &routed.probe;
        let predicted = probe.predicted_cached_tokens;
        let error = reported as f64 - predicted;
        self.errors.requests += 1;
        self.errors.absolute += error.abs();
        self.errors.signed += error;
        self.errors.predicted += predicted;
        self.errors.reported += reported as f64;
        self.errors.history_absolute += (reported as f64 - routed.history_cached).abs();
        // The router's closed loop (routing glue and data core): capacity correction,
        // eviction watermark, and the prefill history missed counted as admitted.
        let observation = observe_reuse(probe, reported);
        self.rooms[backend].observe(
            &self.estimator,
            &observation,
            probe.load_tokens,
            probe.block_size,
        );
        if let Some(stamp) = observation.evicted_stamp {
            self.shard
                .mark_evicted_below(BackendId(backend as u32), stamp);
        }
        let history_cached = (u64::from(probe.reusable_blocks()) * u64::from(probe.block_size))
            .max(probe.predicted_cached_tokens as u64);
        self.admitted[backend] += history_cached.saturating_sub(reported);
        self.spent_us += started.elapsed().as_secs_f64() * 1e6;
    }

    /// The leg's figures (`leg` and `repeat` are set by the caller).
    pub fn finish(&self) -> LegCalibration {
        let requests = self.errors.requests;
        let mean = |sum: f64| (requests > 0).then(|| sum / requests as f64);
        LegCalibration {
            leg: String::new(),
            repeat: 0,
            sample_every: self.setup.sample_every,
            sampled_requests: self.sampled_requests,
            sampled_pairs: self.sampled_pairs,
            capacity_tokens: self.setup.capacity_tokens,
            ttl_s: TTL_S,
            sharpness: Some(self.estimator.sharpness),
            edge: Some(self.estimator.edge),
            recalibration: Some(self.estimator.recalibration.to_vec()),
            cost_us_per_request: self.spent_us / self.requests_seen.max(1) as f64,
            predictors: PREDICTORS
                .iter()
                .zip(&self.reliability)
                .map(|((name, description), reliability)| reliability.summarize(name, description))
                .collect(),
            cached_tokens: CachedTokensError {
                requests,
                mean_absolute_error_tokens: mean(self.errors.absolute),
                mean_error_tokens: mean(self.errors.signed),
                mean_predicted_tokens: mean(self.errors.predicted),
                mean_reported_tokens: mean(self.errors.reported),
                history_mean_absolute_error_tokens: mean(self.errors.history_absolute),
            },
        }
    }
}

fn optional(value: Option<f64>, decimals: usize) -> String {
    value.map_or("-".into(), |value| format!("{value:.decimals$}"))
}

/// report.md's calibration section (empty when no leg measured it).
pub fn render_markdown(calibrations: &[LegCalibration], plot: Option<&str>) -> String {
    if calibrations.is_empty() {
        return String::new();
    }
    let mut out = String::from("## Residency calibration against the simulator's truth\n\n");
    out.push_str(&format!(
        "One request in {} (drawn from the seed), at send time: each historically matched block of \
         every backend, predicted residency against the simulator's pool at that instant. A bucket's \
         gap is |observed - mean predicted|; the worst gap counts buckets with at least {} samples. \
         Samples are blocks; blocks of one (request, backend) pair are strongly correlated (pairs \
         column). Of the counted buckets: how many are within {} of the diagonal, and how many are \
         off by more than both {} and their sampling noise (1.96 sqrt(p(1-p)/pairs): what a \
         perfectly calibrated predictor could show with that many pairs).\n\n",
        calibrations[0].sample_every, MIN_BUCKET_SAMPLES, GAP_TOLERANCE, GAP_TOLERANCE
    ));
    out.push_str(
        "| leg | repeat | sampled requests | pairs | cost/request (us) | predictor | samples | Brier | worst gap | buckets counted | within tolerance | off beyond noise |\n\
         |---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for leg in calibrations {
        for predictor in &leg.predictors {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.0} | {} |",
                leg.leg,
                leg.repeat,
                leg.sampled_requests,
                leg.sampled_pairs,
                leg.cost_us_per_request,
                predictor_cells(predictor),
            );
        }
    }
    out.push_str(
        "\nPredicted vs reported cached tokens (the harness replica's expected cached tokens on \
         the chosen backend; `usage.prompt_tokens_details.cached_tokens`):\n\n\
         | leg | repeat | requests | MAE (tokens) | mean error (reported - predicted) | mean predicted | mean reported | history-only MAE |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for leg in calibrations {
        let errors = &leg.cached_tokens;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            leg.leg,
            leg.repeat,
            errors.requests,
            optional(errors.mean_absolute_error_tokens, 0),
            optional(errors.mean_error_tokens, 0),
            optional(errors.mean_predicted_tokens, 0),
            optional(errors.mean_reported_tokens, 0),
            optional(errors.history_mean_absolute_error_tokens, 0),
        );
    }
    for leg in calibrations {
        let _ = write!(
            out,
            "\n### Reliability: {} (repeat {})\n\n",
            leg.leg, leg.repeat
        );
        reliability_table(&mut out, &leg.predictors);
    }
    if let Some(plot) = plot {
        let _ = write!(out, "\n![reliability diagram]({plot})\n");
    }
    out.push('\n');
    out
}

/// A predictor's summary cells of report.md's tables: name, samples, Brier score, worst gap
/// and the bucket counts (counted, within tolerance, off beyond noise).
fn predictor_cells(predictor: &PredictorCalibration) -> String {
    format!(
        "{} | {} | {} | {} | {} | {} | {}",
        predictor.name,
        predictor.samples,
        optional(predictor.brier, 4),
        optional(predictor.worst_gap, 3),
        predictor.buckets_counted,
        predictor.buckets_within_tolerance,
        predictor.buckets_beyond_noise,
    )
}

/// Every predictor's reliability table side by side: per bucket, samples (pairs), mean
/// predicted, observed (marked when off beyond noise) and the sampling noise.
fn reliability_table(out: &mut String, predictors: &[PredictorCalibration]) {
    out.push_str("| bucket |");
    for predictor in predictors {
        let _ = write!(
            out,
            " {} n (pairs) | predicted | observed | noise |",
            predictor.name
        );
    }
    out.push_str("\n|---|");
    for _ in predictors {
        out.push_str("---:|---:|---:|---:|");
    }
    out.push('\n');
    for bucket in 0..BUCKETS {
        let lower = bucket as f64 * BUCKET_WIDTH;
        let _ = write!(out, "| {lower:.1}-{:.1} |", lower + BUCKET_WIDTH);
        for predictor in predictors {
            let cell = &predictor.buckets[bucket];
            let _ = write!(
                out,
                " {} ({}) | {} | {}{} | {} |",
                cell.samples,
                cell.pairs,
                optional(cell.mean_predicted, 3),
                optional(cell.observed, 3),
                if cell.counted() && cell.beyond_noise() {
                    " (off)"
                } else {
                    ""
                },
                match cell.run_noise_95 {
                    Some(runs) => format!("{} (runs {runs:.3})", optional(cell.noise_95, 3)),
                    None => optional(cell.noise_95, 3),
                }
            );
        }
        out.push('\n');
    }
}

/// A leg's calibration pooled over several runs of it (the repeats of one `myelin bench`, or
/// the reports of runs with other seeds: `myelin bench calibration REPORT...`). Pairs of
/// different runs count as distinct, so the pairs' noise shrinks with every run; the runs'
/// own spread ([`Bucket::run_noise_95`]) says how far runs really differ. Runs of one seed
/// replay the same traffic, so they are not independent samples of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PooledCalibration {
    pub leg: String,
    pub runs: u32,
    /// The refit of the `pressure` predictor's recalibration map over these runs
    /// ([`refit_recalibration`]), when every run recorded its parameters and they share the
    /// sharpness and edge.
    pub refit: Option<Vec<(f64, f64)>>,
    pub sampled_requests: u64,
    pub sampled_pairs: u64,
    pub predictors: Vec<PredictorCalibration>,
}

/// 1.96 · sd / sqrt(n) of `values`, `None` under 3 of them.
fn spread_95(values: &[f64]) -> Option<f64> {
    let n = values.len();
    if n < 3 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let variance = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    Some(1.96 * (variance / n as f64).sqrt())
}

/// One run's gap (observed − predicted) per bucket, where the bucket counted.
type RunGaps = [Option<f64>; BUCKETS];

/// Pools `calibrations` per leg (in order of first appearance), each predictor by name.
pub fn pool(calibrations: &[LegCalibration]) -> Vec<PooledCalibration> {
    struct Pooling {
        leg: String,
        runs: u32,
        /// The first run's sharpness and edge.
        curve: (Option<f64>, Option<f64>),
        /// The runs' `pressure` buckets as (survival, observed, samples) points, while every run
        /// recorded its map and the first run's curve ([`recalibration_points`]).
        points: Option<Vec<(f64, f64, f64)>>,
        sampled_requests: u64,
        sampled_pairs: u64,
        /// Per predictor: name, description, the pooled table and each run's bucket gaps.
        predictors: Vec<(String, String, Reliability, Vec<RunGaps>)>,
    }
    let mut legs: Vec<Pooling> = Vec::new();
    for run in calibrations {
        let index = match legs.iter().position(|leg| leg.leg == run.leg) {
            Some(index) => index,
            None => {
                legs.push(Pooling {
                    leg: run.leg.clone(),
                    runs: 0,
                    curve: (run.sharpness, run.edge),
                    points: Some(Vec::new()),
                    sampled_requests: 0,
                    sampled_pairs: 0,
                    predictors: Vec::new(),
                });
                legs.len() - 1
            }
        };
        let leg = &mut legs[index];
        leg.runs += 1;
        let pressure = run.predictors.iter().find(|p| p.name == PREDICTORS[0].0);
        leg.points = match (leg.points.take(), pressure, &run.recalibration) {
            (Some(mut points), Some(pressure), Some(knots))
                if leg.curve == (run.sharpness, run.edge) && leg.curve.0.is_some() =>
            {
                points.extend(recalibration_points(&pressure.buckets, knots));
                Some(points)
            }
            _ => None,
        };
        leg.sampled_requests += run.sampled_requests;
        leg.sampled_pairs += run.sampled_pairs;
        for predictor in &run.predictors {
            let slot = match leg
                .predictors
                .iter()
                .position(|(name, ..)| *name == predictor.name)
            {
                Some(slot) => slot,
                None => {
                    leg.predictors.push((
                        predictor.name.clone(),
                        predictor.description.clone(),
                        Reliability::default(),
                        Vec::new(),
                    ));
                    leg.predictors.len() - 1
                }
            };
            let (_, _, table, gaps) = &mut leg.predictors[slot];
            table.absorb(predictor);
            let mut run_gaps = [None; BUCKETS];
            for (gap, bucket) in run_gaps.iter_mut().zip(&predictor.buckets) {
                *gap = bucket
                    .counted()
                    .then(|| Some(bucket.observed? - bucket.mean_predicted?))
                    .flatten();
            }
            gaps.push(run_gaps);
        }
    }
    legs.into_iter()
        .map(|leg| PooledCalibration {
            leg: leg.leg,
            runs: leg.runs,
            refit: leg.points.and_then(refit_recalibration),
            sampled_requests: leg.sampled_requests,
            sampled_pairs: leg.sampled_pairs,
            predictors: leg
                .predictors
                .iter()
                .map(|(name, description, reliability, gaps)| {
                    let mut summary = reliability.summarize(name, description);
                    for (index, bucket) in summary.buckets.iter_mut().enumerate() {
                        let gaps: Vec<f64> = gaps.iter().filter_map(|run| run[index]).collect();
                        bucket.run_noise_95 = spread_95(&gaps);
                    }
                    summary.count_buckets();
                    summary
                })
                .collect(),
        })
        .collect()
}

/// One run's `pressure` buckets from 0.1 to 0.9 with at least [`MIN_BUCKET_SAMPLES`]
/// samples, as (log-logistic survival, observed fraction, samples): the survival the bucket's
/// mean prediction came from through the run's map `knots` ([`myelin_routing::uncalibrate`]).
/// The outer buckets are left to the map's implied (0, 0) and (1, 1).
pub fn recalibration_points(buckets: &[Bucket], knots: &[(f64, f64)]) -> Vec<(f64, f64, f64)> {
    buckets
        .iter()
        .filter(|bucket| bucket.lower >= 0.1 - 1e-9 && bucket.upper <= 0.9 + 1e-9)
        .filter(|bucket| bucket.counted())
        .filter_map(|bucket| {
            Some((
                myelin_routing::uncalibrate(knots, bucket.mean_predicted?),
                bucket.observed?,
                bucket.samples as f64,
            ))
        })
        .collect()
}

/// Refits the estimate's recalibration map ([`myelin_routing::DEFAULT_RECALIBRATION`]) from
/// runs' [`recalibration_points`] (runs made with different maps pool, as each point is placed
/// at its own survival): the points are grouped in survival buckets of 0.1 from 0.1 to 0.9,
/// one knot per group at the sample-weighted mean survival and observed fraction (runs made
/// without a map: exactly the pooled table's points), made non-decreasing
/// (pool-adjacent-violators, weighted by samples). `None` with fewer than three knots.
pub fn refit_recalibration(points: Vec<(f64, f64, f64)>) -> Option<Vec<(f64, f64)>> {
    let mut groups = [(0.0f64, 0.0f64, 0.0f64); BUCKETS];
    for (survival, observed, weight) in points {
        let group = &mut groups[bucket_of(survival)];
        group.0 += survival * weight;
        group.1 += observed * weight;
        group.2 += weight;
    }
    // (survivals of the knots merged, observed, weight), in increasing survival.
    let mut merged: Vec<(Vec<f64>, f64, f64)> = Vec::new();
    for (sum_survival, sum_observed, weight) in groups.into_iter().take(BUCKETS - 1).skip(1) {
        if weight <= 0.0 {
            continue;
        }
        merged.push((vec![sum_survival / weight], sum_observed / weight, weight));
        // Pool adjacent violators: merged runs keep their weighted mean observed fraction.
        while merged.len() > 1 && merged[merged.len() - 2].1 > merged[merged.len() - 1].1 {
            let (survivals, observed, weight) = merged.pop().unwrap();
            let last = merged.last_mut().unwrap();
            last.1 = (last.1 * last.2 + observed * weight) / (last.2 + weight);
            last.2 += weight;
            last.0.extend(survivals);
        }
    }
    let knots: Vec<(f64, f64)> = merged
        .into_iter()
        .flat_map(|(survivals, observed, _)| survivals.into_iter().map(move |s| (s, observed)))
        .collect();
    (knots.len() >= 3).then_some(knots)
}

/// report.md's section for the calibration pooled over runs (empty without pooled legs).
pub fn render_pooled_markdown(pooled: &[PooledCalibration]) -> String {
    if pooled.is_empty() {
        return String::new();
    }
    let mut out = String::from("## Residency calibration pooled over runs\n\n");
    let _ = write!(
        out,
        "Each leg's runs added together: samples, pairs and resident blocks summed per bucket, \
         the Brier score weighted by samples, the noise recomputed from the pooled pairs and, \
         over 3 runs or more, from the spread of the runs' own gaps (runs: 1.96 sd / sqrt(n); \
         off beyond noise means beyond the larger of the two). A bucket counts with at least \
         {MIN_BUCKET_SAMPLES} samples; within tolerance: within {GAP_TOLERANCE} of the \
         diagonal.\n\n\
         | leg | runs | sampled requests | pairs | predictor | samples | Brier | worst gap | buckets counted | within tolerance | off beyond noise |\n\
         |---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|\n"
    );
    for leg in pooled {
        for predictor in &leg.predictors {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                leg.leg,
                leg.runs,
                leg.sampled_requests,
                leg.sampled_pairs,
                predictor_cells(predictor),
            );
        }
    }
    for leg in pooled {
        let _ = write!(
            out,
            "\n### Pooled reliability: {} ({} runs)\n\n",
            leg.leg, leg.runs
        );
        reliability_table(&mut out, &leg.predictors);
        if let Some(knots) = &leg.refit {
            let knots: Vec<String> = knots
                .iter()
                .map(|(survival, observed)| format!("({survival:.4}, {observed:.4})"))
                .collect();
            let _ = writeln!(
                out,
                "\nRefit of `pressure`'s recalibration map (survival, observed), for \
                 `DEFAULT_RECALIBRATION`: [{}]",
                knots.join(", ")
            );
        }
    }
    out.push('\n');
    out
}

/// One line per leg run for stdout.
pub fn render_text(calibrations: &[LegCalibration]) -> String {
    let mut out = String::new();
    for leg in calibrations {
        let _ = write!(
            out,
            "calibration {} #{}: {} sampled requests ({:.0} us/request), Brier",
            leg.leg, leg.repeat, leg.sampled_requests, leg.cost_us_per_request
        );
        predictors_text(&mut out, &leg.predictors);
        let _ = writeln!(
            out,
            "; cached tokens MAE {} (history only {})",
            optional(leg.cached_tokens.mean_absolute_error_tokens, 0),
            optional(leg.cached_tokens.history_mean_absolute_error_tokens, 0)
        );
    }
    out
}

/// One line per pooled leg for stdout.
pub fn render_pooled_text(pooled: &[PooledCalibration]) -> String {
    let mut out = String::new();
    for leg in pooled {
        let _ = write!(
            out,
            "calibration {} pooled over {} runs: {} sampled requests, {} pairs, Brier",
            leg.leg, leg.runs, leg.sampled_requests, leg.sampled_pairs
        );
        predictors_text(&mut out, &leg.predictors);
        out.push('\n');
    }
    out
}

/// Each predictor's Brier score, worst gap and bucket counts, for a stdout line.
fn predictors_text(out: &mut String, predictors: &[PredictorCalibration]) {
    for predictor in predictors {
        let _ = write!(
            out,
            " {} {} (worst gap {}, {}/{} buckets within {GAP_TOLERANCE}, {} off beyond noise)",
            predictor.name,
            optional(predictor.brier, 4),
            optional(predictor.worst_gap, 3),
            predictor.buckets_within_tolerance,
            predictor.buckets_counted,
            predictor.buckets_beyond_noise
        );
    }
}

/// `myelin bench calibration`: pools the residency calibration of several runs.
#[derive(Debug, Clone, clap::Args)]
pub struct PoolArgs {
    /// report.json files of `myelin bench` runs that measured calibration (for independent
    /// samples: the same legs run with different --seed values).
    #[arg(required = true)]
    pub reports: Vec<PathBuf>,
    /// Pool only this leg (default: every leg found).
    #[arg(long)]
    pub leg: Option<String>,
}

/// Why `myelin bench calibration` could not pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a myelin bench report.json: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error(
        "no calibration to pool{}: the runs need a leg that measures it (--calibration) on token-id prompts",
        leg.as_ref().map(|leg| format!(" for leg {leg}")).unwrap_or_default()
    )]
    Empty { leg: Option<String> },
}

/// Reads every report's `calibration[]` (a report without one adds nothing) and prints the
/// pooled tables as markdown.
pub fn run_pool(args: &PoolArgs) -> Result<std::process::ExitCode, PoolError> {
    #[derive(Deserialize)]
    struct Report {
        #[serde(default)]
        calibration: Vec<LegCalibration>,
    }
    let mut runs = Vec::new();
    for path in &args.reports {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| PoolError::Read {
            path: display.clone(),
            source,
        })?;
        let report: Report = serde_json::from_str(&text).map_err(|source| PoolError::Parse {
            path: display,
            source,
        })?;
        runs.extend(
            report
                .calibration
                .into_iter()
                .filter(|run| args.leg.as_ref().is_none_or(|leg| *leg == run.leg)),
        );
    }
    if runs.is_empty() {
        return Err(PoolError::Empty {
            leg: args.leg.clone(),
        });
    }
    let pooled = pool(&runs);
    print!("{}", render_pooled_markdown(&pooled));
    Ok(std::process::ExitCode::SUCCESS)
}

/// The reliability diagram: one panel per predictor, observed fraction against mean
/// prediction per bucket for every leg run, with the diagonal of perfect calibration. Filled
/// markers: buckets with at least [`MIN_BUCKET_SAMPLES`] samples; hollow: fewer. Binary
/// predictors (TTL, LRU) have two points and no line.
pub fn reliability_diagram(path: &Path, calibrations: &[LegCalibration]) -> Result<(), PlotError> {
    crate::plot::register_font()?;
    let draw = |message: String| PlotError::Draw {
        path: path.display().to_string(),
        message,
    };
    let root = BitMapBackend::new(path, (1950, 1300)).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let root = root
        .titled(
            "Residency reliability against the simulator (blocks): observed vs predicted",
            ("sans-serif", 28),
        )
        .map_err(|error| draw(error.to_string()))?;
    let panels = root.split_evenly((2, 3));
    for (index, ((name, _), panel)) in PREDICTORS.iter().zip(panels.iter()).enumerate() {
        let mut chart = ChartBuilder::on(panel)
            .caption(*name, ("sans-serif", 22))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(55)
            .build_cartesian_2d(0.0..1.0, 0.0..1.0)
            .map_err(|error| draw(error.to_string()))?;
        chart
            .configure_mesh()
            .x_desc("mean predicted (bucket of 0.1)")
            .y_desc("observed fraction resident")
            .x_label_formatter(&|value| format!("{value:.1}"))
            .y_label_formatter(&|value| format!("{value:.1}"))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .draw()
            .map_err(|error| draw(error.to_string()))?;
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, 0.0), (1.0, 1.0)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(|error| draw(error.to_string()))?
            .label("perfect calibration")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.mix(0.5)));
        for (run, leg) in calibrations.iter().enumerate() {
            let Some(predictor) = leg.predictors.get(index) else {
                continue;
            };
            let points: Vec<(f64, f64, bool)> = predictor
                .buckets
                .iter()
                .filter_map(|bucket| {
                    Some((bucket.mean_predicted?, bucket.observed?, bucket.counted()))
                })
                .collect();
            if points.is_empty() {
                continue;
            }
            let color = Palette99::pick(run).to_rgba();
            let label = format!(
                "{} #{} (Brier {})",
                leg.leg,
                leg.repeat,
                optional(predictor.brier, 4)
            );
            let line: Vec<(f64, f64)> = points.iter().map(|&(x, y, _)| (x, y)).collect();
            let series = if line.len() > 2 { line } else { Vec::new() };
            chart
                .draw_series(LineSeries::new(series, color.stroke_width(2)))
                .map_err(|error| draw(error.to_string()))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
                });
            chart
                .draw_series(points.into_iter().map(|(x, y, enough)| {
                    let style = if enough {
                        color.filled()
                    } else {
                        color.stroke_width(2)
                    };
                    Circle::new((x, y), 5, style)
                }))
                .map_err(|error| draw(error.to_string()))?;
        }
        chart
            .configure_series_labels()
            .label_font(("sans-serif", 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|error| draw(error.to_string()))?;
    }
    root.present().map_err(|error| draw(error.to_string()))
}

/// report.json: the report with `calibration` added (additive: absent when no leg measured it).
#[derive(Serialize)]
pub struct WithCalibration<'a, T: Serialize> {
    #[serde(flatten)]
    pub report: &'a T,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub calibration: &'a [LegCalibration],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    pub calibration_pooled: &'a [PooledCalibration],
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use myelin_routing::MemoryPressure;

    use super::*;
    use crate::oracle::EngineTruth;

    #[test]
    fn buckets_are_tenths_with_one_in_the_last() {
        assert_eq!(bucket_of(0.0), 0);
        assert_eq!(bucket_of(0.099), 0);
        assert_eq!(bucket_of(0.1), 1);
        assert_eq!(bucket_of(0.3), 3);
        assert_eq!(bucket_of(0.7), 7);
        assert_eq!(bucket_of(0.95), 9);
        assert_eq!(bucket_of(1.0), 9);
        assert_eq!(bucket_of(-0.5), 0);
        assert_eq!(bucket_of(1.5), 9);
        assert_eq!(bucket_of(f64::NAN), 0);
    }

    #[test]
    fn reliability_table_and_brier_score_by_hand() {
        let mut table = Reliability::default();
        table.add(0.05, false, 1);
        table.add(0.05, true, 1);
        table.add(0.95, true, 2);
        table.add(1.0, true, 2);
        table.add(0.55, false, 3);
        // (0.05² + 0.95² + 0.05² + 0² + 0.55²) / 5 = 1.21 / 5.
        assert!((table.brier().unwrap() - 0.242).abs() < 1e-12);
        let buckets = table.buckets();
        assert_eq!(buckets.len(), 10);
        assert_eq!(buckets[0].samples, 2);
        assert_eq!(buckets[0].pairs, 1);
        assert!((buckets[0].mean_predicted.unwrap() - 0.05).abs() < 1e-12);
        assert_eq!(buckets[0].observed, Some(0.5));
        assert!((buckets[0].gap().unwrap() - 0.45).abs() < 1e-12);
        assert_eq!(buckets[5].observed, Some(0.0));
        assert_eq!(buckets[9].samples, 2);
        assert!((buckets[9].mean_predicted.unwrap() - 0.975).abs() < 1e-12);
        assert_eq!(buckets[9].observed, Some(1.0));
        assert_eq!(buckets[3].samples, 0);
        assert_eq!(buckets[3].mean_predicted, None);
        // No bucket has 100 samples: no gap counts.
        assert_eq!(table.summarize("p", "").worst_gap, None);
        assert_eq!(Reliability::default().brier(), None);
    }

    #[test]
    fn worst_gap_counts_only_buckets_with_enough_samples() {
        let mut table = Reliability::default();
        // 100 samples predicted 0.3, 40 resident: gap 0.1.
        for sample in 0..100 {
            table.add(0.3, sample < 40, sample);
        }
        // 99 samples predicted 0.9, none resident: gap 0.9, but too few samples.
        for sample in 0..99 {
            table.add(0.9, false, 1000 + sample);
        }
        let summary = table.summarize("p", "");
        assert!(
            (summary.worst_gap.unwrap() - 0.1).abs() < 1e-9,
            "{summary:?}"
        );
        assert_eq!(summary.buckets[3].pairs, 100);
        assert_eq!(summary.samples, 199);
        // Brier: 40 x 0.7² + 60 x 0.3² + 99 x 0.9², over 199.
        let expected = (40.0 * 0.49 + 60.0 * 0.09 + 99.0 * 0.81) / 199.0;
        assert!((summary.brier.unwrap() - expected).abs() < 1e-12);
        // 100 independent pairs at 0.3: a calibrated predictor stays within
        // 1.96·sqrt(0.21/100) ≈ 0.090 of the diagonal; 0.1 is beyond that and the tolerance.
        let noise = summary.buckets[3].noise_95.unwrap();
        assert!((noise - 1.96 * 0.0021f64.sqrt()).abs() < 1e-9, "{noise}");
        assert!(summary.buckets[3].beyond_noise());
        assert_eq!(
            (
                summary.buckets_counted,
                summary.buckets_within_tolerance,
                summary.buckets_beyond_noise
            ),
            (1, 0, 1)
        );
        // The same samples from 5 pairs of 20 blocks: the noise is ±0.40, so the same gap is
        // not evidence of miscalibration (but still outside the tolerance).
        let mut few_pairs = Reliability::default();
        for sample in 0..100u64 {
            few_pairs.add(0.3, sample < 40, sample / 20);
        }
        let summary = few_pairs.summarize("p", "");
        assert_eq!(summary.buckets[3].pairs, 5);
        assert!(!summary.buckets[3].beyond_noise());
        assert_eq!(
            (
                summary.buckets_counted,
                summary.buckets_within_tolerance,
                summary.buckets_beyond_noise
            ),
            (1, 0, 0)
        );
    }

    /// The simulator's truth, set by the test.
    struct FakeOracle(Mutex<Vec<EngineTruth>>);

    impl CacheOracle for FakeOracle {
        fn probe(&self, _prompt_tokens: &[u32]) -> Vec<EngineTruth> {
            self.0.lock().unwrap().clone()
        }
    }

    fn truth(cached_tokens: u64, utilization: f64) -> EngineTruth {
        EngineTruth {
            cached_tokens,
            queued_tokens: 0,
            requests_received: None,
            memory: Some(MemoryPressure {
                utilization,
                waiting_requests: 0,
                running_requests: 0,
                mean_remaining_output_tokens: 0.0,
            }),
            ..EngineTruth::default()
        }
    }

    fn calibrator(oracle: Arc<FakeOracle>) -> Calibrator {
        Calibrator::new(CalibrationSetup {
            oracle,
            engines: 2,
            block_size: 4,
            capacity_tokens: 64,
            seed: 1,
            // Simulated time barely moves: every block is within the TTL.
            speedup: 1.0,
            sample_every: 1,
        })
        .unwrap()
    }

    fn route(
        calibrator: &mut Calibrator,
        seq: u64,
        tokens: &[u32],
        output: u32,
        backend: &str,
        cached: u32,
    ) {
        let mut ticket = calibrator.on_send(0, seq, tokens, output);
        calibrator.on_head(&mut ticket, backend);
        calibrator.on_first_byte(&mut ticket);
        calibrator.on_end(ticket, Some(cached));
    }

    #[test]
    fn the_replica_counts_admitted_tokens_and_scores_every_predictor_against_the_truth() {
        let oracle = Arc::new(FakeOracle(Mutex::new(vec![truth(0, 0.0), truth(0, 0.0)])));
        let mut calibrator = calibrator(oracle.clone());
        let prefix: Vec<u32> = (0..32).collect();
        // First time: nothing matched, nothing sampled; 32 uncached + 8 output tokens admitted.
        route(&mut calibrator, 0, &prefix, 8, "0", 0);
        assert_eq!(calibrator.admitted_tokens(0), 40);
        assert_eq!(calibrator.admitted_tokens(1), 0);
        let first = calibrator.finish();
        assert_eq!(first.sampled_requests, 1);
        assert_eq!(first.sampled_pairs, 0);

        // Again, engine 0 holds all 8 blocks and is a quarter full: no pressure since, so the
        // estimate says 1.0, and 1 − utilization 0.75.
        *oracle.0.lock().unwrap() = vec![truth(32, 0.25), truth(0, 0.0)];
        route(&mut calibrator, 1, &prefix, 8, "0", 28);
        // History held 8 blocks: only the output is new pressure.
        assert_eq!(calibrator.admitted_tokens(0), 48);
        let second = calibrator.finish();
        assert_eq!(second.sampled_pairs, 1);
        let pressure = &second.predictors[0];
        assert_eq!(pressure.name, "pressure");
        assert_eq!(pressure.samples, 8);
        assert_eq!(pressure.brier, Some(0.0));
        assert_eq!(pressure.buckets[9].observed, Some(1.0));
        let utilization = &second.predictors[1];
        assert_eq!(utilization.buckets[7].samples, 8);
        assert!((utilization.brier.unwrap() - 0.0625).abs() < 1e-12);
        // Predicted 7 reusable blocks (28 tokens: the last block of an aligned prompt is never
        // reported), the engine reported 28: no error on the second request.
        assert_eq!(second.cached_tokens.requests, 2);
        assert_eq!(second.cached_tokens.mean_absolute_error_tokens, Some(0.0));

        // 64 new tokens through engine 0 fill its capacity: the prefix's blocks are past the
        // LRU edge, and the engine (truth) no longer holds them.
        let other: Vec<u32> = (100..164).collect();
        *oracle.0.lock().unwrap() = vec![truth(0, 0.0), truth(0, 0.0)];
        route(&mut calibrator, 2, &other, 0, "0", 0);
        assert_eq!(calibrator.admitted_tokens(0), 48 + 64);
        route(&mut calibrator, 3, &prefix, 8, "1", 0);
        let third = calibrator.finish();
        let pressure = &third.predictors[0];
        // 8 more samples (the sample of `other` matched nothing), all evicted, all predicted
        // below 0.5: the deterministic edge of block 0 is at 64 − 4 = 60 tokens of pressure.
        assert_eq!(pressure.samples, 16);
        let low: u64 = pressure.buckets[..5].iter().map(|b| b.samples).sum();
        assert_eq!(low, 8, "{pressure:?}");
        assert!(pressure.brier.unwrap() > 0.0 && pressure.brier.unwrap() < 0.25 / 2.0);
        // The capacity-bounded LRU is exactly right here, the TTL says "resident" throughout.
        assert_eq!(third.predictors[3].brier, Some(0.0));
        assert_eq!(third.predictors[2].brier, Some(0.5));
        assert_eq!(third.predictors[2].buckets[9].observed, Some(0.5));
    }

    fn leg_run(leg: &str, predictor: PredictorCalibration, pairs: u64) -> LegCalibration {
        LegCalibration {
            leg: leg.into(),
            repeat: 1,
            sample_every: 1,
            sampled_requests: 10,
            sampled_pairs: pairs,
            capacity_tokens: 64,
            ttl_s: TTL_S,
            sharpness: Some(4.0),
            edge: Some(1.0),
            recalibration: Some(Vec::new()),
            cost_us_per_request: 1.0,
            predictors: vec![predictor],
            cached_tokens: CachedTokensError::default(),
        }
    }

    #[test]
    fn pooling_runs_equals_one_table_of_all_their_samples() {
        // Two runs of one leg, with different predictions and outcomes, and a third leg.
        let (mut first, mut second, mut both) = (
            Reliability::default(),
            Reliability::default(),
            Reliability::default(),
        );
        let mut add = |table: &mut Reliability, predicted: f64, resident: bool, pair: u64| {
            table.add(predicted, resident, pair);
            both.add(predicted, resident, pair);
        };
        for sample in 0..300u64 {
            add(&mut first, 0.35, sample % 5 < 2, sample / 3);
        }
        for sample in 0..500u64 {
            let predicted = if sample % 2 == 0 { 0.32 } else { 0.91 };
            // Pair ids restart in every run: pooled pairs still add up.
            add(&mut second, predicted, sample % 4 != 0, sample / 5);
        }
        let first = first.summarize("pressure", "d");
        let second = second.summarize("pressure", "d");
        let other = Reliability::default().summarize("pressure", "d");
        let pooled = pool(&[
            leg_run("prefix+estimate", first.clone(), 100),
            leg_run("prefix+auto", other, 0),
            leg_run("prefix+estimate", second.clone(), 100),
        ]);
        assert_eq!(pooled.len(), 2);
        assert_eq!(
            (
                pooled[0].leg.as_str(),
                pooled[0].runs,
                pooled[0].sampled_pairs
            ),
            ("prefix+estimate", 2, 200)
        );
        assert_eq!((pooled[1].leg.as_str(), pooled[1].runs), ("prefix+auto", 1));
        let got = &pooled[0].predictors[0];
        let expected = both.summarize("pressure", "d");
        assert_eq!(got.samples, 800);
        assert!((got.brier.unwrap() - expected.brier.unwrap()).abs() < 1e-12);
        for (got, expected) in got.buckets.iter().zip(&expected.buckets) {
            assert_eq!(got.samples, expected.samples);
            match (got.observed, expected.observed) {
                (Some(got), Some(expected)) => assert!((got - expected).abs() < 1e-12),
                (got, expected) => assert_eq!(got, expected),
            }
        }
        // Pairs of different runs are distinct: 100 + 50 in the 0.3 bucket, so the noise
        // shrinks below either run's.
        let bucket = &got.buckets[3];
        assert_eq!(
            bucket.pairs,
            first.buckets[3].pairs + second.buckets[3].pairs
        );
        assert!(bucket.noise_95.unwrap() < first.buckets[3].noise_95.unwrap());
        let markdown = render_pooled_markdown(&pooled);
        assert!(markdown.contains("### Pooled reliability: prefix+estimate (2 runs)"));
        assert!(markdown.contains("| prefix+estimate | 2 | 20 | 200 | pressure | 800 |"));
        // Two middle buckets only: too few knots to refit.
        assert_eq!(pooled[0].refit, None);
        assert!(render_pooled_markdown(&[]).is_empty());
        assert!(render_pooled_text(&pooled).contains("prefix+estimate pooled over 2 runs"));
    }

    #[test]
    fn pooling_refits_the_map_only_over_runs_of_one_curve() {
        let mut table = Reliability::default();
        for sample in 0..2000u64 {
            let predicted = 0.15 + (sample % 7) as f64 * 0.1;
            table.add(predicted, sample % 10 < 5, sample);
        }
        let run = leg_run("prefix+estimate", table.summarize("pressure", "d"), 2000);
        let pooled = pool(&[run.clone(), run.clone()]);
        let refit = pooled[0].refit.as_ref().unwrap();
        assert_eq!(refit.len(), 7);
        // Every bucket observed about half: a map near 0.5, non-decreasing.
        assert!(
            refit.iter().all(|knot| (knot.1 - 0.5).abs() < 0.005),
            "{refit:?}"
        );
        assert!(
            refit.windows(2).all(|pair| pair[0].1 <= pair[1].1),
            "{refit:?}"
        );
        // A run with another sharpness, or one from a build that recorded no map: no refit.
        let other = LegCalibration {
            sharpness: Some(5.0),
            ..run.clone()
        };
        assert_eq!(pool(&[run.clone(), other])[0].refit, None);
        let old = LegCalibration {
            recalibration: None,
            ..run.clone()
        };
        assert_eq!(pool(&[old, run])[0].refit, None);
    }

    #[test]
    fn pooled_noise_counts_the_spread_between_runs() {
        // Three runs predicting 0.35 on 200 independent pairs each, observed 0.45, 0.25, 0.65.
        let runs: Vec<LegCalibration> = [90u64, 50, 130]
            .iter()
            .map(|&resident| {
                let mut table = Reliability::default();
                for sample in 0..200u64 {
                    table.add(0.35, sample < resident, sample);
                }
                leg_run("prefix+estimate", table.summarize("pressure", "d"), 200)
            })
            .collect();
        let pooled = pool(&runs);
        let bucket = &pooled[0].predictors[0].buckets[3];
        assert!((bucket.gap().unwrap() - 0.1).abs() < 1e-9, "{bucket:?}");
        // The pairs alone (600) would call a 0.1 gap off: 1.96·sqrt(0.35·0.65/600) ≈ 0.038.
        assert!(bucket.noise_95.unwrap() < 0.04);
        // The runs' gaps (+0.1, −0.1, +0.3) have sd 0.2: 1.96·0.2/sqrt(3) ≈ 0.226.
        let runs_noise = bucket.run_noise_95.unwrap();
        assert!(
            (runs_noise - 1.96 * 0.2 / 3f64.sqrt()).abs() < 1e-9,
            "{runs_noise}"
        );
        assert!(!bucket.beyond_noise());
        assert_eq!(pooled[0].predictors[0].buckets_beyond_noise, 0);
        assert!(render_pooled_markdown(&pooled).contains("(runs 0.226)"));
        // Two runs: no spread to measure.
        let two = pool(&runs[..2]);
        assert_eq!(two[0].predictors[0].buckets[3].run_noise_95, None);
    }

    fn bucket_at(bucket: usize, predicted: f64, observed: f64, samples: u64) -> Bucket {
        Bucket {
            lower: bucket as f64 * BUCKET_WIDTH,
            upper: (bucket + 1) as f64 * BUCKET_WIDTH,
            samples,
            pairs: samples / 10,
            mean_predicted: Some(predicted),
            observed: Some(observed),
            noise_95: None,
            run_noise_95: None,
        }
    }

    #[test]
    fn the_recalibration_refit_maps_survival_to_what_was_observed() {
        // Runs without a map: the knots are the table itself, outer buckets left out.
        let mut buckets: Vec<Bucket> = (0..BUCKETS)
            .map(|bucket| {
                let predicted = bucket as f64 * BUCKET_WIDTH + 0.05;
                bucket_at(bucket, predicted, (predicted + 0.05).min(1.0), 1000)
            })
            .collect();
        let points = recalibration_points;
        let knots = refit_recalibration(points(&buckets, &[])).unwrap();
        assert_eq!(knots.len(), 8);
        for (knot, bucket) in knots.iter().zip(&buckets[1..9]) {
            assert!((knot.0 - bucket.mean_predicted.unwrap()).abs() < 1e-12);
            assert!((knot.1 - bucket.observed.unwrap()).abs() < 1e-12);
        }
        // A run made with a map: each point sits at the survival its prediction came from,
        // and pools with a run without one in that survival's group.
        let map: &[(f64, f64)] = &[(0.5, 0.6)];
        let mapped = points(&buckets, map);
        let survival = myelin_routing::uncalibrate(map, 0.35);
        assert!((mapped[2].0 - survival).abs() < 1e-12, "{mapped:?}");
        let mut both = points(&buckets, &[]);
        both.extend(mapped);
        let knots = refit_recalibration(both).unwrap();
        assert!(
            knots.windows(2).all(|pair| pair[0].0 < pair[1].0),
            "{knots:?}"
        );
        // A dip is pooled with its neighbour (equal samples: the mean), keeping both knots.
        buckets[4].observed = Some(0.3);
        let knots = refit_recalibration(points(&buckets, &[])).unwrap();
        assert!((knots[2].1 - 0.35).abs() < 1e-12 && (knots[3].1 - 0.35).abs() < 1e-12);
        assert!(
            knots.windows(2).all(|pair| pair[0].1 <= pair[1].1),
            "{knots:?}"
        );
        // Too few buckets with enough samples: no refit.
        for bucket in &mut buckets[3..] {
            bucket.samples = 10;
        }
        assert_eq!(refit_recalibration(points(&buckets, &[])), None);
    }

    #[test]
    fn report_sections_and_the_diagram_are_written() {
        let mut table = Reliability::default();
        for sample in 0..200u32 {
            table.add(
                f64::from(sample % 10) / 10.0 + 0.05,
                sample % 3 == 0,
                sample.into(),
            );
        }
        let summary = table.summarize("pressure", "");
        let leg = LegCalibration {
            leg: "prefix+estimate".into(),
            repeat: 1,
            sample_every: 4,
            sampled_requests: 50,
            sampled_pairs: 60,
            capacity_tokens: 64,
            ttl_s: TTL_S,
            sharpness: None,
            edge: None,
            recalibration: None,
            cost_us_per_request: 3.0,
            predictors: vec![summary; PREDICTORS.len()],
            cached_tokens: CachedTokensError::default(),
        };
        let markdown = render_markdown(std::slice::from_ref(&leg), Some("reliability.png"));
        assert!(markdown.contains("| prefix+estimate | 1 | 50 | 60 | 3 | pressure | 200 |"));
        assert!(markdown.contains("![reliability diagram](reliability.png)"));
        assert!(render_markdown(&[], None).is_empty());
        let path = std::env::temp_dir().join(format!(
            "myelin-calibration-diagram-{}.png",
            std::process::id()
        ));
        reliability_diagram(&path, &[leg]).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn the_diagnostic_counts_each_block_in_flight_once() {
        let oracle = Arc::new(FakeOracle(Mutex::new(vec![truth(32, 0.0), truth(0, 0.0)])));
        let mut calibrator = calibrator(oracle);
        let prefix: Vec<u32> = (0..32).collect();
        route(&mut calibrator, 0, &prefix, 8, "0", 0);
        assert_eq!(calibrator.pinned_tokens(0), 0);
        // Two 48-token prompts in flight on engine 0, past their first token, sharing their
        // first 32 tokens: the router's load is their 16 output tokens; the engine pins
        // 32 + 16 + 16 distinct prompt tokens and the outputs.
        let first: Vec<u32> = (200..248).collect();
        let second: Vec<u32> = (200..232).chain(300..316).collect();
        let mut in_flight = Vec::new();
        for (seq, prompt) in [(1, &first), (2, &second)] {
            let mut ticket = calibrator.on_send(0, seq, prompt, 8);
            calibrator.on_head(&mut ticket, "0");
            calibrator.on_first_byte(&mut ticket);
            in_flight.push(ticket);
        }
        assert_eq!(calibrator.pinned_tokens(0), 64 + 16);
        let mut again = calibrator.on_send(0, 3, &prefix, 8);
        let sampled = calibrator.finish();
        let (pressure, pinned) = (&sampled.predictors[0], &sampled.predictors[4]);
        assert_eq!(pinned.name, "pressure_pinned_blocks");
        // 8 blocks of the second prompt (shared with the first) and the 8 of the prefix.
        assert_eq!((pressure.samples, pinned.samples), (16, 16));
        // Every block is resident (truth): the smaller room of the diagnostic predicts less.
        assert!(
            pinned.brier.unwrap() > pressure.brier.unwrap(),
            "{pinned:?} vs {pressure:?}"
        );
        calibrator.on_head(&mut again, "0");
        calibrator.on_end(again, Some(28));
        let second = in_flight.pop().unwrap();
        calibrator.on_end(second, Some(28));
        // The shared blocks stay pinned while the first prompt runs.
        assert_eq!(calibrator.pinned_tokens(0), 48 + 8);
        calibrator.on_end(in_flight.pop().unwrap(), Some(0));
        assert_eq!(calibrator.pinned_tokens(0), 0);
    }

    #[test]
    fn a_short_reuse_report_under_pressure_sets_the_watermark_and_counts_the_shortfall() {
        let oracle = Arc::new(FakeOracle(Mutex::new(vec![truth(0, 0.0), truth(0, 0.0)])));
        let mut calibrator = calibrator(oracle);
        let prefix: Vec<u32> = (0..32).collect();
        route(&mut calibrator, 0, &prefix, 0, "0", 0);
        let stamp = calibrator.admitted_tokens(0);
        let other: Vec<u32> = (100..164).collect();
        route(&mut calibrator, 1, &other, 0, "0", 0);
        assert_eq!(calibrator.evicted_below(0), 0);
        // History says 7 reusable blocks; the engine reused none, after 64 tokens of pressure
        // (at least 2 x matched tokens and a quarter of the room): an LRU eviction.
        let before = calibrator.admitted_tokens(0);
        let mut ticket = calibrator.on_send(0, 2, &prefix, 0);
        calibrator.on_head(&mut ticket, "0");
        calibrator.on_end(ticket, Some(0));
        assert_eq!(calibrator.evicted_below(0), stamp);
        // The request's own prompt counted as history had it (nothing new), then the 28
        // tokens the engine had to prefill beyond history.
        assert_eq!(calibrator.admitted_tokens(0), before + 28);
        // Unknown or out-of-range backends are ignored.
        let mut ticket = calibrator.on_send(0, 3, &prefix, 0);
        calibrator.on_head(&mut ticket, "fixture-0");
        calibrator.on_head(&mut ticket, "7");
        calibrator.on_end(ticket, Some(0));
        assert_eq!(calibrator.finish().cached_tokens.requests, 3);
    }
}
