//! What the router knows about each backend at decision time: health and load.

pub use myelin_art::BackendId;

use crate::ttft::{EngineQueue, EngineTiming};

/// Health of a backend, as the control core's health checks see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BackendState {
    /// Takes new requests.
    Up,
    /// Finishes what it has, takes nothing new (being removed or restarted). Like production
    /// load balancers (Envoy, pingora), no policy sends it new work, even when nothing else is up.
    Draining,
    /// Unreachable or failing: never routed to.
    Down,
}

impl BackendState {
    /// Its name in the admin API and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Up => "up",
            BackendState::Draining => "draining",
            BackendState::Down => "down",
        }
    }

    /// Whether a new request may go to a backend in this state.
    pub fn accepts_new_requests(self) -> bool {
        matches!(self, BackendState::Up)
    }
}

/// One backend as seen by the deciding core.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct BackendView {
    pub id: BackendId,
    pub state: BackendState,
    /// Work waiting on the backend, in tokens: queued prefill plus active decode.
    pub load_tokens: u64,
    /// KV-cache capacity in tokens the residency estimator works with (the engine's, scraped
    /// or configured, times the online correction), `None` when unknown.
    pub capacity_tokens: Option<u64>,
    /// Monotonic count of tokens admitted to the backend (uncached prompt + expected output,
    /// as routers sent them, summed over every core): the residency stamps' clock.
    pub admitted_tokens: u64,
    /// Uses stamped below this were seen evicted (an engine reported reusing less than the
    /// history predicted): under LRU, everything older is gone too. 0: nothing known.
    pub evicted_below_stamp: u64,
    /// The engine's KV memory and admission queue, `None` when unknown (an engine without a
    /// metrics endpoint, or figures too old to trust).
    pub memory: Option<MemoryPressure>,
    /// How the engine's steps take time (fitted from its first tokens, or the default).
    pub timing: EngineTiming,
    /// What is in front of a new request there: the predicted-TTFT cost's inputs.
    pub queue: EngineQueue,
    /// When the oldest request in flight there without its first token was sent (routing
    /// clock, ms), `None` when none is: the engine serves its queue first come, first served,
    /// so a route taken since is still being prefilled (or waits to be), and its blocks are on
    /// their way into the cache ([`crate::RouterConfig::pending_resident_ms`]).
    pub prefilling_since_ms: Option<u64>,
}

/// What an engine's KV memory and scheduler say: the inputs of the expected admission wait
/// (see [`crate::Router::decide`]). From the engine's own gauges (vLLM:
/// `kv_cache_usage_perc`, `num_requests_running`, `num_requests_waiting`) plus what routers
/// sent it since they were read, or from the simulator's truth in the harness's oracle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryPressure {
    /// Fraction of the KV blocks held by requests (running or being admitted), 0..1. Free
    /// cached blocks do not count: they are evicted on demand.
    pub utilization: f64,
    /// Requests waiting for admission.
    pub waiting_requests: u32,
    /// Requests running (their blocks are freed as they finish).
    pub running_requests: u32,
    /// Output tokens a running request still has to generate, on average.
    pub mean_remaining_output_tokens: f64,
}

impl BackendView {
    /// A view; fields may be added later (residency-estimator inputs), so build it with this.
    pub fn new(id: BackendId, state: BackendState, load_tokens: u64) -> Self {
        Self {
            id,
            state,
            load_tokens,
            capacity_tokens: None,
            admitted_tokens: 0,
            evicted_below_stamp: 0,
            memory: None,
            timing: EngineTiming::default(),
            queue: EngineQueue::default(),
            prefilling_since_ms: None,
        }
    }

    /// When the oldest request without its first token there was sent (see the field).
    pub fn with_prefilling_since(mut self, since_ms: Option<u64>) -> Self {
        self.prefilling_since_ms = since_ms;
        self
    }

    /// The predicted-TTFT cost's inputs: the engine's timing and what is in front of a new
    /// request there (see [`crate::predict_ttft`]).
    pub fn with_ttft(mut self, timing: EngineTiming, queue: EngineQueue) -> Self {
        self.timing = timing;
        self.queue = queue;
        self
    }

    /// The engine's KV memory and admission queue (see [`MemoryPressure`]).
    pub fn with_memory(mut self, memory: Option<MemoryPressure>) -> Self {
        self.memory = memory;
        self
    }

    /// The residency estimator's inputs (see the fields).
    pub fn with_cache(
        mut self,
        capacity_tokens: Option<u64>,
        admitted_tokens: u64,
        evicted_below_stamp: u64,
    ) -> Self {
        self.capacity_tokens = capacity_tokens;
        self.admitted_tokens = admitted_tokens;
        self.evicted_below_stamp = evicted_below_stamp;
        self
    }
}
