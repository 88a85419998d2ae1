//! Policy and shard behaviour: unit tests for each rule and property tests over random
//! backends, histories, loads and mirror states.

use std::num::NonZeroU32;

use myelin_routing::{
    BackendId, BackendMatch, BackendState, BackendView, BlockChain, CostModel,
    DEFAULT_DECODE_STEP_TOKENS, DEFAULT_ENGINE_TIMING, Decision, EngineQueue, EngineTiming,
    EstimateInput, KvMemory, MEMORY_FULL_UTILIZATION, MemoryPressure, MirrorTrust, NoBackend,
    PlaceholderEstimator, Policy, PrefixMatch, ResidencyEstimator, ResidencyMode, Router,
    RouterConfig, RoutingError, Shard, ShardConfig, admission_wait_tokens, expected_cached_tokens,
    prefill_pairs,
};
use proptest::prelude::*;

const BLOCK: u32 = 4;
const ALL_POLICIES: [Policy; 3] = [Policy::RoundRobin, Policy::LeastLoad, Policy::Prefix];
const ALL_MODES: [ResidencyMode; 4] = [
    ResidencyMode::Off,
    ResidencyMode::Estimate,
    ResidencyMode::Verified,
    ResidencyMode::Auto,
];

fn shard() -> Shard {
    Shard::new(ShardConfig {
        block_size: BLOCK,
        max_blocks: 100_000,
    })
    .unwrap()
}

fn up(id: u32, load_tokens: u64) -> BackendView {
    BackendView::new(BackendId(id), BackendState::Up, load_tokens)
}

fn prompt(blocks: u32, salt: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|token| token * 7 + salt).collect()
}

/// The cost in tokens (`CostModel::Tokens`): the rules these tests check (load bound, KV-memory
/// wait in tokens, homes) are that cost's; the cost in seconds has its own tests below.
fn tokens_cost() -> RouterConfig {
    RouterConfig {
        cost: CostModel::Tokens,
        ..RouterConfig::default()
    }
}

fn router(policy: Policy, residency: ResidencyMode, load_bound_tokens: u64) -> Router {
    Router::new(
        policy,
        residency,
        RouterConfig {
            load_bound_tokens,
            ..tokens_cost()
        },
    )
}

fn decide<E: ResidencyEstimator>(
    router: &mut Router<E>,
    shard: &Shard,
    tokens: &[u32],
    views: &[BackendView],
) -> Decision {
    let matched = shard.lookup(tokens, 0);
    router.decide(tokens.len() as u64, &matched, views).unwrap()
}

#[test]
fn prefix_match_is_send() {
    fn assert_send<T: Send + 'static>() {}
    assert_send::<PrefixMatch>();
    assert_send::<BlockChain>();
    assert_send::<Decision>();
    assert_send::<Shard>();
}

#[test]
fn names_parse_and_print() {
    for policy in ALL_POLICIES {
        assert_eq!(policy.to_string().parse::<Policy>(), Ok(policy));
    }
    for mode in ALL_MODES {
        assert_eq!(mode.to_string().parse::<ResidencyMode>(), Ok(mode));
    }
    let error = "fastest".parse::<Policy>().unwrap_err();
    assert!(
        error
            .to_string()
            .contains("round-robin, least-load, prefix")
    );
    assert!("always".parse::<ResidencyMode>().is_err());
}

#[test]
fn no_eligible_backend_is_a_typed_error() {
    let shard = shard();
    let tokens = prompt(2, 0);
    let views = [
        BackendView::new(BackendId(0), BackendState::Draining, 0),
        BackendView::new(BackendId(1), BackendState::Down, 0),
        BackendView::new(BackendId(2), BackendState::Down, 0),
    ];
    for policy in ALL_POLICIES {
        let mut router = router(policy, ResidencyMode::Auto, 0);
        let result = router.decide(8, &shard.lookup(&tokens, 0), &views);
        assert_eq!(
            result,
            Err(NoBackend {
                draining: 1,
                down: 2
            })
        );
        assert_eq!(
            router.decide(8, &shard.lookup(&tokens, 0), &[]),
            Err(NoBackend {
                draining: 0,
                down: 0
            })
        );
    }
}

#[test]
fn draining_and_down_backends_get_nothing_even_with_the_whole_prefix() {
    let mut shard = shard();
    let tokens = prompt(8, 1);
    shard.learn(&tokens, BackendId(0), 1);
    shard.learn(&tokens, BackendId(1), 1);
    let views = [
        BackendView::new(BackendId(0), BackendState::Draining, 0),
        BackendView::new(BackendId(1), BackendState::Down, 0),
        up(2, 1_000_000),
    ];
    for policy in ALL_POLICIES {
        let mut router = router(policy, ResidencyMode::Off, 0);
        for _ in 0..5 {
            assert_eq!(
                decide(&mut router, &shard, &tokens, &views).backend,
                BackendId(2)
            );
        }
    }
}

#[test]
fn round_robin_cycles_fairly_and_skips_ineligible() {
    let shard = shard();
    let tokens = prompt(1, 0);
    let mut router = router(Policy::RoundRobin, ResidencyMode::Off, 0);
    let views = [
        up(3, 0),
        up(1, 99),
        BackendView::new(BackendId(2), BackendState::Down, 0),
        up(7, 5),
    ];
    let picks: Vec<u32> = (0..9)
        .map(|_| decide(&mut router, &shard, &tokens, &views).backend.0)
        .collect();
    assert_eq!(picks, vec![1, 3, 7, 1, 3, 7, 1, 3, 7]);
    // Backend 3 starts draining: the cycle continues over the rest.
    let views = [
        BackendView::new(BackendId(3), BackendState::Draining, 0),
        up(1, 0),
        up(7, 0),
    ];
    let picks: Vec<u32> = (0..4)
        .map(|_| decide(&mut router, &shard, &tokens, &views).backend.0)
        .collect();
    assert_eq!(picks, vec![1, 7, 1, 7]);
}

#[test]
fn least_load_picks_fewest_tokens_and_rotates_ties() {
    let shard = shard();
    let tokens = prompt(1, 0);
    let mut router = router(Policy::LeastLoad, ResidencyMode::Off, 0);
    assert_eq!(
        decide(
            &mut router,
            &shard,
            &tokens,
            &[up(0, 500), up(1, 20), up(2, 300)]
        )
        .backend,
        BackendId(1)
    );
    let tied = [up(0, 10), up(1, 10), up(2, 10)];
    let picks: Vec<u32> = (0..3)
        .map(|_| decide(&mut router, &shard, &tokens, &tied).backend.0)
        .collect();
    assert_eq!(picks, vec![2, 0, 1]);
}

#[test]
fn prefix_prefers_the_cached_backend_until_load_outweighs_it() {
    let mut shard = shard();
    let tokens = prompt(16, 3); // 64 tokens, 16 blocks
    shard.learn(&tokens, BackendId(1), 1);
    let mut router = router(Policy::Prefix, ResidencyMode::Off, 100);
    // Within the bound: the match wins even though backend 1 is busier.
    let decision = decide(&mut router, &shard, &tokens, &[up(0, 0), up(1, 100)]);
    assert_eq!(decision.backend, BackendId(1));
    assert_eq!(decision.matched_blocks, 16);
    assert_eq!(decision.expected_cached_tokens, 64.0);
    assert_eq!(decision.historical_best, Some(BackendId(1)));
    assert!(!decision.residency_downgrade);
    // Beyond the bound by less than the 64 cached tokens: still backend 1 (cost 0+63 < 64+0).
    assert_eq!(
        decide(&mut router, &shard, &tokens, &[up(0, 0), up(1, 163)]).backend,
        BackendId(1)
    );
    // Beyond the bound by more than the cached tokens: the idle backend wins.
    let decision = decide(&mut router, &shard, &tokens, &[up(0, 0), up(1, 165)]);
    assert_eq!(decision.backend, BackendId(0));
    assert_eq!(decision.expected_cost_tokens, 64.0);
    assert!(
        !decision.residency_downgrade,
        "load, not residency, moved it"
    );
}

