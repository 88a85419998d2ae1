//! The cache-pressure residency estimator and its closed loop: unit tests for each rule and
//! property tests (bounded, 1.0 without pressure, monotone in pressure and depth, unknown
//! capacity degrades to history, the calibration moves towards the room a report implies).

use myelin_routing::{
    BackendId, BackendMatch, BackendState, BackendView, MatchSegment, Policy, PrefixMatch,
    PressureEstimator, ResidencyMode, ReuseProbe, RoomCalibration, Router, RouterConfig, Shard,
    ShardConfig, WriteOp, block_stamps, expected_cached_tokens, observe_reuse,
};
use proptest::prelude::*;

const BLOCK: u32 = 16;

fn view(capacity: Option<u64>, admitted: u64, load: u64) -> BackendView {
    BackendView::new(BackendId(0), BackendState::Up, load).with_cache(capacity, admitted, 0)
}

fn survivals(view: &BackendView, stamps: &[u64]) -> Vec<f64> {
    let mut out = Vec::new();
    PressureEstimator::default().survivals(view, BLOCK, stamps, &mut out);
    out
}

/// The log-logistic curve alone, without the recalibration map.
fn raw_survivals(view: &BackendView, stamps: &[u64]) -> Vec<f64> {
    let estimator = PressureEstimator {
        recalibration: &[],
        ..PressureEstimator::default()
    };
    let mut out = Vec::new();
    estimator.survivals(view, BLOCK, stamps, &mut out);
    out
}

fn matched(blocks: u32, stamp: u64) -> BackendMatch {
    BackendMatch {
        backend: BackendId(0),
        matched_blocks: blocks,
        last_routed_ms: 1,
        residency_stamp: stamp,
        verified_resident_blocks: None,
        verified_partial: false,
    }
}

#[test]
fn no_pressure_means_resident() {
    let v = view(Some(10_000), 5_000, 0);
    assert_eq!(survivals(&v, &[5_000; 8]), vec![1.0; 8]);
    // A stamp from a counter ahead of this core's view (peer counts arrive late): no pressure.
    assert_eq!(survivals(&v, &[6_000; 3]), vec![1.0; 3]);
}

#[test]
fn unknown_capacity_is_history_only() {
    let v = view(None, 1_000_000, 0);
    assert_eq!(survivals(&v, &[0; 5]), vec![1.0; 5]);
}

#[test]
fn half_at_the_edge_and_gone_far_past_it() {
    // Room 10_000, block 0 at headroom 10_000 - 16: half gone at `edge` of it.
    let v = view(Some(10_000), 20_000, 0);
    let half_at = (f64::from(10_000 - 16) * myelin_routing::DEFAULT_EDGE).round() as u64;
    let edge = raw_survivals(&v, &[20_000 - half_at]);
    assert!((edge[0] - 0.5).abs() < 1e-3, "{edge:?}");
    // The default map moves that half to what the engines were seen to keep there: close to
    // the diagonal (fitted across regimes, it no longer lifts the middle).
    let mapped = survivals(&v, &[20_000 - half_at]);
    let expected = myelin_routing::recalibrate(myelin_routing::DEFAULT_RECALIBRATION, 0.5);
    assert!((mapped[0] - expected).abs() < 1e-3, "{mapped:?}");
    assert!((0.45..0.6).contains(&mapped[0]), "{mapped:?}");
    // Past the deterministic LRU edge (the whole headroom) it is mostly gone.
    let lru_edge = raw_survivals(&v, &[20_000 - (10_000 - 16)]);
    assert!(lru_edge[0] < 0.4, "{lru_edge:?}");
    let far = survivals(&v, &[0]);
    assert!(far[0] < 0.1, "{far:?}");
    let near = survivals(&v, &[20_000 - 2_000]);
    assert!(near[0] > 0.99, "{near:?}");
}

