//! The server's side of the sans-IO routing core (`myelin-routing`): one data core's shard and
//! router, the load view it scores with, and the messages lookups and lessons travel in.

use std::collections::BTreeMap;
use std::time::Instant;

pub use myelin_routing::BlockCounts;
use myelin_routing::{
    BackendView, BlockChain, Policy, PrefixMatch, Router, RouterConfig, Shard, ShardConfig,
    owner_shard_of_chain,
};

use crate::backends::{BackendId, BackendInfo, BackendState, Load};
use crate::config::{ResidencyMode, RoutingPolicy, ServeConfig};
use crate::kv_feed::MirrorChange;

/// What the owner shard is asked: the prompt's block chain.
#[derive(Debug, Clone)]
pub struct LookupQuery {
    pub chain: BlockChain,
}

/// The owner's answer: every backend's match (plain data, crosses cores).
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

/// "This prompt went to this backend", for the owner shard to record.
#[derive(Debug, Clone)]
pub struct RouteLesson {
    pub chain: BlockChain,
    pub backend: BackendId,
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

/// One data core's routing state: the shard of the prefixes it owns, its router (scoring and
/// the round-robin cursor), and its view of every backend's state and load.
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
    pub fn new(
        config: &ServeConfig,
        shards: usize,
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
            clock_origin: Instant::now(),
        })
    }

    /// Milliseconds since this shard started: the routing core's clock.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Hashes the prompt once; returns the owner shard and the query to send it.
    pub fn query(&self, tokens: &[u32]) -> (usize, LookupQuery) {
        let chain = self.shard.chain(tokens);
        (
            owner_shard_of_chain(&chain, self.shards),
            LookupQuery { chain },
        )
    }

    /// Answers a lookup for a prompt this shard owns.
    pub fn lookup(&self, query: &LookupQuery) -> LookupAnswer {
        // Every core hashes with the same block size, so the chain always fits.
        self.shard
            .lookup_chain(&query.chain, self.now_ms())
            .unwrap_or_default()
    }

    pub fn lesson(&self, query: &LookupQuery, backend: BackendId) -> RouteLesson {
        RouteLesson {
            chain: query.chain.clone(),
            backend,
        }
    }

    /// Records a routed prompt this shard owns.
    pub fn learn(&mut self, lesson: RouteLesson) {
        let now = self.now_ms();
        // Same block size everywhere: cannot fail.
        let _ = self.shard.learn_chain(
            &lesson.chain,
            myelin_routing::BackendId(lesson.backend),
            now,
            0,
        );
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

    /// Applies a backend's KV events for the prefixes this shard owns.
    pub fn apply_mirror(&mut self, backend: BackendId, changes: &[MirrorChange]) {
        // Updates still in flight when a backend was removed are dropped with it.
        if !self.backends.contains_key(&backend) {
            return;
        }
        let backend = myelin_routing::BackendId(backend);
        for change in changes {
            match *change {
                MirrorChange::Stored(chain) => self.shard.apply_block_stored(backend, chain),
                MirrorChange::Removed(chain) => self.shard.apply_block_removed(backend, chain),
                MirrorChange::Cleared => self.shard.clear_mirror(backend),
            }
        }
    }

    /// Marks a backend's KV-event mirror live or not (`auto` uses it only while live).
    pub fn set_mirror_live(&mut self, backend: BackendId, live: bool) {
        self.shard
            .set_mirror_live(myelin_routing::BackendId(backend), live);
    }

    /// Blocks per backend this shard holds, in the tree and the verified mirror (admin API).
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
        let mut shard = RoutingShard::new(&config, shards).unwrap();
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
        let (owner, query) = shard.query(&prompt);
        assert_eq!(owner, 0);
        let first = shard
            .decide(&shard.lookup(&query), prompt.len(), &[])
            .unwrap();
        shard.learn(shard.lesson(&query, first.backend));
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
