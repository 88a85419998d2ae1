//! The control core: owns the backend list and its health (active checks, passive circuit
//! breaker, half-open probes), executes admin actions, fans state changes out to the data
//! cores, runs the metrics recorder's upkeep and the optional `--metrics-listen` server.
//! Nothing here is on the request path; a slow engine only ever delays a health check.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use glommio::channels::shared_channel::ConnectedReceiver;
use glommio::timer::Timer;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;
use myelin_http::body::{Body, empty, full};
use myelin_http::client::{Pool, PoolConfig};
use myelin_routing::WriteOp;

use crate::backend_spec::BackendSpec;
use crate::backends::{BackendId, BackendInfo, BackendState};
use crate::config::{HealthConfig, ServeConfig};
use crate::health::{BackendHealth, HealthEvent};
use crate::kv_feed::KvFeed;
use crate::kv_subscriber::{FeedEvent, KvEndpoints, Subscriber};
use crate::mesh::{Mesh, MeshEnds};
use crate::messages::{AdminOp, AdminOutcome, Message};
use crate::metrics as names;

/// How often open breakers are checked for the end of their open period.
const BREAKER_TICK: Duration = Duration::from_millis(50);
/// How often the Prometheus recorder drains histogram samples.
const METRICS_UPKEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How often the control loop looks at the stop flag.
const STOP_POLL_INTERVAL: Duration = Duration::from_millis(20);
/// How often KV-event subscribers' updates are forwarded to the data cores.
const KV_FEED_INTERVAL: Duration = Duration::from_millis(2);
/// Updates queued between the subscriber threads and the control core; a full queue makes the
/// subscribers wait (and, if it lasts, the engines' PUB sockets drop: counted as gaps).
const KV_FEED_QUEUE: usize = 16 * 1024;

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

struct PendingChange {
    request_id: u64,
    reply_to: usize,
    outcome: AdminOutcome,
    acks_remaining: usize,
}

struct ControlState {
    backends: BTreeMap<BackendId, ControlBackend>,
    next_backend_id: BackendId,
    next_change_id: u64,
    pending: HashMap<u64, PendingChange>,
}

/// The control core's context.
struct Control {
    shards: usize,
    health_config: HealthConfig,
    mesh: Mesh<Message>,
    state: RefCell<ControlState>,
    pool: Pool,
    /// KV-event subscribers by backend; dropping one stops its thread.
    subscribers: RefCell<HashMap<BackendId, Subscriber>>,
    feed_sender: crossbeam_channel::Sender<FeedEvent>,
    block_size: std::num::NonZeroU32,
    control_cpu: Option<usize>,
}

/// Runs the control core until `stop` is set. `initial` are the configured backends (ids
/// 0..n, in order); the data cores were given the same list at startup.
pub async fn run_control(
    config: Arc<ServeConfig>,
    shards: usize,
    mesh_ends: MeshEnds<Message>,
    initial: Vec<BackendInfo>,
    metrics: PrometheusHandle,
    stop: Arc<AtomicBool>,
    ready: std::sync::mpsc::Sender<Result<Option<std::net::SocketAddr>, String>>,
) {
    let (mesh, receivers) = mesh_ends.connect().await;
    let (feed_sender, feed_receiver) = crossbeam_channel::bounded(KV_FEED_QUEUE);
    let next_backend_id = initial.iter().map(|info| info.id + 1).max().unwrap_or(0);
    let backends = initial
        .into_iter()
        .map(|info| {
            metrics::gauge!(names::BACKEND_UP, "backend" => info.spec.url.clone()).set(1.0);
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
        health_config: config.health.clone(),
        mesh,
        state: RefCell::new(ControlState {
            backends,
            next_backend_id,
            next_change_id: 1,
            pending: HashMap::new(),
        }),
        pool: Pool::new(PoolConfig {
            connect_timeout: config.health.timeout,
            max_idle_per_host: 2,
        }),
        subscribers: RefCell::new(HashMap::new()),
        feed_sender,
        block_size: std::num::NonZeroU32::new(u32::try_from(config.block_size).unwrap_or(16))
            .unwrap_or(std::num::NonZeroU32::MIN),
        control_cpu: config.layout.control_cpu,
    });
    let initial_specs = control.check_targets();
    for (id, spec) in initial_specs {
        control.follow_kv_events(id, &spec);
    }
    glommio::spawn_local(feed_loop(control.clone(), feed_receiver)).detach();

    for (_, receiver) in receivers {
        let control = control.clone();
        glommio::spawn_local(receive_loop(control, receiver)).detach();
    }
    glommio::spawn_local(health_check_loop(control.clone())).detach();
    glommio::spawn_local(breaker_loop(control.clone())).detach();
    let upkeep_handle = metrics.clone();
    glommio::spawn_local(async move {
        loop {
            Timer::new(METRICS_UPKEEP_INTERVAL).await;
            upkeep_handle.run_upkeep();
        }
    })
    .detach();

    let metrics_server = match config.metrics_listen {
        Some(addr) => match glommio::net::TcpListener::bind(addr) {
            Ok(listener) => {
                let bound = listener.local_addr().ok();
                let shutdown = myelin_http::server::Shutdown::new();
                shutdown.follow(stop.clone(), STOP_POLL_INTERVAL);
                let handle = metrics.clone();
                let task = glommio::spawn_local(myelin_http::server::serve(
                    listener,
                    move |request: Request<Incoming>| {
                        let handle = handle.clone();
                        async move { metrics_only(&handle, &request) }
                    },
                    myelin_http::server::ServerConfig {
                        drain_timeout: Duration::from_millis(100),
                        ..Default::default()
                    },
                    shutdown,
                ));
                let _ = ready.send(Ok(bound));
                Some(task)
            }
            Err(error) => {
                let _ = ready.send(Err(format!("cannot listen for metrics on {addr}: {error}")));
                None
            }
        },
        None => {
            let _ = ready.send(Ok(None));
            None
        }
    };

    while !stop.load(Ordering::Acquire) {
        Timer::new(STOP_POLL_INTERVAL).await;
    }
    // Stop every subscriber thread (each notices within its receive timeout).
    control.subscribers.borrow_mut().clear();
    if let Some(task) = metrics_server {
        task.await;
    }
}

