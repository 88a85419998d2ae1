//! Backend health as a pure state machine: active checks with thresholds, a passive circuit
//! breaker on consecutive request failures, and half-open probing. The control core feeds it
//! check results, request outcomes and time; it never does I/O.
//!
//! The half-open probe is a health check, which an engine that accepts requests and never
//! answers them still passes. So a breaker closed by a probe is on probation: the first real
//! request decides. A failure re-opens it at once for twice the previous open period (up to
//! [`MAX_OPEN_FACTOR`] times `--breaker-open-ms`); a success ends the probation and resets the
//! period. Such an engine spends almost all its time open, and costs one request per period.
//! A failed probe re-opens it for the base period (the engine is down, and should be back
//! soon after it restarts).

use std::time::{Duration, Instant};

use crate::config::HealthConfig;

/// The longest open period, as a multiple of `--breaker-open-ms`.
pub const MAX_OPEN_FACTOR: u32 = 16;

/// The circuit breaker of one backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breaker {
    /// Requests flow.
    Closed,
    /// Too many consecutive failures: no requests until `until`.
    Open { until: Instant },
    /// The open period ended: one probe (an active check) decides between closed and open.
    HalfOpen,
}

impl Breaker {
    pub fn as_str(self) -> &'static str {
        match self {
            Breaker::Closed => "closed",
            Breaker::Open { .. } => "open",
            Breaker::HalfOpen => "half_open",
        }
    }
}

/// A change worth a metric and a broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthEvent {
    /// The breaker moved (`from` -> `to`, as [`Breaker::as_str`] names).
    BreakerTransition {
        from: &'static str,
        to: &'static str,
    },
    /// Active checks changed their verdict.
    CheckVerdict { up: bool },
}

/// Health of one backend.
#[derive(Debug, Clone)]
pub struct BackendHealth {
    checks_say_up: bool,
    consecutive_check_successes: u32,
    consecutive_check_failures: u32,
    consecutive_request_failures: u32,
    breaker: Breaker,
    /// Closed by a probe and no request succeeded since: one failure re-opens.
    probation: bool,
    /// Open periods in a row without a request succeeding in between (0: none).
    reopenings: u32,
}

impl Default for BackendHealth {
    fn default() -> Self {
        Self::new()
    }
}

impl BackendHealth {
    /// A new backend is presumed up until checks or requests say otherwise, so a router
    /// started next to its engines serves at once.
    pub fn new() -> Self {
        BackendHealth {
            checks_say_up: true,
            consecutive_check_successes: 0,
            consecutive_check_failures: 0,
            consecutive_request_failures: 0,
            breaker: Breaker::Closed,
            probation: false,
            reopenings: 0,
        }
    }

    /// Opens the breaker for the current period: `--breaker-open-ms`, doubled for every
    /// re-opening without a successful request in between.
    fn open(&mut self, now: Instant, config: &HealthConfig, events: &mut Vec<HealthEvent>) {
        let factor = 1u32 << self.reopenings.min(MAX_OPEN_FACTOR.trailing_zeros());
        self.reopenings = self.reopenings.saturating_add(1);
        self.probation = false;
        self.transition(
            Breaker::Open {
                until: now + config.breaker_open.saturating_mul(factor),
            },
            events,
        );
    }

    /// May requests be sent to this backend?
    pub fn is_routable(&self) -> bool {
        self.checks_say_up && self.breaker == Breaker::Closed
    }

    pub fn breaker(&self) -> Breaker {
        self.breaker
    }

    pub fn checks_say_up(&self) -> bool {
        self.checks_say_up
    }

    /// Records an active health check result.
    pub fn on_check(
        &mut self,
        success: bool,
        now: Instant,
        config: &HealthConfig,
        events: &mut Vec<HealthEvent>,
    ) {
        if success {
            self.consecutive_check_failures = 0;
            self.consecutive_check_successes = self.consecutive_check_successes.saturating_add(1);
            if !self.checks_say_up && self.consecutive_check_successes >= config.healthy_threshold {
                self.checks_say_up = true;
                events.push(HealthEvent::CheckVerdict { up: true });
            }
        } else {
            self.consecutive_check_successes = 0;
            self.consecutive_check_failures = self.consecutive_check_failures.saturating_add(1);
            if self.checks_say_up && self.consecutive_check_failures >= config.unhealthy_threshold {
                self.checks_say_up = false;
                events.push(HealthEvent::CheckVerdict { up: false });
            }
        }
        // The half-open probe is the next active check.
        if self.breaker == Breaker::HalfOpen {
            if success {
                self.consecutive_request_failures = 0;
                self.probation = true;
                self.transition(Breaker::Closed, events);
            } else {
                // A failed probe means the engine is down, not hung: the base period, so it
                // is back soon after it restarts.
                self.reopenings = 0;
                self.open(now, config, events);
            }
        }
    }