#[test]
fn the_last_decisions_candidates_are_its_evidence() {
    let mut shard = shard();
    let tokens = prompt(16, 5);
    shard.learn(&tokens, BackendId(1), 1);
    let mut router = router(Policy::Prefix, ResidencyMode::Off, 100);
    assert!(router.candidates().is_empty(), "no decision yet");
    let views = [
        up(2, 30),
        up(0, 0),
        up(1, 100),
        BackendView::new(BackendId(3), BackendState::Down, 0),
    ];
    let decision = decide(&mut router, &shard, &tokens, &views);
    let candidates = router.candidates();
    // Every eligible backend, by id; the down one is not a candidate.
    let ids: Vec<u32> = candidates.iter().map(|c| c.id.0).collect();
    assert_eq!(ids, [0, 1, 2]);
    let chosen = candidates
        .iter()
        .find(|c| c.id == decision.backend)
        .unwrap();
    assert_eq!(chosen.id, BackendId(1));
    assert_eq!(chosen.matched_blocks, decision.matched_blocks);
    assert_eq!(
        chosen.expected_cached_tokens,
        decision.expected_cached_tokens
    );
    assert_eq!(chosen.cost_tokens, decision.expected_cost_tokens);
    assert_eq!(candidates[0].matched_blocks, 0);
    assert_eq!(
        (candidates[0].load_tokens, candidates[2].load_tokens),
        (0, 30)
    );
    // The chosen one is the cheapest.
    assert!(
        candidates
            .iter()
            .all(|c| c.cost_tokens >= chosen.cost_tokens)
    );
}

#[test]
fn cold_prompts_spread_instead_of_piling_on_one_id() {
    let shard = shard();
    let mut router = router(Policy::Prefix, ResidencyMode::Auto, 0);
    let views = [up(0, 0), up(1, 0), up(2, 0)];
    let picks: Vec<u32> = (0..6)
        .map(|salt| {
            decide(&mut router, &shard, &prompt(2, salt), &views)
                .backend
                .0
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
}

/// Scales every block's probability by a constant: a stand-in for a real estimator.
struct ConstantEstimator(f64);

impl ResidencyEstimator for ConstantEstimator {
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>) {
        probabilities.resize(input.matched.matched_blocks as usize, self.0);
    }
}

#[test]
fn placeholder_estimator_counts_every_matched_block_as_resident() {
    // The PLACEHOLDER estimator (until the residency-estimate issue): probability 1.0.
    let mut shard = shard();
    let tokens = prompt(5, 9);
    shard.learn(&tokens, BackendId(4), 1);
    let mut router = Router::with_estimator(
        Policy::Prefix,
        ResidencyMode::Estimate,
        tokens_cost(),
        PlaceholderEstimator,
    );
    let decision = decide(&mut router, &shard, &tokens, &[up(4, 0), up(5, 0)]);
    assert_eq!(decision.expected_cached_tokens, 20.0);
}

#[test]
fn estimate_mode_discounts_by_cumulative_probability_and_counts_downgrades() {
    let mut shard = shard();
    let tokens = prompt(2, 5); // 2 blocks of 4
    shard.learn(&tokens, BackendId(0), 1);
    let mut router = Router::with_estimator(
        Policy::Prefix,
        ResidencyMode::Estimate,
        RouterConfig {
            load_bound_tokens: 0,
            ..tokens_cost()
        },
        ConstantEstimator(0.5),
    );
    // Backend 0: expected cached = 4*0.5 + 4*0.25 = 3, cost = 5 + 2 (load) = 7.
    // Backend 1: nothing cached, cost = 8 + 0. Backend 0 still wins.
    let decision = decide(&mut router, &shard, &tokens, &[up(0, 2), up(1, 0)]);
    assert_eq!(decision.backend, BackendId(0));
    assert_eq!(decision.expected_cached_tokens, 3.0);
    assert!(!decision.residency_downgrade);
    // Load 4 on backend 0: cost 9 > 8. With probabilities forced to 1 it would cost 0 + 4 = 4
    // and win: the loss is due to residency, a downgrade.
    let decision = decide(&mut router, &shard, &tokens, &[up(0, 4), up(1, 0)]);
    assert_eq!(decision.backend, BackendId(1));
    assert_eq!(decision.historical_best, Some(BackendId(0)));
    assert!(decision.residency_downgrade);
    // Load 9: backend 0 loses even with full residency: not a downgrade.
    let decision = decide(&mut router, &shard, &tokens, &[up(0, 9), up(1, 0)]);
    assert_eq!(decision.backend, BackendId(1));
    assert!(!decision.residency_downgrade);
    assert_eq!(expected_cached_tokens(4, &[0.5, 0.5]), 3.0);
    assert_eq!(expected_cached_tokens(4, &[1.0, 0.0, 1.0]), 4.0);
    assert_eq!(expected_cached_tokens(4, &[f64::NAN, 1.0]), 0.0);
    assert_eq!(expected_cached_tokens(4, &[2.0]), 4.0);
}

/// Ages blocks by their segment's last use: blocks last routed before `fresh_after_ms` are gone.
struct AgeEstimator {
    fresh_after_ms: u64,
}

impl ResidencyEstimator for AgeEstimator {
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>) {
        probabilities.resize(input.matched.matched_blocks as usize, 0.0);
        for segment in input
            .segments
            .iter()
            .filter(|s| s.backend == input.matched.backend)
        {
            let fresh = segment.last_routed_ms >= self.fresh_after_ms;
            for block in segment.start_block..segment.end_block {
                probabilities[block as usize] = if fresh { 1.0 } else { 0.0 };
            }
        }
    }
}

#[test]
fn estimator_sees_per_block_use_records() {
    let mut shard = shard();
    let system = prompt(2, 1); // 2 blocks, refreshed at t=100
    let mut chat = system.clone();
    chat.extend(prompt(3, 2)); // 3 more blocks, last routed at t=10
    shard.learn(&chat, BackendId(0), 10);
    shard.learn(&system, BackendId(0), 100);
    let matched = shard.lookup(&chat, 200);
    let mut router = Router::with_estimator(
        Policy::Prefix,
        ResidencyMode::Estimate,
        tokens_cost(),
        AgeEstimator { fresh_after_ms: 50 },
    );
    let decision = router
        .decide(chat.len() as u64, &matched, &[up(0, 0)])
        .unwrap();
    assert_eq!(decision.matched_blocks, 5);
    // Only the refreshed system prompt (2 blocks of 4) is expected to be resident.
    assert_eq!(decision.expected_cached_tokens, 8.0);
}

#[test]
fn verified_eviction_of_a_middle_block_cuts_the_cached_prefix() {
    let mut shard = shard();
    let tokens = prompt(10, 2);
    let chain = shard.chain(&tokens);
    shard.learn_chain(&chain, BackendId(0), 1, 0).unwrap();
    shard.set_mirror_live(BackendId(0), true);
    for &hash in chain.hashes() {
        shard.apply_block_stored(BackendId(0), hash);
    }
    shard.apply_block_removed(BackendId(0), chain.hashes()[3]);
    let matched = shard.lookup_chain(&chain, 5).unwrap();
    let entry = matched.backend(BackendId(0)).unwrap();
    assert_eq!(entry.matched_blocks, 10);
    assert_eq!(entry.verified_resident_blocks, Some(3));
    for mode in [ResidencyMode::Verified, ResidencyMode::Auto] {
        let mut router = router(Policy::Prefix, mode, 0);
        let decision = router.decide(40, &matched, &[up(0, 0)]).unwrap();
        assert_eq!(decision.expected_cached_tokens, 12.0, "{mode}");
    }
    // With the mirror not live, auto falls back to the (placeholder) estimate, verified to 0.
    shard.set_mirror_live(BackendId(0), false);
    let matched = shard.lookup_chain(&chain, 6).unwrap();
    assert_eq!(
        matched
            .backend(BackendId(0))
            .unwrap()
            .verified_resident_blocks,
        None
    );
    let auto = router(Policy::Prefix, ResidencyMode::Auto, 0)
        .decide(40, &matched, &[up(0, 0)])
        .unwrap();
    assert_eq!(auto.expected_cached_tokens, 40.0);
    let verified = router(Policy::Prefix, ResidencyMode::Verified, 0)
        .decide(40, &matched, &[up(0, 0)])
        .unwrap();
    assert_eq!(verified.expected_cached_tokens, 0.0);
}

