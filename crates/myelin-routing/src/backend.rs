//! What the router knows about each backend at decision time: health and load.

pub use myelin_art::BackendId;

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
}

impl BackendView {
    /// A view; fields may be added later (residency-estimator inputs), so build it with this.
    pub fn new(id: BackendId, state: BackendState, load_tokens: u64) -> Self {
        Self {
            id,
            state,
            load_tokens,
        }
    }
}
