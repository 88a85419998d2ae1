//! The embedding API: start N simulated engines in this process ([`SimCluster::start`]), each
//! with its HTTP server and optional KV-event publisher, spread over a few glommio executor
//! threads; read their URLs and event endpoints; probe their true cache state (the oracle the
//! harness compares routers against); stop them.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use glommio::ExecutorJoinHandle;
use glommio::net::TcpListener;
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::server::{ServerConfig, Shutdown, serve};
use myelin_kv_events::{WireVersion, hash_token_blocks};

use crate::engine::{EngineConfig, EngineCounters, EngineLoad, EngineModel};
use crate::faults::FaultConfig;
use crate::host::{EngineSettings, EngineShared, KvEventSource, LocalEngine};
use crate::perf::{A100_LLAMA_8B_PROFILE, PROFILE_NAMES, profile_by_name};
use crate::publisher::{DEFAULT_BUFFER_STEPS, KvPublisher, PublisherConfig, PublisherError};
use crate::text::{TextError, TextModel};

/// The model name engines report by default.
pub const DEFAULT_MODEL_NAME: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// How often executors check the cluster's stop flag.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(20);

/// How long `start` waits for every engine to bind.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stopping engine lets open connections finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// KV-event publishing for every engine of a cluster.
#[derive(Clone, Debug)]
pub struct KvEventsConfig {
    /// Engine i publishes on `base_port + 2i` and serves replay on `base_port + 2i + 1`;
    /// 0 = ephemeral ports.
    pub base_port: u16,
    /// Host or address to bind (`*` = all interfaces).
    pub bind_host: String,
    /// Topic frame.
    pub topic: String,
    /// Payload layout.
    pub wire: WireVersion,
    /// Batches kept for replay.
    pub buffer_steps: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            base_port: 0,
            bind_host: "127.0.0.1".to_string(),
            topic: String::new(),
            wire: WireVersion::default(),
            buffer_steps: DEFAULT_BUFFER_STEPS,
        }
    }
}

/// Everything [`SimCluster::start`] needs.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Number of engines.
    pub engines: usize,
    /// Address the HTTP servers bind.
    pub listen_host: IpAddr,
    /// Engine i listens on `base_port + i`; 0 = ephemeral ports.
    pub base_port: u16,
    /// Performance profile name (see [`PROFILE_NAMES`]).
    pub profile: String,
    /// All simulated times are divided by this.
    pub speedup: f64,
    /// Scheduler and KV cache settings of every engine. Build them with
    /// [`EngineConfig::for_profile`] so the scheduler limits are vLLM's for the profile's GPU
    /// (`EngineConfig::default()` has the default profile's).
    pub engine: EngineConfig,
    /// KV events, when enabled.
    pub kv_events: Option<KvEventsConfig>,
    /// Faults injected into every engine.
    pub faults: FaultConfig,
    /// Model name reported by `/v1/models` and responses.
    pub model_name: String,
    /// LoRA adapters served besides the base model (`--lora-adapter`): listed by `/v1/models`
    /// with the model as parent; a request naming one is keyed by it in the prefix cache.
    pub lora_adapters: Vec<String>,
    /// Tokenizer file (`None`: the bundled DeepSeek-V3 tokenizer, as the router's default).
    pub tokenizer_path: Option<PathBuf>,
    /// Chat template (`tokenizer_config.json` or Jinja file; `None`: ChatML).
    pub chat_template_path: Option<PathBuf>,
    /// Executor threads hosting the engines (0 = one per engine up to the available cores).
    pub executor_threads: usize,
    /// Serve HTTPS with this certificate and key (`--tls-cert`, `--tls-key`), as an engine
    /// behind a TLS terminator would.
    pub tls: Option<myelin_http::tls::ServerTlsFiles>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            engines: 1,
            listen_host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            base_port: 0,
            profile: A100_LLAMA_8B_PROFILE.to_string(),
            speedup: 1.0,
            engine: EngineConfig::default(),
            kv_events: None,
            faults: FaultConfig::default(),
            model_name: DEFAULT_MODEL_NAME.to_string(),
            lora_adapters: Vec::new(),
            tokenizer_path: None,
            chat_template_path: None,
            executor_threads: 0,
            tls: None,
        }
    }
}

/// Why a cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The configuration is unusable.
    #[error("invalid simulator configuration: {0}")]
    Config(String),
    /// Tokenizer or chat template.
    #[error(transparent)]
    Text(#[from] TextError),
    /// KV-event sockets.
    #[error(transparent)]
    Publisher(#[from] PublisherError),
    /// An executor or listener failed.
    #[error("engine {engine}: {message}")]
    Engine {
        /// Engine index.
        engine: usize,
        /// What failed.
        message: String,
    },
    /// Executor thread start failure.
    #[error("cannot start an executor thread: {0}")]
    Executor(std::io::Error),
}

/// Where to find one engine's KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventEndpoints {
    /// PUB endpoint to connect a SUB socket to (`tcp://host:port`).
    pub publish: String,
    /// ROUTER replay endpoint to connect a DEALER socket to.
    pub replay: String,
}

