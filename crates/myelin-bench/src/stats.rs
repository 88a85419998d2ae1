//! Per-leg statistics: latency percentiles from hdrhistogram, throughput, cache and engine
//! counters, the harness's own cost. Pure: takes records and counters, returns summaries.

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::legs::LegKind;
use crate::record::RequestRecord;

/// Largest latency the histograms hold, in wall microseconds (one hour).
const MAX_TRACKED_US: u64 = 3_600_000_000;

/// Latency percentiles in simulated milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    pub mean: f64,
}

/// Engine counters summed over a leg's engines. The default is nothing counted yet (evictions
/// measured, 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EngineCounters {
    /// Prompt tokens looked up in the prefix caches (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Cached blocks dropped to make room (`None`: not measured; vLLM exports no eviction
    /// counter, see [`crate::engines`]).
    pub evictions: Option<u64>,
    /// Running requests preempted for lack of blocks (`vllm:num_preemptions_total`).
    pub preemptions: u64,
}

impl Default for EngineCounters {
    fn default() -> Self {
        EngineCounters {
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            evictions: Some(0),
            preemptions: 0,
        }
    }
}

impl EngineCounters {
    /// The counters accumulated between `earlier` and `self`.
    pub fn since(&self, earlier: &EngineCounters) -> EngineCounters {
        EngineCounters {
            prefix_cache_queries: self
                .prefix_cache_queries
                .saturating_sub(earlier.prefix_cache_queries),
            prefix_cache_hits: self
                .prefix_cache_hits
                .saturating_sub(earlier.prefix_cache_hits),
            evictions: match (self.evictions, earlier.evictions) {
                (Some(now), before) => Some(now.saturating_sub(before.unwrap_or(0))),
                (None, _) => None,
            },
            preemptions: self.preemptions.saturating_sub(earlier.preemptions),
        }
    }

    /// Adds `other`'s counts (evictions stay measured only where both sides measured them).
    pub(crate) fn add(&mut self, other: &EngineCounters) {
        self.prefix_cache_queries += other.prefix_cache_queries;
        self.prefix_cache_hits += other.prefix_cache_hits;
        self.evictions = match (self.evictions, other.evictions) {
            (Some(mine), Some(theirs)) => Some(mine + theirs),
            _ => None,
        };
        self.preemptions += other.preemptions;
    }
}

/// The load generator's own cost during a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HarnessCost {
    /// CPU time of the load generator's thread, microseconds.
    pub cpu_us: u64,
    /// Requests it handled (sent, streamed, recorded).
    pub requests: u64,
    /// How late its 1 ms ticker woke, microseconds: a busy harness wakes late and would
    /// inflate the latencies it measures.
    pub loop_lag_us: Vec<u64>,
    /// Oracle legs: wall time of each probe of the simulator, microseconds (the probe takes
    /// each engine's lock, so it also briefly holds the engines up).
    pub oracle_probe_us: Vec<u64>,
}

/// The harness's cost, summarised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HarnessSummary {
    /// Load-generator CPU per request, microseconds (wall clock, not simulated).
    pub cpu_us_per_request: f64,
    /// Ticker lateness P99 and max, microseconds (wall clock).
    pub loop_lag_p99_us: u64,
    pub loop_lag_max_us: u64,
    /// Oracle legs: probe time P50 and P99, microseconds (wall clock).
    pub oracle_probe_p50_us: Option<u64>,
    pub oracle_probe_p99_us: Option<u64>,
    /// The loop lag's P99, in simulated time, exceeds [`HARNESS_LIMIT_FRACTION`] of the leg's
    /// TTFT P99: the harness may be what limits this leg's latencies.
    pub may_limit_leg: bool,
}

/// Above this fraction of a leg's TTFT P99, the harness's loop lag is flagged.
pub const HARNESS_LIMIT_FRACTION: f64 = 0.1;

/// One run of one leg: everything measured.
#[derive(Debug, Clone)]
pub struct LegRun {
    pub name: String,
    pub kind: LegKind,
    pub repeat: u32,
    pub speedup: f64,
    pub warmup_s: f64,
    /// Simulated seconds over which throughput is measured (after warm-up).
    pub window_s: f64,
    pub records: Vec<RequestRecord>,
    /// Engine counters over the measured window (after warm-up).
    pub engines_measured: EngineCounters,
    /// Engine counters over the whole run.
    pub engines_total: EngineCounters,
    /// Residency downgrades from the router's /metrics (`None`: no myelin router in the leg).
    pub downgrades: Option<u64>,
    /// Requests sent to a second home of their prefix (KV memory full at the first), from the
    /// router's /metrics (`None`: no myelin router in the leg).
    pub replications: Option<u64>,
    /// Prompt tokens the router's prefix history matched and those its residency mode found
    /// evicted, over the whole run, from the router's /metrics (`None`: no myelin router).
    pub history_tokens: Option<HistoryTokens>,
    pub harness: HarnessCost,
}

