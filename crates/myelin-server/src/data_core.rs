//! One data core: its state (shard, backend table, pool, tokenizer, mesh), its message
//! handling, its periodic broadcasts, and its HTTP server. The request path itself is in
//! `request_path.rs`.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use glommio::channels::shared_channel::ConnectedReceiver;
use glommio::timer::Timer;
use http::{Request, Response};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use myelin_http::body::Body;
use myelin_http::client::{Pool, PoolConfig};
use myelin_http::server::{ServeReport, ServerConfig, Shutdown};
use myelin_routing::PinnedBlocks;

use crate::TokenizerParts;
use crate::backends::{BackendId, BackendInfo, BackendTable, Load, LoadUpdate, Prefill, SentTimes};
use crate::config::ServeConfig;
use crate::engine_metrics::ServedModels;
use crate::mesh::{Mesh, MeshEnds, SendError};
use crate::messages::{Message, ReplicaBackend, ReplicaSnapshot};
use crate::metrics as names;
use crate::openai::ApiError;
use crate::pins::{OwnedPins, PinChange, PromptBlocks};
use crate::route_tokens::RouteTokenizer;
use crate::routing_glue::{LookupAnswer, LookupQuery, RoutingShard};
use crate::watchdog::Watchdog;

/// Learned routes sent to the other replicas in one message, at most.
const MAX_WRITES_PER_BATCH: usize = 256;
/// Period of the full load and shard-stats broadcast that heals dropped updates.
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);
/// How often the server loop looks at the process-wide stop flag.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Time between the drain deadline (streams still running are ended with an SSE error event)
/// and the server closing the connections left.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// Progress of a data core's startup, reported to the main thread.
#[derive(Debug)]
pub enum CoreReady {
    /// The listener is bound (to this address: port 0 resolved).
    Bound(SocketAddr),
    /// Mesh connected; accepting requests.
    Serving,
    /// Startup failed.
    Failed(String),
}

/// Everything a data core is started with (all `Send`).
pub struct DataCoreSetup {
    pub shard: usize,
    pub shards: usize,
    pub config: Arc<ServeConfig>,
    pub listen: SocketAddr,
    pub mesh_ends: MeshEnds<Message>,
    pub initial_backends: Vec<BackendInfo>,
    /// Engine host names resolved at startup (`dns.rs`).
    pub initial_addresses: Vec<(String, SocketAddr)>,
    /// The router-wide tokenizer, chat template and fast path (each core gets its own clone:
    /// own word cache).
    pub tokenizer: TokenizerParts,
    /// Those of the models tokenized apart (`--model-tokenizer`, `--model-chat-template`).
    pub model_tokenizers: Vec<(String, TokenizerParts)>,
    pub metrics: PrometheusHandle,
    pub stop: Arc<AtomicBool>,
    pub ready: std::sync::mpsc::Sender<CoreReady>,
    /// The routing clock's origin, the same on every core (learned routes carry its times).
    pub clock_origin: Instant,
    /// The OTLP exporter's queue (`--otlp-endpoint`; `None`: no traces).
    pub tracing: Option<crate::otel::ExporterHandle>,
}

/// A data core's state, shared by its tasks (same thread, no locks; borrows never span an
/// `.await`).
pub struct DataCore {
    pub shard: usize,
    pub shards: usize,
    pub config: Arc<ServeConfig>,
    pub pool: Pool,
    /// Tokenizes requests for models without their own ([`Self::tokenizer_for`]).
    pub tokenizer: RefCell<RouteTokenizer>,
    /// The models with a tokenizer or chat template of their own, by name.
    model_tokenizers: Vec<(String, RefCell<RouteTokenizer>)>,
    pub routing: RefCell<RoutingShard>,
    pub backends: RefCell<BackendTable>,
    pub metrics: PrometheusHandle,
    pub shutdown: Shutdown,
    /// Triggered `--drain-timeout-ms` after `shutdown`: relays still running end then.
    pub drain_expired: Shutdown,
    mesh: Mesh<Message>,
    shard_label: String,
    /// Routing lookups this core served (`myelin_router_lookups_total{shard}`).
    lookups: metrics::Counter,
    /// The metric handles the request path records into (no registry lookup, no lock).
    pub meters: names::CoreMetrics,
    /// Learned routes not yet sent to the other cores' replicas.
    outbox: RefCell<Vec<myelin_routing::WriteOp>>,
    /// Backends whose local load changed since the last flush.
    dirty_loads: RefCell<Vec<BackendId>>,
    /// Backends with a success not yet reported to the control core.
    pending_successes: RefCell<Vec<BackendId>>,
    flush_scheduled: Cell<bool>,
    in_flight: Cell<usize>,
    /// Prompts this core counts in its backends' KV memory, for requests on any core (see
    /// `pins.rs`).
    owned_pins: RefCell<OwnedPins>,
    /// Keys of this core's requests in flight (pinned on every core), and the pin changes not
    /// yet sent to the other cores.
    live_pins: RefCell<BTreeSet<u64>>,
    pin_outbox: RefCell<Vec<PinChange>>,
    next_pin_key: Cell<u64>,
    /// Which engines have this core's requests in flight, and their last byte
    /// (`--engine-stall-ms`).
    watchdog: RefCell<Watchdog>,
    /// What each backend's `GET /v1/models` said (the control core asks; absent: never
    /// answered).
    served: RefCell<std::collections::BTreeMap<BackendId, ServedModels>>,
    /// The number the control core's next mirror write should carry (a jump: one was dropped).
    mirror_seq: Cell<u64>,
    /// Bytes of request bodies this core holds while reading them (before admission).
    pub body_budget: Rc<crate::body_budget::BodyBudget>,
    /// This core's tracer (`--otlp-endpoint`; `None`: tracing off, nothing else to pay).
    pub tracer: Option<crate::otel::Tracer>,
}

