//! The control core: owns the backend list and its health (active checks, passive circuit
//! breaker, half-open probes), serves the admin API on its own listener and executes its
//! changes, fans state changes out to the data cores, runs the metrics recorder's upkeep and
//! the optional `--metrics-listen` server. Nothing here is on the request path; a slow engine
//! only ever delays a health check.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use glommio::channels::shared_channel::ConnectedReceiver;
use glommio::timer::Timer;
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use myelin_http::body::{Body, empty};
use myelin_http::client::{Pool, PoolConfig};
use myelin_routing::{MirrorTrust, ResidencyMode, WriteOp};

use crate::backend_spec::BackendSpec;
use crate::backends::{BackendId, BackendInfo, BackendState};
use crate::config::{AdminListen, AdminToken, HealthConfig, ServeConfig};
use crate::engine_metrics::ServedModels;
use crate::health::{BackendHealth, HealthEvent};
use crate::kv_feed::{KvFeed, MirrorChange};
use crate::kv_subscriber::{FeedEvent, KvEndpoints, MirrorStatus, Subscriber};
use crate::mesh::{Mesh, MeshEnds, OneShot};
use crate::messages::{Message, ReplicaSnapshot};
use crate::metrics as names;

pub(crate) mod gossip;

/// How often a backend's context length is asked again once known, and while unknown.
const MODEL_LEN_REFRESH: Duration = Duration::from_secs(30);
const MODEL_LEN_RETRY: Duration = Duration::from_secs(5);
/// How often open breakers are checked for the end of their open period.
const BREAKER_TICK: Duration = Duration::from_millis(50);
/// How often the Prometheus recorder drains histogram samples.
const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How often the control loop looks at the stop flag.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How often KV-event subscribers' updates are looked for while none arrive.
const KV_FEED_INTERVAL: Duration = Duration::from_millis(2);
/// How often the control core forwards KV events while they keep arriving.
const KV_FEED_BUSY_INTERVAL: Duration = Duration::from_micros(250);
/// Updates queued between the subscriber threads and the control core; a full queue makes the
/// subscribers wait (and, if it lasts, the engines' PUB sockets drop: counted as gaps).
const KV_FEED_QUEUE: usize = 16 * 1024;
/// How long an admin change waits for every data core to confirm it; past it the change is
/// answered 503 and its pending entry expires (the change itself stays on the control core).
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often an admin change not yet confirmed by every data core is sent again to those
/// that did not confirm it (a full queue drops messages).
const ADMIN_RESEND_INTERVAL: Duration = Duration::from_millis(100);
/// Most of a health check's response body read (the rest is not: its connection is dropped).
const MAX_HEALTH_BODY_BYTES: usize = 64 * 1024;
/// How often the resolver thread's answers are looked at.
const DNS_POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How often the whole backend list goes to every data core (heals dropped changes).
const BACKEND_SYNC_INTERVAL: Duration = Duration::from_secs(1);
/// How often data cores that missed a mirror write are looked for (their mirrors are then
/// rebuilt from the KV-event feeds' snapshots).
const MIRROR_RESYNC_INTERVAL: Duration = Duration::from_millis(200);
/// How long the admin listing waits for the data cores' replica snapshots.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(1);

/// An operator action from the admin API, executed by the control core.
#[derive(Debug, Clone)]
pub(crate) enum AdminOp {
    Add(BackendSpec),
    Remove(BackendId),
    Drain(BackendId),
}

/// What an admin action did.
#[derive(Debug, Clone)]
pub(crate) enum AdminOutcome {
    Added(BackendInfo),
    Removed(BackendInfo),
    Draining(BackendInfo),
    NotFound(BackendId),
    Duplicate(String),
}

/// Addresses the control core listens on, reported at startup.
#[derive(Debug, Clone, Default)]
pub struct ControlAddrs {
    pub metrics: Option<std::net::SocketAddr>,
    /// The admin API: `http://HOST:PORT` (port 0 resolved) or `unix:PATH`.
    pub admin: Option<String>,
}

struct ControlBackend {
    info: BackendInfo,
    health: BackendHealth,
    draining: bool,
    probe_in_flight: bool,
}

impl ControlBackend {
    fn effective_state(&self) -> BackendState {
        if self.draining {
            BackendState::Draining
        } else if self.health.is_routable() {
            BackendState::Up
        } else {
            BackendState::Down
        }
    }
}

/// An admin change sent to the data cores, until every one confirmed it or it expired.
struct PendingChange {
    outcome: AdminOutcome,
    reply: OneShot<AdminOutcome>,
    /// Data cores that have not confirmed it yet, by index.
    unconfirmed: Vec<bool>,
    message: Rc<dyn Fn() -> Message>,
    expires: Instant,
}

struct ControlState {
    backends: BTreeMap<BackendId, ControlBackend>,
    next_backend_id: BackendId,
    /// Version of the next backend change sent to the data cores (every kind of change shares
    /// this counter, so a data core can tell which of two changes is newer).
    next_version: u64,
    pending: BTreeMap<u64, PendingChange>,
}

impl ControlState {
    fn take_version(&mut self) -> u64 {
        let version = self.next_version;
        self.next_version += 1;
        version
    }
}

