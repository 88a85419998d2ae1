//! The server's side of the sans-IO routing core (`myelin-routing`): one data core's replica of
//! the routing state and its router, and the load view it scores with.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use myelin_routing::BlockCounts;
use myelin_routing::{
    BackendView, BlockChain, EngineQueue, EngineTiming, KvMemory, MemoryPressure, PredictionError,
    PrefixMatch, ResidencyMode, ReuseObservation, ReuseProbe, RoomCalibration, Router,
    RouterConfig, Shard, ShardConfig, TimingFit, TtftPrediction, WriteOp,
};

use crate::backends::{BackendId, BackendInfo, BackendState, Load};
use crate::config::ServeConfig;
use crate::engine_metrics::ScrapedMemory;

/// A prompt's block chain, hashed once per request (shared with the learn broadcast).
#[derive(Debug, Clone)]
pub struct LookupQuery {
    pub chain: Arc<BlockChain>,
}

/// Every backend's match for a prompt.
pub type LookupAnswer = PrefixMatch;

/// Deepest match of any backend in an answer, in blocks (history or verified mirror).
pub fn deepest_match(answer: &LookupAnswer) -> u32 {
    answer
        .backends
        .iter()
        .map(|entry| {
            entry
                .matched_blocks
                .max(entry.verified_resident_blocks.unwrap_or(0))
        })
        .max()
        .unwrap_or(0)
}

/// The decision for one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteChoice {
    pub backend: BackendId,
    pub matched_blocks: u32,
    /// Prompt tokens the chosen backend is expected to serve from its cache.
    pub expected_cached_tokens: u64,
    pub residency_downgrade: bool,
    /// The engine with the prefix had its KV memory full: this one becomes a second home.
    pub prefix_replication: bool,
    /// The predicted time to first token there, as the cost priced it.
    pub predicted_ttft: TtftPrediction,
    /// Prompt tokens the history matched over every eligible backend, and those of them the
    /// residency mode found evicted (whole tokens; see `Router::evicted_share`).
    pub history_matched_tokens: u64,
    pub history_evicted_tokens: u64,
}

/// Candidates a decision trace lists, at most (a response header stays a few KiB).
pub const MAX_TRACED_CANDIDATES: usize = 32;

/// A backend's predicted-TTFT figures on one core (admin API).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingFigures {
    /// The timing this core prices the backend with now.
    pub timing: EngineTiming,
    /// First tokens the fit learned from.
    pub observations: u64,
    /// The error of this core's predictions for the backend.
    pub error: PredictionError,
}

struct ShardBackend {
    state: BackendState,
    load_by_core: Vec<Load>,
    /// KV capacity from the backend spec (`capacity-tokens=`).
    configured_capacity: Option<u64>,
    /// KV capacity the engine's metrics report (control core's scrape), which wins.
    scraped_capacity: Option<u64>,
    /// This core's correction of the capacity from the engine's reuse reports.
    calibration: RoomCalibration,
    /// The engine's KV utilization and queue at the last scrape that read them, and when it
    /// came in.
    scraped_memory: Option<(ScrapedMemory, Instant)>,
    /// This core's fit of the engine's timing from the first tokens of its own requests.
    timing: TimingFit,
    /// KV tokens the engine held at its last scrape beyond what the routers' requests in flight
    /// there held then: other frontends' requests (0 when the routers account for it all).
    other_held_tokens: f64,
}

impl ShardBackend {
    /// Its load summed over the cores (and the peer slot), as this core last heard.
    fn total_load(&self) -> Load {
        let mut total = Load::default();
        for load in &self.load_by_core {
            total.add(load);
        }
        total
    }

    /// The engine's last scraped KV figures, when they are at most `max_age` old at `now`.
    fn fresh_scrape(&self, now: Instant, max_age: Duration) -> Option<ScrapedMemory> {
        self.scraped_memory
            .filter(|(_, at)| now.saturating_duration_since(*at) <= max_age)
            .map(|(memory, _)| memory)
    }
}

/// A backend's residency-estimate figures on one core (admin API).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheFigures {
    /// Capacity the estimator uses (after correction), tokens; `None`: unknown.
    pub effective_capacity_tokens: Option<u64>,
    /// The correction factor (1.0: none).
    pub correction: f64,
    /// Whether the capacity was learned from reuse reports.
    pub learned: bool,
    /// Reuse reports seen and those that moved the correction.
    pub reports: u64,
    pub corrections: u64,
    /// Tokens admitted to the backend, summed over cores as this core last heard.
    pub admitted_tokens: u64,
    /// Routes stamped below this are known evicted (this node's and its peers' reuse reports).
    pub evicted_below: u64,
}

/// One data core's routing state: its replica of the prefix tree and mirror, its router
/// (scoring and the round-robin cursor), and its view of every backend's state and load.
pub struct RoutingShard {
    shards: usize,
    shard: Shard,
    router: Router,
    residency: ResidencyMode,
    backends: BTreeMap<BackendId, ShardBackend>,
    views: Vec<BackendView>,
    clock_origin: Instant,
    /// Scraped KV figures older than this are not trusted (three scrape intervals).
    memory_max_age: Duration,
    /// The timing the pooled fit starts from.
    default_timing: EngineTiming,
    /// The fit of every backend's first tokens together: the prior of each backend's own fit.
    pooled_timing: TimingFit,
}

impl RoutingShard {
    /// `clock_origin` is shared by every core: learned routes carry times on that clock.
    pub fn new(
        config: &ServeConfig,
        shards: usize,
        clock_origin: Instant,
    ) -> Result<RoutingShard, myelin_routing::RoutingError> {
        let shard = Shard::new(ShardConfig {
            block_size: u32::try_from(config.block_size).unwrap_or(u32::MAX),
            ..ShardConfig::default()
        })?;
        let default_timing = EngineTiming {
            step_tokens: config.engine_step_tokens,
            ..EngineTiming::default()
        };
        Ok(RoutingShard {
            shards,
            shard,
            router: Router::new(
                config.routing,
                config.residency,
                RouterConfig {
                    cost: config.cost,
                    load_bound_tokens: config.load_bound_tokens,
                    decode_step_tokens: config.decode_step_tokens,
                    pending_resident_ms: config.pending_resident_ms,
                    max_prefix_homes: config.max_prefix_homes,
                    extra_prefill_percent: config.extra_prefill_percent,
                    extra_prefill_ramp_percent: config.extra_prefill_ramp_percent,
                },
            ),
            residency: config.residency,
            backends: BTreeMap::new(),
            views: Vec::new(),
            clock_origin,
            memory_max_age: config.engine_metrics_interval * 3,
            default_timing,
            pooled_timing: TimingFit::new(default_timing),
        })
    }

    /// Milliseconds since the server started (same origin on every core): the routing clock.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Hashes the prompt once (in the plain cache namespace).
    #[cfg(test)]
    pub fn query(&self, tokens: &[u32]) -> LookupQuery {
        self.query_in(myelin_routing::ROOT_CHAIN_HASH, tokens)
    }

