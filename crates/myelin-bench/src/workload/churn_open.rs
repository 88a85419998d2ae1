//! Open-loop churn: the churn workload's rotating prefix population, with requests arriving as
//! a Poisson process instead of from closed-loop users. Request `i` is a pure function of the
//! seed, `i` and the rate: its send time is the sum of the first `i` exponential gaps (each
//! drawn from `(seed, gap index)`), its prefix a uniform draw from the active set at that time,
//! its suffix drawn from `(seed, i)`, its output the workload's `output_tokens`. The rate is
//! the same on every leg (fixed before the first leg), so every leg and every repeat sends the
//! identical requests at the identical times.

use super::churn::ChurnWorkload;
use super::config::{WorkloadConfig, WorkloadError};
use super::{PlannedRequest, TokenAlphabet};
use crate::rng::{self, stream};

/// Keys of open-loop requests: above every closed-loop `(user << 40) | seq`.
pub(crate) const OPEN_KEY: u64 = 1 << 63;

/// An open-loop Poisson schedule at the config's resolved rate: what every Poisson workload
/// (churn-open, shared-prefix-open, multi-turn) sends when.
#[derive(Debug, Clone)]
pub struct OpenSchedule {
    rate_rps: f64,
    /// The capacity the rate is a fraction of, when known.
    capacity_rps: Option<f64>,
    /// Send time of every request, simulated seconds, ascending.
    send_at_s: Vec<f64>,
}

impl OpenSchedule {
    /// The schedule over `duration_s` at the config's resolved `rate_rps` (see
    /// `crate::capacity::resolve_rate`).
    pub fn new(config: &WorkloadConfig) -> Result<Self, WorkloadError> {
        let rate_rps = config
            .open_loop
            .as_ref()
            .and_then(|open| open.rate_rps)
            .ok_or_else(|| WorkloadError::Invalid {
                name: config.name.clone(),
                problem: "open_loop: the rate is not resolved (no rate_rps, capacity not measured)"
                    .into(),
            })?;
        Ok(Self {
            rate_rps,
            capacity_rps: config.open_loop.as_ref().and_then(|open| open.capacity_rps),
            send_at_s: poisson_schedule(config.seed, rate_rps, config.duration_s),
        })
    }

    /// Requests per simulated second.
    pub fn rate_rps(&self) -> f64 {
        self.rate_rps
    }

    /// The cluster capacity the rate was set from (`None`: the rate was given).
    pub fn capacity_rps(&self) -> Option<f64> {
        self.capacity_rps
    }

    /// Requests in the schedule.
    pub fn len(&self) -> usize {
        self.send_at_s.len()
    }

    /// Whether the schedule is empty (a rate too low for the duration).
    pub fn is_empty(&self) -> bool {
        self.send_at_s.is_empty()
    }

    /// When request `index` is sent, simulated seconds into the leg.
    pub fn send_at_s(&self, index: usize) -> f64 {
        self.send_at_s[index]
    }
}

/// The open-loop churn generator.
#[derive(Debug)]
pub struct ChurnOpenWorkload {
    churn: ChurnWorkload,
    schedule: OpenSchedule,
}

impl ChurnOpenWorkload {
    /// The schedule over `duration_s` at the config's resolved `rate_rps` (see
    /// `crate::capacity::resolve_rate`).
    pub fn new(config: &WorkloadConfig, alphabet: TokenAlphabet) -> Result<Self, WorkloadError> {
        Ok(Self {
            schedule: OpenSchedule::new(config)?,
            churn: ChurnWorkload::new(config, alphabet),
        })
    }

    /// The Poisson schedule.
    pub fn schedule(&self) -> &OpenSchedule {
        &self.schedule
    }

    /// Requests per simulated second.
    pub fn rate_rps(&self) -> f64 {
        self.schedule.rate_rps()
    }

    /// The cluster capacity the rate was set from (`None`: the rate was given).
    pub fn capacity_rps(&self) -> Option<f64> {
        self.schedule.capacity_rps()
    }

    /// Requests in the schedule.
    pub fn len(&self) -> usize {
        self.schedule.len()
    }

    /// Whether the schedule is empty (a rate too low for the duration).
    pub fn is_empty(&self) -> bool {
        self.schedule.is_empty()
    }

