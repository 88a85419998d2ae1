//! Validity gates: a run whose legs are not comparable says so and exits non-zero. With
//! `--ci-gates`, also the regression gates CI runs: routing must still beat round-robin,
//! residency weighting must not lose to history beyond the measured spread, and the machine
//! must be quiet enough to judge (a separate verdict: "machine too busy").

use serde::Serialize;

use crate::stats::{HARNESS_LIMIT_FRACTION, LegSummary};

/// What a gate judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GateKind {
    /// Whether the legs are comparable at all (errors, measured requests, cache pressure).
    Validity,
    /// Whether routing still does what it is for (`--ci-gates`).
    Routing,
    /// Whether the machine was quiet enough for the figures to mean anything (`--ci-gates`).
    Machine,
}

/// One gate's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gate {
    pub name: &'static str,
    pub kind: GateKind,
    pub passed: bool,
    pub detail: String,
}

/// The run's verdict from its gates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every gate passed.
    Valid,
    /// A validity or routing gate failed.
    Invalid,
    /// Only the machine gate failed: the harness lagged, nothing is known about routing.
    MachineTooBusy,
}

impl Verdict {
    /// The process exit status: 0, 1, or 3 for a machine too busy to judge.
    pub fn exit_status(self) -> u8 {
        match self {
            Verdict::Valid => 0,
            Verdict::Invalid => 1,
            Verdict::MachineTooBusy => 3,
        }
    }
}

/// The verdict of a set of gates.
pub fn verdict(gates: &[Gate]) -> Verdict {
    let failed = |kind: GateKind| gates.iter().any(|gate| gate.kind == kind && !gate.passed);
    if failed(GateKind::Validity) || failed(GateKind::Routing) {
        Verdict::Invalid
    } else if failed(GateKind::Machine) {
        Verdict::MachineTooBusy
    } else {
        Verdict::Valid
    }
}

/// How far `prefix+auto`'s TTFT P99 may be above `prefix+off`'s in the CI gate, simulated
/// milliseconds: the spread of `prefix+off`'s P99 over 12 `--quick` churn runs on the busy
/// 2-core development machine (623 to 5,693 ms; docs/reference/benchmark.md, "CI gates"). Sized for the
/// quick churn; another workload needs its own measurement.
pub const AUTO_OVER_OFF_P99_MARGIN_MS: f64 = 5100.0;

