//! The oracle: the router's own decision code (`myelin_routing::Router`, prefix policy, its
//! default cost: the predicted time to first token) fed the truth instead of what a router can
//! know: every engine's actual cache contents as its verified mirror, and every engine's actual
//! queue and KV memory, plus, as a router counts its own requests at once, what the oracle sent
//! that the engine has not received yet. Pure; the probe of the simulator is behind a trait.

use std::collections::VecDeque;

use myelin_routing::{
    BackendId, BackendMatch, BackendState, BackendView, EngineQueue, EngineTiming, KvMemory,
    MemoryPressure, Policy, PrefixMatch, ResidencyMode, Router, RouterConfig, prefill_pairs,
};

/// What an engine truly holds and owes at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineTruth {
    /// Leading prompt tokens whose full KV blocks the engine holds right now.
    pub cached_tokens: u64,
    /// Tokens of work waiting or running on the engine: prefill still to do (net of what its
    /// cache serves) plus output still to generate.
    pub queued_tokens: u64,
    /// Requests the engine has accepted since it started (`None`: unknown, so requests in
    /// transit are not counted).
    pub requests_received: Option<u64>,
    /// The engine's true KV utilization and queue (`None`: unknown); the calibration's
    /// predictors read the utilization.
    pub memory: Option<MemoryPressure>,
    /// The engine's true queue and KV memory as the predicted time to first token reads them
    /// (`None`: unknown, the default queue of an idle engine).
    pub queue: Option<EngineQueue>,
    /// Tokens per scheduler step (`None`: the default timing's).
    pub step_tokens: Option<u32>,
}

/// Reads the simulated engines' true state. Implemented over the embedded simulator.
pub trait CacheOracle: Send + Sync {
    /// The truth for each engine, in engine order, for a prompt.
    fn probe(&self, prompt_tokens: &[u32]) -> Vec<EngineTruth>;
}

/// Requests in transit counted per engine at most (more would be a stalled engine).
const MAX_IN_TRANSIT: usize = 256;

/// The router's decision with true inputs. Holds the router's tie-break cursor (ties go to the
/// first tied engine after the last one chosen, as in `myelin serve`) and what it sent each
/// engine, so keep one per leg and cluster.
pub struct Oracle {
    router: Router,
    block_size: u32,
    /// Per engine: requests sent, and the most recent ones, newest last.
    sent: Vec<(u64, VecDeque<Sent>)>,
    /// The predicted time to first token of the last choice, simulated seconds.
    last_predicted_ttft_s: Option<f64>,
}

/// A request the oracle sent, as an engine that has not received it yet will queue it.
#[derive(Debug, Clone, Copy, Default)]
struct Sent {
    /// Uncached prompt tokens (prefill to do).
    uncached: u64,
    /// Prompt tokens (KV memory it will hold).
    prompt: u64,
    /// Uncached prompt plus output tokens (the load).
    load: u64,
}

impl Oracle {
    /// The router as `myelin serve --routing prefix` runs it by default (the cost in seconds,
    /// the predicted time to first token at the default timing, which is the simulated
    /// profile's), reading residency from a mirror that is always exact and the queues and KV
    /// memory from the engines themselves. `block_size`: the engines' KV block size in tokens.
    /// One difference: the extra-prefill charge is always in full (ramp 0), because the oracle
    /// has no routing history whose evictions could scale it (its matches are the truth).
    pub fn new(block_size: u32) -> Self {
        Self {
            router: Router::new(
                Policy::Prefix,
                ResidencyMode::Verified,
                RouterConfig {
                    extra_prefill_ramp_percent: 0,
                    ..RouterConfig::default()
                },
            ),
            block_size: block_size.max(1),
            sent: Vec::new(),
            last_predicted_ttft_s: None,
        }
    }