#[test]
fn the_recalibration_map_goes_through_its_knots_and_inverts() {
    use myelin_routing::{recalibrate, uncalibrate};
    let knots: &[(f64, f64)] = &[(0.2, 0.3), (0.5, 0.5), (0.8, 0.9)];
    assert_eq!(recalibrate(&[], 0.37), 0.37);
    assert_eq!(recalibrate(knots, 0.0), 0.0);
    assert_eq!(recalibrate(knots, 1.0), 1.0);
    assert!((recalibrate(knots, 0.2) - 0.3).abs() < 1e-12);
    assert!((recalibrate(knots, 0.1) - 0.15).abs() < 1e-12);
    assert!((recalibrate(knots, 0.35) - 0.4).abs() < 1e-12);
    assert!((recalibrate(knots, 0.9) - 0.95).abs() < 1e-12);
    // Out of range and NaN are clamped.
    assert_eq!(recalibrate(knots, 1.5), 1.0);
    assert_eq!(recalibrate(knots, f64::NAN), 0.0);
    for step in 0..=100 {
        let value = f64::from(step) / 100.0;
        assert!((uncalibrate(knots, recalibrate(knots, value)) - value).abs() < 1e-12);
    }
    // A flat stretch inverts to its lowest point.
    let flat: &[(f64, f64)] = &[(0.4, 0.5), (0.6, 0.5)];
    assert!((uncalibrate(flat, 0.5) - 0.4).abs() < 1e-12);
    // The default map is increasing in both coordinates.
    let defaults = myelin_routing::DEFAULT_RECALIBRATION;
    assert!(
        defaults
            .windows(2)
            .all(|pair| pair[0].0 < pair[1].0 && pair[0].1 <= pair[1].1)
    );
}

#[test]
fn load_pins_room_and_deeper_blocks_go_first() {
    let idle = survivals(&view(Some(10_000), 8_000, 0), &[0; 4]);
    let busy = survivals(&view(Some(10_000), 8_000, 5_000), &[0; 4]);
    for depth in 0..4 {
        assert!(busy[depth] < idle[depth]);
    }
    assert!(idle.windows(2).all(|pair| pair[1] < pair[0]), "{idle:?}");
}

#[test]
fn watermark_zeroes_older_uses() {
    let v = BackendView::new(BackendId(0), BackendState::Up, 0).with_cache(Some(10_000), 100, 50);
    let out = survivals(&v, &[80, 60, 40, 30]);
    assert_eq!(&out[2..], &[0.0, 0.0]);
    assert!(out[1] > 0.99);
}

#[test]
fn segments_give_each_block_its_own_stamp() {
    let entry = matched(6, 10);
    let segments = [
        MatchSegment {
            backend: BackendId(0),
            start_block: 0,
            end_block: 2,
            last_routed_ms: 9,
            residency_stamp: 900,
        },
        MatchSegment {
            backend: BackendId(1),
            start_block: 0,
            end_block: 6,
            last_routed_ms: 9,
            residency_stamp: 5,
        },
        MatchSegment {
            backend: BackendId(0),
            start_block: 2,
            end_block: 4,
            last_routed_ms: 5,
            residency_stamp: 400,
        },
    ];
    let mut stamps = Vec::new();
    block_stamps(&entry, &segments, &mut stamps);
    assert_eq!(stamps, vec![900, 900, 400, 400, 10, 10]);
}