    /// Records the outcome of a proxied request (failure: connect error, 5xx, broken stream).
    pub fn on_request(
        &mut self,
        success: bool,
        now: Instant,
        config: &HealthConfig,
        events: &mut Vec<HealthEvent>,
    ) {
        if success {
            self.consecutive_request_failures = 0;
            if self.breaker == Breaker::Closed {
                self.probation = false;
                self.reopenings = 0;
            }
            return;
        }
        self.consecutive_request_failures = self.consecutive_request_failures.saturating_add(1);
        if self.breaker == Breaker::Closed
            && (self.probation || self.consecutive_request_failures >= config.breaker_failures)
        {
            self.open(now, config, events);
        }
    }

    /// The progress watchdog found the engine wedged (requests in flight, nothing sent for
    /// `--engine-stall-ms`): the breaker opens at once, as after a failed request on probation
    /// (a wedged engine's health endpoint may well answer, so the probe cannot tell).
    pub fn on_stall(&mut self, now: Instant, config: &HealthConfig, events: &mut Vec<HealthEvent>) {
        self.consecutive_request_failures = self.consecutive_request_failures.saturating_add(1);
        if self.breaker == Breaker::Closed {
            self.open(now, config, events);
        }
    }

    /// Advances time: an open breaker whose period ended becomes half-open. Returns true when
    /// a probe should be sent now.
    pub fn on_tick(&mut self, now: Instant, events: &mut Vec<HealthEvent>) -> bool {
        match self.breaker {
            Breaker::Open { until } if now >= until => {
                self.transition(Breaker::HalfOpen, events);
                true
            }
            Breaker::HalfOpen => true,
            _ => false,
        }
    }

    fn transition(&mut self, to: Breaker, events: &mut Vec<HealthEvent>) {
        let from = self.breaker.as_str();
        self.breaker = to;
        if from != to.as_str() {
            events.push(HealthEvent::BreakerTransition {
                from,
                to: to.as_str(),
            });
        }
    }