    /// Hashes the prompt once, from its cache namespace's root ([`myelin_routing::namespace_root`]).
    pub fn query_in(&self, root: u64, tokens: &[u32]) -> LookupQuery {
        LookupQuery {
            chain: Arc::new(self.shard.chain_in(root, tokens)),
        }
    }

    /// Every backend's match for a prompt, from this core's replica.
    pub fn lookup(&self, query: &LookupQuery) -> LookupAnswer {
        // Every core hashes with the same block size, so the chain always fits.
        self.shard
            .lookup_chain(&query.chain, self.now_ms())
            .unwrap_or_default()
    }

    /// Records here that a prompt was routed to `backend`; returns the write for the other
    /// cores' replicas.
    /// The use is stamped with the backend's admitted-tokens counter (over every core, this
    /// request included): the residency estimate measures age as tokens admitted since.
    pub fn learn(&mut self, query: &LookupQuery, backend: BackendId) -> WriteOp {
        let op = WriteOp::Learn {
            chain: query.chain.clone(),
            backend,
            at_ms: self.now_ms(),
            residency_stamp: self.admitted_tokens(backend),
        };
        self.apply(&op);
        op
    }

    /// Records a route another cluster node learned (gossip), as history at this core's
    /// clock with that node's residency stamp.
    pub fn learn_peer(&mut self, chain: Arc<BlockChain>, backend: BackendId, stamp: u64) {
        let op = WriteOp::Learn {
            chain,
            backend,
            at_ms: self.now_ms(),
            residency_stamp: stamp,
        };
        self.apply(&op);
    }

    /// Applies a write to this replica. Writes about a backend this core no longer has (still
    /// in flight when it was removed) are dropped with it.
    pub fn apply(&mut self, op: &WriteOp) {
        let backend = match op {
            WriteOp::Learn { backend, .. }
            | WriteOp::Mirror { backend, .. }
            | WriteOp::MirrorLive { backend, .. }
            | WriteOp::Evicted { backend, .. } => *backend,
        };
        if self.backends.contains_key(&backend) {
            self.shard.apply(op);
        }
    }

    /// A mirror write to this replica was lost: every backend's mirror is not routed on until
    /// it is cleared and rebuilt (the snapshots of a mirror resync begin with a clear).
    pub fn distrust_mirrors(&mut self) {
        for &id in self.backends.keys() {
            self.shard.mark_mirror_untrusted(id);
        }
    }

    pub fn add_backend(&mut self, info: &BackendInfo) {
        let shards = self.shards;
        let entry = self
            .backends
            .entry(info.id)
            .or_insert_with(|| ShardBackend {
                state: info.state,
                // One slot per data core, and the last for the other cluster nodes (gossip).
                load_by_core: vec![Load::default(); shards + 1],
                configured_capacity: None,
                scraped_capacity: None,
                calibration: RoomCalibration::default(),
                scraped_memory: None,
                timing: TimingFit::new(self.pooled_timing.timing()),
                other_held_tokens: 0.0,
            });
        entry.state = info.state;
        entry.configured_capacity = info.spec.capacity_tokens;
        entry
            .calibration
            .set_capacity(entry.scraped_capacity.or(entry.configured_capacity));
    }

    /// The KV capacity the engine's metrics report (`None`: no figure, the configured one
    /// applies).
    pub fn set_scraped_capacity(&mut self, id: BackendId, capacity: Option<u64>) {
        if let Some(entry) = self.backends.get_mut(&id) {
            entry.scraped_capacity = capacity;
            entry
                .calibration
                .set_capacity(capacity.or(entry.configured_capacity));
        }
    }

    /// The engine's KV utilization and queue, read by the control core at about `at`.
    pub fn set_scraped_memory(&mut self, id: BackendId, memory: ScrapedMemory, at: Instant) {
        let now_ms = self.now_ms();
        if let Some(entry) = self.backends.get_mut(&id) {
            entry.scraped_memory = Some((memory, at));
            // What the engine holds beyond the routers' own requests, as of the scrape. The
            // routers' part is counted live at each decision, so a scrape taken while the
            // engine was full does not make it look full after its requests finished.
            let capacity = entry.scraped_capacity.or(entry.configured_capacity);
            let total = entry.total_load();
            let progress = decode_progress(&total, &entry.timing.timing(), now_ms);
            let routed = total.pinned_prompt_tokens as f64 + progress.written;
            entry.other_held_tokens = capacity.map_or(0.0, |capacity| {
                let per_request = if total.requests > 0 {
                    routed / f64::from(total.requests)
                } else {
                    0.0
                };
                let reported = memory.utilization.clamp(0.0, 1.0) * capacity as f64
                    + f64::from(memory.waiting) * per_request;
                (reported - routed).max(0.0)
            });
        }
    }

    /// Tokens admitted to `id` over every core, as this core last heard (the stamps' clock).
    fn admitted_tokens(&self, id: BackendId) -> u64 {
        self.backends.get(&id).map_or(0, |entry| {
            entry
                .load_by_core
                .iter()
                .map(|load| load.admitted_tokens)
                .sum()
        })
    }

    /// Whether scoring `id` uses the estimator alone (residency `estimate`, or `auto` without
    /// a live KV-event mirror; under a partial mirror the expected cache mixes the mirror's
    /// blocks in, so its answers do not calibrate the estimator).
    fn estimates(&self, id: BackendId) -> bool {
        match self.residency {
            ResidencyMode::Estimate => true,
            ResidencyMode::Auto => !self.shard.mirror_live(id),
            ResidencyMode::Off | ResidencyMode::Verified => false,
        }
    }

    /// What the estimator saw of `choice`'s backend, kept until the engine reports its reuse
    /// (`None` when that backend is not estimated).
    pub fn probe(
        &self,
        answer: &LookupAnswer,
        choice: &RouteChoice,
        prompt_tokens: u64,
    ) -> Option<ReuseProbe> {
        let id = choice.backend;
        if !self.estimates(id) {
            return None;
        }
        let entry = self.backends.get(&id)?;
        let load_tokens = entry.load_by_core.iter().map(|load| load.tokens).sum();
        let view = BackendView::new(id, myelin_routing::BackendState::Up, load_tokens).with_cache(
            entry.calibration.effective_capacity(),
            0,
            0,
        );
        let block_size = answer.block_size.max(1);
        let room_tokens = self.router.estimator().room_tokens(&view, block_size);
        let mut stamps = Vec::new();
        if let Some(matched) = answer.backend(id) {
            myelin_routing::block_stamps(matched, &answer.segments, &mut stamps);
        }
        Some(ReuseProbe {
            block_size,
            stamps,
            admitted_tokens: self.admitted_tokens(id),
            load_tokens,
            predicted_cached_tokens: choice.expected_cached_tokens as f64,
            room_tokens,
            prompt_tokens,
        })
    }