#[test]
fn router_discounts_an_aged_prefix_and_counts_a_downgrade() {
    let mut shard = Shard::new(ShardConfig {
        block_size: BLOCK,
        max_blocks: 10_000,
    })
    .unwrap();
    let prompt: Vec<u32> = (0..BLOCK * 64).collect();
    let chain = shard.chain(&prompt);
    // Routed to backend 0 when its counter read 1_000; since then 50_000 tokens went there,
    // five times its 10_000-token cache. It is busier than backend 1 by more than the load
    // bound, which history alone (1_024 cached tokens) outweighs.
    shard.learn_chain(&chain, BackendId(0), 1, 1_000).unwrap();
    let answer: PrefixMatch = shard.lookup_chain(&chain, 2).unwrap();
    let views = [
        BackendView::new(BackendId(0), BackendState::Up, 3_000).with_cache(Some(10_000), 51_000, 0),
        BackendView::new(BackendId(1), BackendState::Up, 0).with_cache(Some(10_000), 0, 0),
    ];
    // The cost in tokens, whose load bound the scenario is built on.
    let tokens = RouterConfig {
        cost: myelin_routing::CostModel::Tokens,
        ..RouterConfig::default()
    };
    let mut estimate = Router::new(Policy::Prefix, ResidencyMode::Estimate, tokens);
    let decision = estimate
        .decide(prompt.len() as u64, &answer, &views)
        .unwrap();
    assert_eq!(decision.backend, BackendId(1));
    assert!(decision.residency_downgrade);
    let mut off = Router::new(Policy::Prefix, ResidencyMode::Off, tokens);
    let decision = off.decide(prompt.len() as u64, &answer, &views).unwrap();
    assert_eq!(decision.backend, BackendId(0));
    // Fresh (little pressure since): the estimate keeps it.
    let views = [
        BackendView::new(BackendId(0), BackendState::Up, 3_000).with_cache(Some(10_000), 2_000, 0),
        views[1].clone(),
    ];
    let decision = estimate
        .decide(prompt.len() as u64, &answer, &views)
        .unwrap();
    assert_eq!(decision.backend, BackendId(0));
    assert!(!decision.residency_downgrade);
}

#[test]
fn evicted_writes_keep_the_largest_stamp_in_any_order() {
    let config = ShardConfig {
        block_size: BLOCK,
        max_blocks: 100,
    };
    let mut a = Shard::new(config).unwrap();
    let mut b = Shard::new(config).unwrap();
    let low = WriteOp::Evicted {
        backend: BackendId(3),
        stamp: 10,
    };
    let high = WriteOp::Evicted {
        backend: BackendId(3),
        stamp: 20,
    };
    a.apply(&low);
    a.apply(&high);
    b.apply(&high);
    b.apply(&low);
    assert_eq!(a.evicted_below(BackendId(3)), 20);
    assert_eq!(b.evicted_below(BackendId(3)), 20);
    assert_eq!(a.evicted_below(BackendId(4)), 0);
    a.remove_backend(BackendId(3));
    assert_eq!(a.evicted_below(BackendId(3)), 0);
}

fn make_probe(stamps: Vec<u64>, admitted: u64) -> ReuseProbe {
    ReuseProbe {
        block_size: BLOCK,
        stamps,
        admitted_tokens: admitted,
        load_tokens: 0,
        predicted_cached_tokens: 0.0,
        room_tokens: None,
        prompt_tokens: 0,
    }
}

#[test]
fn the_last_block_of_an_aligned_prompt_is_never_reported_reused() {
    // 4 blocks of history, a 64-token prompt: the engine recomputes token 63, so it reports
    // at most 3 blocks (48 tokens). That is a full hit, not an eviction.
    let mut probe = make_probe(vec![1_000; 4], 100_000);
    probe.prompt_tokens = 64;
    assert_eq!(probe.reusable_blocks(), 3);
    let observation = observe_reuse(&probe, 48);
    assert_eq!(observation.matched_blocks, 3);
    assert_eq!(observation.evicted_stamp, None);
    assert_eq!(observation.room_below, None);
    // A 65-token prompt can reuse all 4.
    probe.prompt_tokens = 65;
    assert_eq!(probe.reusable_blocks(), 4);
    assert_eq!(observe_reuse(&probe, 48).evicted_stamp, Some(1_000));
}

