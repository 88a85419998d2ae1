//! One node of the cluster, sans-IO: the caller hands it received datagrams, fired timers and
//! its own figures, and takes back datagrams to send, timers to start, membership changes and
//! the peers' routes to apply.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use crate::membership::{
    MemberEvent, MemberState, Membership, MembershipError, MembershipParams, MembershipTimer,
    NodeIdentity,
};
use crate::messages::{EngineState, Payload, Sender, decode_packet, encode_packet};
use crate::state::{
    ClusterState, Inserted, Reassembly, Route, RouteKey, RouteTable, pack_routes, pack_state,
};
use crate::wire::{ClusterKey, DecodeError, PacketType, ReplayGuard};

/// Own routes waiting to be announced, at most (the oldest is dropped past it: anti-entropy
/// still carries it later).
pub const MAX_ANNOUNCE_QUEUE: usize = 4_096;
/// Blocks of routes sent in answer to one digest, at most (one longer route goes alone).
pub const ANTI_ENTROPY_MAX_BLOCKS: usize = 2_400;
/// Members whose anti-entropy position is kept.
const MAX_ANSWERED: usize = 1_024;
/// Route blocks one peer may send per second (a token bucket holding one second's worth):
/// some 2M tokens of new prefixes per second, past any node's traffic; anti-entropy answers
/// ([`ANTI_ENTROPY_MAX_BLOCKS`]) fit many times over. Packets past it are dropped
/// ([`DecodeError::RateLimited`]) and anti-entropy carries their routes later.
pub const MAX_ROUTE_BLOCKS_PER_PEER_PER_S: u64 = 1 << 17;

/// How a node is set up.
#[derive(Debug, Clone)]
pub struct GossipConfig {
    /// `--node-id`: unique in the cluster.
    pub node_name: String,
    /// The address peers reach this node's gossip socket at.
    pub addr: SocketAddr,
    /// This process's incarnation: larger on every restart (the start time).
    pub boot: u64,
    pub key: ClusterKey,
    pub params: MembershipParams,
    /// Tokens per block: routes of another block size are refused.
    pub block_size: u32,
    /// Nodes to join through (`--peer`).
    pub seeds: Vec<SocketAddr>,
}

/// A datagram to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub to: SocketAddr,
    pub kind: PacketType,
    pub packet: Vec<u8>,
}

/// What an accepted packet changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received {
    /// Membership traffic, or nothing new.
    Nothing,
    /// A peer's load and counters changed.
    State,
    /// Routes this node did not hold (or held with an older stamp): apply them.
    Routes(Vec<Route>),
}

/// Counts of what a node did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCounters {
    /// Own routes dropped from a full announcement queue.
    pub announce_dropped: u64,
    /// Route pieces that could not be part of a route.
    pub bad_chunks: u64,
    /// Peer figures clamped to their bounds ([`ClusterState::clamped_values`]).
    pub clamped_values: u64,
    /// Member updates refused because the member table was full
    /// ([`MembershipParams::max_members`]).
    pub members_refused: u64,
}

/// One node's side of the cluster.
pub struct GossipNode {
    config: GossipConfig,
    sender: Sender,
    seq: u64,
    guard: ReplayGuard,
    membership: Membership,
    cluster: ClusterState,
    routes: RouteTable,
    reassembly: Reassembly,
    next_route_id: u32,
    queue: VecDeque<RouteKey>,
    queued: HashMap<RouteKey, Route>,
    out: Vec<Outgoing>,
    timers: Vec<(Duration, MembershipTimer)>,
    events: Vec<MemberEvent>,
    next_partner: usize,
    /// Per member, where the next anti-entropy answer to it starts (see
    /// [`RouteTable::routes_in`]).
    answered: HashMap<u64, usize>,
    /// Per peer, the route blocks it may still send and when the bucket was last filled.
    route_budget: HashMap<u64, (u64, u64)>,
    counters: NodeCounters,
}