    /// When request `index` is sent, simulated seconds into the leg.
    pub fn send_at_s(&self, index: usize) -> f64 {
        self.schedule.send_at_s(index)
    }

    /// Request `index`.
    pub fn request(&self, index: usize) -> PlannedRequest {
        self.churn
            .keyed_request(OPEN_KEY | index as u64, self.send_at_s(index))
    }

    /// The prefix population and rotation.
    pub fn churn(&self) -> &ChurnWorkload {
        &self.churn
    }
}

/// Send times of a Poisson process of `rate_rps` over `[0, duration_s)`: gap `k` is
/// `-ln(1 - u_k) / rate` with `u_k` uniform in `[0, 1)` drawn from `(seed, k)`.
pub fn poisson_schedule(seed: u64, rate_rps: f64, duration_s: f64) -> Vec<f64> {
    let mut times = Vec::new();
    let mut now = 0.0;
    for gap in 0u64.. {
        let uniform =
            (rng::draw(seed, stream::ARRIVAL_GAP, gap) >> 11) as f64 / (1u64 << 53) as f64;
        now += -(1.0 - uniform).ln() / rate_rps;
        if now >= duration_s || times.len() >= MAX_REQUESTS {
            break;
        }
        times.push(now);
    }
    times
}

/// Most requests one schedule holds (a rate typo should not exhaust memory).
const MAX_REQUESTS: usize = 10_000_000;

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(rate_rps: f64) -> ChurnOpenWorkload {
        let mut config = WorkloadConfig::load("churn-open").unwrap();
        config.open_loop.as_mut().unwrap().rate_rps = Some(rate_rps);
        ChurnOpenWorkload::new(&config, TokenAlphabet::token_ids()).unwrap()
    }

    #[test]
    fn the_schedule_is_a_poisson_process_at_the_rate() {
        let open = workload(5.0);
        // 600 s at 5 req/s: 3,000 expected, Poisson spread sqrt(3000) ~ 55.
        assert!((2800..3200).contains(&open.len()), "{}", open.len());
        assert!((1..open.len()).all(|index| open.send_at_s(index) > open.send_at_s(index - 1)));
        assert!(open.send_at_s(open.len() - 1) < 600.0);
        let gaps: Vec<f64> = (1..open.len())
            .map(|index| open.send_at_s(index) - open.send_at_s(index - 1))
            .collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        assert!((0.18..0.22).contains(&mean), "mean gap {mean}");
        // Exponential gaps: about 1/e of them longer than the mean.
        let long = gaps.iter().filter(|gap| **gap > 0.2).count() as f64 / gaps.len() as f64;
        assert!((0.32..0.42).contains(&long), "{long}");
    }

    #[test]
    fn every_request_is_the_same_whoever_builds_it() {
        // Two builds stand for two legs: same send times, prefixes, suffixes, outputs.
        let (one, other) = (workload(5.0), workload(5.0));
        assert_eq!(one.len(), other.len());
        for index in [0, 1, 17, 999, one.len() - 1] {
            assert_eq!(
                one.send_at_s(index).to_bits(),
                other.send_at_s(index).to_bits()
            );
            assert_eq!(one.request(index), other.request(index));
        }
        // A request's prefix is drawn from the active set at its own send time.
        for index in [0, 500, 2000] {
            let request = one.request(index);
            let active = one.churn().active_set(one.send_at_s(index));
            assert!(active.contains(&(request.label as u32)));
            assert_eq!(request.output_tokens, 400);
        }
        // Requests differ from one another (unique suffixes).
        assert_ne!(one.request(3).tokens, one.request(4).tokens);
        // The seed changes everything.
        let mut config = WorkloadConfig::load("churn-open").unwrap();
        config.seed = 43;
        config.open_loop.as_mut().unwrap().rate_rps = Some(5.0);
        let reseeded = ChurnOpenWorkload::new(&config, TokenAlphabet::token_ids()).unwrap();
        assert_ne!(reseeded.send_at_s(0), one.send_at_s(0));
    }

    #[test]
    fn an_unresolved_rate_is_an_error() {
        let config = WorkloadConfig::load("churn-open").unwrap();
        assert!(config.open_loop.as_ref().unwrap().rate_rps.is_none());
        assert!(ChurnOpenWorkload::new(&config, TokenAlphabet::token_ids()).is_err());
    }
}
