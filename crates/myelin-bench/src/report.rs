//! The run's report: the A/B table (metric | leg A | leg B | delta), the all-legs table, the
//! gates, as text for stdout and as report.md / report.json.

use serde::Serialize;

use crate::gates::{Gate, Verdict};
use crate::stats::{LegSummary, Overlap, Spread};
use crate::workload::WorkloadConfig;
use crate::workload::trace::SkippedOverContext;

/// report.json's schema version (docs/reference/benchmark.md, "Output files", describes the schema).
pub const REPORT_SCHEMA_VERSION: u32 = 2;

/// Everything report.json holds.
#[derive(Debug, Serialize)]
pub struct Report<'a> {
    pub schema_version: u32,
    pub myelin_version: &'static str,
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub generated_at: String,
    /// The command line that produced the run.
    pub command: String,
    /// `simulated`: latencies and rates are in simulated time (wall time x speedup);
    /// `wall`: external engines at speedup 1.
    pub time_unit: &'static str,
    pub speedup: f64,
    pub repeat: u32,
    pub quick: bool,
    pub workload: &'a WorkloadConfig,
    /// What drives the traffic, in words (closed-loop users, or the open-loop schedule).
    pub traffic: String,
    /// Trace replays: lines left out, on every leg alike, because prompt plus output exceed
    /// the engines' context length (`null` for other workloads).
    pub skipped_over_context: Option<SkippedOverContext>,
    /// `myelin serve` nodes per myelin router leg (`--router-nodes`; 1 = a single router).
    pub router_nodes: u32,
    /// The URLs of the engines of `--engine` (empty: simulated engines).
    pub external_engines: Vec<String>,
    /// Whether those nodes formed a peer cluster over gossip (false with one node).
    pub gossip: bool,
    /// The regime the run measured: working set / KV capacity, offered load / capacity, the
    /// share of requests whose reusable prefix was resident somewhere (`null` when it could not
    /// be worked out).
    pub regime: Option<crate::regime::Regime>,
    pub legs: &'a [LegSummary],
    /// Pairs of legs whose TTFT P50 or P99 ranges across repeats overlap (empty with one
    /// repeat: one run has no range).
    pub overlaps: &'a [Overlap],
    pub gates: &'a [Gate],
    pub passed: bool,
}

