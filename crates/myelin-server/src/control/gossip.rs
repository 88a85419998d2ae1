//! The peer cluster on the control core: one UDP socket on this executor and the timers that
//! drive `myelin_gossip::GossipNode` (membership probes, route announcements, state, joins,
//! anti-entropy). In: the data cores' learned routes and load (they send them here too when
//! gossip is on) and the peers' datagrams. Out: datagrams, and for every data core the peers'
//! load (`Message::PeerLoads`) and routes (`Message::PeerRoutes`). docs/gossip-protocol.md.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use glommio::net::UdpSocket;
use glommio::timer::Timer;
use http::{Method, Response, StatusCode};
use myelin_gossip::{
    EngineState, GossipConfig, GossipNode, MemberEvent, MemberState, MembershipTimer, Outgoing,
    Received, Route, engine_key,
};
use myelin_http::body::Body;
use myelin_routing::{BlockChain, WriteOp};
use serde_json::{Value, json};

use super::Control;
use crate::backends::{BackendId, Load, LoadUpdate};
use crate::cluster::GossipSettings;
use crate::messages::{Message, PeerRoute};

/// Cluster members by `state` (up, suspect, down), as this node sees them.
pub(crate) const MEMBERS: &str = "myelin_gossip_members";
/// Gossip datagrams sent, by `type` (swim, state, routes, digest).
pub(crate) const PACKETS_SENT_TOTAL: &str = "myelin_gossip_packets_sent_total";
/// Gossip datagrams accepted, by `type`.
pub(crate) const PACKETS_RECEIVED_TOTAL: &str = "myelin_gossip_packets_received_total";
/// Gossip datagrams dropped, by `reason` (bad_mac, replayed, short, malformed, ...).
pub(crate) const PACKETS_DROPPED_TOTAL: &str = "myelin_gossip_packets_dropped_total";
/// Peers' routes applied to the data cores' replicas.
pub(crate) const ROUTES_APPLIED_TOTAL: &str = "myelin_gossip_routes_applied_total";
/// Own routes queued for announcement.
pub(crate) const ROUTES_LEARNED_TOTAL: &str = "myelin_gossip_routes_learned_total";
/// Membership changes, by `to` (up, down).
pub(crate) const MEMBER_CHANGES_TOTAL: &str = "myelin_gossip_member_changes_total";
/// Peer figures clamped to their bounds where they entered (a count, a token figure, an
/// admitted-tokens counter growing too fast, a stamp ahead of the cluster's clock).
pub(crate) const PEER_VALUES_CLAMPED_TOTAL: &str = "myelin_gossip_peer_values_clamped_total";
/// Member updates left out because the member table was full (`--gossip-max-members`).
pub(crate) const MEMBERS_REFUSED_TOTAL: &str = "myelin_gossip_members_refused_total";

/// How often own routes are announced (batched: every route learned since).
const ANNOUNCE_INTERVAL: Duration = Duration::from_millis(50);
/// Route packets sent to each member per announcement, at most (the rest waits; a full queue
/// drops its oldest, which anti-entropy carries later).
const MAX_ROUTE_PACKETS_PER_FLUSH: usize = 8;
/// How often this node's load and counters go to every member.
const STATE_INTERVAL: Duration = Duration::from_millis(100);
/// How often a node that has no member announces itself to its seeds.
const JOIN_INTERVAL: Duration = Duration::from_millis(500);
/// How often the digest of held routes goes to one member.
const ANTI_ENTROPY_INTERVAL: Duration = Duration::from_secs(1);
/// The peers' load goes to the data cores when it changed, looked at this often, and every
/// [`PEER_LOAD_RESEND`] anyway (a dropped message heals).
const PEER_LOAD_INTERVAL: Duration = Duration::from_millis(50);
const PEER_LOAD_RESEND: Duration = Duration::from_secs(1);
/// Receive buffer: larger than any valid packet, so an oversize one is seen as such.
const RECEIVE_BUFFER_BYTES: usize = 2_048;