    /// The engine reported reusing `reported_cached_tokens` of a prompt routed with `probe`:
    /// corrects this core's capacity estimate, and returns the eviction write for every
    /// replica (applied here) when the engine held less than history said.
    pub fn observe_reuse(
        &mut self,
        id: BackendId,
        probe: &ReuseProbe,
        reported_cached_tokens: u64,
    ) -> (ReuseObservation, Option<WriteOp>) {
        let observation = myelin_routing::observe_reuse(probe, reported_cached_tokens);
        let estimator = *self.router.estimator();
        if let Some(entry) = self.backends.get_mut(&id) {
            entry.calibration.observe(
                &estimator,
                &observation,
                probe.load_tokens,
                probe.block_size,
            );
        }
        let write = observation
            .evicted_stamp
            .map(|stamp| WriteOp::Evicted { backend: id, stamp });
        if let Some(write) = &write {
            self.apply(write);
        }
        (observation, write)
    }

    /// A backend's residency-estimate figures on this core.
    pub fn cache_figures(&self, id: BackendId) -> CacheFigures {
        let Some(entry) = self.backends.get(&id) else {
            return CacheFigures::default();
        };
        let (reports, corrections) = entry.calibration.counts();
        CacheFigures {
            effective_capacity_tokens: entry.calibration.effective_capacity(),
            correction: entry.calibration.scale(),
            learned: entry.calibration.learned(),
            reports,
            corrections,
            admitted_tokens: self.admitted_tokens(id),
            evicted_below: self.shard.evicted_below(id),
        }
    }

    pub fn remove_backend(&mut self, id: BackendId) {
        self.backends.remove(&id);
        self.shard.remove_backend(id);
    }

    pub fn set_state(&mut self, id: BackendId, state: BackendState) {
        if let Some(entry) = self.backends.get_mut(&id) {
            entry.state = state;
        }
    }

    /// Records the load `core` puts on a backend (absolute).
    pub fn set_load(&mut self, id: BackendId, core: usize, load: Load) {
        if let Some(slot) = self
            .backends
            .get_mut(&id)
            .and_then(|entry| entry.load_by_core.get_mut(core))
        {
            *slot = load;
        }
    }

    /// The prefix tree's blocks per backend in arena slots `from..from + slots`, added to
    /// `counts`; the next slice's start, `None` past the end.
    pub fn count_routed_blocks(
        &self,
        from: usize,
        slots: usize,
        counts: &mut Vec<(myelin_routing::BackendId, usize)>,
    ) -> Option<usize> {
        self.shard.count_routed_blocks(from, slots, counts)
    }

    /// The verified mirror's blocks per backend (kept as events arrive: O(backends)).
    pub fn mirrored_blocks(&self) -> Vec<(myelin_routing::BackendId, usize)> {
        self.shard.mirrored_blocks_by_backend()
    }

    /// Residency in effect for a backend (admin API).
    pub fn residency_of(&self, id: BackendId) -> &'static str {
        let live = self.shard.mirror_live(id);
        let partial = self.shard.mirror_partial(id);
        match self.residency {
            ResidencyMode::Auto if partial => "partial",
            ResidencyMode::Auto if live => "verified",
            ResidencyMode::Auto => "estimate",
            mode => mode.as_str(),
        }
    }

    /// Scores the up backends not in `excluded` (already tried for this request). `shared`:
    /// per backend, the tokens of this prompt that requests in flight there already hold
    /// (their blocks need no new KV memory), from the pinned blocks.
    pub fn decide(
        &mut self,
        answer: &LookupAnswer,
        prompt_tokens: usize,
        excluded: &[BackendId],
        shared: &[(BackendId, u64)],
    ) -> Option<RouteChoice> {
        let mut views = std::mem::take(&mut self.views);
        views.clear();
        self.fill_views(&mut views, excluded, shared);
        let decision = self.router.decide(prompt_tokens as u64, answer, &views);
        self.views = views;
        let decision = decision.ok()?;
        Some(RouteChoice {
            backend: decision.backend,
            matched_blocks: decision.matched_blocks,
            // Whole tokens: the expectation is a sum of block sizes weighted by probabilities.
            expected_cached_tokens: decision.expected_cached_tokens.max(0.0).round() as u64,
            residency_downgrade: decision.residency_downgrade,
            prefix_replication: decision.prefix_replication,
            predicted_ttft: decision.predicted_ttft,
            history_matched_tokens: decision.history_matched_tokens.max(0.0).round() as u64,
            history_evicted_tokens: decision.history_evicted_tokens.max(0.0).round() as u64,
        })
    }

    /// Every backend as the router sees it now: its state (down when `excluded`), load, cache,
    /// KV memory and predicted-TTFT inputs.
    fn fill_views(
        &self,
        views: &mut Vec<BackendView>,
        excluded: &[BackendId],
        shared: &[(BackendId, u64)],
    ) {
        let shard = &self.shard;
        let now = Instant::now();
        let now_ms = self.now_ms();
        let max_age = self.memory_max_age;
        views.extend(self.backends.iter().map(|(&id, backend)| {
            let state = if excluded.contains(&id) {
                BackendState::Down
            } else {
                backend.state
            };
            let total = backend.total_load();
            let shared_tokens = shared
                .iter()
                .find(|(backend, _)| *backend == id)
                .map_or(0, |&(_, tokens)| tokens);
            let scrape = backend.fresh_scrape(now, max_age);
            let memory = memory_pressure(backend, &total, scrape);
            let timing = backend.timing.timing();
            let mut queue = engine_queue(
                backend,
                &total,
                scrape.is_some(),
                shared_tokens,
                &timing,
                now_ms,
            );
            deduct_prefill_progress(&mut queue, &timing, &total, now_ms);
            BackendView::new(id, state, total.tokens)
                .with_cache(
                    backend.calibration.effective_capacity(),
                    total.admitted_tokens,
                    shard.evicted_below(id),
                )
                .with_memory(memory)
                .with_ttft(timing, queue)
                .with_prefilling_since(
                    (total.prefilling_since_ms > 0).then_some(total.prefilling_since_ms),
                )
        }));
    }

    /// What [`RoutingShard::decide`] would choose for this prompt now, and its evidence (the
    /// decision trace's JSON), without deciding: nothing of this shard changes (the router's
    /// cursor and decayed sums stay as they were; nothing is learned, pinned or counted).
    pub fn explain(
        &self,
        answer: &LookupAnswer,
        prompt_tokens: usize,
        excluded: &[BackendId],
        shared: &[(BackendId, u64)],
    ) -> serde_json::Value {
        let mut views = Vec::with_capacity(self.backends.len());
        self.fill_views(&mut views, excluded, shared);
        let mut router = self.router.clone();
        let chosen = router
            .decide(prompt_tokens as u64, answer, &views)
            .ok()
            .map(|decision| decision.backend);
        trace_json(&router, chosen)
    }

    /// The last decision's evidence as compact JSON (the `x-myelin-decision` header): the
    /// policy, the cost's unit, the chosen backend and, per candidate (eligible backend, by id;
    /// at most [`MAX_TRACED_CANDIDATES`]), its matched blocks, expected cached tokens, load,
    /// predicted TTFT, expected KV-memory wait and cost. Backends by id, never by address.
    pub fn decision_trace(&self, chosen: Option<BackendId>) -> String {
        trace_json(&self.router, chosen).to_string()
    }

    /// A request routed to `id` with `prediction` had its first token `observed_s` seconds
    /// after it was sent: this core's fit of the engine's timing learns from it. Returns the
    /// prediction's error (predicted − observed), or `None` when the backend is gone.
    pub fn observe_ttft(
        &mut self,
        id: BackendId,
        prediction: &TtftPrediction,
        observed_s: f64,
    ) -> Option<f64> {
        let entry = self.backends.get_mut(&id)?;
        entry.timing.observe(prediction, observed_s);
        self.pooled_timing.observe(prediction, observed_s);
        self.pooled_timing.refit(&self.default_timing);
        // Every backend's fit is shrunk towards the pool: one with few first tokens of its
        // own follows what the others taught.
        let pooled = self.pooled_timing.timing();
        for backend in self.backends.values_mut() {
            backend.timing.refit(&pooled);
        }
        Some(prediction.seconds - observed_s)
    }

    /// A backend's predicted-TTFT figures on this core.
    pub fn timing_figures(&self, id: BackendId) -> Option<TimingFigures> {
        let entry = self.backends.get(&id)?;
        Some(TimingFigures {
            timing: entry.timing.timing(),
            observations: entry.timing.observations(),
            error: entry.timing.error(),
        })
    }
}