/// The control core's context.
pub(crate) struct Control {
    shards: usize,
    residency: ResidencyMode,
    admin_token: Option<AdminToken>,
    /// The process's metrics, served as GET /metrics on the admin API.
    metrics: PrometheusHandle,
    pending_snapshots: RefCell<HashMap<u64, OneShot<ReplicaSnapshot>>>,
    /// Explained decisions asked of a data core, by request id.
    pending_explains: RefCell<HashMap<u64, OneShot<ExplainAnswer>>>,
    /// Largest request body explained (`--max-body-bytes`, as on the client port).
    pub(crate) max_body_bytes: usize,
    next_request_id: Cell<u64>,
    health_config: HealthConfig,
    mesh: Mesh<Message>,
    state: RefCell<ControlState>,
    pool: Pool,
    /// KV-event subscribers by backend; dropping one stops its thread.
    subscribers: RefCell<HashMap<BackendId, Subscriber>>,
    /// Each followed backend's mirror: live (`None`) or why not, as its subscriber last said.
    mirror_status: RefCell<HashMap<BackendId, MirrorStatus>>,
    /// Each backend's KV-cache figures from its last metrics scrape (residency estimate).
    engine_caches: RefCell<HashMap<BackendId, crate::engine_metrics::EngineCache>>,
    /// Per backend, its scraped generated-tokens counter and when it last moved (the progress
    /// watchdog's evidence, see [`Control::on_stall`]).
    engine_progress: RefCell<HashMap<BackendId, (f64, Instant)>>,
    /// Per backend, what its `GET /v1/models` reported and when it was asked.
    model_lens: RefCell<HashMap<BackendId, (Option<ServedModels>, Instant)>>,
    /// How often `engine_caches` is refreshed (`--engine-metrics-interval-ms`).
    engine_metrics_interval: Duration,
    /// `--engine-stall-ms` (`None`: the progress watchdog is off).
    engine_stall: Option<Duration>,
    /// Data cores a mirror write could not be sent to since their last resync.
    mirror_dirty: RefCell<Vec<bool>>,
    /// Per data core, the number the next mirror write to it carries ([`Message::MirrorWrites`]).
    mirror_seq: RefCell<Vec<u64>>,
    /// Per data core, the followed backends whose snapshot it still waits for (a resync in
    /// progress).
    mirror_awaiting: RefCell<Vec<std::collections::BTreeSet<BackendId>>>,
    /// The `myelin-dns` thread (host names of the engines) and the last good address of each.
    resolver: Option<crate::dns::Resolver>,
    addresses: RefCell<BTreeMap<String, std::net::SocketAddr>>,
    /// Fault injection (`--fault-drop-control-messages`): every Nth message this core sends is
    /// dropped as if the queue were full (0: never).
    fault_drop_every: u64,
    fault_sent: Cell<u64>,
    feed_sender: crossbeam_channel::Sender<FeedEvent>,
    block_size: std::num::NonZeroU32,
    control_cpu: Option<usize>,
    /// The peer cluster (`--gossip-listen`), once started.
    gossip: RefCell<Option<Rc<gossip::Gossip>>>,
}

/// The admin API's listener, started on the control core ([`run_control`]'s `start_admin`).
pub struct AdminServer {
    pub task: glommio::Task<myelin_http::server::ServeReport>,
    /// What the startup line shows (`http://HOST:PORT` or `unix:PATH`).
    pub address: String,
    /// The Unix socket to remove at exit.
    pub socket: Option<std::path::PathBuf>,
}

/// A data core's explained decision: the evidence as JSON, or why there is none.
pub type ExplainAnswer = Result<serde_json::Value, crate::openai::ApiError>;

/// Binds `listen` and serves the admin API on it until the shutdown (`admin.rs`).
pub type StartAdmin = fn(
    &Rc<Control>,
    &AdminListen,
    Option<&myelin_http::tls::ServerTls>,
    myelin_http::server::Shutdown,
) -> Result<AdminServer, String>;

