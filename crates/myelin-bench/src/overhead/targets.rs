//! The overhead benchmark's targets, all in one place, and their evaluation on a run's legs.
//! Targets are informational (PASS/FAIL/SKIP lines) unless `--strict`.

use serde::Serialize;

use super::figures::{LegKind, LegResult};
use super::shapes::Shape;

/// Busiest data core's share of routing lookups, shared-prefix-2k at 2 router cores.
pub const MAX_BUSIEST_SHARD_SHARE: f64 = 0.6;
/// Router cores the shard-share target is read at.
pub const SHARD_SHARE_CORES: usize = 2;
/// Added latency at 1 router core, milliseconds: shared-prefix-2k p50 and p99.
pub const MAX_ADDED_SHARED_PREFIX_P50_MS: f64 = 0.15;
pub const MAX_ADDED_SHARED_PREFIX_P99_MS: f64 = 0.5;
/// Added latency at 1 router core, milliseconds: short p50 and p99.
pub const MAX_ADDED_SHORT_P50_MS: f64 = 0.10;
pub const MAX_ADDED_SHORT_P99_MS: f64 = 0.5;
/// Scaling is judged only on machines with at least this many CPUs (router, engines and load
/// generator on separate CPUs).
pub const SCALING_MIN_CPUS: usize = 16;
/// shared-prefix-2k req/s at N cores must reach this fraction of N x req/s at 1 core.
pub const MIN_SCALING_EFFICIENCY: f64 = 0.85;
/// myelin req/s over each external router's at the same cores and shape; on `short`.
pub const MIN_RPS_OVER_EXTERNAL: f64 = 2.0;
pub const MIN_RPS_OVER_EXTERNAL_SHORT: f64 = 3.0;
/// Router CPU per request on the conversation shapes (multi-turn-N, agentic), as a fraction of
/// each external router's at the same cores.
pub const MAX_CPU_OVER_EXTERNAL_CONVERSATIONS: f64 = 0.4;
/// Router CPU per request on multi-turn-50 over multi-turn-5, at the same cores.
pub const MAX_CPU_GROWTH_5_TO_50_TURNS: f64 = 1.25;

/// A target's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
    /// Not measurable in this run (leg or shape not run, metric absent, too few CPUs).
    Skip,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
        }
    }
}

/// One target's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TargetResult {
    pub name: String,
    pub status: Status,
    /// The measured value (None when skipped).
    pub value: Option<f64>,
    /// The bound it is held to.
    pub limit: f64,
    /// `<=` or `>=`.
    pub comparison: &'static str,
    /// Why it was skipped, or what was compared.
    pub detail: String,
}

impl TargetResult {
    fn at_most(name: String, value: Option<f64>, limit: f64, missing: &str) -> Self {
        Self::judge(name, value, limit, "<=", missing, |value| value <= limit)
    }

    fn at_least(name: String, value: Option<f64>, limit: f64, missing: &str) -> Self {
        Self::judge(name, value, limit, ">=", missing, |value| value >= limit)
    }

    fn judge(
        name: String,
        value: Option<f64>,
        limit: f64,
        comparison: &'static str,
        missing: &str,
        passes: impl Fn(f64) -> bool,
    ) -> Self {
        match value.filter(|value| value.is_finite()) {
            Some(value) => TargetResult {
                name,
                status: if passes(value) {
                    Status::Pass
                } else {
                    Status::Fail
                },
                value: Some(value),
                limit,
                comparison,
                detail: String::new(),
            },
            None => TargetResult {
                name,
                status: Status::Skip,
                value: None,
                limit,
                comparison,
                detail: missing.to_string(),
            },
        }
    }

    /// `PASS busiest shard share ...: 0.52 <= 0.6`.
    pub fn line(&self) -> String {
        match self.value {
            Some(value) => format!(
                "{} {}: {} {} {}{}",
                self.status.label(),
                self.name,
                round(value),
                self.comparison,
                round(self.limit),
                if self.detail.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", self.detail)
                }
            ),
            None => format!("{} {}: {}", self.status.label(), self.name, self.detail),
        }
    }
}

fn round(value: f64) -> String {
    if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.3}")
    }
}

fn find<'a>(
    legs: &'a [LegResult],
    kind: LegKind,
    name: Option<&str>,
    cores: usize,
    shape: Shape,
) -> Option<&'a LegResult> {
    legs.iter().find(|leg| {
        leg.kind == kind
            && name.is_none_or(|name| leg.name == name)
            && leg.router_cores == Some(cores)
            && leg.shape == shape.name()
    })
}

