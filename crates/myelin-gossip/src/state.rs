//! What the cluster shares, held by one node: every peer's load and residency inputs per
//! engine, the routes known (own and peers'), route reassembly, and the packers that cut
//! announcements into packets. Every table is bounded.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::messages::{
    DIGEST_BUCKETS, DigestPayload, EngineState, Hashes, MAX_NODE_NAME_BYTES, RouteChunk,
    RoutesPayload, StatePayload,
};
use crate::wire::MAX_PAYLOAD_BYTES;

/// Peers whose state is kept.
pub const MAX_PEERS: usize = 256;
/// Engines kept per peer.
pub const MAX_ENGINES_PER_PEER: usize = 1_024;
/// Longest route accepted or announced, in blocks (longer chains are announced cut to it).
pub const MAX_ROUTE_BLOCKS: usize = 2_048;
/// Routes held (least recently used forgotten past it).
pub const MAX_ROUTES: usize = 16_384;
/// Blocks held over all routes (least recently used routes forgotten past it).
pub const MAX_ROUTE_TABLE_BLOCKS: usize = 1 << 21;
/// Routes being reassembled from pieces, over all senders.
pub const MAX_PENDING_ROUTES: usize = 512;
/// How long a route's missing pieces are waited for, milliseconds.
pub const PENDING_ROUTE_TTL_MS: u64 = 2_000;
/// Down peers whose admitted-token counters are kept apart (see [`ClusterState::node_down`]).
const MAX_RETIRED: usize = 64;

/// Bounds on a peer's figures for one engine, applied where they enter ([`ClusterState`]): a
/// peer holding the cluster key is still not trusted with the shared state. A figure past its
/// bound is clamped to it and counted ([`ClusterState::clamped_values`]).
///
/// Requests one peer may have in flight at one engine.
pub const MAX_PEER_REQUESTS: u32 = 1 << 20;
/// Tokens of queued work or of KV capacity one peer may report for one engine.
pub const MAX_PEER_TOKENS: u64 = 1 << 40;
/// How fast one peer's admitted-tokens counter for one engine may grow, tokens per second
/// (some hundred times what any engine processes: an 8B model prefills about 10^5 tokens per
/// second on an H100). The counter is the residency estimate's clock: a jump would make every
/// route look evicted, so growth past this rate is clamped.
pub const MAX_ADMITTED_TOKENS_PER_S: u64 = 1 << 24;
/// A peer's first report of an admitted-tokens counter, at most (a node that ran for weeks at
/// the rate above reports less).
pub const MAX_FIRST_ADMITTED_TOKENS: u64 = 1 << 44;

fn hash64(domain: &[u8], bytes: &[u8]) -> u64 {
    let mut hasher = Sha256::new();
    hasher.update(domain);
    hasher.update(bytes);
    let digest = hasher.finalize();
    let mut word = [0u8; 8];
    word.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(word)
}

/// An engine's key on the wire: a hash of its URL (without a trailing `/`), the same on every
/// node that configured the same URL.
pub fn engine_key(url: &str) -> u64 {
    hash64(b"myelin-engine\0", url.trim_end_matches('/').as_bytes())
}

/// A node's key on the wire: a hash of its node id.
pub fn node_key(node_id: &str) -> u64 {
    hash64(b"myelin-node\0", node_id.as_bytes())
}

/// One route: the chain hashes of a prompt's blocks, the engine it was routed to, and the
/// residency stamp of that use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub engine: u64,
    pub stamp: u64,
    pub hashes: Arc<[u64]>,
}

impl Route {
    pub fn key(&self) -> RouteKey {
        RouteKey {
            engine: self.engine,
            last: self.hashes.last().copied().unwrap_or(0),
        }
    }
}

/// A route's identity: its engine and the chain hash of its last block (which names the
/// whole prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteKey {
    pub engine: u64,
    pub last: u64,
}