/// Runs the control core until `stop` is set. `initial` are the configured backends (ids
/// 0..n, in order); the data cores were given the same list at startup.
#[expect(
    clippy::too_many_arguments,
    reason = "the control core's whole setup, handed over once by lib.rs"
)]
pub async fn run_control(
    config: Arc<ServeConfig>,
    shards: usize,
    mesh_ends: MeshEnds<Message>,
    initial: Vec<BackendInfo>,
    metrics: PrometheusHandle,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<Result<ControlAddrs, String>>,
    start_admin: StartAdmin,
) {
    let (mesh, receivers) = mesh_ends.connect().await;
    let (feed_sender, feed_receiver) = crossbeam_channel::bounded(KV_FEED_QUEUE);
    let next_backend_id = BackendId(initial.iter().map(|info| info.id.0 + 1).max().unwrap_or(0));
    let backends = initial
        .into_iter()
        .map(|info| {
            metrics::gauge!(names::BACKEND_UP, "backend" => names::backend_label(info.id)).set(1.0);
            (
                info.id,
                ControlBackend {
                    info,
                    health: BackendHealth::new(),
                    draining: false,
                    probe_in_flight: false,
                },
            )
        })
        .collect();
    let control = Rc::new(Control {
        shards,
        residency: config.residency,
        admin_token: config.admin_token.clone(),
        metrics: metrics.clone(),
        pending_snapshots: RefCell::new(HashMap::new()),
        pending_explains: RefCell::new(HashMap::new()),
        max_body_bytes: config.max_body_bytes,
        next_request_id: Cell::new(1),
        health_config: config.health.clone(),
        mesh,
        state: RefCell::new(ControlState {
            backends,
            next_backend_id,
            next_version: 1,
            pending: BTreeMap::new(),
        }),
        pool: Pool::new(PoolConfig {
            connect_timeout: config.health.timeout,
            max_idle_per_host: 2,
            tls: Some(config.engine_tls.clone()),
        })
        .with_provided_addresses(),
        subscribers: RefCell::new(HashMap::new()),
        mirror_status: RefCell::new(HashMap::new()),
        engine_caches: RefCell::new(HashMap::new()),
        engine_progress: RefCell::new(HashMap::new()),
        model_lens: RefCell::new(HashMap::new()),
        engine_metrics_interval: config.engine_metrics_interval,
        engine_stall: config.engine_stall,
        mirror_dirty: RefCell::new(vec![false; shards]),
        mirror_seq: RefCell::new(vec![0; shards]),
        mirror_awaiting: RefCell::new(vec![Default::default(); shards]),
        resolver: match crate::dns::Resolver::start(config.layout.control_cpu) {
            Ok(resolver) => Some(resolver),
            Err(error) => {
                eprintln!(
                    "myelin: no resolver thread ({error}): host names stay as resolved at startup"
                );
                None
            }
        },
        addresses: RefCell::new(BTreeMap::new()),
        fault_drop_every: config.fault_drop_control_messages,
        fault_sent: Cell::new(0),
        feed_sender,
        block_size: std::num::NonZeroU32::new(u32::try_from(config.block_size).unwrap_or(16))
            .unwrap_or(std::num::NonZeroU32::MIN),
        control_cpu: config.layout.control_cpu,
        gossip: RefCell::new(None),
    });
    // Startup resolves on this thread (nothing is served yet); later the resolver thread does.
    let authorities = control.authorities();
    for (authority, addr) in crate::dns::resolve_now(&authorities) {
        control.pool.set_address(&authority, addr);
        control.addresses.borrow_mut().insert(authority, addr);
    }
    if let Some(resolver) = &control.resolver {
        resolver.follow(authorities);
    }
    glommio::spawn_local(dns_loop(control.clone())).detach();
    let initial_specs = control.check_targets();
    for (id, spec) in initial_specs {
        control.follow_backend(id, &spec);
    }
    glommio::spawn_local(feed_loop(control.clone(), feed_receiver)).detach();

    for (_, receiver) in receivers {
        let control = control.clone();
        glommio::spawn_local(receive_loop(control, receiver)).detach();
    }
    glommio::spawn_local(health_check_loop(control.clone())).detach();
    glommio::spawn_local(breaker_loop(control.clone())).detach();
    glommio::spawn_local(admin_resend_loop(control.clone())).detach();
    glommio::spawn_local(backend_sync_loop(control.clone())).detach();
    glommio::spawn_local(mirror_resync_loop(control.clone())).detach();
    glommio::spawn_local(engine_metrics_loop(control.clone())).detach();
    let upkeep_handle = metrics.clone();
    glommio::spawn_local(async move {
        loop {
            Timer::new(METRICS_UPKEEP_INTERVAL).await;
            upkeep_handle.run_upkeep();
        }
    })
    .detach();

    let mut addrs = ControlAddrs::default();
    let mut servers = Vec::new();
    let mut startup_error = None;
    if let Some(addr) = config.metrics_listen {
        match glommio::net::TcpListener::bind(addr) {
            Ok(listener) => {
                addrs.metrics = listener.local_addr().ok();
                let shutdown = myelin_http::server::Shutdown::new();
                shutdown.follow(stop.clone(), STOP_POLL_INTERVAL);
                let handle = metrics.clone();
                servers.push(glommio::spawn_local(myelin_http::server::serve(
                    listener,
                    move |request: Request<Incoming>| {
                        let handle = handle.clone();
                        async move { metrics_only(&handle, &request) }
                    },
                    myelin_http::server::ServerConfig {
                        drain_timeout: Duration::from_millis(100),
                        tls: config.metrics_tls.clone(),
                        on_tls: Some(crate::metrics::metrics_tls_event),
                        ..Default::default()
                    },
                    shutdown,
                )));
            }
            Err(error) => {
                startup_error = Some(format!("cannot listen for metrics on {addr}: {error}"));
            }
        }
    }
    let admin_shutdown = myelin_http::server::Shutdown::new();
    admin_shutdown.follow(stop.clone(), STOP_POLL_INTERVAL);
    let mut admin_socket = None;
    let admin = start_admin(
        &control,
        &config.admin_listen,
        config.admin_tls.as_ref(),
        admin_shutdown,
    )
    .map(|started| {
        addrs.admin = Some(started.address);
        admin_socket = started.socket;
        started.task
    });
    match admin {
        Ok(server) => servers.push(server),
        Err(error) => {
            startup_error.get_or_insert(format!(
                "cannot listen for the admin API on {} (--admin-listen; port 0 picks a free \
                 one): {error}",
                config.admin_listen
            ));
        }
    }
    if let Some(settings) = &config.gossip {
        match gossip::start(&control, settings, config.block_size, stop.clone()) {
            Ok(started) => {
                gossip::install(&started);
                *control.gossip.borrow_mut() = Some(started);
            }
            Err(message) => {
                startup_error.get_or_insert(message);
            }
        }
    }
    let _ = ready.send(match startup_error {
        Some(message) => Err(message),
        None => Ok(addrs),
    });

    while !stop.load(Ordering::Acquire) {
        Timer::new(STOP_POLL_INTERVAL).await;
    }
    // The data cores have drained: tell the peer cluster this node leaves.
    let leaving = control.gossip.borrow().clone();
    if let Some(gossip) = leaving {
        gossip.leave().await;
    }
    // Stop every subscriber thread (each notices within its receive timeout).
    control.subscribers.borrow_mut().clear();
    for task in servers {
        task.await;
    }
    if let Some(path) = admin_socket {
        let _ = std::fs::remove_file(path);
    }
}

fn metrics_only(handle: &PrometheusHandle, request: &Request<Incoming>) -> Response<Body> {
    if request.uri().path() != "/metrics" {
        return Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(empty())
            .unwrap_or_else(|_| Response::new(empty()));
    }
    names::exposition(handle)
}

/// Forwards the subscribers' mirror changes to every data core's replica (one shared payload
/// per batch).
async fn feed_loop(control: Rc<Control>, receiver: crossbeam_channel::Receiver<FeedEvent>) {
    let mut busy = false;
    loop {
        // While events flow, look again soon (event-to-routable lag p99 ~0.3 ms at half the
        // control core's capacity, docs/performance.md); idle, a slower tick costs nothing.
        Timer::new(if busy {
            KV_FEED_BUSY_INTERVAL
        } else {
            KV_FEED_INTERVAL
        })
        .await;
        busy = false;
        // Bounded per tick, so a flood of events cannot starve the control core's other tasks.
        for event in receiver.try_iter().take(4096) {
            busy = true;
            match event {
                FeedEvent::Updates { backend, updates } => {
                    let op = WriteOp::Mirror {
                        backend,
                        changes: updates.into(),
                    };
                    control.broadcast_write(op);
                }
                FeedEvent::Live { backend, status } => {
                    let trust = status.trust();
                    if control.url_of(backend).is_some() {
                        // Only for backends still listed (a removed one's thread says
                        // `Stopped` after the removal).
                        control.mirror_status.borrow_mut().insert(backend, status);
                        let label = names::backend_label(backend);
                        metrics::gauge!(names::KV_EVENTS_LIVE, "backend" => label.clone())
                            .set(if trust.is_live() { 1.0 } else { 0.0 });
                        metrics::gauge!(names::KV_EVENTS_PARTIAL, "backend" => label).set(
                            if trust == MirrorTrust::Partial {
                                1.0
                            } else {
                                0.0
                            },
                        );
                    }
                    control.broadcast_write(WriteOp::MirrorLive { backend, trust });
                }
                FeedEvent::Snapshot {
                    backend,
                    changes,
                    trust,
                } => control.deliver_snapshot(backend, changes, trust),
            }
        }
    }
}

