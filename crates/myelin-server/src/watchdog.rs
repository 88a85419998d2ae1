//! The engine progress watchdog of one data core, as a pure state machine: which engines have
//! requests of this core in flight and when any of them last sent a byte. An engine with
//! requests in flight and no byte on any of them for `--engine-stall-ms` is *stalled*; the data
//! core reports it to the control core, which opens its breaker (docs/operations.md, "Failure
//! behaviour"): it gets no new requests until the breaker's probation lets one through and
//! that one is answered.
//!
//! The control core decides: where the engine exports a generated-tokens counter (scraped),
//! the engine is wedged only if that stood still as long (a busy engine's queued requests are
//! silent too); without one, silence on streams (a byte per token) is proof, and a
//! non-streaming request alone (answered whole, at its end) is left to its deadline. The report
//! says whether streams were among the silent requests.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::backends::BackendId;

/// One engine's requests of this core and their progress.
#[derive(Debug, Clone, Copy)]
struct Progress {
    in_flight: u32,
    streaming: u32,
    /// The last byte from the engine, or when its first request of a busy period was sent.
    last: Instant,
    /// When this stall was last reported (reported again every `stall` while it lasts).
    reported: Option<Instant>,
}

/// A stalled engine, as [`Watchdog::check`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    pub backend: BackendId,
    /// Some of its silent requests stream (a token each step).
    pub streaming: bool,
}

/// The watchdog of one data core.
#[derive(Debug)]
pub struct Watchdog {
    stall: Option<Duration>,
    engines: HashMap<BackendId, Progress>,
}

impl Watchdog {
    /// `stall`: `--engine-stall-ms` (`None`: off).
    pub fn new(stall: Option<Duration>) -> Self {
        Watchdog {
            stall,
            engines: HashMap::new(),
        }
    }

    /// How often [`Self::check`] should run: a quarter of the stall time, at least every 50 ms
    /// and at most every second (`None`: off).
    pub fn check_interval(&self) -> Option<Duration> {
        self.stall
            .map(|stall| (stall / 4).clamp(Duration::from_millis(50), Duration::from_secs(1)))
    }

    /// A request was sent to `backend`.
    pub fn started(&mut self, backend: BackendId, streaming: bool, now: Instant) {
        if self.stall.is_none() {
            return;
        }
        let progress = self.engines.entry(backend).or_insert(Progress {
            in_flight: 0,
            streaming: 0,
            last: now,
            reported: None,
        });
        if progress.in_flight == 0 {
            // A new busy period: its clock starts now, not at the last byte of the previous.
            progress.last = now;
            progress.reported = None;
        }
        progress.in_flight = progress.in_flight.saturating_add(1);
        if streaming {
            progress.streaming = progress.streaming.saturating_add(1);
        }
    }

    /// A request to `backend` ended (answered, failed or abandoned).
    pub fn ended(&mut self, backend: BackendId, streaming: bool) {
        let Some(progress) = self.engines.get_mut(&backend) else {
            return;
        };
        progress.in_flight = progress.in_flight.saturating_sub(1);
        if streaming {
            progress.streaming = progress.streaming.saturating_sub(1);
        }
        if progress.in_flight == 0 {
            self.engines.remove(&backend);
        }
    }

    /// `backend` sent bytes (a response head or a body frame).
    pub fn progressed(&mut self, backend: BackendId, now: Instant) {
        if let Some(progress) = self.engines.get_mut(&backend) {
            progress.last = now;
            progress.reported = None;
        }
    }

    /// The engines stalled now that were not reported within the last stall time.
    pub fn check(&mut self, now: Instant) -> Vec<Stall> {
        let Some(stall) = self.stall else {
            return Vec::new();
        };
        let mut stalls = Vec::new();
        for (&backend, progress) in &mut self.engines {
            let silent = now.saturating_duration_since(progress.last);
            let due = progress
                .reported
                .is_none_or(|reported| now.saturating_duration_since(reported) >= stall);
            if progress.in_flight > 0 && silent >= stall && due {
                progress.reported = Some(now);
                stalls.push(Stall {
                    backend,
                    streaming: progress.streaming > 0,
                });
            }
        }
        stalls.sort_by_key(|stall| stall.backend);
        stalls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(10);

    #[test]
    fn an_engine_silent_on_every_request_for_the_stall_time_is_reported_once_per_period() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut watchdog = Watchdog::new(Some(STALL));
        watchdog.started(BackendId(1), true, at(0));
        watchdog.started(BackendId(2), false, at(0));
        assert!(watchdog.check(at(9)).is_empty());
        // Engine 1 answers now and then; engine 2 never does.
        watchdog.progressed(BackendId(1), at(8));
        let stalls = watchdog.check(at(10));
        assert_eq!(
            stalls,
            vec![Stall {
                backend: BackendId(2),
                streaming: false,
            }]
        );
        // Not again within the stall time.
        assert!(watchdog.check(at(15)).is_empty());
        // Engine 1 went silent too (streaming: proof enough).
        let stalls = watchdog.check(at(18));
        assert_eq!(stalls.len(), 1);
        assert_eq!(stalls[0].backend, BackendId(1));
        assert!(stalls[0].streaming);
        // Engine 2 again, a stall time after its first report.
        let stalls = watchdog.check(at(20));
        assert_eq!(stalls.len(), 1);
        assert_eq!(stalls[0].backend, BackendId(2));
        // A byte ends the stall; silence again starts a new one.
        watchdog.progressed(BackendId(2), at(21));
        assert!(
            watchdog
                .check(at(30))
                .iter()
                .all(|stall| stall.backend != BackendId(2))
        );
        assert!(
            watchdog
                .check(at(31))
                .iter()
                .any(|stall| stall.backend == BackendId(2))
        );
    }

    #[test]
    fn an_idle_engine_is_never_stalled_and_a_new_busy_period_starts_its_clock_afresh() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut watchdog = Watchdog::new(Some(STALL));
        watchdog.started(BackendId(3), true, at(0));
        watchdog.ended(BackendId(3), true);
        assert!(watchdog.check(at(100)).is_empty(), "nothing in flight");
        // Its next request, long after the last byte: silent only from when it was sent.
        watchdog.started(BackendId(3), false, at(100));
        assert!(watchdog.check(at(105)).is_empty());
        let stalls = watchdog.check(at(110));
        assert_eq!(stalls.len(), 1);
        assert!(
            !stalls[0].streaming,
            "only a non-streaming request in flight"
        );
        // Ends balance starts; unknown ends are ignored.
        watchdog.ended(BackendId(3), false);
        watchdog.ended(BackendId(3), false);
        watchdog.ended(BackendId(9), true);
        assert!(watchdog.check(at(200)).is_empty());
    }

    #[test]
    fn off_means_off() {
        let start = Instant::now();
        let mut watchdog = Watchdog::new(None);
        assert_eq!(watchdog.check_interval(), None);
        watchdog.started(BackendId(1), true, start);
        assert!(watchdog.check(start + Duration::from_secs(3600)).is_empty());
        let on = Watchdog::new(Some(Duration::from_millis(100)));
        assert_eq!(on.check_interval(), Some(Duration::from_millis(50)));
        let long = Watchdog::new(Some(Duration::from_secs(60)));
        assert_eq!(long.check_interval(), Some(Duration::from_secs(1)));
    }
}