/// `myelin_router_history_matched_tokens_total` and `..._evicted_tokens_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HistoryTokens {
    pub matched: u64,
    pub evicted: u64,
}

impl std::iter::Sum for HistoryTokens {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(HistoryTokens::default(), |total, one| HistoryTokens {
            matched: total.matched.saturating_add(one.matched),
            evicted: total.evicted.saturating_add(one.evicted),
        })
    }
}

impl HistoryTokens {
    /// Evicted over matched (`None` when nothing matched).
    pub fn evicted_share(self) -> Option<f64> {
        (self.matched > 0).then(|| self.evicted as f64 / self.matched as f64)
    }
}

impl LegRun {
    /// Whether a record is in the measured window: sent after warm-up (open loop: planned
    /// after it, so every leg measures the same requests).
    pub fn is_measured(&self, record: &RequestRecord) -> bool {
        let sent_s = record.sent_at_us as f64 * self.speedup / 1e6;
        record.planned_send_s.unwrap_or(sent_s) >= self.warmup_s
    }
}

/// A first token later than this (simulated milliseconds) counts as a slow request.
pub const SLOW_TTFT_MS: f64 = 2000.0;

/// A leg over all its runs.
#[derive(Debug, Clone, Serialize)]
pub struct LegSummary {
    pub name: String,
    pub kind: String,
    pub runs: u32,
    /// Successful requests in the measured windows.
    pub requests: u64,
    /// All requests sent, warm-up included.
    pub requests_sent: u64,
    /// Failed requests, warm-up included.
    pub errors: u64,
    pub downgrades: Option<u64>,
    /// Second homes made (`myelin_router_prefix_replications_total`).
    pub replications: Option<u64>,
    /// Of the prompt tokens the router's history matched, the share its residency mode found
    /// evicted (see [`HistoryTokens`]; `None`: no myelin router, or nothing matched).
    pub history_evicted_share: Option<f64>,
    /// Downgrades per request sent.
    pub downgrade_rate: Option<f64>,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Successful measured requests per simulated second.
    pub throughput_rps: f64,
    /// Output tokens per simulated second.
    pub output_tokens_per_s: f64,
    /// Engine prefix-cache hit rate over the measured window (hits / queries, in tokens).
    pub cache_hit_rate: Option<f64>,
    /// Sum of engine-reported cached tokens over sum of prompt tokens, measured requests.
    pub cached_token_ratio: Option<f64>,
    /// Over the whole run(s), warm-up included (`None`: not measured, external engines).
    pub evictions: Option<u64>,
    pub preemptions: u64,
    /// Measured requests whose first token took more than [`SLOW_TTFT_MS`] (simulated): the
    /// tail episodes (KV memory full, a herd on one engine) stay visible as a count.
    pub slow_ttft_requests: u64,
    /// This leg's median TTFT P99 across repeats divided by the oracle leg's (set when an
    /// oracle leg ran).
    pub p99_ttft_vs_oracle: Option<f64>,
    /// Measured requests with a reusable prefix of at least one block that were probed at send
    /// time (the denominator of `prefix_resident_share`).
    pub prefix_reusable_requests: u64,
    /// Of those, the share whose reusable prefix some engine held in full at send time
    /// (`None`: none probed).
    pub prefix_resident_share: Option<f64>,
    /// The router's predicted time to first token against the observed one, over the
    /// measured requests that carried a prediction (`None`: none did).
    pub ttft_prediction: Option<PredictionSummary>,
    pub harness: HarnessSummary,
    /// Every repeat's own figures, in the order the repeats ran.
    pub repeats: Vec<RepeatFigures>,
    /// Median and range across repeats of the figures the tables show.
    pub spread: LegSpread,
}