/// Every target, judged on `legs`; `available_cpus` decides whether scaling is judged.
pub fn evaluate(legs: &[LegResult], available_cpus: usize) -> Vec<TargetResult> {
    let mut results = Vec::new();
    // The plain myelin leg (not `myelin+tls`, which is measured beside it, not judged).
    let myelin = |cores, shape| find(legs, LegKind::Myelin, Some("myelin"), cores, shape);
    let not_run = |cores: usize, shape: Shape| {
        format!(
            "myelin at {cores} router core{} on {} was not run",
            if cores == 1 { "" } else { "s" },
            shape.name()
        )
    };

    // Sharding: the busiest data core's share of lookups.
    let share_leg = myelin(SHARD_SHARE_CORES, Shape::SharedPrefix2k);
    results.push(TargetResult::at_most(
        format!("busiest shard share, shared-prefix-2k, {SHARD_SHARE_CORES} router cores"),
        share_leg.and_then(|leg| leg.figures.busiest_shard_share),
        MAX_BUSIEST_SHARD_SHARE,
        &match share_leg {
            None => not_run(SHARD_SHARE_CORES, Shape::SharedPrefix2k),
            Some(_) => "the router exports no myelin_router_lookups_total{shard} counter".into(),
        },
    ));

    // Added latency at 1 router core.
    for (shape, p50, p99) in [
        (
            Shape::SharedPrefix2k,
            MAX_ADDED_SHARED_PREFIX_P50_MS,
            MAX_ADDED_SHARED_PREFIX_P99_MS,
        ),
        (Shape::Short, MAX_ADDED_SHORT_P50_MS, MAX_ADDED_SHORT_P99_MS),
    ] {
        let leg = myelin(1, shape);
        let missing = match leg {
            None => not_run(1, shape),
            Some(_) => "no direct-leg latency to subtract".into(),
        };
        results.push(TargetResult::at_most(
            format!("added p50 ms, {}, 1 router core", shape.name()),
            leg.and_then(|leg| leg.figures.added_p50_ms),
            p50,
            &missing,
        ));
        results.push(TargetResult::at_most(
            format!("added p99 ms, {}, 1 router core", shape.name()),
            leg.and_then(|leg| leg.figures.added_p99_ms),
            p99,
            &missing,
        ));
    }

    // Scaling on shared-prefix-2k.
    let mut cores: Vec<usize> = legs
        .iter()
        .filter(|leg| leg.kind == LegKind::Myelin && leg.shape == Shape::SharedPrefix2k.name())
        .filter_map(|leg| leg.router_cores)
        .filter(|&cores| cores > 1)
        .collect();
    cores.sort_unstable();
    cores.dedup();
    let base = myelin(1, Shape::SharedPrefix2k).map(|leg| leg.figures.rps);
    if cores.is_empty() {
        results.push(TargetResult::at_least(
            "scaling, shared-prefix-2k".into(),
            None,
            MIN_SCALING_EFFICIENCY,
            "needs shared-prefix-2k at 1 and more router cores",
        ));
    }
    for n in cores {
        let name =
            format!("scaling, shared-prefix-2k, req/s at {n} router cores / ({n} x req/s at 1)");
        let missing = if available_cpus < SCALING_MIN_CPUS {
            format!(
                "judged only with >= {SCALING_MIN_CPUS} CPUs (this machine has {available_cpus})"
            )
        } else {
            not_run(1, Shape::SharedPrefix2k)
        };
        let ratio = match (available_cpus >= SCALING_MIN_CPUS, base) {
            (true, Some(base)) if base > 0.0 => {
                myelin(n, Shape::SharedPrefix2k).map(|leg| leg.figures.rps / (n as f64 * base))
            }
            _ => None,
        };
        results.push(TargetResult::at_least(
            name,
            ratio,
            MIN_SCALING_EFFICIENCY,
            &missing,
        ));
    }

    // Conversations: CPU per request from 5 to 50 turns.
    let cores_run: Vec<usize> = {
        let mut cores: Vec<usize> = legs
            .iter()
            .filter(|leg| leg.kind == LegKind::Myelin)
            .filter_map(|leg| leg.router_cores)
            .collect();
        cores.sort_unstable();
        cores.dedup();
        cores
    };
    for &cores in &cores_run {
        let cpu = |shape| myelin(cores, shape).and_then(|leg| leg.figures.cpu_us_per_request);
        let (five, fifty) = (cpu(Shape::MultiTurn5), cpu(Shape::MultiTurn50));
        if five.is_none() && fifty.is_none() {
            continue;
        }
        results.push(TargetResult::at_most(
            format!(
                "CPU/req multi-turn-50 / multi-turn-5, {cores} router core{}",
                if cores == 1 { "" } else { "s" }
            ),
            five.zip(fifty)
                .filter(|(five, _)| *five > 0.0)
                .map(|(five, fifty)| fifty / five),
            MAX_CPU_GROWTH_5_TO_50_TURNS,
            "needs multi-turn-5 and multi-turn-50 with CPU figures",
        ));
    }

    // myelin against each external router.
    let externals: Vec<&LegResult> = legs
        .iter()
        .filter(|leg| leg.kind == LegKind::External)
        .collect();
    if externals.is_empty() {
        results.push(TargetResult::at_least(
            "myelin req/s over external routers".into(),
            None,
            MIN_RPS_OVER_EXTERNAL,
            "no --external legs",
        ));
    }
    for external in externals {
        let Some(cores) = external.router_cores else {
            continue;
        };
        let Some(shape) = Shape::from_name(&external.shape) else {
            continue;
        };
        let limit = if shape == Shape::Short {
            MIN_RPS_OVER_EXTERNAL_SHORT
        } else {
            MIN_RPS_OVER_EXTERNAL
        };
        let ratio = myelin(cores, shape)
            .filter(|_| external.figures.rps > 0.0)
            .map(|leg| leg.figures.rps / external.figures.rps);
        let mut result = TargetResult::at_least(
            format!(
                "myelin req/s / {} req/s, {}, {cores} router core{}",
                external.name,
                shape.name(),
                if cores == 1 { "" } else { "s" }
            ),
            ratio,
            limit,
            &if external.figures.rps > 0.0 {
                not_run(cores, shape)
            } else {
                format!("{} completed no requests", external.name)
            },
        );
        if result.status == Status::Skip && external.figures.rps <= 0.0 {
            result.status = Status::Fail;
        }
        results.push(result);
        if shape.is_conversation() {
            let ratio = myelin(cores, shape)
                .and_then(|leg| leg.figures.cpu_us_per_request)
                .zip(external.figures.cpu_us_per_request)
                .filter(|(_, theirs)| *theirs > 0.0)
                .map(|(ours, theirs)| ours / theirs);
            results.push(TargetResult::at_most(
                format!(
                    "myelin CPU/req / {} CPU/req, {}, {cores} router core{}",
                    external.name,
                    shape.name(),
                    if cores == 1 { "" } else { "s" }
                ),
                ratio,
                MAX_CPU_OVER_EXTERNAL_CONVERSATIONS,
                "needs CPU figures of both legs",
            ));
        }
    }
    results
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::overhead::report::Figures;

    fn leg(kind: LegKind, name: &str, cores: Option<usize>, shape: Shape) -> LegResult {
        LegResult {
            name: name.into(),
            kind,
            router_cores: cores,
            shape: shape.name().into(),
            cpus: None,
            command: None,
            figures: Figures {
                rps: 1_000.0,
                ..Figures::default()
            },
            repeats: Vec::new(),
        }
    }

    fn by_name<'a>(results: &'a [TargetResult], prefix: &str) -> Vec<&'a TargetResult> {
        results
            .iter()
            .filter(|result| result.name.starts_with(prefix))
            .collect()
    }

    #[test]
    fn latency_and_share_targets_pass_fail_and_skip() {
        let mut one = leg(LegKind::Myelin, "myelin", Some(1), Shape::SharedPrefix2k);
        one.figures.added_p50_ms = Some(0.10);
        one.figures.added_p99_ms = Some(0.9);
        let mut two = leg(LegKind::Myelin, "myelin", Some(2), Shape::SharedPrefix2k);
        two.figures.busiest_shard_share = Some(0.55);
        let results = evaluate(&[one, two], 2);
        let share = by_name(&results, "busiest shard share")[0];
        assert_eq!((share.status, share.value), (Status::Pass, Some(0.55)));
        let p50 = by_name(&results, "added p50 ms, shared-prefix-2k")[0];
        assert_eq!(p50.status, Status::Pass);
        let p99 = by_name(&results, "added p99 ms, shared-prefix-2k")[0];
        assert_eq!(p99.status, Status::Fail);
        assert!(
            p99.line().starts_with("FAIL added p99 ms"),
            "{}",
            p99.line()
        );
        // short was not run: skipped, with the reason.
        let short = by_name(&results, "added p50 ms, short")[0];
        assert_eq!(short.status, Status::Skip);
        assert!(short.detail.contains("not run"));
        // 2 CPUs: scaling is not judged.
        let scaling = by_name(&results, "scaling")[0];
        assert_eq!(scaling.status, Status::Skip);
        assert!(scaling.detail.contains(">= 16 CPUs"));
    }

    #[test]
    fn conversations_are_held_to_cpu_growth_and_a_share_of_the_gateways_cpu() {
        let with_cpu = |kind, name, shape, cpu| {
            let mut leg = leg(kind, name, Some(1), shape);
            leg.figures.cpu_us_per_request = Some(cpu);
            leg
        };
        let legs = [
            with_cpu(LegKind::Myelin, "myelin", Shape::MultiTurn5, 100.0),
            with_cpu(LegKind::Myelin, "myelin", Shape::MultiTurn50, 130.0),
            with_cpu(LegKind::Myelin, "myelin", Shape::Agentic, 150.0),
            with_cpu(LegKind::External, "smg", Shape::MultiTurn5, 300.0),
            with_cpu(LegKind::External, "smg", Shape::Agentic, 300.0),
            with_cpu(LegKind::External, "smg", Shape::Short, 10.0),
        ];
        let results = evaluate(&legs, 2);
        let growth = by_name(
            &results,
            "CPU/req multi-turn-50 / multi-turn-5, 1 router core",
        );
        assert_eq!(growth.len(), 1);
        assert_eq!(
            (growth[0].status, growth[0].value),
            (Status::Fail, Some(1.3))
        );
        let share = |shape: &str| {
            let found = by_name(&results, &format!("myelin CPU/req / smg CPU/req, {shape}"));
            found.first().map(|result| (result.status, result.value))
        };
        assert_eq!(
            share("multi-turn-5"),
            Some((Status::Pass, Some(100.0 / 300.0)))
        );
        assert_eq!(share("agentic"), Some((Status::Fail, Some(0.5))));
        // Not a conversation shape: no CPU share target.
        assert_eq!(share("short"), None);
    }

    #[test]
    fn a_missing_lookup_metric_skips_the_share_target() {
        let two = leg(LegKind::Myelin, "myelin", Some(2), Shape::SharedPrefix2k);
        let results = evaluate(&[two], 2);
        let share = by_name(&results, "busiest shard share")[0];
        assert_eq!(share.status, Status::Skip);
        assert!(share.detail.contains("myelin_router_lookups_total"));
    }

    #[test]
    fn scaling_is_judged_on_large_machines() {
        let one = leg(LegKind::Myelin, "myelin", Some(1), Shape::SharedPrefix2k);
        let mut four = leg(LegKind::Myelin, "myelin", Some(4), Shape::SharedPrefix2k);
        four.figures.rps = 3_500.0;
        let mut eight = leg(LegKind::Myelin, "myelin", Some(8), Shape::SharedPrefix2k);
        eight.figures.rps = 6_000.0;
        let results = evaluate(&[one, four, eight], 32);
        let scaling = by_name(&results, "scaling");
        assert_eq!(scaling.len(), 2);
        assert_eq!(
            (scaling[0].status, scaling[0].value),
            (Status::Pass, Some(0.875))
        );
        assert_eq!(
            (scaling[1].status, scaling[1].value),
            (Status::Fail, Some(0.75))
        );
    }

    #[test]
    fn myelin_is_compared_with_each_external_leg() {
        let mut myelin_short = leg(LegKind::Myelin, "myelin", Some(1), Shape::Short);
        myelin_short.figures.rps = 2_500.0;
        let mut myelin_shared = leg(LegKind::Myelin, "myelin", Some(1), Shape::SharedPrefix2k);
        myelin_shared.figures.rps = 2_500.0;
        let smg_short = leg(LegKind::External, "smg", Some(1), Shape::Short);
        let smg_shared = leg(LegKind::External, "smg", Some(1), Shape::SharedPrefix2k);
        let results = evaluate(&[myelin_short, myelin_shared, smg_short, smg_shared], 2);
        let external = by_name(&results, "myelin req/s / smg");
        assert_eq!(external.len(), 2);
        // 2.5x: below 3x on short, above 2x elsewhere.
        assert_eq!((external[0].status, external[0].limit), (Status::Fail, 3.0));
        assert_eq!((external[1].status, external[1].limit), (Status::Pass, 2.0));
    }
}