async fn receive_loop(control: Rc<Control>, receiver: ConnectedReceiver<Message>) {
    while let Some(message) = receiver.recv().await {
        match message {
            Message::Outcome { backend, success } => {
                control.with_backend_health(backend, |health, now, config, events| {
                    health.on_request(success, now, config, events)
                });
            }
            Message::Stalled { backend, streaming } => control.on_stall(backend, streaming),
            Message::Applied {
                shard,
                version,
                cumulative,
            } => control.on_applied(shard, version, cumulative),
            Message::SnapshotReply {
                request_id,
                snapshot,
            } => {
                let slot = control.pending_snapshots.borrow_mut().remove(&request_id);
                if let Some(slot) = slot {
                    slot.fill(*snapshot);
                }
            }
            Message::ExplainReply { request_id, answer } => {
                let slot = control.pending_explains.borrow_mut().remove(&request_id);
                if let Some(slot) = slot {
                    slot.fill(answer);
                }
            }
            // Learned routes and load of the data cores: the peer cluster's (sent here only
            // when gossip is on).
            Message::Writes(writes) => {
                if let Some(gossip) = control.gossip.borrow().clone() {
                    gossip.on_local_writes(&control, &writes);
                }
            }
            Message::Loads(updates) => {
                if let Some(gossip) = control.gossip.borrow().clone() {
                    gossip.on_local_loads(&control, &updates);
                }
            }
            _ => {}
        }
    }
}

impl Control {
    /// A backend joined: its labelled series are exported at 0, and its KV events followed
    /// when its spec names an endpoint.
    fn follow_backend(&self, id: BackendId, spec: &BackendSpec) {
        names::export_backend_series(id, spec.kv_events.is_some());
        let Some(publish) = spec.kv_events.clone() else {
            return;
        };
        let endpoints = KvEndpoints {
            publish,
            replay: spec.kv_replay.clone(),
        };
        let feed = KvFeed::new(self.block_size);
        match Subscriber::start(
            id,
            endpoints,
            feed,
            self.feed_sender.clone(),
            self.control_cpu,
        ) {
            Ok(subscriber) => {
                if let Some(tokens) = spec.capacity_tokens {
                    subscriber.set_capacity_blocks(tokens / u64::from(self.block_size.get()));
                }
                self.subscribers.borrow_mut().insert(id, subscriber);
            }
            Err(error) => eprintln!("myelin: cannot follow KV events of {}: {error}", spec.url),
        }
    }

    fn url_of(&self, id: BackendId) -> Option<String> {
        self.state
            .borrow()
            .backends
            .get(&id)
            .map(|backend| backend.info.spec.url.clone())
    }

    /// Sends one write to every data core's replica (the payload is shared, not copied). A
    /// core the write could not be sent to (full queue) is marked for a mirror resync: the
    /// sender sees every drop, so no sequence numbers are needed to detect one.
    fn broadcast_write(&self, op: WriteOp) {
        let batch: Arc<[WriteOp]> = Arc::from(vec![op]);
        for shard in 0..self.shards {
            if !self.send_mirror(shard, batch.clone()) {
                self.mark_mirror_dirty(shard);
            }
        }
    }

    /// Sends mirror writes to one data core with the next number of its sequence, used up
    /// whether or not the send succeeds: the core sees the gap a drop leaves (and distrusts
    /// its mirrors until their snapshots arrive).
    fn send_mirror(&self, shard: usize, batch: Arc<[WriteOp]>) -> bool {
        let seq = {
            let mut seqs = self.mirror_seq.borrow_mut();
            let Some(next) = seqs.get_mut(shard) else {
                return false;
            };
            *next += 1;
            *next - 1
        };
        self.send(shard, Message::MirrorWrites { seq, batch })
    }

    fn mark_mirror_dirty(&self, shard: usize) {
        if let Some(dirty) = self.mirror_dirty.borrow_mut().get_mut(shard) {
            *dirty = true;
        }
    }

    /// Starts a mirror resync of every data core that missed a mirror write: each followed
    /// backend's subscriber sends its whole mirror, in stream order with its updates.
    fn start_mirror_resyncs(&self) {
        let dirty: Vec<usize> = {
            let mut flags = self.mirror_dirty.borrow_mut();
            let dirty = flags
                .iter()
                .enumerate()
                .filter(|(_, dirty)| **dirty)
                .map(|(shard, _)| shard)
                .collect();
            flags.iter_mut().for_each(|flag| *flag = false);
            dirty
        };
        if dirty.is_empty() {
            return;
        }
        let subscribers = self.subscribers.borrow();
        let mut awaiting = self.mirror_awaiting.borrow_mut();
        for shard in dirty {
            metrics::counter!(names::STATE_RESYNCS_TOTAL, "kind" => "mirror").increment(1);
            awaiting[shard].extend(subscribers.keys().copied());
        }
        for subscriber in subscribers.values() {
            subscriber.request_snapshot();
        }
    }

    /// Sends a backend's whole mirror to the data cores waiting for it (replacing what their
    /// replica holds for it, liveness included).
    fn deliver_snapshot(&self, backend: BackendId, changes: Vec<MirrorChange>, trust: MirrorTrust) {
        let waiting: Vec<usize> = self
            .mirror_awaiting
            .borrow()
            .iter()
            .enumerate()
            .filter(|(_, backends)| backends.contains(&backend))
            .map(|(shard, _)| shard)
            .collect();
        if waiting.is_empty() {
            return;
        }
        let batch: Arc<[WriteOp]> = Arc::from(vec![
            WriteOp::Mirror {
                backend,
                changes: changes.into(),
            },
            WriteOp::MirrorLive { backend, trust },
        ]);
        for shard in waiting {
            if self.send_mirror(shard, batch.clone()) {
                self.mirror_awaiting.borrow_mut()[shard].remove(&backend);
            } else {
                self.mark_mirror_dirty(shard);
            }
        }
    }

    /// Every backend's `host:port`.
    fn authorities(&self) -> Vec<String> {
        self.state
            .borrow()
            .backends
            .values()
            .map(|backend| backend.info.spec.authority.clone())
            .collect()
    }