/// What is in front of a new request on a backend, for the predicted time to first token:
/// the prefill of the routers' requests there that have not had their first token, those
/// decoding, and its KV memory when its capacity is known. Held memory is the routers' own
/// count, live (the distinct prompt blocks of their requests in flight plus the output they
/// wrote so far, [`decode_progress`]), plus, while the engine's last scrape is fresh, what it
/// held then beyond the routers' requests (other frontends' requests); the rest of the output
/// they expect is what their KV memory will still grow by.
fn engine_queue(
    backend: &ShardBackend,
    total: &Load,
    fresh_scrape: bool,
    shared_tokens: u64,
    timing: &EngineTiming,
    now_ms: u64,
) -> EngineQueue {
    let decoding = total.requests.saturating_sub(total.prefilling);
    let progress = decode_progress(total, timing, now_ms);
    let capacity = backend.scraped_capacity.or(backend.configured_capacity);
    let kv = capacity.filter(|&capacity| capacity > 0).map(|capacity| {
        let others = if fresh_scrape {
            backend.other_held_tokens
        } else {
            0.0
        };
        KvMemory {
            capacity_tokens: capacity,
            held_tokens: total.pinned_prompt_tokens as f64 + progress.written + others,
            shared_tokens,
            growth_tokens: (total.decode_tokens as f64 - progress.written).max(0.0),
        }
    });
    EngineQueue {
        prefill_tokens_ahead: total.tokens.saturating_sub(total.decode_tokens),
        prefill_pairs_ahead: total.prefill_pairs as f64,
        requests: total.requests,
        decoding,
        mean_remaining_output_tokens: progress.remaining,
        waiting_output_tokens: progress.waiting_output,
        memory: kv,
    }
}

/// How far the routers' requests in flight on a backend are through their output.
struct DecodeProgress {
    /// Output tokens they wrote so far, together.
    written: f64,
    /// Output a decoding one still owes, on average (any request in flight, when
    /// `waiting_output` is `None`).
    remaining: f64,
    /// Output one without its first token will write (its whole expected output), on average;
    /// `None` when how far the decoding ones are is unknown.
    waiting_output: Option<f64>,
}

/// How far the routers' requests in flight on a backend are through their output. Each
/// expects the backend's average (`decode_tokens / requests`); the decoding ones this node saw
/// start wrote one token per step since their first token, on average
/// [`Load::mean_decode_age_s`] ago, at most all of it. Without any (only a peer's requests
/// decoding, or none), each request in flight is taken to be halfway through.
fn decode_progress(total: &Load, timing: &EngineTiming, now_ms: u64) -> DecodeProgress {
    let age_s = total
        .mean_decode_age_s(now_ms)
        .filter(|_| total.requests > 0);
    let Some(age_s) = age_s else {
        return DecodeProgress {
            written: total.decode_tokens as f64 / 2.0,
            remaining: mean_remaining_output(total),
            waiting_output: None,
        };
    };
    let decoding = total.requests.saturating_sub(total.prefilling);
    let expected = total.decode_tokens as f64 / f64::from(total.requests);
    let step_s = timing.step_seconds(decoding).max(1e-6);
    let done = (age_s / step_s).min(expected);
    let started = f64::from(total.decode_started.min(decoding));
    DecodeProgress {
        written: started * done,
        remaining: (expected - done).max(1.0),
        waiting_output: Some(expected.max(1.0)),
    }
}

/// The least share of the prefill ahead taken to remain while none of it has had its first
/// token: past its predicted time the queue ahead is late, not done.
const MIN_PREFILL_AHEAD_LEFT: f64 = 0.1;

/// Takes off the prefill ahead what the engine has done of it since the head of its queue
/// began ([`Load::prefill_clock_ms`]): at the engine's `timing`, the seconds since then are
/// that share of the seconds the queue ahead takes. The tokens and pairs ahead shrink by the
/// share (at most to [`MIN_PREFILL_AHEAD_LEFT`] of them). Without it a request ahead counts in
/// full until its first token, and an engine half through a long prompt looked as busy as
/// one that just took it.
fn deduct_prefill_progress(
    queue: &mut EngineQueue,
    timing: &EngineTiming,
    total: &Load,
    now_ms: u64,
) {
    if total.prefilling == 0 || queue.prefill_tokens_ahead == 0 {
        return;
    }
    let elapsed = now_ms.saturating_sub(total.prefill_clock_ms) as f64 / 1000.0;
    let alone = EngineQueue {
        memory: None,
        ..*queue
    };
    let idle = EngineQueue {
        prefill_tokens_ahead: 0,
        prefill_pairs_ahead: 0.0,
        ..alone
    };
    let ahead_seconds = myelin_routing::predict_ttft(timing, &alone, 0, 0.0).seconds
        - myelin_routing::predict_ttft(timing, &idle, 0, 0.0).seconds;
    if ahead_seconds.is_nan() || ahead_seconds <= 0.0 {
        return;
    }
    let left = (1.0 - elapsed / ahead_seconds).clamp(MIN_PREFILL_AHEAD_LEFT, 1.0);
    queue.prefill_tokens_ahead = (queue.prefill_tokens_ahead as f64 * left).round() as u64;
    queue.prefill_pairs_ahead *= left;
}

/// KV tokens the routers' requests in flight hold on a backend: their distinct prompt blocks
/// and half of the output they expect.
fn routed_held_tokens(total: &Load) -> f64 {
    total.pinned_prompt_tokens as f64 + total.decode_tokens as f64 / 2.0
}

