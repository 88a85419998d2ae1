//! Errors of the prefix tree's public API.

/// A [`crate::TreeConfig`] that cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("block size must be at least one token")]
    ZeroBlockSize,
}