    /// Takes the resolver thread's answers: a new or changed address goes to this core's pool
    /// and every data core's; a failure keeps the last good one.
    fn take_resolutions(&self) {
        let Some(resolver) = &self.resolver else {
            return;
        };
        let mut changed = false;
        for (authority, resolved) in resolver.results.try_iter() {
            match resolved {
                Ok(addr) => {
                    metrics::counter!(names::DNS_RESOLUTIONS_TOTAL, "result" => "ok").increment(1);
                    if self.addresses.borrow().get(&authority) != Some(&addr) {
                        self.pool.set_address(&authority, addr);
                        self.addresses.borrow_mut().insert(authority, addr);
                        changed = true;
                    }
                }
                Err(error) => {
                    metrics::counter!(names::DNS_RESOLUTIONS_TOTAL, "result" => "error")
                        .increment(1);
                    eprintln!("myelin: resolving {authority}: {error} (last address kept)");
                }
            }
        }
        if changed {
            self.broadcast_addresses();
        }
    }

    /// Sends every engine address to every data core.
    fn broadcast_addresses(&self) {
        let addresses: Arc<[(String, std::net::SocketAddr)]> = self
            .addresses
            .borrow()
            .iter()
            .map(|(authority, addr)| (authority.clone(), *addr))
            .collect();
        if !addresses.is_empty() {
            self.broadcast(|| Message::Addresses(addresses.clone()));
        }
    }

    /// Sends the whole backend list to every data core (see `Message::BackendSync`).
    fn sync_backends(&self) {
        self.broadcast_addresses();
        let (version, backends) = {
            let state = self.state.borrow();
            let backends: Arc<[BackendInfo]> = state
                .backends
                .values()
                .map(|backend| backend.info.clone())
                .collect();
            (state.next_version - 1, backends)
        };
        self.broadcast(|| Message::BackendSync {
            version,
            backends: backends.clone(),
        });
    }

    fn broadcast(&self, make: impl Fn() -> Message) {
        // One message per data core: each core has its own channel.
        for shard in 0..self.shards {
            self.send(shard, make());
        }
    }

    fn send(&self, to: usize, message: Message) -> bool {
        let kind = message.kind();
        if self.fault_drop_every > 0 {
            let sent = self.fault_sent.get() + 1;
            self.fault_sent.set(sent);
            if sent.is_multiple_of(self.fault_drop_every) {
                metrics::counter!(names::CROSS_CORE_DROPPED_TOTAL, "kind" => kind).increment(1);
                return false;
            }
        }
        match self.mesh.try_send(to, message) {
            Ok(()) => {
                metrics::counter!(names::CROSS_CORE_MESSAGES_TOTAL, "shard" => "control", "kind" => kind)
                    .increment(1);
                true
            }
            Err(_) => {
                metrics::counter!(names::CROSS_CORE_DROPPED_TOTAL, "kind" => kind).increment(1);
                false
            }
        }
    }

    /// Runs `update` on a backend's health and publishes any state change.
    /// What `id`'s `GET /v1/models` says (its context length, its LoRA adapters): asked when
    /// unknown (at most every [`MODEL_LEN_RETRY`]) and again every [`MODEL_LEN_REFRESH`] (an
    /// engine restarted with another `--max-model-len`, an adapter loaded or unloaded).
    /// `None` when it never answered.
    async fn served_models_of(&self, id: BackendId, url: &str) -> Option<ServedModels> {
        let (known, asked) = self
            .model_lens
            .borrow()
            .get(&id)
            .cloned()
            .map_or((None, None), |(known, at)| (known, Some(at)));
        let due = asked.is_none_or(|at| {
            at.elapsed()
                >= if known.is_some() {
                    MODEL_LEN_REFRESH
                } else {
                    MODEL_LEN_RETRY
                }
        });
        if !due {
            return known;
        }
        let fetched = crate::engine_metrics::fetch_models(&self.pool, url).await;
        let value = fetched.or(known);
        self.model_lens
            .borrow_mut()
            .insert(id, (value.clone(), Instant::now()));
        value
    }

    /// The LoRA adapters `id`'s `GET /v1/models` lists, for the admin API.
    pub(crate) fn lora_adapters(&self, id: BackendId) -> Vec<String> {
        self.model_lens
            .borrow()
            .get(&id)
            .and_then(|(known, _)| known.as_ref())
            .map(|served| served.adapters.to_vec())
            .unwrap_or_default()
    }

    /// The context length `id` reported, for the admin API.
    pub(crate) fn max_model_len(&self, id: BackendId) -> Option<u64> {
        self.model_lens
            .borrow()
            .get(&id)
            .and_then(|(known, _)| known.as_ref()?.max_model_len)
    }

    /// A data core's watchdog found `backend` silent on all its requests for
    /// `--engine-stall-ms`. Where the engine exports a generated-tokens counter, that decides:
    /// still as long, it is wedged; moving, it is busy (requests queued behind others), not
    /// wedged. Without the counter, silence on streams (a byte per token) is proof, and
    /// non-streaming requests alone (answered whole, at the end) are left to their deadline.
    fn on_stall(&self, backend: BackendId, streaming: bool) {
        let Some(stall) = self.engine_stall else {
            return;
        };
        let counter_still = self
            .engine_progress
            .borrow()
            .get(&backend)
            .map(|(_, moved)| moved.elapsed() >= stall);
        let evidence = match (counter_still, streaming) {
            (Some(true), _) => "progress_counter_still",
            (Some(false), _) | (None, false) => return,
            (None, true) => "streams_silent",
        };
        if self.url_of(backend).is_some() {
            let label = names::backend_label(backend);
            metrics::counter!(names::ENGINE_STALLS_TOTAL, "backend" => label, "evidence" => evidence)
                .increment(1);
        }
        self.with_backend_health(backend, |health, now, config, events| {
            health.on_stall(now, config, events)
        });
    }