/// A table of text cells (also used by the overhead benchmark's report).
pub(crate) struct Table {
    pub(crate) header: Vec<String>,
    pub(crate) rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn plain(&self) -> String {
        let columns = self.header.len();
        let widths: Vec<usize> = (0..columns)
            .map(|column| {
                std::iter::once(&self.header)
                    .chain(&self.rows)
                    .map(|row| row.get(column).map_or(0, |cell| cell.chars().count()))
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |row: &Vec<String>| {
            row.iter()
                .enumerate()
                .map(|(column, cell)| {
                    if column == 0 {
                        format!("{cell:<width$}", width = widths[column])
                    } else {
                        format!("{cell:>width$}", width = widths[column])
                    }
                })
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str(&"-".repeat(widths.iter().sum::<usize>() + 2 * columns.saturating_sub(1)));
        out.push('\n');
        for row in &self.rows {
            out.push_str(&line(row));
            out.push('\n');
        }
        out
    }

    pub(crate) fn markdown(&self) -> String {
        let mut out = format!("| {} |\n", self.header.join(" | "));
        out.push_str(&format!(
            "|{}\n",
            (0..self.header.len())
                .map(|column| if column == 0 { "---|" } else { "---:|" })
                .collect::<String>()
        ));
        for row in &self.rows {
            out.push_str(&format!("| {} |\n", row.join(" | ")));
        }
        out
    }
}

fn ms(value: f64) -> String {
    format!("{value:.0}")
}

fn rate(value: Option<f64>) -> String {
    value.map_or("-".into(), |value| format!("{:.1}%", value * 100.0))
}

fn two_decimals(value: f64) -> String {
    format!("{value:.2}")
}

/// A figure's median across repeats, with its range `[min-max]` when the leg ran more than
/// once.
fn spread_cell(spread: Spread, runs: usize, format: fn(f64) -> String) -> String {
    if runs > 1 {
        format!(
            "{} [{}-{}]",
            format(spread.median),
            format(spread.min),
            format(spread.max)
        )
    } else {
        format(spread.median)
    }
}

fn rate_cell(spread: Option<Spread>, runs: usize) -> String {
    match spread {
        Some(spread) if runs > 1 => format!(
            "{} [{}-{}]",
            rate(Some(spread.median)),
            rate(Some(spread.min)),
            rate(Some(spread.max))
        ),
        Some(spread) => rate(Some(spread.median)),
        None => "-".into(),
    }
}

fn relative_change(before: f64, after: f64) -> String {
    if before == 0.0 {
        return "-".into();
    }
    format!("{:+.1}%", (after - before) / before * 100.0)
}

fn count_change(before: Option<u64>, after: Option<u64>) -> String {
    match (before, after) {
        (Some(before), Some(after)) => format!("{:+}", after as i128 - before as i128),
        _ => "-".into(),
    }
}

fn optional_count(value: Option<u64>) -> String {
    value.map_or("-".into(), |value| value.to_string())
}

/// The A/B table for two legs: metric | A | B | delta (B against A). Figures are medians
/// across repeats, with their ranges when a leg ran more than once; a delta whose two ranges
/// overlap says so.
fn comparison_table(a: &LegSummary, b: &LegSummary) -> Table {
    let spread_row = |label: &str, pick: fn(&LegSummary) -> Spread, format: fn(f64) -> String| {
        let (spread_a, spread_b) = (pick(a), pick(b));
        let mut delta = relative_change(spread_a.median, spread_b.median);
        if a.repeats.len() > 1 && b.repeats.len() > 1 && spread_a.overlaps(&spread_b) {
            delta.push_str(" (ranges overlap)");
        }
        vec![
            label.to_string(),
            spread_cell(spread_a, a.repeats.len(), format),
            spread_cell(spread_b, b.repeats.len(), format),
            delta,
        ]
    };
    let mut rows = vec![
        spread_row("TTFT P50 (ms)", |leg| leg.spread.ttft_p50_ms, ms),
        spread_row("TTFT P90 (ms)", |leg| leg.spread.ttft_p90_ms, ms),
        spread_row("TTFT P99 (ms)", |leg| leg.spread.ttft_p99_ms, ms),
        spread_row("TTFT P99.9 (ms)", |leg| leg.spread.ttft_p999_ms, ms),
        spread_row("E2E P99 (ms)", |leg| leg.spread.e2e_p99_ms, ms),
        spread_row(
            "Throughput (req/s)",
            |leg| leg.spread.throughput_rps,
            two_decimals,
        ),
        spread_row("Output (tok/s)", |leg| leg.spread.output_tokens_per_s, ms),
        vec![
            "Prefix-cache hit rate".into(),
            rate_cell(a.spread.cache_hit_rate, a.repeats.len()),
            rate_cell(b.spread.cache_hit_rate, b.repeats.len()),
            match (a.spread.cache_hit_rate, b.spread.cache_hit_rate) {
                (Some(a), Some(b)) => format!("{:+.1} pt", (b.median - a.median) * 100.0),
                _ => "-".into(),
            },
        ],
    ];
    for (label, pick) in [
        (
            "Requests",
            (|leg: &LegSummary| Some(leg.requests)) as fn(&LegSummary) -> Option<u64>,
        ),
        ("Errors", |leg| Some(leg.errors)),
        ("Downgrades", |leg| leg.downgrades),
        ("Evictions (blocks)", |leg| leg.evictions),
        ("Preemptions", |leg| Some(leg.preemptions)),
    ] {
        rows.push(vec![
            label.to_string(),
            optional_count(pick(a)),
            optional_count(pick(b)),
            count_change(pick(a), pick(b)),
        ]);
    }
    Table {
        header: vec![
            "metric".into(),
            a.name.clone(),
            b.name.clone(),
            "delta".into(),
        ],
        rows,
    }
}

/// One row per leg: medians across repeats, with ranges when a leg ran more than once; counts
/// are totals over the repeats.
fn legs_table(legs: &[LegSummary]) -> Table {
    Table {
        header: [
            "leg",
            "requests",
            "errors",
            "TTFT p50",
            "p90",
            "p99",
            "E2E p99",
            "req/s",
            "tok/s",
            "hit rate",
            "evictions",
            "preempt",
            "TTFT>2s",
            "downgrades",
            "2nd homes",
            "p99/oracle",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: legs
            .iter()
            .map(|leg| {
                let runs = leg.repeats.len();
                vec![
                    leg.name.clone(),
                    leg.requests.to_string(),
                    leg.errors.to_string(),
                    spread_cell(leg.spread.ttft_p50_ms, runs, ms),
                    spread_cell(leg.spread.ttft_p90_ms, runs, ms),
                    spread_cell(leg.spread.ttft_p99_ms, runs, ms),
                    spread_cell(leg.spread.e2e_p99_ms, runs, ms),
                    spread_cell(leg.spread.throughput_rps, runs, two_decimals),
                    spread_cell(leg.spread.output_tokens_per_s, runs, ms),
                    rate_cell(leg.spread.cache_hit_rate, runs),
                    optional_count(leg.evictions),
                    leg.preemptions.to_string(),
                    leg.slow_ttft_requests.to_string(),
                    optional_count(leg.downgrades),
                    optional_count(leg.replications),
                    leg.p99_ttft_vs_oracle
                        .map_or("-".into(), |ratio| format!("{ratio:.2}x")),
                ]
            })
            .collect(),
    }
}

/// Every repeat of every leg, when some leg ran more than once.
fn repeats_table(legs: &[LegSummary]) -> Option<Table> {
    if legs.iter().all(|leg| leg.repeats.len() < 2) {
        return None;
    }
    Some(Table {
        header: [
            "leg",
            "repeat",
            "requests",
            "errors",
            "TTFT p50",
            "p90",
            "p99",
            "E2E p99",
            "req/s",
            "hit rate",
            "TTFT>2s",
            "downgrades",
            "2nd homes",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: legs
            .iter()
            .flat_map(|leg| {
                leg.repeats.iter().map(|figures| {
                    vec![
                        leg.name.clone(),
                        figures.repeat.to_string(),
                        figures.requests.to_string(),
                        figures.errors.to_string(),
                        ms(figures.ttft_ms.p50),
                        ms(figures.ttft_ms.p90),
                        ms(figures.ttft_ms.p99),
                        ms(figures.e2e_ms.p99),
                        two_decimals(figures.throughput_rps),
                        rate(figures.cache_hit_rate),
                        figures.slow_ttft_requests.to_string(),
                        optional_count(figures.downgrades),
                        optional_count(figures.replications),
                    ]
                })
            })
            .collect(),
    })
}

/// What the repeats say about comparing legs: which ranges overlap, or that one run per leg
/// measured no spread.
fn spread_lines(report: &Report<'_>) -> Vec<String> {
    if report.legs.iter().all(|leg| leg.repeats.len() < 2) {
        return vec![
            "One run per leg: no spread measured. Run with --repeat 3 or more before drawing \
             conclusions between legs that are close."
                .into(),
        ];
    }
    if report.overlaps.is_empty() {
        return vec![format!(
            "Across {} repeats no two legs' TTFT P50 or P99 ranges overlap.",
            report.repeat
        )];
    }
    report
        .overlaps
        .iter()
        .map(|overlap| {
            format!(
                "OVERLAP: the {} ranges of {} ({}-{} ms) and {} ({}-{} ms) overlap across \
                 repeats: their difference is within repeat-to-repeat variation.",
                if overlap.metric == "ttft_p50_ms" {
                    "TTFT P50"
                } else {
                    "TTFT P99"
                },
                overlap.legs[0],
                ms(overlap.ranges[0][0]),
                ms(overlap.ranges[0][1]),
                overlap.legs[1],
                ms(overlap.ranges[1][0]),
                ms(overlap.ranges[1][1]),
            )
        })
        .collect()
}

/// The harness's own cost per leg.
fn harness_table(legs: &[LegSummary]) -> Table {
    Table {
        header: [
            "leg",
            "harness CPU/request (us)",
            "loop lag p99 (us)",
            "loop lag max (us)",
            "oracle probe p50/p99 (us)",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: legs
            .iter()
            .map(|leg| {
                vec![
                    leg.name.clone(),
                    format!("{:.0}", leg.harness.cpu_us_per_request),
                    leg.harness.loop_lag_p99_us.to_string(),
                    leg.harness.loop_lag_max_us.to_string(),
                    match (
                        leg.harness.oracle_probe_p50_us,
                        leg.harness.oracle_probe_p99_us,
                    ) {
                        (Some(p50), Some(p99)) => format!("{p50}/{p99}"),
                        _ => "-".into(),
                    },
                ]
            })
            .collect(),
    }
}

/// The routers' predicted time to first token against the observed one, per leg that
/// carried predictions (`None`: no leg did).
fn prediction_table(legs: &[LegSummary]) -> Option<Table> {
    let rows: Vec<Vec<String>> = legs
        .iter()
        .filter_map(|leg| {
            let prediction = leg.ttft_prediction?;
            let per_repeat: Vec<String> = leg
                .repeats
                .iter()
                .map(|repeat| {
                    repeat.ttft_prediction.map_or("-".into(), |figures| {
                        format!("{:.0}%", figures.relative_abs_error_p50 * 100.0)
                    })
                })
                .collect();
            Some(vec![
                leg.name.clone(),
                prediction.requests.to_string(),
                format!("{:+.0}", prediction.bias_ms),
                format!("{:.0}", prediction.abs_error_p50_ms),
                format!("{:.0}", prediction.abs_error_p99_ms),
                format!("{:.0}%", prediction.relative_abs_error_p50 * 100.0),
                format!("{:.0}%", prediction.relative_abs_error_p99 * 100.0),
                per_repeat.join(" "),
            ])
        })
        .collect();
    (!rows.is_empty()).then(|| Table {
        header: [
            "leg",
            "predicted",
            "bias (ms)",
            "|error| p50",
            "|error| p99",
            "|error|/TTFT p50",
            "p99",
            "p50 per repeat",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows,
    })
}

/// Warnings for legs the harness may have limited.
fn harness_warnings(legs: &[LegSummary], speedup: f64) -> Vec<String> {
    legs.iter()
        .filter(|leg| leg.harness.may_limit_leg)
        .map(|leg| {
            format!(
                "WARNING: on {} the harness's loop lag P99 ({:.0} ms simulated) is over {:.0}% of the leg's TTFT \
                 P99 ({:.0} ms): the harness may limit this leg; lower --speedup",
                leg.name,
                leg.harness.loop_lag_p99_us as f64 * speedup / 1000.0,
                crate::stats::HARNESS_LIMIT_FRACTION * 100.0,
                leg.ttft_ms.p99
            )
        })
        .collect()
}

fn gate_kind(gate: &Gate) -> &'static str {
    match gate.kind {
        crate::gates::GateKind::Validity => "validity",
        crate::gates::GateKind::Routing => "routing",
        crate::gates::GateKind::Machine => "machine",
    }
}

fn gates_lines(gates: &[Gate]) -> String {
    gates
        .iter()
        .map(|gate| {
            format!(
                "[{}] {} ({}): {}\n",
                if gate.passed { "PASS" } else { "FAIL" },
                gate.name,
                gate_kind(gate),
                gate.detail
            )
        })
        .collect()
}

fn verdict(gates: &[Gate]) -> String {
    let failed: Vec<&str> = gates
        .iter()
        .filter(|gate| !gate.passed)
        .map(|gate| gate.name)
        .collect();
    match crate::gates::verdict(gates) {
        Verdict::Valid => "VALID: every gate passed.".into(),
        Verdict::Invalid => format!(
            "INVALID: gate(s) failed: {}. Do not compare these legs.",
            failed.join(", ")
        ),
        Verdict::MachineTooBusy => format!(
            "MACHINE TOO BUSY: gate(s) failed: {}. The harness lagged behind the engines, so \
             these figures say nothing about routing (not a routing failure): rerun on a quieter \
             machine or with a lower --speedup.",
            failed.join(", ")
        ),
    }
}

/// The trace lines skipped before the run, when there were any.
fn skipped_line(report: &Report<'_>) -> Option<String> {
    let skipped = report.skipped_over_context.as_ref()?;
    if skipped.count == 0 {
        return None;
    }
    let shown: Vec<String> = skipped
        .lines
        .iter()
        .take(10)
        .map(|line| line.to_string())
        .collect();
    Some(format!(
        "Skipped {} trace line(s) whose prompt plus output exceed the engines' context of {} \
         tokens, on every leg alike (line {}{}).",
        skipped.count,
        skipped.context_tokens,
        shown.join(", "),
        if skipped.lines.len() > shown.len() {
            ", ..."
        } else {
            ""
        }
    ))
}

/// The text printed on stdout at the end of a run.
/// "1 router node", "3 router nodes, gossip on" or "3 router nodes, gossip off".
pub fn router_nodes_words(report: &Report<'_>) -> String {
    match report.router_nodes {
        0 | 1 => "1 router node".to_string(),
        nodes => format!(
            "{nodes} router nodes, gossip {}",
            if report.gossip { "on" } else { "off" }
        ),
    }
}

/// The engines in words: simulated with their profile, or the URLs of `--engine`.
fn engines_words(report: &Report<'_>) -> String {
    if report.external_engines.is_empty() {
        format!(
            "{} simulated engines, profile `{}`",
            report.workload.cluster.engines, report.workload.cluster.profile
        )
    } else {
        format!(
            "{} external engines ({})",
            report.external_engines.len(),
            report.external_engines.join(", ")
        )
    }
}

pub fn render_text(report: &Report<'_>) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "\nworkload {} | {} | {} | {} | speedup {} | times in {} ms\n\n",
        report.workload.name,
        report.traffic,
        engines_words(report),
        router_nodes_words(report),
        report.speedup,
        report.time_unit,
    ));
    if let Some(regime) = &report.regime {
        out.push_str(&regime.line(report.legs));
        out.push_str("\n\n");
    }
    if let Some(line) = skipped_line(report) {
        out.push_str(&line);
        out.push_str("\n\n");
    }
    if let [a, b, ..] = report.legs {
        out.push_str(&comparison_table(a, b).plain());
        out.push('\n');
    }
    out.push_str(&legs_table(report.legs).plain());
    out.push('\n');
    if let Some(repeats) = repeats_table(report.legs) {
        out.push_str(&repeats.plain());
        out.push('\n');
    }
    for line in spread_lines(report) {
        out.push_str(&line);
        out.push('\n');
    }
    out.push('\n');
    if let Some(table) = prediction_table(report.legs) {
        out.push_str(&format!(
            "predicted TTFT against observed ({} ms; error = predicted - observed)\n",
            report.time_unit
        ));
        out.push_str(&table.plain());
        out.push('\n');
    }
    out.push_str(&harness_table(report.legs).plain());
    for warning in harness_warnings(report.legs, report.speedup) {
        out.push_str(&warning);
        out.push('\n');
    }
    out.push('\n');
    out.push_str(&gates_lines(report.gates));
    out.push_str(&verdict(report.gates));
    out.push('\n');
    out
}

/// report.md.
pub fn render_markdown(report: &Report<'_>, plots: &[(&str, &str)]) -> String {
    let workload = report.workload;
    let mut out = format!(
        "# myelin bench: {}\n\n{}\n\n- command: `{}`\n- generated: {} (myelin {})\n- cluster: {}, \
         {} KV blocks of {} tokens each, speedup {}\n- routers: {}\n- traffic: {}; duration {} s, warm-up {} s \
         ({}), repeats: {}\n- latencies in {} milliseconds{}; rates per {} \
         second\n\n",
        workload.name,
        workload.description,
        report.command,
        report.generated_at,
        report.myelin_version,
        engines_words(report),
        workload.cluster.kv_blocks,
        workload.cluster.block_size,
        report.speedup,
        router_nodes_words(report),
        report.traffic,
        workload.duration_s,
        workload.warmup_s,
        report.time_unit,
        report.repeat,
        report.time_unit,
        if report.time_unit == "simulated" {
            " (wall time x speedup)"
        } else {
            ""
        },
        report.time_unit,
    );
    if let Some(regime) = &report.regime {
        out.push_str(&format!("{}\n\n", regime.line(report.legs)));
    }
    if let Some(line) = skipped_line(report) {
        out.push_str(&format!("{line}\n\n"));
    }
    if let [a, b, ..] = report.legs {
        out.push_str(&format!("## {} vs {}\n\n", a.name, b.name));
        out.push_str(&comparison_table(a, b).markdown());
        out.push('\n');
    }
    out.push_str("## All legs\n\n");
    out.push_str(&legs_table(report.legs).markdown());
    if let Some(repeats) = repeats_table(report.legs) {
        out.push_str("\n## Repeats\n\n");
        out.push_str(&repeats.markdown());
    }
    out.push('\n');
    for line in spread_lines(report) {
        out.push_str(&format!("{line}\n"));
    }
    if let Some(table) = prediction_table(report.legs) {
        out.push_str(
            "\n## Predicted TTFT\n\nThe router's predicted time to first token (`x-myelin-predicted-ttft-us`, \
             the oracle's own prediction) against the observed one; error = predicted − observed.\n\n",
        );
        out.push_str(&table.markdown());
    }
    out.push_str("\n## Harness cost\n\n");
    out.push_str(&harness_table(report.legs).markdown());
    for warning in harness_warnings(report.legs, report.speedup) {
        out.push_str(&format!("\n{warning}\n"));
    }
    out.push_str("\n## Gates\n\n");
    for gate in report.gates {
        out.push_str(&format!(
            "- {} **{}** ({}): {}\n",
            if gate.passed { "PASS" } else { "FAIL" },
            gate.name,
            gate_kind(gate),
            gate.detail
        ));
    }
    out.push_str(&format!("\n{}\n", verdict(report.gates)));
    if !plots.is_empty() {
        out.push_str("\n## Plots\n\n");
        for (title, file) in plots {
            out.push_str(&format!("![{title}]({file})\n\n"));
        }
    }
    out
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`, and as `YYYYMMDD-HHMMSS` for directory
/// names.
pub fn utc_now() -> (String, String) {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs());
    let (year, month, day) = civil_from_days((seconds / 86_400) as i64);
    let (hour, minute, second) = (seconds / 3600 % 24, seconds / 60 % 60, seconds % 60);
    (
        format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z"),
        format!("{year:04}{month:02}{day:02}-{hour:02}{minute:02}{second:02}"),
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day), by the era arithmetic
/// in Howard Hinnant's "chrono-compatible low-level date algorithms".
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gates::evaluate;
    use crate::legs::LegKind;
    use crate::stats::summarize_all;
    use crate::stats::tests::run;

    #[test]
    fn dates_convert() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_786), (2026, 11, 29));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }

    #[test]
    fn report_renders_the_ab_table_with_deltas_and_the_verdict() {
        let runs = vec![
            run(
                "prefix+off",
                LegKind::Prefix(crate::legs::Residency::Off),
                &[280_000],
            ),
            run("oracle", LegKind::Oracle, &[120_000]),
        ];
        let legs = summarize_all(&runs);
        let gates = evaluate(&legs, &[]);
        let workload = WorkloadConfig::load("churn").unwrap();
        let report = Report {
            schema_version: REPORT_SCHEMA_VERSION,
            myelin_version: "test",
            generated_at: "now".into(),
            command: "myelin bench".into(),
            time_unit: "simulated",
            speedup: 10.0,
            repeat: 1,
            quick: false,
            workload: &workload,
            traffic: "60 closed-loop users".into(),
            router_nodes: 1,
            external_engines: Vec::new(),
            gossip: false,
            skipped_over_context: None,
            regime: None,
            legs: &legs,
            overlaps: &[],
            gates: &gates,
            passed: true,
        };
        let text = render_text(&report);
        let p99_line = text
            .lines()
            .find(|line| line.starts_with("TTFT P99 (ms)"))
            .unwrap();
        // 280 ms and 120 ms wall at speedup 10: 2800 -> 1200 simulated, -57.1%.
        let cells: Vec<&str> = p99_line.split_whitespace().collect();
        let before: f64 = cells[3].parse().unwrap();
        assert!((before - 2800.0).abs() <= 2800.0 * 0.001, "{p99_line}");
        assert!(p99_line.ends_with("-57.1%"), "{p99_line}");
        assert!(text.contains("VALID: every gate passed."));
        let markdown = render_markdown(&report, &[("TTFT CDF", "ttft_cdf.png")]);
        assert!(markdown.contains("| metric | prefix+off | oracle | delta |"));
        assert!(markdown.contains("![TTFT CDF](ttft_cdf.png)"));
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!(json["legs"][0]["name"], "prefix+off");
        for key in [
            "requests",
            "errors",
            "downgrades",
            "throughput_rps",
            "cache_hit_rate",
        ] {
            assert!(json["legs"][0].get(key).is_some(), "missing {key}");
        }
        assert!(json["legs"][0]["ttft_ms"]["p99"].as_f64().unwrap() > 2700.0);
        assert_eq!(json["legs"][1]["downgrades"], serde_json::Value::Null);
        assert_eq!(json["legs"][0]["repeats"].as_array().unwrap().len(), 1);
        assert!(text.contains("One run per leg: no spread measured"));
        assert!(!text.contains("(ranges overlap)"));
    }

    #[test]
    fn repeats_show_median_and_range_per_repeat_rows_and_overlaps() {
        let leg = |name: &str, repeat: u32, ttft_us: u64| {
            let mut leg = run(name, LegKind::RoundRobin, &[ttft_us]);
            leg.repeat = repeat;
            leg
        };
        // a: 1 s, 3 s, 2 s; b: 2.5 s, 2.6 s, 2.55 s (simulated, speedup 10).
        let runs = vec![
            leg("a", 0, 100_000),
            leg("b", 0, 250_000),
            leg("b", 1, 260_000),
            leg("a", 1, 300_000),
            leg("a", 2, 200_000),
            leg("b", 2, 255_000),
        ];
        let legs = summarize_all(&runs);
        let overlaps = crate::stats::overlaps(&legs);
        let gates = evaluate(&legs, &[]);
        let workload = WorkloadConfig::load("churn").unwrap();
        let report = Report {
            schema_version: REPORT_SCHEMA_VERSION,
            myelin_version: "test",
            generated_at: "now".into(),
            command: "myelin bench --repeat 3".into(),
            time_unit: "simulated",
            speedup: 10.0,
            repeat: 3,
            quick: false,
            workload: &workload,
            traffic: "60 closed-loop users".into(),
            router_nodes: 1,
            external_engines: Vec::new(),
            gossip: false,
            skipped_over_context: None,
            regime: None,
            legs: &legs,
            overlaps: &overlaps,
            gates: &gates,
            passed: true,
        };
        let text = render_text(&report);
        let p99_line = text
            .lines()
            .find(|line| line.starts_with("TTFT P99 (ms)"))
            .unwrap();
        // Histogram values are exact to 0.1%: 2 s reads 2001 ms.
        assert!(p99_line.contains("2001 [1000-3000]"), "{p99_line}");
        assert!(p99_line.contains("2551 [2501-2601]"), "{p99_line}");
        assert!(p99_line.ends_with("+27.5% (ranges overlap)"), "{p99_line}");
        assert!(
            text.contains("OVERLAP: the TTFT P99 ranges of a (1000-3000 ms) and b (2501-2601 ms)"),
            "{text}"
        );
        // One row per repeat: three for each leg.
        let repeat_rows: Vec<(String, String)> = text
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|cells| cells.len() == 13 && cells[2] == "1")
            .map(|cells| (cells[0].to_string(), cells[1].to_string()))
            .collect();
        assert_eq!(repeat_rows.len(), 6, "{text}");
        assert_eq!(repeat_rows[2], ("a".to_string(), "3".to_string()));
        let markdown = render_markdown(&report, &[]);
        assert!(markdown.contains("## Repeats"));
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!(json["schema_version"], 2);
        let repeats = json["legs"][0]["repeats"].as_array().unwrap();
        assert_eq!(repeats.len(), 3);
        assert_eq!(repeats[1]["repeat"], 2);
        assert!((repeats[1]["ttft_ms"]["p99"].as_f64().unwrap() - 3000.0).abs() < 3.0);
        // Its TTFT over 2 s is a slow request; the first repeat's 1 s is not.
        assert_eq!(repeats[1]["slow_ttft_requests"], 1);
        assert_eq!(repeats[0]["slow_ttft_requests"], 0);
        assert!(
            (json["legs"][0]["spread"]["ttft_p99_ms"]["median"]
                .as_f64()
                .unwrap()
                - 2000.0)
                .abs()
                < 2.0
        );
        assert_eq!(json["overlaps"][0]["legs"][1], "b");
    }
}