/// The regression gates CI runs (`--ci-gates`) on the medians across repeats: `prefix+off`'s
/// TTFT P99 below `round-robin`'s; `prefix+auto`'s not above `prefix+off`'s by more than
/// [`AUTO_OVER_OFF_P99_MARGIN_MS`]; `prefix+auto` downgraded; and, as its own kind of gate, the
/// harness's loop lag P99 (in simulated time) below [`HARNESS_LIMIT_FRACTION`] of every leg's
/// TTFT P99. A gate whose legs did not run fails, saying which legs it needs.
pub fn ci_gates(legs: &[LegSummary], speedup: f64) -> Vec<Gate> {
    let leg = |name: &str| legs.iter().find(|leg| leg.name == name && leg.requests > 0);
    let p99 = |leg: &LegSummary| leg.spread.ttft_p99_ms.median;
    let needs = |names: &str| format!("needs legs {names} with measured requests in --legs");
    let beats_round_robin = match (leg("prefix+off"), leg("round-robin")) {
        (Some(off), Some(round_robin)) => (
            p99(off) < p99(round_robin),
            format!(
                "TTFT P99 prefix+off {:.0} ms vs round-robin {:.0} ms",
                p99(off),
                p99(round_robin)
            ),
        ),
        _ => (false, needs("prefix+off and round-robin")),
    };
    let auto_within_margin = match (leg("prefix+auto"), leg("prefix+off")) {
        (Some(auto), Some(off)) => {
            let limit = p99(off) + AUTO_OVER_OFF_P99_MARGIN_MS;
            (
                p99(auto) <= limit,
                format!(
                    "TTFT P99 prefix+auto {:.0} ms vs prefix+off {:.0} ms (limit {:.0} ms: \
                     +{:.0} ms, the measured spread of quick runs)",
                    p99(auto),
                    p99(off),
                    limit,
                    AUTO_OVER_OFF_P99_MARGIN_MS
                ),
            )
        }
        _ => (false, needs("prefix+auto and prefix+off")),
    };
    let auto_downgrades = match leg("prefix+auto") {
        Some(auto) => (
            auto.downgrades.unwrap_or(0) > 0,
            format!("{} downgrades", auto.downgrades.unwrap_or(0)),
        ),
        None => (false, needs("prefix+auto")),
    };
    let lagging: Vec<String> = legs
        .iter()
        .filter(|leg| leg.requests > 0)
        .filter_map(|leg| {
            let lag_ms = leg.harness.loop_lag_p99_us as f64 * speedup / 1000.0;
            (lag_ms >= HARNESS_LIMIT_FRACTION * p99(leg)).then(|| {
                format!(
                    "{} (lag {lag_ms:.0} ms, TTFT P99 {:.0} ms)",
                    leg.name,
                    p99(leg)
                )
            })
        })
        .collect();
    let gate = |name, kind, (passed, detail): (bool, String)| Gate {
        name,
        kind,
        passed,
        detail,
    };
    vec![
        gate(
            "prefix+off beats round-robin",
            GateKind::Routing,
            beats_round_robin,
        ),
        gate(
            "prefix+auto within the spread of prefix+off",
            GateKind::Routing,
            auto_within_margin,
        ),
        gate("prefix+auto downgrades", GateKind::Routing, auto_downgrades),
        gate(
            "harness loop lag",
            GateKind::Machine,
            (
                lagging.is_empty(),
                if lagging.is_empty() {
                    format!(
                        "loop lag P99 below {:.0}% of every leg's TTFT P99",
                        HARNESS_LIMIT_FRACTION * 100.0
                    )
                } else {
                    format!(
                        "machine too busy: the harness's loop lag P99 is {:.0}% or more of the TTFT \
                         P99 on {}",
                        HARNESS_LIMIT_FRACTION * 100.0,
                        lagging.join(", ")
                    )
                },
            ),
        ),
    ]
}

