//! Residency: how the router discounts a historical match by the chance the backend still holds
//! it. The mode selector, the estimator interface, and the placeholder estimator.

use std::fmt;
use std::str::FromStr;

use crate::backend::BackendView;
use crate::error::ParseNameError;
use crate::shard::BackendMatch;
use myelin_art::MatchSegment;

/// Where resident probabilities come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResidencyMode {
    /// History only: every matched block counts as resident (probability 1).
    Off,
    /// The [`ResidencyEstimator`] for every backend.
    Estimate,
    /// Only the KV-event mirror: 0/1 per block where the backend's mirror is live; a backend
    /// without a live mirror has nothing verified, so nothing counts as cached on it.
    Verified,
    /// Verified where the backend's mirror is live, the estimator elsewhere (the default).
    Auto,
}

impl ResidencyMode {
    const NAMES: &'static str = "off, estimate, verified, auto";
}

impl fmt::Display for ResidencyMode {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            ResidencyMode::Off => "off",
            ResidencyMode::Estimate => "estimate",
            ResidencyMode::Verified => "verified",
            ResidencyMode::Auto => "auto",
        })
    }
}

impl FromStr for ResidencyMode {
    type Err = ParseNameError;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "off" => Ok(ResidencyMode::Off),
            "estimate" => Ok(ResidencyMode::Estimate),
            "verified" => Ok(ResidencyMode::Verified),
            "auto" => Ok(ResidencyMode::Auto),
            _ => Err(ParseNameError {
                kind: "residency mode",
                given: name.to_owned(),
                expected: Self::NAMES,
            }),
        }
    }
}

/// Everything an estimator may use for one backend's matched blocks.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct EstimateInput<'a> {
    /// The backend as the deciding core sees it.
    pub view: &'a BackendView,
    /// Its historical match (from the deciding core's replica).
    pub matched: &'a BackendMatch,
    /// Use records of its matched blocks (filter by `matched.backend`), shallow first.
    pub segments: &'a [MatchSegment],
    /// When the replica answered the lookup (caller's ms clock).
    pub now_ms: u64,
}

/// Probability that a backend still holds each block it was historically routed.
pub trait ResidencyEstimator {
    /// Writes `input.matched.matched_blocks` probabilities (block 0 first) into `probabilities`
    /// (cleared by the caller). Values outside 0..=1 are clamped, NaN counts as 0.
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>);
}

/// PLACEHOLDER estimator: says every historically matched block is still resident (1.0).
///
/// Stands in until the residency-estimate issue lands the real model (cache utilization and
/// blocks admitted since last use). With it, `estimate` behaves like `off`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlaceholderEstimator;

impl ResidencyEstimator for PlaceholderEstimator {
    fn block_probabilities(&self, input: EstimateInput<'_>, probabilities: &mut Vec<f64>) {
        probabilities.resize(input.matched.matched_blocks as usize, 1.0);
    }
}

/// Expected cached tokens of a prefix: Σ_i block_size · Π_{j≤i} p_j (block i is only usable
/// if every block before it is resident too: engines match prefixes, not sets of blocks).
pub fn expected_cached_tokens(block_size: u32, probabilities: &[f64]) -> f64 {
    let mut all_resident_so_far = 1.0f64;
    let mut expected = 0.0f64;
    for &probability in probabilities {
        let probability = if probability.is_nan() {
            0.0
        } else {
            probability.clamp(0.0, 1.0)
        };
        all_resident_so_far *= probability;
        if all_resident_so_far == 0.0 {
            break;
        }
        expected += f64::from(block_size) * all_resident_so_far;
    }
    expected
}