    /// The predicted time to first token of the last [`Self::choose`], in the timing's
    /// (simulated) seconds.
    pub fn last_predicted_ttft_s(&self) -> Option<f64> {
        self.last_predicted_ttft_s
    }

    /// Requests sent to `engine` that it has not received yet (at most the recent ones kept).
    fn in_transit(&self, engine: usize, received: Option<u64>) -> usize {
        let (Some(received), Some((sent, recent))) = (received, self.sent.get(engine)) else {
            return 0;
        };
        (sent.saturating_sub(received) as usize).min(recent.len())
    }

    /// The requests sent to `engine` that it has not received yet: the newest
    /// `sent - received` of them.
    fn in_transit_requests(
        &self,
        engine: usize,
        received: Option<u64>,
    ) -> impl Iterator<Item = &Sent> + '_ {
        let in_transit = self.in_transit(engine, received);
        self.sent
            .get(engine)
            .into_iter()
            .flat_map(move |(_, recent)| recent.iter().rev().take(in_transit))
    }

    /// The engine the router picks for a prompt of `prompt_len` tokens asking for
    /// `output_tokens`, when every engine's verified resident blocks are its true cached blocks
    /// and its queue and KV memory are its true ones plus what this oracle sent it that it has
    /// not received yet: the lowest predicted time to first token. Records the request as sent
    /// to the chosen engine. `None` when there are no engines.
    pub fn choose(
        &mut self,
        prompt_len: usize,
        output_tokens: u32,
        truths: &[EngineTruth],
    ) -> Option<usize> {
        let block_size = u64::from(self.block_size);
        let backends = truths
            .iter()
            .enumerate()
            .map(|(engine, truth)| {
                let blocks = u32::try_from(truth.cached_tokens / block_size).unwrap_or(u32::MAX);
                BackendMatch {
                    backend: BackendId(engine as u32),
                    matched_blocks: blocks,
                    last_routed_ms: 0,
                    residency_stamp: 0,
                    verified_resident_blocks: Some(blocks),
                    verified_partial: false,
                }
            })
            .collect();
        let matched = PrefixMatch {
            block_size: self.block_size,
            prompt_blocks: u32::try_from(prompt_len as u64 / block_size).unwrap_or(u32::MAX),
            looked_up_at_ms: 0,
            backends,
            segments: Vec::new(),
        };
        let views: Vec<BackendView> = truths
            .iter()
            .enumerate()
            .map(|(engine, truth)| {
                let in_transit = self.in_transit(engine, truth.requests_received) as u32;
                let transit = self
                    .in_transit_requests(engine, truth.requests_received)
                    .fold(Sent::default(), |sum, sent| Sent {
                        uncached: sum.uncached + sent.uncached,
                        prompt: sum.prompt + sent.prompt,
                        load: sum.load + sent.load,
                    });
                let transit_pairs: f64 = self
                    .in_transit_requests(engine, truth.requests_received)
                    .map(|sent| prefill_pairs(sent.prompt, sent.uncached as f64))
                    .sum();
                // Requests in transit join the queue: their prefill ahead, their prompts in
                // KV memory.
                let queue = truth.queue.map(|queue| EngineQueue {
                    prefill_tokens_ahead: queue.prefill_tokens_ahead + transit.uncached,
                    prefill_pairs_ahead: queue.prefill_pairs_ahead + transit_pairs,
                    requests: queue.requests + in_transit,
                    memory: queue.memory.map(|memory| KvMemory {
                        held_tokens: memory.held_tokens + transit.prompt as f64,
                        ..memory
                    }),
                    ..queue
                });
                let timing = EngineTiming {
                    step_tokens: truth
                        .step_tokens
                        .unwrap_or(EngineTiming::default().step_tokens),
                    ..EngineTiming::default()
                };
                BackendView::new(
                    BackendId(engine as u32),
                    BackendState::Up,
                    truth.queued_tokens + transit.load,
                )
                .with_ttft(timing, queue.unwrap_or_default())
            })
            .collect();
        let decision = self
            .router
            .decide(prompt_len as u64, &matched, &views)
            .ok()?;
        let engine = decision.backend.0 as usize;
        self.last_predicted_ttft_s = Some(decision.predicted_ttft.seconds);
        if self.sent.len() < truths.len() {
            self.sent.resize_with(truths.len(), Default::default);
        }
        let (sent, recent) = &mut self.sent[engine];
        *sent += 1;
        let uncached = (prompt_len as f64 - decision.expected_cached_tokens).max(0.0) as u64;
        recent.push_back(Sent {
            uncached,
            prompt: prompt_len as u64,
            load: uncached + u64::from(output_tokens),
        });
        if recent.len() > MAX_IN_TRANSIT {
            recent.pop_front();
        }
        Some(engine)
    }
}