/// Checks every gate over the leg summaries. `residency_legs` names the legs that run
/// residency weighting.
pub fn evaluate(legs: &[LegSummary], residency_legs: &[&str]) -> Vec<Gate> {
    let list = |names: Vec<String>| names.join(", ");

    let with_errors: Vec<String> = legs
        .iter()
        .filter(|leg| leg.errors > 0)
        .map(|leg| format!("{} ({} errors)", leg.name, leg.errors))
        .collect();
    let without_requests: Vec<String> = legs
        .iter()
        .filter(|leg| leg.requests == 0)
        .map(|leg| leg.name.clone())
        .collect();
    let without_evictions: Vec<String> = legs
        .iter()
        .filter(|leg| leg.evictions == Some(0))
        .map(|leg| leg.name.clone())
        .collect();
    // External engines: vLLM exports no eviction counter.
    let unmeasured: Vec<String> = legs
        .iter()
        .filter(|leg| leg.evictions.is_none())
        .map(|leg| leg.name.clone())
        .collect();
    let weighting: Vec<&LegSummary> = legs
        .iter()
        .filter(|leg| residency_legs.contains(&leg.name.as_str()))
        .collect();
    let without_downgrades: Vec<String> = weighting
        .iter()
        .filter(|leg| leg.downgrades.unwrap_or(0) == 0)
        .map(|leg| leg.name.clone())
        .collect();

    vec![
        Gate {
            name: "no errors",
            kind: GateKind::Validity,
            passed: with_errors.is_empty(),
            detail: if with_errors.is_empty() {
                "0 errors on every leg".into()
            } else {
                format!("errors on {}", list(with_errors))
            },
        },
        Gate {
            name: "requests measured",
            kind: GateKind::Validity,
            passed: without_requests.is_empty(),
            detail: if without_requests.is_empty() {
                "every leg completed requests after warm-up".into()
            } else {
                format!("no measured requests on {}", list(without_requests))
            },
        },
        Gate {
            name: "cache pressure",
            kind: GateKind::Validity,
            passed: without_evictions.is_empty(),
            detail: if without_evictions.is_empty() && unmeasured.is_empty() {
                "engines evicted on every leg".into()
            } else if without_evictions.is_empty() && unmeasured.len() == legs.len() {
                "not checked: evictions unmeasured on every leg (the engines export no eviction \
                 counter; give each --engine its kv-events= stream to count them)"
                    .into()
            } else if without_evictions.is_empty() {
                format!(
                    "engines evicted on every leg that measured it; unmeasured on {} (the \
                     engines export no eviction counter)",
                    list(unmeasured)
                )
            } else {
                format!(
                    "no evictions on {} (raise the load or lower kv_blocks)",
                    list(without_evictions)
                )
            },
        },
        Gate {
            name: "residency downgrades",
            kind: GateKind::Validity,
            passed: without_downgrades.is_empty(),
            detail: if weighting.is_empty() {
                "no residency-weighting leg in this run".into()
            } else if without_downgrades.is_empty() {
                "every residency-weighting leg downgraded at least once".into()
            } else {
                format!("no downgrade on {}", list(without_downgrades))
            },
        },
    ]
}

