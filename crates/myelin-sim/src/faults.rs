//! Fault injection for one simulated engine: HTTP faults (503s, stalls, streams cut mid-way)
//! counted over generation requests, KV-event faults (dropped batches, publisher restarts), and
//! a missing metrics endpoint.

/// Which faults to inject. Counts are per engine; `None` disables a fault.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultConfig {
    /// Answer every generation request after the first N with `503 Service Unavailable`.
    pub fail_after: Option<u64>,
    /// Accept every generation request after the first N but never answer it.
    pub stall_after: Option<u64>,
    /// Cut the response of every generation request after the first N after its first token
    /// (streaming: the SSE stream breaks without `[DONE]`; otherwise the body breaks).
    pub die_mid_stream_after: Option<u64>,
    /// Do not send every Nth KV event batch on the PUB socket (it stays replayable).
    pub kv_drop_every: Option<u64>,
    /// Restart the KV publisher (seq back to 0, replay buffer emptied) every N batches.
    pub kv_restart_every: Option<u64>,
    /// Serve no Prometheus metrics (`GET /metrics` answers 404), like an engine without a
    /// metrics endpoint (TensorRT-LLM's OpenAI server, Ollama, LM Studio): a router sees
    /// neither its KV capacity nor its utilization and queue.
    pub no_metrics: bool,
}

/// What to do with the `nth` generation request (1-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestFault {
    /// Serve normally.
    None,
    /// Answer 503.
    Fail,
    /// Never answer.
    Stall,
    /// Cut the response after the first token.
    DieMidStream,
}

impl FaultConfig {
    /// The fault for the `nth` generation request (1-based); 503 wins over stall over cut.
    pub fn for_request(&self, nth: u64) -> RequestFault {
        let past = |limit: Option<u64>| limit.is_some_and(|limit| nth > limit);
        if past(self.fail_after) {
            RequestFault::Fail
        } else if past(self.stall_after) {
            RequestFault::Stall
        } else if past(self.die_mid_stream_after) {
            RequestFault::DieMidStream
        } else {
            RequestFault::None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_start_after_the_configured_count() {
        let faults = FaultConfig {
            fail_after: Some(5),
            stall_after: Some(3),
            die_mid_stream_after: Some(1),
            ..FaultConfig::default()
        };
        assert_eq!(faults.for_request(1), RequestFault::None);
        assert_eq!(faults.for_request(2), RequestFault::DieMidStream);
        assert_eq!(faults.for_request(4), RequestFault::Stall);
        assert_eq!(faults.for_request(6), RequestFault::Fail);
        assert_eq!(FaultConfig::default().for_request(1000), RequestFault::None);
    }
}
