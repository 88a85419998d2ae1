//! Backend identity and each data core's table of backends: state, this core's load on each,
//! and the load the other cores last reported (the load view).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use myelin_routing::PinnedBlocks;

use crate::backend_spec::BackendSpec;
use crate::metrics::BackendMetrics;

/// Stable id of a backend within one router process (never reused after removal): the routing
/// core's own type, used throughout.
pub use myelin_routing::BackendId;

/// Whether a backend takes new requests: up, draining (removed by the operator, in-flight
/// requests finish) or down (failing health checks, or its circuit breaker is open).
pub use myelin_routing::BackendState;

/// What every core knows about a backend (sent across cores).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendInfo {
    pub id: BackendId,
    pub spec: BackendSpec,
    pub state: BackendState,
}

/// Load on a backend from one core: requests in flight and the work they still queue there, in
/// tokens (uncached prompt tokens until the first output token arrives, then only the expected
/// output), as used by the load part of routing scores. `admitted_tokens` only grows: every
/// token this core ever sent the backend (uncached prompt + expected output), the residency
/// estimate's clock (summed over cores, see `routing_glue`). `decode_tokens` is the part of
/// `tokens` that is expected output; `prefix_replications` only grows (requests sent as a
/// second home of a prefix whose first home's KV memory was full). `pinned_prompt_tokens`: the
/// prompt tokens of the in-flight requests (of any core) whose prompts this core owns, held in
/// the backend's KV memory, a block shared by several of them counted once (`pins.rs`): summed
/// over cores, the router's own view of that memory for engines that do not report theirs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub requests: u32,
    pub tokens: u64,
    pub admitted_tokens: u64,
    pub decode_tokens: u64,
    pub prefix_replications: u64,
    pub pinned_prompt_tokens: u64,
    /// Requests in flight that have not had their first token yet (the rest are decoding).
    pub prefilling: u32,
    /// The attention pairs of the prefill in `tokens` (`myelin_routing::prefill_pairs` of each
    /// request that has not had its first token): what makes a long prompt queued ahead cost
    /// more than its tokens.
    pub prefill_pairs: u64,
    /// When the engine began the prefill now at the head of its queue, as far as this core can
    /// tell (milliseconds on the routing clock shared by the cores): this core's last first
    /// token there, or when its first request without one was sent to an idle queue. Summed
    /// over cores as the latest: the engine serves its queue first come, first served, so the
    /// head started at the last first token anywhere. The predicted TTFT deducts the prefill
    /// done since (`routing_glue::engine_queue`). 0: never.
    pub prefill_clock_ms: u64,
    /// Requests in flight past their first token whose first token this node saw (a peer's
    /// requests are not among them), and the sum of those first tokens' times (milliseconds
    /// on the routing clock): their mean age, so how far through their output they are
    /// (`routing_glue::engine_queue`).
    pub decode_started: u32,
    pub decode_clock_ms: u64,
    /// When the oldest request in flight without a first token was sent (milliseconds on the
    /// routing clock, at least 1; 0: none). Summed over cores as the earliest: the engine
    /// serves first come, first served, so every route taken since that moment is still being
    /// prefilled or waits to be (`Router`'s pending resident). Kept by [`SentTimes`].
    pub prefilling_since_ms: u64,
}

/// The send times of one core's requests in flight on a backend without their first token:
/// the earliest is [`Load::prefilling_since_ms`].
#[derive(Debug, Clone, Default)]
pub struct SentTimes(std::collections::BTreeMap<u64, u32>);

impl SentTimes {
    /// A request sent at `sent_ms` (routing clock) waits for its first token.
    pub fn add(&mut self, sent_ms: u64) {
        *self.0.entry(sent_ms.max(1)).or_default() += 1;
    }

    /// The request sent at `sent_ms` had its first token, or ended without one.
    pub fn remove(&mut self, sent_ms: u64) {
        let key = sent_ms.max(1);
        if let Some(count) = self.0.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.0.remove(&key);
            }
        }
    }

    /// The earliest send time, 0 when none waits.
    pub fn earliest(&self) -> u64 {
        self.0.keys().next().copied().unwrap_or(0)
    }
}

