//! The embedded simulated cluster a leg runs on (crates/myelin-sim): started fresh for every
//! leg (caches empty), exposing its engines as router backends, their counters, and the
//! oracle's probe.

use std::sync::Arc;

use myelin_sim::{ClusterConfig, EngineConfig, FaultConfig, KvEventsConfig, SimCluster};

use myelin_routing::{EngineQueue, KvMemory, MemoryPressure};

use crate::oracle::{CacheOracle, EngineTruth};
use crate::router_process::BackendEndpoint;
use crate::stats::EngineCounters;
use crate::workload::config::ClusterSettings;

/// Why the simulated cluster could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("starting the simulated engines: {0}")]
    Start(#[from] myelin_sim::SimError),
}

/// A running simulated cluster; dropping it stops the engines.
pub struct EmbeddedCluster {
    sim: Arc<SimCluster>,
    block_size: u32,
    /// Each engine's KV capacity in tokens for the routers' backend specs, when the engines
    /// serve no metrics.
    configured_capacity: Option<u64>,
}

/// Starts `settings.engines` simulated engines on loopback ephemeral ports, publishing KV
/// events when `kv_events` (the verified and auto residency legs read them).
pub fn start_cluster(
    settings: &ClusterSettings,
    kv_events: bool,
) -> Result<EmbeddedCluster, ClusterError> {
    // vLLM's scheduler limits for the profile's GPU (an unknown profile is refused below).
    let defaults = myelin_sim::perf::profile_by_name(&settings.profile)
        .map(|profile| EngineConfig::for_profile(profile.as_ref()))
        .unwrap_or_default();
    let engine = EngineConfig {
        block_size: settings.block_size as usize,
        num_gpu_blocks: settings.kv_blocks as usize,
        ..defaults
    };
    let sim = SimCluster::start(ClusterConfig {
        engines: settings.engines as usize,
        base_port: 0,
        profile: settings.profile.clone(),
        speedup: settings.speedup,
        engine,
        kv_events: kv_events.then(KvEventsConfig::default),
        faults: FaultConfig {
            no_metrics: !settings.engine_metrics,
            ..FaultConfig::default()
        },
        ..ClusterConfig::default()
    })?;
    Ok(EmbeddedCluster {
        sim: Arc::new(sim),
        block_size: settings.block_size,
        // Without metrics the router cannot scrape the capacity: it is configured instead.
        configured_capacity: (!settings.engine_metrics)
            .then(|| u64::from(settings.kv_blocks) * u64::from(settings.block_size)),
    })
}

impl EmbeddedCluster {
    /// The engines, in order, as router backends.
    pub fn backends(&self) -> Vec<BackendEndpoint> {
        let events = self.sim.kv_event_endpoints();
        self.sim
            .engine_urls()
            .into_iter()
            .enumerate()
            .map(|(engine, url)| BackendEndpoint {
                url,
                kv_events: events
                    .get(engine)
                    .and_then(|endpoints| endpoints.as_ref())
                    .map(|endpoints| endpoints.publish.clone()),
                kv_replay: events
                    .get(engine)
                    .and_then(|endpoints| endpoints.as_ref())
                    .map(|endpoints| endpoints.replay.clone()),
                capacity_tokens: self.configured_capacity,
            })
            .collect()
    }

    /// Counters summed over the engines since they started.
    pub fn counters(&self) -> EngineCounters {
        let mut sum = EngineCounters::default();
        for engine in self.sim.counters() {
            sum.add(&EngineCounters {
                prefix_cache_queries: engine.prefix_cache_queries,
                prefix_cache_hits: engine.prefix_cache_hits,
                evictions: Some(engine.evictions),
                preemptions: engine.preemptions,
            });
        }
        sum
    }

    /// Tokens per KV block of the engines.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The oracle's view of the engines' true state.
    pub fn oracle(&self) -> Arc<dyn CacheOracle> {
        Arc::new(SimOracle {
            sim: self.sim.clone(),
        })
    }

    /// Stops every engine (waits for their threads).
    pub fn stop(self) {
        match Arc::try_unwrap(self.sim) {
            Ok(sim) => sim.shutdown(),
            // The oracle still holds it: dropping the last handle stops it.
            Err(shared) => drop(shared),
        }
    }
}

/// The oracle over the embedded simulator's in-process probe.
struct SimOracle {
    sim: Arc<SimCluster>,
}

impl CacheOracle for SimOracle {
    fn probe(&self, prompt_tokens: &[u32]) -> Vec<EngineTruth> {
        self.sim
            .probe(prompt_tokens)
            .into_iter()
            .map(|probe| EngineTruth {
                // The leading tokens whose full blocks the engine holds: what an exact KV-event
                // mirror shows the router.
                cached_tokens: probe.cached_prefix_tokens as u64,
                // The router's load measure, in true values: prefill still to do (net of cache)
                // plus output tokens still to generate.
                queued_tokens: (probe.load.pending_prefill_tokens
                    + probe.load.pending_decode_tokens) as u64,
                requests_received: Some(probe.requests_received),
                // The true inputs of the expected wait for KV memory: what the engine's gauges
                // say at this instant, and the output its requests still owe.
                memory: Some(MemoryPressure {
                    utilization: probe.load.kv_usage,
                    waiting_requests: probe.load.waiting as u32,
                    running_requests: probe.load.running as u32,
                    mean_remaining_output_tokens: probe.load.pending_decode_tokens as f64
                        / (probe.load.running + probe.load.waiting).max(1) as f64,
                }),
                // The predicted time to first token's inputs, true: the prefill still to do,
                // the decoding requests, and the KV memory held now plus what the prefill
                // still to do will take, the prompt's prefix that running requests hold shared
                // and the output they still owe.
                queue: Some(EngineQueue {
                    prefill_tokens_ahead: probe.load.pending_prefill_tokens as u64,
                    prefill_pairs_ahead: probe.load.pending_prefill_pairs,
                    requests: (probe.load.running + probe.load.waiting) as u32,
                    decoding: probe.load.decoding as u32,
                    mean_remaining_output_tokens: probe.load.pending_decode_tokens as f64
                        / (probe.load.running + probe.load.waiting).max(1) as f64,
                    // The true mean over every request in flight, spread evenly.
                    waiting_output_tokens: None,
                    memory: Some(KvMemory {
                        capacity_tokens: probe.capacity_tokens as u64,
                        held_tokens: probe.load.kv_usage * probe.capacity_tokens as f64
                            + probe.load.pending_prefill_tokens as f64,
                        shared_tokens: probe.held_prefix_tokens as u64,
                        growth_tokens: probe.load.pending_decode_tokens as f64,
                    }),
                }),
                step_tokens: u32::try_from(probe.step_tokens).ok(),
            })
            .collect()
    }
}