    fn with_backend_health(
        &self,
        id: BackendId,
        update: impl FnOnce(&mut BackendHealth, Instant, &HealthConfig, &mut Vec<HealthEvent>),
    ) {
        let mut events = Vec::new();
        let changed = {
            let mut state = self.state.borrow_mut();
            let Some(backend) = state.backends.get_mut(&id) else {
                return;
            };
            let before = backend.effective_state();
            update(
                &mut backend.health,
                Instant::now(),
                &self.health_config,
                &mut events,
            );
            let after = backend.effective_state();
            let label = names::backend_label(id);
            for event in &events {
                match event {
                    HealthEvent::BreakerTransition { from, to } => {
                        metrics::counter!(
                            names::BREAKER_TRANSITIONS_TOTAL,
                            "backend" => label.clone(), "from" => *from, "to" => *to
                        )
                        .increment(1);
                    }
                    HealthEvent::CheckVerdict { up } => {
                        metrics::counter!(
                            names::HEALTH_TRANSITIONS_TOTAL,
                            "backend" => label.clone(), "to" => if *up { "up" } else { "down" }
                        )
                        .increment(1);
                    }
                }
            }
            backend.info.state = after;
            (before != after).then_some(after)
        };
        if let Some(state) = changed {
            self.publish_state(id, state);
        }
    }

    fn publish_state(&self, id: BackendId, state: BackendState) {
        // A dead engine's cache is gone: its mirror leaves routing until its stream says
        // whether it restarted (kv_subscriber.rs).
        if state == BackendState::Down
            && let Some(subscriber) = self.subscribers.borrow().get(&id)
        {
            subscriber.suspend();
        }
        let up = if state == BackendState::Up { 1.0 } else { 0.0 };
        metrics::gauge!(names::BACKEND_UP, "backend" => names::backend_label(id)).set(up);
        let version = self.state.borrow_mut().take_version();
        self.broadcast(|| Message::BackendState { version, id, state });
    }

    /// Number of data cores.
    pub(crate) fn shards(&self) -> usize {
        self.shards
    }

    /// The admin API's bearer token, when one is configured.
    pub(crate) fn admin_token(&self) -> Option<&AdminToken> {
        self.admin_token.as_ref()
    }

    /// The process's metrics (GET /metrics on the admin API).
    pub(crate) fn metrics(&self) -> &PrometheusHandle {
        &self.metrics
    }

    /// The configured residency mode (what a backend's residency is when no replica answered).
    pub(crate) fn residency(&self) -> ResidencyMode {
        self.residency
    }

    /// A followed backend's mirror (exact, partial or not live, and why); `None` when the
    /// backend has no KV-event stream (or its subscriber has said nothing yet).
    pub(crate) fn mirror_status(&self, id: BackendId) -> Option<MirrorStatus> {
        self.mirror_status.borrow().get(&id).copied()
    }

    /// A backend's KV-cache figures from its last metrics scrape (default: none yet).
    pub(crate) fn engine_cache(&self, id: BackendId) -> crate::engine_metrics::EngineCache {
        self.engine_caches
            .borrow()
            .get(&id)
            .copied()
            .unwrap_or_default()
    }

    /// Every backend as the control core knows it (its state is the truth the data cores
    /// follow).
    pub(crate) fn backend_infos(&self) -> Vec<BackendInfo> {
        self.state
            .borrow()
            .backends
            .values()
            .map(|backend| backend.info.clone())
            .collect()
    }

    /// Every data core's replica snapshot, by core index, from those that answered within
    /// [`SNAPSHOT_TIMEOUT`].
    pub(crate) async fn snapshots(&self) -> Vec<(usize, ReplicaSnapshot)> {
        let mut waiting = Vec::with_capacity(self.shards);
        for shard in 0..self.shards {
            let request_id = self.next_request_id.get();
            self.next_request_id.set(request_id + 1);
            let slot = OneShot::default();
            self.pending_snapshots
                .borrow_mut()
                .insert(request_id, slot.clone());
            if self.send(shard, Message::Snapshot { request_id }) {
                waiting.push((shard, request_id, slot));
            } else {
                self.pending_snapshots.borrow_mut().remove(&request_id);
            }
        }
        let deadline = Instant::now() + SNAPSHOT_TIMEOUT;
        let mut answers = Vec::with_capacity(waiting.len());
        for (shard, request_id, slot) in waiting {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(snapshot) = myelin_http::rt::timeout(left, slot.wait()).await {
                answers.push((shard, snapshot));
            }
            self.pending_snapshots.borrow_mut().remove(&request_id);
        }
        answers
    }

    /// Where data core 0 would route a generation request with `body` now, and why, without
    /// routing it (every core holds a replica of the same state); `None` when it did not
    /// answer within [`SNAPSHOT_TIMEOUT`].
    pub(crate) async fn explain(
        &self,
        endpoint: crate::openai::Endpoint,
        body: bytes::Bytes,
    ) -> Option<ExplainAnswer> {
        let request_id = self.next_request_id.get();
        self.next_request_id.set(request_id + 1);
        let slot = OneShot::default();
        self.pending_explains
            .borrow_mut()
            .insert(request_id, slot.clone());
        let message = Message::Explain {
            request_id,
            endpoint,
            body,
        };
        let answer = if self.send(0, message) {
            myelin_http::rt::timeout(SNAPSHOT_TIMEOUT, slot.wait()).await
        } else {
            None
        };
        self.pending_explains.borrow_mut().remove(&request_id);
        answer
    }

    /// Executes an admin action and waits until every data core has it (`None` when some did
    /// not confirm within [`ADMIN_TIMEOUT`]; the change stays made on the control core and is
    /// re-sent to the others until then).
    pub(crate) async fn admin_change(&self, op: AdminOp) -> Option<AdminOutcome> {
        let (outcome, change) = self.apply_admin(op);
        let Some((version, message)) = change else {
            return Some(outcome);
        };
        let reply = OneShot::default();
        self.state.borrow_mut().pending.insert(
            version,
            PendingChange {
                outcome,
                reply: reply.clone(),
                unconfirmed: vec![true; self.shards],
                message: message.clone(),
                expires: Instant::now() + ADMIN_TIMEOUT,
            },
        );
        self.broadcast(|| message());
        let confirmed = myelin_http::rt::timeout(ADMIN_TIMEOUT, reply.wait()).await;
        self.state.borrow_mut().pending.remove(&version);
        confirmed
    }