/// Output tokens assumed for load accounting when a request sets no `max_tokens`.
pub const DEFAULT_EXPECTED_OUTPUT_TOKENS: u64 = 256;
/// Most output tokens one request counts for in load, the admitted-tokens clock and the
/// predicted TTFT, whatever its `max_tokens` says: no model's context is longer, and a client's
/// number must not move shared state by more than a request can cost (the engine rejects what
/// its context cannot hold).
pub const MAX_ACCOUNTED_OUTPUT_TOKENS: u64 = 1 << 20;

/// The output tokens a request counts for: its `max_tokens` (or the default), at most the
/// model's context and [`MAX_ACCOUNTED_OUTPUT_TOKENS`].
pub fn accounted_output_tokens(max_tokens: Option<u64>, max_model_len: Option<u64>) -> u64 {
    max_tokens
        .unwrap_or(DEFAULT_EXPECTED_OUTPUT_TOKENS)
        .min(max_model_len.unwrap_or(MAX_ACCOUNTED_OUTPUT_TOKENS))
        .min(MAX_ACCOUNTED_OUTPUT_TOKENS)
}

impl Load {
    /// A request starts on the backend: `prefill` queued until its first token,
    /// `decode_tokens` until it ends; the admitted-tokens clock grows by
    /// `admitted_prefill_tokens + decode_tokens`. Saturating: nothing wraps. `now_ms`: the
    /// routing clock (starts [`Self::prefill_clock_ms`] when no request was prefilling).
    pub fn start_request(
        &mut self,
        admitted_prefill_tokens: u64,
        prefill: Prefill,
        decode_tokens: u64,
        now_ms: u64,
    ) {
        let prefill_tokens = prefill.tokens;
        if self.prefilling == 0 {
            self.prefill_clock_ms = self.prefill_clock_ms.max(now_ms);
        }
        self.requests = self.requests.saturating_add(1);
        self.prefilling = self.prefilling.saturating_add(1);
        self.prefill_pairs = self.prefill_pairs.saturating_add(prefill.pairs);
        self.tokens = self
            .tokens
            .saturating_add(prefill_tokens.saturating_add(decode_tokens));
        self.admitted_tokens = self
            .admitted_tokens
            .saturating_add(admitted_prefill_tokens.saturating_add(decode_tokens));
        self.decode_tokens = self.decode_tokens.saturating_add(decode_tokens);
    }

    /// The request's first token: its `prefilled` work leaves the queue (and it stops
    /// prefilling, when `was_prefilling`, and the engine moves on to the next prefill at
    /// `now_ms`).
    pub fn first_token(&mut self, prefilled: Prefill, was_prefilling: bool, now_ms: u64) {
        self.tokens = self.tokens.saturating_sub(prefilled.tokens);
        self.prefill_pairs = self.prefill_pairs.saturating_sub(prefilled.pairs);
        if was_prefilling {
            self.prefilling = self.prefilling.saturating_sub(1);
            self.prefill_clock_ms = self.prefill_clock_ms.max(now_ms);
            self.decode_started = self.decode_started.saturating_add(1);
            self.decode_clock_ms = self.decode_clock_ms.saturating_add(now_ms);
        }
    }

    /// The request ended with `prefill` still queued (none once it had its first token) and
    /// `decode` output tokens; `first_token_ms`: when it had its first token (`None`: it had
    /// none, it was still prefilling).
    pub fn end_request(&mut self, prefill: Prefill, decode: u64, first_token_ms: Option<u64>) {
        self.requests = self.requests.saturating_sub(1);
        match first_token_ms {
            None => self.prefilling = self.prefilling.saturating_sub(1),
            Some(ms) => {
                self.decode_started = self.decode_started.saturating_sub(1);
                self.decode_clock_ms = self.decode_clock_ms.saturating_sub(ms);
            }
        }
        self.tokens = self
            .tokens
            .saturating_sub(prefill.tokens.saturating_add(decode));
        self.prefill_pairs = self.prefill_pairs.saturating_sub(prefill.pairs);
        self.decode_tokens = self.decode_tokens.saturating_sub(decode);
    }