/// A partial mirror (the router joined the event stream after the engine had cached blocks it
/// never saw): its blocks are resident, but a block missing from it is not taken as evicted.
/// `auto` takes the larger of the mirror's prefix and the estimate of the history; `verified`
/// counts the mirror's blocks only; once exact, the mirror is taken at its word.
#[test]
fn a_partial_mirror_is_a_floor_under_the_estimate() {
    let mut shard = shard();
    let tokens = prompt(10, 2);
    let chain = shard.chain(&tokens);
    shard.learn_chain(&chain, BackendId(0), 1, 0).unwrap();
    // Since the router subscribed, backend 0 stored 3 of the prompt's blocks, backend 1 (never
    // routed this prompt) 5.
    for &hash in &chain.hashes()[..3] {
        shard.apply_block_stored(BackendId(0), hash);
    }
    for &hash in &chain.hashes()[..5] {
        shard.apply_block_stored(BackendId(1), hash);
    }
    for backend in [0, 1] {
        shard.set_mirror_trust(BackendId(backend), MirrorTrust::Partial);
    }
    let matched = shard.lookup_chain(&chain, 5).unwrap();
    let entry = matched.backend(BackendId(0)).unwrap();
    assert_eq!(
        (entry.verified_resident_blocks, entry.verified_partial),
        (Some(3), true)
    );
    let expected = |mode, matched: &PrefixMatch, backend| {
        router(Policy::Prefix, mode, 0)
            .decide(40, matched, &[up(backend, 0)])
            .unwrap()
            .expected_cached_tokens
    };
    // The (placeholder) estimate of backend 0's 10 historical blocks beats the mirror's 3.
    assert_eq!(expected(ResidencyMode::Auto, &matched, 0), 40.0);
    assert_eq!(expected(ResidencyMode::Verified, &matched, 0), 12.0);
    // No history on backend 1: the mirror's 5 blocks.
    assert_eq!(expected(ResidencyMode::Auto, &matched, 1), 20.0);
    shard.set_mirror_trust(BackendId(0), MirrorTrust::Exact);
    let matched = shard.lookup_chain(&chain, 6).unwrap();
    assert!(!matched.backend(BackendId(0)).unwrap().verified_partial);
    assert_eq!(expected(ResidencyMode::Auto, &matched, 0), 12.0);
    shard.set_mirror_trust(BackendId(0), MirrorTrust::None);
    let matched = shard.lookup_chain(&chain, 7).unwrap();
    assert_eq!(
        matched
            .backend(BackendId(0))
            .unwrap()
            .verified_resident_blocks,
        None
    );
}

#[test]
fn live_mirror_counts_blocks_routed_elsewhere_and_copies_are_refcounted() {
    let mut shard = shard();
    let tokens = prompt(3, 4);
    let chain = shard.chain(&tokens);
    shard.set_mirror_live(BackendId(8), true);
    for &hash in chain.hashes() {
        shard.apply_block_stored(BackendId(8), hash);
    }
    shard.apply_block_stored(BackendId(8), chain.hashes()[0]); // a second physical copy
    shard.apply_block_removed(BackendId(8), chain.hashes()[0]);
    let matched = shard.lookup_chain(&chain, 0).unwrap();
    let entry = matched.backend(BackendId(8)).unwrap();
    assert_eq!(
        (entry.matched_blocks, entry.verified_resident_blocks),
        (0, Some(3))
    );
    let decision = router(Policy::Prefix, ResidencyMode::Verified, 0)
        .decide(12, &matched, &[up(7, 0), up(8, 0)])
        .unwrap();
    assert_eq!(decision.backend, BackendId(8));
    assert_eq!(decision.historical_best, None);
    shard.apply_block_removed(BackendId(8), chain.hashes()[0]);
    assert_eq!(
        shard
            .lookup_chain(&chain, 0)
            .unwrap()
            .backend(BackendId(8))
            .unwrap()
            .verified_resident_blocks,
        Some(0)
    );
    shard.clear_mirror(BackendId(8));
    assert_eq!(shard.mirror().block_count(), 0);
}

#[test]
fn shard_rejects_foreign_block_size_and_forgets_backends() {
    let mut shard = shard();
    let tokens = prompt(4, 0);
    let foreign = BlockChain::new(&tokens, NonZeroU32::new(16).unwrap());
    assert_eq!(
        shard.lookup_chain(&foreign, 0),
        Err(RoutingError::BlockSizeMismatch {
            chain: 16,
            shard: BLOCK
        })
    );
    assert!(shard.learn_chain(&foreign, BackendId(0), 0, 0).is_err());
    assert!(
        Shard::new(ShardConfig {
            block_size: 0,
            max_blocks: 1
        })
        .is_err()
    );
    let empty_bytes = shard.memory_bytes();
    let chain = shard.chain(&tokens);
    shard.learn_chain(&chain, BackendId(0), 1, 0).unwrap();
    shard.set_mirror_live(BackendId(0), true);
    shard.apply_block_stored(BackendId(0), chain.hashes()[0]);
    assert!(shard.memory_bytes() > empty_bytes);
    assert_eq!(shard.forget_block(&chain.hashes()[..2], BackendId(0)), 3);
    assert_eq!(shard.lookup(&tokens, 2).matched_blocks_of(BackendId(0)), 1);
    assert_eq!(shard.remove_backend(BackendId(0)), 1);
    assert!(!shard.mirror_live(BackendId(0)));
    assert_eq!(shard.mirror().block_count(), 0);
    assert!(shard.lookup(&tokens, 3).backends.is_empty());
}

// ---- properties ----

#[derive(Debug, Clone)]
struct Scenario {
    views: Vec<BackendView>,
    history: Vec<(u32, u32)>, // (backend, blocks routed of the prompt)
    mirrored: Vec<(u32, Vec<bool>)>, // live backends and which prompt blocks they hold
    prompt_blocks: u32,
}

fn state() -> impl Strategy<Value = BackendState> {
    prop_oneof![6 => Just(BackendState::Up), 1 => Just(BackendState::Draining), 1 => Just(BackendState::Down)]
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (1u32..12).prop_flat_map(|prompt_blocks| {
        (
            prop::collection::vec((state(), 0u64..200), 1..6),
            prop::collection::vec((0u32..6, 0..=prompt_blocks), 0..6),
            prop::collection::vec(
                (
                    0u32..6,
                    prop::collection::vec(any::<bool>(), prompt_blocks as usize),
                ),
                0..4,
            ),
        )
            .prop_map(move |(states, history, mirrored)| Scenario {
                views: states
                    .into_iter()
                    .enumerate()
                    .map(|(id, (state, load))| BackendView::new(BackendId(id as u32), state, load))
                    .collect(),
                history,
                mirrored,
                prompt_blocks,
            })
    })
}