/// The output a running request still owes on a backend, on average: half of what the
/// routers' requests in flight there expect.
fn mean_remaining_output(total: &Load) -> f64 {
    if total.requests > 0 {
        total.decode_tokens as f64 / f64::from(total.requests) / 2.0
    } else {
        DEFAULT_REMAINING_OUTPUT_TOKENS
    }
}

/// Output a running request is assumed to still owe when the router has none in flight there
/// to average over (half of a typical 256-token answer).
const DEFAULT_REMAINING_OUTPUT_TOKENS: f64 = 128.0;

/// A backend's expected-wait inputs. From the engine's last scraped utilization and queue
/// when they are fresh (`fresh_scrape`, see [`ShardBackend::fresh_scrape`]); only the engine's
/// own queue counts as waiting: requests routers sent since the scrape may well have been admitted, and counting them as waiting made
/// every busy engine look full (docs/routing.md). Otherwise, when its KV capacity is known
/// (scraped or `capacity-tokens=`), from what routers sent it ([`sent_memory`]); else `None`.
/// The output a running request still owes is taken as half of what the routers' in-flight
/// requests there expect. `total`: the backend's load summed over the cores.
fn memory_pressure(
    backend: &ShardBackend,
    total: &Load,
    fresh_scrape: Option<ScrapedMemory>,
) -> Option<MemoryPressure> {
    let mean_remaining_output_tokens = mean_remaining_output(total);
    match fresh_scrape {
        Some(memory) => Some(MemoryPressure {
            utilization: memory.utilization,
            waiting_requests: memory.waiting,
            running_requests: memory.running,
            mean_remaining_output_tokens,
        }),
        None => {
            let capacity = backend.scraped_capacity.or(backend.configured_capacity)?;
            Some(sent_memory(total, capacity, mean_remaining_output_tokens))
        }
    }
}

/// An engine's KV memory as the routers' requests in flight there fill it, for engines that do
/// not report theirs (TensorRT-LLM, Ollama, LM Studio) or whose figures grew old. Held: the
/// distinct prompt blocks of those requests (a prefix shared by several counted once, as the
/// engine holds it once) plus their output so far, half of what they expect on average. The
/// engine admits requests while their blocks fit in `capacity`; what is held beyond it is the
/// requests waiting, each taken to need the average request's share.
pub(crate) fn sent_memory(
    total: &Load,
    capacity_tokens: u64,
    mean_remaining_output_tokens: f64,
) -> MemoryPressure {
    let held = routed_held_tokens(total);
    let capacity = capacity_tokens.max(1) as f64;
    let waiting_requests = if held > capacity && total.requests > 0 {
        let per_request = held / f64::from(total.requests);
        (((held - capacity) / per_request).ceil() as u32).min(total.requests)
    } else {
        0
    };
    MemoryPressure {
        utilization: (held / capacity).min(1.0),
        waiting_requests,
        running_requests: total.requests - waiting_requests,
        mean_remaining_output_tokens,
    }
}