impl GossipNode {
    pub fn new(config: GossipConfig) -> GossipNode {
        let node = crate::state::node_key(&config.node_name);
        let identity = NodeIdentity {
            addr: config.addr,
            node,
            boot: config.boot,
            bump: 0,
        };
        let membership = Membership::new(identity, config.params, node ^ config.boot);
        GossipNode {
            sender: Sender {
                node,
                boot: config.boot,
            },
            config,
            seq: 0,
            guard: ReplayGuard::new(),
            membership,
            cluster: ClusterState::new(),
            routes: RouteTable::new(),
            reassembly: Reassembly::default(),
            next_route_id: 0,
            queue: VecDeque::new(),
            queued: HashMap::new(),
            out: Vec::new(),
            timers: Vec::new(),
            events: Vec::new(),
            next_partner: 0,
            answered: HashMap::new(),
            route_budget: HashMap::new(),
            counters: NodeCounters::default(),
        }
    }

    pub fn config(&self) -> &GossipConfig {
        &self.config
    }

    /// This node's key on the wire.
    pub fn node(&self) -> u64 {
        self.sender.node
    }

    pub fn counters(&self) -> NodeCounters {
        NodeCounters {
            clamped_values: self.cluster.clamped_values(),
            members_refused: self.membership.refused_members(),
            ..self.counters
        }
    }

    /// Takes `blocks` from `sender`'s route budget, refilled at
    /// [`MAX_ROUTE_BLOCKS_PER_PEER_PER_S`]; false when it does not hold them.
    fn take_route_budget(&mut self, sender: u64, blocks: u64, now_ms: u64) -> bool {
        if self.route_budget.len() >= crate::state::MAX_PEERS * 4
            && !self.route_budget.contains_key(&sender)
        {
            self.route_budget.clear();
        }
        let (budget, filled_ms) = self
            .route_budget
            .entry(sender)
            .or_insert((MAX_ROUTE_BLOCKS_PER_PEER_PER_S, now_ms));
        let refill = MAX_ROUTE_BLOCKS_PER_PEER_PER_S
            .saturating_mul(now_ms.saturating_sub(*filled_ms))
            / 1_000;
        if refill > 0 {
            *budget = budget
                .saturating_add(refill)
                .min(MAX_ROUTE_BLOCKS_PER_PEER_PER_S);
            *filled_ms = now_ms;
        }
        if *budget < blocks {
            return false;
        }
        *budget -= blocks;
        true
    }

    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    /// This node's own admitted-tokens counter for `engine` (see
    /// [`ClusterState::set_own_admitted`]).
    pub fn set_own_admitted(&mut self, engine: u64, tokens: u64) {
        self.cluster.set_own_admitted(engine, tokens);
    }

    pub fn routes(&self) -> &RouteTable {
        &self.routes
    }

    /// Every member known, with its state.
    pub fn members(&self) -> Vec<(NodeIdentity, MemberState)> {
        self.membership.members()
    }

    /// Members up or suspect.
    pub fn active_members(&self) -> usize {
        self.membership.active_members()
    }

    fn active_addrs(&self) -> Vec<SocketAddr> {
        let mut addrs: Vec<SocketAddr> = self
            .membership
            .members()
            .into_iter()
            .filter(|(_, state)| *state != MemberState::Down)
            .map(|(id, _)| id.addr)
            .collect();
        addrs.sort();
        addrs.dedup();
        addrs
    }

    fn seal(&mut self, to: SocketAddr, payload: &Payload) {
        self.seq += 1;
        if let Ok(packet) = encode_packet(&self.config.key, self.sender, self.seq, payload) {
            self.out.push(Outgoing {
                to,
                kind: payload.kind(),
                packet,
            });
        }
    }

    /// Moves what the membership asked for into the outputs.
    fn drain_membership(&mut self) {
        let output = self.membership.take_output();
        for (to, bytes) in output.send {
            self.seal(to, &Payload::Swim(bytes));
        }
        self.timers.extend(output.timers);
        for event in output.events {
            if let MemberEvent::Down(id) = &event {
                let still_up = self
                    .membership
                    .members()
                    .iter()
                    .any(|(other, state)| other.node == id.node && *state != MemberState::Down);
                if !still_up {
                    self.cluster.node_down(id.node);
                }
            }
            self.events.push(event);
        }
    }