/// One repeat (one run) of one leg: its figures alone.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RepeatFigures {
    /// 1 for the first repeat.
    pub repeat: u32,
    pub requests: u64,
    pub requests_sent: u64,
    pub errors: u64,
    pub downgrades: Option<u64>,
    pub replications: Option<u64>,
    pub history_evicted_share: Option<f64>,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    pub cache_hit_rate: Option<f64>,
    pub evictions: Option<u64>,
    pub preemptions: u64,
    /// Measured requests with a TTFT over [`SLOW_TTFT_MS`].
    pub slow_ttft_requests: u64,
    /// The harness's loop lag P99 in this repeat, wall microseconds.
    pub loop_lag_p99_us: u64,
    /// The share of its probed requests whose reusable prefix was resident at send time.
    pub prefix_resident_share: Option<f64>,
    /// The predicted-TTFT error in this repeat.
    pub ttft_prediction: Option<PredictionSummary>,
}

/// How far a router's predicted times to first token were from the observed ones (simulated
/// milliseconds; error = predicted − observed, so a positive bias is a pessimistic predictor).
/// The prediction runs from the router sending the request to the engine, the observation
/// from the harness sending it to the router: the router's own time is in the error.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PredictionSummary {
    /// Requests with both a prediction and an observed first token.
    pub requests: u64,
    /// Median of predicted − observed.
    pub bias_ms: f64,
    /// Mean of predicted − observed.
    pub mean_error_ms: f64,
    /// Median and 99th percentile of |predicted − observed|.
    pub abs_error_p50_ms: f64,
    pub abs_error_p99_ms: f64,
    /// Median and 99th percentile of |predicted − observed| / observed.
    pub relative_abs_error_p50: f64,
    pub relative_abs_error_p99: f64,
}

impl PredictionSummary {
    /// The summary of `(predicted, observed)` pairs in wall microseconds, `None` without any.
    pub fn of(pairs: impl IntoIterator<Item = (u64, u64)>, speedup: f64) -> Option<Self> {
        let to_ms = |us: f64| us * speedup / 1000.0;
        let mut signed = Vec::new();
        let mut absolute = Vec::new();
        let mut relative = Vec::new();
        for (predicted, observed) in pairs {
            let error = predicted as f64 - observed as f64;
            signed.push(to_ms(error));
            absolute.push(to_ms(error.abs()));
            relative.push(error.abs() / (observed as f64).max(1.0));
        }
        if signed.is_empty() {
            return None;
        }
        let quantile = |values: &mut Vec<f64>, q: f64| {
            values.sort_by(f64::total_cmp);
            let index = ((values.len() as f64 * q).ceil() as usize).clamp(1, values.len()) - 1;
            values[index]
        };
        let mean_error_ms = signed.iter().sum::<f64>() / signed.len() as f64;
        Some(PredictionSummary {
            requests: signed.len() as u64,
            bias_ms: quantile(&mut signed, 0.5),
            mean_error_ms,
            abs_error_p50_ms: quantile(&mut absolute, 0.5),
            abs_error_p99_ms: quantile(&mut absolute, 0.99),
            relative_abs_error_p50: quantile(&mut relative, 0.5),
            relative_abs_error_p99: quantile(&mut relative, 0.99),
        })
    }
}

/// The median, smallest and largest of one figure across a leg's repeats (the median of an
/// even count is the mean of the middle two).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of `values`; all zero when there are none.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Spread {
        let mut sorted: Vec<f64> = values.into_iter().collect();
        if sorted.is_empty() {
            return Spread::default();
        }
        sorted.sort_by(f64::total_cmp);
        let middle = sorted.len() / 2;
        let median = if sorted.len() % 2 == 1 {
            sorted[middle]
        } else {
            (sorted[middle - 1] + sorted[middle]) / 2.0
        };
        Spread {
            median,
            min: sorted[0],
            max: sorted[sorted.len() - 1],
        }
    }

    /// Whether two ranges share at least one value.
    pub fn overlaps(&self, other: &Spread) -> bool {
        self.min <= other.max && other.min <= self.max
    }
}

/// The spread across repeats of the figures the report's tables show.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LegSpread {
    pub ttft_p50_ms: Spread,
    pub ttft_p90_ms: Spread,
    pub ttft_p99_ms: Spread,
    pub ttft_p999_ms: Spread,
    pub e2e_p99_ms: Spread,
    pub throughput_rps: Spread,
    pub output_tokens_per_s: Spread,
    /// `None` when a repeat had no cache queries.
    pub cache_hit_rate: Option<Spread>,
}