/// Builds the shard for a scenario; returns it, the prompt and its chain.
fn build(scenario: &Scenario) -> (Shard, Vec<u32>, BlockChain) {
    let mut shard = shard();
    let tokens = prompt(scenario.prompt_blocks, 11);
    let chain = shard.chain(&tokens);
    for &(backend, blocks) in &scenario.history {
        shard.learn(&tokens[..(blocks * BLOCK) as usize], BackendId(backend), 1);
    }
    for (backend, held) in &scenario.mirrored {
        shard.set_mirror_live(BackendId(*backend), true);
        for (hash, &is_held) in chain.hashes().iter().zip(held) {
            if is_held {
                shard.apply_block_stored(BackendId(*backend), *hash);
            }
        }
    }
    (shard, tokens, chain)
}

/// Naive verified depth: leading prompt blocks the backend's live mirror holds.
fn naive_verified_blocks(scenario: &Scenario, backend: BackendId) -> Option<u32> {
    let mut live = false;
    let mut held = vec![false; scenario.prompt_blocks as usize];
    for (mirror_backend, blocks) in &scenario.mirrored {
        if BackendId(*mirror_backend) == backend {
            live = true;
            for (slot, &is_held) in held.iter_mut().zip(blocks) {
                *slot |= is_held;
            }
        }
    }
    live.then(|| held.iter().take_while(|&&h| h).count() as u32)
}