/// What the oracle sees in one engine for a token sequence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineProbe {
    /// Engine index.
    pub engine: usize,
    /// Leading tokens of the sequence whose full blocks are in the engine's prefix cache now.
    pub cached_prefix_tokens: usize,
    /// What a request with exactly this prompt would be served from cache (the last token is
    /// always recomputed, so at most `len - 1` rounded down to a block).
    pub prompt_hit_tokens: usize,
    /// Queued work and cache usage.
    pub load: EngineLoad,
    /// Requests the engine has accepted since it started.
    pub requests_received: u64,
    /// Of `cached_prefix_tokens`, those held by requests in flight (shared memory).
    pub held_prefix_tokens: usize,
    /// KV capacity in tokens.
    pub capacity_tokens: usize,
    /// Tokens per scheduler step.
    pub step_tokens: usize,
}

/// N simulated engines running in this process. Dropping it stops them.
pub struct SimCluster {
    engines: Vec<Arc<EngineShared>>,
    /// `http` or `https` (with [`ClusterConfig::tls`]).
    scheme: &'static str,
    block_size: usize,
    addresses: Vec<SocketAddr>,
    kv_endpoints: Vec<Option<KvEventEndpoints>>,
    stop: Arc<AtomicBool>,
    executors: Vec<ExecutorJoinHandle<()>>,
}

impl std::fmt::Debug for SimCluster {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SimCluster")
            .field("addresses", &self.addresses)
            .field("kv_endpoints", &self.kv_endpoints)
            .finish()
    }
}

/// A ZMQ endpoint a client can connect to for something bound on `bind_host:port`.
fn connectable(bind_host: &str, bound: &str) -> String {
    let port = bound.rsplit(':').next().unwrap_or_default();
    let host = match bind_host {
        "*" | "0.0.0.0" | "" => "127.0.0.1",
        "::" | "[::]" => "[::1]",
        other => other,
    };
    format!("tcp://{host}:{port}")
}

fn zmq_bind_endpoint(bind_host: &str, port: u16) -> String {
    if port == 0 {
        format!("tcp://{bind_host}:*")
    } else {
        format!("tcp://{bind_host}:{port}")
    }
}

