//! Residency: how the router discounts a historical match by the chance the backend still holds
//! it. The mode selector, the estimator interface, the cache-pressure estimator (the default),
//! the placeholder estimator, and the closed loop that corrects the estimate from what engines
//! report they reused. The model is derived in docs/residency.md.

use std::fmt;
use std::str::FromStr;

use crate::backend::{BackendId, BackendView};
use crate::error::ParseNameError;
use crate::shard::BackendMatch;
use myelin_art::MatchSegment;

/// Where resident probabilities come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResidencyMode {
    /// History only: every matched block counts as resident (probability 1).
    Off,
    /// The [`ResidencyEstimator`] for every backend.
    Estimate,
    /// Only the KV-event mirror: 0/1 per block where the backend's mirror is live; a backend
    /// without a live mirror has nothing verified, so nothing counts as cached on it.
    Verified,
    /// Verified where the backend's mirror is live, the estimator elsewhere (the default).
    Auto,
}

impl ResidencyMode {
    const NAMES: &'static str = "off, estimate, verified, auto";

    /// The name `myelin serve --residency` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            ResidencyMode::Off => "off",
            ResidencyMode::Estimate => "estimate",
            ResidencyMode::Verified => "verified",
            ResidencyMode::Auto => "auto",
        }
    }
}

impl fmt::Display for ResidencyMode {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl FromStr for ResidencyMode {
    type Err = ParseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "off" => Ok(ResidencyMode::Off),
            "estimate" => Ok(ResidencyMode::Estimate),
            "verified" => Ok(ResidencyMode::Verified),
            "auto" => Ok(ResidencyMode::Auto),
            _ => Err(ParseNameError {
                kind: "residency mode",
                given: name.to_owned(),
                expected: Self::NAMES,
            }),
        }
    }
}

/// Everything an estimator may use for one backend's matched blocks.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct EstimateInput<'a> {
    /// The backend as the deciding core sees it.
    pub view: &'a BackendView,
    /// Its historical match (from the deciding core's replica).
    pub matched: &'a BackendMatch,
    /// Use records of its matched blocks (filter by `matched.backend`), shallow first.
    pub segments: &'a [MatchSegment],
    /// When the replica answered the lookup (caller's ms clock).
    pub now_ms: u64,
    /// Tokens per block.
    pub block_size: u32,
}

impl<'a> EstimateInput<'a> {
    /// An input (the router builds these; estimators' own tests may too).
    pub fn new(
        view: &'a BackendView,
        matched: &'a BackendMatch,
        segments: &'a [MatchSegment],
        now_ms: u64,
        block_size: u32,
    ) -> Self {
        Self {
            view,
            matched,
            segments,
            now_ms,
            block_size,
        }
    }
}

/// Probability that a backend still holds each block it was historically routed.
pub trait ResidencyEstimator {
    /// Writes `input.matched.matched_blocks` probabilities (block 0 first) into `probabilities`
    /// (cleared by the caller). Values outside 0..=1 are clamped, NaN counts as 0.
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>);
}

/// PLACEHOLDER estimator: says every historically matched block is still resident (1.0).
///
/// Stands in until the residency-estimate issue lands the real model (cache utilization and
/// blocks admitted since last use). With it, `estimate` behaves like `off`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlaceholderEstimator;

impl ResidencyEstimator for PlaceholderEstimator {
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>) {
        probabilities.resize(input.matched.matched_blocks as usize, 1.0);
    }
}