/// Runs a data core until shutdown and drain complete, answering every client request with
/// `handler` (the request path, `request_path.rs`).
pub async fn run_data_core<H, F>(setup: DataCoreSetup, handler: H) -> ServeReport
where
    H: Fn(Rc<DataCore>, Request<Incoming>) -> F + 'static,
    F: Future<Output = Response<Body>> + 'static,
{
    let routing = match RoutingShard::new(&setup.config, setup.shards, setup.clock_origin) {
        Ok(routing) => routing,
        Err(error) => {
            let _ = setup
                .ready
                .send(CoreReady::Failed(format!("shard {}: {error}", setup.shard)));
            let _ = setup.mesh_ends.connect().await;
            return ServeReport::default();
        }
    };
    let listener = match glommio::net::TcpListener::bind(setup.listen) {
        Ok(listener) => listener,
        Err(error) => {
            let _ = setup.ready.send(CoreReady::Failed(format!(
                "shard {}: cannot listen on {}: {error}",
                setup.shard, setup.listen
            )));
            // Connect anyway: every other core waits for its peers before it can stop.
            let _ = setup.mesh_ends.connect().await;
            return ServeReport::default();
        }
    };
    match listener.local_addr() {
        Ok(addr) => {
            let _ = setup.ready.send(CoreReady::Bound(addr));
        }
        Err(error) => {
            let _ = setup
                .ready
                .send(CoreReady::Failed(format!("shard {}: {error}", setup.shard)));
            let _ = setup.mesh_ends.connect().await;
            return ServeReport::default();
        }
    }
    let (mesh, receivers) = setup.mesh_ends.connect().await;
    let mut backends = BackendTable::new(setup.shards);
    let mut routing = routing;
    for info in setup.initial_backends {
        routing.add_backend(&info);
        backends.upsert(info);
    }
    let route_tokenizer = |parts: TokenizerParts| {
        RouteTokenizer::new(
            parts.tokenizer,
            parts.fast,
            parts.template,
            parts.added_tokens,
            setup.config.tokenize_cache_bytes,
            setup.config.block_size,
        )
        .with_limits(
            setup.config.tokenize_max_bytes,
            setup.config.tokenize_max_piece_bytes,
        )
    };
    let tokenizer = route_tokenizer(setup.tokenizer);
    let model_tokenizers = setup
        .model_tokenizers
        .into_iter()
        .map(|(model, parts)| (model, RefCell::new(route_tokenizer(parts))))
        .collect();
    let shutdown = Shutdown::new();
    shutdown.follow(setup.stop.clone(), STOP_POLL_INTERVAL);
    let core = Rc::new(DataCore {
        shard: setup.shard,
        shards: setup.shards,
        pool: {
            // Host names only at the addresses the control core resolves (never here).
            let pool = Pool::new(PoolConfig {
                connect_timeout: setup.config.connect_timeout,
                tls: Some(setup.config.engine_tls.clone()),
                ..PoolConfig::default()
            })
            .with_provided_addresses();
            for (authority, addr) in &setup.initial_addresses {
                pool.set_address(authority, *addr);
            }
            pool
        },
        tokenizer: RefCell::new(tokenizer),
        model_tokenizers,
        routing: RefCell::new(routing),
        backends: RefCell::new(backends),
        metrics: setup.metrics,
        shutdown: shutdown.clone(),
        drain_expired: Shutdown::new(),
        mesh,
        shard_label: setup.shard.to_string(),
        lookups: metrics::counter!(names::LOOKUPS_TOTAL, "shard" => setup.shard.to_string()),
        meters: names::CoreMetrics::new(&setup.shard.to_string()),
        outbox: RefCell::new(Vec::new()),
        dirty_loads: RefCell::new(Vec::new()),
        pending_successes: RefCell::new(Vec::new()),
        flush_scheduled: Cell::new(false),
        in_flight: Cell::new(0),
        owned_pins: RefCell::new(OwnedPins::default()),
        live_pins: RefCell::new(BTreeSet::new()),
        pin_outbox: RefCell::new(Vec::new()),
        next_pin_key: Cell::new(0),
        watchdog: RefCell::new(Watchdog::new(setup.config.engine_stall)),
        served: RefCell::new(std::collections::BTreeMap::new()),
        mirror_seq: Cell::new(0),
        body_budget: crate::body_budget::BodyBudget::new(
            setup.config.max_body_buffer_bytes_per_core,
        ),
        tracer: setup
            .tracing
            .as_ref()
            .map(|exporter| crate::otel::Tracer::new(exporter, setup.shard as u64)),
        config: setup.config.clone(),
    });
    for (_, receiver) in receivers {
        glommio::spawn_local(receive_loop(core.clone(), receiver)).detach();
    }
    glommio::spawn_local(resync_loop(core.clone())).detach();
    if let Some(interval) = core.watchdog.borrow().check_interval() {
        glommio::spawn_local(watchdog_loop(core.clone(), interval)).detach();
    }
    let drain_core = core.clone();
    glommio::spawn_local(async move {
        drain_core.shutdown.wait().await;
        Timer::new(drain_core.config.drain_timeout).await;
        drain_core.drain_expired.trigger();
    })
    .detach();
    let _ = setup.ready.send(CoreReady::Serving);

    let handler_core = core.clone();
    let server_config = ServerConfig {
        drain_timeout: setup.config.drain_timeout + DRAIN_GRACE,
        error_bodies: Some(crate::openai::protocol_error_body),
        max_connections: setup.config.max_connections_per_core,
        on_refused: Some(crate::metrics::connection_refused),
        tls: setup.config.tls.clone(),
        on_tls: Some(crate::metrics::client_tls_event),
        ..ServerConfig::default()
    };
    myelin_http::server::serve(
        listener,
        move |request| handler(handler_core.clone(), request),
        server_config,
        shutdown,
    )
    .await
}

async fn receive_loop(core: Rc<DataCore>, receiver: ConnectedReceiver<Message>) {
    while let Some(message) = receiver.recv().await {
        core.on_message(message);
    }
}

