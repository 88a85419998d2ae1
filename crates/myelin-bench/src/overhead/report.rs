//! The overhead benchmark's results: per leg and shape figures, medians over repeats, added
//! latency against the direct leg, and the tables (stdout, report.md) and report.json.

use serde::Serialize;

use super::args::Settings;
pub use super::figures::{Figures, LegKind, LegResult};
use super::targets::{Status, TargetResult};
use crate::report::Table;

/// report.json's schema version for `myelin bench overhead` (docs/reference/benchmark.md, "Files").
pub const OVERHEAD_SCHEMA_VERSION: u32 = 1;

/// Median of the finite values (mean of the middle two for an even count).
pub fn median(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let mut values: Vec<f64> = values
        .into_iter()
        .filter(|value| value.is_finite())
        .collect();
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    })
}

/// Medians of every figure over repeats; counts are summed.
pub fn median_figures(repeats: &[Figures]) -> Figures {
    let of = |field: fn(&Figures) -> Option<f64>| median(repeats.iter().filter_map(field));
    let shard_lookups = repeats
        .iter()
        .map(|figures| figures.shard_lookups.clone())
        .collect::<Option<Vec<Vec<u64>>>>()
        .filter(|all| !all.is_empty() && all.iter().all(|lookups| lookups.len() == all[0].len()))
        .map(|all| {
            (0..all[0].len())
                .map(|shard| all.iter().map(|lookups| lookups[shard]).sum())
                .collect()
        });
    Figures {
        rps: of(|figures| Some(figures.rps)).unwrap_or(0.0),
        requests: repeats.iter().map(|figures| figures.requests).sum(),
        errors: repeats.iter().map(|figures| figures.errors).sum(),
        p50_ms: of(|figures| figures.p50_ms),
        p99_ms: of(|figures| figures.p99_ms),
        first_byte_p50_ms: of(|figures| figures.first_byte_p50_ms),
        first_byte_p99_ms: of(|figures| figures.first_byte_p99_ms),
        added_p50_ms: of(|figures| figures.added_p50_ms),
        added_p99_ms: of(|figures| figures.added_p99_ms),
        cpu_us_per_request: of(|figures| figures.cpu_us_per_request),
        busiest_shard_share: of(|figures| figures.busiest_shard_share),
        shard_lookups,
        open_loop_requests: repeats
            .iter()
            .map(|figures| figures.open_loop_requests)
            .sum(),
        measured_s: repeats.iter().map(|figures| figures.measured_s).sum(),
    }
}

/// Fills `added_*` of a leg's figures from the direct leg's figures for the same shape and
/// repeat.
pub fn subtract_direct(figures: &mut Figures, direct: &Figures) {
    // Latencies have microsecond resolution: round the difference to it (no float noise).
    let minus = |leg: Option<f64>, base: Option<f64>| Some(((leg? - base?) * 1e3).round() / 1e3);
    figures.added_p50_ms = minus(figures.p50_ms, direct.p50_ms);
    figures.added_p99_ms = minus(figures.p99_ms, direct.p99_ms);
}

/// The busiest shard's share of the lookups between two scrapes: (share, per-shard deltas).
/// `None` when the counter is absent from either scrape or did not move.
pub fn busiest_shard_share(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> Option<(f64, Vec<u64>)> {
    if after.is_empty() {
        return None;
    }
    let mut shards: Vec<(&String, u64)> = after
        .iter()
        .map(|(shard, value)| {
            let delta = value - before.get(shard).copied().unwrap_or(0.0);
            (shard, delta.max(0.0).round() as u64)
        })
        .collect();
    // Numeric shard labels in numeric order.
    shards.sort_by_key(|(shard, _)| (shard.parse::<u64>().unwrap_or(u64::MAX), (*shard).clone()));
    let total: u64 = shards.iter().map(|(_, delta)| delta).sum();
    let busiest = shards.iter().map(|(_, delta)| *delta).max()?;
    (total > 0).then(|| {
        (
            busiest as f64 / total as f64,
            shards.into_iter().map(|(_, delta)| delta).collect(),
        )
    })
}

/// Where everything ran.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// CPUs this process could use.
    pub available_cpus: String,
    pub cpu_count: usize,
    pub router_cpus: String,
    pub engine_cpus: String,
    pub loadgen_cpus: String,
    /// Some CPU served two of router, engines and load generator: figures are not isolated.
    pub shared: bool,
    pub engine_urls: Vec<String>,
}