impl SimCluster {
    /// Starts the engines; returns once every HTTP listener and KV socket is bound.
    pub fn start(config: ClusterConfig) -> Result<SimCluster, SimError> {
        if config.engines == 0 {
            return Err(SimError::Config(
                "at least one engine is needed".to_string(),
            ));
        }
        if !(config.speedup.is_finite() && config.speedup > 0.0) {
            return Err(SimError::Config(format!(
                "speedup must be a positive number, not {}",
                config.speedup
            )));
        }
        if config.engine.block_size == 0 || config.engine.num_gpu_blocks == 0 {
            return Err(SimError::Config(
                "block size and KV blocks must be positive".to_string(),
            ));
        }
        if config.engine.max_num_batched_tokens == 0 || config.engine.max_num_seqs == 0 {
            return Err(SimError::Config(
                "max_num_batched_tokens and max_num_seqs must be positive".to_string(),
            ));
        }
        let performance = profile_by_name(&config.profile).ok_or_else(|| {
            SimError::Config(format!(
                "unknown profile {:?} (known: {})",
                config.profile,
                PROFILE_NAMES.join(", ")
            ))
        })?;
        let tls = match &config.tls {
            Some(files) => Some(
                myelin_http::tls::ServerTls::load(files.clone(), true)
                    .map_err(|error| SimError::Config(format!("TLS: {error}")))?,
            ),
            None => None,
        };
        let port_for = |base: u16, offset: usize| -> Result<u16, SimError> {
            if base == 0 {
                return Ok(0);
            }
            u16::try_from(usize::from(base) + offset)
                .map_err(|_| SimError::Config(format!("port {base}+{offset} is out of range")))
        };
        let text = Arc::new(TextModel::load(
            config.tokenizer_path.as_deref(),
            config.chat_template_path.as_deref(),
        )?);
        let context = zmq::Context::new();
        let mut engines = Vec::with_capacity(config.engines);
        let mut kv_endpoints = Vec::with_capacity(config.engines);
        for index in 0..config.engines {
            let publisher = match &config.kv_events {
                Some(kv) => {
                    let publish_port = port_for(kv.base_port, 2 * index)?;
                    let replay_port = port_for(kv.base_port, 2 * index + 1)?;
                    let publisher = KvPublisher::start(
                        &context,
                        PublisherConfig {
                            endpoint: zmq_bind_endpoint(&kv.bind_host, publish_port),
                            replay_endpoint: Some(zmq_bind_endpoint(&kv.bind_host, replay_port)),
                            topic: kv.topic.clone(),
                            wire: kv.wire,
                            buffer_steps: kv.buffer_steps,
                            drop_every: config.faults.kv_drop_every,
                            restart_every: config.faults.kv_restart_every,
                        },
                    )?;
                    kv_endpoints.push(Some(KvEventEndpoints {
                        publish: connectable(&kv.bind_host, publisher.publish_endpoint()),
                        replay: connectable(
                            &kv.bind_host,
                            publisher.replay_endpoint().unwrap_or_default(),
                        ),
                    }));
                    Some(publisher)
                }
                None => {
                    kv_endpoints.push(None);
                    None
                }
            };
            let model = EngineModel::new(
                config.engine.clone(),
                performance.clone(),
                text.vocabulary(),
            );
            let kv_source =
                config
                    .kv_events
                    .as_ref()
                    .zip(publisher.as_ref())
                    .map(|(kv, publisher)| KvEventSource {
                        endpoint: publisher.publish_endpoint().to_string(),
                        replay_endpoint: publisher.replay_endpoint().map(str::to_string),
                        topic: kv.topic.clone(),
                        buffer_steps: kv.buffer_steps,
                        wire: kv.wire,
                    });
            engines.push(Arc::new(EngineShared::new(
                model,
                EngineSettings {
                    index,
                    model_name: config.model_name.clone(),
                    lora_adapters: config.lora_adapters.clone(),
                    speedup: config.speedup,
                    faults: config.faults.clone(),
                    publisher,
                    kv_source,
                    text: text.clone(),
                },
            )));
        }

        let threads = match config.executor_threads {
            0 => std::thread::available_parallelism()
                .map_or(1, usize::from)
                .min(config.engines),
            threads => threads.min(config.engines),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_sender, ready) = mpsc::channel::<Result<(usize, SocketAddr), SimError>>();
        let mut executors = Vec::with_capacity(threads);
        for thread in 0..threads {
            let mut hosted = Vec::new();
            for (index, engine) in engines.iter().enumerate() {
                if index % threads == thread {
                    let port = port_for(config.base_port, index)?;
                    hosted.push((engine.clone(), SocketAddr::new(config.listen_host, port)));
                }
            }
            let executor_stop = stop.clone();
            let ready_sender = ready_sender.clone();
            let tls = tls.clone();
            let spawned = spawn_executor(
                ExecutorSpec::unpinned(format!("sim-engines-{thread}")),
                move || run_executor(hosted, tls, executor_stop, ready_sender),
            );
            match spawned {
                Ok(handle) => executors.push(handle),
                Err(error) => {
                    stop.store(true, Ordering::Release);
                    return Err(SimError::Executor(error));
                }
            }
        }
        drop(ready_sender);
        let mut cluster = SimCluster {
            engines,
            scheme: if tls.is_some() { "https" } else { "http" },
            block_size: config.engine.block_size,
            addresses: vec![SocketAddr::new(config.listen_host, 0); config.engines],
            kv_endpoints,
            stop,
            executors,
        };
        for _ in 0..config.engines {
            match ready.recv_timeout(START_TIMEOUT) {
                Ok(Ok((index, address))) => cluster.addresses[index] = address,
                Ok(Err(error)) => return Err(error),
                Err(_) => {
                    return Err(SimError::Config(
                        "engines did not start in time".to_string(),
                    ));
                }
            }
        }
        Ok(cluster)
    }

    /// Number of engines.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// Always false: a cluster has at least one engine.
    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    /// Each engine's bound HTTP address.
    pub fn engine_addresses(&self) -> &[SocketAddr] {
        &self.addresses
    }

    /// Each engine's base URL, e.g. `http://127.0.0.1:8001` (`https://` with TLS).
    pub fn engine_urls(&self) -> Vec<String> {
        self.addresses
            .iter()
            .map(|address| {
                let host = match address.ip() {
                    IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    ip => ip,
                };
                format!(
                    "{}://{}",
                    self.scheme,
                    SocketAddr::new(host, address.port())
                )
            })
            .collect()
    }

    /// Each engine's KV-event endpoints (`None` when KV events are off).
    pub fn kv_event_endpoints(&self) -> &[Option<KvEventEndpoints>] {
        &self.kv_endpoints
    }