/// Prefix-tree arena slots counted per slice of an admin snapshot: the walk yields to the
/// request path between slices (a tree of millions of nodes would otherwise hold this core
/// for milliseconds).
const SNAPSHOT_SLICE_SLOTS: usize = 16_384;

/// Answers the control core's snapshot request: the prefix tree counted in slices, yielding
/// between them when other tasks wait, then the rest at once (O(backends)).
async fn answer_snapshot(core: Rc<DataCore>, request_id: u64) {
    let mut routed = Vec::new();
    let mut next = Some(0);
    while let Some(from) = next {
        next = core
            .routing
            .borrow()
            .count_routed_blocks(from, SNAPSHOT_SLICE_SLOTS, &mut routed);
        if next.is_some() {
            glommio::yield_if_needed().await;
        }
    }
    let snapshot = core.snapshot(routed);
    core.send(
        core.shards,
        Message::SnapshotReply {
            request_id,
            snapshot: Box::new(snapshot),
        },
    );
}

/// Re-broadcasts this core's load on every backend: absolute values, so a dropped update is
/// healed within one interval; and tells every other core which of this core's requests are
/// in flight, so a dropped unpin heals too. Also publishes the tokenizer caches' sizes.
/// Reports the engines the watchdog finds stalled to the control core (which opens their
/// breakers) every `interval`.
async fn watchdog_loop(core: Rc<DataCore>, interval: Duration) {
    loop {
        Timer::new(interval).await;
        let stalls = core.watchdog.borrow_mut().check(Instant::now());
        for stall in stalls {
            core.send(
                core.shards,
                Message::Stalled {
                    backend: stall.backend,
                    streaming: stall.streaming,
                },
            );
        }
    }
}

async fn resync_loop(core: Rc<DataCore>) {
    let segment_bytes = metrics::gauge!(
        names::TOKENIZE_CACHE_BYTES, "cache" => "segment", "shard" => core.shard_label.clone()
    );
    let prefix_bytes = metrics::gauge!(
        names::TOKENIZE_CACHE_BYTES, "cache" => "prefix", "shard" => core.shard_label.clone()
    );
    let body_bytes = metrics::gauge!(names::BODY_BUFFER_BYTES, "shard" => core.shard_label.clone());
    loop {
        Timer::new(RESYNC_INTERVAL).await;
        let (segment, prefix) = core.tokenizer_cache_bytes();
        segment_bytes.set(segment as f64);
        prefix_bytes.set(prefix as f64);
        body_bytes.set(core.body_budget.held() as f64);
        let loads: Vec<(BackendId, Load)> = core
            .backends
            .borrow()
            .iter()
            .map(|entry| (entry.info.id, entry.local))
            .collect();
        core.broadcast_loads(&loads);
        // Every other core learns which of this core's requests are still in flight (pins.rs).
        let live: BTreeSet<u64> = core.live_pins.borrow().clone();
        for peer in (0..core.shards).filter(|&peer| peer != core.shard) {
            core.send(
                peer,
                Message::LivePins {
                    from: core.shard,
                    keys: live.clone(),
                },
            );
        }
    }
}

/// A slot in the core's in-flight budget; released on drop.
pub struct InFlightPermit {
    core: Rc<DataCore>,
}

impl Drop for InFlightPermit {
    fn drop(&mut self) {
        self.core
            .in_flight
            .set(self.core.in_flight.get().saturating_sub(1));
    }
}

/// Load one request puts on a backend, from admission to the end of its response.
pub struct LoadGuard {
    core: Rc<DataCore>,
    backend: BackendId,
    /// Uncached prompt still counted as queued prefill (none once the first token came).
    prefill: Prefill,
    decode_tokens: u64,
    /// The backend's `myelin_backend_in_flight_requests` (none: the backend was gone).
    in_flight: Option<metrics::Gauge>,
    /// What the residency estimate saw of the backend when it was chosen, until the engine
    /// reports its reuse (`None`: not estimated).
    probe: Option<myelin_routing::ReuseProbe>,
    /// The prompt's pin key on this core (its blocks count until the response ends).
    pin: u64,
    /// When it was sent (routing clock, ms).
    sent_ms: u64,
    /// When it had its first token (routing clock, ms; `None`: not yet, so it counts among
    /// the backend's requests without one).
    first_token_ms: Option<u64>,
    /// The predicted time to first token the request was routed with, and when it was sent.
    prediction: Option<(myelin_routing::TtftPrediction, Instant)>,
    /// Counted by the progress watchdog (whether it streams).
    watched: Option<bool>,
}

impl LoadGuard {
    pub fn backend(&self) -> BackendId {
        self.backend
    }

    /// Counts the request in the progress watchdog until the guard drops.
    pub fn watch(&mut self, streaming: bool) {
        if self.watched.is_none() {
            self.core
                .watchdog
                .borrow_mut()
                .started(self.backend, streaming, Instant::now());
            self.watched = Some(streaming);
        }
    }

    /// Keeps the estimate's view of the request for its reuse report.
    pub fn set_probe(&mut self, probe: Option<myelin_routing::ReuseProbe>) {
        self.probe = probe;
    }

    pub fn has_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// The engine reported serving `cached_tokens` of the prompt from its cache: corrects the
    /// estimate (once per request).
    pub fn reuse_reported(&mut self, cached_tokens: u64) {
        if let Some(probe) = self.probe.take() {
            self.core.observe_reuse(self.backend, &probe, cached_tokens);
        }
    }

    /// The request is about to be sent, routed with `prediction`: its first token teaches
    /// this core the engine's timing ([`Self::first_token`]).
    pub fn set_prediction(&mut self, prediction: myelin_routing::TtftPrediction) {
        self.prediction = Some((prediction, Instant::now()));
    }

    /// The predicted time to first token the request was routed with, seconds.
    pub fn predicted_ttft_seconds(&self) -> Option<f64> {
        self.prediction.map(|(prediction, _)| prediction.seconds)
    }