/// report.json.
#[derive(Debug, Serialize)]
pub struct OverheadReport<'a> {
    pub schema_version: u32,
    pub benchmark: &'static str,
    pub myelin_version: &'static str,
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub generated_at: String,
    pub command: String,
    pub settings: &'a Settings,
    pub machine: &'a Machine,
    pub legs: &'a [LegResult],
    /// Legs that could not run (a router that did not start), with the reason.
    pub failures: &'a [String],
    pub targets: &'a [TargetResult],
    /// No request failed and every leg ran.
    pub valid: bool,
}

fn cell(value: Option<f64>, decimals: usize) -> String {
    value.map_or("-".into(), |value| format!("{value:.decimals$}"))
}

fn signed(value: Option<f64>) -> String {
    value.map_or("-".into(), |value| format!("{value:+.3}"))
}

/// One table per shape: every leg's figures.
fn shape_tables(legs: &[LegResult]) -> Vec<(String, Table)> {
    let mut shapes: Vec<&str> = Vec::new();
    for leg in legs {
        if !shapes.contains(&leg.shape.as_str()) {
            shapes.push(&leg.shape);
        }
    }
    shapes
        .into_iter()
        .map(|shape| {
            let rows = legs
                .iter()
                .filter(|leg| leg.shape == shape)
                .map(|leg| {
                    let figures = &leg.figures;
                    vec![
                        leg.name.clone(),
                        leg.router_cores
                            .map_or("-".into(), |cores| cores.to_string()),
                        format!("{:.0}", figures.rps),
                        cell(figures.p50_ms, 3),
                        cell(figures.p99_ms, 3),
                        signed(figures.added_p50_ms),
                        signed(figures.added_p99_ms),
                        cell(figures.cpu_us_per_request, 1),
                        cell(figures.busiest_shard_share, 2),
                        figures.errors.to_string(),
                    ]
                })
                .collect();
            (
                shape.to_string(),
                Table {
                    header: [
                        "leg",
                        "cores",
                        "req/s",
                        "p50 ms",
                        "p99 ms",
                        "+p50 ms",
                        "+p99 ms",
                        "CPU us/req",
                        "busiest shard",
                        "errors",
                    ]
                    .map(String::from)
                    .to_vec(),
                    rows,
                },
            )
        })
        .collect()
}

fn machine_lines(report: &OverheadReport<'_>) -> Vec<String> {
    let machine = report.machine;
    let settings = report.settings;
    let mut lines = vec![
        format!(
            "CPUs: {} available; router {}, engines {}, load generator {}{}",
            machine.cpu_count,
            machine.router_cpus,
            machine.engine_cpus,
            machine.loadgen_cpus,
            if machine.shared {
                " (SHARED: router, engines and load generator share CPUs; figures are not isolated)"
            } else {
                ""
            }
        ),
        format!(
            "closed loop: {} connections, {} s measured after {} s warm-up; open loop: {} requests at {} req/s after {} warm-up; {} instant engines; max_tokens {}, stream {}; {} repeat{}",
            settings.connections,
            settings.duration_s,
            settings.warmup_s,
            settings.open_requests,
            settings.open_rate,
            settings.open_warmup,
            settings.engines,
            settings.max_tokens,
            settings.stream,
            settings.repeat,
            if settings.repeat == 1 {
                ""
            } else {
                "s (medians)"
            },
        ),
    ];
    for failure in report.failures {
        lines.push(format!("FAILED: {failure}"));
    }
    lines
}

fn verdict(report: &OverheadReport<'_>) -> String {
    let errors: u64 = report.legs.iter().map(|leg| leg.figures.errors).sum();
    let failed = report
        .targets
        .iter()
        .filter(|target| target.status == Status::Fail)
        .count();
    let passed = report
        .targets
        .iter()
        .filter(|target| target.status == Status::Pass)
        .count();
    format!(
        "{}: {errors} request errors, {} legs failed to run; targets: {passed} passed, {failed} failed, {} skipped",
        if report.valid { "VALID" } else { "INVALID" },
        report.failures.len(),
        report.targets.len() - passed - failed,
    )
}

