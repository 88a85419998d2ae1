//! The regime a run measured, printed as one line in every report: the working set against the
//! cluster's KV capacity, the offered load against the cluster's capacity, and the share of
//! requests whose reusable prefix some engine held at send time (the simulator's truth). The
//! first two place a run on the regime grid (`myelin bench regimes`); the third says how much
//! of the reuse was there to be had. docs/reference/benchmark.md ("Definitions") has the definitions.

use serde::Serialize;

use crate::stats::LegSummary;
use crate::workload::working_set::kv_capacity_tokens;
use crate::workload::{Workload, WorkloadConfig, WorkloadError, working_set};

/// What the regime line shows (report.json `regime`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Regime {
    /// Distinct reusable prompt tokens live at once (see `crate::workload::working_set`).
    pub working_set_tokens: u64,
    /// How the working set was counted, in words.
    pub working_set: String,
    /// Engines x KV blocks x block size.
    pub kv_capacity_tokens: u64,
    /// `working_set_tokens / kv_capacity_tokens`.
    pub working_set_ratio: f64,
    /// Open loop: requests per simulated second offered (the Poisson rate, or a trace's mean
    /// rate).
    pub offered_rps: Option<f64>,
    /// The cluster's capacity the offered rate is set against (`crate::capacity`).
    pub capacity_rps: Option<f64>,
    /// `offered_rps / capacity_rps`.
    pub offered_load: Option<f64>,
    /// Closed loop: the users (the load is whatever they send).
    pub closed_loop_users: Option<u32>,
    /// Measured requests, over every leg, whose reusable prefix (at least one block) was probed.
    pub prefix_reusable_requests: u64,
    /// Of those, the share whose reusable prefix some engine held in full at send time.
    pub prefix_resident_share: Option<f64>,
}

impl Regime {
    /// The regime of a run of `config` (its rate resolved), from its legs' summaries.
    pub fn of(
        config: &WorkloadConfig,
        workload: &Workload,
        legs: &[LegSummary],
    ) -> Result<Regime, WorkloadError> {
        let set = working_set(config)?;
        let kv = kv_capacity_tokens(config);
        let (offered_rps, capacity_rps) = match workload {
            Workload::Trace(trace) => (
                Some(trace.mean_rate_rps()),
                config.trace.as_ref().and_then(|trace| trace.capacity_rps),
            ),
            _ => match workload.schedule() {
                Some(schedule) => (Some(schedule.rate_rps()), schedule.capacity_rps()),
                None => (None, None),
            },
        };
        let closed_loop_users = match workload.arrival() {
            crate::workload::Arrival::ClosedLoop { users } => Some(users),
            crate::workload::Arrival::OpenLoop { .. } => None,
        };
        let prefix_reusable_requests: u64 =
            legs.iter().map(|leg| leg.prefix_reusable_requests).sum();
        let resident: f64 = legs
            .iter()
            .filter_map(|leg| {
                leg.prefix_resident_share
                    .map(|share| share * leg.prefix_reusable_requests as f64)
            })
            .sum();
        Ok(Regime {
            working_set_tokens: set.tokens,
            working_set: set.definition,
            kv_capacity_tokens: kv,
            working_set_ratio: set.tokens as f64 / kv.max(1) as f64,
            offered_rps,
            capacity_rps,
            offered_load: offered_rps
                .zip(capacity_rps)
                .map(|(rate, capacity)| rate / capacity),
            closed_loop_users,
            prefix_reusable_requests,
            prefix_resident_share: (prefix_reusable_requests > 0)
                .then(|| resident / prefix_reusable_requests as f64),
        })
    }