/// The cache-pressure estimator (the default): an LRU pool of `room` tokens, where the tokens
/// admitted to the backend since a block was last used push it towards eviction.
///
/// For block i (0-based) of a backend's match, with stamp s_i (the backend's admitted-tokens
/// counter when a prompt through that block was last routed there; see
/// [`BackendView::admitted_tokens`]):
///
/// - pressure Δ_i = admitted − s_i (tokens admitted since);
/// - room R = max(capacity − load, capacity · `min_room_fraction`, block size): what the pool
///   can hold besides the blocks pinned by running requests (the backend's load);
/// - headroom h_i = max(R − (i+1)·B, B): a freed request's blocks are evicted tail first
///   (vLLM appends them to the free queue in reverse), so block i goes once Δ_i + (i+1)·B
///   exceeds R;
/// - survival S_i = 1 / (1 + (Δ_i / (e·h_i))^k): 1 with no pressure, ½ at `edge` e of the
///   deterministic LRU edge Δ_i = h_i, the width of the step (`sharpness` k) standing for what
///   the counter does not know (cache hits of other prompts, outputs shorter than expected,
///   stale peer counts);
/// - the log-logistic S_i is then mapped through `recalibration`, a monotone piecewise-linear
///   map fitted to what the simulated engines really kept (the curve's shape is close, not
///   exact: [`DEFAULT_RECALIBRATION`]);
/// - S_i is made non-increasing in depth (a block past a missing one is unusable) and 0 for a
///   stamp below the backend's eviction watermark; the probabilities written are the
///   conditional ones, p_i = S_i / S_{i−1}, so that Π_{j≤i} p_j = S_i in
///   [`expected_cached_tokens`].
///
/// Unknown capacity: every block 1.0 (history only, like residency `off`) until the closed loop
/// learns a capacity (see [`RoomCalibration`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressureEstimator {
    /// k: how sharp the LRU edge is (larger: closer to a step at Δ = e·h).
    pub sharpness: f64,
    /// Floor of the room as a fraction of capacity (a backend whose load exceeds its cache
    /// still keeps the prefixes of what it is running).
    pub min_room_fraction: f64,
    /// e: where survival is ½, as a fraction of the headroom (what the counter misses takes
    /// room too, so the engines evict a little before the counted edge).
    pub edge: f64,
    /// (log-logistic survival, fraction really resident) knots of the map applied to the
    /// survival, increasing in both; (0, 0) and (1, 1) are implied. Empty: no map.
    pub recalibration: &'static [(f64, f64)],
}

/// Default sharpness of [`PressureEstimator`]: fitted, with [`DEFAULT_EDGE`], to the
/// simulator's truth on pooled churn runs (docs/residency.md, "Fitted sharpness and edge").
pub const DEFAULT_SHARPNESS: f64 = 5.4;
/// Default edge of [`PressureEstimator`].
pub const DEFAULT_EDGE: f64 = 0.89;
/// Default recalibration of [`PressureEstimator`]: the fraction of blocks really resident per
/// bucket of the log-logistic survival (k = 5.4, e = 0.89), pooled over 52 runs of 28 cells
/// of the regime grid (rotating, all-active, shared-system and multi-turn prompts; working sets
/// 0.5-3x the KV capacity; 30-90% load; docs/residency.md, "Recalibration map"), the two knots
/// the isotonic fit tied at 0.56 merged into one. Close to the identity: the map fitted on one
/// churn workload lifted the middle by 0.05-0.09 and was optimistic by up to 0.09 on the grid.
pub const DEFAULT_RECALIBRATION: &[(f64, f64)] = &[
    (0.1458, 0.1342),
    (0.2569, 0.2554),
    (0.3772, 0.4174),
    (0.4640, 0.5072),
    (0.6367, 0.5553),
    (0.7109, 0.7023),
    (0.8332, 0.8017),
];

/// The monotone piecewise-linear map through (0, 0), `knots` and (1, 1), at `value` (clamped
/// to 0..=1; identity without knots).
pub fn recalibrate(knots: &[(f64, f64)], value: f64) -> f64 {
    interpolate(knots, value, |&(x, y)| (x, y))
}

/// The inverse of [`recalibrate`]: the survival that `knots` map to `value` (the lowest one
/// where the map is flat).
pub fn uncalibrate(knots: &[(f64, f64)], value: f64) -> f64 {
    interpolate(knots, value, |&(x, y)| (y, x))
}