#[test]
fn a_miss_soon_after_the_use_is_not_eviction() {
    // Block 2 missing with 100 tokens of pressure since its use (a sibling's prefill still in
    // flight): no bound, no watermark.
    let mut probe = make_probe(vec![9_950, 9_950, 9_900, 9_900], 10_000);
    let observation = observe_reuse(&probe, 32);
    assert_eq!(observation.room_below, None);
    assert_eq!(observation.evicted_stamp, None);
    // Pressure above twice the matched tokens but under a quarter of the room: still none.
    probe.stamps = vec![9_000, 9_000, 8_000, 8_000];
    probe.room_tokens = Some(20_000.0);
    assert_eq!(observe_reuse(&probe, 32).evicted_stamp, None);
    probe.room_tokens = Some(6_000.0);
    assert_eq!(observe_reuse(&probe, 32).evicted_stamp, Some(8_000));
}

#[test]
fn a_short_report_bounds_the_room_and_names_the_evicted_stamp() {
    let probe = make_probe(vec![9_000, 9_000, 5_000, 5_000], 10_000);
    // Two blocks reused (31 tokens: vLLM recomputes a whole prompt's last token).
    let observation = observe_reuse(&probe, 31);
    assert_eq!(observation.reported_blocks, 2);
    assert_eq!(observation.matched_blocks, 4);
    assert_eq!(observation.room_at_least, Some(1_000.0 + 32.0));
    assert_eq!(observation.room_below, Some(5_000.0 + 48.0));
    assert_eq!(observation.evicted_stamp, Some(5_000));
    // Everything reused: a lower bound only.
    let full = observe_reuse(&probe, 64);
    assert_eq!(full.room_below, None);
    assert_eq!(full.evicted_stamp, None);
    assert_eq!(full.room_at_least, Some(5_000.0 + 64.0));
}

#[test]
fn calibration_moves_towards_the_implied_room_and_learns_an_unknown_capacity() {
    let estimator = PressureEstimator::default();
    let mut calibration = RoomCalibration::default();
    calibration.set_capacity(Some(20_000));
    let probe = make_probe(vec![9_000, 9_000, 5_000, 5_000], 10_000);
    let miss = observe_reuse(&probe, 32);
    for _ in 0..200 {
        calibration.observe(&estimator, &miss, 0, BLOCK);
    }
    let capacity = calibration.effective_capacity().unwrap();
    assert!((4_500..=5_048).contains(&capacity), "{capacity}");
    assert!(calibration.scale() < 1.0);
    // A report consistent with the estimate changes nothing.
    let before = calibration.scale();
    let consistent = observe_reuse(&make_probe(vec![9_990; 2], 10_000), 32);
    calibration.observe(&estimator, &consistent, 0, BLOCK);
    assert_eq!(calibration.scale(), before);
    // A new capacity from the engine resets the correction.
    calibration.set_capacity(Some(50_000));
    assert_eq!(calibration.scale(), 1.0);
    assert_eq!(calibration.effective_capacity(), Some(50_000));

    let mut unknown = RoomCalibration::default();
    unknown.set_capacity(None);
    assert_eq!(unknown.effective_capacity(), None);
    unknown.observe(&estimator, &observe_reuse(&probe, 1_000), 0, BLOCK);
    assert_eq!(
        unknown.effective_capacity(),
        None,
        "a full hit bounds nothing above"
    );
    unknown.observe(&estimator, &miss, 200, BLOCK);
    assert_eq!(unknown.effective_capacity(), Some(5_048 + 200));
    assert!(unknown.learned());
    // A scraped capacity replaces a learned one; an absent one keeps it.
    unknown.set_capacity(None);
    assert_eq!(unknown.effective_capacity(), Some(5_248));
    unknown.set_capacity(Some(7_000));
    assert!(!unknown.learned());
    assert_eq!(unknown.effective_capacity(), Some(7_000));
}