    /// Makes an admin change on the control core. Returns its outcome and, when the data cores
    /// must apply it, its version and the message that tells them (sent again to a core that
    /// has not confirmed it).
    #[allow(clippy::type_complexity)]
    fn apply_admin(&self, op: AdminOp) -> (AdminOutcome, Option<(u64, Rc<dyn Fn() -> Message>)>) {
        let mut state = self.state.borrow_mut();
        // KV-event subscriptions to start or stop once the state is released.
        let mut follow: Option<(BackendId, BackendSpec)> = None;
        let mut unfollow: Option<BackendId> = None;
        let (outcome, change): (AdminOutcome, Option<(u64, Rc<dyn Fn() -> Message>)>) = match op {
            AdminOp::Add(spec) => {
                if let Some(existing) = state
                    .backends
                    .values()
                    .find(|backend| backend.info.spec.url == spec.url)
                {
                    (
                        AdminOutcome::Duplicate(existing.info.spec.url.clone()),
                        None,
                    )
                } else {
                    let id = state.next_backend_id;
                    state.next_backend_id.0 += 1;
                    let version = state.take_version();
                    let info = BackendInfo {
                        id,
                        spec,
                        state: BackendState::Up,
                    };
                    follow = Some((id, info.spec.clone()));
                    metrics::gauge!(names::BACKEND_UP, "backend" => names::backend_label(id))
                        .set(1.0);
                    state.backends.insert(
                        id,
                        ControlBackend {
                            info: info.clone(),
                            health: BackendHealth::new(),
                            draining: false,
                            probe_in_flight: false,
                        },
                    );
                    let sent = info.clone();
                    let message: Rc<dyn Fn() -> Message> =
                        Rc::new(move || Message::BackendUpsert {
                            version,
                            info: sent.clone(),
                        });
                    (AdminOutcome::Added(info), Some((version, message)))
                }
            }
            AdminOp::Remove(id) => match state.backends.remove(&id) {
                Some(backend) => {
                    unfollow = Some(id);
                    let version = state.take_version();
                    metrics::gauge!(names::BACKEND_UP, "backend" => names::backend_label(id))
                        .set(0.0);
                    let message: Rc<dyn Fn() -> Message> =
                        Rc::new(move || Message::BackendRemove { version, id });
                    (
                        AdminOutcome::Removed(backend.info),
                        Some((version, message)),
                    )
                }
                None => (AdminOutcome::NotFound(id), None),
            },
            AdminOp::Drain(id) => {
                let version = state.next_version;
                match state.backends.get_mut(&id) {
                    Some(backend) => {
                        backend.draining = true;
                        backend.info.state = BackendState::Draining;
                        metrics::gauge!(names::BACKEND_UP, "backend" => names::backend_label(id))
                            .set(0.0);
                        let info = backend.info.clone();
                        state.next_version += 1;
                        let sent = info.clone();
                        let message: Rc<dyn Fn() -> Message> =
                            Rc::new(move || Message::BackendUpsert {
                                version,
                                info: sent.clone(),
                            });
                        (AdminOutcome::Draining(info), Some((version, message)))
                    }
                    None => (AdminOutcome::NotFound(id), None),
                }
            }
        };
        drop(state);
        let backends_changed = follow.is_some() || unfollow.is_some();
        if let Some((id, spec)) = follow {
            self.follow_backend(id, &spec);
        }
        if backends_changed && let Some(resolver) = &self.resolver {
            resolver.follow(self.authorities());
        }
        if let Some(id) = unfollow {
            self.subscribers.borrow_mut().remove(&id);
            self.mirror_status.borrow_mut().remove(&id);
            for awaiting in self.mirror_awaiting.borrow_mut().iter_mut() {
                awaiting.remove(&id);
            }
        }
        (outcome, change)
    }

    /// Data core `shard` has the change `version` (and every earlier one, when `cumulative`):
    /// once every core has an admin change, its caller gets the outcome.
    fn on_applied(&self, shard: usize, version: u64, cumulative: bool) {
        let finished: Vec<PendingChange> = {
            let mut state = self.state.borrow_mut();
            let confirmed: Vec<u64> = if cumulative {
                state.pending.range(..=version).map(|(&v, _)| v).collect()
            } else {
                state
                    .pending
                    .get(&version)
                    .map(|_| version)
                    .into_iter()
                    .collect()
            };
            let mut done = Vec::new();
            for change in confirmed {
                let Some(pending) = state.pending.get_mut(&change) else {
                    continue;
                };
                if let Some(flag) = pending.unconfirmed.get_mut(shard) {
                    *flag = false;
                }
                if !pending.unconfirmed.iter().any(|&flag| flag) {
                    done.extend(state.pending.remove(&change));
                }
            }
            done
        };
        for pending in finished {
            pending.reply.fill(pending.outcome);
        }
    }

    /// Sends every unconfirmed admin change again to the cores that have not confirmed it,
    /// and drops the expired ones.
    fn resend_pending(&self) {
        let now = Instant::now();
        let mut resend: Vec<(usize, Rc<dyn Fn() -> Message>)> = Vec::new();
        self.state.borrow_mut().pending.retain(|_, pending| {
            if pending.expires <= now {
                return false;
            }
            for (shard, &unconfirmed) in pending.unconfirmed.iter().enumerate() {
                if unconfirmed {
                    resend.push((shard, pending.message.clone()));
                }
            }
            true
        });
        for (shard, message) in resend {
            self.send(shard, message());
        }
    }

    fn check_targets(&self) -> Vec<(BackendId, BackendSpec)> {
        self.state
            .borrow()
            .backends
            .values()
            .map(|backend| (backend.info.id, backend.info.spec.clone()))
            .collect()
    }

    /// One active check: GET `{url}{path}`, success on 2xx within the timeout.
    async fn check(&self, spec: &BackendSpec) -> bool {
        let uri = format!("{}{}", spec.url, self.health_config.path);
        let Ok(request) = Request::builder()
            .method(Method::GET)
            .uri(uri)
            .body(empty())
        else {
            return false;
        };
        let attempt = async {
            match self.pool.send(request).await {
                Ok(response) => {
                    let success = response.status().is_success();
                    // Read the (small) body so the connection can be reused; a larger one is
                    // dropped unread, with its connection.
                    let limit = MAX_HEALTH_BODY_BYTES;
                    let _ = crate::proxy::collect_limited(response.into_body(), limit).await;
                    success
                }
                Err(_) => false,
            }
        };
        myelin_http::rt::timeout(self.health_config.timeout, attempt)
            .await
            .unwrap_or_else(|| {
                names::timeout("health_check");
                false
            })
    }
}