#[cfg(test)]
mod tests {
    use myelin_routing::{DEFAULT_ENGINE_TIMING, predict_ttft};

    use super::*;

    /// An engine holding `cached_tokens` of the prompt with `prefill_ahead` tokens queued.
    fn truth(cached_tokens: u64, prefill_ahead: u64) -> EngineTruth {
        EngineTruth {
            cached_tokens,
            queued_tokens: prefill_ahead,
            queue: Some(EngineQueue {
                prefill_tokens_ahead: prefill_ahead,
                requests: u32::from(prefill_ahead > 0),
                mean_remaining_output_tokens: 200.0,
                ..EngineQueue::default()
            }),
            ..EngineTruth::default()
        }
    }

    #[test]
    fn prefers_the_cached_engine_unless_its_queue_costs_more() {
        let mut oracle = Oracle::new(16);
        // 4,000 cached of 5,000 behind 1,000 queued: 2,000 tokens to prefill against 5,000.
        let truths = [truth(0, 0), truth(4000, 1000), truth(0, 100)];
        assert_eq!(oracle.choose(5000, 10, &truths), Some(1));
        let seconds = oracle.last_predicted_ttft_s().unwrap();
        let expected = predict_ttft(
            &DEFAULT_ENGINE_TIMING,
            &truths[1].queue.unwrap(),
            5000,
            1000.0,
        );
        assert!((seconds - expected.seconds).abs() < 1e-12);
        // 7,000 queued ahead cost more than prefilling the whole prompt elsewhere, but not
        // more than that plus the charge for prefilling the 4,000 cached tokens again (the
        // router's default); 9,000 do.
        let busy = [truth(0, 0), truth(4000, 7000)];
        assert_eq!(oracle.choose(5000, 10, &busy), Some(1));
        let busier = [truth(0, 0), truth(4000, 9000)];
        assert_eq!(oracle.choose(5000, 10, &busier), Some(0));
    }

    #[test]
    fn cached_tokens_count_in_whole_blocks() {
        let mut oracle = Oracle::new(16);
        // 31 cached tokens are one whole block (16): the same as 16, a tie broken by rotation.
        let first = oracle.choose(64, 1, &[truth(31, 0), truth(16, 0)]);
        let second = oracle.choose(64, 1, &[truth(31, 0), truth(16, 0)]);
        assert_ne!(first, second, "ties rotate as in the router");
        assert_eq!(oracle.choose(64, 1, &[truth(31, 0), truth(32, 0)]), Some(1));
    }

    #[test]
    fn ties_rotate_and_no_engines_is_none() {
        let mut oracle = Oracle::new(16);
        let empty = [truth(0, 0); 3];
        let picks: Vec<Option<usize>> = (0..4).map(|_| oracle.choose(100, 1, &empty)).collect();
        assert_eq!(picks, [Some(0), Some(1), Some(2), Some(0)]);
        assert_eq!(oracle.choose(100, 1, &[]), None);
    }