impl RouteKey {
    fn mixed(self) -> u64 {
        // splitmix64 finaliser over both halves: spreads keys evenly over the buckets.
        let mut z = self.engine ^ self.last.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// The anti-entropy bucket of the key.
    pub fn bucket(self) -> usize {
        (self.mixed() % DIGEST_BUCKETS as u64) as usize
    }
}

/// What inserting a route did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// Not held before.
    New,
    /// Held with an older stamp: the stamp moved forward.
    Newer,
    /// Held already, with this stamp or a newer one.
    Known,
}

struct RouteEntry {
    hashes: Arc<[u64]>,
    stamp: u64,
    used: u64,
}

/// Routes this node knows, own and peers', for anti-entropy: bounded by route count and
/// blocks, least recently used forgotten first.
#[derive(Default)]
pub struct RouteTable {
    entries: HashMap<RouteKey, RouteEntry>,
    by_use: BTreeMap<u64, RouteKey>,
    blocks: usize,
    tick: u64,
    buckets: Vec<u64>,
}

impl RouteTable {
    pub fn new() -> RouteTable {
        RouteTable {
            buckets: vec![0; DIGEST_BUCKETS],
            ..RouteTable::default()
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Blocks held over all routes.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    pub fn contains(&self, key: RouteKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// Records a route (a use of it: it becomes the most recently used).
    pub fn insert(&mut self, route: &Route) -> Inserted {
        if route.hashes.is_empty() || route.hashes.len() > MAX_ROUTE_BLOCKS {
            return Inserted::Known;
        }
        if self.buckets.len() != DIGEST_BUCKETS {
            self.buckets = vec![0; DIGEST_BUCKETS];
        }
        self.tick += 1;
        let key = route.key();
        if let Some(entry) = self.entries.get_mut(&key) {
            self.by_use.remove(&entry.used);
            entry.used = self.tick;
            self.by_use.insert(self.tick, key);
            if route.stamp > entry.stamp {
                entry.stamp = route.stamp;
                return Inserted::Newer;
            }
            return Inserted::Known;
        }
        self.entries.insert(
            key,
            RouteEntry {
                hashes: route.hashes.clone(),
                stamp: route.stamp,
                used: self.tick,
            },
        );
        self.by_use.insert(self.tick, key);
        self.blocks += route.hashes.len();
        self.buckets[key.bucket()] ^= key.mixed();
        while self.entries.len() > MAX_ROUTES || self.blocks > MAX_ROUTE_TABLE_BLOCKS {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.remove(&oldest) {
                self.blocks -= entry.hashes.len();
                self.buckets[oldest.bucket()] ^= oldest.mixed();
            }
        }
        Inserted::New
    }

    /// The digest of the keys held.
    pub fn digest(&self, block_size: u32, reply: bool) -> DigestPayload {
        let mut buckets = self.buckets.clone();
        buckets.resize(DIGEST_BUCKETS, 0);
        DigestPayload {
            block_size,
            routes: u32::try_from(self.entries.len()).unwrap_or(u32::MAX),
            buckets,
            reply,
        }
    }

    /// Buckets whose digest differs from `other`'s.
    pub fn differing_buckets(&self, other: &DigestPayload) -> Vec<usize> {
        (0..DIGEST_BUCKETS)
            .filter(|&bucket| {
                self.buckets.get(bucket).copied().unwrap_or(0)
                    != other.buckets.get(bucket).copied().unwrap_or(0)
            })
            .collect()
    }

    /// Routes held in `buckets`, most recently used first, at most `max_blocks` blocks,
    /// starting after the first `skip` of them. Returns the routes and the `skip` of the next
    /// call (0 once the end was reached): successive answers to a peer walk through every
    /// route of the buckets that differ, not the same most recent ones again.
    pub fn routes_in(
        &self,
        buckets: &[usize],
        max_blocks: usize,
        skip: usize,
    ) -> (Vec<Route>, usize) {
        let mut wanted = [false; DIGEST_BUCKETS];
        for &bucket in buckets {
            if let Some(slot) = wanted.get_mut(bucket) {
                *slot = true;
            }
        }
        let matching = || {
            self.by_use
                .values()
                .rev()
                .filter(|key| wanted[key.bucket()])
                .filter_map(|key| Some((key, self.entries.get(key)?)))
        };
        let skip = if matching().nth(skip).is_some() {
            skip
        } else {
            0
        };
        let mut routes = Vec::new();
        let mut blocks = 0;
        let mut next = 0;
        for (index, (key, entry)) in matching().enumerate().skip(skip) {
            if !routes.is_empty() && blocks + entry.hashes.len() > max_blocks {
                next = index;
                break;
            }
            blocks += entry.hashes.len();
            routes.push(Route {
                engine: key.engine,
                stamp: entry.stamp,
                hashes: entry.hashes.clone(),
            });
        }
        (routes, next)
    }
}

struct Pending {
    hashes: Vec<u64>,
    filled: Vec<bool>,
    missing: usize,
    stamp: u64,
    started_ms: u64,
}

/// Routes split over several packets, until every piece arrived (bounded; pieces of a route
/// not complete within [`PENDING_ROUTE_TTL_MS`] are dropped).
#[derive(Default)]
pub struct Reassembly {
    pending: HashMap<(u64, u64, u32), Pending>,
}

/// A route piece that cannot be part of any route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadChunk;

impl Reassembly {
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Adds a piece from `sender`; returns the route when it is complete.
    pub fn add(
        &mut self,
        sender: u64,
        chunk: RouteChunk,
        now_ms: u64,
    ) -> Result<Option<Route>, BadChunk> {
        let total = chunk.total_blocks as usize;
        let offset = chunk.offset as usize;
        let len = chunk.hashes.0.len();
        if total == 0 || total > MAX_ROUTE_BLOCKS || len == 0 || offset + len > total {
            return Err(BadChunk);
        }
        if offset == 0 && len == total {
            return Ok(Some(Route {
                engine: chunk.engine,
                stamp: chunk.stamp,
                hashes: chunk.hashes.0.into(),
            }));
        }
        let id = (sender, chunk.engine, chunk.id);
        self.pending
            .retain(|_, pending| now_ms.saturating_sub(pending.started_ms) < PENDING_ROUTE_TTL_MS);
        if !self.pending.contains_key(&id) && self.pending.len() >= MAX_PENDING_ROUTES {
            let oldest = self
                .pending
                .iter()
                .min_by_key(|(_, pending)| pending.started_ms)
                .map(|(key, _)| *key);
            if let Some(oldest) = oldest {
                self.pending.remove(&oldest);
            }
        }
        let pending = self.pending.entry(id).or_insert_with(|| Pending {
            hashes: vec![0; total],
            filled: vec![false; total],
            missing: total,
            stamp: chunk.stamp,
            started_ms: now_ms,
        });
        if pending.hashes.len() != total || pending.stamp != chunk.stamp {
            self.pending.remove(&id);
            return Err(BadChunk);
        }
        for (index, hash) in chunk.hashes.0.iter().enumerate() {
            let at = offset + index;
            if !pending.filled[at] {
                pending.filled[at] = true;
                pending.missing -= 1;
            }
            pending.hashes[at] = *hash;
        }
        if pending.missing > 0 {
            return Ok(None);
        }
        let done = self.pending.remove(&id).ok_or(BadChunk)?;
        Ok(Some(Route {
            engine: chunk.engine,
            stamp: done.stamp,
            hashes: done.hashes.into(),
        }))
    }
}

/// Upper bound of a varint's size in bincode's standard configuration.
const VARINT_MAX: usize = 9;
/// Upper bound of a route piece's bytes besides its hashes.
const CHUNK_OVERHEAD: usize = 5 * VARINT_MAX + 3;
/// Upper bound of a `Routes` payload's bytes besides its pieces.
const ROUTES_OVERHEAD: usize = 2 * VARINT_MAX;

/// Cuts routes into `Routes` payloads that fit a packet, long routes into pieces (`next_id`
/// numbers each route's pieces). Routes longer than [`MAX_ROUTE_BLOCKS`] are cut to it.
pub fn pack_routes(block_size: u32, routes: &[Route], next_id: &mut u32) -> Vec<RoutesPayload> {
    let mut payloads = Vec::new();
    let mut current = RoutesPayload {
        block_size,
        chunks: Vec::new(),
    };
    let mut used = ROUTES_OVERHEAD;
    for route in routes {
        let hashes = &route.hashes[..route.hashes.len().min(MAX_ROUTE_BLOCKS)];
        if hashes.is_empty() {
            continue;
        }
        let id = *next_id;
        *next_id = next_id.wrapping_add(1);
        let mut offset = 0;
        while offset < hashes.len() {
            if used + CHUNK_OVERHEAD + 8 > MAX_PAYLOAD_BYTES {
                payloads.push(std::mem::take(&mut current.chunks));
                used = ROUTES_OVERHEAD;
            }
            let room = (MAX_PAYLOAD_BYTES - used - CHUNK_OVERHEAD) / 8;
            let take = room.min(hashes.len() - offset);
            current.chunks.push(RouteChunk {
                engine: route.engine,
                stamp: route.stamp,
                id,
                total_blocks: hashes.len() as u32,
                offset: offset as u32,
                hashes: Hashes(hashes[offset..offset + take].to_vec()),
            });
            used += CHUNK_OVERHEAD + 8 * take;
            offset += take;
        }
    }
    if !current.chunks.is_empty() {
        payloads.push(current.chunks);
    }
    payloads
        .into_iter()
        .map(|chunks| RoutesPayload { block_size, chunks })
        .collect()
}

/// Upper bound of an engine entry's bytes.
const ENGINE_STATE_BYTES: usize = 7 * VARINT_MAX + 2;
/// Engines whose largest evicted-below stamp is kept.
const MAX_EVICTED_ENGINES: usize = 4_096;

/// Cuts a node's engine figures into `State` payloads that fit a packet.
pub fn pack_state(node: &str, engines: &[EngineState]) -> Vec<StatePayload> {
    let node = crate::messages::node_name(node);
    let per_packet =
        ((MAX_PAYLOAD_BYTES - 3 * VARINT_MAX - MAX_NODE_NAME_BYTES) / ENGINE_STATE_BYTES).max(1);
    if engines.is_empty() {
        return vec![StatePayload {
            node,
            engines: Vec::new(),
        }];
    }
    engines
        .chunks(per_packet)
        .map(|engines| StatePayload {
            node: node.clone(),
            engines: engines.to_vec(),
        })
        .collect()
}

/// One peer's figures, as last heard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerState {
    pub name: String,
    pub boot: u64,
    pub engines: BTreeMap<u64, EngineState>,
    /// When its last `State` arrived (caller's milliseconds).
    pub heard_ms: u64,
}

/// The load and residency inputs the peers put on one engine, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerLoad {
    pub requests: u32,
    pub tokens: u64,
    pub admitted_tokens: u64,
}

/// Every live peer's figures, and the admitted-token counters of peers that died.
#[derive(Debug, Default)]
pub struct ClusterState {
    peers: BTreeMap<u64, PeerState>,
    /// Admitted tokens per engine of dead peers, by (node, boot): kept so the cluster-wide
    /// counter (the residency stamps' clock) never runs backwards; a peer declared down that
    /// comes back under the same boot takes its own entry back.
    retired: BTreeMap<(u64, u64), BTreeMap<u64, u64>>,
    /// Retired entries merged once [`MAX_RETIRED`] was reached.
    retired_base: BTreeMap<u64, u64>,
    /// Per engine, the largest evicted-below stamp any peer reported (it stays true when the
    /// peer dies).
    evicted: BTreeMap<u64, u64>,
    /// Node ids by node key, kept after a peer dies (for listings).
    names: BTreeMap<u64, String>,
    /// Peer figures clamped to their bounds so far.
    clamped: u64,
    /// Per engine, the tokens this node itself admitted there (its part of the clock).
    own_admitted: BTreeMap<u64, u64>,
}

/// `reported` within `[low, high]`; `clamped` counts a value that was not.
fn bounded(reported: u64, low: u64, high: u64, clamped: &mut u64) -> u64 {
    let value = reported.clamp(low, high.max(low));
    if value != reported {
        *clamped = clamped.saturating_add(1);
    }
    value
}

/// A peer's figures for one engine within their bounds. `previous`: what the same peer (same
/// boot) reported before, `elapsed_ms` ago: its admitted-tokens counter never goes back and
/// grows at most at [`MAX_ADMITTED_TOKENS_PER_S`] (plus one second's worth for delays).
fn sanitized(
    engine: EngineState,
    previous: Option<&EngineState>,
    elapsed_ms: u64,
    clamped: &mut u64,
) -> EngineState {
    let admitted = match previous {
        Some(previous) => {
            let growth = MAX_ADMITTED_TOKENS_PER_S
                .saturating_mul(elapsed_ms)
                .saturating_div(1_000)
                .saturating_add(MAX_ADMITTED_TOKENS_PER_S);
            bounded(
                engine.admitted_tokens,
                previous.admitted_tokens,
                previous.admitted_tokens.saturating_add(growth),
                clamped,
            )
        }
        None => bounded(
            engine.admitted_tokens,
            0,
            MAX_FIRST_ADMITTED_TOKENS,
            clamped,
        ),
    };
    let requests = engine.requests.min(MAX_PEER_REQUESTS);
    if requests != engine.requests {
        *clamped = clamped.saturating_add(1);
    }
    let capacity_tokens = engine
        .capacity_tokens
        .map(|tokens| bounded(tokens, 0, MAX_PEER_TOKENS, clamped));
    let utilization_ppm = engine.utilization_ppm.map(|ppm| {
        let bounded = ppm.min(1_000_000);
        if bounded != ppm {
            *clamped = clamped.saturating_add(1);
        }
        bounded
    });
    EngineState {
        requests,
        tokens: bounded(engine.tokens, 0, MAX_PEER_TOKENS, clamped),
        admitted_tokens: admitted,
        capacity_tokens,
        utilization_ppm,
        ..engine
    }
}

impl ClusterState {
    pub fn new() -> ClusterState {
        ClusterState::default()
    }

