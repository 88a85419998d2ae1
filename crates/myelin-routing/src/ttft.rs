//! The predicted time to first token of a request on an engine, and the per-engine timing it
//! is priced with, fitted online from observed first tokens (docs/routing.md, "The cost in
//! seconds").
//!
//! The model follows vLLM v1's scheduler: every step first gives each running request its next
//! token (a decode costs one token of the step's budget), then fills what is left of the
//! budget with prefill chunks of waiting requests in arrival order (FCFS, chunked prefill). A
//! new request therefore gets its first token once the prefill queued ahead of it and its own
//! uncached prompt have gone through, `budget − decoding` tokens per step, and, when the
//! engine's KV memory cannot hold it, after enough running requests have finished to make
//! room. Time per step is a fixed part plus a part per running sequence, and prefill costs
//! time per token plus time per (query, key) pair of causal attention: a prompt's attention
//! grows with the square of its length, so a 100k-token prompt takes three times what its
//! tokens alone would.

/// How an engine's steps take time. Defaults: Llama-3.1-8B on an A100-40GB at vLLM's OpenAI
/// server defaults (the simulator's default profile, docs/simulator.md), used until an engine's
/// own first tokens have been observed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineTiming {
    /// Seconds of one scheduler step apart from its tokens: launch, scheduling, sampling.
    pub step_s: f64,
    /// Seconds one running sequence adds to every step (its decode token, its KV reads).
    pub step_s_per_sequence: f64,
    /// Seconds per prefilled prompt token (the work linear in tokens: projections, MLP).
    pub prefill_s_per_token: f64,
    /// Seconds per (query, key) pair of prefill attention: a chunk of n new tokens on top of
    /// c tokens already computed attends n · (c + n / 2) pairs ([`prefill_pairs`]).
    pub prefill_s_per_token_pair: f64,
    /// Tokens per step (vLLM's `max_num_batched_tokens`).
    pub step_tokens: u32,
}

/// The A100 / Llama-3.1-8B figures: a step's fixed part 13 ms (9.7 ms of forward for one
/// token, 3.3 ms of overhead), 1 ms per running sequence of some 8k tokens of context (0.2 ms
/// of bookkeeping, 0.9 ms of KV reads), 0.07 ms per prefilled token (2,048 tokens in 146 ms),
/// 3 ns per attention pair (published: attention adds ~5% to a 2k prompt's prefill and ~20% to
/// an 8k one's; FlashAttention at half the A100's 312 TFLOP/s does the 4 · 4,096 · 32 FLOPs of
/// one pair over Llama-8B's layers in 3.4 ns), 2,048 tokens per step.
pub const DEFAULT_ENGINE_TIMING: EngineTiming = EngineTiming {
    step_s: 0.013,
    step_s_per_sequence: 0.001,
    prefill_s_per_token: 0.000_07,
    prefill_s_per_token_pair: 3.0e-9,
    step_tokens: 2048,
};

impl Default for EngineTiming {
    fn default() -> Self {
        DEFAULT_ENGINE_TIMING
    }
}

impl EngineTiming {
    /// One step's time with `sequences` running, apart from prefill tokens.
    pub fn step_seconds(&self, sequences: u32) -> f64 {
        self.step_s + self.step_s_per_sequence * f64::from(sequences)
    }

    /// Seconds of prefill work (apart from steps) for `uncached_tokens` of a
    /// `prompt_tokens`-token prompt whose leading rest is cached.
    pub fn prefill_seconds(&self, prompt_tokens: u64, uncached_tokens: f64) -> f64 {
        let uncached = sane(uncached_tokens, MAX_TOKENS);
        self.prefill_s_per_token * uncached
            + self.prefill_s_per_token_pair * prefill_pairs(prompt_tokens, uncached)
    }
}

/// The (query, key) pairs of causal attention in prefilling the last `uncached_tokens` of a
/// `prompt_tokens`-token prompt on top of its cached rest: each new token attends to the
/// cached tokens and the new ones before it, u · (c + u / 2) with c = prompt − u, whatever the
/// chunks the engine splits it into.
pub fn prefill_pairs(prompt_tokens: u64, uncached_tokens: f64) -> f64 {
    let prompt = (prompt_tokens as f64).min(MAX_TOKENS);
    let uncached = sane(uncached_tokens, prompt);
    uncached * (prompt - uncached / 2.0)
}

/// An engine's KV memory as the router sees it when deciding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvMemory {
    /// KV capacity in tokens.
    pub capacity_tokens: u64,
    /// Tokens held by requests in flight there (their prompts, a shared prefix once, and their
    /// output so far), including those still waiting to be admitted.
    pub held_tokens: f64,
    /// Tokens of this request's prompt already held by requests in flight there (a shared
    /// prefix): they need no new memory.
    pub shared_tokens: u64,
    /// Output tokens the requests in flight there will still write: their KV memory grows by
    /// this while this request is prefilled and decoded, and vLLM makes room for that growth
    /// by preempting the newest request (this one).
    pub growth_tokens: f64,
}