    /// Adds `other` to `self` (sums over cores), saturating: a count from elsewhere (another
    /// core, a peer) must not wrap a sum.
    pub fn add(&mut self, other: &Load) {
        self.requests = self.requests.saturating_add(other.requests);
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.admitted_tokens = self.admitted_tokens.saturating_add(other.admitted_tokens);
        self.decode_tokens = self.decode_tokens.saturating_add(other.decode_tokens);
        self.prefix_replications = self
            .prefix_replications
            .saturating_add(other.prefix_replications);
        self.pinned_prompt_tokens = self
            .pinned_prompt_tokens
            .saturating_add(other.pinned_prompt_tokens);
        self.prefilling = self.prefilling.saturating_add(other.prefilling);
        self.prefill_pairs = self.prefill_pairs.saturating_add(other.prefill_pairs);
        self.prefill_clock_ms = self.prefill_clock_ms.max(other.prefill_clock_ms);
        self.decode_started = self.decode_started.saturating_add(other.decode_started);
        self.decode_clock_ms = self.decode_clock_ms.saturating_add(other.decode_clock_ms);
        self.prefilling_since_ms = match (self.prefilling_since_ms, other.prefilling_since_ms) {
            (0, other) => other,
            (own, 0) => own,
            (own, other) => own.min(other),
        };
    }

    /// Seconds since the first tokens of this node's decoding requests, on average (`None`:
    /// none decoding). `now_ms`: the routing clock.
    pub fn mean_decode_age_s(&self, now_ms: u64) -> Option<f64> {
        if self.decode_started == 0 {
            return None;
        }
        let mean_ms = self.decode_clock_ms as f64 / f64::from(self.decode_started);
        Some(((now_ms as f64 - mean_ms) / 1000.0).max(0.0))
    }
}

/// A request's prompt still to prefill on a backend, net of its expected cached prefix: the
/// tokens and their attention pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Prefill {
    pub tokens: u64,
    pub pairs: u64,
}

impl Prefill {
    /// The last `uncached_tokens` of a `prompt_tokens`-token prompt.
    pub fn of(prompt_tokens: u64, uncached_tokens: u64) -> Self {
        let tokens = uncached_tokens.min(prompt_tokens);
        Self {
            tokens,
            // At most 5e17 for the longest prompt the function takes: fits.
            pairs: myelin_routing::prefill_pairs(prompt_tokens, tokens as f64) as u64,
        }
    }
}

/// One data core's view of one backend.
#[derive(Debug, Clone)]
pub struct BackendEntry {
    pub info: BackendInfo,
    /// Load this core put on the backend.
    pub local: Load,
    /// The prompt blocks behind `local.pinned_prompt_tokens`.
    pub pinned: PinnedBlocks,
    /// The send times behind `local.prefilling_since_ms`.
    pub prefilling_sent: SentTimes,
    /// Load each other core last reported, by core index.
    pub peers: Vec<Load>,
    /// Version of the last control-core change applied to this entry (0: the startup list).
    pub version: u64,
    /// This backend's labelled metric handles on this core (registered when it was added, so
    /// the request path never looks a series up in the recorder).
    pub metrics: BackendMetrics,
}

impl BackendEntry {
    /// Total load over all cores, as this core last heard it.
    #[cfg(test)]
    pub fn total_load(&self) -> Load {
        let mut total = self.local;
        for peer in &self.peers {
            total.add(peer);
        }
        total
    }
}

/// A data core's backends, by id.
#[derive(Debug)]
pub struct BackendTable {
    shards: usize,
    entries: BTreeMap<BackendId, BackendEntry>,
    /// Ids removed (never reused): a late or re-sent change for one of them is ignored.
    removed: BTreeSet<BackendId>,
}

impl BackendTable {
    pub fn new(shards: usize) -> Self {
        BackendTable {
            shards,
            entries: BTreeMap::new(),
            removed: BTreeSet::new(),
        }
    }

    pub fn upsert(&mut self, info: BackendInfo) {
        self.upsert_versioned(info, 0);
    }

