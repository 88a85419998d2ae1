//! Scoring and choice: turns a [`PrefixMatch`] and the backends' health and load into a
//! [`Decision`], under a [`Policy`] and a [`ResidencyMode`]. Holds only the round-robin /
//! tie-break cursor; one router per deciding core.

use crate::backend::{BackendId, BackendView, MemoryPressure};
use crate::error::NoBackend;
use crate::policy::Policy;
use crate::residency::{
    EstimateInput, PressureEstimator, ResidencyEstimator, ResidencyMode, expected_cached_tokens,
};
use crate::shard::{BackendMatch, PrefixMatch};
use crate::ttft::{EngineTiming, TtftPrediction, predict_ttft};

/// Load differences up to this many tokens are treated as noise by the prefix policy unless
/// configured (about one 2k-token prompt of prefill).
pub const DEFAULT_LOAD_BOUND_TOKENS: u64 = 2048;

/// What one decode step of a running batch costs, in prompt tokens prefilled in the same time,
/// unless configured: on the default profile (Llama-3.1-8B on an A100) a decode step of a
/// dozen 4-8k-token sequences takes about 20 ms, the time to prefill about 300 tokens at
/// 2,048 tokens per 146 ms (docs/routing.md, "KV memory").
pub const DEFAULT_DECODE_STEP_TOKENS: u64 = 300;

/// Homes a prefix gets at most because of KV-memory waits, unless configured: a hot prefix
/// copied to more engines fills more of the cluster's memory, which is what makes engines wait
/// in the first place. Chosen, not measured: three of the eight engines of a typical host.
pub const DEFAULT_MAX_PREFIX_HOMES: u32 = 3;

/// KV utilization from which an engine with requests waiting is taken to wait for memory
/// (rather than for its token budget, which the load already counts). Not 1.0: a waiting
/// request needs free blocks for its next prefill chunk (up to the step budget, 128 blocks of
/// 16 at 2,048 tokens) while its cached prefix, if no running request uses it, sits in the
/// same free pool and cannot be evicted for it. On the churn workload engines had requests
/// waiting behind 4 to 6 running ones at 0.77 to 0.94 utilization (docs/routing.md).
pub const MEMORY_FULL_UTILIZATION: f64 = 0.75;

/// With the cost in seconds, the prefill a choice makes an engine do beyond what the engine
/// needing the least would do (re-prefilling a prefix another engine still holds) counts this
/// percent of its time again, unless configured: that work delays the requests that will queue
/// behind it, not only this one (docs/routing.md, "Extra prefill").
pub const DEFAULT_EXTRA_PREFILL_PERCENT: u32 = 100;

/// The extra-prefill charge applies in full once this percent of the history-matched prompt
/// tokens of recent decisions were found evicted (by the residency mode), in proportion below
/// it, unless configured: where every prefix the history knows is still cached, a copy on
/// another engine evicts nothing anyone asks for, and the charge would only keep a hit waiting
/// behind its queue (docs/routing.md, "Extra prefill").
pub const DEFAULT_EXTRA_PREFILL_RAMP_PERCENT: u32 = 25;

/// Per decision, the decayed sums behind the evicted share keep this much of their past: a
/// memory of about 128 decisions per deciding core.
const EVICTED_SHARE_DECAY: f64 = 1.0 - 1.0 / 128.0;

/// What the prefix policy minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CostModel {
    /// The predicted time to first token on each engine, in seconds ([`crate::predict_ttft`]):
    /// the prefill queued ahead, this request's own uncached prefill at the engine's fitted
    /// rates, and the wait for KV memory when its prompt does not fit (docs/routing.md).
    #[default]
    Ttft,
    /// The earlier cost in tokens: uncached prefill + load beyond the load bound + the KV-memory
    /// wait in prompt tokens (`decode_step_tokens` per decode step).
    Tokens,
}

impl CostModel {
    /// The name `myelin serve --cost` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            CostModel::Ttft => "ttft",
            CostModel::Tokens => "tokens",
        }
    }
}

impl std::str::FromStr for CostModel {
    type Err = crate::ParseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "ttft" => Ok(CostModel::Ttft),
            "tokens" => Ok(CostModel::Tokens),
            _ => Err(crate::ParseNameError {
                kind: "cost model",
                given: name.to_owned(),
                expected: "ttft, tokens",
            }),
        }
    }
}