/// What is in front of a new request on an engine.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineQueue {
    /// Prompt tokens still to prefill for requests ahead of it (net of their cached prefixes).
    pub prefill_tokens_ahead: u64,
    /// The attention pairs of that prefill ([`prefill_pairs`] of each request ahead, summed).
    pub prefill_pairs_ahead: f64,
    /// Requests in flight there (prefilling, decoding or waiting).
    pub requests: u32,
    /// Requests in flight there that already had their first token (decoding).
    pub decoding: u32,
    /// Output tokens a running request still owes, on average: a decoding one when
    /// `waiting_output_tokens` is known, any request in flight otherwise.
    pub mean_remaining_output_tokens: f64,
    /// Output tokens a request in flight that has not had its first token will write, on
    /// average (all of its output). `None`: not known apart from the decoding ones, and the
    /// remaining outputs of all requests in flight are taken to be spread evenly up to twice
    /// `mean_remaining_output_tokens`.
    pub waiting_output_tokens: Option<f64>,
    /// Its KV memory (`None`: capacity unknown, no memory wait).
    pub memory: Option<KvMemory>,
}

/// The parts of one prediction: the features the fit learns from, and the seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftPrediction {
    /// Scheduler steps until the first token: steps waiting for KV memory plus steps of
    /// prefill (at least one).
    pub steps: f64,
    /// Of `steps`, those spent waiting for KV memory (running requests finishing).
    pub memory_wait_steps: f64,
    /// Running sequences taken to share those steps.
    pub sequences: f64,
    /// Prompt tokens prefilled before the first token: the queue ahead and this request's own.
    pub prefill_tokens: f64,
    /// The attention pairs of that prefill.
    pub prefill_pairs: f64,
    /// The predicted time to first token, in seconds.
    pub seconds: f64,
}

impl TtftPrediction {
    /// The fit's features: steps, steps × sequences, prefill tokens, prefill pairs.
    fn features(&self) -> [f64; FEATURES] {
        [
            self.steps,
            self.steps * self.sequences,
            self.prefill_tokens,
            self.prefill_pairs,
        ]
    }

    /// Of `seconds`, the part spent waiting for KV memory.
    pub fn memory_wait_seconds(&self, timing: &EngineTiming) -> f64 {
        self.memory_wait_steps * timing.step_seconds(self.sequences as u32)
    }
}

/// Bounds on what an engine's figures can make a prediction: a queue or a wait beyond them is
/// a broken input, and the prediction stays finite.
const MAX_STEPS: f64 = 1e7;
const MAX_TOKENS: f64 = 1e9;
const MAX_PAIRS: f64 = 1e18;

/// The timing's parameters, each with its feature: step, per sequence, per token, per pair.
const FEATURES: usize = 4;

/// Steps a request waits for KV memory on an engine, `prefill_steps` the steps its prefill
/// and the prefill queued ahead of it take: 0 when its prompt (net of what requests in flight
/// already hold of it) fits beside what is held and what the decoding requests write before
/// its first token (a prompt that fits only beside what is held now is admitted, then
/// preempted as the newest request when the others' outputs need its blocks). Otherwise
/// blocks come free as requests in flight finish, each freeing about the average in-flight
/// request's share of what is held and what they will still write, and the wait is until the
/// k-th of them finishes, k the finishes needed to make room ([`finish_steps`]).
pub fn memory_wait_steps(queue: &EngineQueue, prompt_tokens: u64, prefill_steps: f64) -> f64 {
    let Some(memory) = queue.memory else {
        return 0.0;
    };
    if queue.requests == 0 {
        return 0.0;
    }
    let capacity = memory.capacity_tokens as f64;
    let held = sane(memory.held_tokens, MAX_TOKENS);
    let growth = sane(memory.growth_tokens, MAX_TOKENS);
    let need = prompt_tokens.saturating_sub(memory.shared_tokens) as f64;
    // One token per decoding request per step until the first token, and a block each
    // ahead: a running request takes a whole block when its output crosses into one.
    let decoding = f64::from(queue.decoding.min(queue.requests));
    let growth_before =
        growth.min(decoding * (sane(prefill_steps, MAX_STEPS) + GROWTH_BLOCK_TOKENS));
    if held + growth_before + need <= capacity {
        return 0.0;
    }
    let excess = held + growth + need - capacity;
    let per_request = ((held + growth) / f64::from(queue.requests)).max(1.0);
    let finishes = (excess / per_request).ceil().clamp(1.0, MAX_STEPS);
    finish_steps(queue, finishes).min(MAX_STEPS)
}

/// Tokens of a KV block (vLLM's default block size): a decoding request may take a new one
/// at its next step.
const GROWTH_BLOCK_TOKENS: f64 = 16.0;

/// Decode steps until `finishes` of the requests in flight on an engine have finished. The
/// decoding ones' remaining outputs are taken to be spread evenly up to twice their mean
/// (the j-th of D finishes after `2 · mean · j / (D + 1)` steps); those without a first token
/// yet finish after all of their output (`waiting_output_tokens`), once the decoding ones that
/// end sooner have. Without `waiting_output_tokens` every request in flight is taken to be
/// decoding. Needing more finishes than there are requests in flight prices past the longest.
fn finish_steps(queue: &EngineQueue, finishes: f64) -> f64 {
    let requests = f64::from(queue.requests);
    let remaining = sane(queue.mean_remaining_output_tokens, 1e6).max(1.0);
    let (decoding, waiting_output) = match queue.waiting_output_tokens {
        Some(output) => (
            f64::from(queue.decoding.min(queue.requests)),
            sane(output, 1e6).max(1.0),
        ),
        None => (requests, 0.0),
    };
    let waiting = requests - decoding;
    // The j-th decoding request to finish.
    let decoded = |j: f64| 2.0 * remaining * j / (decoding + 1.0);
    if waiting == 0.0 {
        return decoded(finishes);
    }
    // The decoding requests that finish before the waiting ones do.
    let sooner =
        ((waiting_output * (decoding + 1.0) / (2.0 * remaining)).ceil() - 1.0).clamp(0.0, decoding);
    if finishes <= sooner {
        decoded(finishes)
    } else if finishes <= sooner + waiting {
        waiting_output
    } else if finishes <= requests {
        decoded(finishes - waiting).max(waiting_output)
    } else {
        decoded(decoding).max(waiting_output) * finishes / requests
    }
}