    /// Adds or updates a backend unless this table already applied a newer change to it or
    /// removed it. Returns whether it changed anything.
    pub fn upsert_versioned(&mut self, info: BackendInfo, version: u64) -> bool {
        if self.removed.contains(&info.id) {
            return false;
        }
        match self.entries.get_mut(&info.id) {
            Some(entry) if entry.version > version => false,
            Some(entry) => {
                entry.version = version;
                if entry.info.spec.url != info.spec.url {
                    entry.metrics = BackendMetrics::new(info.id);
                }
                entry.info = info;
                true
            }
            None => {
                let entry = BackendEntry {
                    metrics: BackendMetrics::new(info.id),
                    info: info.clone(),
                    local: Load::default(),
                    pinned: PinnedBlocks::default(),
                    prefilling_sent: SentTimes::default(),
                    peers: vec![Load::default(); self.shards],
                    version,
                };
                self.entries.insert(info.id, entry);
                true
            }
        }
    }

    /// Removes a backend for good (its id is never reused).
    pub fn remove(&mut self, id: BackendId) -> Option<BackendEntry> {
        self.removed.insert(id);
        self.entries.remove(&id)
    }

    /// Sets a backend's routing state unless a newer change was applied to it. Returns whether
    /// it changed anything.
    pub fn set_state_versioned(
        &mut self,
        id: BackendId,
        state: BackendState,
        version: u64,
    ) -> bool {
        match self.entries.get_mut(&id) {
            Some(entry) if entry.version <= version => {
                entry.version = version;
                entry.info.state = state;
                true
            }
            _ => false,
        }
    }

    /// Makes the table equal to `backends`, the control core's list as of change `version`:
    /// entries not newer than it are replaced, those missing from it removed. Returns the ids
    /// changed (upserted) and removed.
    pub fn sync(
        &mut self,
        backends: &[BackendInfo],
        version: u64,
    ) -> (Vec<BackendId>, Vec<BackendId>) {
        let mut changed = Vec::new();
        for info in backends {
            let differs = self
                .entries
                .get(&info.id)
                .is_none_or(|entry| entry.info != *info);
            if self.upsert_versioned(info.clone(), version) && differs {
                changed.push(info.id);
            }
        }
        let gone: Vec<BackendId> = self
            .entries
            .values()
            .filter(|entry| entry.version <= version)
            .filter(|entry| !backends.iter().any(|info| info.id == entry.info.id))
            .map(|entry| entry.info.id)
            .collect();
        for &id in &gone {
            self.remove(id);
        }
        (changed, gone)
    }

    pub fn get(&self, id: BackendId) -> Option<&BackendEntry> {
        self.entries.get(&id)
    }