    /// A peer's `State` (some of its engines). Returns whether it was kept (not past the
    /// bounds).
    pub fn apply_state(&mut self, node: u64, boot: u64, state: StatePayload, now_ms: u64) -> bool {
        if !self.peers.contains_key(&node) && self.peers.len() >= MAX_PEERS {
            return false;
        }
        self.retired.remove(&(node, boot));
        let peer = self.peers.entry(node).or_default();
        if peer.boot != boot {
            if peer.boot > boot {
                return false;
            }
            // A restarted peer: its old figures are replaced.
            *peer = PeerState {
                boot,
                ..PeerState::default()
            };
        }
        if self.names.len() < MAX_PEERS * 4 || self.names.contains_key(&node) {
            self.names.insert(node, state.node.clone());
        }
        peer.name = state.node;
        let elapsed_ms = now_ms.saturating_sub(peer.heard_ms);
        peer.heard_ms = now_ms;
        for engine in state.engines {
            if peer.engines.len() >= MAX_ENGINES_PER_PEER
                && !peer.engines.contains_key(&engine.engine)
            {
                continue;
            }
            let engine = sanitized(
                engine,
                peer.engines.get(&engine.engine),
                elapsed_ms,
                &mut self.clamped,
            );
            peer.engines.insert(engine.engine, engine);
        }
        // Evicted-below stamps after the counters they are read against: a stamp ahead of the
        // cluster's clock would make every route to come look evicted, and it stays (the
        // largest is kept), so it is bounded by the clock as this node reads it now.
        let Some(peer) = self.peers.get(&node) else {
            return true;
        };
        let reported: Vec<(u64, u64)> = peer
            .engines
            .values()
            .filter(|engine| engine.evicted_below > 0)
            .map(|engine| (engine.engine, engine.evicted_below))
            .collect();
        for (engine, evicted_below) in reported {
            if !self.evicted.contains_key(&engine) && self.evicted.len() >= MAX_EVICTED_ENGINES {
                continue;
            }
            let clock = self.clock(engine);
            let evicted_below = bounded(evicted_below, 0, clock, &mut self.clamped);
            let stamp = self.evicted.entry(engine).or_default();
            *stamp = (*stamp).max(evicted_below);
        }
        true
    }

