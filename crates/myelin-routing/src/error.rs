//! Errors of the routing core.

/// A shard could not be built or was handed data for another configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoutingError {
    #[error("invalid shard configuration: {0}")]
    Config(#[from] myelin_art::ConfigError),
    #[error("block chain hashed with block size {chain}, shard uses {shard}")]
    BlockSizeMismatch { chain: u32, shard: u32 },
}

/// No backend may take a new request: every backend is down or draining (or none is known).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no eligible backend ({draining} draining, {down} down)")]
pub struct NoBackend {
    pub draining: usize,
    pub down: usize,
}

/// A policy or residency mode name that is not recognised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {given:?}; expected one of: {expected}")]
pub struct ParseNameError {
    pub kind: &'static str,
    pub given: String,
    pub expected: &'static str,
}