    /// The engine produced its first output token, so the prompt is prefilled: from now on the
    /// request only queues its decode work there. `streamed`: the answer is an event stream,
    /// so this moment is the first token's, and the engine's timing learns from it (a
    /// non-streaming answer's first byte comes with the whole completion).
    pub fn first_token(&mut self, streamed: bool) {
        let prefilled = std::mem::take(&mut self.prefill);
        let was_prefilling = self.first_token_ms.is_none();
        if prefilled != Prefill::default() || was_prefilling {
            let now_ms = self.core.routing.borrow().now_ms();
            self.first_token_ms.get_or_insert(now_ms);
            let sent = if was_prefilling {
                SentChange::Done(self.sent_ms)
            } else {
                SentChange::None
            };
            self.core.change_load_sent(self.backend, sent, |load| {
                load.first_token(prefilled, was_prefilling, now_ms);
            });
        }
        // Learned from once: the first call is the first token's (later ones change nothing).
        if let Some((prediction, sent)) = self.prediction
            && streamed
            && was_prefilling
        {
            self.core
                .observe_ttft(self.backend, &prediction, sent.elapsed().as_secs_f64());
        }
    }
}

/// How a load change moves a request's wait for its first token ([`SentTimes`]).
#[derive(Debug, Clone, Copy)]
enum SentChange {
    None,
    /// Sent at this time (routing clock, ms), waiting.
    Waiting(u64),
    /// The one sent at this time had its first token, or ended without one.
    Done(u64),
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        if let Some(in_flight) = &self.in_flight {
            in_flight.decrement(1.0);
        }
        if let Some(streaming) = self.watched {
            self.core
                .watchdog
                .borrow_mut()
                .ended(self.backend, streaming);
        }
        let (remaining, decode, first_token_ms) =
            (self.prefill, self.decode_tokens, self.first_token_ms);
        let sent = match first_token_ms {
            None => SentChange::Done(self.sent_ms),
            Some(_) => SentChange::None,
        };
        self.core.change_load_sent(self.backend, sent, |load| {
            load.end_request(remaining, decode, first_token_ms);
        });
        self.core.send_pin_change(PinChange {
            from: self.core.shard,
            key: self.pin,
            backend: self.backend,
            prompt: None,
        });
    }
}

impl DataCore {
    fn on_message(self: &Rc<Self>, message: Message) {
        match message {
            Message::Writes(batch) => {
                let mut routing = self.routing.borrow_mut();
                for op in batch.iter() {
                    routing.apply(op);
                }
            }
            Message::MirrorWrites { seq, batch } => {
                let mut routing = self.routing.borrow_mut();
                if seq != self.mirror_seq.get() {
                    // A mirror write to this core was dropped: no mirror here is exact until
                    // the snapshots the control core sends for it (it saw the drop) arrive.
                    self.meters.mirror_write_gaps.increment(1);
                    routing.distrust_mirrors();
                }
                self.mirror_seq.set(seq.saturating_add(1));
                for op in batch.iter() {
                    routing.apply(op);
                }
            }
            Message::Loads(updates) => {
                let mut backends = self.backends.borrow_mut();
                let mut routing = self.routing.borrow_mut();
                for update in updates.iter() {
                    self.meters
                        .load_view_staleness
                        .record(update.sent_at.elapsed().as_secs_f64());
                    backends.apply_peer_load(update.from, update.backend, update.load);
                    routing.set_load(update.backend, update.from, update.load);
                }
            }
            Message::BackendUpsert { version, info } => {
                let info_copy = info.clone();
                if self.backends.borrow_mut().upsert_versioned(info, version) {
                    self.routing.borrow_mut().add_backend(&info_copy);
                }
                self.acknowledge(version);
            }
            Message::BackendRemove { version, id } => {
                self.routing.borrow_mut().remove_backend(id);
                self.backends.borrow_mut().remove(id);
                self.acknowledge(version);
            }
            Message::BackendState { version, id, state } => {
                if self
                    .backends
                    .borrow_mut()
                    .set_state_versioned(id, state, version)
                {
                    self.routing.borrow_mut().set_state(id, state);
                }
                self.acknowledge(version);
            }
            Message::BackendSync { version, backends } => {
                let (changed, gone) = self.backends.borrow_mut().sync(&backends, version);
                if !changed.is_empty() || !gone.is_empty() {
                    // Only a dropped change makes a sync differ from what this core has.
                    self.meters.backend_resyncs.increment(1);
                }
                let mut routing = self.routing.borrow_mut();
                for id in changed {
                    if let Some(info) = backends.iter().find(|info| info.id == id) {
                        routing.add_backend(info);
                    }
                }
                for id in gone {
                    routing.remove_backend(id);
                }
                drop(routing);
                self.send(
                    self.shards,
                    Message::Applied {
                        shard: self.shard,
                        version,
                        cumulative: true,
                    },
                );
            }
            Message::BackendCache {
                id,
                capacity_tokens,
                memory,
                served,
            } => {
                match served {
                    Some(served) => self.served.borrow_mut().insert(id, served),
                    None => self.served.borrow_mut().remove(&id),
                };
                let mut routing = self.routing.borrow_mut();
                routing.set_scraped_capacity(id, capacity_tokens);
                if let Some(memory) = memory {
                    routing.set_scraped_memory(id, memory, Instant::now());
                }
            }
            Message::Pins(changes) => {
                for change in changes.iter() {
                    self.apply_pin_change(change.clone());
                }
            }
            Message::LivePins { from, keys } => {
                let dead = self.owned_pins.borrow_mut().reconcile(from, &keys);
                for (backend, prompt) in dead {
                    self.meters.pins_reconciled.increment(1);
                    self.release_pin(from, backend, &prompt);
                }
            }
            Message::PeerLoads(loads) => {
                let mut routing = self.routing.borrow_mut();
                for &(backend, load) in loads.iter() {
                    // The slot after the data cores' holds the other cluster nodes' load.
                    routing.set_load(backend, self.shards, load);
                }
            }
            Message::PeerRoutes(routes) => {
                let mut routing = self.routing.borrow_mut();
                for route in routes.iter() {
                    routing.learn_peer(route.chain.clone(), route.backend, route.stamp);
                }
            }
            Message::Addresses(addresses) => {
                for (authority, addr) in addresses.iter() {
                    self.pool.set_address(authority, *addr);
                }
            }
            Message::Snapshot { request_id } => {
                glommio::spawn_local(answer_snapshot(self.clone(), request_id)).detach();
            }
            Message::Explain {
                request_id,
                endpoint,
                body,
            } => {
                let answer = self.explain(endpoint, &body);
                self.send(self.shards, Message::ExplainReply { request_id, answer });
            }
            // Messages for the control core never reach a data core.
            Message::Outcome { .. }
            | Message::Stalled { .. }
            | Message::Applied { .. }
            | Message::SnapshotReply { .. }
            | Message::ExplainReply { .. } => {}
        }
    }