fn naive_history_blocks(scenario: &Scenario, backend: BackendId) -> u32 {
    scenario
        .history
        .iter()
        .filter(|(b, _)| BackendId(*b) == backend)
        .map(|&(_, blocks)| blocks)
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn only_up_backends_are_ever_picked(scenario in scenario(), rounds in 1usize..6) {
        let (shard, tokens, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        let any_up = scenario.views.iter().any(|v| v.state == BackendState::Up);
        for policy in ALL_POLICIES {
            for mode in ALL_MODES {
                let mut router = router(policy, mode, 50);
                for _ in 0..rounds {
                    match router.decide(tokens.len() as u64, &matched, &scenario.views) {
                        Ok(decision) => {
                            let view = scenario.views.iter().find(|v| v.id == decision.backend).unwrap();
                            prop_assert_eq!(view.state, BackendState::Up);
                        }
                        Err(_) => prop_assert!(!any_up),
                    }
                }
            }
        }
    }

    #[test]
    fn shard_lookup_matches_naive_history_and_mirror(scenario in scenario()) {
        let (shard, _, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        for id in 0..6 {
            let backend = BackendId(id);
            prop_assert_eq!(matched.matched_blocks_of(backend), naive_history_blocks(&scenario, backend));
            let verified = matched.backend(backend).and_then(|entry| entry.verified_resident_blocks);
            prop_assert_eq!(verified, naive_verified_blocks(&scenario, backend));
        }
    }

    #[test]
    fn verified_evicted_prefix_never_counts_as_cached(scenario in scenario()) {
        let (shard, tokens, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        for mode in [ResidencyMode::Verified, ResidencyMode::Auto] {
            let mut router = router(Policy::Prefix, mode, 0);
            if let Ok(decision) = router.decide(tokens.len() as u64, &matched, &scenario.views) {
                if let Some(verified) = naive_verified_blocks(&scenario, decision.backend) {
                    prop_assert!(decision.expected_cached_tokens <= f64::from(verified * BLOCK));
                } else if mode == ResidencyMode::Verified {
                    prop_assert_eq!(decision.expected_cached_tokens, 0.0);
                }
            }
        }
    }

    #[test]
    fn residency_off_longest_match_wins_within_the_load_bound(
        scenario in scenario(),
        load_bound in 0u64..300,
    ) {
        let (shard, tokens, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        let up: Vec<&BackendView> = scenario.views.iter().filter(|v| v.state == BackendState::Up).collect();
        prop_assume!(!up.is_empty());
        let min_load = up.iter().map(|v| v.load_tokens).min().unwrap();
        let longest = up.iter().map(|v| matched.matched_blocks_of(v.id)).max().unwrap();
        let mut router = router(Policy::Prefix, ResidencyMode::Off, load_bound);
        let decision = router.decide(tokens.len() as u64, &matched, &scenario.views).unwrap();
        prop_assert!(!decision.residency_downgrade, "no residency, no downgrade");
        let longest_within_bound = up.iter().any(|v| {
            matched.matched_blocks_of(v.id) == longest && v.load_tokens <= min_load + load_bound
        });
        if longest_within_bound {
            // Some longest-match backend's load is within the bound: a longest match wins.
            prop_assert_eq!(decision.matched_blocks, longest);
        } else {
            // Every longest-match backend is over the bound: it wins only if its cache advantage
            // covers its excess load. Check against the cost of every up backend.
            let chosen = up.iter().find(|v| v.id == decision.backend).unwrap();
            let cost = |view: &BackendView| {
                let cached = u64::from(matched.matched_blocks_of(view.id) * BLOCK);
                (tokens.len() as u64 - cached) + view.load_tokens.saturating_sub(load_bound).max(min_load)
            };
            for view in &up {
                prop_assert!(cost(chosen) <= cost(view));
            }
        }
    }

    #[test]
    fn residency_with_full_probabilities_never_downgrades(scenario in scenario()) {
        // No mirrors: estimate (placeholder = 1.0) and auto score exactly like off.
        let scenario = Scenario { mirrored: Vec::new(), ..scenario };
        let (shard, tokens, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        let mut off = router(Policy::Prefix, ResidencyMode::Off, 30);
        let mut estimate = router(Policy::Prefix, ResidencyMode::Estimate, 30);
        let mut auto = router(Policy::Prefix, ResidencyMode::Auto, 30);
        for _ in 0..3 {
            let a = off.decide(tokens.len() as u64, &matched, &scenario.views);
            let b = estimate.decide(tokens.len() as u64, &matched, &scenario.views);
            let c = auto.decide(tokens.len() as u64, &matched, &scenario.views);
            prop_assert_eq!(a, b);
            prop_assert_eq!(a, c);
            if let Ok(decision) = b {
                prop_assert!(!decision.residency_downgrade);
            }
        }
    }

    #[test]
    fn downgrade_means_undiscounted_scoring_would_have_picked_the_best_match(scenario in scenario()) {
        let (shard, tokens, chain) = build(&scenario);
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        for mode in [ResidencyMode::Verified, ResidencyMode::Auto] {
            let mut router = router(Policy::Prefix, mode, 20);
            let Ok(actual) = router.decide(tokens.len() as u64, &matched, &scenario.views) else {
                continue;
            };
            // The undiscounted counterfactual, computed independently: per up backend, cached =
            // max(what the mode counts, history), cost = uncached + counted load; lowest cost,
            // ties to the lowest id (fresh router: no rotation yet).
            let up: Vec<&BackendView> =
                scenario.views.iter().filter(|v| v.state == BackendState::Up).collect();
            let min_load = up.iter().map(|v| v.load_tokens).min().unwrap();
            let prompt_tokens = tokens.len() as u64;
            let counted = |cached: u64, view: &BackendView| {
                (prompt_tokens - cached.min(prompt_tokens)) + view.load_tokens.saturating_sub(20).max(min_load)
            };
            let undiscounted = |view: &BackendView| {
                let history = u64::from(matched.matched_blocks_of(view.id) * BLOCK);
                let verified = naive_verified_blocks(&scenario, view.id).map(|b| u64::from(b * BLOCK));
                let mode_cached = match (mode, verified) {
                    (_, Some(verified)) => verified,
                    (ResidencyMode::Auto, None) => history, // placeholder estimate: 1.0
                    _ => 0,
                };
                counted(mode_cached.max(history), view)
            };
            let best_cost = up.iter().map(|v| undiscounted(v)).min().unwrap();
            let winner = up.iter().filter(|v| undiscounted(v) == best_cost).map(|v| v.id).min().unwrap();
            let longest = up.iter().map(|v| matched.matched_blocks_of(v.id)).max().unwrap();
            let expected = longest > 0
                && actual.historical_best == Some(winner)
                && matched.matched_blocks_of(winner) == longest
                && actual.backend != winner;
            prop_assert_eq!(actual.residency_downgrade, expected, "{:?}", actual);
            if let Some(best) = actual.historical_best {
                prop_assert_eq!(matched.matched_blocks_of(best), longest);
            } else {
                prop_assert_eq!(longest, 0);
            }
        }
    }

    #[test]
    fn verified_surplus_beyond_history_is_not_a_downgrade(extra in 1u32..5) {
        // Backend 1 was routed 2 blocks and still holds them; backend 2 was never routed the
        // prompt here but its live mirror shows more of it. Choosing 2 is not a downgrade.
        let mut shard = shard();
        let tokens = prompt(2 + extra, 6);
        let chain = shard.chain(&tokens);
        shard.learn(&tokens[..8], BackendId(1), 1);
        for backend in [1, 2] {
            shard.set_mirror_live(BackendId(backend), true);
        }
        for (index, &hash) in chain.hashes().iter().enumerate() {
            if index < 2 {
                shard.apply_block_stored(BackendId(1), hash);
            }
            shard.apply_block_stored(BackendId(2), hash);
        }
        let matched = shard.lookup_chain(&chain, 0).unwrap();
        let decision = router(Policy::Prefix, ResidencyMode::Auto, 0)
            .decide(tokens.len() as u64, &matched, &[up(1, 0), up(2, 0)])
            .unwrap();
        prop_assert_eq!(decision.backend, BackendId(2));
        prop_assert_eq!(decision.historical_best, Some(BackendId(1)));
        prop_assert!(!decision.residency_downgrade);
    }

    #[test]
    fn round_robin_is_fair_over_a_stable_set(scenario in scenario(), laps in 1usize..5) {
        let shard = shard();
        let tokens = prompt(1, 0);
        let matched = shard.lookup(&tokens, 0);
        let up = scenario.views.iter().filter(|v| v.state == BackendState::Up).count();
        prop_assume!(up > 0);
        let mut router = router(Policy::RoundRobin, ResidencyMode::Off, 0);
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..laps * up {
            let decision = router.decide(4, &matched, &scenario.views).unwrap();
            *counts.entry(decision.backend).or_insert(0usize) += 1;
        }
        prop_assert_eq!(counts.len(), up);
        prop_assert!(counts.values().all(|&count| count == laps));
    }

    #[test]
    fn least_load_always_picks_a_minimum(scenario in scenario()) {
        let shard = shard();
        let matched = shard.lookup(&prompt(1, 0), 0);
        let mut router = router(Policy::LeastLoad, ResidencyMode::Auto, 0);
        if let Ok(decision) = router.decide(4, &matched, &scenario.views) {
            let min = scenario.views.iter().filter(|v| v.state == BackendState::Up).map(|v| v.load_tokens).min().unwrap();
            let chosen = scenario.views.iter().find(|v| v.id == decision.backend).unwrap();
            prop_assert_eq!(chosen.load_tokens, min);
        }
    }
}

#[test]
fn backend_match_is_plain_data_found_by_backend_id() {
    // The server copies matches across cores by message: they must be Copy and Send.
    fn plain<T: Copy + Send + Sync + 'static>() {}
    plain::<BackendMatch>();
    let entry = |backend: u32, matched_blocks: u32| BackendMatch {
        backend: BackendId(backend),
        matched_blocks,
        last_routed_ms: 3,
        residency_stamp: 4,
        verified_resident_blocks: None,
        verified_partial: false,
    };
    // Entries sorted by backend id, as a lookup returns them: found by binary search, absent
    // backends have no entry and match 0 blocks.
    let matched = PrefixMatch {
        block_size: 4,
        prompt_blocks: 8,
        looked_up_at_ms: 0,
        backends: vec![entry(1, 2), entry(3, 5), entry(7, 1)],
        segments: Vec::new(),
    };
    assert_eq!(matched.backend(BackendId(3)), Some(&entry(3, 5)));
    assert_eq!(matched.matched_blocks_of(BackendId(7)), 1);
    assert_eq!(matched.backend(BackendId(2)), None);
    assert_eq!(matched.matched_blocks_of(BackendId(0)), 0);
    assert_eq!(matched.matched_blocks_of(BackendId(8)), 0);
}

fn full(waiting_requests: u32, running_requests: u32) -> MemoryPressure {
    MemoryPressure {
        utilization: 0.98,
        waiting_requests,
        running_requests,
        mean_remaining_output_tokens: 200.0,
    }
}

#[test]
fn admission_wait_counts_only_full_memory_with_a_queue() {
    let step = DEFAULT_DECODE_STEP_TOKENS;
    // Memory full, 5 waiting, 10 running owing 200 tokens each: a request is admitted every
    // 200 / 10 = 20 steps, the new one after 6 admissions, 120 steps.
    assert_eq!(
        admission_wait_tokens(&full(5, 10), step),
        120.0 * step as f64
    );
    // Nobody waiting: the new request is admitted at once (its budget share is in the load).
    assert_eq!(admission_wait_tokens(&full(0, 10), step), 0.0);
    // A queue without full memory waits for the token budget, which the load counts.
    let busy = MemoryPressure {
        utilization: MEMORY_FULL_UTILIZATION - 0.01,
        ..full(5, 10)
    };
    assert_eq!(admission_wait_tokens(&busy, step), 0.0);
    // 0 = KV memory ignored; a NaN utilization is no evidence.
    assert_eq!(admission_wait_tokens(&full(5, 10), 0), 0.0);
    let nan = MemoryPressure {
        utilization: f64::NAN,
        ..full(5, 10)
    };
    assert_eq!(admission_wait_tokens(&nan, step), 0.0);
    // No running request to free memory: counted as one.
    assert_eq!(
        admission_wait_tokens(&full(1, 0), step),
        2.0 * 200.0 * step as f64
    );
}

#[test]
fn a_prefix_whose_home_is_out_of_kv_memory_gets_a_second_home() {
    let mut shard = shard();
    let tokens = prompt(8, 3); // 32 tokens, 8 blocks
    shard.learn(&tokens, BackendId(0), 1);
    let mut router = router(Policy::Prefix, ResidencyMode::Off, 0);
    // Backend 0 holds the prefix; with room it wins.
    let roomy = [up(0, 0), up(1, 0)];
    let decision = decide(&mut router, &shard, &tokens, &roomy);
    assert_eq!(decision.backend, BackendId(0));
    assert!(!decision.prefix_replication);
    assert_eq!(decision.admission_wait_tokens, 0.0);
    // Its KV memory full with a queue: the wait costs more than prefilling 32 tokens on 1.
    let saturated = [up(0, 0).with_memory(Some(full(3, 4))), up(1, 0)];
    let decision = decide(&mut router, &shard, &tokens, &saturated);
    assert_eq!(decision.backend, BackendId(1));
    assert!(decision.prefix_replication, "{decision:?}");
    // The second home learns the prefix; both hold it now, and the full one keeps losing.
    shard.learn(&tokens, BackendId(1), 2);
    let decision = decide(&mut router, &shard, &tokens, &saturated);
    assert_eq!(decision.backend, BackendId(1));
    assert!(
        !decision.prefix_replication,
        "both hold the prefix: no replication"
    );
    // A short wait that costs less than the prefill keeps the request home.
    let mut router = Router::new(
        Policy::Prefix,
        ResidencyMode::Off,
        RouterConfig {
            load_bound_tokens: 0,
            decode_step_tokens: 1,
            ..tokens_cost()
        },
    );
    let mut fresh = self::shard();
    fresh.learn(&tokens, BackendId(0), 1);
    // 2 admissions every 200 / 40 = 5 steps of 1 token: 10 tokens of wait < 32 to prefill.
    let slight = [up(0, 0).with_memory(Some(full(1, 40))), up(1, 0)];
    let decision = decide(&mut router, &fresh, &tokens, &slight);
    assert_eq!(decision.backend, BackendId(0));
    assert_eq!(decision.admission_wait_tokens, 10.0);
    // Round-robin and least-load never count replications.
    let mut round_robin = self::router(Policy::RoundRobin, ResidencyMode::Off, 0);
    for _ in 0..2 {
        let decision = decide(&mut round_robin, &fresh, &tokens, &saturated);
        assert!(!decision.prefix_replication);
    }
}

#[test]
fn waits_count_beyond_the_least_one() {
    let mut shard = shard();
    let tokens = prompt(8, 3);
    shard.learn(&tokens, BackendId(0), 1);
    let mut router = router(Policy::Prefix, ResidencyMode::Off, 0);
    // Both engines full with the same queue: the cache decides, as without memory figures.
    let both = [
        up(0, 0).with_memory(Some(full(3, 4))),
        up(1, 0).with_memory(Some(full(3, 4))),
    ];
    let decision = decide(&mut router, &shard, &tokens, &both);
    assert_eq!(decision.backend, BackendId(0));
    assert_eq!(decision.admission_wait_tokens, 0.0);
    assert!(!decision.prefix_replication);
    // The other one waits less, by more than the prompt's prefill: it takes the request, and
    // its cost carries only the difference.
    let less = [
        up(0, 0).with_memory(Some(full(3, 4))),
        up(1, 0).with_memory(Some(full(1, 4))),
    ];
    let decision = decide(&mut router, &shard, &tokens, &less);
    assert_eq!(decision.backend, BackendId(1));
    assert_eq!(decision.admission_wait_tokens, 0.0);
    assert!(decision.prefix_replication);
    let waits = admission_wait_tokens(&full(3, 4), DEFAULT_DECODE_STEP_TOKENS)
        - admission_wait_tokens(&full(1, 4), DEFAULT_DECODE_STEP_TOKENS);
    assert_eq!(decision.expected_cost_tokens, 32.0);
    assert!(waits > 32.0);
}

#[test]
fn a_prefix_routed_moments_ago_counts_as_resident_in_every_mode() {
    let mut shard = shard();
    let tokens = prompt(8, 3);
    // Routed to backend 0 at 1,000 ms; its mirror is live and shows nothing yet (the engine is
    // prefilling, its BlockStored events are on the way).
    shard.learn(&tokens, BackendId(0), 1_000);
    shard.set_mirror_live(BackendId(0), true);
    let views = [up(0, 0), up(1, 0)];
    for pending_resident_ms in [0, 500] {
        for mode in [ResidencyMode::Verified, ResidencyMode::Auto] {
            let mut router = Router::new(
                Policy::Prefix,
                mode,
                RouterConfig {
                    load_bound_tokens: 0,
                    pending_resident_ms,
                    ..tokens_cost()
                },
            );
            let soon = shard.lookup(&tokens, 1_400);
            let decision = router.decide(tokens.len() as u64, &soon, &views).unwrap();
            if pending_resident_ms == 0 {
                // Only the (empty) mirror counts: nothing cached anywhere.
                assert_eq!(decision.expected_cached_tokens, 0.0, "{mode:?}");
            } else {
                assert_eq!(decision.backend, BackendId(0), "{mode:?}");
                assert_eq!(decision.expected_cached_tokens, 32.0, "{mode:?}");
                assert!(!decision.residency_downgrade);
            }
            // Past the bound the mirror rules again.
            let later = shard.lookup(&tokens, 1_501);
            let decision = router.decide(tokens.len() as u64, &later, &views).unwrap();
            assert_eq!(decision.expected_cached_tokens, 0.0, "{mode:?}");
        }
    }
}

#[test]
fn a_prefix_routed_before_a_request_still_waiting_for_its_first_token_stays_pending() {
    let mut shard = shard();
    let tokens = prompt(8, 3);
    // Routed to backend 0 at 1,000 ms, a long prompt: its mirror is live and shows nothing of
    // it 5 s later, past the pending bound of 500 ms.
    shard.learn(&tokens, BackendId(0), 1_000);
    shard.set_mirror_live(BackendId(0), true);
    let mut router = Router::new(
        Policy::Prefix,
        ResidencyMode::Auto,
        RouterConfig {
            load_bound_tokens: 0,
            pending_resident_ms: 500,
            ..tokens_cost()
        },
    );
    let later = shard.lookup(&tokens, 6_000);
    let expected = |router: &mut Router, since: Option<u64>| {
        let views = [up(0, 0).with_prefilling_since(since), up(1, 0)];
        router
            .decide(tokens.len() as u64, &later, &views)
            .unwrap()
            .expected_cached_tokens
    };
    // The oldest request there without a first token was sent at or before the route (first
    // come, first served: the routed prompt is still being prefilled, or waits to be).
    assert_eq!(expected(&mut router, Some(900)), 32.0);
    assert_eq!(expected(&mut router, Some(1_000)), 32.0);
    // Every request sent no later than the route has had its first token: the mirror rules.
    assert_eq!(expected(&mut router, Some(1_001)), 0.0);
    assert_eq!(expected(&mut router, None), 0.0);
    // Off, the pending bound turns this off too.
    let mut off = Router::new(
        Policy::Prefix,
        ResidencyMode::Auto,
        RouterConfig {
            load_bound_tokens: 0,
            pending_resident_ms: 0,
            ..tokens_cost()
        },
    );
    assert_eq!(expected(&mut off, Some(900)), 0.0);
}

#[test]
fn a_prefix_with_its_share_of_homes_gets_no_more_for_memory() {
    let mut shard = shard();
    let tokens = prompt(8, 3);
    for home in 0..3 {
        shard.learn(&tokens, BackendId(home), 1);
    }
    // Three homes, all full with queues of 3 to 5; backend 3 is idle and holds nothing.
    let views = [
        up(0, 0).with_memory(Some(full(5, 4))),
        up(1, 0).with_memory(Some(full(3, 4))),
        up(2, 0).with_memory(Some(full(4, 4))),
        up(3, 0),
    ];
    let config = |max_prefix_homes| RouterConfig {
        load_bound_tokens: 0,
        max_prefix_homes,
        ..tokens_cost()
    };
    // Unbounded: the idle engine becomes a fourth home.
    let mut unbounded = Router::new(Policy::Prefix, ResidencyMode::Off, config(0));
    let decision = decide(&mut unbounded, &shard, &tokens, &views);
    assert_eq!(decision.backend, BackendId(3));
    assert!(decision.prefix_replication);
    // At most 3 homes: the least-waiting home takes it, its wait counted as 0.
    let mut bounded = Router::new(Policy::Prefix, ResidencyMode::Off, config(3));
    let decision = decide(&mut bounded, &shard, &tokens, &views);
    assert_eq!(decision.backend, BackendId(1));
    assert!(!decision.prefix_replication);
    assert_eq!(decision.admission_wait_tokens, 0.0);
    // A bound above the homes there are changes nothing.
    let mut roomy = Router::new(Policy::Prefix, ResidencyMode::Off, config(4));
    assert_eq!(
        decide(&mut roomy, &shard, &tokens, &views).backend,
        BackendId(3)
    );
    // Load still moves it: a home loaded beyond the prompt's prefill loses to the idle engine.
    let loaded = [
        up(0, 500).with_memory(Some(full(5, 4))),
        up(1, 500).with_memory(Some(full(3, 4))),
        up(2, 500).with_memory(Some(full(4, 4))),
        up(3, 0),
    ];
    let decision = decide(&mut bounded, &shard, &tokens, &loaded);
    assert_eq!(decision.backend, BackendId(3));
    assert!(!decision.prefix_replication, "moved by load, not by memory");
}

#[test]
fn absurd_engine_figures_give_a_finite_wait() {
    // An engine's metrics are not trusted to be sane: no overflow, no NaN, no infinity.
    let absurd = MemoryPressure {
        utilization: 7.0,
        waiting_requests: u32::MAX,
        running_requests: 0,
        mean_remaining_output_tokens: f64::INFINITY,
    };
    let wait = admission_wait_tokens(&absurd, u64::MAX);
    assert!(wait.is_finite() && wait > 0.0, "{wait}");
    let unknown = MemoryPressure {
        mean_remaining_output_tokens: f64::NAN,
        ..absurd
    };
    assert!(admission_wait_tokens(&unknown, 300).is_finite());
    // Every engine absurd: the waits cancel out and the decision is still well defined.
    let mut shard = shard();
    let tokens = prompt(8, 3);
    shard.learn(&tokens, BackendId(0), 1);
    let mut router = router(Policy::Prefix, ResidencyMode::Off, 0);
    let views = [
        up(0, 0).with_memory(Some(absurd)),
        up(1, 0).with_memory(Some(absurd)),
    ];
    let decision = decide(&mut router, &shard, &tokens, &views);
    assert_eq!(decision.backend, BackendId(0));
    assert!(decision.expected_cost_tokens.is_finite());
}

// The cost in seconds (the default): the predicted time to first token.

/// An engine of `capacity` KV tokens with `requests` decoding, holding `held` tokens.
fn engine(id: u32, requests: u32, held: f64, timing: EngineTiming) -> BackendView {
    up(id, u64::from(requests) * 400).with_ttft(
        timing,
        EngineQueue {
            prefill_tokens_ahead: 0,
            prefill_pairs_ahead: 0.0,
            requests,
            decoding: requests,
            mean_remaining_output_tokens: 200.0,
            waiting_output_tokens: None,
            memory: Some(KvMemory {
                capacity_tokens: 32_768,
                held_tokens: held,
                shared_tokens: 0,
                growth_tokens: 0.0,
            }),
        },
    )
}

fn ttft_router(residency: ResidencyMode) -> Router {
    Router::new(Policy::Prefix, residency, RouterConfig::default())
}

/// Backend `id` at the default timing with `ahead` tokens of prefill queued in front of a new
/// request, behind one running request of 200 output tokens to go.
fn queued(id: u32, ahead: u64) -> BackendView {
    up(id, ahead).with_ttft(
        DEFAULT_ENGINE_TIMING,
        EngineQueue {
            prefill_tokens_ahead: ahead,
            requests: 1,
            mean_remaining_output_tokens: 200.0,
            ..EngineQueue::default()
        },
    )
}

#[test]
fn a_cold_prompt_goes_where_it_fits_not_where_it_would_wait_for_memory() {
    // Issue 26's overflow regime: engine 0 runs three 8k-token requests (26,000 tokens of its
    // 32,768), engine 1 runs five short ones. The cost in tokens sees 1,200 against 2,000
    // queued output tokens, both within the load bound, and ties; in seconds, a 9,000-token
    // prompt cannot fit on engine 0 until one of its requests finishes (seconds), while
    // engine 1 has room, and five sequences per step cost milliseconds.
    let shard = shard();
    let tokens = prompt(2250, 1);
    let views = [
        engine(0, 3, 26_000.0, DEFAULT_ENGINE_TIMING),
        engine(1, 5, 10_000.0, DEFAULT_ENGINE_TIMING),
    ];
    let mut router = ttft_router(ResidencyMode::Off);
    for _ in 0..4 {
        let decision = decide(&mut router, &shard, &tokens, &views);
        assert_eq!(decision.backend, BackendId(1));
        assert_eq!(decision.predicted_ttft.memory_wait_steps, 0.0);
    }
    // The same on engine 0 would have waited: its prediction says so.
    let mut only_full = ttft_router(ResidencyMode::Off);
    let decision = decide(&mut only_full, &shard, &tokens, &views[..1]);
    assert!(decision.predicted_ttft.memory_wait_steps > 0.0);
    assert!(decision.predicted_ttft.seconds > 1.0, "{decision:?}");
}

#[test]
fn a_cache_hit_stays_home_while_the_queue_there_costs_less_than_prefilling_elsewhere() {
    let mut shard = shard();
    let tokens = prompt(1500, 2); // 6,000 tokens
    shard.learn(&tokens, BackendId(0), 0);
    let queued = |ahead: u64| queued(0, ahead);
    let idle = up(1, 0);
    // The request's own time only (no charge for the extra prefill).
    let mut own_time = Router::new(
        Policy::Prefix,
        ResidencyMode::Off,
        RouterConfig {
            extra_prefill_percent: 0,
            ..RouterConfig::default()
        },
    );
    // 2,000 tokens of prefill ahead cost less than prefilling 6,000 on the idle engine.
    let home = decide(
        &mut own_time,
        &shard,
        &tokens,
        &[queued(2000), idle.clone()],
    );
    assert_eq!(home.backend, BackendId(0));
    assert_eq!(home.expected_cached_tokens, 6000.0);
    // 8,000 ahead cost more: the hit moves.
    let moved = decide(
        &mut own_time,
        &shard,
        &tokens,
        &[queued(8000), idle.clone()],
    );
    assert_eq!(moved.backend, BackendId(1));
    assert!(moved.predicted_ttft.seconds < 8000.0 * DEFAULT_ENGINE_TIMING.prefill_s_per_token);
    // By default the 6,000 tokens prefilled again on the idle engine are charged once more
    // (the requests queuing behind them pay for them too): 8,000 ahead keep the hit home, and
    // it moves only past about 12,000, where its own first token comes later than the whole
    // prompt prefilled twice.
    let mut router = ttft_router(ResidencyMode::Off);
    let home = decide(&mut router, &shard, &tokens, &[queued(8000), idle.clone()]);
    assert_eq!(home.backend, BackendId(0));
    let home = decide(
        &mut router,
        &shard,
        &tokens,
        &[queued(11_000), idle.clone()],
    );
    assert_eq!(home.backend, BackendId(0));
    let moved = decide(&mut router, &shard, &tokens, &[queued(13_000), idle]);
    assert_eq!(moved.backend, BackendId(1));
    // The charge is the extra prefill only: the cold engine's cost is its own prefill twice
    // (its tokens and their attention).
    let expected =
        moved.predicted_ttft.seconds + DEFAULT_ENGINE_TIMING.prefill_seconds(6000, 6000.0);
    assert!(
        (moved.expected_cost_tokens - expected).abs() < 1e-9,
        "{moved:?}"
    );
}

#[test]
fn a_prefix_partly_evicted_at_home_is_not_copied_to_an_idle_engine_for_a_small_saving() {
    // Engine 0's live mirror holds the first 3,000 tokens of a 6,000-token prompt (the rest was
    // evicted); engine 1 is idle and holds none. Engine 0 has 3,500 tokens of prefill ahead, so
    // its own first token would come after 6,500 prefilled tokens against 6,000 on engine 1.
    // Moving saves 500 tokens of this request's wait and prefills the resident head a second
    // time (3,000 tokens of work, and memory the other prefixes lose): the request stays.
    let mut shard = shard();
    let tokens = prompt(1500, 8);
    shard.learn(&tokens, BackendId(0), 0);
    let chain = shard.chain(&tokens);
    shard.set_mirror_live(BackendId(0), true);
    for &hash in &chain.hashes()[..750] {
        shard.apply_block_stored(BackendId(0), hash);
    }
    let views = [queued(0, 3500), up(1, 0)];
    let decision = decide(
        &mut ttft_router(ResidencyMode::Auto),
        &shard,
        &tokens,
        &views,
    );
    assert_eq!(decision.backend, BackendId(0), "{decision:?}");
    assert_eq!(decision.expected_cached_tokens, 3000.0);
    let mut own_time = Router::new(
        Policy::Prefix,
        ResidencyMode::Auto,
        RouterConfig {
            extra_prefill_percent: 0,
            ..RouterConfig::default()
        },
    );
    assert_eq!(
        decide(&mut own_time, &shard, &tokens, &views).backend,
        BackendId(1)
    );
}

#[test]
fn the_extra_prefill_charge_grows_with_the_share_of_the_history_found_evicted() {
    // Engine 0 holds a hot 6,000-token prefix (its live mirror has every block) behind 8,000
    // tokens of prefill; engine 1 is idle. Charged in full, the re-prefill keeps the hit home
    // (see above); where nothing the history matches is evicted, a copy costs no other prefix
    // its memory and the hit moves to the idle engine.
    let mut shard = shard();
    let hot = prompt(1500, 3);
    shard.learn(&hot, BackendId(0), 0);
    shard.set_mirror_live(BackendId(0), true);
    for &hash in shard.chain(&hot).hashes() {
        shard.apply_block_stored(BackendId(0), hash);
    }
    let views = [queued(0, 8000), up(1, 0)];
    let mut router = ttft_router(ResidencyMode::Auto);
    let roomy = decide(&mut router, &shard, &hot, &views);
    assert_eq!(roomy.backend, BackendId(1), "{roomy:?}");
    assert_eq!(roomy.extra_prefill_scale, 0.0);
    assert_eq!(
        (roomy.history_matched_tokens, roomy.history_evicted_tokens),
        (6000.0, 0.0)
    );
    assert_eq!(router.evicted_share(), 0.0);
    // Charged in full whatever was evicted: ramp 0, and residency `off` (which cannot know).
    for (residency, ramp) in [(ResidencyMode::Auto, 0), (ResidencyMode::Off, 25)] {
        let mut always = Router::new(
            Policy::Prefix,
            residency,
            RouterConfig {
                extra_prefill_ramp_percent: ramp,
                ..RouterConfig::default()
            },
        );
        let decision = decide(&mut always, &shard, &hot, &views);
        assert_eq!(decision.backend, BackendId(0), "{residency:?} {ramp}");
        assert_eq!(decision.extra_prefill_scale, 1.0);
    }
    // Prompts whose history engine 1 no longer holds (its live mirror has none of them): as
    // they come, the evicted share passes 25% and the charge returns in full.
    let mut shard_evicting = shard;
    shard_evicting.set_mirror_live(BackendId(1), true);
    let evicted: Vec<_> = (0..20).map(|seed| prompt(1500, 100 + seed)).collect();
    for tokens in &evicted {
        shard_evicting.learn(tokens, BackendId(1), 0);
    }
    let mut scales = Vec::new();
    for tokens in &evicted {
        let decision = decide(&mut router, &shard_evicting, tokens, &[up(0, 0), up(1, 0)]);
        assert_eq!(decision.history_evicted_tokens, 6000.0);
        scales.push(decision.extra_prefill_scale);
    }
    assert!(
        scales.windows(2).all(|pair| pair[0] <= pair[1]),
        "{scales:?}"
    );
    assert_eq!(*scales.last().unwrap(), 1.0, "{scales:?}");
    assert!(router.evicted_share() > 0.25);
    let pressed = decide(&mut router, &shard_evicting, &hot, &views);
    assert_eq!(pressed.backend, BackendId(0), "{pressed:?}");
}

#[test]
fn equal_costs_go_to_the_engine_holding_the_prompt_not_round_the_engines() {
    // Engine 0 holds the 6,000-token prompt but shows 6,000 tokens of prefill ahead (a
    // finished request still counted in flight: another core's view lags); engine 1 would
    // prefill the whole prompt. Both predict the same seconds: the hit keeps the prompt, every
    // time, instead of rotating a second copy onto engine 1.
    let mut shard = shard();
    let tokens = prompt(1500, 6);
    shard.learn(&tokens, BackendId(0), 0);
    let views = [queued(0, 6000), queued(1, 0)];
    let mut router = ttft_router(ResidencyMode::Off);
    for _ in 0..4 {
        let decision = decide(&mut router, &shard, &tokens, &views);
        assert_eq!(decision.backend, BackendId(0));
        assert_eq!(decision.expected_cached_tokens, 6000.0);
    }
    // Without the prompt anywhere, equal engines still take turns.
    let cold = prompt(1500, 7);
    let spread: Vec<BackendId> = (0..2)
        .map(|_| decide(&mut router, &shard, &cold, &[queued(0, 0), queued(1, 0)]).backend)
        .collect();
    assert_ne!(spread[0], spread[1], "{spread:?}");
}

#[test]
fn a_slower_engine_is_priced_by_its_own_fitted_timing() {
    let shard = shard();
    let tokens = prompt(1000, 3);
    let slow = EngineTiming {
        prefill_s_per_token: DEFAULT_ENGINE_TIMING.prefill_s_per_token * 3.0,
        ..DEFAULT_ENGINE_TIMING
    };
    // Engine 0 is three times slower at prefill; with equal queues a cold prompt goes to 1,
    // every time (no rotation between unequal costs).
    let views = [
        engine(0, 0, 0.0, slow),
        engine(1, 1, 500.0, DEFAULT_ENGINE_TIMING),
    ];
    let mut router = ttft_router(ResidencyMode::Off);
    for _ in 0..3 {
        assert_eq!(
            decide(&mut router, &shard, &tokens, &views).backend,
            BackendId(1)
        );
    }
}

#[test]
fn one_long_prompt_queued_ahead_costs_more_than_the_same_tokens_in_short_ones() {
    // Both engines have 60,000 prompt tokens to prefill before a new request: engine 0 as one
    // prompt (its attention: 1.8e9 pairs, 5.4 s at the default timing), engine 1 as six of
    // 10,000 (3e8 pairs, 0.9 s). Counted in tokens alone they tie.
    let shard = shard();
    let tokens = prompt(100, 5);
    let behind = |id, prompts: u32, tokens_each: u64| {
        up(id, 60_000).with_ttft(
            DEFAULT_ENGINE_TIMING,
            EngineQueue {
                prefill_tokens_ahead: u64::from(prompts) * tokens_each,
                prefill_pairs_ahead: f64::from(prompts)
                    * prefill_pairs(tokens_each, tokens_each as f64),
                requests: prompts,
                mean_remaining_output_tokens: 200.0,
                ..EngineQueue::default()
            },
        )
    };
    let views = [behind(0, 1, 60_000), behind(1, 6, 10_000)];
    let mut router = ttft_router(ResidencyMode::Off);
    for _ in 0..3 {
        let decision = decide(&mut router, &shard, &tokens, &views);
        assert_eq!(decision.backend, BackendId(1));
    }
    let candidates = router.candidates();
    let gap = candidates[0].predicted_ttft.seconds - candidates[1].predicted_ttft.seconds;
    assert!((gap - 1.5e9 * 3e-9).abs() < 0.01, "{candidates:?}");
}

#[test]
fn a_residency_discount_that_moves_a_request_is_a_downgrade_in_seconds_too() {
    // History says engine 0 holds the prompt; its live mirror says it holds nothing. With
    // engine 0 a little busier, undiscounted scoring keeps it home and the mirror moves it.
    let mut shard = shard();
    let tokens = prompt(1500, 4);
    shard.learn(&tokens, BackendId(0), 0);
    shard.set_mirror_live(BackendId(0), true);
    let views = [
        engine(0, 2, 1000.0, DEFAULT_ENGINE_TIMING),
        engine(1, 0, 0.0, DEFAULT_ENGINE_TIMING),
    ];
    let mut router = ttft_router(ResidencyMode::Verified);
    let decision = decide(&mut router, &shard, &tokens, &views);
    assert_eq!(decision.backend, BackendId(1));
    assert_eq!(decision.historical_best, Some(BackendId(0)));
    assert!(decision.residency_downgrade);
    let mut history = ttft_router(ResidencyMode::Off);
    let decision = decide(&mut history, &shard, &tokens, &views);
    assert_eq!(decision.backend, BackendId(0));
    assert!(!decision.residency_downgrade);
}