    /// Joins through the seeds while no member is known (call periodically: one lost
    /// datagram must not leave a node alone).
    pub fn join_tick(&mut self) {
        if self.membership.active_members() > 0 {
            return;
        }
        for seed in self.config.seeds.clone() {
            if seed != self.config.addr {
                self.membership.announce(seed);
            }
        }
        self.drain_membership();
    }

    /// A membership timer fired.
    pub fn handle_timer(&mut self, timer: MembershipTimer) {
        self.membership.handle_timer(timer);
        self.drain_membership();
    }

    /// Leaves the cluster (before stopping).
    pub fn leave(&mut self) {
        self.membership.leave();
        self.drain_membership();
    }

    /// The address of the live member with this node key and boot.
    fn live_member(&self, node: u64, boot: u64) -> Option<SocketAddr> {
        self.membership
            .members()
            .into_iter()
            .find(|(id, state)| id.node == node && id.boot == boot && *state != MemberState::Down)
            .map(|(id, _)| id.addr)
    }

    /// A datagram from the source address `_from` (not trusted: answers go to members' own
    /// addresses). Errors are the reason it was dropped (count them).
    pub fn receive(
        &mut self,
        _from: SocketAddr,
        packet: &[u8],
        now_ms: u64,
    ) -> Result<Received, DecodeError> {
        let (header, payload) = decode_packet(&self.config.key, packet)?;
        if header.sender == self.sender.node {
            if header.boot == self.sender.boot {
                // Our own packet reflected back: nothing to learn.
                return Ok(Received::Nothing);
            }
            // Another process with this node's id: its packets would corrupt this node's
            // sequence windows at every peer; ignored here and counted (ids must be unique).
            return Err(DecodeError::DuplicateNode);
        }
        self.guard.check(&header)?;
        match payload {
            Payload::Swim(bytes) => {
                let result = self.membership.handle_data(&bytes);
                self.drain_membership();
                result
                    .map(|()| Received::Nothing)
                    .map_err(|error| match error {
                        MembershipError::MemberCap => DecodeError::MemberCap,
                        MembershipError::Refused(_) => DecodeError::Membership,
                    })
            }
            Payload::State(state) => {
                if self.live_member(header.sender, header.boot).is_none() {
                    return Err(DecodeError::NotMember);
                }
                if self
                    .cluster
                    .apply_state(header.sender, header.boot, state, now_ms)
                {
                    Ok(Received::State)
                } else {
                    Ok(Received::Nothing)
                }
            }
            Payload::Routes(routes) => {
                if routes.block_size != self.config.block_size {
                    return Err(DecodeError::BlockSize);
                }
                // Routes only from members, each within its budget.
                if self.live_member(header.sender, header.boot).is_none() {
                    return Err(DecodeError::NotMember);
                }
                let blocks: u64 = routes
                    .chunks
                    .iter()
                    .map(|chunk| chunk.hashes.0.len() as u64)
                    .sum();
                if !self.take_route_budget(header.sender, blocks, now_ms) {
                    return Err(DecodeError::RateLimited);
                }
                let mut learned = Vec::new();
                for chunk in routes.chunks {
                    match self.reassembly.add(header.sender, chunk, now_ms) {
                        Ok(Some(route)) => match self.routes.insert(&route) {
                            Inserted::New | Inserted::Newer => learned.push(route),
                            Inserted::Known => {}
                        },
                        Ok(None) => {}
                        Err(_) => self.counters.bad_chunks += 1,
                    }
                }
                Ok(Received::Routes(learned))
            }
            Payload::Digest(digest) => {
                if digest.block_size != self.config.block_size {
                    return Err(DecodeError::BlockSize);
                }
                // Answered only to a live member, at its own address (never to the datagram's
                // source): a digest replayed to this node from elsewhere cannot direct the
                // answer at a third party.
                let Some(to) = self.live_member(header.sender, header.boot) else {
                    return Err(DecodeError::NotMember);
                };
                let differing = self.routes.differing_buckets(&digest);
                if !differing.is_empty() {
                    let skip = self.answered.get(&header.sender).copied().unwrap_or(0);
                    let (routes, next) =
                        self.routes
                            .routes_in(&differing, ANTI_ENTROPY_MAX_BLOCKS, skip);
                    if self.answered.len() >= MAX_ANSWERED
                        && !self.answered.contains_key(&header.sender)
                    {
                        self.answered.clear();
                    }
                    self.answered.insert(header.sender, next);
                    let payloads =
                        pack_routes(self.config.block_size, &routes, &mut self.next_route_id);
                    for payload in payloads {
                        self.seal(to, &Payload::Routes(payload));
                    }
                    if !digest.reply {
                        let mine = self.routes.digest(self.config.block_size, true);
                        self.seal(to, &Payload::Digest(mine));
                    }
                }
                Ok(Received::Nothing)
            }
        }
    }