/// Whether every gate passed.
pub fn all_passed(gates: &[Gate]) -> bool {
    gates.iter().all(|gate| gate.passed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legs::LegKind;
    use crate::stats::summarize;
    use crate::stats::tests::run;

    fn summary(name: &str, kind: LegKind) -> LegSummary {
        summarize(&[&run(name, kind, &[1000, 2000])])
    }

    #[test]
    fn a_clean_run_passes_every_gate() {
        let legs = [
            summary("round-robin", LegKind::RoundRobin),
            summary("oracle", LegKind::Oracle),
        ];
        let gates = evaluate(&legs, &[]);
        assert!(all_passed(&gates), "{gates:?}");
        assert_eq!(gates[3].detail, "no residency-weighting leg in this run");
    }

    #[test]
    fn errors_missing_evictions_and_missing_downgrades_fail() {
        let mut broken = summary("prefix+auto", LegKind::Prefix(crate::legs::Residency::Auto));
        broken.errors = 3;
        broken.evictions = Some(0);
        broken.downgrades = Some(0);
        let fine = summary("round-robin", LegKind::RoundRobin);
        let gates = evaluate(&[fine, broken], &["prefix+auto"]);
        assert!(!all_passed(&gates));
        let failed: Vec<&str> = gates
            .iter()
            .filter(|gate| !gate.passed)
            .map(|gate| gate.name)
            .collect();
        assert_eq!(
            failed,
            ["no errors", "cache pressure", "residency downgrades"]
        );
        assert!(gates[0].detail.contains("prefix+auto (3 errors)"));
    }

    #[test]
    fn unmeasured_evictions_are_named_but_do_not_fail_the_run() {
        let mut external = summary("least-load", LegKind::LeastLoad);
        external.evictions = None;
        let mirrored = summary("prefix+auto", LegKind::Prefix(crate::legs::Residency::Auto));
        let gates = evaluate(&[external.clone(), mirrored], &[]);
        let pressure = gates
            .iter()
            .find(|gate| gate.name == "cache pressure")
            .unwrap();
        assert!(pressure.passed, "{pressure:?}");
        assert!(
            pressure.detail.contains("unmeasured on least-load"),
            "{pressure:?}"
        );
        // A measured leg that did not evict still fails it.
        let mut idle = summary("prefix+auto", LegKind::Prefix(crate::legs::Residency::Auto));
        idle.evictions = Some(0);
        let gates = evaluate(&[external, idle], &[]);
        assert!(
            !gates
                .iter()
                .find(|gate| gate.name == "cache pressure")
                .unwrap()
                .passed
        );
    }

    /// A leg whose measured requests all have TTFT `ttft_us` (wall, speedup 10) and whose
    /// harness lagged `lag_us`.
    fn leg(name: &str, kind: LegKind, ttft_us: u64, lag_us: u64) -> LegSummary {
        let mut run = run(name, kind, &[ttft_us]);
        run.harness.loop_lag_us = vec![lag_us; 10];
        summarize(&[&run])
    }

    fn ci(legs: &[LegSummary]) -> Vec<(&'static str, bool)> {
        ci_gates(legs, 10.0)
            .iter()
            .map(|gate| (gate.name, gate.passed))
            .collect()
    }

    #[test]
    fn ci_gates_judge_routing_and_the_machine_separately() {
        use crate::legs::Residency;
        let round_robin = leg("round-robin", LegKind::RoundRobin, 1_000_000, 100);
        let off = leg("prefix+off", LegKind::Prefix(Residency::Off), 200_000, 100);
        let auto = leg(
            "prefix+auto",
            LegKind::Prefix(Residency::Auto),
            250_000,
            100,
        );
        let gates = ci_gates(&[round_robin.clone(), off.clone(), auto.clone()], 10.0);
        assert!(gates.iter().all(|gate| gate.passed), "{gates:?}");
        assert_eq!(verdict(&gates), Verdict::Valid);

        // prefix+off no better than round-robin: a routing failure.
        let slow_off = leg(
            "prefix+off",
            LegKind::Prefix(Residency::Off),
            1_200_000,
            100,
        );
        let gates = ci_gates(&[round_robin.clone(), slow_off, auto.clone()], 10.0);
        assert!(!gates[0].passed);
        assert_eq!(verdict(&gates), Verdict::Invalid);

        // prefix+auto beyond the margin over prefix+off (8 s against 2 s).
        let slow_auto = leg(
            "prefix+auto",
            LegKind::Prefix(Residency::Auto),
            800_000,
            100,
        );
        assert_eq!(
            ci(&[round_robin.clone(), off.clone(), slow_auto])[1],
            ("prefix+auto within the spread of prefix+off", false)
        );

        // No downgrade.
        let mut idle_auto = auto.clone();
        idle_auto.downgrades = Some(0);
        assert_eq!(
            ci(&[round_robin.clone(), off.clone(), idle_auto])[2],
            ("prefix+auto downgrades", false)
        );

        // A lagging harness (20 ms wall = 200 simulated ms against a 2 s P99): machine too
        // busy, not a routing failure.
        let lagging = leg(
            "prefix+off",
            LegKind::Prefix(Residency::Off),
            200_000,
            20_000,
        );
        let gates = ci_gates(&[round_robin.clone(), lagging, auto.clone()], 10.0);
        assert!(!gates[3].passed);
        assert!(
            gates[3].detail.starts_with("machine too busy"),
            "{}",
            gates[3].detail
        );
        assert_eq!(verdict(&gates), Verdict::MachineTooBusy);
        assert_eq!(Verdict::MachineTooBusy.exit_status(), 3);

        // Missing legs fail and say which are needed.
        let gates = ci_gates(&[off], 10.0);
        assert!(!gates[0].passed && gates[0].detail.contains("round-robin"));
        assert!(!gates[2].passed && gates[2].detail.contains("prefix+auto"));
    }

    #[test]
    fn a_leg_with_nothing_measured_fails() {
        let mut empty = summary("least-load", LegKind::LeastLoad);
        empty.requests = 0;
        assert!(!evaluate(&[empty], &[])[1].passed);
    }
}