impl std::fmt::Display for CostModel {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// Tunables of a [`Router`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterConfig {
    /// What the prefix policy minimises (default: the predicted time to first token).
    pub cost: CostModel,
    /// Load slack of the prefix policy, in tokens: a backend's load counts only beyond
    /// `min_load + load_bound_tokens` (see [`Router::decide`]). 0 = pure expected cost.
    pub load_bound_tokens: u64,
    /// Cost of one decode step in prompt tokens, the unit of the expected wait for KV memory
    /// (see [`admission_wait_tokens`]). 0 = KV memory ignored.
    pub decode_step_tokens: u64,
    /// A backend that was routed a prompt's matched prefix this recently (ms, the lookup's
    /// clock) is taken to hold it whatever the residency mode says: it is prefilling it, or
    /// its KV events for it are still on the way ("pending resident"). So is a backend routed
    /// it while a request sent no later is still without its first token there
    /// ([`BackendView::prefilling_since_ms`]: the routed prompt is still being prefilled, or
    /// waits to be). 0 = off.
    pub pending_resident_ms: u64,
    /// Most homes a prefix gets because of KV-memory waits (backends holding at least half of
    /// its longest match); beyond it, waits count only among its homes. 0 = no bound.
    pub max_prefix_homes: u32,
    /// With [`CostModel::Ttft`]: the prefill a backend would do beyond the least any eligible
    /// backend would (its uncached tokens minus the fewest uncached tokens anywhere) is charged
    /// this percent of its prefill time on top of the predicted TTFT. 0 = own TTFT only.
    pub extra_prefill_percent: u32,
    /// The extra-prefill charge applies in full once this percent of the history-matched
    /// prompt tokens of recent decisions were found evicted, scaled down in proportion below it
    /// (see [`Router::evicted_share`]). 0 = always in full. With residency `off` nothing is
    /// ever found evicted and the charge applies in full.
    pub extra_prefill_ramp_percent: u32,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            cost: CostModel::default(),
            load_bound_tokens: DEFAULT_LOAD_BOUND_TOKENS,
            decode_step_tokens: DEFAULT_DECODE_STEP_TOKENS,
            pending_resident_ms: 0,
            max_prefix_homes: DEFAULT_MAX_PREFIX_HOMES,
            extra_prefill_percent: DEFAULT_EXTRA_PREFILL_PERCENT,
            extra_prefill_ramp_percent: DEFAULT_EXTRA_PREFILL_RAMP_PERCENT,
        }
    }
}

/// Expected wait of a new request for KV memory on an engine, in prompt tokens: 0 unless the
/// engine's memory is full (utilization at least [`MEMORY_FULL_UTILIZATION`]) with requests
/// already waiting. Then the new request is admitted after the `waiting + 1` requests ahead of
/// it and itself get blocks, and blocks come free as running requests finish: with `running`
/// requests of `remaining` output tokens each on average, one finishes about every
/// `remaining / running` decode steps, so the wait is `(waiting + 1) · remaining / running`
/// steps of `decode_step_tokens` each.
pub fn admission_wait_tokens(memory: &MemoryPressure, decode_step_tokens: u64) -> f64 {
    if decode_step_tokens == 0
        || memory.waiting_requests == 0
        || memory.utilization.is_nan()
        || memory.utilization < MEMORY_FULL_UTILIZATION
    {
        return 0.0;
    }
    // An engine's figures are not trusted to be sane: the wait stays finite.
    let remaining = match memory.mean_remaining_output_tokens {
        tokens if tokens.is_nan() => 1.0,
        tokens => tokens.clamp(1.0, 1e6),
    };
    let steps = (f64::from(memory.waiting_requests) + 1.0) * remaining
        / f64::from(memory.running_requests.max(1));
    steps * decode_step_tokens as f64
}

