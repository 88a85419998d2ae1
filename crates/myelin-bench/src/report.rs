//! The run's report: the A/B table (metric | leg A | leg B | delta), the all-legs table, the
//! gates, as text for stdout and as report.md / report.json.

use serde::Serialize;

use crate::gates::Gate;
use crate::stats::LegSummary;
use crate::workload::WorkloadConfig;

/// report.json's schema version (docs/benchmark.md describes the schema).
pub const REPORT_SCHEMA_VERSION: u32 = 1;

/// Everything report.json holds.
#[derive(Debug, Serialize)]
pub struct Report<'a> {
    pub schema_version: u32,
    pub myelin_version: &'static str,
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub generated_at: String,
    /// The command line that produced the run.
    pub command: String,
    /// Latencies and rates are in simulated time: wall time x speedup.
    pub time_unit: &'static str,
    pub speedup: f64,
    pub repeat: u32,
    pub quick: bool,
    pub workload: &'a WorkloadConfig,
    pub legs: &'a [LegSummary],
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

/// The A/B table for two legs: metric | A | B | delta (B against A).
fn comparison_table(a: &LegSummary, b: &LegSummary) -> Table {
    let latency_row = |label: &str, pick: fn(&LegSummary) -> f64| {
        vec![
            label.to_string(),
            ms(pick(a)),
            ms(pick(b)),
            relative_change(pick(a), pick(b)),
        ]
    };
    let mut rows = vec![
        latency_row("TTFT P50 (ms)", |leg| leg.ttft_ms.p50),
        latency_row("TTFT P90 (ms)", |leg| leg.ttft_ms.p90),
        latency_row("TTFT P99 (ms)", |leg| leg.ttft_ms.p99),
        latency_row("TTFT P99.9 (ms)", |leg| leg.ttft_ms.p999),
        latency_row("E2E P99 (ms)", |leg| leg.e2e_ms.p99),
        vec![
            "Throughput (req/s)".into(),
            format!("{:.2}", a.throughput_rps),
            format!("{:.2}", b.throughput_rps),
            relative_change(a.throughput_rps, b.throughput_rps),
        ],
        vec![
            "Output (tok/s)".into(),
            format!("{:.0}", a.output_tokens_per_s),
            format!("{:.0}", b.output_tokens_per_s),
            relative_change(a.output_tokens_per_s, b.output_tokens_per_s),
        ],
        vec![
            "Prefix-cache hit rate".into(),
            rate(a.cache_hit_rate),
            rate(b.cache_hit_rate),
            match (a.cache_hit_rate, b.cache_hit_rate) {
                (Some(a), Some(b)) => format!("{:+.1} pt", (b - a) * 100.0),
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
        ("Evictions (blocks)", |leg| Some(leg.evictions)),
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

/// One row per leg.
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
            "downgrades",
            "p99/oracle",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: legs
            .iter()
            .map(|leg| {
                vec![
                    leg.name.clone(),
                    leg.requests.to_string(),
                    leg.errors.to_string(),
                    ms(leg.ttft_ms.p50),
                    ms(leg.ttft_ms.p90),
                    ms(leg.ttft_ms.p99),
                    ms(leg.e2e_ms.p99),
                    format!("{:.2}", leg.throughput_rps),
                    format!("{:.0}", leg.output_tokens_per_s),
                    rate(leg.cache_hit_rate),
                    leg.evictions.to_string(),
                    leg.preemptions.to_string(),
                    optional_count(leg.downgrades),
                    leg.p99_ttft_vs_oracle
                        .map_or("-".into(), |ratio| format!("{ratio:.2}x")),
                ]
            })
            .collect(),
    }
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

fn gates_lines(gates: &[Gate]) -> String {
    gates
        .iter()
        .map(|gate| {
            format!(
                "[{}] {}: {}\n",
                if gate.passed { "PASS" } else { "FAIL" },
                gate.name,
                gate.detail
            )
        })
        .collect()
}

fn verdict(gates: &[Gate]) -> String {
    if gates.iter().all(|gate| gate.passed) {
        "VALID: every gate passed.".into()
    } else {
        let failed: Vec<&str> = gates
            .iter()
            .filter(|gate| !gate.passed)
            .map(|gate| gate.name)
            .collect();
        format!(
            "INVALID: gate(s) failed: {}. Do not compare these legs.",
            failed.join(", ")
        )
    }
}

/// The text printed on stdout at the end of a run.
pub fn render_text(report: &Report<'_>) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "\nworkload {} | {} engines | {} | speedup {} | times in simulated ms\n\n",
        report.workload.name,
        report.workload.cluster.engines,
        report.workload.cluster.profile,
        report.speedup
    ));
    if let [a, b, ..] = report.legs {
        out.push_str(&comparison_table(a, b).plain());
        out.push('\n');
    }
    out.push_str(&legs_table(report.legs).plain());
    out.push('\n');
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
        "# myelin bench: {}\n\n{}\n\n- command: `{}`\n- generated: {} (myelin {})\n- cluster: {} simulated engines, \
         profile `{}`, {} KV blocks of {} tokens each, speedup {}\n- users: {}, duration {} s, warm-up {} s \
         (simulated), repeats: {}\n- latencies in simulated milliseconds (wall time x speedup); rates per simulated \
         second\n\n",
        workload.name,
        workload.description,
        report.command,
        report.generated_at,
        report.myelin_version,
        workload.cluster.engines,
        workload.cluster.profile,
        workload.cluster.kv_blocks,
        workload.cluster.block_size,
        report.speedup,
        workload.users,
        workload.duration_s,
        workload.warmup_s,
        report.repeat,
    );
    if let [a, b, ..] = report.legs {
        out.push_str(&format!("## {} vs {}\n\n", a.name, b.name));
        out.push_str(&comparison_table(a, b).markdown());
        out.push('\n');
    }
    out.push_str("## All legs\n\n");
    out.push_str(&legs_table(report.legs).markdown());
    out.push_str("\n## Harness cost\n\n");
    out.push_str(&harness_table(report.legs).markdown());
    for warning in harness_warnings(report.legs, report.speedup) {
        out.push_str(&format!("\n{warning}\n"));
    }
    out.push_str("\n## Gates\n\n");
    for gate in report.gates {
        out.push_str(&format!(
            "- {} **{}**: {}\n",
            if gate.passed { "PASS" } else { "FAIL" },
            gate.name,
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
            legs: &legs,
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
    }
}