impl LegSpread {
    /// The spread of `repeats`.
    pub fn of(repeats: &[RepeatFigures]) -> LegSpread {
        let spread = |pick: fn(&RepeatFigures) -> f64| Spread::of(repeats.iter().map(pick));
        LegSpread {
            ttft_p50_ms: spread(|figures| figures.ttft_ms.p50),
            ttft_p90_ms: spread(|figures| figures.ttft_ms.p90),
            ttft_p99_ms: spread(|figures| figures.ttft_ms.p99),
            ttft_p999_ms: spread(|figures| figures.ttft_ms.p999),
            e2e_p99_ms: spread(|figures| figures.e2e_ms.p99),
            throughput_rps: spread(|figures| figures.throughput_rps),
            output_tokens_per_s: spread(|figures| figures.output_tokens_per_s),
            cache_hit_rate: repeats
                .iter()
                .map(|figures| figures.cache_hit_rate)
                .collect::<Option<Vec<f64>>>()
                .filter(|rates| !rates.is_empty())
                .map(Spread::of),
        }
    }
}

/// Percentiles of wall-microsecond samples, in simulated milliseconds.
pub fn percentiles(samples_us: impl IntoIterator<Item = u64>, speedup: f64) -> Percentiles {
    let Some(histogram) = histogram_of(samples_us) else {
        return Percentiles::default();
    };
    let to_ms = |us: u64| us as f64 * speedup / 1000.0;
    Percentiles {
        p50: to_ms(histogram.value_at_quantile(0.50)),
        p90: to_ms(histogram.value_at_quantile(0.90)),
        p99: to_ms(histogram.value_at_quantile(0.99)),
        p999: to_ms(histogram.value_at_quantile(0.999)),
        max: to_ms(histogram.max()),
        mean: histogram.mean() * speedup / 1000.0,
    }
}

/// A histogram of microsecond samples (3 significant digits: values within 0.1%), or `None`
/// when there are no samples.
pub fn histogram_of(samples_us: impl IntoIterator<Item = u64>) -> Option<Histogram<u64>> {
    let mut histogram = Histogram::<u64>::new_with_bounds(1, MAX_TRACKED_US, 3).ok()?;
    for sample in samples_us {
        histogram.saturating_record(sample.clamp(1, MAX_TRACKED_US));
    }
    (!histogram.is_empty()).then_some(histogram)
}

/// Summarises all runs of one leg (same name): figures over every run's requests together
/// (histograms merged, counters summed), each run's own figures (`repeats`) and their spread.
/// `runs` must not be empty.
pub fn summarize(runs: &[&LegRun]) -> LegSummary {
    let mut summary = pooled(runs);
    summary.repeats = runs
        .iter()
        .map(|run| {
            let alone = pooled(&[run]);
            RepeatFigures {
                repeat: run.repeat + 1,
                requests: alone.requests,
                requests_sent: alone.requests_sent,
                errors: alone.errors,
                downgrades: alone.downgrades,
                replications: alone.replications,
                history_evicted_share: alone.history_evicted_share,
                ttft_ms: alone.ttft_ms,
                e2e_ms: alone.e2e_ms,
                throughput_rps: alone.throughput_rps,
                output_tokens_per_s: alone.output_tokens_per_s,
                cache_hit_rate: alone.cache_hit_rate,
                evictions: alone.evictions,
                preemptions: alone.preemptions,
                slow_ttft_requests: alone.slow_ttft_requests,
                loop_lag_p99_us: alone.harness.loop_lag_p99_us,
                prefix_resident_share: alone.prefix_resident_share,
                ttft_prediction: alone.ttft_prediction,
            }
        })
        .collect();
    summary.spread = LegSpread::of(&summary.repeats);
    summary
}

