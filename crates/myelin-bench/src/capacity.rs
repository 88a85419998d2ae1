//! The cluster's capacity for an open-loop workload, measured before the run on the simulator's
//! sans-IO engine model in simulated time: no sockets, no wall clock, the same answer on every
//! machine and every leg.
//!
//! Capacity is what round-robin routing sustains: every engine is kept saturated (a request
//! always waiting, so it admits whenever its token budget and KV blocks allow, and preempts
//! when they run out, as vLLM does under overload) with its own stream of the workload's
//! requests (prefixes uniform over the active set at the engine's simulated time, as a
//! cache-blind router spreads them), and the completions of all engines over a measuring
//! window after a warm-up, per simulated second, are the capacity. Cache-aware routing gets
//! more out of the same cluster (more prefix hits); a rate below 1.0 of this capacity is one
//! every leg can serve without its queues growing without bound.
//!
//! Each workload's stream: churn, a prefix of the active set at the engine's time and a suffix
//! unique to (engine, request); shared prefix, a group's system prompt and a question (unique
//! to the request in the open-loop form); multi-turn and trace, the workload's own sequence
//! dealt round-robin (request `n` of engine `e` is the sequence's `n x engines + e`, the trace
//! wrapping around), so consecutive turns of a conversation land on different engines, as a
//! cache-blind router sends them.

use std::time::Duration;

use myelin_sim::engine::{EngineConfig, EngineModel, OutputVocabulary, RequestSpec};

use crate::workload::churn::ChurnWorkload;
use crate::workload::config::{WorkloadConfig, WorkloadError, WorkloadKind};
use crate::workload::multi_turn::{ConversationSlots, Conversations};
use crate::workload::shared_prefix::SharedPrefixWorkload;
use crate::workload::trace::TraceWorkload;
use crate::workload::{PlannedRequest, TokenAlphabet};

/// Where each saturated engine's requests come from.
enum Source {
    Churn(ChurnWorkload),
    SharedPrefix(SharedPrefixWorkload),
    SharedPrefixOpen(SharedPrefixWorkload),
    MultiTurn {
        conversations: Conversations,
        slots: ConversationSlots,
        /// The sequence's (conversation, turn) so far.
        sequence: Vec<(u64, u32)>,
    },
    Trace(TraceWorkload),
}

impl Source {
    fn new(config: &WorkloadConfig) -> Result<Self, WorkloadError> {
        let alphabet = TokenAlphabet::token_ids();
        Ok(match config.kind {
            WorkloadKind::Churn | WorkloadKind::ChurnOpen => {
                Source::Churn(ChurnWorkload::new(config, alphabet))
            }
            WorkloadKind::SharedPrefix => {
                Source::SharedPrefix(SharedPrefixWorkload::new(config, alphabet))
            }
            WorkloadKind::SharedPrefixOpen => {
                Source::SharedPrefixOpen(SharedPrefixWorkload::new(config, alphabet))
            }
            WorkloadKind::MultiTurn => {
                let conversations = Conversations::new(config, alphabet);
                Source::MultiTurn {
                    slots: ConversationSlots::new(config.seed, conversations.settings()),
                    conversations,
                    sequence: Vec::new(),
                }
            }
            WorkloadKind::Trace => Source::Trace(TraceWorkload::load(config, alphabet)?),
        })
    }

    /// Request `n` of engine `engine` (of `engines`), asked at `now_s` of the engine's time.
    fn request(&mut self, engine: u32, engines: u32, n: u64, now_s: f64) -> PlannedRequest {
        // The engine's own keys: above every user's of the closed loop.
        let key = (1 << 62) | (u64::from(engine) << 40) | n;
        let dealt = n * u64::from(engines) + u64::from(engine);
        match self {
            Source::Churn(churn) => churn.keyed_request(key, now_s),
            Source::SharedPrefix(shared) => shared.request((1 << 20) | engine, n),
            Source::SharedPrefixOpen(shared) => shared.unique_request(key),
            Source::MultiTurn {
                conversations,
                slots,
                sequence,
            } => {
                while sequence.len() as u64 <= dealt {
                    sequence.push(slots.next_turn());
                }
                let (conversation, turn) = sequence[dealt as usize];
                conversations.request(conversation, turn)
            }
            Source::Trace(trace) => trace.request((dealt % trace.len().max(1) as u64) as usize),
        }
    }
}