fn interpolate(knots: &[(f64, f64)], value: f64, axes: impl Fn(&(f64, f64)) -> (f64, f64)) -> f64 {
    let value = if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, 1.0)
    };
    let mut previous = (0.0, 0.0);
    for point in knots.iter().map(&axes).chain(std::iter::once((1.0, 1.0))) {
        if value <= point.0 {
            let span = point.0 - previous.0;
            if span <= 0.0 {
                return point.1;
            }
            return previous.1 + (point.1 - previous.1) * (value - previous.0) / span;
        }
        previous = point;
    }
    1.0
}

/// Default room floor of [`PressureEstimator`], as a fraction of capacity.
pub const DEFAULT_MIN_ROOM_FRACTION: f64 = 1.0 / 16.0;

impl Default for PressureEstimator {
    fn default() -> Self {
        Self {
            sharpness: DEFAULT_SHARPNESS,
            min_room_fraction: DEFAULT_MIN_ROOM_FRACTION,
            edge: DEFAULT_EDGE,
            recalibration: DEFAULT_RECALIBRATION,
        }
    }
}

/// Residency stamp of each of the first `blocks` matched blocks of `matched.backend`, from the
/// lookup's use records (a block no record covers gets the deepest use's stamp).
pub fn block_stamps(matched: &BackendMatch, segments: &[MatchSegment], out: &mut Vec<u64>) {
    let blocks = matched.matched_blocks as usize;
    out.clear();
    out.resize(blocks, matched.residency_stamp);
    for segment in segments.iter().filter(|s| s.backend == matched.backend) {
        let start = (segment.start_block as usize).min(blocks);
        let end = (segment.end_block as usize).min(blocks);
        for stamp in &mut out[start..end] {
            *stamp = segment.residency_stamp;
        }
    }
}

impl PressureEstimator {
    /// Room of the LRU pool in tokens, `None` when the capacity is unknown.
    pub fn room_tokens(&self, view: &BackendView, block_size: u32) -> Option<f64> {
        let capacity = view.capacity_tokens? as f64;
        let floor = (capacity * self.min_room_fraction).max(f64::from(block_size));
        Some((capacity - view.load_tokens as f64).max(floor))
    }

    /// Survival S of a block under `pressure` tokens with `headroom` tokens before its LRU edge.
    pub fn survival(&self, pressure: u64, headroom: f64) -> f64 {
        if pressure == 0 {
            return 1.0;
        }
        let ratio = pressure as f64 / (headroom * self.edge).max(1.0);
        let survival = 1.0 / (1.0 + ratio.powf(self.sharpness));
        if survival.is_nan() {
            0.0
        } else {
            recalibrate(self.recalibration, survival)
        }
    }

    /// Marginal survival S_i of every block given its stamp (non-increasing in depth).
    pub fn survivals(
        &self,
        view: &BackendView,
        block_size: u32,
        stamps: &[u64],
        out: &mut Vec<f64>,
    ) {
        out.clear();
        let Some(room) = self.room_tokens(view, block_size) else {
            out.resize(stamps.len(), 1.0);
            return;
        };
        let block = f64::from(block_size);
        let mut previous = 1.0f64;
        for (depth, &stamp) in stamps.iter().enumerate() {
            let survival = if stamp < view.evicted_below_stamp {
                0.0
            } else {
                let pressure = view.admitted_tokens.saturating_sub(stamp);
                let headroom = (room - (depth as f64 + 1.0) * block).max(block);
                self.survival(pressure, headroom)
            };
            previous = previous.min(survival);
            out.push(previous);
        }
    }
}

impl ResidencyEstimator for PressureEstimator {
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>) {
        let mut stamps = Vec::new();
        block_stamps(input.matched, input.segments, &mut stamps);
        let mut survivals = Vec::new();
        self.survivals(input.view, input.block_size, &stamps, &mut survivals);
        let mut previous = 1.0f64;
        for survival in survivals {
            probabilities.push(if previous > 0.0 {
                (survival / previous).clamp(0.0, 1.0)
            } else {
                0.0
            });
            previous = survival;
        }
    }
}

