//! Simulated vLLM engines: a faithful model of vLLM v1's scheduler and prefix cache, served
//! over vLLM's OpenAI-compatible HTTP API, publishing real vLLM KV-event bytes over ZMQ.
//!
//! # Layout
//! - [`engine`] (sans-IO): requests, scheduler (token budget, decodes first, chunked prefill,
//!   preemption of the newest request), prefix cache with the real `sha256_cbor` hash chain.
//! - [`block_pool`] (sans-IO): blocks, reference counts, LRU free queue, lazy eviction, events.
//! - [`perf`]: step-time models; the default `a100-40gb-llama-3.1-8b` profile.
//! - [`host`], [`api`], [`openai`], [`text`], [`metrics`]: the I/O shell (glommio step loop,
//!   HTTP routes, response shapes, tokenizer, `/metrics`).
//! - [`publisher`]: the ZMQ PUB + ROUTER replay edge on its own thread.
//! - [`cluster`]: the embedding API; [`cli`]: `myelin sim`.
//!
//! # Embedding
//! ```no_run
//! use myelin_sim::{ClusterConfig, KvEventsConfig, SimCluster};
//!
//! let cluster = SimCluster::start(ClusterConfig {
//!     engines: 4,
//!     speedup: 10.0,
//!     kv_events: Some(KvEventsConfig::default()),
//!     ..ClusterConfig::default()
//! })?;
//! let urls = cluster.engine_urls(); // http://127.0.0.1:PORT, one per engine
//! let events = cluster.kv_event_endpoints(); // Some(KvEventEndpoints { publish, replay })
//! let truth = cluster.probe(&[1, 2, 3]); // per engine: cached prefix tokens, queued work
//! let counters = cluster.counters(); // per engine: hits, queries, preemptions, evictions
//! cluster.shutdown(); // or drop it
//! # Ok::<(), myelin_sim::SimError>(())
//! ```

pub mod api;
pub mod block_pool;
pub mod cli;
pub mod cluster;
pub mod engine;
pub mod faults;
pub mod host;
pub mod metrics;
pub mod openai;
pub mod perf;
pub mod publisher;
pub mod text;

pub use cli::{SimArgs, run};
pub use cluster::{
    ClusterConfig, DEFAULT_MODEL_NAME, EngineProbe, KvEventEndpoints, KvEventsConfig, SimCluster,
    SimError,
};
pub use engine::{EngineConfig, EngineCounters, EngineLoad};
pub use faults::FaultConfig;
pub use myelin_kv_events::WireVersion;