    /// Tells the control core this core has the backend change `version` (or a newer one).
    fn acknowledge(&self, version: u64) {
        self.send(
            self.shards,
            Message::Applied {
                shard: self.shard,
                version,
                cumulative: false,
            },
        );
    }

    /// What this core's replica holds and the load this core puts on each backend, with the
    /// prefix tree's `routed` blocks per backend (counted in slices beforehand).
    fn snapshot(&self, mut routed: Vec<(myelin_routing::BackendId, usize)>) -> ReplicaSnapshot {
        let routing = self.routing.borrow();
        let backends = self
            .backends
            .borrow()
            .iter()
            .map(|entry| ReplicaBackend {
                id: entry.info.id,
                local: entry.local,
                residency: routing.residency_of(entry.info.id),
                cache: routing.cache_figures(entry.info.id),
                timing: routing.timing_figures(entry.info.id),
            })
            .collect();
        routed.sort_unstable_by_key(|(backend, _)| *backend);
        ReplicaSnapshot {
            counts: myelin_routing::BlockCounts {
                routed,
                mirrored: routing.mirrored_blocks(),
            },
            backends,
        }
    }

    /// Sends without waiting; a full or closed peer drops the message (counted).
    pub fn send(&self, to: usize, message: Message) -> bool {
        let kind = message.kind();
        match self.mesh.try_send(to, message) {
            Ok(()) => {
                self.meters.cross_core_messages.get(kind).increment(1);
                true
            }
            Err(SendError::Full | SendError::Closed | SendError::NoSuchCore) => {
                self.meters.cross_core_dropped.get(kind).increment(1);
                false
            }
        }
    }

    /// Takes a slot of the per-core in-flight budget, or `None` at the limit.
    pub fn admit(self: &Rc<Self>) -> Option<InFlightPermit> {
        if self.in_flight.get() >= self.config.max_in_flight_per_core {
            return None;
        }
        self.in_flight.set(self.in_flight.get() + 1);
        Some(InFlightPermit { core: self.clone() })
    }

    /// Every backend's match for `query`, from this core's own replica (no other core is
    /// asked: lookups never wait on the request path).
    pub fn lookup(&self, query: &LookupQuery) -> LookupAnswer {
        self.lookups.increment(1);
        self.routing.borrow().lookup(query)
    }

    /// Records that a prompt went to `backend`: applied to this core's replica now, and sent
    /// to the other cores' replicas with the next flush.
    pub fn learn(self: &Rc<Self>, query: &LookupQuery, backend: BackendId) {
        let write = self.routing.borrow_mut().learn(query, backend);
        self.replicate(write);
    }

    /// Queues a write this core's replica already applied for the other cores' replicas (sent
    /// with the next flush, or now when the batch is full).
    fn replicate(self: &Rc<Self>, write: myelin_routing::WriteOp) {
        if !self.tells_others() {
            return;
        }
        let full = {
            let mut outbox = self.outbox.borrow_mut();
            outbox.push(write);
            outbox.len() >= MAX_WRITES_PER_BATCH
        };
        if full {
            self.flush();
        } else {
            self.schedule_flush();
        }
    }

    /// Flushes what this core has to tell the others once the tasks ready now have run, so
    /// requests handled in the same scheduling round share one message per peer and kind
    /// (instead of one per request: waking a sleeping core costs a syscall and an IPI).
    fn schedule_flush(self: &Rc<Self>) {
        if self.flush_scheduled.replace(true) {
            return;
        }
        let core = self.clone();
        glommio::spawn_local(async move {
            futures_lite::future::yield_now().await;
            core.flush();
        })
        .detach();
    }

    /// Sends the pending learned routes and load changes to every other data core (one
    /// shared batch each) and the pending successes to the control core.
    fn flush(&self) {
        self.flush_scheduled.set(false);
        let writes: Vec<myelin_routing::WriteOp> = std::mem::take(&mut *self.outbox.borrow_mut());
        if !writes.is_empty() {
            let batch: Arc<[myelin_routing::WriteOp]> = writes.into();
            for peer in self.write_recipients() {
                self.send(peer, Message::Writes(batch.clone()));
            }
        }
        let dirty: Vec<BackendId> = std::mem::take(&mut *self.dirty_loads.borrow_mut());
        if !dirty.is_empty() {
            let loads: Vec<(BackendId, Load)> = {
                let backends = self.backends.borrow();
                dirty
                    .iter()
                    .filter_map(|&id| backends.get(id).map(|entry| (id, entry.local)))
                    .collect()
            };
            self.broadcast_loads(&loads);
        }
        let pins: Vec<PinChange> = std::mem::take(&mut *self.pin_outbox.borrow_mut());
        if !pins.is_empty() {
            let batch: Arc<[PinChange]> = pins.into();
            for peer in (0..self.shards).filter(|&peer| peer != self.shard) {
                self.send(peer, Message::Pins(batch.clone()));
            }
        }
        let successes: Vec<BackendId> = std::mem::take(&mut *self.pending_successes.borrow_mut());
        for backend in successes {
            self.send(
                self.shards,
                Message::Outcome {
                    backend,
                    success: true,
                },
            );
        }
    }