/// What one engine's reuse report (`usage.prompt_tokens_details.cached_tokens`) says, set
/// against the history the router routed on. See [`observe_reuse`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReuseObservation {
    /// Blocks the engine reused (reported cached tokens / block size).
    pub reported_blocks: u32,
    /// Blocks history said it held.
    pub matched_blocks: u32,
    /// The room was at least this (the deepest reused block survived its pressure).
    pub room_at_least: Option<f64>,
    /// The room was less than this (the first block not reused was evicted by its pressure).
    pub room_below: Option<f64>,
    /// Stamp of the first historical block not reused: under LRU every use stamped below it
    /// on this backend is gone too.
    pub evicted_stamp: Option<u64>,
}

/// The estimator's view of a routed request, kept until its engine reports its reuse: the
/// chosen backend's stamps per matched block and its counters at decision time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReuseProbe {
    pub block_size: u32,
    /// Stamp per historically matched block (block 0 first).
    pub stamps: Vec<u64>,
    /// The backend's admitted-tokens counter at decision time.
    pub admitted_tokens: u64,
    /// The backend's load at decision time, in tokens.
    pub load_tokens: u64,
    /// Cached tokens the router expected.
    pub predicted_cached_tokens: f64,
    /// The estimator's room for the backend at decision time (`None`: capacity unknown).
    pub room_tokens: Option<f64>,
    /// The prompt's length in tokens (0: unknown). An engine computes at least a prompt's last
    /// token, so it never reports the last block of a block-aligned prompt as reused (vLLM
    /// looks for hits in the first `prompt − 1` tokens).
    pub prompt_tokens: u64,
}

impl ReuseProbe {
    /// Matched blocks an engine could have reported reused: history's, capped at the blocks
    /// within the prompt's first `prompt − 1` tokens.
    pub fn reusable_blocks(&self) -> u32 {
        let matched = u32::try_from(self.stamps.len()).unwrap_or(u32::MAX);
        if self.prompt_tokens == 0 {
            return matched;
        }
        let block = u64::from(self.block_size.max(1));
        let within = (self.prompt_tokens - 1) / block;
        matched.min(u32::try_from(within).unwrap_or(u32::MAX))
    }
}

/// A block missing under less pressure than this fraction of the room is not taken for LRU
/// eviction (see [`observe_reuse`]).
pub const MISS_MIN_ROOM_FRACTION: f64 = 0.25;

/// Sets a reuse report against the probe: reported blocks k vs matched m. Blocks are counted
/// whole (engines reuse whole blocks; vLLM recomputes a fully cached prompt's last token, so a
/// report one token short of a block boundary still counts that block).
///
/// A missing block k counts as evicted (an upper bound on the room, and its stamp the
/// backend's eviction watermark) only when the pressure since its use is at least
/// [`MISS_MIN_ROOM_FRACTION`] of the room and twice the matched tokens: a block missing sooner
/// was not pushed out by LRU pressure (its first prefill still in flight when a sibling
/// arrived, a preemption, a restart) and says nothing about the room.
pub fn observe_reuse(probe: &ReuseProbe, reported_cached_tokens: u64) -> ReuseObservation {
    let block = u64::from(probe.block_size.max(1));
    let matched_blocks = probe.reusable_blocks();
    let reported_blocks =
        u32::try_from(reported_cached_tokens.saturating_add(1) / block).unwrap_or(u32::MAX);
    let mut observation = ReuseObservation {
        reported_blocks,
        matched_blocks,
        ..ReuseObservation::default()
    };
    let pressure = |depth: usize| probe.admitted_tokens.saturating_sub(probe.stamps[depth]);
    let edge = |depth: usize| pressure(depth) as f64 + (depth as f64 + 1.0) * block as f64;
    let reused = (reported_blocks.min(matched_blocks)) as usize;
    if reused > 0 && pressure(reused - 1) > 0 {
        observation.room_at_least = Some(edge(reused - 1));
    }
    let min_pressure = (probe.room_tokens.unwrap_or(0.0) * MISS_MIN_ROOM_FRACTION)
        .max(2.0 * f64::from(matched_blocks) * block as f64);
    if reused < matched_blocks as usize && pressure(reused) as f64 >= min_pressure {
        observation.room_below = Some(edge(reused));
        observation.evicted_stamp = Some(probe.stamps[reused]);
    }
    observation
}