proptest! {
    #[test]
    fn probabilities_are_bounded_and_survival_monotone(
        capacity in proptest::option::of(1u64..2_000_000),
        admitted in 0u64..5_000_000,
        load in 0u64..3_000_000,
        watermark in 0u64..5_000_000,
        mut stamps in proptest::collection::vec(0u64..5_000_000, 0..40),
    ) {
        // Tree stamps are non-increasing in depth (a use passes through every shallower node).
        stamps.sort_unstable_by(|a, b| b.cmp(a));
        let v = BackendView::new(BackendId(0), BackendState::Up, load)
            .with_cache(capacity, admitted, watermark);
        let out = survivals(&v, &stamps);
        prop_assert_eq!(out.len(), stamps.len());
        for pair in out.windows(2) {
            prop_assert!(pair[1] <= pair[0]);
        }
        for &s in &out {
            prop_assert!((0.0..=1.0).contains(&s));
        }
        if capacity.is_none() {
            prop_assert!(out.iter().all(|&s| s == 1.0));
        }
        // Conditional probabilities through the trait: bounded, their product is the survival.
        let entry = matched(stamps.len() as u32, stamps.last().copied().unwrap_or(0));
        let segments: Vec<MatchSegment> = stamps
            .iter()
            .enumerate()
            .map(|(i, &stamp)| MatchSegment {
                backend: BackendId(0),
                start_block: i as u32,
                end_block: i as u32 + 1,
                last_routed_ms: 1,
                residency_stamp: stamp,
            })
            .collect();
        let mut probabilities = Vec::new();
        myelin_routing::ResidencyEstimator::block_probabilities(
            &PressureEstimator::default(),
            test_input(&v, &entry, &segments),
            &mut probabilities,
        );
        let mut product = 1.0;
        for (i, &p) in probabilities.iter().enumerate() {
            prop_assert!((0.0..=1.0).contains(&p));
            product *= p;
            prop_assert!((product - out[i]).abs() < 1e-9);
        }
        let expected = expected_cached_tokens(BLOCK, &probabilities);
        prop_assert!(expected <= f64::from(BLOCK) * stamps.len() as f64 + 1e-9);
    }

    #[test]
    fn more_pressure_or_less_room_never_raises_survival(
        capacity in 1u64..2_000_000,
        admitted in 0u64..5_000_000,
        extra in 0u64..1_000_000,
        load in 0u64..3_000_000,
        more_load in 0u64..1_000_000,
        stamp in 0u64..5_000_000,
        depth in 0usize..30,
    ) {
        let stamps = vec![stamp; depth + 1];
        let base = survivals(&view(Some(capacity), admitted, load), &stamps);
        let pressed = survivals(&view(Some(capacity), admitted + extra, load), &stamps);
        let loaded = survivals(&view(Some(capacity), admitted, load + more_load), &stamps);
        let bigger = survivals(&view(Some(capacity + extra), admitted, load), &stamps);
        for i in 0..=depth {
            prop_assert!(pressed[i] <= base[i]);
            prop_assert!(loaded[i] <= base[i]);
            prop_assert!(bigger[i] >= base[i]);
        }
        if admitted <= stamp {
            prop_assert!(base.iter().all(|&s| s == 1.0));
        }
    }

    #[test]
    fn calibration_scale_stays_in_bounds(
        reports in proptest::collection::vec((0u64..200, 0u64..100_000, 0u64..50_000), 1..60),
    ) {
        let estimator = PressureEstimator::default();
        let mut calibration = RoomCalibration::default();
        calibration.set_capacity(Some(40_000));
        for (reported, pressure, load) in reports {
            let probe = make_probe(vec![100_000 - pressure; 8], 100_000);
            calibration.observe(&estimator, &observe_reuse(&probe, reported), load, BLOCK);
            let (low, high) = myelin_routing::CALIBRATION_SCALE_BOUNDS;
            prop_assert!(calibration.scale() >= low && calibration.scale() <= high);
        }
    }
}

/// An estimator input for one backend's match.
fn test_input<'a>(
    view: &'a BackendView,
    matched: &'a BackendMatch,
    segments: &'a [MatchSegment],
) -> myelin_routing::EstimateInput<'a> {
    myelin_routing::EstimateInput::new(view, matched, segments, 0, BLOCK)
}