/// The control core's gossip state.
pub(crate) struct Gossip {
    node: RefCell<GossipNode>,
    socket: Rc<UdpSocket>,
    node_name: String,
    advertise: SocketAddr,
    started: Instant,
    shards: usize,
    block_size: std::num::NonZeroU32,
    /// This node's load per backend, per data core (absolute, from their `Loads`).
    loads: RefCell<HashMap<BackendId, Vec<Load>>>,
    /// Engine key of each backend (its URL's hash).
    keys: RefCell<HashMap<BackendId, u64>>,
    /// Per backend, the largest evicted-below stamp this node's reuse reports revealed.
    own_evicted: RefCell<HashMap<BackendId, u64>>,
    /// Per backend, the largest peer evicted-below stamp sent to the data cores.
    sent_evicted: RefCell<HashMap<BackendId, u64>>,
    /// The peer load last sent to the data cores.
    sent_peer_loads: RefCell<Vec<(BackendId, Load)>>,
    last_peer_load_sent: Cell<Option<Instant>>,
    /// The node's clamped-values counter as last exported.
    clamped_exported: Cell<u64>,
    /// The node's refused-members counter as last exported.
    refused_exported: Cell<u64>,
}

/// Adds to counter `name` what the node's own counter `total` grew by since it was last
/// exported (`exported`).
fn export_increase(name: &'static str, exported: &Cell<u64>, total: u64) {
    let increase = total.saturating_sub(exported.replace(total));
    if increase > 0 {
        metrics::counter!(name).increment(increase);
    }
}

/// Binds the gossip socket and starts the cluster's tasks on this executor.
pub(crate) fn start(
    control: &Rc<Control>,
    settings: &GossipSettings,
    block_size: usize,
    stop: Arc<AtomicBool>,
) -> Result<Rc<Gossip>, String> {
    let socket = UdpSocket::bind(settings.listen).map_err(|error| {
        format!(
            "cannot listen for gossip on {} (--gossip-listen): {error}",
            settings.listen
        )
    })?;
    let bound = socket
        .local_addr()
        .map_err(|error| format!("gossip socket: {error}"))?;
    let mut advertise = settings.advertise.unwrap_or(bound);
    if advertise.port() == 0 {
        advertise.set_port(bound.port());
    }
    let node_name = settings
        .node_id
        .clone()
        .unwrap_or_else(|| advertise.to_string());
    let boot = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |since| {
            u64::try_from(since.as_nanos()).unwrap_or(u64::MAX)
        });
    let block_size = std::num::NonZeroU32::new(u32::try_from(block_size).unwrap_or(16))
        .unwrap_or(std::num::NonZeroU32::MIN);
    let node = GossipNode::new(GossipConfig {
        node_name: node_name.clone(),
        addr: advertise,
        boot,
        key: settings.key.clone(),
        params: settings.membership_params(),
        block_size: block_size.get(),
        seeds: settings.peers.clone(),
    });
    let gossip = Rc::new(Gossip {
        node: RefCell::new(node),
        socket: Rc::new(socket),
        node_name,
        advertise,
        started: Instant::now(),
        shards: control.shards,
        block_size,
        loads: RefCell::new(HashMap::new()),
        keys: RefCell::new(HashMap::new()),
        own_evicted: RefCell::new(HashMap::new()),
        sent_evicted: RefCell::new(HashMap::new()),
        sent_peer_loads: RefCell::new(Vec::new()),
        last_peer_load_sent: Cell::new(None),
        clamped_exported: Cell::new(0),
        refused_exported: Cell::new(0),
    });
    eprintln!(
        "myelin: gossip on {bound} as {} (advertised {advertise}), seeds {:?}",
        gossip.node_name, settings.peers
    );
    // Exported at 0 from the start (an alert on them sees a series before the first count).
    metrics::counter!(PEER_VALUES_CLAMPED_TOTAL).increment(0);
    metrics::counter!(MEMBERS_REFUSED_TOTAL).increment(0);
    for reason in ["not_member", "rate_limited", "member_cap", "bad_mac"] {
        metrics::counter!(PACKETS_DROPPED_TOTAL, "reason" => reason).increment(0);
    }
    glommio::spawn_local(receive_loop(control.clone(), gossip.clone())).detach();
    glommio::spawn_local(tick_loop(control.clone(), gossip.clone(), stop)).detach();
    Ok(gossip)
}