    #[test]
    fn requests_sent_but_not_yet_received_queue_their_prefill() {
        let received = |count: u64, cached_tokens: u64| EngineTruth {
            requests_received: Some(count),
            ..truth(cached_tokens, 0)
        };
        let mut oracle = Oracle::new(16);
        // A burst of requests for a prefix engine 0 holds (4,000 of 4,100 tokens): the
        // engines have received none of them yet. Each one in transit to engine 0 queues its
        // 100 uncached tokens there; once that prefill ahead costs more than prefilling all
        // 4,100 on engine 1 plus the charge for the 4,000 prefilled again, the next goes there.
        let mut picks = Vec::new();
        for _ in 0..120 {
            picks.push(
                oracle
                    .choose(4100, 400, &[received(0, 4000), received(0, 0)])
                    .unwrap(),
            );
        }
        assert_eq!(picks[0], 0);
        let first_elsewhere = picks.iter().position(|&engine| engine == 1).unwrap();
        let cold = predict_ttft(
            &DEFAULT_ENGINE_TIMING,
            &EngineQueue::default(),
            4100,
            4100.0,
        );
        let behind = |in_transit: u64| {
            predict_ttft(
                &DEFAULT_ENGINE_TIMING,
                &EngineQueue {
                    prefill_tokens_ahead: in_transit * 100,
                    prefill_pairs_ahead: in_transit as f64 * prefill_pairs(4100, 100.0),
                    requests: in_transit as u32,
                    ..EngineQueue::default()
                },
                4100,
                100.0,
            )
            .seconds
        };
        // At equal predictions engine 0, which holds the prompt, keeps it (the tie rule).
        let charge = DEFAULT_ENGINE_TIMING.prefill_seconds(4100, 4100.0)
            - DEFAULT_ENGINE_TIMING.prefill_seconds(4100, 100.0);
        let crossing = (0..120)
            .find(|&n| behind(n) > cold.seconds + charge)
            .unwrap();
        assert_eq!(first_elsewhere as u64, crossing, "{picks:?}");
        // Once engine 0 has received them, their queue is its true queue's business: with an
        // empty queue reported, engine 0 wins again.
        assert_eq!(
            oracle.choose(4100, 400, &[received(60, 4000), received(1, 0)]),
            Some(0)
        );
    }

    #[test]
    fn a_cache_hit_that_cannot_fit_in_kv_memory_goes_elsewhere_as_in_the_router() {
        let holder = |held_tokens: f64, requests_received| EngineTruth {
            cached_tokens: 6000,
            requests_received,
            queue: Some(EngineQueue {
                requests: 4,
                decoding: 4,
                mean_remaining_output_tokens: 200.0,
                memory: Some(KvMemory {
                    capacity_tokens: 32_768,
                    held_tokens,
                    shared_tokens: 0,
                    growth_tokens: 0.0,
                }),
                ..EngineQueue::default()
            }),
            ..EngineTruth::default()
        };
        let mut oracle = Oracle::new(16);
        // Room on the engine that holds 6,000 of 6,100 tokens (its cached blocks free): it wins.
        assert_eq!(
            oracle.choose(6100, 400, &[holder(20_000.0, None), truth(0, 0)]),
            Some(0)
        );
        // Four running requests hold 30,000 tokens: the prompt waits for one to finish there,
        // longer than prefilling it on the idle engine.
        assert_eq!(
            oracle.choose(6100, 400, &[holder(30_000.0, None), truth(0, 0)]),
            Some(1)
        );
        // Requests the oracle sent that the engine has not received yet hold memory too.
        // 24,000 held: the first request fits (30,100), the second, with the first still in
        // transit, would not (36,200).
        let mut oracle = Oracle::new(16);
        assert_eq!(
            oracle.choose(6100, 400, &[holder(24_000.0, Some(0)), truth(0, 0)]),
            Some(0)
        );
        assert_eq!(
            oracle.choose(6100, 400, &[holder(24_000.0, Some(0)), truth(0, 0)]),
            Some(1)
        );
    }
}