/// Simulated seconds each engine runs before the measuring window (caches fill, the first
/// rotations pass).
pub const WARMUP_S: f64 = 60.0;
/// Simulated seconds over which completions are counted.
pub const WINDOW_S: f64 = 240.0;

/// A measured capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Requests per simulated second, whole cluster.
    pub requests_per_s: f64,
    /// Requests completed in the window, whole cluster.
    pub completed: u64,
    /// The window, simulated seconds.
    pub window_s: f64,
}

/// Measures the capacity of `config`'s cluster under its requests (see the module).
pub fn measure(config: &WorkloadConfig) -> Result<Capacity, WorkloadError> {
    measure_over(config, WARMUP_S, WINDOW_S)
}

/// [`measure`] with another warm-up and window.
pub fn measure_over(
    config: &WorkloadConfig,
    warmup_s: f64,
    window_s: f64,
) -> Result<Capacity, WorkloadError> {
    let invalid = |problem: String| WorkloadError::Invalid {
        name: config.name.clone(),
        problem,
    };
    let profile = myelin_sim::perf::profile_by_name(&config.cluster.profile)
        .ok_or_else(|| invalid(format!("unknown profile `{}`", config.cluster.profile)))?;
    let mut source = Source::new(config)?;
    let engine_config = EngineConfig {
        block_size: config.cluster.block_size as usize,
        num_gpu_blocks: config.cluster.kv_blocks as usize,
        ..EngineConfig::for_profile(profile.as_ref())
    };
    let end = Duration::from_secs_f64(warmup_s + window_s);
    let warmup = Duration::from_secs_f64(warmup_s);
    let mut completed = 0;
    for engine_index in 0..config.cluster.engines {
        let mut engine = EngineModel::new(
            engine_config.clone(),
            profile.clone(),
            OutputVocabulary::default(),
        );
        let mut now = Duration::ZERO;
        let mut next = 0u64;
        while now < end {
            if engine.num_waiting() == 0 {
                let request = source.request(
                    engine_index,
                    config.cluster.engines,
                    next,
                    now.as_secs_f64(),
                );
                next += 1;
                let spec = RequestSpec {
                    prompt_token_ids: request.tokens,
                    max_tokens: Some(request.output_tokens as usize),
                    ignore_eos: true,
                    ..RequestSpec::default()
                };
                if let Err(error) = engine.add_request(next, spec) {
                    return Err(invalid(format!("measuring capacity: {error}")));
                }
            }
            let Some(step) = engine.schedule() else {
                break;
            };
            now += step.step_time;
            let finished = engine
                .complete_step(&step)
                .iter()
                .filter(|output| output.finished.is_some())
                .count() as u64;
            if now > warmup && now <= end {
                completed += finished;
            }
        }
    }
    Ok(Capacity {
        requests_per_s: completed as f64 / window_s,
        completed,
        window_s,
    })
}

/// Whether [`resolve_rate`] would measure the capacity on the engine model (an open-loop or
/// trace workload given neither a rate nor a capacity).
pub fn needs_measurement(config: &WorkloadConfig) -> bool {
    if config.kind == WorkloadKind::Trace {
        return config
            .trace
            .as_ref()
            .is_some_and(|trace| trace.capacity_rps.is_none());
    }
    config.kind.is_poisson()
        && config
            .open_loop
            .as_ref()
            .is_some_and(|open| open.rate_rps.is_none() && open.capacity_rps.is_none())
}