    /// Time until the breaker may want attention, for the control loop's sleep.
    pub fn next_deadline(&self, now: Instant) -> Option<Duration> {
        match self.breaker {
            Breaker::Open { until } => Some(until.saturating_duration_since(now)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> HealthConfig {
        HealthConfig {
            interval: Duration::from_millis(100),
            timeout: Duration::from_millis(50),
            path: "/health".into(),
            healthy_threshold: 2,
            unhealthy_threshold: 3,
            breaker_failures: 2,
            breaker_open: Duration::from_secs(5),
        }
    }

    #[test]
    fn checks_take_a_backend_down_and_up_with_thresholds() {
        let config = config();
        let now = Instant::now();
        let mut health = BackendHealth::new();
        let mut events = Vec::new();
        health.on_check(false, now, &config, &mut events);
        health.on_check(false, now, &config, &mut events);
        assert!(
            health.is_routable(),
            "two failures are under the threshold of three"
        );
        health.on_check(false, now, &config, &mut events);
        assert!(!health.is_routable());
        assert_eq!(events, vec![HealthEvent::CheckVerdict { up: false }]);
        health.on_check(true, now, &config, &mut events);
        assert!(
            !health.is_routable(),
            "one success is under the threshold of two"
        );
        health.on_check(true, now, &config, &mut events);
        assert!(health.is_routable());
        assert_eq!(events.last(), Some(&HealthEvent::CheckVerdict { up: true }));
    }

    #[test]
    fn breaker_opens_half_opens_and_closes_on_probe() {
        let config = config();
        let start = Instant::now();
        let mut health = BackendHealth::new();
        let mut events = Vec::new();
        health.on_request(false, start, &config, &mut events);
        health.on_request(true, start, &config, &mut events);
        health.on_request(false, start, &config, &mut events);
        assert!(health.is_routable(), "failures were not consecutive");
        health.on_request(false, start, &config, &mut events);
        assert!(!health.is_routable());
        assert!(!health.on_tick(start + Duration::from_secs(1), &mut events));
        assert!(health.on_tick(start + Duration::from_secs(5), &mut events));
        assert_eq!(health.breaker(), Breaker::HalfOpen);
        assert!(!health.is_routable());
        health.on_check(false, start + Duration::from_secs(5), &config, &mut events);
        assert!(matches!(health.breaker(), Breaker::Open { .. }));
        assert!(health.on_tick(start + Duration::from_secs(10), &mut events));
        health.on_check(true, start + Duration::from_secs(10), &config, &mut events);
        assert_eq!(health.breaker(), Breaker::Closed);
        assert!(health.is_routable());
        let transitions: Vec<_> = events
            .iter()
            .filter_map(|event| match event {
                HealthEvent::BreakerTransition { from, to } => Some((*from, *to)),
                _ => None,
            })
            .collect();
        assert_eq!(
            transitions,
            vec![
                ("closed", "open"),
                ("open", "half_open"),
                ("half_open", "open"),
                ("open", "half_open"),
                ("half_open", "closed"),
            ]
        );
    }

    /// An engine whose health endpoint answers but whose requests time out: every probe closes
    /// the breaker, the next request re-opens it at once, for twice as long each time.
    #[test]
    fn a_stall_opens_the_breaker_at_once_and_probation_decides_after() {
        let config = config();
        let now = Instant::now();
        let mut health = BackendHealth::new();
        let mut events = Vec::new();
        health.on_stall(now, &config, &mut events);
        assert!(matches!(health.breaker(), Breaker::Open { .. }));
        assert!(!health.is_routable());
        assert_eq!(
            events,
            vec![HealthEvent::BreakerTransition {
                from: "closed",
                to: "open"
            }]
        );
        // A stall while open changes nothing.
        health.on_stall(now, &config, &mut events);
        assert_eq!(events.len(), 1);
        // The period ends, the probe passes (a wedged engine's health endpoint answers):
        // closed on probation, and a second stall re-opens it for twice the period.
        let later = now + config.breaker_open;
        assert!(health.on_tick(later, &mut events));
        health.on_check(true, later, &config, &mut events);
        assert!(health.is_routable());
        health.on_stall(later, &config, &mut events);
        let Breaker::Open { until } = health.breaker() else {
            panic!("not open: {:?}", health.breaker());
        };
        assert_eq!(until, later + config.breaker_open * 2);
    }

    #[test]
    fn probation_reopens_on_the_first_failure_with_a_growing_period() {
        let config = config();
        let mut now = Instant::now();
        let mut health = BackendHealth::new();
        let mut events = Vec::new();
        health.on_request(false, now, &config, &mut events);
        health.on_request(false, now, &config, &mut events);
        let mut periods = Vec::new();
        for _ in 0..7 {
            let Breaker::Open { until } = health.breaker() else {
                panic!("open expected: {:?}", health.breaker());
            };
            periods.push(until - now);
            now = until;
            assert!(health.on_tick(now, &mut events));
            health.on_check(true, now, &config, &mut events);
            assert!(health.is_routable(), "the probe closes it");
            health.on_request(false, now, &config, &mut events);
            assert!(
                !health.is_routable(),
                "one failure on probation re-opens it"
            );
        }
        let seconds: Vec<u64> = periods.iter().map(Duration::as_secs).collect();
        assert_eq!(seconds, [5, 10, 20, 40, 80, 80, 80]);

        // A success after a probe ends the probation and resets the period.
        now += Duration::from_secs(80);
        assert!(health.on_tick(now, &mut events));
        health.on_check(true, now, &config, &mut events);
        health.on_request(true, now, &config, &mut events);
        health.on_request(false, now, &config, &mut events);
        assert!(
            health.is_routable(),
            "one failure is under the threshold again"
        );
        health.on_request(false, now, &config, &mut events);
        let Breaker::Open { until } = health.breaker() else {
            panic!("open expected");
        };
        assert_eq!(until - now, Duration::from_secs(5));
    }
}