/// The figures of all `runs` together, without `repeats` and `spread`.
fn pooled(runs: &[&LegRun]) -> LegSummary {
    let first = runs[0];
    let speedup = first.speedup;
    let measured_ok = || {
        runs.iter()
            .flat_map(|run| {
                run.records
                    .iter()
                    .filter(move |record| run.is_measured(record))
            })
            .filter(|record| !record.outcome.is_error())
    };
    let requests = measured_ok().count() as u64;
    let requests_sent: u64 = runs.iter().map(|run| run.records.len() as u64).sum();
    let errors = runs
        .iter()
        .flat_map(|run| run.records.iter())
        .filter(|record| record.outcome.is_error())
        .count() as u64;
    let window_s: f64 = runs.iter().map(|run| run.window_s).sum();
    let output_tokens: u64 = measured_ok()
        .map(|record| u64::from(record.output_tokens))
        .sum();
    let prompt_tokens: u64 = measured_ok()
        .map(|record| u64::from(record.prompt_tokens))
        .sum();
    let cached_tokens: Option<u64> = measured_ok()
        .map(|record| record.cached_tokens.map(u64::from))
        .sum::<Option<u64>>();
    let mut measured = EngineCounters::default();
    let mut total = EngineCounters::default();
    for run in runs {
        measured.add(&run.engines_measured);
        total.add(&run.engines_total);
    }
    let downgrades = runs.iter().map(|run| run.downgrades).sum::<Option<u64>>();
    let replications = runs.iter().map(|run| run.replications).sum::<Option<u64>>();
    let history_tokens = runs
        .iter()
        .map(|run| run.history_tokens)
        .sum::<Option<HistoryTokens>>();
    let cpu_us: u64 = runs.iter().map(|run| run.harness.cpu_us).sum();
    let harness_requests: u64 = runs.iter().map(|run| run.harness.requests).sum();
    let lag = histogram_of(
        runs.iter()
            .flat_map(|run| run.harness.loop_lag_us.iter().copied()),
    );
    let probes = histogram_of(
        runs.iter()
            .flat_map(|run| run.harness.oracle_probe_us.iter().copied()),
    );
    let per_second = |count: f64| {
        if window_s > 0.0 {
            count / window_s
        } else {
            0.0
        }
    };
    let ttft_ms = percentiles(measured_ok().filter_map(|record| record.ttft_us), speedup);
    let slow_ttft_requests = measured_ok()
        .filter_map(|record| record.ttft_us)
        .filter(|&us| us as f64 * speedup / 1000.0 > SLOW_TTFT_MS)
        .count() as u64;
    let loop_lag_p99_us = lag
        .as_ref()
        .map_or(0, |histogram| histogram.value_at_quantile(0.99));
    let probed: Vec<bool> = measured_ok()
        .filter_map(|record| record.prefix_resident)
        .collect();
    let prefix_resident_share = (!probed.is_empty())
        .then(|| probed.iter().filter(|resident| **resident).count() as f64 / probed.len() as f64);
    let may_limit_leg = requests > 0
        && loop_lag_p99_us as f64 * speedup / 1000.0 > HARNESS_LIMIT_FRACTION * ttft_ms.p99;
    LegSummary {
        name: first.name.clone(),
        kind: first.kind.describe().to_string(),
        runs: runs.len() as u32,
        requests,
        requests_sent,
        errors,
        downgrades,
        replications,
        history_evicted_share: history_tokens.and_then(HistoryTokens::evicted_share),
        downgrade_rate: downgrades
            .filter(|_| requests_sent > 0)
            .map(|count| count as f64 / requests_sent as f64),
        ttft_ms,
        e2e_ms: percentiles(measured_ok().filter_map(|record| record.e2e_us), speedup),
        throughput_rps: per_second(requests as f64),
        output_tokens_per_s: per_second(output_tokens as f64),
        cache_hit_rate: (measured.prefix_cache_queries > 0)
            .then(|| measured.prefix_cache_hits as f64 / measured.prefix_cache_queries as f64),
        cached_token_ratio: cached_tokens
            .filter(|_| prompt_tokens > 0)
            .map(|cached| cached as f64 / prompt_tokens as f64),
        evictions: total.evictions,
        preemptions: total.preemptions,
        slow_ttft_requests,
        p99_ttft_vs_oracle: None,
        prefix_reusable_requests: probed.len() as u64,
        prefix_resident_share,
        ttft_prediction: PredictionSummary::of(
            measured_ok().filter_map(|record| record.predicted_ttft_us.zip(record.ttft_us)),
            speedup,
        ),
        repeats: Vec::new(),
        spread: LegSpread::default(),
        harness: HarnessSummary {
            cpu_us_per_request: if harness_requests > 0 {
                cpu_us as f64 / harness_requests as f64
            } else {
                0.0
            },
            loop_lag_p99_us,
            loop_lag_max_us: lag.as_ref().map_or(0, |histogram| histogram.max()),
            oracle_probe_p50_us: probes
                .as_ref()
                .map(|histogram| histogram.value_at_quantile(0.5)),
            oracle_probe_p99_us: probes
                .as_ref()
                .map(|histogram| histogram.value_at_quantile(0.99)),
            may_limit_leg,
        },
    }
}