fn sane(value: f64, bound: f64) -> f64 {
    if value.is_nan() {
        0.0
    } else {
        value.clamp(0.0, bound)
    }
}

/// The predicted time to first token of a request with `uncached_tokens` to prefill, of a
/// `prompt_tokens`-token prompt, on an engine with `queue` in front of it.
pub fn predict_ttft(
    timing: &EngineTiming,
    queue: &EngineQueue,
    prompt_tokens: u64,
    uncached_tokens: f64,
) -> TtftPrediction {
    let prefill_tokens = sane(
        queue.prefill_tokens_ahead as f64 + sane(uncached_tokens, MAX_TOKENS),
        MAX_TOKENS,
    );
    let prefill_pairs = sane(
        sane(queue.prefill_pairs_ahead, MAX_PAIRS) + prefill_pairs(prompt_tokens, uncached_tokens),
        MAX_PAIRS,
    );
    let decoding = queue.decoding.min(queue.requests);
    // Each step first decodes every running sequence, then prefills with what is left.
    let per_step = (f64::from(timing.step_tokens) - f64::from(decoding)).max(1.0);
    let prefill_steps = (prefill_tokens / per_step).ceil().max(1.0);
    let memory_wait_steps = memory_wait_steps(queue, prompt_tokens, prefill_steps);
    let steps = (prefill_steps + memory_wait_steps).min(MAX_STEPS);
    let sequences = f64::from(decoding);
    let mut prediction = TtftPrediction {
        steps,
        memory_wait_steps,
        sequences,
        prefill_tokens,
        prefill_pairs,
        seconds: 0.0,
    };
    prediction.seconds = timing_dot(timing, &prediction.features());
    prediction
}

fn timing_dot(timing: &EngineTiming, features: &[f64; FEATURES]) -> f64 {
    parameters(timing)
        .iter()
        .zip(features)
        .map(|(parameter, feature)| parameter * feature)
        .sum()
}

/// A timing's parameters in the features' order.
fn parameters(timing: &EngineTiming) -> [f64; FEATURES] {
    [
        timing.step_s,
        timing.step_s_per_sequence,
        timing.prefill_s_per_token,
        timing.prefill_s_per_token_pair,
    ]
}

/// Observations a fitted timing weighs as much as the prior (the default timing) it starts
/// from, each taken to owe [`PRIOR_FEATURE_SECONDS`] to every parameter: a few first tokens
/// move it, and an engine with none keeps the default.
pub const TIMING_PRIOR_WEIGHT: f64 = 4.0;
/// The seconds of a first token the prior takes each parameter to explain (a typical share).
const PRIOR_FEATURE_SECONDS: f64 = 0.01;
/// The prior's weight on each parameter, in the fit's scaled units.
const PRIOR_DIAGONAL: f64 = TIMING_PRIOR_WEIGHT * PRIOR_FEATURE_SECONDS * PRIOR_FEATURE_SECONDS;
/// How strongly each parameter is held to the prior's proportions (scaled to the speed the
/// observations show), as a share of the weight of its own feature in the observations. The
/// features are nearly collinear (the steps grow with the prefill tokens, the pairs with
/// both), so an unshrunk fit of four parameters swings between their bounds and prices an
/// engine far off (one run of the Mooncake trace: prefill rates at their lower bound, step
/// times at either bound, predicted first tokens 2-4x the observed); held this much, a
/// parameter leaves the prior's proportions only where the observations tell it apart.
pub const TIMING_PROPORTION_WEIGHT: f64 = 0.05;
/// How much each observation's weight decays per new observation: the fit follows an engine
/// whose speed changes over some hundreds of requests.
pub const TIMING_FORGETTING: f64 = 0.995;
/// A fitted figure stays within this factor of the default (either way): a stalled engine or
/// a broken observation cannot price an engine at zero or at infinity. (A simulated engine
/// running ten times faster than the hardware it models is well inside.)
pub const TIMING_BOUND_FACTOR: f64 = 50.0;

/// An engine's timing fitted online: a ridge regression of observed first-token times on the
/// prediction's features (steps, steps × sequences, prefill tokens, prefill pairs), with exponential
/// forgetting, shrunk towards a prior timing given at each refit. Pure: the caller feeds each
/// observation and chooses the prior. The server keeps one fit per engine with the pooled fit
/// of all its engines as prior, and the pooled fit with the default timing as prior, so an
/// engine with few first tokens is priced like the others rather than by the default (a new
/// engine priced slower than the fitted ones would never get the requests to learn from).
#[derive(Debug, Clone)]
pub struct TimingFit {
    /// Decayed sums of x xᵀ and x y over observations, features scaled to the default
    /// timing's units (each parameter over its default).
    xx: [[f64; FEATURES]; FEATURES],
    xy: [f64; FEATURES],
    fitted: EngineTiming,
    observations: u64,
    error: PredictionError,
}