/// Scrapes every backend's metrics endpoint every `--engine-metrics-interval-ms` and sends each
/// data core the KV capacity found (every time: a dropped message heals with the next scrape)
/// and, from a scrape that answered, the engine's utilization and queue (the expected wait for
/// KV memory; data cores stop trusting them when they grow old). A failed scrape keeps the
/// last capacity.
async fn engine_metrics_loop(control: Rc<Control>) {
    loop {
        let targets = control.check_targets();
        let scrapes: Vec<_> = targets
            .into_iter()
            .map(|(id, spec)| {
                let control = control.clone();
                glommio::spawn_local(async move {
                    let scraped = crate::engine_metrics::scrape(&control.pool, &spec.url).await;
                    let served = control.served_models_of(id, &spec.url).await;
                    let memory = scraped.and_then(|scraped| scraped.memory());
                    if let Some(tokens) = scraped.and_then(|scraped| scraped.generation_tokens) {
                        let mut progress = control.engine_progress.borrow_mut();
                        let entry = progress.entry(id).or_insert((tokens, Instant::now()));
                        if entry.0 != tokens {
                            *entry = (tokens, Instant::now());
                        }
                    }
                    let cache = {
                        let mut caches = control.engine_caches.borrow_mut();
                        let cache = caches.entry(id).or_default();
                        if let Some(scraped) = scraped {
                            *cache = scraped;
                        }
                        *cache
                    };
                    // The end of a partial mirror (the configured capacity, else the engine's).
                    if let Some(tokens) = spec.capacity_tokens.or(cache.capacity_tokens)
                        && let Some(subscriber) = control.subscribers.borrow().get(&id)
                    {
                        subscriber
                            .set_capacity_blocks(tokens / u64::from(control.block_size.get()));
                    }
                    if let Some(utilization) = cache.utilization {
                        metrics::gauge!(
                            names::BACKEND_KV_UTILIZATION, "backend" => names::backend_label(id)
                        )
                        .set(utilization);
                    }
                    control.broadcast(|| Message::BackendCache {
                        id,
                        capacity_tokens: cache.capacity_tokens,
                        memory,
                        served: served.clone(),
                    });
                })
            })
            .collect();
        let interval = Timer::new(control.engine_metrics_interval);
        for scrape in scrapes {
            scrape.await;
        }
        control
            .engine_caches
            .borrow_mut()
            .retain(|id, _| control.state.borrow().backends.contains_key(id));
        control
            .engine_progress
            .borrow_mut()
            .retain(|id, _| control.state.borrow().backends.contains_key(id));
        control
            .model_lens
            .borrow_mut()
            .retain(|id, _| control.state.borrow().backends.contains_key(id));
        interval.await;
    }
}

/// Takes the resolver thread's answers every [`DNS_POLL_INTERVAL`].
async fn dns_loop(control: Rc<Control>) {
    loop {
        Timer::new(DNS_POLL_INTERVAL).await;
        control.take_resolutions();
    }
}

/// Sends the whole backend list every [`BACKEND_SYNC_INTERVAL`].
async fn backend_sync_loop(control: Rc<Control>) {
    loop {
        Timer::new(BACKEND_SYNC_INTERVAL).await;
        control.sync_backends();
    }
}

/// Starts mirror resyncs of data cores that missed a mirror write.
async fn mirror_resync_loop(control: Rc<Control>) {
    loop {
        Timer::new(MIRROR_RESYNC_INTERVAL).await;
        control.start_mirror_resyncs();
    }
}

/// Re-sends admin changes some data core has not confirmed (see [`Control::resend_pending`]).
async fn admin_resend_loop(control: Rc<Control>) {
    loop {
        Timer::new(ADMIN_RESEND_INTERVAL).await;
        control.resend_pending();
    }
}

async fn health_check_loop(control: Rc<Control>) {
    loop {
        let targets = control.check_targets();
        let checks: Vec<_> = targets
            .into_iter()
            .map(|(id, spec)| {
                let control = control.clone();
                glommio::spawn_local(async move {
                    let success = control.check(&spec).await;
                    control.with_backend_health(id, |health, now, config, events| {
                        health.on_check(success, now, config, events)
                    });
                })
            })
            .collect();
        let interval = Timer::new(control.health_config.interval);
        for check in checks {
            check.await;
        }
        interval.await;
    }
}

/// Moves open breakers to half-open when their period ends and sends the probe.
async fn breaker_loop(control: Rc<Control>) {
    loop {
        Timer::new(BREAKER_TICK).await;
        let now = Instant::now();
        let mut probes = Vec::new();
        let mut changed = Vec::new();
        {
            let mut state = control.state.borrow_mut();
            for backend in state.backends.values_mut() {
                let mut events = Vec::new();
                let before = backend.effective_state();
                if backend.health.on_tick(now, &mut events) && !backend.probe_in_flight {
                    backend.probe_in_flight = true;
                    probes.push((backend.info.id, backend.info.spec.clone()));
                }
                for event in events {
                    if let HealthEvent::BreakerTransition { from, to } = event {
                        metrics::counter!(
                            names::BREAKER_TRANSITIONS_TOTAL,
                            "backend" => names::backend_label(backend.info.id),
                            "from" => from, "to" => to
                        )
                        .increment(1);
                    }
                }
                let after = backend.effective_state();
                if before != after {
                    backend.info.state = after;
                    changed.push((backend.info.id, after));
                }
            }
        }
        for (id, state) in changed {
            control.publish_state(id, state);
        }
        for (id, spec) in probes {
            let control = control.clone();
            glommio::spawn_local(async move {
                let success = control.check(&spec).await;
                control.with_backend_health(id, |health, now, config, events| {
                    health.on_check(success, now, config, events)
                });
                if let Some(backend) = control.state.borrow_mut().backends.get_mut(&id) {
                    backend.probe_in_flight = false;
                }
            })
            .detach();
        }
    }
}