    pub fn get_mut(&mut self, id: BackendId) -> Option<&mut BackendEntry> {
        self.entries.get_mut(&id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &BackendEntry> {
        self.entries.values()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Records the load another core reported (absolute values: a lost update heals with the
    /// next one).
    pub fn apply_peer_load(&mut self, from: usize, id: BackendId, load: Load) {
        if let Some(peer) = self
            .entries
            .get_mut(&id)
            .and_then(|entry| entry.peers.get_mut(from))
        {
            *peer = load;
        }
    }
}

/// A load update in flight between cores, stamped to measure the view's staleness.
#[derive(Debug, Clone, Copy)]
pub struct LoadUpdate {
    pub from: usize,
    pub backend: BackendId,
    pub load: Load,
    pub sent_at: Instant,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_load() -> impl Strategy<Value = Load> {
        let figure = || prop_oneof![0..1_000_000u64, u64::MAX - 1_000..=u64::MAX, any::<u64>()];
        let count = || prop_oneof![0..1_000u32, u32::MAX - 10..=u32::MAX];
        (
            figure(),
            figure(),
            figure(),
            figure(),
            count(),
            count(),
            figure(),
            figure(),
            (count(), figure()),
        )
            .prop_map(
                |(
                    tokens,
                    admitted_tokens,
                    decode_tokens,
                    pinned_prompt_tokens,
                    requests,
                    prefilling,
                    prefill_pairs,
                    prefill_clock_ms,
                    (decode_started, decode_clock_ms),
                )| {
                    Load {
                        requests,
                        tokens,
                        admitted_tokens,
                        decode_tokens,
                        prefix_replications: 0,
                        pinned_prompt_tokens,
                        prefilling,
                        prefill_pairs,
                        prefill_clock_ms,
                        decode_started,
                        decode_clock_ms,
                        prefilling_since_ms: 0,
                    }
                },
            )
    }

    #[test]
    fn the_earliest_request_waiting_for_a_first_token_is_summed_over_cores_as_the_earliest() {
        let mut sent = SentTimes::default();
        assert_eq!(sent.earliest(), 0);
        for ms in [30, 10, 10, 20] {
            sent.add(ms);
        }
        assert_eq!(sent.earliest(), 10);
        sent.remove(10);
        assert_eq!(sent.earliest(), 10, "two were sent at 10 ms");
        sent.remove(10);
        assert_eq!(sent.earliest(), 20);
        // A time never added changes nothing; the clock's 0 counts as 1 (0 means none).
        sent.remove(99);
        sent.add(0);
        assert_eq!(sent.earliest(), 1);
        let at = |prefilling_since_ms| Load {
            prefilling_since_ms,
            ..Load::default()
        };
        for (a, b, sum) in [(0, 0, 0), (0, 7, 7), (7, 0, 7), (9, 7, 7), (7, 9, 7)] {
            let mut total = at(a);
            total.add(&at(b));
            assert_eq!(total.prefilling_since_ms, sum, "{a} + {b}");
        }
    }

    proptest! {
        /// Whatever a client asks (`max_tokens` to u64::MAX, prompts of any length), and
        /// whatever the counters hold already (near their maximum too): no counter wraps, the
        /// admitted-tokens clock never goes back and moves by at most the prompt plus
        /// `MAX_ACCOUNTED_OUTPUT_TOKENS`, and a finished request leaves the in-flight figures
        /// where they were (unless one had saturated).
        #[test]
        fn no_request_moves_a_counter_by_more_than_it_can_cost(
            before in any_load(),
            prompt in prop_oneof![0..100_000u64, any::<u64>()],
            cached in any::<u64>(),
            max_tokens in proptest::option::of(prop_oneof![0..10_000u64, any::<u64>()]),
            max_model_len in proptest::option::of(any::<u64>()),
            first_token in any::<bool>(),
        ) {
            let decode = accounted_output_tokens(max_tokens, max_model_len);
            prop_assert!(decode <= MAX_ACCOUNTED_OUTPUT_TOKENS);
            prop_assert!(max_model_len.is_none_or(|len| decode <= len));
            let prefill = prompt.saturating_sub(cached);
            let queued = Prefill::of(prompt, prefill);
            let mut load = before;
            load.start_request(prefill, queued, decode, 5);
            prop_assert!(load.admitted_tokens >= before.admitted_tokens);
            prop_assert!(load.admitted_tokens - before.admitted_tokens <= prompt.saturating_add(decode));
            prop_assert!(load.tokens - before.tokens <= prompt.saturating_add(decode));
            prop_assert!(load.requests - before.requests <= 1);
            let admitted = load.admitted_tokens;
            let mut remaining = queued;
            let mut first_token_ms = None;
            if first_token {
                load.first_token(queued, true, 9);
                prop_assert_eq!(load.prefill_clock_ms, before.prefill_clock_ms.max(9));
                remaining = Prefill::default();
                first_token_ms = Some(9);
            }
            load.end_request(remaining, decode, first_token_ms);
            prop_assert_eq!(load.admitted_tokens, admitted, "the clock stays where it went");
            let saturated = before.tokens.checked_add(prefill.saturating_add(decode)).is_none()
                || before.requests == u32::MAX
                || before.prefilling == u32::MAX
                || before.decode_tokens.checked_add(decode).is_none()
                || before.prefill_pairs.checked_add(queued.pairs).is_none()
                || before.decode_started == u32::MAX
                || before.decode_clock_ms.checked_add(9).is_none();
            if !saturated {
                prop_assert_eq!(load.decode_started, before.decode_started);
                prop_assert_eq!(load.decode_clock_ms, before.decode_clock_ms);
                prop_assert_eq!(load.prefill_pairs, before.prefill_pairs);
                prop_assert_eq!(load.tokens, before.tokens);
                prop_assert_eq!(load.requests, before.requests);
                prop_assert_eq!(load.prefilling, before.prefilling);
                prop_assert_eq!(load.decode_tokens, before.decode_tokens);
            }
        }
    }

    fn info(id: u32) -> BackendInfo {
        BackendInfo {
            id: BackendId(id),
            spec: BackendSpec::parse("http://127.0.0.1:1").unwrap(),
            state: BackendState::Up,
        }
    }

    #[test]
    fn total_load_sums_local_and_peers() {
        let mut table = BackendTable::new(3);
        table.upsert(info(7));
        table.get_mut(BackendId(7)).unwrap().local = Load {
            requests: 1,
            tokens: 100,
            ..Load::default()
        };
        table.apply_peer_load(
            1,
            BackendId(7),
            Load {
                requests: 2,
                tokens: 50,
                ..Load::default()
            },
        );
        table.apply_peer_load(
            2,
            BackendId(7),
            Load {
                requests: 1,
                tokens: 10,
                ..Load::default()
            },
        );
        table.apply_peer_load(
            1,
            BackendId(7),
            Load {
                requests: 0,
                tokens: 0,
                ..Load::default()
            },
        );
        assert_eq!(
            table.get(BackendId(7)).unwrap().total_load(),
            Load {
                requests: 2,
                tokens: 110,
                ..Load::default()
            }
        );
        table.apply_peer_load(
            9,
            BackendId(7),
            Load {
                requests: 5,
                tokens: 5,
                ..Load::default()
            },
        );
        table.apply_peer_load(
            1,
            BackendId(99),
            Load {
                requests: 5,
                tokens: 5,
                ..Load::default()
            },
        );
        assert_eq!(table.get(BackendId(7)).unwrap().total_load().requests, 2);
    }

    #[test]
    fn states() {
        let mut table = BackendTable::new(1);
        table.upsert(info(1));
        table.set_state_versioned(BackendId(1), BackendState::Draining, 0);
        assert_eq!(
            table.get(BackendId(1)).unwrap().info.state,
            BackendState::Draining
        );
        table.upsert(info(1));
        assert_eq!(
            table.get(BackendId(1)).unwrap().info.state,
            BackendState::Up
        );
        assert!(table.remove(BackendId(1)).is_some());
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn a_sync_heals_dropped_changes_but_not_newer_ones() {
        let mut table = BackendTable::new(1);
        table.upsert(info(1));
        table.upsert(info(2));
        // Missed: backend 2 removed (v3), backend 3 added (v4), backend 1 down (v5).
        let mut down = info(1);
        down.state = BackendState::Down;
        // A newer add already arrived (v7, after the sync was sent at v5).
        assert!(table.upsert_versioned(info(4), 7));
        let (changed, gone) = table.sync(&[down.clone(), info(3)], 5);
        assert_eq!(changed, vec![BackendId(1), BackendId(3)]);
        assert_eq!(gone, vec![BackendId(2)]);
        assert_eq!(
            table.get(BackendId(1)).unwrap().info.state,
            BackendState::Down
        );
        assert!(
            table.get(BackendId(4)).is_some(),
            "newer than the sync: kept"
        );
        assert!(table.get(BackendId(2)).is_none());
        // The same sync again changes nothing.
        assert_eq!(table.sync(&[down, info(3), info(4)], 5), (vec![], vec![]));
    }

    #[test]
    fn older_and_resent_changes_never_undo_newer_ones() {
        let mut table = BackendTable::new(1);
        assert!(table.upsert_versioned(info(1), 5));
        assert!(!table.set_state_versioned(BackendId(1), BackendState::Down, 4));
        assert!(table.set_state_versioned(BackendId(1), BackendState::Draining, 7));
        // The add re-sent after the drain: ignored.
        assert!(!table.upsert_versioned(info(1), 5));
        assert_eq!(
            table.get(BackendId(1)).unwrap().info.state,
            BackendState::Draining
        );
        assert!(table.remove(BackendId(1)).is_some());
        // A re-sent add of a removed backend does not bring it back.
        assert!(!table.upsert_versioned(info(1), 9));
        assert!(table.get(BackendId(1)).is_none());
    }
}
