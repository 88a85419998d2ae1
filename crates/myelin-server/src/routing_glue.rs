//! The server's side of the sans-IO routing core (`myelin-routing`): one data core's replica of
//! the routing state and its router, and the load view it scores with.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

pub use myelin_routing::BlockCounts;
use myelin_routing::{
    BackendView, BlockChain, Policy, PrefixMatch, Router, RouterConfig, Shard, ShardConfig, WriteOp,
};

use crate::backends::{BackendId, BackendInfo, BackendState, Load};
use crate::config::{ResidencyMode, RoutingPolicy, ServeConfig};

/// A prompt's block chain, hashed once per request (shared with the learn broadcast).
#[derive(Debug, Clone)]
pub struct LookupQuery {
    pub chain: Arc<BlockChain>,
}

/// Every backend's match for a prompt.
pub type LookupAnswer = PrefixMatch;

/// Deepest match of any backend in an answer, in blocks (history or verified mirror).
pub fn deepest_match(answer: &LookupAnswer) -> u32 {
    answer
        .backends
        .iter()
        .map(|entry| {
            entry
                .matched_blocks
                .max(entry.verified_resident_blocks.unwrap_or(0))
        })
        .max()
        .unwrap_or(0)
}

/// The decision for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteChoice {
    pub backend: BackendId,
    pub matched_blocks: u32,
    /// Prompt tokens the chosen backend is expected to serve from its cache.
    pub expected_cached_tokens: u64,
    pub residency_downgrade: bool,
}

struct ShardBackend {
    state: BackendState,
    load_by_core: Vec<Load>,
}

/// One data core's routing state: its replica of the prefix tree and mirror, its router
/// (scoring and the round-robin cursor), and its view of every backend's state and load.
pub struct RoutingShard {
    shards: usize,
    shard: Shard,
    router: Router,
    residency: ResidencyMode,
    backends: BTreeMap<BackendId, ShardBackend>,
    views: Vec<BackendView>,
    clock_origin: Instant,
}

fn policy_of(policy: RoutingPolicy) -> Policy {
    match policy {
        RoutingPolicy::RoundRobin => Policy::RoundRobin,
        RoutingPolicy::LeastLoad => Policy::LeastLoad,
        RoutingPolicy::Prefix => Policy::Prefix,
    }
}

fn residency_of(mode: ResidencyMode) -> myelin_routing::ResidencyMode {
    match mode {
        ResidencyMode::Off => myelin_routing::ResidencyMode::Off,
        ResidencyMode::Estimate => myelin_routing::ResidencyMode::Estimate,
        ResidencyMode::Verified => myelin_routing::ResidencyMode::Verified,
        ResidencyMode::Auto => myelin_routing::ResidencyMode::Auto,
    }
}

fn state_of(state: BackendState) -> myelin_routing::BackendState {
    match state {
        BackendState::Up => myelin_routing::BackendState::Up,
        BackendState::Draining => myelin_routing::BackendState::Draining,
        BackendState::Down => myelin_routing::BackendState::Down,
    }
}

impl RoutingShard {
    /// `clock_origin` is shared by every core: learned routes carry times on that clock.
    pub fn new(
        config: &ServeConfig,
        shards: usize,
        clock_origin: Instant,
    ) -> Result<RoutingShard, myelin_routing::RoutingError> {
        let shard = Shard::new(ShardConfig {
            block_size: u32::try_from(config.block_size).unwrap_or(u32::MAX),
            ..ShardConfig::default()
        })?;
        Ok(RoutingShard {
            shards,
            shard,
            router: Router::new(
                policy_of(config.routing),
                residency_of(config.residency),
                RouterConfig {
                    load_bound_tokens: config.load_bound_tokens,
                },
            ),
            residency: config.residency,
            backends: BTreeMap::new(),
            views: Vec::new(),
            clock_origin,
        })
    }

    /// Milliseconds since the server started (same origin on every core): the routing clock.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Hashes the prompt once.
    pub fn query(&self, tokens: &[u32]) -> LookupQuery {
        LookupQuery {
            chain: Arc::new(self.shard.chain(tokens)),
        }
    }

    /// Every backend's match for a prompt, from this core's replica.
    pub fn lookup(&self, query: &LookupQuery) -> LookupAnswer {
        // Every core hashes with the same block size, so the chain always fits.
        self.shard
            .lookup_chain(&query.chain, self.now_ms())
            .unwrap_or_default()
    }

    /// Records here that a prompt was routed to `backend`; returns the write for the other
    /// cores' replicas.
    pub fn learn(&mut self, query: &LookupQuery, backend: BackendId) -> WriteOp {
        let op = WriteOp::Learn {
            chain: query.chain.clone(),
            backend: myelin_routing::BackendId(backend),
            at_ms: self.now_ms(),
            residency_stamp: 0,
        };
        self.apply(&op);
        op
    }

    /// Applies a write to this replica. Writes about a backend this core no longer has (still
    /// in flight when it was removed) are dropped with it.
    pub fn apply(&mut self, op: &WriteOp) {
        let backend = match op {
            WriteOp::Learn { backend, .. }
            | WriteOp::Mirror { backend, .. }
            | WriteOp::MirrorLive { backend, .. }
            | WriteOp::Evicted { backend, .. } => backend.0,
        };
        if self.backends.contains_key(&backend) {
            self.shard.apply(op);
        }
    }