    /// This node's own admitted-tokens counter for `engine` (summed over its data cores), the
    /// part of the clock no peer reports.
    pub fn set_own_admitted(&mut self, engine: u64, tokens: u64) {
        if self.own_admitted.len() < MAX_EVICTED_ENGINES || self.own_admitted.contains_key(&engine)
        {
            self.own_admitted.insert(engine, tokens);
        }
    }

    /// The cluster's admitted-tokens clock for `engine` as this node reads it: its own counter,
    /// the live peers' and the dead peers' kept ones.
    pub fn clock(&self, engine: u64) -> u64 {
        let own = self.own_admitted.get(&engine).copied().unwrap_or(0);
        let live = self
            .peers
            .values()
            .filter_map(|peer| peer.engines.get(&engine))
            .map(|state| state.admitted_tokens);
        let dead = self
            .retired
            .values()
            .chain(std::iter::once(&self.retired_base))
            .filter_map(|counters| counters.get(&engine).copied());
        live.chain(dead).fold(own, u64::saturating_add)
    }

    /// A peer died: its in-flight load and scraped figures go with it; its admitted-token
    /// counters stop growing but stay counted (tokens it sent were admitted by the engines).
    pub fn node_down(&mut self, node: u64) {
        let Some(peer) = self.peers.remove(&node) else {
            return;
        };
        let counters: BTreeMap<u64, u64> = peer
            .engines
            .values()
            .map(|engine| (engine.engine, engine.admitted_tokens))
            .collect();
        self.retired.insert((node, peer.boot), counters);
        while self.retired.len() > MAX_RETIRED {
            let Some((_, counters)) = self.retired.pop_first() else {
                break;
            };
            for (engine, admitted) in counters {
                *self.retired_base.entry(engine).or_default() += admitted;
            }
        }
    }