    /// The regime line (one line, no newline).
    pub fn line(&self, legs: &[LegSummary]) -> String {
        let load = match (self.offered_load, self.offered_rps, self.capacity_rps) {
            (Some(load), Some(rate), Some(capacity)) => {
                format!("offered load {load:.2}x capacity ({rate:.2} of {capacity:.2} req/s)")
            }
            (_, Some(rate), None) => {
                format!("offered load {rate:.2} req/s (capacity not measured)")
            }
            _ => format!(
                "offered load: closed loop ({} users)",
                self.closed_loop_users.unwrap_or(0)
            ),
        };
        let resident = match self.prefix_resident_share {
            Some(share) => {
                let per_leg: Vec<String> = legs
                    .iter()
                    .filter_map(|leg| {
                        leg.prefix_resident_share
                            .map(|share| format!("{} {}", leg.name, percent(share)))
                    })
                    .collect();
                format!(
                    "prefix resident somewhere at send {} of {} requests ({})",
                    percent(share),
                    self.prefix_reusable_requests,
                    per_leg.join(", ")
                )
            }
            None => "prefix resident somewhere at send: not probed".to_string(),
        };
        format!(
            "regime: working set {:.2}x KV capacity ({} of {} tokens; {}) | {load} | {resident}",
            self.working_set_ratio,
            self.working_set_tokens,
            self.kv_capacity_tokens,
            self.working_set,
        )
    }
}

fn percent(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legs::LegKind;
    use crate::stats::summarize_all;
    use crate::stats::tests::run;
    use crate::workload::TokenAlphabet;

    #[test]
    fn the_line_shows_the_ratio_the_load_and_the_resident_share() {
        let mut config = WorkloadConfig::load("churn-open").unwrap();
        config.open_loop.as_mut().unwrap().capacity_rps = Some(5.0);
        config.open_loop.as_mut().unwrap().rate_rps = Some(3.0);
        let workload = Workload::build(&config, TokenAlphabet::token_ids()).unwrap();
        let mut runs = vec![
            run("least-load", LegKind::LeastLoad, &[100_000, 100_000]),
            run("prefix+auto", LegKind::LeastLoad, &[100_000, 100_000]),
        ];
        // least-load: 1 of 2 measured requests resident; prefix+auto: 2 of 2; warm-up ones
        // (sent at 2 s) do not count.
        for (run, verdicts) in runs.iter_mut().zip([[true, false], [true, true]]) {
            let mut measured = 0;
            for record in &mut run.records {
                record.prefix_resident = Some(false);
                if record.sent_at_us >= 1_000_000 {
                    record.prefix_resident = Some(verdicts[measured]);
                    measured += 1;
                }
            }
        }
        let legs = summarize_all(&runs);
        assert_eq!(legs[0].prefix_resident_share, Some(0.5));
        assert_eq!(legs[0].prefix_reusable_requests, 2);
        let regime = Regime::of(&config, &workload, &legs).unwrap();
        assert_eq!(regime.kv_capacity_tokens, 8 * 2048 * 16);
        assert!(
            (regime.working_set_ratio - regime.working_set_tokens as f64 / 262_144.0).abs() < 1e-12
        );
        assert_eq!(regime.offered_load, Some(0.6));
        assert_eq!(regime.prefix_resident_share, Some(0.75));
        let line = regime.line(&legs);
        assert!(line.starts_with("regime: working set 0.4"), "{line}");
        assert!(
            line.contains("offered load 0.60x capacity (3.00 of 5.00 req/s)"),
            "{line}"
        );
        assert!(
            line.contains("resident somewhere at send 75.0% of 4 requests (least-load 50.0%, prefix+auto 100.0%)"),
            "{line}"
        );
        // Closed loop: no offered load, the users instead.
        let churn = WorkloadConfig::load("churn").unwrap();
        let workload = Workload::build(&churn, TokenAlphabet::token_ids()).unwrap();
        let regime = Regime::of(&churn, &workload, &[]).unwrap();
        assert_eq!(regime.offered_load, None);
        assert!(regime.line(&[]).contains("closed loop (60 users)"));
        assert!(regime.line(&[]).contains("not probed"));
    }
}