/// Summaries of every leg, in first-run order, with each leg's P99 TTFT against the oracle's
/// (medians across repeats).
pub fn summarize_all(runs: &[LegRun]) -> Vec<LegSummary> {
    let mut names: Vec<&str> = Vec::new();
    for run in runs {
        if !names.contains(&run.name.as_str()) {
            names.push(&run.name);
        }
    }
    let mut summaries: Vec<LegSummary> = names
        .iter()
        .map(|name| {
            let leg_runs: Vec<&LegRun> = runs.iter().filter(|run| run.name == *name).collect();
            summarize(&leg_runs)
        })
        .collect();
    let oracle_p99 = summaries
        .iter()
        .find(|summary| summary.kind == LegKind::Oracle.describe())
        .map(|oracle| oracle.spread.ttft_p99_ms.median)
        .filter(|p99| *p99 > 0.0);
    if let Some(oracle_p99) = oracle_p99 {
        for summary in &mut summaries {
            if summary.requests > 0 {
                summary.p99_ttft_vs_oracle = Some(summary.spread.ttft_p99_ms.median / oracle_p99);
            }
        }
    }
    summaries
}

/// Two legs whose ranges of one figure across repeats overlap: with this many repeats, the
/// difference between them is within what a leg varies from one repeat to the next.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Overlap {
    /// `ttft_p50_ms` or `ttft_p99_ms`.
    pub metric: &'static str,
    pub legs: [String; 2],
    /// Each leg's `[min, max]` across its repeats.
    pub ranges: [[f64; 2]; 2],
}