    /// Reports a request outcome to the control core (circuit breaker): successes with the
    /// next flush, a failure at once (after a pending success of the same backend, so the
    /// control core sees them in order).
    /// The context length requests are checked against: `--max-model-len`, else the smallest
    /// any backend of this core reports (a request may go to any of them); `None`: unknown.
    pub fn max_model_len(&self) -> Option<u64> {
        self.config.max_model_len.or_else(|| {
            let backends = self.backends.borrow();
            self.served
                .borrow()
                .iter()
                .filter(|(id, _)| backends.get(**id).is_some())
                .filter_map(|(_, served)| served.max_model_len)
                .min()
        })
    }

    /// The chain root of a request's cache namespace: its `model` when a backend of this core
    /// serves that name as a LoRA adapter, and its `cache_salt` (docs/routing.md, "Cache
    /// namespaces").
    pub fn namespace_root(&self, model: &str, cache_salt: Option<&str>) -> u64 {
        let backends = self.backends.borrow();
        let adapter = self
            .served
            .borrow()
            .iter()
            .any(|(id, served)| {
                backends.get(*id).is_some() && served.adapters.iter().any(|name| name == model)
            })
            .then_some(model);
        myelin_routing::namespace_root(adapter, cache_salt)
    }

    /// The backends of this core that must not get a request for `model` (the name as the
    /// engines list it, or an Ollama name without its `:latest` tag): those whose
    /// `GET /v1/models` answered without it (engines serving other models or adapters). A
    /// backend that never answered stays eligible (the engine answers for the name). Unknown
    /// (404, `model_not_found`) when every backend answered and none lists it.
    /// What tokenizes requests naming `model`: its own tokenizer and chat template when
    /// `--model-tokenizer` or `--model-chat-template` named it, the router-wide ones otherwise.
    pub fn tokenizer_for(&self, model: &str) -> &RefCell<RouteTokenizer> {
        self.model_tokenizers
            .iter()
            .find(|(name, _)| name == model)
            .map_or(&self.tokenizer, |(_, tokenizer)| tokenizer)
    }