/// Datagrams handled back to back before the receive loop lets the control core's other tasks
/// run (health checks, KV-event forwarding, admin): a flood that passes the magic check and
/// fails the HMAC costs more than one that does not, and must not starve them.
const DATAGRAMS_PER_YIELD: u32 = 64;

async fn receive_loop(control: Rc<Control>, gossip: Rc<Gossip>) {
    let mut buffer = vec![0u8; RECEIVE_BUFFER_BYTES];
    let mut handled = 0u32;
    loop {
        match gossip.socket.recv_from(&mut buffer).await {
            Ok((len, from)) => {
                gossip.on_datagram(&control, from, &buffer[..len]);
                handled += 1;
                if handled.is_multiple_of(DATAGRAMS_PER_YIELD) {
                    futures_lite::future::yield_now().await;
                }
            }
            Err(_) => {
                Timer::new(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Every periodic duty, on one task: joins, announcements, state, anti-entropy, the peers'
/// load for the data cores, the member gauges; leaves the cluster at shutdown.
async fn tick_loop(control: Rc<Control>, gossip: Rc<Gossip>, stop: Arc<AtomicBool>) {
    let start = Instant::now();
    let mut next_join = start;
    let mut next_state = start;
    let mut next_anti_entropy = start + ANTI_ENTROPY_INTERVAL;
    let mut next_peer_load = start;
    let tick = ANNOUNCE_INTERVAL.min(PEER_LOAD_INTERVAL);
    loop {
        if stop.load(Ordering::Acquire) {
            // run_control says goodbye (Gossip::leave) once this loop has stopped.
            return;
        }
        let now = Instant::now();
        {
            let mut node = gossip.node.borrow_mut();
            if now >= next_join {
                node.join_tick();
                next_join = now + JOIN_INTERVAL;
            }
            node.flush_routes(MAX_ROUTE_PACKETS_PER_FLUSH);
            if now >= next_anti_entropy {
                node.anti_entropy();
                next_anti_entropy = now + ANTI_ENTROPY_INTERVAL;
            }
        }
        if now >= next_state {
            let engines = gossip.own_state(&control);
            gossip.node.borrow_mut().send_state(&engines);
            next_state = now + STATE_INTERVAL;
            gossip.update_member_gauges();
        }
        if now >= next_peer_load {
            gossip.push_peer_loads(&control, false);
            next_peer_load = now + PEER_LOAD_INTERVAL;
        }
        gossip.pump();
        Timer::new(tick).await;
    }
}

impl Gossip {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn key_of(&self, control: &Control, backend: BackendId) -> Option<u64> {
        if let Some(&key) = self.keys.borrow().get(&backend) {
            return Some(key);
        }
        let key = engine_key(&control.url_of(backend)?);
        self.keys.borrow_mut().insert(backend, key);
        Some(key)
    }

    /// Local backend ids by engine key.
    fn backends_by_key(&self, control: &Control) -> HashMap<u64, BackendId> {
        let ids: Vec<BackendId> = control.state.borrow().backends.keys().copied().collect();
        ids.into_iter()
            .filter_map(|id| Some((self.key_of(control, id)?, id)))
            .collect()
    }

    /// One datagram from the socket.
    fn on_datagram(&self, control: &Control, from: SocketAddr, packet: &[u8]) {
        let now_ms = self.now_ms();
        let received = self.node.borrow_mut().receive(from, packet, now_ms);
        match received {
            Ok(received) => {
                let kind = packet
                    .get(5)
                    .and_then(|&kind| myelin_gossip::PacketType::from_u8(kind))
                    .map_or("other", myelin_gossip::PacketType::as_str);
                metrics::counter!(PACKETS_RECEIVED_TOTAL, "type" => kind).increment(1);
                match received {
                    Received::Routes(routes) => self.apply_routes(control, routes),
                    Received::State => self.push_peer_loads(control, false),
                    Received::Nothing => {}
                }
            }
            Err(error) => {
                metrics::counter!(PACKETS_DROPPED_TOTAL, "reason" => error.reason()).increment(1);
            }
        }
        let counters = self.node.borrow().counters();
        export_increase(
            PEER_VALUES_CLAMPED_TOTAL,
            &self.clamped_exported,
            counters.clamped_values,
        );
        export_increase(
            MEMBERS_REFUSED_TOTAL,
            &self.refused_exported,
            counters.members_refused,
        );
        self.pump();
    }

    fn count_clamped(&self, values: u64) {
        if values > 0 {
            metrics::counter!(PEER_VALUES_CLAMPED_TOTAL).increment(values);
        }
    }

    /// Per backend, the cluster's admitted-tokens clock as this node reads it now (its data
    /// cores' counters plus the peers'): residency stamps from peers cannot be ahead of it.
    fn clocks(&self, by_key: &HashMap<u64, BackendId>) -> HashMap<BackendId, u64> {
        let node = self.node.borrow();
        by_key
            .iter()
            .map(|(&key, &id)| (id, node.cluster().clock(key)))
            .collect()
    }

    /// `stamp` no further than `clock`, counted when it was.
    fn stamp_within(&self, stamp: u64, clock: u64) -> u64 {
        if stamp > clock {
            self.count_clamped(1);
            clock
        } else {
            stamp
        }
    }

    /// Sends the peers' routes to every data core's replica.
    fn apply_routes(&self, control: &Control, routes: Vec<Route>) {
        if routes.is_empty() {
            return;
        }
        let by_key = self.backends_by_key(control);
        let clocks = self.clocks(&by_key);
        let batch: Arc<[PeerRoute]> = routes
            .into_iter()
            .filter_map(|route| {
                let backend = *by_key.get(&route.engine)?;
                // A stamp ahead of the clock would keep the route fresh forever.
                let clock = clocks.get(&backend).copied().unwrap_or(0);
                Some(PeerRoute {
                    backend,
                    chain: Arc::new(BlockChain::from_hashes(
                        route.hashes.to_vec(),
                        self.block_size,
                    )),
                    stamp: self.stamp_within(route.stamp, clock),
                })
            })
            .collect();
        if batch.is_empty() {
            return;
        }
        metrics::counter!(ROUTES_APPLIED_TOTAL).increment(batch.len() as u64);
        for shard in 0..self.shards {
            control.send(shard, Message::PeerRoutes(batch.clone()));
        }
    }

    /// Learned routes a data core made (its `Writes`): announced to the cluster.
    pub(crate) fn on_local_writes(&self, control: &Control, writes: &[WriteOp]) {
        let mut node = self.node.borrow_mut();
        for write in writes {
            if let WriteOp::Evicted { backend, stamp } = write {
                let mut evicted = self.own_evicted.borrow_mut();
                let known = evicted.entry(*backend).or_default();
                *known = (*known).max(*stamp);
                continue;
            }
            let WriteOp::Learn {
                chain,
                backend,
                residency_stamp,
                ..
            } = write
            else {
                continue;
            };
            if chain.is_empty() || chain.block_size() != self.block_size {
                continue;
            }
            let Some(engine) = self.key_of(control, *backend) else {
                continue;
            };
            metrics::counter!(ROUTES_LEARNED_TOTAL).increment(1);
            node.learned(Route {
                engine,
                stamp: *residency_stamp,
                hashes: chain.hashes().into(),
            });
        }
    }

    /// A data core's load (its `Loads`): part of this node's state.
    pub(crate) fn on_local_loads(&self, control: &Control, updates: &[LoadUpdate]) {
        let mut loads = self.loads.borrow_mut();
        let mut node = self.node.borrow_mut();
        for update in updates {
            let per_core = loads
                .entry(update.backend)
                .or_insert_with(|| vec![Load::default(); self.shards]);
            if let Some(slot) = per_core.get_mut(update.from) {
                *slot = update.load;
            }
            // The node's own part of the clock: peers' evicted-below stamps are bounded by it.
            if let Some(engine) = self.key_of(control, update.backend) {
                let own = per_core
                    .iter()
                    .fold(0u64, |sum, load| sum.saturating_add(load.admitted_tokens));
                node.set_own_admitted(engine, own);
            }
        }
    }

    /// This node's figures per engine: its data cores' load summed, and the engine's scraped
    /// capacity and utilization.
    fn own_state(&self, control: &Control) -> Vec<EngineState> {
        let ids: Vec<BackendId> = control.state.borrow().backends.keys().copied().collect();
        self.loads.borrow_mut().retain(|id, _| ids.contains(id));
        self.own_evicted
            .borrow_mut()
            .retain(|id, _| ids.contains(id));
        let loads = self.loads.borrow();
        let evicted = self.own_evicted.borrow();
        let caches = control.engine_caches.borrow();
        ids.into_iter()
            .filter_map(|id| {
                let engine = self.key_of(control, id)?;
                let mut state = EngineState {
                    engine,
                    evicted_below: evicted.get(&id).copied().unwrap_or(0),
                    ..EngineState::default()
                };
                for load in loads.get(&id).into_iter().flatten() {
                    state.requests = state.requests.saturating_add(load.requests);
                    state.tokens = state.tokens.saturating_add(load.tokens);
                    state.admitted_tokens =
                        state.admitted_tokens.saturating_add(load.admitted_tokens);
                }
                if let Some(cache) = caches.get(&id) {
                    state.capacity_tokens = cache.capacity_tokens;
                    state.utilization_ppm = cache
                        .utilization
                        .map(|fraction| (fraction.clamp(0.0, 1.0) * 1e6) as u32);
                }
                Some(state)
            })
            .collect()
    }

    /// Sends the peers' summed load to every data core when it changed (or `force`, or a
    /// second passed).
    fn push_peer_loads(&self, control: &Control, force: bool) {
        let by_key = self.backends_by_key(control);
        let peer_loads = self.node.borrow().cluster().peer_load();
        let mut loads: Vec<(BackendId, Load)> = by_key
            .iter()
            .map(|(key, &id)| {
                let peer = peer_loads.get(key).copied().unwrap_or_default();
                (
                    id,
                    Load {
                        requests: peer.requests,
                        tokens: peer.tokens,
                        admitted_tokens: peer.admitted_tokens,
                        ..Load::default()
                    },
                )
            })
            .collect();
        loads.sort_by_key(|(id, _)| *id);
        let stale = self
            .last_peer_load_sent
            .get()
            .is_none_or(|sent| sent.elapsed() >= PEER_LOAD_RESEND);
        self.push_peer_evictions(control, &by_key, stale);
        if !force && !stale && *self.sent_peer_loads.borrow() == loads {
            return;
        }
        let batch: Arc<[(BackendId, Load)]> = loads.clone().into();
        for shard in 0..self.shards {
            control.send(shard, Message::PeerLoads(batch.clone()));
        }
        *self.sent_peer_loads.borrow_mut() = loads;
        self.last_peer_load_sent.set(Some(Instant::now()));
    }

    /// Sends the data cores the evictions peers' reuse reports revealed (`WriteOp::Evicted`,
    /// kept as the largest stamp per backend by every replica: re-sending is harmless) when
    /// they moved, or `resend`.
    fn push_peer_evictions(
        &self,
        control: &Control,
        by_key: &HashMap<u64, BackendId>,
        resend: bool,
    ) {
        let node = self.node.borrow();
        let mut sent = self.sent_evicted.borrow_mut();
        let writes: Vec<WriteOp> = node
            .cluster()
            .peer_evicted()
            .iter()
            .filter_map(|(key, &stamp)| {
                let id = *by_key.get(key)?;
                let known = sent.entry(id).or_default();
                if stamp <= *known && !resend {
                    return None;
                }
                *known = stamp;
                Some(WriteOp::Evicted { backend: id, stamp })
            })
            .collect();
        if writes.is_empty() {
            return;
        }
        let batch: Arc<[WriteOp]> = writes.into();
        for shard in 0..self.shards {
            control.send(shard, Message::Writes(batch.clone()));
        }
    }

    /// Leaves the cluster: the members hear of it at once instead of by failed probes (sent
    /// before returning, so the executor may stop right after).
    pub(crate) async fn leave(&self) {
        let outgoing = {
            let mut node = self.node.borrow_mut();
            node.leave();
            node.take_outgoing()
        };
        send_all(self.socket.clone(), outgoing).await;
    }

    /// Sends what the node has to send, starts the timers it asked for, reports membership
    /// changes.
    fn pump(self: &Gossip) {
        let (outgoing, timers, events) = {
            let mut node = self.node.borrow_mut();
            (node.take_outgoing(), node.take_timers(), node.take_events())
        };
        for event in events {
            let (to, id) = match &event {
                MemberEvent::Up(id) => ("up", id),
                MemberEvent::Down(id) => ("down", id),
                MemberEvent::Rejoined(id) => ("rejoined", id),
            };
            metrics::counter!(MEMBER_CHANGES_TOTAL, "to" => to).increment(1);
            eprintln!(
                "myelin: gossip ({}): member {} {to}",
                self.node_name, id.addr
            );
        }
        for (after, timer) in timers {
            self.schedule(after, timer);
        }
        if !outgoing.is_empty() {
            let socket = self.socket.clone();
            glommio::spawn_local(send_all(socket, outgoing)).detach();
        }
    }

    fn schedule(&self, after: Duration, timer: MembershipTimer) {
        let Some(gossip) = GOSSIP.with(|slot| slot.borrow().clone()) else {
            return;
        };
        glommio::spawn_local(async move {
            Timer::new(after).await;
            gossip.node.borrow_mut().handle_timer(timer);
            gossip.pump();
        })
        .detach();
    }

    fn update_member_gauges(&self) {
        let mut counts: BTreeMap<&'static str, usize> =
            [("up", 0), ("suspect", 0), ("down", 0)].into();
        for (_, state) in self.node.borrow().members() {
            *counts.entry(state.as_str()).or_default() += 1;
        }
        for (state, count) in counts {
            metrics::gauge!(MEMBERS, "state" => state).set(count as f64);
        }
    }

    /// `GET /admin/cluster`.
    fn report(&self, control: &Control) -> Value {
        let node = self.node.borrow();
        let urls: HashMap<u64, String> = control
            .state
            .borrow()
            .backends
            .values()
            .map(|backend| {
                (
                    engine_key(&backend.info.spec.url),
                    backend.info.spec.url.clone(),
                )
            })
            .collect();
        let members: Vec<Value> = node
            .members()
            .into_iter()
            .map(|(id, state)| {
                json!({
                    "node_id": node.cluster().name(id.node),
                    "address": id.addr.to_string(),
                    "boot": id.boot,
                    "state": state.as_str(),
                })
            })
            .collect();
        let peers: Vec<Value> = node
            .cluster()
            .peers()
            .map(|(_, peer)| {
                let engines: Vec<Value> = peer
                    .engines
                    .values()
                    .map(|engine| {
                        json!({
                            "url": urls.get(&engine.engine),
                            "engine_key": format!("{:016x}", engine.engine),
                            "requests": engine.requests,
                            "tokens": engine.tokens,
                            "admitted_tokens": engine.admitted_tokens,
                            "capacity_tokens": engine.capacity_tokens,
                            "utilization": engine.utilization_ppm.map(|ppm| f64::from(ppm) / 1e6),
                            "evicted_below": engine.evicted_below,
                        })
                    })
                    .collect();
                json!({
                    "node_id": peer.name,
                    "boot": peer.boot,
                    "heard_ms_ago": self.now_ms().saturating_sub(peer.heard_ms),
                    "engines": engines,
                })
            })
            .collect();
        let peer_load: Vec<Value> = node
            .cluster()
            .peer_load()
            .into_iter()
            .map(|(engine, load)| {
                json!({
                    "url": urls.get(&engine),
                    "requests": load.requests,
                    "tokens": load.tokens,
                    "admitted_tokens": load.admitted_tokens,
                })
            })
            .collect();
        let up = node
            .members()
            .iter()
            .filter(|(_, state)| *state != MemberState::Down)
            .count();
        json!({
            "enabled": true,
            "node_id": self.node_name,
            "gossip_address": self.advertise.to_string(),
            "members_up": up,
            "members": members,
            "peers": peers,
            "peer_load": peer_load,
            "routes_held": node.routes().len(),
            "route_blocks_held": node.routes().blocks(),
            "announce_backlog": node.announce_backlog(),
            "announce_dropped": node.counters().announce_dropped,
            "members_refused": node.counters().members_refused,
        })
    }
}

thread_local! {
    /// The control core's gossip, for timer tasks (one control core per process).
    static GOSSIP: RefCell<Option<Rc<Gossip>>> = const { RefCell::new(None) };
}

/// Makes `gossip` the one timer tasks drive.
pub(crate) fn install(gossip: &Rc<Gossip>) {
    GOSSIP.with(|slot| *slot.borrow_mut() = Some(gossip.clone()));
}

async fn send_all(socket: Rc<UdpSocket>, outgoing: Vec<Outgoing>) {
    for out in outgoing {
        match socket.send_to(&out.packet, out.to).await {
            Ok(_) => {
                metrics::counter!(PACKETS_SENT_TOTAL, "type" => out.kind.as_str()).increment(1);
            }
            Err(_) => {
                metrics::counter!(PACKETS_DROPPED_TOTAL, "reason" => "send_failed").increment(1);
            }
        }
    }
}

/// `GET /admin/cluster` on the admin listener.
pub(crate) fn cluster_admin(control: &Control, method: &Method) -> Response<Body> {
    if *method != Method::GET && *method != Method::HEAD {
        return crate::request_path::json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"error": {"message": "GET /admin/cluster only", "type": "invalid_request_error"}}),
        );
    }
    let body = match control.gossip.borrow().as_ref() {
        Some(gossip) => gossip.report(control),
        None => json!({"enabled": false}),
    };
    crate::request_path::json_response(StatusCode::OK, &body)
}

#[cfg(test)]
mod tests {
    use crate::backends::{BackendId, Load};
    use crate::routing_glue::RoutingShard;
    use myelin_routing::Policy;

    /// A data core's routing state (one data core) over backends 0 and 1.
    fn shard(routing: Policy) -> RoutingShard {
        crate::routing_glue::tests::shard_over(routing, 1, 2)
    }

    #[test]
    fn peer_load_is_scored_like_the_cores_own() {
        let mut shard = shard(Policy::LeastLoad);
        let nothing = crate::routing_glue::LookupAnswer::default();
        assert_eq!(
            shard.decide(&nothing, 10, &[], &[]).unwrap().backend,
            BackendId(0)
        );
        // The slot after the data cores' (here: 1) is the other nodes' load.
        let peers = Load {
            requests: 3,
            tokens: 3_000,
            ..Load::default()
        };
        shard.set_load(BackendId(0), 1, peers);
        assert_eq!(
            shard.decide(&nothing, 10, &[], &[]).unwrap().backend,
            BackendId(1)
        );
        shard.set_load(BackendId(0), 1, Load::default());
        shard.set_load(BackendId(1), 1, peers);
        assert_eq!(
            shard.decide(&nothing, 10, &[], &[]).unwrap().backend,
            BackendId(0)
        );
    }

    #[test]
    fn a_peer_route_is_history_like_an_own_one() {
        let mut shard = shard(Policy::Prefix);
        let prompt: Vec<u32> = (0..320).collect();
        let query = shard.query(&prompt);
        let before = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        let other = BackendId(1 - before.backend.0);
        shard.learn_peer(query.chain.clone(), other, 0);
        let after = shard
            .decide(&shard.lookup(&query), prompt.len(), &[], &[])
            .unwrap();
        assert_eq!(after.backend, other);
        assert_eq!(after.matched_blocks, 20);
    }
}