/// Every pair of legs whose TTFT P50 or P99 ranges across repeats overlap. Empty unless both
/// legs of a pair ran at least twice (one run has no range).
pub fn overlaps(legs: &[LegSummary]) -> Vec<Overlap> {
    let mut found = Vec::new();
    for (metric, pick) in [
        (
            "ttft_p50_ms",
            (|leg: &LegSummary| leg.spread.ttft_p50_ms) as fn(&LegSummary) -> Spread,
        ),
        ("ttft_p99_ms", |leg| leg.spread.ttft_p99_ms),
    ] {
        for (index, a) in legs.iter().enumerate() {
            for b in &legs[index + 1..] {
                if a.repeats.len() < 2 || b.repeats.len() < 2 || a.requests == 0 || b.requests == 0
                {
                    continue;
                }
                let (range_a, range_b) = (pick(a), pick(b));
                if range_a.overlaps(&range_b) {
                    found.push(Overlap {
                        metric,
                        legs: [a.name.clone(), b.name.clone()],
                        ranges: [[range_a.min, range_a.max], [range_b.min, range_b.max]],
                    });
                }
            }
        }
    }
    found
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::record::Outcome;

    pub fn record(sent_at_us: u64, ttft_us: u64, outcome: Outcome) -> RequestRecord {
        RequestRecord {
            user: 0,
            seq: 0,
            label: 0,
            sent_at_us,
            planned_send_s: None,
            ttft_us: Some(ttft_us),
            e2e_us: Some(ttft_us * 10),
            prompt_tokens: 1000,
            output_tokens: 100,
            cached_tokens: Some(500),
            backend: None,
            outcome,
            reusable_tokens: 0,
            resident_tokens: None,
            prefix_resident: None,
            predicted_ttft_us: None,
        }
    }

    pub fn run(name: &str, kind: LegKind, ttfts_us: &[u64]) -> LegRun {
        LegRun {
            name: name.into(),
            kind,
            repeat: 0,
            speedup: 10.0,
            warmup_s: 10.0,
            window_s: 100.0,
            // Sent at 2 simulated seconds (warm-up) and at 20 (measured).
            records: ttfts_us
                .iter()
                .flat_map(|&ttft| {
                    [
                        record(200_000, 1, Outcome::Ok),
                        record(2_000_000, ttft, Outcome::Ok),
                    ]
                })
                .collect(),
            engines_measured: EngineCounters {
                prefix_cache_queries: 1000,
                prefix_cache_hits: 250,
                evictions: Some(5),
                preemptions: 0,
            },
            engines_total: EngineCounters {
                prefix_cache_queries: 2000,
                prefix_cache_hits: 300,
                evictions: Some(7),
                preemptions: 1,
            },
            downgrades: kind.uses_myelin_router().then_some(2),
            replications: kind.uses_myelin_router().then_some(1),
            history_tokens: kind.uses_myelin_router().then_some(HistoryTokens {
                matched: 1000,
                evicted: 250,
            }),
            harness: HarnessCost {
                cpu_us: 5_000,
                requests: 2 * ttfts_us.len() as u64,
                loop_lag_us: vec![10, 20, 30],
                oracle_probe_us: Vec::new(),
            },
        }
    }

    #[test]
    fn percentiles_are_exact_to_a_tenth_of_a_percent_and_scaled_to_simulated_time() {
        // 1..=1000 ms in wall microseconds, speedup 1.
        let samples: Vec<u64> = (1..=1000).map(|ms| ms * 1000).collect();
        let result = percentiles(samples.iter().copied(), 1.0);
        for (value, expected) in [
            (result.p50, 500.0),
            (result.p90, 900.0),
            (result.p99, 990.0),
            (result.p999, 999.0),
        ] {
            assert!(
                (value - expected).abs() <= expected * 0.001,
                "{value} vs {expected}"
            );
        }
        let scaled = percentiles(samples.iter().copied(), 10.0);
        assert!((scaled.p50 - 5000.0).abs() <= 5.0);
        assert_eq!(percentiles(std::iter::empty(), 1.0), Percentiles::default());
    }

    #[test]
    fn summary_excludes_warmup_from_latency_but_counts_its_errors() {
        let mut leg = run(
            "round-robin",
            LegKind::RoundRobin,
            &[100_000, 200_000, 300_000],
        );
        leg.records.push(record(100, 1, Outcome::HttpStatus(503)));
        let summary = summarize(&[&leg]);
        assert_eq!(summary.requests, 3);
        assert_eq!(summary.requests_sent, 7);
        assert_eq!(summary.errors, 1);
        // Warm-up TTFTs of 1 us would pull P50 down; measured ones are 100..300 ms wall.
        assert!(
            (summary.ttft_ms.p50 - 2000.0).abs() < 3.0,
            "{}",
            summary.ttft_ms.p50
        );
        assert!((summary.throughput_rps - 0.03).abs() < 1e-9);
        assert!((summary.output_tokens_per_s - 3.0).abs() < 1e-9);
        assert_eq!(summary.cache_hit_rate, Some(0.25));
        assert_eq!(summary.cached_token_ratio, Some(0.5));
        assert_eq!((summary.evictions, summary.preemptions), (Some(7), 1));
        assert_eq!(summary.downgrades, Some(2));
        // Measured TTFTs of 1, 2 and 3 simulated s: only the last is over 2 s.
        assert_eq!(summary.slow_ttft_requests, 1);
        assert_eq!(summary.repeats[0].slow_ttft_requests, 1);
        assert!((summary.harness.cpu_us_per_request - 5000.0 / 6.0).abs() < 1e-9);
        // A 30 us lag is 0.3 simulated ms against a TTFT P99 of 3 s: not limiting.
        assert!(!summary.harness.may_limit_leg);
        leg.harness.loop_lag_us = vec![100_000; 10];
        assert!(summarize(&[&leg]).harness.may_limit_leg);
    }

    #[test]
    fn repeats_merge_and_oracle_ratio_is_set() {
        let runs = vec![
            run("round-robin", LegKind::RoundRobin, &[400_000]),
            run("oracle", LegKind::Oracle, &[100_000]),
            run("round-robin", LegKind::RoundRobin, &[400_000]),
        ];
        let summaries = summarize_all(&runs);
        assert_eq!(summaries.len(), 2);
        assert_eq!(summaries[0].name, "round-robin");
        assert_eq!(summaries[0].runs, 2);
        assert_eq!(summaries[0].requests, 2);
        assert_eq!(summaries[0].downgrades, Some(4));
        assert_eq!(summaries[1].downgrades, None);
        let ratio = summaries[0].p99_ttft_vs_oracle.unwrap();
        assert!((ratio - 4.0).abs() < 0.01, "{ratio}");
        assert_eq!(summaries[1].p99_ttft_vs_oracle, Some(1.0));
    }

    #[test]
    fn the_evicted_history_share_pools_tokens_and_each_repeat_keeps_its_own() {
        let mut first = run("prefix+auto", LegKind::RoundRobin, &[100_000]);
        first.history_tokens = Some(HistoryTokens {
            matched: 1_000,
            evicted: 500,
        });
        let mut second = run("prefix+auto", LegKind::RoundRobin, &[100_000]);
        second.repeat = 1;
        second.history_tokens = Some(HistoryTokens {
            matched: 3_000,
            evicted: 0,
        });
        let summary = summarize(&[&first, &second]);
        // 500 of 4,000 tokens, not the mean of 0.5 and 0.
        assert_eq!(summary.history_evicted_share, Some(0.125));
        let shares: Vec<_> = summary
            .repeats
            .iter()
            .map(|figures| figures.history_evicted_share)
            .collect();
        assert_eq!(shares, [Some(0.5), Some(0.0)]);
        second.history_tokens = Some(HistoryTokens::default());
        assert_eq!(summarize(&[&second]).history_evicted_share, None);
    }

    fn close(value: f64, expected: f64) -> bool {
        (value - expected).abs() <= expected * 0.001
    }

    /// A leg run `repeat` (0-based) whose measured requests all take `ttft_us`.
    fn repeat_of(name: &str, repeat: u32, ttft_us: u64) -> LegRun {
        let mut leg = run(name, LegKind::RoundRobin, &[ttft_us]);
        leg.repeat = repeat;
        leg
    }

    #[test]
    fn every_repeat_keeps_its_own_figures_and_the_spread_is_their_median_and_range() {
        // 100, 300 and 200 ms wall at speedup 10: 1, 3 and 2 simulated seconds.
        let runs = [
            repeat_of("round-robin", 0, 100_000),
            repeat_of("round-robin", 1, 300_000),
            repeat_of("round-robin", 2, 200_000),
        ];
        let summary = summarize(&runs.iter().collect::<Vec<_>>());
        let repeats: Vec<u32> = summary
            .repeats
            .iter()
            .map(|figures| figures.repeat)
            .collect();
        assert_eq!(repeats, [1, 2, 3]);
        let p99s: Vec<f64> = summary
            .repeats
            .iter()
            .map(|figures| figures.ttft_ms.p99)
            .collect();
        assert!(close(p99s[0], 1000.0) && close(p99s[1], 3000.0) && close(p99s[2], 2000.0));
        let spread = summary.spread.ttft_p99_ms;
        assert!(close(spread.median, 2000.0), "{spread:?}");
        assert!(
            close(spread.min, 1000.0) && close(spread.max, 3000.0),
            "{spread:?}"
        );
        // Each repeat counts its own requests; the pooled figures count them all.
        assert!(summary.repeats.iter().all(|figures| figures.requests == 1));
        assert_eq!(summary.requests, 3);
        assert_eq!(
            summary.spread.cache_hit_rate.map(|rate| rate.median),
            Some(0.25)
        );
    }

    #[test]
    fn spread_medians_and_overlaps() {
        let even = Spread::of([4.0, 1.0, 3.0, 2.0]);
        assert_eq!((even.median, even.min, even.max), (2.5, 1.0, 4.0));
        assert_eq!(Spread::of([7.0]).median, 7.0);
        assert_eq!(Spread::of([]), Spread::default());
        let a = Spread::of([1.0, 3.0]);
        assert!(a.overlaps(&Spread::of([3.0, 5.0])));
        assert!(!a.overlaps(&Spread::of([3.5, 5.0])));
    }

    #[test]
    fn overlapping_p99_ranges_are_reported_pairwise_and_single_runs_never() {
        let runs = vec![
            repeat_of("a", 0, 100_000),
            repeat_of("b", 0, 250_000),
            repeat_of("c", 0, 500_000),
            repeat_of("a", 1, 300_000),
            repeat_of("b", 1, 260_000),
            repeat_of("c", 1, 600_000),
        ];
        let legs = summarize_all(&runs);
        let found = overlaps(&legs);
        let pairs: Vec<(&str, &str, &str)> = found
            .iter()
            .map(|overlap| (overlap.metric, &*overlap.legs[0], &*overlap.legs[1]))
            .collect();
        // a spans 1-3 s and b 2.5-2.6 s; c (5-6 s) overlaps neither.
        assert_eq!(
            pairs,
            [("ttft_p50_ms", "a", "b"), ("ttft_p99_ms", "a", "b")]
        );
        assert!(close(found[1].ranges[0][1], 3000.0));
        let single = summarize_all(&runs[..3]);
        assert!(overlaps(&single).is_empty());
    }
}