fn metrics_only(handle: &PrometheusHandle, request: &Request<Incoming>) -> Response<Body> {
    if request.uri().path() != "/metrics" {
        return Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(empty())
            .unwrap_or_else(|_| Response::new(empty()));
    }
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
        .body(full(handle.render()))
        .unwrap_or_else(|_| Response::new(empty()))
}

/// Forwards the subscribers' mirror changes to every data core's replica (one shared payload
/// per batch).
async fn feed_loop(control: Rc<Control>, receiver: crossbeam_channel::Receiver<FeedEvent>) {
    loop {
        Timer::new(KV_FEED_INTERVAL).await;
        // Bounded per tick, so a flood of events cannot starve the control core's other tasks.
        for event in receiver.try_iter().take(4096) {
            match event {
                FeedEvent::Updates { backend, updates } => {
                    let op = WriteOp::Mirror {
                        backend: myelin_routing::BackendId(backend),
                        changes: updates.into(),
                    };
                    control.broadcast_write(op);
                }
                FeedEvent::Live { backend, live } => {
                    if let Some(url) = control.url_of(backend) {
                        metrics::gauge!(names::KV_EVENTS_LIVE, "backend" => url).set(if live {
                            1.0
                        } else {
                            0.0
                        });
                    }
                    control.broadcast_write(WriteOp::MirrorLive {
                        backend: myelin_routing::BackendId(backend),
                        live,
                    });
                }
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
            Message::Admin {
                request_id,
                reply_to,
                op,
            } => control.apply_admin(request_id, reply_to, op),
            Message::Applied { change_id } => control.on_applied(change_id),
            _ => {}
        }
    }
}

impl Control {
    /// Starts following a backend's KV events, when its spec names an endpoint.
    fn follow_kv_events(&self, id: BackendId, spec: &BackendSpec) {
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

    /// Sends one write to every data core's replica (the payload is shared, not copied).
    fn broadcast_write(&self, op: WriteOp) {
        let batch: Arc<[WriteOp]> = Arc::from(vec![op]);
        self.broadcast(|| Message::Writes(batch.clone()));
    }

    fn broadcast(&self, make: impl Fn() -> Message) {
        // One message per data core: each core has its own channel.
        for shard in 0..self.shards {
            self.send(shard, make());
        }
    }

    fn send(&self, to: usize, message: Message) {
        let kind = message.kind();
        match self.mesh.try_send(to, message) {
            Ok(()) => {
                metrics::counter!(names::CROSS_CORE_MESSAGES_TOTAL, "shard" => "control", "kind" => kind)
                    .increment(1);
            }
            Err(_) => {
                metrics::counter!(names::CROSS_CORE_DROPPED_TOTAL, "kind" => kind).increment(1);
            }
        }
    }

    /// Runs `update` on a backend's health and publishes any state change.
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
            let url = backend.info.spec.url.clone();
            for event in &events {
                match event {
                    HealthEvent::BreakerTransition { from, to } => {
                        metrics::counter!(
                            names::BREAKER_TRANSITIONS_TOTAL,
                            "backend" => url.clone(), "from" => *from, "to" => *to
                        )
                        .increment(1);
                    }
                    HealthEvent::CheckVerdict { up } => {
                        metrics::counter!(
                            names::HEALTH_TRANSITIONS_TOTAL,
                            "backend" => url.clone(), "to" => if *up { "up" } else { "down" }
                        )
                        .increment(1);
                    }
                }
            }
            backend.info.state = after;
            (before != after).then_some((after, url))
        };
        if let Some((state, url)) = changed {
            self.publish_state(id, state, url);
        }
    }

    fn publish_state(&self, id: BackendId, state: BackendState, url: String) {
        let up = if state == BackendState::Up { 1.0 } else { 0.0 };
        metrics::gauge!(names::BACKEND_UP, "backend" => url).set(up);
        self.broadcast(|| Message::BackendState { id, state });
    }

    fn apply_admin(&self, request_id: u64, reply_to: usize, op: AdminOp) {
        let mut state = self.state.borrow_mut();
        let change_id = state.next_change_id;
        state.next_change_id += 1;
        // KV-event subscriptions to start or stop once the state is released.
        let mut follow: Option<(BackendId, BackendSpec)> = None;
        let mut unfollow: Option<BackendId> = None;
        let (outcome, broadcast) = match op {
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
                    state.next_backend_id += 1;
                    let info = BackendInfo {
                        id,
                        spec,
                        state: BackendState::Up,
                    };
                    let info_copy = info.clone();
                    follow = Some((id, info.spec.clone()));
                    metrics::gauge!(names::BACKEND_UP, "backend" => info.spec.url.clone()).set(1.0);
                    state.backends.insert(
                        id,
                        ControlBackend {
                            info: info_copy.clone(),
                            health: BackendHealth::new(),
                            draining: false,
                            probe_in_flight: false,
                        },
                    );
                    let upsert: Box<dyn Fn() -> Message> =
                        Box::new(move || Message::BackendUpsert {
                            change_id,
                            info: info.clone(),
                        });
                    (AdminOutcome::Added(info_copy), Some(upsert))
                }
            }
            AdminOp::Remove(id) => match state.backends.remove(&id) {
                Some(backend) => {
                    unfollow = Some(id);
                    metrics::gauge!(names::BACKEND_UP, "backend" => backend.info.spec.url.clone())
                        .set(0.0);
                    let remove: Box<dyn Fn() -> Message> =
                        Box::new(move || Message::BackendRemove { change_id, id });
                    (AdminOutcome::Removed(backend.info), Some(remove))
                }
                None => (AdminOutcome::NotFound(id), None),
            },
            AdminOp::Drain(id) => match state.backends.get_mut(&id) {
                Some(backend) => {
                    backend.draining = true;
                    backend.info.state = BackendState::Draining;
                    metrics::gauge!(names::BACKEND_UP, "backend" => backend.info.spec.url.clone())
                        .set(0.0);
                    let info = backend.info.clone();
                    let upsert: Box<dyn Fn() -> Message> =
                        Box::new(move || Message::BackendUpsert {
                            change_id,
                            info: info.clone(),
                        });
                    (AdminOutcome::Draining(backend.info.clone()), Some(upsert))
                }
                None => (AdminOutcome::NotFound(id), None),
            },
        };
        drop(state);
        if let Some((id, spec)) = follow {
            self.follow_kv_events(id, &spec);
        }
        if let Some(id) = unfollow {
            self.subscribers.borrow_mut().remove(&id);
        }
        let mut state = self.state.borrow_mut();
        match broadcast {
            Some(make_message) => {
                state.pending.insert(
                    change_id,
                    PendingChange {
                        request_id,
                        reply_to,
                        outcome,
                        acks_remaining: self.shards,
                    },
                );
                drop(state);
                self.broadcast(make_message);
            }
            None => {
                drop(state);
                self.send(
                    reply_to,
                    Message::AdminReply {
                        request_id,
                        outcome,
                    },
                );
            }
        }
    }

    fn on_applied(&self, change_id: u64) {
        let finished = {
            let mut state = self.state.borrow_mut();
            let Some(pending) = state.pending.get_mut(&change_id) else {
                return;
            };
            pending.acks_remaining = pending.acks_remaining.saturating_sub(1);
            if pending.acks_remaining > 0 {
                return;
            }
            state.pending.remove(&change_id)
        };
        if let Some(pending) = finished {
            self.send(
                pending.reply_to,
                Message::AdminReply {
                    request_id: pending.request_id,
                    outcome: pending.outcome,
                },
            );
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
                    // Read the (small) body so the connection can be reused.
                    let _ = response.into_body().collect().await;
                    success
                }
                Err(_) => false,
            }
        };
        myelin_http::rt::timeout(self.health_config.timeout, attempt)
            .await
            .unwrap_or(false)
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
                            "backend" => backend.info.spec.url.clone(), "from" => from, "to" => to
                        )
                        .increment(1);
                    }
                }
                let after = backend.effective_state();
                if before != after {
                    backend.info.state = after;
                    changed.push((backend.info.id, after, backend.info.spec.url.clone()));
                }
            }
        }
        for (id, state, url) in changed {
            control.publish_state(id, state, url);
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