/// The outcome of one routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Where the request goes.
    pub backend: BackendId,
    /// Historical matched blocks of the chosen backend.
    pub matched_blocks: u32,
    /// Prompt tokens expected to be served from the chosen backend's cache (under the
    /// router's residency mode).
    pub expected_cached_tokens: f64,
    /// The chosen backend's score: uncached prefill + counted load, in tokens.
    pub expected_cost_tokens: f64,
    /// The eligible backend with the longest historical match (None when nobody matched);
    /// among equals, the one undiscounted scoring (see `residency_downgrade`) prefers.
    pub historical_best: Option<BackendId>,
    /// Expected wait for KV memory on the chosen backend beyond the least one, in tokens
    /// (included in the cost).
    pub admission_wait_tokens: f64,
    /// True when the expected wait for KV memory moved the request off the backend that would
    /// have served more of its prompt from cache (the lowest cost without that wait): the
    /// chosen backend prefills the prefix too and becomes a second home for it. Feeds
    /// `myelin_router_prefix_replications_total`.
    pub prefix_replication: bool,
    /// True when `historical_best` would have been chosen with the resident probability of
    /// every historically matched block forced to 1.0 ("undiscounted" scoring: expected cached
    /// = max(expected cached, matched blocks × block size) per backend) but was not: its
    /// residency was discounted. Always false for residency `off` and for non-prefix policies.
    /// Feeds `myelin_router_residency_route_downgrades_total`.
    pub residency_downgrade: bool,
    /// The predicted time to first token on the chosen backend (every policy computes it, so
    /// the predictor's error can be measured whatever routes).
    pub predicted_ttft: TtftPrediction,
    /// History-matched prompt tokens over every eligible backend of this decision, and those
    /// of them the residency mode found evicted (0 with residency `off`): what
    /// [`Router::evicted_share`] is made of, for metrics.
    pub history_matched_tokens: f64,
    pub history_evicted_tokens: f64,
    /// The share of the extra-prefill charge applied (0..=1 times `extra_prefill_percent`; 0
    /// when no charge applies: the cost in tokens, or `extra_prefill_percent` 0).
    pub extra_prefill_scale: f64,
}

/// One eligible backend's scores in a decision: the evidence [`Router::candidates`] shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub id: BackendId,
    /// Its load in tokens, as the view gave it.
    pub load_tokens: u64,
    /// Blocks of the prompt its history holds.
    pub matched_blocks: u32,
    /// Prompt tokens expected cached there under the residency mode.
    pub expected_cached_tokens: f64,
    /// What the policy minimises: the predicted TTFT in seconds (plus the extra-prefill
    /// charge) under the cost in seconds, tokens under the cost in tokens.
    pub cost_tokens: f64,
    /// Cost with every historically matched block's probability forced to 1.0.
    pub undiscounted_cost_tokens: f64,
    /// Expected wait for KV memory, in the cost's unit (part of both costs).
    pub wait_tokens: f64,
    /// The predicted time to first token there.
    pub predicted_ttft: TtftPrediction,
    /// Prompt tokens to prefill there, expected and undiscounted.
    pub uncached_tokens: f64,
    pub undiscounted_uncached_tokens: f64,
    /// The timing it is priced with there (its prefill's seconds for the extra-prefill charge).
    pub timing: EngineTiming,
    /// Prompt tokens its historical match covers.
    pub history_cached_tokens: f64,
}

/// Chooses backends. `E` supplies resident probabilities for the `estimate`/`auto` modes.
/// A clone decides as the original would, without touching it (an explained decision).
#[derive(Debug, Clone)]
pub struct Router<E = PressureEstimator> {
    policy: Policy,
    residency: ResidencyMode,
    config: RouterConfig,
    estimator: E,
    /// Last backend chosen: round-robin continues after it, ties rotate after it.
    last_chosen: Option<BackendId>,
    candidates: Vec<Candidate>,
    probabilities: Vec<f64>,
    /// Decayed sums over recent decisions of the history-matched prompt tokens of every
    /// eligible backend and of those found evicted (see [`Router::evicted_share`]).
    history_matched: f64,
    history_evicted: f64,
}

impl Router<PressureEstimator> {
    /// A router with the default [`PressureEstimator`].
    pub fn new(policy: Policy, residency: ResidencyMode, config: RouterConfig) -> Self {
        Self::with_estimator(policy, residency, config, PressureEstimator::default())
    }
}

impl<E: ResidencyEstimator> Router<E> {
    pub fn with_estimator(
        policy: Policy,
        residency: ResidencyMode,
        config: RouterConfig,
        estimator: E,
    ) -> Self {
        Self {
            policy,
            residency,
            config,
            estimator,
            last_chosen: None,
            candidates: Vec::new(),
            probabilities: Vec::new(),
            history_matched: 0.0,
            history_evicted: 0.0,
        }
    }