    /// The oracle: for `token_ids`, what each engine truly holds in its prefix cache now and
    /// how much work it has queued. An in-process call that briefly takes each engine's lock.
    pub fn probe(&self, token_ids: &[u32]) -> Vec<EngineProbe> {
        // Every engine of a cluster shares one configuration: hash the chain once.
        let block_size = self.block_size.max(1);
        let chain = hash_token_blocks(token_ids, block_size);
        self.engines
            .iter()
            .map(|engine| {
                let model = engine.model();
                let cached_prefix_tokens = model.cached_prefix_tokens_of_chain(&chain);
                let cap = token_ids.len().saturating_sub(1) / block_size * block_size;
                EngineProbe {
                    engine: engine.index,
                    cached_prefix_tokens,
                    prompt_hit_tokens: cached_prefix_tokens.min(cap),
                    load: model.load(),
                    requests_received: model.requests_received(),
                    held_prefix_tokens: model.held_prefix_tokens_of_chain(&chain),
                    capacity_tokens: model.capacity_tokens(),
                    step_tokens: model.config().max_num_batched_tokens,
                }
            })
            .collect()
    }

    /// Each engine's counters (hits, queries, preemptions, evictions, ...).
    pub fn counters(&self) -> Vec<EngineCounters> {
        self.engines
            .iter()
            .map(|engine| engine.model().counters())
            .collect()
    }

    /// Simulates a restart of engine `engine`'s KV publisher (seq back to 0). False when the
    /// engine does not exist or publishes no events.
    pub fn restart_kv_publisher(&self, engine: usize) -> bool {
        match self
            .engines
            .get(engine)
            .and_then(|shared| shared.publisher.as_ref())
        {
            Some(publisher) => {
                publisher.restart();
                true
            }
            None => false,
        }
    }

    /// Drops engine `engine`'s prefix cache like `POST /reset_prefix_cache` (refused while
    /// requests hold blocks).
    pub fn reset_prefix_cache(&self, engine: usize) -> bool {
        let Some(shared) = self.engines.get(engine) else {
            return false;
        };
        let mut model = shared.model();
        let reset = model.reset_prefix_cache();
        shared.flush_events(&mut model);
        reset
    }

    /// Stops every engine and waits for the executor threads.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Release);
        for executor in self.executors.drain(..) {
            let _ = executor.join();
        }
    }
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// One executor thread: binds its engines' listeners, reports them, runs their step loops and
/// servers until the stop flag is set.
async fn run_executor(
    hosted: Vec<(Arc<EngineShared>, SocketAddr)>,
    tls: Option<myelin_http::tls::ServerTls>,
    stop: Arc<AtomicBool>,
    ready: mpsc::Sender<Result<(usize, SocketAddr), SimError>>,
) {
    let shutdown = Shutdown::new();
    shutdown.follow(stop, STOP_POLL_INTERVAL);
    let mut tasks = Vec::new();
    for (shared, address) in hosted {
        let index = shared.index;
        let listener = match TcpListener::bind(address) {
            Ok(listener) => listener,
            Err(error) => {
                let _ = ready.send(Err(SimError::Engine {
                    engine: index,
                    message: format!("cannot listen on {address}: {error}"),
                }));
                continue;
            }
        };
        let bound = listener.local_addr().unwrap_or(address);
        let local = LocalEngine::new(shared);
        tasks.push(glommio::spawn_local(local.clone().run(shutdown.clone())));
        let handler_engine = local.clone();
        let server_config = ServerConfig {
            drain_timeout: DRAIN_TIMEOUT,
            tls: tls.clone(),
            ..ServerConfig::default()
        };
        let server_shutdown = shutdown.clone();
        tasks.push(glommio::spawn_local(async move {
            serve(
                listener,
                move |request| crate::api::handle(handler_engine.clone(), request),
                server_config,
                server_shutdown,
            )
            .await;
        }));
        let _ = ready.send(Ok((index, bound)));
    }
    for task in tasks {
        task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn a_cluster_can_be_shared_across_threads() {
        // The harness probes from its own threads while engines run.
        assert_send_sync::<SimCluster>();
        assert_send_sync::<EngineProbe>();
    }

    #[test]
    fn endpoints_are_connectable() {
        assert_eq!(
            connectable("*", "tcp://0.0.0.0:5557"),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            connectable("127.0.0.1", "tcp://127.0.0.1:41000"),
            "tcp://127.0.0.1:41000"
        );
        assert_eq!(zmq_bind_endpoint("127.0.0.1", 0), "tcp://127.0.0.1:*");
        assert_eq!(zmq_bind_endpoint("*", 5557), "tcp://*:5557");
    }

    #[test]
    fn bad_configurations_are_refused() {
        for config in [
            ClusterConfig {
                engines: 0,
                ..ClusterConfig::default()
            },
            ClusterConfig {
                speedup: 0.0,
                ..ClusterConfig::default()
            },
            ClusterConfig {
                profile: "h200".to_string(),
                ..ClusterConfig::default()
            },
        ] {
            assert!(matches!(
                SimCluster::start(config),
                Err(SimError::Config(_))
            ));
        }
    }
}