/// The stdout rendering: settings, one table per shape, the targets, the verdict.
pub fn render_text(report: &OverheadReport<'_>) -> String {
    let mut out = String::new();
    for line in machine_lines(report) {
        out.push_str(&line);
        out.push('\n');
    }
    for (shape, table) in shape_tables(report.legs) {
        out.push_str(&format!("\n{shape}\n"));
        out.push_str(&table.plain());
    }
    out.push_str("\ntargets\n");
    for target in report.targets {
        out.push_str(&target.line());
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&verdict(report));
    out.push('\n');
    out
}

/// report.md.
pub fn render_markdown(report: &OverheadReport<'_>, plots: &[(&str, &str)]) -> String {
    let mut out = format!(
        "# myelin bench overhead\n\n`{}`\n\nGenerated {} by myelin {}.\n\n",
        report.command, report.generated_at, report.myelin_version
    );
    for line in machine_lines(report) {
        out.push_str(&format!("- {line}\n"));
    }
    out.push_str("\nLegs and command lines:\n\n");
    let mut seen = Vec::new();
    for leg in report.legs {
        let key = (leg.name.clone(), leg.router_cores);
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        out.push_str(&format!(
            "- {}{}: {}\n",
            leg.name,
            leg.router_cores
                .map_or(String::new(), |cores| format!(" at {cores} router cores")),
            leg.command
                .as_deref()
                .map_or("load generator straight to engine 0".into(), |command| {
                    format!("`{command}`")
                })
        ));
    }
    out.push_str(
        "\nreq/s: closed loop. p50/p99: open loop, send to end of response. +p50/+p99: minus \
         the direct leg's. CPU us/req: the router's CPU time per request (closed loop).\n",
    );
    for (shape, table) in shape_tables(report.legs) {
        out.push_str(&format!("\n## {shape}\n\n"));
        out.push_str(&table.markdown());
    }
    out.push_str("\n## Targets\n\n");
    for target in report.targets {
        out.push_str(&format!("- {}\n", target.line()));
    }
    out.push_str(&format!("\n**{}**\n", verdict(report)));
    if !plots.is_empty() {
        out.push_str("\n## Plots\n\n");
        for (title, file) in plots {
            out.push_str(&format!("![{title}]({file})\n\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn map(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs
            .iter()
            .map(|(key, value)| (key.to_string(), *value))
            .collect()
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median([4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median([f64::NAN]), None);
        assert_eq!(median([]), None);
    }

    #[test]
    fn repeats_give_medians_and_summed_counts() {
        let run = |rps: f64, p50: Option<f64>, errors: u64| Figures {
            rps,
            p50_ms: p50,
            errors,
            requests: 10,
            shard_lookups: Some(vec![1, 2]),
            ..Figures::default()
        };
        let merged = median_figures(&[
            run(100.0, Some(1.0), 0),
            run(300.0, None, 2),
            run(200.0, Some(3.0), 1),
        ]);
        assert_eq!(merged.rps, 200.0);
        assert_eq!(merged.p50_ms, Some(2.0));
        assert_eq!((merged.errors, merged.requests), (3, 30));
        assert_eq!(merged.shard_lookups, Some(vec![3, 6]));
        assert_eq!(merged.busiest_shard_share, None);
    }

    #[test]
    fn added_latency_is_leg_minus_direct() {
        let direct = Figures {
            p50_ms: Some(0.2),
            p99_ms: Some(0.5),
            ..Figures::default()
        };
        let mut leg = Figures {
            p50_ms: Some(0.3),
            p99_ms: Some(0.4),
            ..Figures::default()
        };
        subtract_direct(&mut leg, &direct);
        assert_eq!(leg.added_p50_ms, Some(0.1));
        assert_eq!(leg.added_p99_ms, Some(-0.1));
        subtract_direct(&mut leg, &Figures::default());
        assert_eq!(leg.added_p50_ms, None);
    }

    #[test]
    fn busiest_share_uses_deltas_between_scrapes() {
        let before = map(&[("0", 100.0), ("1", 50.0)]);
        let after = map(&[("0", 160.0), ("1", 90.0), ("10", 0.0)]);
        let (share, deltas) = busiest_shard_share(&before, &after).unwrap();
        assert_eq!(share, 0.6);
        assert_eq!(deltas, [60, 40, 0]);
        // A shard first seen after the start counts from 0.
        let (share, _) = busiest_shard_share(&BTreeMap::new(), &map(&[("0", 5.0)])).unwrap();
        assert_eq!(share, 1.0);
        assert_eq!(busiest_shard_share(&before, &BTreeMap::new()), None);
        assert_eq!(busiest_shard_share(&before, &before), None);
    }
}