/// Running figures of a predictor's error, in seconds: predicted − observed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PredictionError {
    /// Observations so far.
    pub count: u64,
    /// Exponentially weighted mean of predicted − observed (positive: too pessimistic).
    pub bias_s: f64,
    /// Exponentially weighted mean of |predicted − observed|.
    pub mean_abs_s: f64,
    /// Exponentially weighted mean of |predicted − observed| / observed.
    pub mean_abs_relative: f64,
}

/// Weight of the newest observation in [`PredictionError`]'s means.
const ERROR_SMOOTHING: f64 = 0.02;

impl PredictionError {
    fn record(&mut self, predicted: f64, observed: f64) {
        let error = predicted - observed;
        let relative = error.abs() / observed.max(1e-6);
        let weight = if self.count == 0 {
            1.0
        } else {
            ERROR_SMOOTHING.max(1.0 / (self.count + 1) as f64)
        };
        self.bias_s += weight * (error - self.bias_s);
        self.mean_abs_s += weight * (error.abs() - self.mean_abs_s);
        self.mean_abs_relative += weight * (relative.min(1e3) - self.mean_abs_relative);
        self.count += 1;
    }
}

/// The scale of each parameter in the fit: the default timing's figures.
const SCALE: [f64; FEATURES] = [
    DEFAULT_ENGINE_TIMING.step_s,
    DEFAULT_ENGINE_TIMING.step_s_per_sequence,
    DEFAULT_ENGINE_TIMING.prefill_s_per_token,
    DEFAULT_ENGINE_TIMING.prefill_s_per_token_pair,
];

impl TimingFit {
    /// A fit with no observations, priced at `prior` until its first refit.
    pub fn new(prior: EngineTiming) -> Self {
        Self {
            xx: [[0.0; FEATURES]; FEATURES],
            xy: [0.0; FEATURES],
            fitted: prior,
            observations: 0,
            error: PredictionError::default(),
        }
    }

    /// The timing to price the engine with now.
    pub fn timing(&self) -> EngineTiming {
        self.fitted
    }

    /// First tokens learned from.
    pub fn observations(&self) -> u64 {
        self.observations
    }

    /// The error of the predictions made so far (against what was then observed).
    pub fn error(&self) -> PredictionError {
        self.error
    }

    /// Learns from one request: `prediction` as made when it was sent (with the timing of
    /// then), `observed_s` the seconds from sending it to its first token. Requests predicted
    /// to wait for KV memory count in the error but do not move the rates: how long such a
    /// wait lasts depends on other requests' outputs, not on the engine's speed. The timing
    /// changes at the next [`Self::refit`].
    pub fn observe(&mut self, prediction: &TtftPrediction, observed_s: f64) {
        if !observed_s.is_finite() || observed_s < 0.0 || !prediction.seconds.is_finite() {
            return;
        }
        self.error.record(prediction.seconds, observed_s);
        if prediction.memory_wait_steps > 0.0 {
            return;
        }
        // What the request waited beyond the model (another frontend's requests, a wait for
        // memory the router did not see) must not drag the rates far: observations count at
        // most 4x and at least a quarter of what the current fit predicts.
        let expected = timing_dot(&self.fitted, &prediction.features()).max(1e-9);
        let observed = observed_s.clamp(expected / 4.0, expected * 4.0);
        let raw = prediction.features();
        let x: [f64; FEATURES] = std::array::from_fn(|index| raw[index] * SCALE[index]);
        for (row, &xi) in self.xx.iter_mut().zip(&x) {
            for (cell, &xj) in row.iter_mut().zip(&x) {
                *cell = *cell * TIMING_FORGETTING + xi * xj;
            }
        }
        for (cell, &xi) in self.xy.iter_mut().zip(&x) {
            *cell = *cell * TIMING_FORGETTING + xi * observed;
        }
        self.observations += 1;
    }

    /// Solves the fit again, shrunk towards `prior`: first the one factor k by which the
    /// prior's predictions best match what was observed (an engine k times slower at
    /// everything, shrunk towards 1 with the weight of [`TIMING_PRIOR_WEIGHT`] observations),
    /// then each parameter by least squares, held to k times the prior's with
    /// [`TIMING_PROPORTION_WEIGHT`] of its feature's weight (and to the prior itself with the
    /// prior's weight). Without observations the timing is `prior`.
    pub fn refit(&mut self, prior: &EngineTiming) {
        let prior_parameters = parameters(prior);
        let theta0: [f64; FEATURES] =
            std::array::from_fn(|index| prior_parameters[index] / SCALE[index]);
        // k: least squares of the observations on the prior's predictions, with the prior's
        // weight on k = 1.
        let mut predicted_squares = 0.0;
        let mut predicted_observed = 0.0;
        for (row, (&theta_i, &xy_i)) in self.xx.iter().zip(theta0.iter().zip(&self.xy)) {
            predicted_observed += theta_i * xy_i;
            for (&cell, &theta_j) in row.iter().zip(&theta0) {
                predicted_squares += theta_i * cell * theta_j;
            }
        }
        let prior_weight = PRIOR_DIAGONAL * FEATURES as f64;
        let speed = ((predicted_observed + prior_weight) / (predicted_squares + prior_weight))
            .clamp(1.0 / TIMING_BOUND_FACTOR, TIMING_BOUND_FACTOR);
        let speed = if speed.is_finite() { speed } else { 1.0 };
        let mut xx = self.xx;
        let mut xy = self.xy;
        for index in 0..FEATURES {
            let proportion = TIMING_PROPORTION_WEIGHT * self.xx[index][index];
            xx[index][index] += PRIOR_DIAGONAL + proportion;
            xy[index] += PRIOR_DIAGONAL * theta0[index] + proportion * speed * theta0[index];
        }
        self.fitted = match solve(&xx, &xy) {
            Some(theta) => {
                // Each figure within TIMING_BOUND_FACTOR of its default, the prior's when the
                // solution is not a number.
                let bounded: [f64; FEATURES] = std::array::from_fn(|index| {
                    let value = theta[index] * SCALE[index];
                    if value.is_finite() {
                        value.clamp(
                            SCALE[index] / TIMING_BOUND_FACTOR,
                            SCALE[index] * TIMING_BOUND_FACTOR,
                        )
                    } else {
                        prior_parameters[index]
                    }
                });
                EngineTiming {
                    step_s: bounded[0],
                    step_s_per_sequence: bounded[1],
                    prefill_s_per_token: bounded[2],
                    prefill_s_per_token_pair: bounded[3],
                    step_tokens: prior.step_tokens,
                }
            }
            None => *prior,
        };
    }
}