/// A decision's evidence as JSON: the policy, the cost's unit, the chosen backend and, per
/// candidate (eligible backend, by id; at most [`MAX_TRACED_CANDIDATES`]), its matched blocks,
/// expected cached tokens, load, predicted TTFT, expected KV-memory wait and cost.
fn trace_json(router: &Router, chosen: Option<BackendId>) -> serde_json::Value {
    let config = router.config();
    let unit = match config.cost {
        myelin_routing::CostModel::Ttft => "seconds",
        myelin_routing::CostModel::Tokens => "tokens",
    };
    let round = |value: f64, scale: f64| (value * scale).round() / scale;
    let candidates: Vec<serde_json::Value> = router
        .candidates()
        .iter()
        .take(MAX_TRACED_CANDIDATES)
        .map(|candidate| {
            serde_json::json!({
                "backend": candidate.id.0,
                "matched_blocks": candidate.matched_blocks,
                "expected_cached_tokens": candidate.expected_cached_tokens.round(),
                "load_tokens": candidate.load_tokens,
                "predicted_ttft_ms": round(candidate.predicted_ttft.seconds * 1e3, 1e3),
                "memory_wait": round(candidate.wait_tokens, 1e6),
                "cost": round(candidate.cost_tokens, 1e6),
            })
        })
        .collect();
    serde_json::json!({
        "policy": router.policy().as_str(),
        "residency": router.residency().as_str(),
        "cost_unit": unit,
        "chosen": chosen.map(|id| id.0),
        "candidates": candidates,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend_spec::BackendSpec;
    use crate::config::ServeArgs;
    use myelin_routing::Policy;

    fn shard(routing: Policy, shards: usize) -> RoutingShard {
        shard_over(routing, shards, 3)
    }

    /// A data core's routing state (one of `shards` cores) over backends `0..backends`, all up.
    pub(crate) fn shard_over(routing: Policy, shards: usize, backends: u32) -> RoutingShard {
        let shard_count = shards.to_string();
        let args = ["--routing", routing.as_str(), "--shards", &shard_count];
        shard_from(&args, shards, backends, "")
    }

    /// [`shard_over`] configured by `flags`, every backend spec ending in `spec_options`
    /// (`",capacity-tokens=N"`).
    fn shard_from(
        flags: &[&str],
        shards: usize,
        backends: u32,
        spec_options: &str,
    ) -> RoutingShard {
        let flags: Vec<&str> = ["--backend", "http://a:1"]
            .iter()
            .chain(flags)
            .copied()
            .collect();
        let config = ServeConfig::from_args(ServeArgs::from_flags(&flags), &[0]).unwrap();
        let mut shard = RoutingShard::new(&config, shards, Instant::now()).unwrap();
        for id in 0..backends {
            shard.add_backend(&BackendInfo {
                id: BackendId(id),
                spec: BackendSpec::parse(&format!("http://b{id}:1{spec_options}")).unwrap(),
                state: BackendState::Up,
            });
        }
        shard
    }

    #[test]
    fn learned_prefix_wins_and_excluded_backends_are_skipped() {
        let mut shard = shard(Policy::Prefix, 1);
        let prompt: Vec<u32> = (0..160).collect();
        let query = shard.query(&prompt);
        let first = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        let write = shard.learn(&query, first.backend);
        assert!(matches!(write, WriteOp::Learn { backend, .. } if backend == first.backend));
        let again = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!(again.backend, first.backend);
        assert_eq!(again.matched_blocks, 10);
        let retry = shard
            .decide(&shard.lookup(&query), prompt.len(), &[first.backend], &[])
            .unwrap();
        assert_ne!(retry.backend, first.backend);
        let none = shard.decide(
            &shard.lookup(&query),
            prompt.len(),
            &[BackendId(0), BackendId(1), BackendId(2)],
            &[],
        );
        assert_eq!(none, None);
    }

    #[test]
    fn an_explained_decision_is_the_next_decision_and_moves_nothing() {
        // Round-robin: every decision moves the cursor, so an explanation that moved it would
        // change what the next decision chooses.
        let mut shard = shard(Policy::RoundRobin, 1);
        let prompt: Vec<u32> = (0..160).collect();
        let query = shard.query(&prompt);
        shard.decide(&shard.lookup(&query), prompt.len(), &[], &[]);
        let explained = shard.explain(&shard.lookup(&query), prompt.len(), &[], &[]);
        let again = shard.explain(&shard.lookup(&query), prompt.len(), &[], &[]);
        assert_eq!(explained, again, "explaining twice gives the same answer");
        assert_eq!(explained["candidates"].as_array().unwrap().len(), 3);
        let decided = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!(explained["chosen"], decided.backend.0);
        // Excluded backends are out of the explanation too.
        let excluded = [BackendId(0), BackendId(1), BackendId(2)];
        let none = shard.explain(&shard.lookup(&query), prompt.len(), &excluded, &[]);
        assert_eq!(none["chosen"], serde_json::Value::Null);
    }

    /// [`shard_over`] with the cost in tokens (`--cost tokens`), whose KV-memory rules the
    /// tests below check.
    fn tokens_shard(spec_options: &str) -> RoutingShard {
        let args = ["--routing", "prefix", "--shards", "1", "--cost", "tokens"];
        shard_from(&args, 1, 3, spec_options)
    }

    #[test]
    fn a_full_engine_with_a_queue_sends_its_prefix_to_a_second_home_while_its_figures_are_fresh() {
        let mut shard = tokens_shard("");
        let prompt: Vec<u32> = (0..4096).collect();
        let query = shard.query(&prompt);
        let home = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap()
            .backend;
        shard.learn(&query, home);
        let full = |waiting| ScrapedMemory {
            utilization: 0.97,
            running: 6,
            waiting,
        };
        // Full memory but nobody waiting: the request stays home.
        let scraped_at = Instant::now();
        shard.set_scraped_memory(home, full(0), scraped_at);
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!((choice.backend, choice.prefix_replication), (home, false));
        // Three requests waiting there: (3 + 1) admissions of 128 / 6 steps at 300 tokens cost
        // 25,600 tokens, more than prefilling 4,096 elsewhere.
        shard.set_scraped_memory(home, full(3), scraped_at);
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert!(choice.prefix_replication && choice.backend != home);
        // Every engine waiting as long: waiting is no reason to leave the cache.
        for id in 0..3 {
            shard.set_scraped_memory(BackendId(id), full(3), scraped_at);
        }
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!((choice.backend, choice.prefix_replication), (home, false));
        for id in (0..3).map(BackendId).filter(|&id| id != home) {
            shard.set_scraped_memory(id, full(0), scraped_at);
        }
        // Figures older than three scrape intervals are not trusted: home again.
        let old = scraped_at - shard.memory_max_age - Duration::from_millis(1);
        shard.set_scraped_memory(home, full(3), old);
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!((choice.backend, choice.prefix_replication), (home, false));
    }

    #[test]
    fn in_seconds_a_prompt_goes_where_it_fits_beside_what_requests_in_flight_hold() {
        // The default cost: three 8,000-token requests in flight on backend 0 (24,000 tokens
        // pinned, 600 of output so far) leave no room for a 9,000-token prompt among 32,768;
        // backend 1 runs five short ones. Scored in tokens both loads are within the bound.
        let args = ["--routing", "prefix", "--shards", "1"];
        let mut shard = shard_from(&args, 1, 2, ",capacity-tokens=32768");
        let long = |requests, pinned_prompt_tokens| Load {
            requests,
            tokens: u64::from(requests) * 400,
            decode_tokens: u64::from(requests) * 400,
            pinned_prompt_tokens,
            ..Load::default()
        };
        shard.set_load(BackendId(0), 0, long(3, 24_000));
        shard.set_load(BackendId(1), 0, long(5, 5_000));
        let prompt: Vec<u32> = (0..9000).collect();
        let query = shard.query(&prompt);
        let answer = shard.lookup(&query);
        for _ in 0..3 {
            let choice = shard.decide(&answer, prompt.len(), &[], &[]).unwrap();
            assert_eq!(choice.backend, BackendId(1));
            assert_eq!(choice.predicted_ttft.memory_wait_steps, 0.0);
        }
        // Alone, backend 0 is predicted to wait for one of its requests to finish.
        let waits = shard
            .decide(&answer, prompt.len(), &[BackendId(1)], &[])
            .unwrap();
        assert_eq!(waits.backend, BackendId(0));
        assert!(waits.predicted_ttft.memory_wait_steps > 0.0, "{waits:?}");
        // Unless its requests in flight hold the prompt's first 8,000 tokens already.
        let shared = shard
            .decide(
                &answer,
                prompt.len(),
                &[BackendId(1)],
                &[(BackendId(0), 8_000)],
            )
            .unwrap();
        assert_eq!(shared.predicted_ttft.memory_wait_steps, 0.0);
    }

    #[test]
    fn a_scrape_taken_while_the_engine_was_full_does_not_outlive_the_requests_that_filled_it() {
        let args = ["--routing", "prefix", "--shards", "1"];
        let mut shard = shard_from(&args, 1, 1, ",capacity-tokens=10000");
        let prompt: Vec<u32> = (0..3900).collect();
        let query = shard.query(&prompt);
        let answer = shard.lookup(&query);
        let wait = |shard: &mut RoutingShard| {
            shard
                .decide(&answer, prompt.len(), &[], &[])
                .unwrap()
                .predicted_ttft
                .memory_wait_steps
        };
        // Two of the routers' requests hold 8,000 of 10,000 tokens, and the engine says so.
        let full = Load {
            requests: 2,
            decode_tokens: 400,
            tokens: 400,
            pinned_prompt_tokens: 7_800,
            ..Load::default()
        };
        shard.set_load(BackendId(0), 0, full);
        let scraped = ScrapedMemory {
            utilization: 0.8,
            running: 2,
            waiting: 0,
        };
        shard.set_scraped_memory(BackendId(0), scraped, Instant::now());
        assert!(wait(&mut shard) > 0.0, "3,900 more do not fit");
        // They finish: the scrape is still fresh, but what it saw was the routers' own.
        shard.set_load(BackendId(0), 0, Load::default());
        assert_eq!(wait(&mut shard), 0.0);
        // What the engine holds beyond the routers' requests (another frontend's) counts.
        let busy_elsewhere = ScrapedMemory {
            utilization: 0.9,
            running: 3,
            waiting: 0,
        };
        shard.set_scraped_memory(BackendId(0), busy_elsewhere, Instant::now());
        shard.set_load(
            BackendId(0),
            0,
            Load {
                requests: 1,
                decode_tokens: 200,
                tokens: 200,
                pinned_prompt_tokens: 100,
                ..Load::default()
            },
        );
        assert!(wait(&mut shard) > 0.0);
        // ... until the scrape is too old to trust.
        let old = Instant::now() - shard.memory_max_age - Duration::from_millis(1);
        shard.set_scraped_memory(BackendId(0), busy_elsewhere, old);
        assert_eq!(wait(&mut shard), 0.0);
    }

    #[test]
    fn first_tokens_fit_the_engine_s_timing_and_the_pool_moves_the_others() {
        let mut shard = shard(Policy::Prefix, 1);
        let prompt: Vec<u32> = (0..4000).collect();
        let query = shard.query(&prompt);
        let before: Vec<EngineTiming> = (0..3)
            .map(|id| shard.timing_figures(BackendId(id)).unwrap().timing)
            .collect();
        assert!(
            before
                .iter()
                .all(|timing| *timing == EngineTiming::default())
        );
        let default_seconds = myelin_routing::predict_ttft(
            &EngineTiming::default(),
            &myelin_routing::EngineQueue::default(),
            4000,
            4000.0,
        )
        .seconds;
        // Backend 0's first tokens come ten times faster than the default timing predicts
        // (a simulated engine at speedup 10): the truth is fixed, whatever the fit predicts
        // meanwhile.
        let observed = default_seconds / 10.0;
        for _ in 0..100 {
            let choice = shard
                .decide(
                    &shard.lookup(&query),
                    prompt.len(),
                    &[BackendId(1), BackendId(2)],
                    &[],
                )
                .unwrap();
            assert_eq!(choice.backend, BackendId(0));
            let error = shard
                .observe_ttft(BackendId(0), &choice.predicted_ttft, observed)
                .unwrap();
            assert!(error.is_finite());
        }
        let fitted = shard.timing_figures(BackendId(0)).unwrap();
        assert_eq!(fitted.observations, 100);
        assert_eq!(fitted.error.count, 100);
        let mut seconds = |id: BackendId| {
            let others: Vec<BackendId> =
                (0..3).map(BackendId).filter(|&other| other != id).collect();
            shard
                .decide(&shard.lookup(&query), prompt.len(), &others, &[])
                .unwrap()
                .predicted_ttft
                .seconds
        };
        // Learned: within 20% of a tenth of the default's prediction.
        assert!((seconds(BackendId(0)) / (default_seconds / 10.0) - 1.0).abs() < 0.2);
        // Backends 1 and 2 saw nothing: they follow the pool, not the default.
        let own = seconds(BackendId(0));
        assert!((seconds(BackendId(1)) / own - 1.0).abs() < 0.2);
        assert!((seconds(BackendId(2)) / own - 1.0).abs() < 0.2);
        // A backend gone has no figures to learn into.
        assert_eq!(
            shard.observe_ttft(BackendId(7), &fitted_prediction(), 1.0),
            None
        );
    }

    fn fitted_prediction() -> TtftPrediction {
        TtftPrediction {
            steps: 1.0,
            seconds: 0.1,
            ..TtftPrediction::default()
        }
    }

    #[test]
    fn sent_memory_waits_only_for_what_is_held_beyond_the_capacity() {
        let load = |requests, pinned_prompt_tokens, decode_tokens| Load {
            requests,
            pinned_prompt_tokens,
            decode_tokens,
            ..Load::default()
        };
        // 8 requests hold 20,000 prompt tokens and half of their 4,000 output: 22,000 of 32,768.
        let memory = sent_memory(&load(8, 20_000, 4_000), 32_768, 250.0);
        assert!((memory.utilization - 22_000.0 / 32_768.0).abs() < 1e-9);
        assert_eq!((memory.running_requests, memory.waiting_requests), (8, 0));
        assert_eq!(memory.mean_remaining_output_tokens, 250.0);
        // 10 requests holding 40,000 (4,000 each on average): 7,232 beyond the capacity, two
        // requests' worth, wait.
        let memory = sent_memory(&load(10, 38_000, 4_000), 32_768, 100.0);
        assert_eq!(memory.utilization, 1.0);
        assert_eq!((memory.running_requests, memory.waiting_requests), (8, 2));
        // Nothing in flight, or a zero capacity from a broken engine: finite and idle.
        let idle = sent_memory(&Load::default(), 0, 128.0);
        assert_eq!((idle.utilization, idle.waiting_requests), (0.0, 0));
    }

    #[test]
    fn the_prefill_ahead_counts_less_the_longer_the_engine_has_been_at_it() {
        let mut shard = shard_over(Policy::Prefix, 1, 2);
        // The routing clock has run a minute.
        shard.clock_origin = Instant::now().checked_sub(Duration::from_secs(60)).unwrap();
        let now_ms = shard.now_ms();
        let prompt: Vec<u32> = (0..512).collect();
        let query = shard.query(&prompt);
        let prefilling_since = |clock_ms| Load {
            requests: 1,
            prefilling: 1,
            tokens: 20_000,
            prefill_pairs: myelin_routing::prefill_pairs(20_000, 20_000.0) as u64,
            prefill_clock_ms: clock_ms,
            ..Load::default()
        };
        let mut predicted = Vec::new();
        for (started, fresh) in [(BackendId(0), BackendId(1)), (BackendId(1), BackendId(0))] {
            // Both hold a 20,000-token prompt ahead: one took it a minute ago (long enough
            // for it to be nearly done), the other just now.
            shard.set_load(started, 0, prefilling_since(0));
            shard.set_load(fresh, 0, prefilling_since(now_ms));
            let choice = shard
                .decide(&shard.lookup(&query), prompt.len(), &[], &[])
                .unwrap();
            assert_eq!(choice.backend, started);
            predicted.push(choice.predicted_ttft.seconds);
        }
        // Not done before its first token: a tenth of it still counts, more than none.
        shard.set_load(BackendId(0), 0, prefilling_since(0));
        shard.set_load(BackendId(1), 0, Load::default());
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!(choice.backend, BackendId(1));
        assert!(choice.predicted_ttft.seconds < predicted[0]);
    }

    #[test]
    fn a_full_engine_whose_requests_are_nearly_done_is_the_shorter_wait() {
        let args = ["--routing", "prefix", "--shards", "1"];
        let mut shard = shard_from(&args, 1, 2, ",capacity-tokens=10000");
        // The routing clock has run a minute.
        shard.clock_origin = Instant::now().checked_sub(Duration::from_secs(60)).unwrap();
        let now_ms = shard.now_ms();
        let prompt: Vec<u32> = (0..4000).collect();
        let query = shard.query(&prompt);
        // Four requests decoding on each, their prompts filling its memory, 200 output tokens
        // each to write: on one they had their first tokens 2 s ago (about 120 of 200
        // written at the default timing), on the other just now.
        let decoding_since = |first_token_ms: u64| Load {
            requests: 4,
            tokens: 800,
            decode_tokens: 800,
            pinned_prompt_tokens: 9_000,
            decode_started: 4,
            decode_clock_ms: 4 * first_token_ms,
            ..Load::default()
        };
        let mut predicted = Vec::new();
        for (older, newer) in [(BackendId(0), BackendId(1)), (BackendId(1), BackendId(0))] {
            shard.set_load(older, 0, decoding_since(now_ms - 2_000));
            shard.set_load(newer, 0, decoding_since(now_ms));
            let choice = shard
                .decide(&shard.lookup(&query), prompt.len(), &[], &[])
                .unwrap();
            assert_eq!(choice.backend, older);
            assert!(choice.predicted_ttft.memory_wait_steps > 0.0);
            predicted.push(choice.predicted_ttft);
        }
        // Without a first token seen (a peer's requests, say) each is taken to be halfway:
        // the wait lies between the two.
        let halfway = Load {
            decode_started: 0,
            decode_clock_ms: 0,
            ..decoding_since(0)
        };
        shard.set_load(BackendId(0), 0, halfway);
        shard.set_load(BackendId(1), 0, decoding_since(now_ms));
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!(choice.backend, BackendId(0));
        assert!(choice.predicted_ttft.memory_wait_steps > predicted[0].memory_wait_steps);
    }

    #[test]
    fn an_engine_without_figures_waits_by_what_routers_sent_it_when_its_capacity_is_known() {
        let mut shard = tokens_shard(",capacity-tokens=32768");
        let prompt: Vec<u32> = (0..4096).collect();
        let query = shard.query(&prompt);
        let home = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap()
            .backend;
        shard.learn(&query, home);
        // 6 requests in flight there holding 30,000 prompt tokens and half of 1,536 output:
        // within the capacity, so a cache hit stays home.
        let mut busy = Load {
            requests: 6,
            tokens: 1_536,
            decode_tokens: 1_536,
            pinned_prompt_tokens: 30_000,
            ..Load::default()
        };
        shard.set_load(home, 0, busy);
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!((choice.backend, choice.prefix_replication), (home, false));
        // 10 in flight holding 45,000: about 3 wait behind 7 running, (3 + 1) · 128 / 7 steps
        // of 300 tokens cost ~22,000, more than prefilling 4,096 elsewhere.
        busy.requests = 10;
        busy.pinned_prompt_tokens = 45_000;
        shard.set_load(home, 0, busy);
        let choice = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert!(choice.prefix_replication && choice.backend != home);
        // The same load with no capacity known: no memory view, the request stays home.
        let mut blind = shard_over(Policy::Prefix, 1, 3);
        blind.learn(&query, home);
        blind.set_load(home, 0, busy);
        let choice = blind
            .decide(&blind.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!((choice.backend, choice.prefix_replication), (home, false));
    }

    #[test]
    fn estimate_stamps_learns_with_the_admitted_counter_and_learns_from_reuse_reports() {
        // The estimate alone: a prefix routed moments ago would count as pending resident.
        let args = ["--residency", "estimate", "--pending-resident-ms", "0"];
        let mut shard = shard_from(&args, 2, 2, ",capacity-tokens=10000");
        let admitted = |tokens| Load {
            admitted_tokens: tokens,
            ..Load::default()
        };
        // Backend 0 has taken 1_000 tokens from core 0 and 500 from core 1.
        shard.set_load(BackendId(0), 0, admitted(1_000));
        shard.set_load(BackendId(0), 1, admitted(500));
        let prompt: Vec<u32> = (0..160).collect();
        let query = shard.query(&prompt);
        let write = shard.learn(&query, BackendId(0));
        assert!(matches!(
            write,
            WriteOp::Learn {
                residency_stamp: 1_500,
                ..
            }
        ));
        // Little pressure since: backend 0 keeps it.
        shard.set_load(BackendId(0), 0, admitted(2_000));
        let answer = shard.lookup(&query);
        let choice = shard.decide(&answer, prompt.len(), &[], &[]).unwrap();
        assert_eq!(choice.backend, BackendId(0));
        assert_eq!(choice.expected_cached_tokens, 160);
        // 40_000 tokens later (4x the cache) the estimate no longer counts it cached.
        shard.set_load(BackendId(0), 0, admitted(41_500));
        let answer = shard.lookup(&query);
        let choice = shard
            .decide(&answer, prompt.len(), &[BackendId(1)], &[])
            .unwrap();
        assert!(choice.expected_cached_tokens < 5, "{choice:?}");
        let probe = shard.probe(&answer, &choice, 170).unwrap();
        assert_eq!(probe.stamps, vec![1_500; 10]);
        assert_eq!(probe.admitted_tokens, 42_000);
        // The engine reports 2 blocks reused: an eviction every replica hears of.
        let (observation, write) = shard.observe_reuse(BackendId(0), &probe, 32);
        assert_eq!(observation.reported_blocks, 2);
        assert_eq!(
            write,
            Some(WriteOp::Evicted {
                backend: BackendId(0),
                stamp: 1_500
            })
        );
        let figures = shard.cache_figures(BackendId(0));
        assert_eq!(figures.reports, 1);
        assert_eq!(figures.admitted_tokens, 42_000);
        // Its first two blocks survived 40_500 tokens of pressure: the cache is larger than
        // configured, and the correction moves it up.
        assert!(
            figures.effective_capacity_tokens.unwrap() > 10_000,
            "{figures:?}"
        );
        assert!(figures.correction > 1.0);
        // A scraped capacity replaces the configured one.
        shard.set_scraped_capacity(BackendId(0), Some(24_000));
        assert_eq!(
            shard.cache_figures(BackendId(0)).effective_capacity_tokens,
            Some(24_000)
        );
        shard.set_scraped_capacity(BackendId(0), None);
        assert_eq!(
            shard.cache_figures(BackendId(0)).effective_capacity_tokens,
            Some(10_000)
        );
    }

    #[test]
    fn down_and_draining_backends_are_not_chosen() {
        let mut shard = shard(Policy::RoundRobin, 1);
        shard.set_state(BackendId(0), BackendState::Down);
        shard.set_state(BackendId(1), BackendState::Draining);
        for _ in 0..5 {
            let choice = shard
                .decide(&LookupAnswer::default(), 10, &[], &[])
                .unwrap();
            assert_eq!(choice.backend, BackendId(2));
        }
    }

    #[test]
    fn least_load_reads_every_cores_load() {
        let mut shard = shard(Policy::LeastLoad, 2);
        shard.set_load(
            BackendId(0),
            0,
            Load {
                requests: 1,
                tokens: 500,
                ..Load::default()
            },
        );
        shard.set_load(
            BackendId(1),
            1,
            Load {
                requests: 1,
                tokens: 100,
                ..Load::default()
            },
        );
        shard.set_load(
            BackendId(2),
            0,
            Load {
                requests: 1,
                tokens: 50,
                ..Load::default()
            },
        );
        shard.set_load(
            BackendId(2),
            1,
            Load {
                requests: 1,
                tokens: 60,
                ..Load::default()
            },
        );
        let choice = shard
            .decide(&LookupAnswer::default(), 10, &[], &[])
            .unwrap();
        assert_eq!(choice.backend, BackendId(1));
    }
}