    pub fn add_backend(&mut self, info: &BackendInfo) {
        let shards = self.shards;
        let entry = self
            .backends
            .entry(info.id)
            .or_insert_with(|| ShardBackend {
                state: info.state,
                load_by_core: vec![Load::default(); shards],
            });
        entry.state = info.state;
    }

    pub fn remove_backend(&mut self, id: BackendId) {
        self.backends.remove(&id);
        self.shard.remove_backend(myelin_routing::BackendId(id));
    }

    pub fn set_state(&mut self, id: BackendId, state: BackendState) {
        if let Some(entry) = self.backends.get_mut(&id) {
            entry.state = state;
        }
    }

    /// Records the load `core` puts on a backend (absolute).
    pub fn set_load(&mut self, id: BackendId, core: usize, load: Load) {
        if let Some(slot) = self
            .backends
            .get_mut(&id)
            .and_then(|entry| entry.load_by_core.get_mut(core))
        {
            *slot = load;
        }
    }

    /// Blocks per backend this replica holds, in the tree and the verified mirror (admin API).
    pub fn block_counts(&self) -> BlockCounts {
        self.shard.blocks_by_backend()
    }

    /// Residency in effect for a backend (admin API).
    pub fn residency_of(&self, id: BackendId) -> &'static str {
        let live = self.shard.mirror_live(myelin_routing::BackendId(id));
        match self.residency {
            ResidencyMode::Auto if live => "verified",
            ResidencyMode::Auto => "estimate",
            mode => mode.as_str(),
        }
    }

    /// Scores the up backends not in `excluded` (already tried for this request).
    pub fn decide(
        &mut self,
        answer: &LookupAnswer,
        prompt_tokens: usize,
        excluded: &[BackendId],
    ) -> Option<RouteChoice> {
        let mut views = std::mem::take(&mut self.views);
        views.clear();
        views.extend(self.backends.iter().map(|(&id, backend)| {
            let state = if excluded.contains(&id) {
                BackendState::Down
            } else {
                backend.state
            };
            let load_tokens = backend.load_by_core.iter().map(|load| load.tokens).sum();
            BackendView::new(myelin_routing::BackendId(id), state_of(state), load_tokens)
        }));
        let decision = self.router.decide(prompt_tokens as u64, answer, &views);
        self.views = views;
        let decision = decision.ok()?;
        Some(RouteChoice {
            backend: decision.backend.0,
            matched_blocks: decision.matched_blocks,
            // Whole tokens: the expectation is a sum of block sizes weighted by probabilities.
            expected_cached_tokens: decision.expected_cached_tokens.max(0.0).round() as u64,
            residency_downgrade: decision.residency_downgrade,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend_spec::BackendSpec;
    use crate::config::{FileConfig, ServeArgs};

    fn shard(routing: RoutingPolicy, shards: usize) -> RoutingShard {
        let args = ServeArgs {
            backends: vec!["http://a:1".into()],
            routing: Some(routing),
            shards: Some(shards),
            ..ServeArgs::default()
        };
        let config = ServeConfig::merge(args, FileConfig::default(), &[0]).unwrap();
        let mut shard = RoutingShard::new(&config, shards, Instant::now()).unwrap();
        for id in 0..3 {
            shard.add_backend(&BackendInfo {
                id,
                spec: BackendSpec::parse(&format!("http://b{id}:1")).unwrap(),
                state: BackendState::Up,
            });
        }
        shard
    }

    #[test]
    fn learned_prefix_wins_and_excluded_backends_are_skipped() {
        let mut shard = shard(RoutingPolicy::Prefix, 1);
        let prompt: Vec<u32> = (0..160).collect();
        let query = shard.query(&prompt);
        let first = shard
            .decide(&shard.lookup(&query), prompt.len(), &[])
            .unwrap();
        let write = shard.learn(&query, first.backend);
        assert!(matches!(write, WriteOp::Learn { backend, .. } if backend.0 == first.backend));
        let again = shard
            .decide(&shard.lookup(&query), prompt.len(), &[])
            .unwrap();
        assert_eq!(again.backend, first.backend);
        assert_eq!(again.matched_blocks, 10);
        let retry = shard
            .decide(&shard.lookup(&query), prompt.len(), &[first.backend])
            .unwrap();
        assert_ne!(retry.backend, first.backend);
        let none = shard.decide(&shard.lookup(&query), prompt.len(), &[0, 1, 2]);
        assert_eq!(none, None);
    }

    #[test]
    fn down_and_draining_backends_are_not_chosen() {
        let mut shard = shard(RoutingPolicy::RoundRobin, 1);
        shard.set_state(0, BackendState::Down);
        shard.set_state(1, BackendState::Draining);
        for _ in 0..5 {
            let choice = shard.decide(&LookupAnswer::default(), 10, &[]).unwrap();
            assert_eq!(choice.backend, 2);
        }
    }

    #[test]
    fn least_load_reads_every_cores_load() {
        let mut shard = shard(RoutingPolicy::LeastLoad, 2);
        shard.set_load(
            0,
            0,
            Load {
                requests: 1,
                tokens: 500,
            },
        );
        shard.set_load(
            1,
            1,
            Load {
                requests: 1,
                tokens: 100,
            },
        );
        shard.set_load(
            2,
            0,
            Load {
                requests: 1,
                tokens: 50,
            },
        );
        shard.set_load(
            2,
            1,
            Load {
                requests: 1,
                tokens: 60,
            },
        );
        let choice = shard.decide(&LookupAnswer::default(), 10, &[]).unwrap();
        assert_eq!(choice.backend, 1);
    }
}