/// Solves a linear system by Gaussian elimination with partial pivoting; `None` when it is
/// singular.
fn solve<const N: usize>(a: &[[f64; N]; N], b: &[f64; N]) -> Option<[f64; N]> {
    let mut m = *a;
    let mut y = *b;
    for column in 0..N {
        let pivot =
            (column..N).max_by(|&i, &j| m[i][column].abs().total_cmp(&m[j][column].abs()))?;
        if m[pivot][column].abs() < 1e-12 {
            return None;
        }
        m.swap(column, pivot);
        y.swap(column, pivot);
        let (pivot_row, pivot_y) = (m[column], y[column]);
        for (index, (row, target)) in m.iter_mut().zip(y.iter_mut()).enumerate() {
            if index != column {
                let factor = row[column] / pivot_row[column];
                for (cell, &above) in row.iter_mut().zip(&pivot_row).skip(column) {
                    *cell -= factor * above;
                }
                *target -= factor * pivot_y;
            }
        }
    }
    Some(std::array::from_fn(|index| y[index] / m[index][index]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle() -> EngineQueue {
        EngineQueue {
            mean_remaining_output_tokens: 200.0,
            ..EngineQueue::default()
        }
    }

    #[test]
    fn an_idle_engine_prefills_the_prompt_in_budget_sized_steps() {
        let timing = DEFAULT_ENGINE_TIMING;
        let prediction = predict_ttft(&timing, &idle(), 5000, 5000.0);
        assert_eq!(prediction.steps, 3.0, "5,000 tokens at 2,048 per step");
        assert_eq!(prediction.memory_wait_steps, 0.0);
        // Its attention: 5,000 new tokens on an empty cache, 5,000 · 2,500 pairs.
        assert_eq!(prediction.prefill_pairs, 12_500_000.0);
        let expected = 3.0 * timing.step_s
            + 5000.0 * timing.prefill_s_per_token
            + 12_500_000.0 * timing.prefill_s_per_token_pair;
        assert!((prediction.seconds - expected).abs() < 1e-12);
        // A fully cached prompt still takes one step for its first token.
        let hit = predict_ttft(&timing, &idle(), 5000, 0.0);
        assert_eq!(hit.steps, 1.0);
        assert!(hit.seconds < prediction.seconds);
    }

    #[test]
    fn attention_prices_a_long_prompt_beyond_its_tokens() {
        let timing = DEFAULT_ENGINE_TIMING;
        // 100k fresh tokens attend 5e9 pairs (15 s) beside 7 s of per-token work; 10k tokens
        // attend 5e7 (0.15 s) beside 0.7 s.
        let long = predict_ttft(&timing, &idle(), 100_000, 100_000.0);
        let short = predict_ttft(&timing, &idle(), 10_000, 10_000.0);
        assert_eq!(long.prefill_pairs, 5e9);
        assert!(
            long.seconds > 2.0 * 10.0 * short.seconds,
            "{long:?} {short:?}"
        );
        // The same 100k tokens queued ahead cost more as one prompt than as ten.
        let behind = |prefill_pairs_ahead| {
            predict_ttft(
                &timing,
                &EngineQueue {
                    prefill_tokens_ahead: 100_000,
                    prefill_pairs_ahead,
                    requests: 10,
                    ..idle()
                },
                1000,
                1000.0,
            )
        };
        let behind_one = behind(prefill_pairs(100_000, 100_000.0));
        let behind_ten = behind(10.0 * prefill_pairs(10_000, 10_000.0));
        assert!(
            behind_one.seconds > behind_ten.seconds + 10.0,
            "{behind_one:?} {behind_ten:?}"
        );
        // A cached prefix is not prefilled, but the new tokens still attend to it.
        assert_eq!(prefill_pairs(10_000, 1000.0), 1000.0 * 9500.0);
        assert_eq!(prefill_pairs(1000, 1000.0), 500_000.0);
        assert_eq!(prefill_pairs(1000, 0.0), 0.0);
        // More uncached than the prompt has counts as the whole prompt; broken input is 0.
        assert_eq!(prefill_pairs(1000, 5000.0), 500_000.0);
        assert_eq!(prefill_pairs(1000, f64::NAN), 0.0);
    }

    #[test]
    fn prefill_queued_ahead_and_running_sequences_delay_the_first_token() {
        let timing = DEFAULT_ENGINE_TIMING;
        let alone = predict_ttft(&timing, &idle(), 1000, 1000.0);
        let behind = predict_ttft(
            &timing,
            &EngineQueue {
                prefill_tokens_ahead: 6000,
                requests: 1,
                ..idle()
            },
            1000,
            1000.0,
        );
        assert!(behind.seconds > alone.seconds + 6000.0 * timing.prefill_s_per_token * 0.99);
        // Decoding sequences take budget and time from every step.
        let busy = predict_ttft(
            &timing,
            &EngineQueue {
                prefill_tokens_ahead: 6000,
                requests: 41,
                decoding: 40,
                ..idle()
            },
            1000,
            1000.0,
        );
        assert!(busy.seconds > behind.seconds);
        assert_eq!(busy.sequences, 40.0);
    }

    #[test]
    fn a_prompt_that_does_not_fit_beside_what_is_held_waits_for_requests_to_finish() {
        let memory = |held_tokens, shared_tokens| {
            Some(KvMemory {
                capacity_tokens: 32_768,
                held_tokens,
                shared_tokens,
                growth_tokens: 0.0,
            })
        };
        let queue = |held, shared| EngineQueue {
            requests: 3,
            decoding: 3,
            mean_remaining_output_tokens: 200.0,
            memory: memory(held, shared),
            ..EngineQueue::default()
        };
        // Three running requests hold 26,000 tokens; a 6,000-token prompt fits.
        assert_eq!(memory_wait_steps(&queue(26_000.0, 0), 6000, 1.0), 0.0);
        // A 9,000-token one does not: one of the three must finish, the first of them after
        // about a quarter of the longest remaining output (400 steps).
        assert_eq!(memory_wait_steps(&queue(26_000.0, 0), 9000, 1.0), 100.0);
        // ... unless most of its prompt is a prefix those requests already hold.
        assert_eq!(memory_wait_steps(&queue(26_000.0, 8000), 9000, 1.0), 0.0);
        // A 6,000-token prompt fits beside what is held now (768 tokens to spare) and beside
        // the 600 output tokens the three still owe.
        let growing = |growth_tokens| EngineQueue {
            memory: Some(KvMemory {
                growth_tokens,
                ..memory(26_000.0, 0).unwrap()
            }),
            ..queue(26_000.0, 0)
        };
        assert_eq!(memory_wait_steps(&growing(600.0), 6000, 3.0), 0.0);
        // With 1,200 still to write it does not fit beside all of it, but the engine admits
        // it and preempts it (the newest) only when their outputs need its blocks: after its
        // first token when that comes in 3 steps, before it behind 300 steps of prefill.
        assert_eq!(memory_wait_steps(&growing(1200.0), 6000, 3.0), 0.0);
        assert_eq!(memory_wait_steps(&growing(1200.0), 6000, 300.0), 100.0);
        // The wait is priced: an idle engine that must prefill all 9,000 tokens wins.
        let timing = DEFAULT_ENGINE_TIMING;
        let waiting = predict_ttft(&timing, &queue(26_000.0, 0), 9000, 1000.0);
        let cold = predict_ttft(&timing, &idle(), 9000, 9000.0);
        assert!(waiting.seconds > cold.seconds, "{waiting:?} {cold:?}");
        // Broken figures stay finite.
        let broken = EngineQueue {
            mean_remaining_output_tokens: f64::NAN,
            memory: memory(f64::INFINITY, 0),
            ..queue(0.0, 0)
        };
        assert!(
            predict_ttft(&timing, &broken, 9000, 9000.0)
                .seconds
                .is_finite()
        );
    }

    #[test]
    fn the_wait_for_memory_follows_how_far_the_requests_in_flight_are() {
        // Four requests in flight hold the engine's 10,000 tokens; a 4,000-token prompt needs
        // two of them to finish.
        let queue = |decoding, remaining, waiting_output| EngineQueue {
            requests: 4,
            decoding,
            mean_remaining_output_tokens: remaining,
            waiting_output_tokens: waiting_output,
            memory: Some(KvMemory {
                capacity_tokens: 10_000,
                held_tokens: 10_000.0,
                shared_tokens: 0,
                growth_tokens: 0.0,
            }),
            ..EngineQueue::default()
        };
        // Progress unknown: the four spread evenly up to twice the mean, the second of them
        // done after 2 · 100 · 2 / 5 steps.
        assert_eq!(memory_wait_steps(&queue(4, 100.0, None), 4000, 1.0), 80.0);
        // Two decoding with 160 tokens to go on average (spread up to 320: they finish after
        // 107 and 213 steps), two without a first token that will write 200 each: the second
        // finish is a waiting one's, after its whole output.
        assert_eq!(
            memory_wait_steps(&queue(2, 160.0, Some(200.0)), 4000, 1.0),
            200.0
        );
        // Nearly done decoding ones (10 to go) free the room soon.
        let soon = memory_wait_steps(&queue(2, 10.0, Some(200.0)), 4000, 1.0);
        assert!((soon - 40.0 / 3.0).abs() < 1e-9, "{soon}");
        // None decoding: every finish waits for a whole output.
        assert_eq!(
            memory_wait_steps(&queue(0, 10.0, Some(200.0)), 4000, 1.0),
            200.0
        );
        // All four finish for a 10,000-token prompt (the last decoding one after 213 steps);
        // a 12,000-token one needs more finishes than there are requests in flight: priced
        // past the longest.
        let all = memory_wait_steps(&queue(2, 160.0, Some(200.0)), 10_000, 1.0);
        assert!((all - 640.0 / 3.0).abs() < 1e-9, "{all}");
        let past = memory_wait_steps(&queue(2, 160.0, Some(200.0)), 12_000, 1.0);
        assert!(past > all, "{past} {all}");
        // Broken figures stay finite.
        let broken = memory_wait_steps(&queue(2, f64::NAN, Some(f64::INFINITY)), 4000, 1.0);
        assert!(broken.is_finite(), "{broken}");
    }

    /// An engine whose true timing is `truth`: the observed first token of a request.
    fn observe(truth: &EngineTiming, queue: &EngineQueue, prompt: u64, uncached: f64) -> f64 {
        predict_ttft(truth, queue, prompt, uncached).seconds
    }

    /// A seeded generator of `0..bound`.
    fn draws(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut state = seed;
        move |bound: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % bound.max(1)
        }
    }

    /// A request's queue and prompt as a busy engine sees them: prompts of 500 to 100k
    /// tokens, part cached, behind up to 20 requests.
    fn busy_request(next: &mut impl FnMut(u64) -> u64) -> (EngineQueue, u64, f64) {
        let ahead = next(3) as u32;
        let long_ahead = next(60_000);
        let queue = EngineQueue {
            prefill_tokens_ahead: u64::from(ahead) * long_ahead,
            prefill_pairs_ahead: f64::from(ahead) * prefill_pairs(long_ahead, long_ahead as f64),
            requests: ahead + next(20) as u32,
            decoding: next(20) as u32,
            mean_remaining_output_tokens: 200.0,
            waiting_output_tokens: None,
            memory: None,
        };
        let prompt = 500 + next(100_000);
        let uncached = next(prompt + 1) as f64;
        (queue, prompt, uncached)
    }

    /// A fit of the default timing after `requests` first tokens of an engine whose true
    /// timing is `truth`, each observed `noise` (a multiplier around 1) times what it should.
    fn learn(truth: &EngineTiming, requests: usize, mut noise: impl FnMut() -> f64) -> TimingFit {
        let mut fit = TimingFit::new(DEFAULT_ENGINE_TIMING);
        let mut next = draws(7);
        for _ in 0..requests {
            let (queue, prompt, uncached) = busy_request(&mut next);
            let prediction = predict_ttft(&fit.timing(), &queue, prompt, uncached);
            fit.observe(
                &prediction,
                observe(truth, &queue, prompt, uncached) * noise(),
            );
            fit.refit(&DEFAULT_ENGINE_TIMING);
        }
        fit
    }

    /// The median of |predicted − true| / true over fresh requests.
    fn median_relative_error(fitted: &EngineTiming, truth: &EngineTiming) -> f64 {
        let mut next = draws(99);
        let mut errors: Vec<f64> = (0..501)
            .map(|_| {
                let (queue, prompt, uncached) = busy_request(&mut next);
                let predicted = predict_ttft(fitted, &queue, prompt, uncached).seconds;
                let observed = observe(truth, &queue, prompt, uncached);
                (predicted / observed - 1.0).abs()
            })
            .collect();
        errors.sort_by(f64::total_cmp);
        errors[errors.len() / 2]
    }

    #[test]
    fn the_fit_learns_an_engine_three_times_slower_with_four_times_the_attention_cost() {
        let truth = EngineTiming {
            step_s: 0.039,
            step_s_per_sequence: 0.003,
            prefill_s_per_token: 0.000_21,
            prefill_s_per_token_pair: 1.2e-8,
            step_tokens: 2048,
        };
        let fit = learn(&truth, 2000, || 1.0);
        let fitted = fit.timing();
        // Attention is told apart by the prompts' lengths; the step time hardly from the
        // prefill per token (see the next test), so the two are checked by what they predict.
        let pairs = fitted.prefill_s_per_token_pair / truth.prefill_s_per_token_pair;
        assert!((pairs - 1.0).abs() < 0.05, "{fitted:?}");
        let error = median_relative_error(&fitted, &truth);
        assert!(error < 0.03, "{error} {fitted:?}");
        assert_eq!(fit.observations(), 2000);
        // The error the fit kept of its own recent predictions says the same.
        assert!(fit.error().mean_abs_relative < 0.05, "{:?}", fit.error());
    }

    #[test]
    fn rates_the_first_tokens_cannot_tell_apart_still_predict_right() {
        // Twice the step time and three times the prefill: steps grow with the prefill tokens,
        // so the first tokens hardly separate the two, and the fit keeps the prior's
        // proportion where they do not; what it predicts is right all the same.
        let truth = EngineTiming {
            step_s: 0.026,
            prefill_s_per_token: 0.000_21,
            prefill_s_per_token_pair: 9.0e-9,
            ..DEFAULT_ENGINE_TIMING
        };
        let fit = learn(&truth, 2000, || 1.0);
        let error = median_relative_error(&fit.timing(), &truth);
        assert!(error < 0.02, "{error} {:?}", fit.timing());
    }

    #[test]
    fn noisy_first_tokens_do_not_swing_the_fit_to_its_bounds() {
        // Simulated engines ten times faster than the hardware they model, each first token
        // observed within ±40% of its true time (other requests' arrivals, the network): the
        // fit keeps every rate near the truth, none at a bound, and predicts within the
        // noise. (Unshrunk, a fit of the four rates put several at their bounds.)
        let truth = EngineTiming {
            step_s: DEFAULT_ENGINE_TIMING.step_s / 10.0,
            step_s_per_sequence: DEFAULT_ENGINE_TIMING.step_s_per_sequence / 10.0,
            prefill_s_per_token: DEFAULT_ENGINE_TIMING.prefill_s_per_token / 10.0,
            prefill_s_per_token_pair: DEFAULT_ENGINE_TIMING.prefill_s_per_token_pair / 10.0,
            ..DEFAULT_ENGINE_TIMING
        };
        let mut next = draws(3);
        let fit = learn(&truth, 3000, || 0.6 + next(801) as f64 / 1000.0);
        let fitted = fit.timing();
        for (fitted, truth) in parameters(&fitted).into_iter().zip(parameters(&truth)) {
            assert!(
                fitted > truth / 2.0 && fitted < truth * 2.0,
                "{fitted} against {truth}: {:?}",
                fit.timing()
            );
        }
        let error = median_relative_error(&fitted, &truth);
        assert!(error < 0.1, "{error} {fitted:?}");
    }

    #[test]
    fn the_fit_starts_at_its_prior_and_broken_observations_cannot_zero_it() {
        let mut fit = TimingFit::new(DEFAULT_ENGINE_TIMING);
        assert_eq!(fit.timing(), DEFAULT_ENGINE_TIMING);
        let prediction = predict_ttft(&fit.timing(), &idle(), 4000, 4000.0);
        for _ in 0..10_000 {
            fit.observe(&prediction, 0.0);
            fit.observe(&prediction, f64::NAN);
            fit.observe(&prediction, -1.0);
            fit.refit(&DEFAULT_ENGINE_TIMING);
        }
        let timing = fit.timing();
        for (fitted, prior) in [
            (timing.step_s, DEFAULT_ENGINE_TIMING.step_s),
            (
                timing.prefill_s_per_token,
                DEFAULT_ENGINE_TIMING.prefill_s_per_token,
            ),
            (
                timing.step_s_per_sequence,
                DEFAULT_ENGINE_TIMING.step_s_per_sequence,
            ),
            (
                timing.prefill_s_per_token_pair,
                DEFAULT_ENGINE_TIMING.prefill_s_per_token_pair,
            ),
        ] {
            assert!(fitted >= prior / TIMING_BOUND_FACTOR, "{timing:?}");
            assert!(fitted > 0.0);
        }
        // A request predicted to wait for memory does not move the rates.
        let mut fit = TimingFit::new(DEFAULT_ENGINE_TIMING);
        let waiting = TtftPrediction {
            memory_wait_steps: 100.0,
            ..prediction
        };
        fit.observe(&waiting, 30.0);
        fit.refit(&DEFAULT_ENGINE_TIMING);
        assert_eq!(fit.timing(), DEFAULT_ENGINE_TIMING);
        assert_eq!(fit.error().count, 1);
        assert!(fit.error().bias_s < 0.0, "predicted less than observed");
    }

    #[test]
    fn an_engine_without_observations_is_priced_by_its_prior_and_follows_it() {
        // The server refits each engine towards the pooled fit of all engines: one that has
        // seen nothing takes the pooled timing, whatever it is.
        let pooled = EngineTiming {
            step_s: 0.0013,
            step_s_per_sequence: 0.0001,
            prefill_s_per_token: 0.000_007,
            prefill_s_per_token_pair: 3.0e-10,
            step_tokens: 2048,
        };
        let mut fresh = TimingFit::new(DEFAULT_ENGINE_TIMING);
        fresh.refit(&pooled);
        let timing = fresh.timing();
        for (fitted, expected) in [
            (timing.step_s, pooled.step_s),
            (timing.step_s_per_sequence, pooled.step_s_per_sequence),
            (timing.prefill_s_per_token, pooled.prefill_s_per_token),
        ] {
            assert!((fitted / expected - 1.0).abs() < 1e-9, "{timing:?}");
        }
        // A few of its own first tokens, twice slower at prefill than the pool, move it there.
        let own = EngineTiming {
            prefill_s_per_token: pooled.prefill_s_per_token * 2.0,
            ..pooled
        };
        for ahead in 0..200u64 {
            let queue = EngineQueue {
                prefill_tokens_ahead: (ahead * 997) % 7000,
                prefill_pairs_ahead: 0.0,
                requests: 1,
                decoding: (ahead % 9) as u32,
                mean_remaining_output_tokens: 200.0,
                waiting_output_tokens: None,
                memory: None,
            };
            let uncached = ((ahead * 7919) % 9000) as f64;
            let prediction = predict_ttft(&fresh.timing(), &queue, 9000, uncached);
            fresh.observe(&prediction, observe(&own, &queue, 9000, uncached));
            fresh.refit(&pooled);
        }
        let learned = fresh.timing().prefill_s_per_token / own.prefill_s_per_token;
        assert!((learned - 1.0).abs() < 0.1, "{:?}", fresh.timing());
    }
}
