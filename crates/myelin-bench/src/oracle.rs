//! The oracle's routing rule: send each request where its true cost is lowest, reading the
//! simulator's actual cache contents and queues. Pure; the probe itself is behind a trait.

/// What an engine truly holds and owes at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineTruth {
    /// Leading prompt tokens whose KV blocks the engine holds right now.
    pub cached_tokens: u64,
    /// Tokens of work waiting or running on the engine (prefill still to do plus decode).
    pub queued_tokens: u64,
}

/// Reads the simulated engines' true state. Implemented over the embedded simulator.
pub trait CacheOracle: Send + Sync {
    /// The truth for each engine, in engine order, for a prompt.
    fn probe(&self, prompt_tokens: &[u32]) -> Vec<EngineTruth>;
}

/// The engine with the lowest expected cost in tokens: uncached prefill plus queued work (the
/// same cost model the router scores with, fed the truth instead of estimates). Ties go to the
/// engine with fewer requests in flight from the harness (requests sent that the engine may
/// not have seen yet), then to the lower index. `None` when there are no engines.
pub fn choose_engine(
    prompt_len: usize,
    truths: &[EngineTruth],
    harness_in_flight: &[u32],
) -> Option<usize> {
    truths
        .iter()
        .enumerate()
        .min_by_key(|(engine, truth)| {
            let uncached = (prompt_len as u64).saturating_sub(truth.cached_tokens);
            let in_flight = harness_in_flight.get(*engine).copied().unwrap_or(0);
            (uncached + truth.queued_tokens, in_flight, *engine)
        })
        .map(|(engine, _)| engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn truth(cached_tokens: u64, queued_tokens: u64) -> EngineTruth {
        EngineTruth {
            cached_tokens,
            queued_tokens,
        }
    }

    #[test]
    fn prefers_the_cached_engine_unless_its_queue_costs_more() {
        let truths = [truth(0, 0), truth(4000, 1000), truth(0, 100)];
        assert_eq!(choose_engine(5000, &truths, &[0, 0, 0]), Some(1));
        let busy = [truth(0, 0), truth(4000, 9000)];
        assert_eq!(choose_engine(5000, &busy, &[0, 0]), Some(0));
    }

    #[test]
    fn ties_spread_by_harness_in_flight_then_index() {
        let empty = [truth(0, 0); 3];
        assert_eq!(choose_engine(100, &empty, &[1, 0, 0]), Some(1));
        assert_eq!(choose_engine(100, &empty, &[0, 0, 0]), Some(0));
        assert_eq!(choose_engine(100, &[], &[]), None);
    }
}