    pub fn peers(&self) -> impl Iterator<Item = (u64, &PeerState)> {
        self.peers.iter().map(|(&node, peer)| (node, peer))
    }

    pub fn peer(&self, node: u64) -> Option<&PeerState> {
        self.peers.get(&node)
    }

    /// The peers' load on each engine, summed (dead peers' admitted tokens included).
    pub fn peer_load(&self) -> BTreeMap<u64, PeerLoad> {
        let mut loads: BTreeMap<u64, PeerLoad> = BTreeMap::new();
        for peer in self.peers.values() {
            for engine in peer.engines.values() {
                let load = loads.entry(engine.engine).or_default();
                load.requests = load.requests.saturating_add(engine.requests);
                load.tokens = load.tokens.saturating_add(engine.tokens);
                load.admitted_tokens = load.admitted_tokens.saturating_add(engine.admitted_tokens);
            }
        }
        for counters in self
            .retired
            .values()
            .chain(std::iter::once(&self.retired_base))
        {
            for (&engine, &admitted) in counters {
                let load = loads.entry(engine).or_default();
                load.admitted_tokens = load.admitted_tokens.saturating_add(admitted);
            }
        }
        loads
    }

    /// The node id of the node with this key, if it ever sent its state.
    pub fn name(&self, node: u64) -> Option<&str> {
        self.names.get(&node).map(String::as_str)
    }

    /// Peer figures clamped to their bounds so far (see [`MAX_PEER_REQUESTS`] and the bounds
    /// after it).
    pub fn clamped_values(&self) -> u64 {
        self.clamped
    }

    /// Per engine, the largest evicted-below stamp a peer reported. A stamp is on the
    /// cluster's admitted-tokens clock, which this crate does not hold: the caller bounds it by
    /// its own reading of the clock before applying it.
    pub fn peer_evicted(&self) -> &BTreeMap<u64, u64> {
        &self.evicted
    }

    /// The largest KV capacity any peer scraped from `engine`.
    pub fn peer_capacity(&self, engine: u64) -> Option<u64> {
        self.peers
            .values()
            .filter_map(|peer| peer.engines.get(&engine)?.capacity_tokens)
            .max()
    }
}
