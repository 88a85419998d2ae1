//! Routing policies by name: round-robin, least-load, prefix.

use std::fmt;
use std::str::FromStr;

use crate::error::ParseNameError;

/// How the router picks a backend (residency is chosen separately, see `ResidencyMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Next eligible backend after the last one chosen, by id, wrapping.
    RoundRobin,
    /// Fewest load tokens.
    LeastLoad,
    /// Lowest expected cost in tokens: uncached prefill of this request plus queued work.
    Prefix,
}

impl Policy {
    const NAMES: &'static str = "round-robin, least-load, prefix";

    /// The name `myelin serve --routing` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::LeastLoad => "least-load",
            Policy::Prefix => "prefix",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

impl FromStr for Policy {
    type Err = ParseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "round-robin" => Ok(Policy::RoundRobin),
            "least-load" => Ok(Policy::LeastLoad),
            "prefix" => Ok(Policy::Prefix),
            _ => Err(ParseNameError {
                kind: "policy",
                given: name.to_owned(),
                expected: Self::NAMES,
            }),
        }
    }
}
