//! Validity gates: a run whose legs are not comparable says so and exits non-zero.

use serde::Serialize;

use crate::stats::LegSummary;

/// One gate's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gate {
    pub name: &'static str,
    pub passed: bool,
    pub detail: String,
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
        .filter(|leg| leg.evictions == 0)
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
            passed: with_errors.is_empty(),
            detail: if with_errors.is_empty() {
                "0 errors on every leg".into()
            } else {
                format!("errors on {}", list(with_errors))
            },
        },
        Gate {
            name: "requests measured",
            passed: without_requests.is_empty(),
            detail: if without_requests.is_empty() {
                "every leg completed requests after warm-up".into()
            } else {
                format!("no measured requests on {}", list(without_requests))
            },
        },
        Gate {
            name: "cache pressure",
            passed: without_evictions.is_empty(),
            detail: if without_evictions.is_empty() {
                "engines evicted on every leg".into()
            } else {
                format!(
                    "no evictions on {} (raise the load or lower kv_blocks)",
                    list(without_evictions)
                )
            },
        },
        Gate {
            name: "residency downgrades",
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
        broken.evictions = 0;
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
    fn a_leg_with_nothing_measured_fails() {
        let mut empty = summary("least-load", LegKind::LeastLoad);
        empty.requests = 0;
        assert!(!evaluate(&[empty], &[])[1].passed);
    }
}
