//! The verified residency mirror against a naive model (a map from (backend, block) to copies)
//! over random KV-event sequences.

use std::collections::{BTreeMap, BTreeSet};

use myelin_routing::{BackendId, ResidencyMirror};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Event {
    Stored(u32, u64),
    Removed(u32, u64),
    Cleared(u32),
    Live(u32, bool),
    /// A change may have been lost (the writer's sequence had a gap).
    Untrusted(u32),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        5 => (0u32..3, 0u64..6).prop_map(|(backend, block)| Event::Stored(backend, block)),
        3 => (0u32..3, 0u64..6).prop_map(|(backend, block)| Event::Removed(backend, block)),
        1 => (0u32..3).prop_map(Event::Cleared),
        1 => (0u32..3, any::<bool>()).prop_map(|(backend, live)| Event::Live(backend, live)),
        1 => (0u32..3).prop_map(Event::Untrusted),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mirror_matches_naive_model(
        events in prop::collection::vec(event(), 0..80),
        chain in prop::collection::vec(0u64..6, 0..8),
    ) {
        let mut mirror = ResidencyMirror::default();
        let mut copies: BTreeMap<(u32, u64), u32> = BTreeMap::new();
        let mut live: BTreeSet<u32> = BTreeSet::new();
        // Not live, whatever the stream says, until the next clear.
        let mut untrusted: BTreeSet<u32> = BTreeSet::new();
        for event in &events {
            match *event {
                Event::Stored(backend, block) => {
                    mirror.block_stored(BackendId(backend), block);
                    *copies.entry((backend, block)).or_default() += 1;
                }
                Event::Removed(backend, block) => {
                    mirror.block_removed(BackendId(backend), block);
                    if let Some(count) = copies.get_mut(&(backend, block)) {
                        *count -= 1;
                        if *count == 0 {
                            copies.remove(&(backend, block));
                        }
                    }
                }
                Event::Cleared(backend) => {
                    mirror.clear_backend(BackendId(backend));
                    copies.retain(|&(holder, _), _| holder != backend);
                    untrusted.remove(&backend);
                }
                Event::Live(backend, is_live) => {
                    mirror.set_live(BackendId(backend), is_live);
                    if !is_live {
                        live.remove(&backend);
                    } else if !untrusted.contains(&backend) {
                        live.insert(backend);
                    }
                }
                Event::Untrusted(backend) => {
                    mirror.mark_untrusted(BackendId(backend));
                    live.remove(&backend);
                    untrusted.insert(backend);
                }
            }
            for backend in 0..3 {
                for block in 0..6 {
                    prop_assert_eq!(
                        mirror.holds(BackendId(backend), block),
                        copies.contains_key(&(backend, block))
                    );
                }
            }
            for backend in 0..3 {
                prop_assert_eq!(mirror.is_live(BackendId(backend)), live.contains(&backend));
                prop_assert_eq!(mirror.is_untrusted(BackendId(backend)), untrusted.contains(&backend));
            }
            let distinct: BTreeSet<u64> = copies.keys().map(|&(_, block)| block).collect();
            prop_assert_eq!(mirror.block_count(), distinct.len());
            let mut by_backend: BTreeMap<u32, usize> = BTreeMap::new();
            for &(backend, _) in copies.keys() {
                *by_backend.entry(backend).or_default() += 1;
            }
            let want_counts: Vec<(BackendId, usize)> = by_backend
                .into_iter()
                .map(|(backend, blocks)| (BackendId(backend), blocks))
                .collect();
            prop_assert_eq!(mirror.blocks_by_backend(), want_counts);
            let want: Vec<(BackendId, u32)> = live
                .iter()
                .map(|&backend| {
                    let resident = chain
                        .iter()
                        .take_while(|&&block| copies.contains_key(&(backend, block)))
                        .count() as u32;
                    (BackendId(backend), resident)
                })
                .collect();
            prop_assert_eq!(mirror.resident_prefixes(&chain), want);
        }
    }
}