/// For a Poisson workload (churn-open, shared-prefix-open, multi-turn) without a `rate_rps`:
/// measures the capacity (unless the file gives `capacity_rps`) and sets `rate_rps =
/// rate_fraction x capacity_rps`. For a trace without `capacity_rps`: measures it (the offered
/// load of the regime line; the replay's rate stays the trace's). Closed-loop workloads are left
/// as they are. Returns the capacity when it was measured.
pub fn resolve_rate(config: &mut WorkloadConfig) -> Result<Option<Capacity>, WorkloadError> {
    if config.kind == WorkloadKind::Trace {
        if config
            .trace
            .as_ref()
            .is_none_or(|trace| trace.capacity_rps.is_some())
        {
            return Ok(None);
        }
        let capacity = measure(config)?;
        if let Some(trace) = config.trace.as_mut() {
            trace.capacity_rps = Some(capacity.requests_per_s.max(f64::MIN_POSITIVE));
        }
        config.validate()?;
        return Ok(Some(capacity));
    }
    if !config.kind.is_poisson() {
        return Ok(None);
    }
    let Some(open) = config.open_loop.clone() else {
        return Ok(None);
    };
    if open.rate_rps.is_some() {
        return Ok(None);
    }
    let (capacity_rps, measured) = match open.capacity_rps {
        Some(capacity_rps) => (capacity_rps, None),
        None => {
            let capacity = measure(config)?;
            (capacity.requests_per_s, Some(capacity))
        }
    };
    if let Some(settings) = config.open_loop.as_mut() {
        settings.capacity_rps = Some(capacity_rps);
        settings.rate_rps = Some(open.rate_fraction * capacity_rps);
    }
    config.validate()?;
    Ok(measured)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One engine of the churn cluster.
    fn small() -> WorkloadConfig {
        let mut config = WorkloadConfig::load("churn-open").unwrap();
        config.cluster.engines = 1;
        config
    }

    #[test]
    fn capacity_is_deterministic_and_grows_with_the_cluster() {
        let one = measure_over(&small(), 20.0, 60.0).unwrap();
        let again = measure_over(&small(), 20.0, 60.0).unwrap();
        assert_eq!(one, again, "a pure function of the workload");
        assert!(one.completed > 0);
        let mut bigger = small();
        bigger.cluster.engines = 2;
        let two = measure_over(&bigger, 20.0, 60.0).unwrap();
        assert!(two.completed > one.completed, "{two:?} vs {one:?}");
    }

    #[test]
    fn more_kv_means_more_capacity() {
        // Long enough for the roomy engine's deep batches to reach their steady state.
        let tight = measure_over(&small(), 60.0, 240.0).unwrap();
        let mut roomy = small();
        roomy.cluster.kv_blocks *= 8;
        let roomy = measure_over(&roomy, 60.0, 240.0).unwrap();
        assert!(
            roomy.requests_per_s > tight.requests_per_s,
            "{roomy:?} vs {tight:?}"
        );
    }

    #[test]
    fn the_rate_is_the_fraction_of_the_capacity() {
        let mut config = small();
        config.open_loop.as_mut().unwrap().capacity_rps = Some(4.0);
        assert_eq!(resolve_rate(&mut config).unwrap(), None, "nothing measured");
        let open = config.open_loop.clone().unwrap();
        assert_eq!(open.rate_rps, Some(0.8 * 4.0));
        // Measured when the file gives neither.
        let mut measured = small();
        measured.open_loop.as_mut().unwrap().capacity_rps = None;
        let capacity = resolve_rate(&mut measured).unwrap().expect("measured");
        let open = measured.open_loop.unwrap();
        assert_eq!(open.capacity_rps, Some(capacity.requests_per_s));
        assert_eq!(open.rate_rps, Some(0.8 * capacity.requests_per_s));
        // Closed-loop workloads are untouched, and so is a trace whose capacity is given.
        let mut churn = WorkloadConfig::load("churn").unwrap();
        let before = churn.clone();
        assert_eq!(resolve_rate(&mut churn).unwrap(), None);
        assert_eq!(churn, before);
        let mut trace = WorkloadConfig::load("trace").unwrap();
        trace.trace.as_mut().unwrap().capacity_rps = Some(1.5);
        let before = trace.clone();
        assert_eq!(resolve_rate(&mut trace).unwrap(), None);
        assert_eq!(trace, before);
    }

    #[test]
    fn every_open_loop_kind_has_a_capacity() {
        for name in ["shared-prefix-open", "multi-turn", "trace"] {
            let mut config = WorkloadConfig::load(name).unwrap();
            config.cluster.engines = 2;
            if let Some(trace) = config.trace.as_mut() {
                trace.max_requests = Some(40);
            }
            let capacity = measure_over(&config, 10.0, 40.0).unwrap();
            assert!(capacity.completed > 0, "{name}: {capacity:?}");
            assert_eq!(
                capacity,
                measure_over(&config, 10.0, 40.0).unwrap(),
                "{name}: a pure function of the workload"
            );
        }
        // A trace's capacity is measured for its regime line; its rate stays the trace's.
        let mut trace = WorkloadConfig::load("trace").unwrap();
        trace.cluster.engines = 2;
        trace.trace.as_mut().unwrap().max_requests = Some(20);
        let measured = resolve_rate(&mut trace).unwrap().expect("measured");
        let settings = trace.trace.unwrap();
        assert_eq!(settings.capacity_rps, Some(measured.requests_per_s));
        assert_eq!(settings.time_scale, 4.0);
    }
}