    /// Every eligible backend's scores in the last decision (empty before the first, or when
    /// none was eligible), by backend id: a decision's evidence, for tracing.
    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn residency(&self) -> ResidencyMode {
        self.residency
    }

    pub fn config(&self) -> RouterConfig {
        self.config
    }

    pub fn estimator(&self) -> &E {
        &self.estimator
    }

    /// Of the prompt tokens the history matched on eligible backends over this router's recent
    /// decisions (decayed, about the last 128), the share the residency mode found evicted:
    /// how much of what clients ask for again the caches no longer hold. 0 before any match,
    /// and always with residency `off`.
    pub fn evicted_share(&self) -> f64 {
        if self.history_matched > 0.0 {
            (self.history_evicted / self.history_matched).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// The share of the extra-prefill charge that applies now: 0 where no charge applies (the
    /// cost in tokens, `extra_prefill_percent` 0); else 1 at or beyond
    /// `extra_prefill_ramp_percent` of evicted share (and always with ramp 0 or residency
    /// `off`), in proportion below.
    fn extra_prefill_scale(&self) -> f64 {
        if self.config.cost != CostModel::Ttft || self.config.extra_prefill_percent == 0 {
            return 0.0;
        }
        if self.config.extra_prefill_ramp_percent == 0 || self.residency == ResidencyMode::Off {
            return 1.0;
        }
        let ramp = f64::from(self.config.extra_prefill_ramp_percent) / 100.0;
        (self.evicted_share() / ramp).min(1.0)
    }

    /// Picks a backend for a prompt of `prompt_tokens` tokens.
    ///
    /// Only `Up` backends are eligible (draining and down ones never get new requests). For
    /// each eligible backend b, with block size B and m(b) its historical matched blocks:
    ///
    /// - expected_cached(b) = Σ_{i<n} B · Π_{j≤i} p_j(b), where p is 1 for `off` over the m(b)
    ///   history blocks; the estimator's probabilities over them for `estimate`; for `verified`
    ///   1 over the verified resident blocks when b's mirror is live, nothing otherwise; `auto`
    ///   = verified where live, estimate elsewhere; in every mode, the m(b) history blocks in
    ///   full when b was routed them within `pending_resident_ms` (pending resident). Capped at
    ///   `prompt_tokens`.
    /// - counted_load(b) = max(load(b) − load_bound, min_load), min_load over eligible
    ///   backends: differences within the bound are noise, beyond it they count in full.
    /// - wait(b) = the expected wait for KV memory, in tokens ([`admission_wait_tokens`]; 0
    ///   when b's memory figures are unknown), beyond the least wait of the eligible backends;
    ///   when the prefix has `max_prefix_homes` homes (backends with at least half the longest
    ///   match) or more, a home's wait counts beyond the least wait among the homes only.
    /// - cost(b) = (prompt_tokens − expected_cached(b)) + counted_load(b) + wait(b) with
    ///   [`CostModel::Tokens`]; with [`CostModel::Ttft`] (the default) cost(b) is the predicted
    ///   time to first token ([`crate::predict_ttft`] with b's timing and queue and
    ///   prompt_tokens − expected_cached(b) to prefill), waits count in full and the homes
    ///   bound does not apply; plus `extra_prefill_percent` of b's prefill time for its
    ///   uncached tokens beyond the fewest of any eligible backend (the extra prefill), scaled
    ///   by the evicted share up to `extra_prefill_ramp_percent` ([`Router::evicted_share`]).
    ///
    /// `prefix` takes the lowest cost; `least-load` the lowest load; `round-robin` the next id
    /// after the last chosen. Ties go to the first tied id after the last chosen backend,
    /// wrapping (deterministic, and spreads cold prompts instead of piling them on one id).
    pub fn decide(
        &mut self,
        prompt_tokens: u64,
        matched: &PrefixMatch,
        backends: &[BackendView],
    ) -> Result<Decision, NoBackend> {
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        let mut draining = 0usize;
        let mut down = 0usize;
        let min_load = backends
            .iter()
            .filter(|view| view.state.accepts_new_requests())
            .map(|view| view.load_tokens)
            .min();
        let prompt = prompt_tokens as f64;
        let block_size = u64::from(matched.block_size);
        for view in backends {
            match view.state {
                crate::BackendState::Up => {}
                crate::BackendState::Draining => {
                    draining += 1;
                    continue;
                }
                crate::BackendState::Down => {
                    down += 1;
                    continue;
                }
            }
            let min_load = min_load.unwrap_or(0);
            let entry = matched.backend(view.id);
            let matched_blocks = entry.map_or(0, |entry| entry.matched_blocks);
            let history_cached = (u64::from(matched_blocks) * block_size).min(prompt_tokens) as f64;
            let expected_cached = self
                .expected_cached(view, entry, matched)
                .min(prompt)
                .max(0.0);
            let counted_load = view
                .load_tokens
                .saturating_sub(self.config.load_bound_tokens)
                .max(min_load) as f64;
            // Counterfactual for downgrades: every historically matched block forced resident;
            // what residency adds beyond history (verified blocks routed elsewhere) stays.
            let undiscounted_cached = expected_cached.max(history_cached);
            let predicted_ttft = predict_ttft(
                &view.timing,
                &view.queue,
                prompt_tokens,
                prompt - expected_cached,
            );
            // (cost, undiscounted cost, wait) in the cost's unit.
            let (cost_tokens, undiscounted_cost_tokens, wait_tokens) = match self.config.cost {
                CostModel::Ttft => {
                    let undiscounted = predict_ttft(
                        &view.timing,
                        &view.queue,
                        prompt_tokens,
                        prompt - undiscounted_cached,
                    );
                    (
                        predicted_ttft.seconds,
                        undiscounted.seconds,
                        predicted_ttft.memory_wait_seconds(&view.timing),
                    )
                }
                CostModel::Tokens => {
                    let wait_tokens = view.memory.as_ref().map_or(0.0, |memory| {
                        admission_wait_tokens(memory, self.config.decode_step_tokens)
                    });
                    (
                        prompt - expected_cached + counted_load + wait_tokens,
                        prompt - undiscounted_cached + counted_load + wait_tokens,
                        wait_tokens,
                    )
                }
            };
            candidates.push(Candidate {
                id: view.id,
                load_tokens: view.load_tokens,
                matched_blocks,
                expected_cached_tokens: expected_cached,
                cost_tokens,
                undiscounted_cost_tokens,
                wait_tokens,
                predicted_ttft,
                uncached_tokens: prompt - expected_cached,
                undiscounted_uncached_tokens: prompt - undiscounted_cached,
                timing: view.timing,
                history_cached_tokens: history_cached,
            });
        }
        if candidates.is_empty() {
            self.candidates = candidates;
            return Err(NoBackend { draining, down });
        }
        // What the history matched and the residency mode found gone (history beyond the
        // expected cached tokens), over every eligible backend.
        let history_matched: f64 = candidates.iter().map(|c| c.history_cached_tokens).sum();
        let history_evicted: f64 = candidates
            .iter()
            .map(|c| c.uncached_tokens - c.undiscounted_uncached_tokens)
            .sum();
        self.history_matched = self.history_matched * EVICTED_SHARE_DECAY + history_matched;
        self.history_evicted = self.history_evicted * EVICTED_SHARE_DECAY + history_evicted;
        let extra_prefill_scale = self.extra_prefill_scale();
        // Waits count beyond the least one: where every engine waits for memory, waiting is
        // not a reason to leave the cache (and a second home would only fill more memory).
        let least_wait = |candidates: &[Candidate], of: &dyn Fn(&Candidate) -> bool| {
            candidates
                .iter()
                .filter(|c| of(c))
                .map(|c| c.wait_tokens)
                .min_by(f64::total_cmp)
                .unwrap_or(0.0)
        };
        // In seconds the cost is the predicted first token itself: waits count in full (a
        // wait everywhere is in every candidate's cost and moves nothing).
        let relative_waits = self.config.cost == CostModel::Tokens;
        let min_wait = if relative_waits {
            least_wait(&candidates, &|_| true)
        } else {
            0.0
        };
        // A prefix with `max_prefix_homes` homes already (backends holding at least half its
        // longest match) gets no more for memory: its homes' waits count only among
        // themselves, so the least-waiting home competes with the others on cache and load
        // alone (load can still move it, as without memory figures).
        let longest = candidates
            .iter()
            .map(|c| c.matched_blocks)
            .max()
            .unwrap_or(0);
        let is_home = |c: &Candidate| longest > 0 && c.matched_blocks * 2 >= longest;
        let homes = candidates.iter().filter(|c| is_home(c)).count();
        let home_wait = (relative_waits
            && self.config.max_prefix_homes > 0
            && homes >= self.config.max_prefix_homes as usize)
            .then(|| least_wait(&candidates, &is_home));
        for candidate in &mut candidates {
            let base = match home_wait {
                Some(home_wait) if is_home(candidate) => home_wait,
                _ => min_wait,
            };
            if base > 0.0 {
                candidate.wait_tokens -= base;
                candidate.cost_tokens -= base;
                candidate.undiscounted_cost_tokens -= base;
            }
        }
        if extra_prefill_scale > 0.0 {
            charge_extra_prefill(
                &mut candidates,
                prompt_tokens,
                f64::from(self.config.extra_prefill_percent) / 100.0 * extra_prefill_scale,
            );
        }
        candidates.sort_by_key(|candidate| candidate.id);
        let after = self.last_chosen;
        let chosen_index = match self.policy {
            Policy::RoundRobin => rotate_pick(&candidates, after, |_| true),
            Policy::LeastLoad => {
                let least = candidates.iter().map(|c| c.load_tokens).min().unwrap_or(0);
                rotate_pick(&candidates, after, |c| c.load_tokens == least)
            }
            Policy::Prefix => {
                // Equal costs: the engine expected to hold more of the prompt keeps it (no
                // second copy of the prefix elsewhere), then rotation.
                let best = candidates
                    .iter()
                    .map(|c| c.cost_tokens)
                    .min_by(f64::total_cmp)
                    .unwrap_or(0.0);
                let most_cached = candidates
                    .iter()
                    .filter(|c| c.cost_tokens == best)
                    .map(|c| c.expected_cached_tokens)
                    .max_by(f64::total_cmp)
                    .unwrap_or(0.0);
                rotate_pick(&candidates, after, |c| {
                    c.cost_tokens == best && c.expected_cached_tokens == most_cached
                })
            }
        };
        let longest = candidates
            .iter()
            .map(|c| c.matched_blocks)
            .max()
            .unwrap_or(0);
        let historical_best = (longest > 0).then(|| {
            let index = lowest(
                &candidates,
                after,
                |c| c.undiscounted_cost_tokens,
                |c| c.matched_blocks == longest,
            );
            candidates[index].id
        });
        let chosen = candidates[chosen_index];
        let residency_downgrade = match historical_best {
            Some(best) if self.policy == Policy::Prefix && self.residency != ResidencyMode::Off => {
                let undiscounted_winner =
                    lowest(&candidates, after, |c| c.undiscounted_cost_tokens, |_| true);
                candidates[undiscounted_winner].id == best && chosen.id != best
            }
            _ => false,
        };
        let prefix_replication = self.policy == Policy::Prefix && {
            let without_wait = lowest(
                &candidates,
                after,
                |c| c.cost_tokens - c.wait_tokens,
                |_| true,
            );
            let home = candidates[without_wait];
            home.id != chosen.id
                && home.wait_tokens > 0.0
                && home.expected_cached_tokens > chosen.expected_cached_tokens
        };
        self.last_chosen = Some(chosen.id);
        self.candidates = candidates;
        Ok(Decision {
            backend: chosen.id,
            matched_blocks: chosen.matched_blocks,
            expected_cached_tokens: chosen.expected_cached_tokens,
            expected_cost_tokens: chosen.cost_tokens,
            admission_wait_tokens: chosen.wait_tokens,
            prefix_replication,
            historical_best,
            residency_downgrade,
            predicted_ttft: chosen.predicted_ttft,
            history_matched_tokens: history_matched,
            history_evicted_tokens: history_evicted,
            extra_prefill_scale,
        })
    }

    fn expected_cached(
        &mut self,
        view: &BackendView,
        entry: Option<&BackendMatch>,
        matched: &PrefixMatch,
    ) -> f64 {
        let block_size = matched.block_size;
        let Some(entry) = entry else {
            return 0.0;
        };
        let verified = entry
            .verified_resident_blocks
            .map(|blocks| f64::from(blocks) * f64::from(block_size));
        let history = f64::from(entry.matched_blocks) * f64::from(block_size);
        // Routed there moments ago (its KV events not arrived yet), or while a request sent
        // no later is still without its first token (first come, first served: the routed
        // prompt is being prefilled or waits to be, however long that takes).
        let pending = self.config.pending_resident_ms > 0
            && entry.matched_blocks > 0
            && (matched.looked_up_at_ms.saturating_sub(entry.last_routed_ms)
                <= self.config.pending_resident_ms
                || view
                    .prefilling_since_ms
                    .is_some_and(|since| entry.last_routed_ms >= since));
        let expected = match (self.residency, verified) {
            (ResidencyMode::Off, _) => return history,
            (ResidencyMode::Verified, verified) => verified.unwrap_or(0.0),
            (ResidencyMode::Auto, Some(verified)) if !entry.verified_partial => verified,
            (ResidencyMode::Estimate | ResidencyMode::Auto, _) => {
                self.probabilities.clear();
                self.estimator.block_probabilities(
                    EstimateInput {
                        view,
                        matched: entry,
                        segments: &matched.segments,
                        now_ms: matched.looked_up_at_ms,
                        block_size,
                    },
                    &mut self.probabilities,
                );
                // Only the historically matched blocks can count, whatever the estimator wrote.
                self.probabilities.truncate(entry.matched_blocks as usize);
                let estimated = expected_cached_tokens(block_size, &self.probabilities);
                // A partial mirror's blocks are resident for sure; past them, the estimate.
                match (self.residency, verified) {
                    (ResidencyMode::Auto, Some(verified)) => estimated.max(verified),
                    _ => estimated,
                }
            }
        };
        if pending {
            expected.max(history)
        } else {
            expected
        }
    }
}

/// Adds to each candidate's costs `weight` times the time it would spend prefilling beyond the
/// fewest uncached tokens of any candidate (each cost against its own fewest: the expected and
/// the undiscounted one), at its own prefill rates (tokens and attention pairs: the extra
/// tokens are the prompt's leading ones, attending to less context than the rest).
fn charge_extra_prefill(candidates: &mut [Candidate], prompt_tokens: u64, weight: f64) {
    let fewest = |of: fn(&Candidate) -> f64| {
        candidates
            .iter()
            .map(of)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0)
    };
    let fewest_expected = fewest(|c| c.uncached_tokens);
    let fewest_undiscounted = fewest(|c| c.undiscounted_uncached_tokens);
    for candidate in candidates {
        let extra = |uncached: f64, fewest: f64| {
            let timing = &candidate.timing;
            weight
                * (timing.prefill_seconds(prompt_tokens, uncached)
                    - timing.prefill_seconds(prompt_tokens, fewest))
        };
        candidate.cost_tokens += extra(candidate.uncached_tokens, fewest_expected);
        candidate.undiscounted_cost_tokens +=
            extra(candidate.undiscounted_uncached_tokens, fewest_undiscounted);
    }
}

/// Index of the first candidate (sorted by id) satisfying `eligible` whose id is after
/// `after`, wrapping to the first one satisfying it. Candidates must be non-empty and at
/// least one must satisfy `eligible`.
fn rotate_pick(
    candidates: &[Candidate],
    after: Option<BackendId>,
    eligible: impl Fn(&Candidate) -> bool,
) -> usize {
    let mut first = None;
    for (index, candidate) in candidates.iter().enumerate() {
        if !eligible(candidate) {
            continue;
        }
        if after.is_none_or(|after| candidate.id > after) {
            return index;
        }
        first.get_or_insert(index);
    }
    first.unwrap_or(0)
}

/// Index of the lowest `score` among candidates satisfying `eligible`, ties rotated.
fn lowest(
    candidates: &[Candidate],
    after: Option<BackendId>,
    score: impl Fn(&Candidate) -> f64,
    eligible: impl Fn(&Candidate) -> bool,
) -> usize {
    let best = candidates
        .iter()
        .filter(|c| eligible(c))
        .map(&score)
        .min_by(f64::total_cmp)
        .unwrap_or(0.0);
    rotate_pick(candidates, after, |c| eligible(c) && score(c) == best)
}