/// Online correction of one backend's capacity from reuse reports: the engine's capacity
/// (scraped or configured) times a scale, moved towards the room each report implies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoomCalibration {
    /// Capacity the engine reports or was configured with; learned from the first miss when
    /// neither is known.
    base: Option<u64>,
    /// Whether `base` was learned (not scraped or configured).
    learned: bool,
    scale: f64,
    observations: u64,
    corrections: u64,
}

/// Share of the gap to the implied room closed per report.
pub const CALIBRATION_RATE: f64 = 0.1;
/// Bounds of the capacity correction.
pub const CALIBRATION_SCALE_BOUNDS: (f64, f64) = (0.125, 4.0);

impl Default for RoomCalibration {
    fn default() -> Self {
        Self {
            base: None,
            learned: false,
            scale: 1.0,
            observations: 0,
            corrections: 0,
        }
    }
}

impl RoomCalibration {
    /// Sets the engine's capacity (scraped or configured). A changed capacity (engine
    /// restarted with another cache) resets the correction.
    pub fn set_capacity(&mut self, capacity: Option<u64>) {
        let capacity = capacity.filter(|&tokens| tokens > 0);
        if capacity.is_none() && self.learned {
            return;
        }
        if capacity != self.base || self.learned {
            *self = Self {
                base: capacity,
                ..Self::default()
            };
        }
    }

    /// Capacity the estimator should use: base × correction, `None` while unknown.
    pub fn effective_capacity(&self) -> Option<u64> {
        self.base
            .map(|base| (base as f64 * self.scale).round().max(1.0) as u64)
    }

    /// The multiplicative correction (1.0: none).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Whether the capacity was learned from reports (none scraped or configured).
    pub fn learned(&self) -> bool {
        self.learned
    }

    /// Reports seen and reports that moved the correction.
    pub fn counts(&self) -> (u64, u64) {
        (self.observations, self.corrections)
    }

    /// Moves the correction towards the room `observation` implies, given the load the
    /// backend had when the request was routed (`estimator` maps capacity to room).
    pub fn observe(
        &mut self,
        estimator: &PressureEstimator,
        observation: &ReuseObservation,
        load_tokens: u64,
        block_size: u32,
    ) {
        self.observations += 1;
        let Some(capacity) = self.effective_capacity() else {
            // Unknown capacity: the first eviction seen bounds it.
            if let Some(below) = observation.room_below {
                self.base = Some((below + load_tokens as f64).round().max(1.0) as u64);
                self.learned = true;
                self.corrections += 1;
            }
            return;
        };
        let view = BackendView::new(BackendId(0), crate::BackendState::Up, load_tokens).with_cache(
            Some(capacity),
            0,
            0,
        );
        let Some(room) = estimator.room_tokens(&view, block_size) else {
            return;
        };
        let target = match (observation.room_at_least, observation.room_below) {
            (Some(low), _) if room < low => low,
            (_, Some(high)) if room >= high => high,
            _ => return,
        };
        let factor = (target / room).powf(CALIBRATION_RATE);
        let (low, high) = CALIBRATION_SCALE_BOUNDS;
        self.scale = (self.scale * factor).clamp(low, high);
        self.corrections += 1;
    }
}

/// Expected cached tokens of a prefix: Σ_i block_size · Π_{j≤i} p_j (block i is only usable
/// if every block before it is resident too: engines match prefixes, not sets of blocks).
pub fn expected_cached_tokens(block_size: u32, probabilities: &[f64]) -> f64 {
    let mut all_resident_so_far = 1.0f64;
    let mut expected = 0.0f64;
    for &probability in probabilities {
        let probability = if probability.is_nan() {
            0.0
        } else {
            probability.clamp(0.0, 1.0)
        };
        all_resident_so_far *= probability;
        if all_resident_so_far == 0.0 {
            break;
        }
        expected += f64::from(block_size) * all_resident_so_far;
    }
    expected
}