    /// A route this node learned (its own traffic): held, and queued for announcement.
    pub fn learned(&mut self, route: Route) {
        if route.hashes.is_empty() {
            return;
        }
        self.routes.insert(&route);
        let key = route.key();
        if self.queued.insert(key, route).is_none() {
            self.queue.push_back(key);
        }
        while self.queue.len() > MAX_ANNOUNCE_QUEUE {
            if let Some(oldest) = self.queue.pop_front() {
                self.queued.remove(&oldest);
                self.counters.announce_dropped += 1;
            }
        }
    }

    /// Own routes waiting to be announced.
    pub fn announce_backlog(&self) -> usize {
        self.queue.len()
    }

    /// Announces queued routes to every live member, at most `max_packets` packets each.
    pub fn flush_routes(&mut self, max_packets: usize) {
        if self.queue.is_empty() {
            return;
        }
        let addrs = self.active_addrs();
        if addrs.is_empty() {
            // Nobody to tell yet: anti-entropy carries them once a member joins.
            self.queue.clear();
            self.queued.clear();
            return;
        }
        let mut routes = Vec::new();
        let mut blocks = 0;
        let budget = max_packets.max(1) * 150;
        while let Some(key) = self.queue.front().copied() {
            let Some(route) = self.queued.get(&key) else {
                self.queue.pop_front();
                continue;
            };
            if !routes.is_empty() && blocks + route.hashes.len() > budget {
                break;
            }
            blocks += route.hashes.len();
            self.queue.pop_front();
            routes.extend(self.queued.remove(&key));
        }
        let payloads = pack_routes(self.config.block_size, &routes, &mut self.next_route_id);
        for to in addrs {
            for payload in &payloads {
                self.seal(to, &Payload::Routes(payload.clone()));
            }
        }
    }

    /// Sends this node's figures per engine to every live member.
    pub fn send_state(&mut self, engines: &[EngineState]) {
        let addrs = self.active_addrs();
        if addrs.is_empty() {
            return;
        }
        let payloads = pack_state(&self.config.node_name, engines);
        for to in addrs {
            for payload in &payloads {
                self.seal(to, &Payload::State(payload.clone()));
            }
        }
    }

    /// Sends the digest of the routes held to one live member (each in turn).
    pub fn anti_entropy(&mut self) {
        let addrs = self.active_addrs();
        if addrs.is_empty() {
            return;
        }
        self.next_partner = self.next_partner.wrapping_add(1);
        let to = addrs[self.next_partner % addrs.len()];
        let digest = self.routes.digest(self.config.block_size, false);
        self.seal(to, &Payload::Digest(digest));
    }

    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.out)
    }

    pub fn take_timers(&mut self) -> Vec<(Duration, MembershipTimer)> {
        std::mem::take(&mut self.timers)
    }

    pub fn take_events(&mut self) -> Vec<MemberEvent> {
        std::mem::take(&mut self.events)
    }
}