    /// `model` as the per-model metrics' label: the name when an engine lists it in `GET
    /// /v1/models` or the configuration names it (`--model-tokenizer`,
    /// `--model-chat-template`); `None` (counted as `other`) for any other string a client
    /// sent.
    pub fn model_label<'a>(&self, model: &'a str) -> Option<&'a str> {
        let configured = self.model_tokenizers.iter().any(|(name, _)| name == model);
        let served = || {
            self.served
                .borrow()
                .values()
                .any(|served| served.models.iter().any(|name| names(name, model)))
        };
        (configured || served()).then_some(model)
    }

    /// The tokenizer caches' bytes on this core, segment and prefix, over every tokenizer.
    fn tokenizer_cache_bytes(&self) -> (usize, usize) {
        self.model_tokenizers
            .iter()
            .map(|(_, tokenizer)| tokenizer)
            .chain([&self.tokenizer])
            .map(|tokenizer| tokenizer.borrow().cache_bytes())
            .fold((0, 0), |(segment, prefix), (s, p)| {
                (segment + s, prefix + p)
            })
    }

    pub fn off_pool(&self, model: &str) -> Result<Vec<BackendId>, ApiError> {
        let backends = self.backends.borrow();
        let served = self.served.borrow();
        let known: Vec<(BackendId, bool)> = served
            .iter()
            .filter(|(id, served)| backends.get(**id).is_some() && !served.models.is_empty())
            .map(|(&id, served)| (id, served.models.iter().any(|name| names(name, model))))
            .collect();
        let unknown = !known.iter().any(|&(_, lists)| lists);
        if unknown && !known.is_empty() && known.len() == backends.len() {
            return Err(ApiError::model_not_found(model));
        }
        Ok(known
            .into_iter()
            .filter(|&(_, lists)| !lists)
            .map(|(id, _)| id)
            .collect())
    }

    /// Where a generation request with this body would go now, and why (the decision trace's
    /// evidence plus the prompt's size), without sending it: the whole prompt is tokenized
    /// and looked up in this core's replica, and nothing is learned, pinned, counted or
    /// moved (the admin API's `POST /admin/explain/...`).
    pub fn explain(
        &self,
        endpoint: crate::openai::Endpoint,
        body: &[u8],
    ) -> Result<serde_json::Value, ApiError> {
        let generation = crate::openai::parse_generation_request(endpoint, body)?;
        let tokens = {
            let mut tokenizer = self.tokenizer_for(&generation.model).borrow_mut();
            let tools =
                crate::openai::template_tools(&generation, body, tokenizer.template_uses_tools())?;
            let rendered = tokenizer
                .render_with_tools(&generation.prompt, tools.as_ref())
                .map_err(|error| ApiError::tokenize(&error))?;
            tokenizer
                .tokens(&rendered, None)
                .map_err(|error| ApiError::tokenize(&error))?
        };
        let off_pool = self.off_pool(&generation.model)?;
        let namespace = self.namespace_root(&generation.model, generation.cache_salt.as_deref());
        let routing = self.routing.borrow();
        let query = routing.query_in(namespace, &tokens.ids);
        let answer = routing.lookup(&query);
        let shared = self.shared_tokens(&query.chain);
        let mut explained = routing.explain(&answer, tokens.estimated_total, &off_pool, &shared);
        explained["model"] = generation
            .model
            .chars()
            .take(256)
            .collect::<String>()
            .into();
        explained["prompt_tokens"] = tokens.estimated_total.into();
        explained["routed_tokens"] = tokens.ids.len().into();
        explained["shard"] = self.shard.into();
        Ok(explained)
    }

    /// `backend` sent bytes (a response head or a body frame): the progress watchdog's clock.
    pub fn engine_progressed(&self, backend: BackendId) {
        self.watchdog
            .borrow_mut()
            .progressed(backend, Instant::now());
    }

    pub fn report_outcome(self: &Rc<Self>, backend: BackendId, success: bool) {
        if success {
            let mut pending = self.pending_successes.borrow_mut();
            if !pending.contains(&backend) {
                pending.push(backend);
            }
            drop(pending);
            self.schedule_flush();
            return;
        }
        let had_success = {
            let mut pending = self.pending_successes.borrow_mut();
            let before = pending.len();
            pending.retain(|&id| id != backend);
            pending.len() != before
        };
        if had_success {
            self.send(
                self.shards,
                Message::Outcome {
                    backend,
                    success: true,
                },
            );
        }
        self.send(
            self.shards,
            Message::Outcome {
                backend,
                success: false,
            },
        );
    }

    /// Adds a request's load to a backend: `prefill` until [`LoadGuard::first_token`],
    /// `decode_tokens` until the guard drops. The backend's admitted-tokens counter grows by
    /// `admitted_prefill_tokens + decode_tokens` (the prompt's uncached part as history has it:
    /// an estimate that discounted a prefix still resident must not count its tokens as new
    /// pressure; the engine's reuse report adds what history missed). The prompt's blocks count
    /// as held in the backend's KV memory ([`Load::pinned_prompt_tokens`]) until the guard drops.
    pub fn start_load(
        self: &Rc<Self>,
        backend: BackendId,
        admitted_prefill_tokens: u64,
        prefill: Prefill,
        decode_tokens: u64,
        prompt: PromptBlocks,
    ) -> LoadGuard {
        let in_flight = self
            .backends
            .borrow()
            .get(backend)
            .map(|entry| entry.metrics.in_flight.clone());
        let now_ms = self.routing.borrow().now_ms();
        self.change_load_sent(backend, SentChange::Waiting(now_ms), |load| {
            load.start_request(admitted_prefill_tokens, prefill, decode_tokens, now_ms);
        });
        let key = self.next_pin_key.get();
        self.next_pin_key.set(key + 1);
        self.send_pin_change(PinChange {
            from: self.shard,
            key,
            backend,
            prompt: Some(prompt),
        });
        if let Some(in_flight) = &in_flight {
            in_flight.increment(1.0);
        }
        LoadGuard {
            core: self.clone(),
            backend,
            prefill,
            decode_tokens,
            in_flight,
            probe: None,
            pin: key,
            sent_ms: now_ms,
            first_token_ms: None,
            prediction: None,
            watched: None,
        }
    }

    /// Per backend, the tokens of a prompt (its chain) that requests in flight there already
    /// hold, as far as the blocks this core counts tell (see [`PinnedBlocks::held_prefix_blocks`]):
    /// those blocks need no new KV memory there. Backends holding none are left out.
    pub fn shared_tokens(&self, chain: &myelin_routing::BlockChain) -> Vec<(BackendId, u64)> {
        let shards = self.shards.max(1) as u64;
        let shard = self.shard as u64;
        let block_size = u64::from(chain.block_size().get());
        self.backends
            .borrow()
            .iter()
            .filter_map(|entry| {
                let blocks = entry
                    .pinned
                    .held_prefix_blocks(chain.hashes(), |hash| hash % shards == shard);
                (blocks > 0).then(|| (entry.info.id, blocks as u64 * block_size))
            })
            .collect()
    }

    /// A request routed to `backend` with `prediction` had its first token after `observed_s`
    /// seconds: this core's fit of the engine's timing learns, and the error is recorded.
    fn observe_ttft(
        &self,
        backend: BackendId,
        prediction: &myelin_routing::TtftPrediction,
        observed_s: f64,
    ) {
        let error = self
            .routing
            .borrow_mut()
            .observe_ttft(backend, prediction, observed_s);
        if let Some(error) = error {
            self.meters.ttft_prediction_error.record(error);
            self.meters
                .ttft_prediction_relative_error
                .record(error.abs() / observed_s.max(1e-6));
        }
    }

    /// Applies a pin change to this core's share of the blocks and queues it for the other
    /// data cores (sent with the next flush).
    fn send_pin_change(self: &Rc<Self>, change: PinChange) {
        if self.shards > 1 {
            {
                let mut live = self.live_pins.borrow_mut();
                match change.prompt {
                    Some(_) => live.insert(change.key),
                    None => live.remove(&change.key),
                };
            }
            self.pin_outbox.borrow_mut().push(change.clone());
            self.schedule_flush();
        }
        self.apply_pin_change(change);
    }

    /// Counts or releases this core's share of a prompt: the blocks it owns, and the tail when
    /// the request is its own.
    fn apply_pin_change(self: &Rc<Self>, change: PinChange) {
        match change.prompt {
            Some(prompt) => {
                let counted = prompt.clone();
                if self
                    .owned_pins
                    .borrow_mut()
                    .pin(change.from, change.key, change.backend, prompt)
                {
                    let tail = self.own_tail(change.from, &counted);
                    self.change_load_pinned(change.backend, |load, pinned| {
                        let new_blocks = pinned.pin(counted.owned(self.shard, self.shards));
                        load.pinned_prompt_tokens = load
                            .pinned_prompt_tokens
                            .saturating_add(counted.block_tokens(new_blocks).saturating_add(tail));
                    });
                }
            }
            None => {
                let released = self.owned_pins.borrow_mut().unpin(change.from, change.key);
                if let Some((backend, prompt)) = released {
                    self.release_pin(change.from, backend, &prompt);
                }
            }
        }
    }

    fn release_pin(self: &Rc<Self>, from: usize, backend: BackendId, prompt: &PromptBlocks) {
        let tail = self.own_tail(from, prompt);
        self.change_load_pinned(backend, |load, pinned| {
            let freed =
                prompt.block_tokens(pinned.unpin(prompt.owned(self.shard, self.shards))) + tail;
            load.pinned_prompt_tokens = load.pinned_prompt_tokens.saturating_sub(freed);
        });
    }

    /// A prompt's tail counts on the core its request is on.
    fn own_tail(&self, from: usize, prompt: &PromptBlocks) -> u64 {
        if from == self.shard {
            prompt.tail_tokens
        } else {
            0
        }
    }

    /// Sets an engine's reuse report against the estimate's view of the request: this core's
    /// capacity correction moves, and an eviction it reveals goes to every replica.
    fn observe_reuse(
        self: &Rc<Self>,
        backend: BackendId,
        probe: &myelin_routing::ReuseProbe,
        cached_tokens: u64,
    ) {
        let (observation, write) =
            self.routing
                .borrow_mut()
                .observe_reuse(backend, probe, cached_tokens);
        self.meters
            .residency_predicted_vs_reported
            .record(cached_tokens as f64 - probe.predicted_cached_tokens);
        let outcome = if observation.reported_blocks >= observation.matched_blocks {
            "as_history"
        } else {
            "short"
        };
        self.meters.reuse_reports.get(outcome).increment(1);
        // The prompt's uncached part was counted as history had it; what the engine had to
        // prefill beyond that is pressure too.
        let history_cached = (u64::from(probe.reusable_blocks()) * u64::from(probe.block_size))
            .max(probe.predicted_cached_tokens as u64);
        let shortfall = history_cached.saturating_sub(cached_tokens);
        if shortfall > 0 {
            self.change_load(backend, |load| {
                load.admitted_tokens = load.admitted_tokens.saturating_add(shortfall);
            });
        }
        if let Some(write) = write {
            self.replicate(write);
        }
    }

    /// Counts a request sent to `backend` as a second home of its prefix (admin API).
    pub fn note_prefix_replication(self: &Rc<Self>, backend: BackendId) {
        self.change_load(backend, |load| {
            load.prefix_replications = load.prefix_replications.saturating_add(1);
        });
    }

    /// Applies `change` to this core's load on `backend`; the other cores hear of it with the
    /// next flush.
    fn change_load(self: &Rc<Self>, backend: BackendId, change: impl FnOnce(&mut Load)) {
        self.change_load_sent(backend, SentChange::None, change);
    }

    /// [`Self::change_load`] with a request starting or ending its wait for a first token
    /// ([`Load::prefilling_since_ms`]).
    fn change_load_sent(
        self: &Rc<Self>,
        backend: BackendId,
        sent: SentChange,
        change: impl FnOnce(&mut Load),
    ) {
        self.change_load_entry(backend, move |load, _, sent_times| {
            match sent {
                SentChange::None => {}
                SentChange::Waiting(ms) => sent_times.add(ms),
                SentChange::Done(ms) => sent_times.remove(ms),
            }
            change(load);
        });
    }

    /// [`Self::change_load`] with the backend's pinned prompt blocks.
    fn change_load_pinned(
        self: &Rc<Self>,
        backend: BackendId,
        change: impl FnOnce(&mut Load, &mut PinnedBlocks),
    ) {
        self.change_load_entry(backend, |load, pinned, _| change(load, pinned));
    }

    /// Changes this core's load on a backend (with its pinned blocks and the send times of its
    /// requests without a first token) and tells the routing state and the other cores.
    fn change_load_entry(
        self: &Rc<Self>,
        backend: BackendId,
        change: impl FnOnce(&mut Load, &mut PinnedBlocks, &mut SentTimes),
    ) {
        let load = {
            let mut backends = self.backends.borrow_mut();
            let Some(entry) = backends.get_mut(backend) else {
                return;
            };
            change(
                &mut entry.local,
                &mut entry.pinned,
                &mut entry.prefilling_sent,
            );
            entry.local.prefilling_since_ms = entry.prefilling_sent.earliest();
            entry.local
        };
        self.routing
            .borrow_mut()
            .set_load(backend, self.shard, load);
        if self.tells_others() {
            let mut dirty = self.dirty_loads.borrow_mut();
            if !dirty.contains(&backend) {
                dirty.push(backend);
            }
            drop(dirty);
            self.schedule_flush();
        }
    }

    /// Sends this core's load on `loads`' backends to every other data core (one batch).
    fn broadcast_loads(&self, loads: &[(BackendId, Load)]) {
        if !self.tells_others() || loads.is_empty() {
            return;
        }
        let sent_at = Instant::now();
        let batch: Arc<[LoadUpdate]> = loads
            .iter()
            .map(|&(backend, load)| LoadUpdate {
                from: self.shard,
                backend,
                load,
                sent_at,
            })
            .collect();
        for peer in self.write_recipients() {
            self.send(peer, Message::Loads(batch.clone()));
        }
    }

    /// Whether this core's writes and load go anywhere: other data cores, or the control
    /// core's gossip (peer cluster).
    fn tells_others(&self) -> bool {
        self.shards > 1 || self.config.gossip.is_some()
    }

    /// Cores told of this core's writes and load: every other data core, and the control core
    /// (index `shards`) when it gossips them to the peer cluster.
    fn write_recipients(&self) -> impl Iterator<Item = usize> + use<> {
        let own = self.shard;
        let control = self.config.gossip.is_some().then_some(self.shards);
        (0..self.shards)
            .filter(move |&peer| peer != own)
            .chain(control)
    }
}

/// Whether the engine's listed model name `listed` is what a request naming `requested` asks
/// for: the same name, or an Ollama name whose tag the request left out (`llama3` is
/// `llama3:latest`).
fn names(listed: &str, requested: &str) -> bool {
    listed == requested
        || listed
            .strip_suffix(":latest")
            .is_some_and(|untagged| untagged == requested)
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn a_model_name_matches_itself_and_an_untagged_ollama_name_its_latest_tag() {
        assert!(names(
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Llama-3.1-8B-Instruct"
        ));
        assert!(names("llama3:latest", "llama3"));
        assert!(!names("llama3:8b", "llama3"));
        assert!(!names("llama3", "llama3:latest"));
        assert!(!names("a-lora", "a"));
        assert!(!names(":latest", "x"));
    }
}
