//! The grid's outputs: report.json, report.md, the text summary and the heatmaps (the default
//! leg's TTFT P99 and P50 against the better of least-load and prefix+off, one PNG each).

use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::grid::{Cell, CellPlan, ratio_name};
use super::verdict::{
    BASELINES, DEFAULT_LEG, LegFigures, P50_TARGET, P99_TARGET, RatioCheck, RegimeFigures,
    THROUGHPUT_NOISE, Verdict,
};
use crate::plot::{PlotError, register_font};
use crate::report::Table;

/// report.json's schema version for the grid.
pub const GRID_SCHEMA_VERSION: u32 = 1;

/// The targets a cell is judged on.
#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    pub default_leg: &'static str,
    pub baselines: [&'static str; 2],
    pub p99_at_most: f64,
    pub p50_at_most: f64,
    pub throughput_noise: f64,
    pub errors: u64,
}

impl Default for Targets {
    fn default() -> Self {
        Targets {
            default_leg: DEFAULT_LEG,
            baselines: BASELINES,
            p99_at_most: P99_TARGET,
            p50_at_most: P50_TARGET,
            throughput_noise: THROUGHPUT_NOISE,
            errors: 0,
        }
    }
}

/// How a cell was set up (its plan without the workload, which is the cell's workload.json).
#[derive(Debug, Clone, Serialize)]
pub struct PlanFigures {
    pub working_set_tokens: u64,
    pub working_set: String,
    pub kv_blocks: u32,
    pub working_set_ratio: f64,
    pub capacity_rps: f64,
    pub rate_rps: f64,
    pub speedup: f64,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub time_scale: Option<f64>,
}

impl From<&CellPlan> for PlanFigures {
    fn from(plan: &CellPlan) -> Self {
        PlanFigures {
            working_set_tokens: plan.working_set_tokens,
            working_set: plan.working_set.clone(),
            kv_blocks: plan.kv_blocks,
            working_set_ratio: plan.working_set_ratio,
            capacity_rps: plan.capacity_rps,
            rate_rps: plan.rate_rps,
            speedup: plan.speedup,
            duration_s: plan.duration_s,
            warmup_s: plan.warmup_s,
            time_scale: plan.time_scale,
        }
    }
}

/// One cell's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct CellOutcome {
    pub name: String,
    pub cell: Cell,
    /// The cell's directory, relative to the grid's output directory.
    pub dir: String,
    pub plan: PlanFigures,
    /// The regime the cell's run measured (its report's regime line).
    pub regime: Option<RegimeFigures>,
    pub legs: Vec<LegFigures>,
    pub verdict: Option<Verdict>,
    /// Why the cell has no verdict (it could not run, or its report could not be read).
    pub error: Option<String>,
    /// Whether the cell's own validity gates passed (errors, cache pressure, downgrades: for
    /// information; the grid judges the targets).
    pub gates_passed: Option<bool>,
    pub wall_s: f64,
    /// The command that reruns the cell alone.
    pub reproduce: String,
}

impl CellOutcome {
    /// `PASS`, `FAIL (...)`, or `ERROR`.
    pub fn verdict_text(&self) -> String {
        match (&self.verdict, &self.error) {
            (Some(verdict), _) => verdict.describe(),
            (None, Some(_)) => "ERROR".into(),
            (None, None) => "-".into(),
        }
    }

    fn passed(&self) -> bool {
        self.verdict.as_ref().is_some_and(|verdict| verdict.passed)
    }
}

/// A cell rerun at twice its duration against its run at its own.
#[derive(Debug, Clone, Serialize)]
pub struct DurationCheck {
    pub cell: String,
    pub duration_s: f64,
    pub longer_duration_s: f64,
    pub verdict: String,
    pub longer_verdict: String,
    pub p99_ratio: Option<f64>,
    pub longer_p99_ratio: Option<f64>,
    pub p50_ratio: Option<f64>,
    pub longer_p50_ratio: Option<f64>,
    /// Whether both runs reached the same verdict (pass or fail, and the same targets missed).
    pub same_verdict: bool,
}

impl DurationCheck {
    /// Compares a cell's outcome with its rerun at twice the duration.
    pub fn of(short: &CellOutcome, long: &CellOutcome) -> DurationCheck {
        let ratio = |outcome: &CellOutcome, pick: fn(&Verdict) -> &Option<RatioCheck>| {
            outcome
                .verdict
                .as_ref()
                .and_then(|verdict| pick(verdict).as_ref().map(|check| check.ratio))
        };
        DurationCheck {
            cell: short.name.clone(),
            duration_s: short.plan.duration_s,
            longer_duration_s: long.plan.duration_s,
            verdict: short.verdict_text(),
            longer_verdict: long.verdict_text(),
            p99_ratio: ratio(short, |verdict| &verdict.p99),
            longer_p99_ratio: ratio(long, |verdict| &verdict.p99),
            p50_ratio: ratio(short, |verdict| &verdict.p50),
            longer_p50_ratio: ratio(long, |verdict| &verdict.p50),
            same_verdict: short.verdict_text() == long.verdict_text() && short.verdict.is_some(),
        }
    }
}

/// The grid's report.json.
#[derive(Debug, Clone, Serialize)]
pub struct GridReport {
    pub schema_version: u32,
    pub myelin_version: &'static str,
    pub generated_at: String,
    pub command: String,
    pub quick: bool,
    pub legs: Vec<String>,
    pub repeat: u32,
    pub time_unit: &'static str,
    pub targets: Targets,
    pub cells: Vec<CellOutcome>,
    pub duration_check: Vec<DurationCheck>,
    /// Every cell of the grid ran (false when interrupted).
    pub complete: bool,
    pub cells_passed: usize,
    pub cells_failed: usize,
    /// Cells without a verdict (they could not run).
    pub cells_errored: usize,
    /// Every cell ran and met every target.
    pub passed: bool,
}

impl GridReport {
    /// Counts the outcomes and sets `passed`.
    pub fn tally(&mut self) {
        self.cells_passed = self.cells.iter().filter(|cell| cell.passed()).count();
        self.cells_errored = self
            .cells
            .iter()
            .filter(|cell| cell.verdict.is_none())
            .count();
        self.cells_failed = self.cells.len() - self.cells_passed - self.cells_errored;
        self.passed =
            self.complete && !self.cells.is_empty() && self.cells_passed == self.cells.len();
    }

    /// The overall verdict line.
    pub fn overall_line(&self) -> String {
        format!(
            "regime grid: {} — {} of {} cells met every target ({} failed, {} could not run){}",
            if self.passed { "PASS" } else { "FAIL" },
            self.cells_passed,
            self.cells.len(),
            self.cells_failed,
            self.cells_errored,
            if self.complete {
                ""
            } else {
                "; INCOMPLETE (interrupted)"
            }
        )
    }
}

fn ratio_cell(check: &Option<RatioCheck>) -> String {
    check.as_ref().map_or("-".into(), |check| {
        format!(
            "{:.0}/{:.0} {} = {:.2}x",
            check.default_ms, check.baseline_ms, check.baseline_leg, check.ratio
        )
    })
}

fn percent(value: Option<f64>) -> String {
    value.map_or("-".into(), |value| format!("{:.1}%", value * 100.0))
}

/// The cells table: one row per cell.
pub(crate) fn cells_table(cells: &[CellOutcome]) -> Table {
    Table {
        header: [
            "cell",
            "ws/KV",
            "load",
            "resident",
            "kv blocks",
            "req/s",
            "speedup",
            "P99 default/best",
            "P50 default/best",
            "throughput",
            "errors",
            "verdict",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: cells
            .iter()
            .map(|outcome| {
                let regime = outcome.regime.as_ref();
                let verdict = outcome.verdict.as_ref();
                vec![
                    outcome.name.clone(),
                    format!(
                        "{:.2}",
                        regime.map_or(outcome.plan.working_set_ratio, |regime| regime
                            .working_set_ratio)
                    ),
                    regime
                        .and_then(|regime| regime.offered_load)
                        .map_or("-".into(), |load| format!("{load:.2}")),
                    percent(regime.and_then(|regime| regime.prefix_resident_share)),
                    outcome.plan.kv_blocks.to_string(),
                    format!("{:.2}", outcome.plan.rate_rps),
                    ratio_name(outcome.plan.speedup),
                    verdict.map_or("-".into(), |verdict| ratio_cell(&verdict.p99)),
                    verdict.map_or("-".into(), |verdict| ratio_cell(&verdict.p50)),
                    verdict.map_or("-".into(), |verdict| {
                        let cells: Vec<String> = verdict
                            .throughput
                            .iter()
                            .map(|(leg, theirs, ours, ok)| {
                                format!(
                                    "{ours:.2} vs {theirs:.2} {leg}{}",
                                    if *ok { "" } else { " LOW" }
                                )
                            })
                            .collect();
                        cells.join("; ")
                    }),
                    verdict.map_or("-".into(), |verdict| verdict.errors.to_string()),
                    outcome.verdict_text(),
                ]
            })
            .collect(),
    }
}

/// The duration check table.
pub(crate) fn duration_table(checks: &[DurationCheck]) -> Table {
    let ratio = |value: Option<f64>| value.map_or("-".into(), |value| format!("{value:.2}x"));
    Table {
        header: [
            "cell",
            "duration",
            "verdict",
            "P99 ratio",
            "P50 ratio",
            "2x duration",
            "verdict",
            "P99 ratio",
            "P50 ratio",
            "same verdict",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: checks
            .iter()
            .map(|check| {
                vec![
                    check.cell.clone(),
                    format!("{:.0} s", check.duration_s),
                    check.verdict.clone(),
                    ratio(check.p99_ratio),
                    ratio(check.p50_ratio),
                    format!("{:.0} s", check.longer_duration_s),
                    check.longer_verdict.clone(),
                    ratio(check.longer_p99_ratio),
                    ratio(check.longer_p50_ratio),
                    if check.same_verdict { "yes" } else { "NO" }.into(),
                ]
            })
            .collect(),
    }
}

/// The text printed at the end of a grid run.
pub fn render_text(report: &GridReport) -> String {
    let mut out = String::from("\n");
    out.push_str(&cells_table(&report.cells).plain());
    if !report.duration_check.is_empty() {
        out.push_str("\nDuration check (each cell rerun at twice its duration):\n");
        out.push_str(&duration_table(&report.duration_check).plain());
    }
    out.push('\n');
    out.push_str(&report.overall_line());
    out.push('\n');
    out
}

/// report.md.
pub fn render_markdown(report: &GridReport, heatmaps: &[(&str, &str)]) -> String {
    let targets = &report.targets;
    let mut out = format!(
        "# myelin bench regimes{}\n\n- command: `{}`\n- generated: {} (myelin {})\n- legs: {}; \
         repeats: {}\n- latencies in simulated milliseconds\n- targets per cell (medians across \
         repeats): `{}` TTFT P99 at most {:.2}x and P50 at most {:.2}x the better of {}; \
         throughput not lower than either's (within {:.0}%, or overlapping ranges); {} errors\n\n{}\n\n",
        if report.quick { " --quick" } else { "" },
        report.command,
        report.generated_at,
        report.myelin_version,
        report.legs.join(", "),
        report.repeat,
        targets.default_leg,
        targets.p99_at_most,
        targets.p50_at_most,
        targets.baselines.join(" and "),
        targets.throughput_noise * 100.0,
        targets.errors,
        report.overall_line(),
    );
    out.push_str("## Cells\n\n");
    out.push_str(&cells_table(&report.cells).markdown());
    out.push_str(
        "\nws/KV: working set / KV capacity; load: offered load / capacity; resident: the share \
         of requests (every leg) whose reusable prefix some engine held at send time. Each \
         cell's directory (`cells/NAME/`) holds its report, its workload.json and the command \
         that reruns it.\n",
    );
    let errors: Vec<&CellOutcome> = report
        .cells
        .iter()
        .filter(|cell| cell.error.is_some())
        .collect();
    if !errors.is_empty() {
        out.push_str("\n## Cells that could not run\n\n");
        for cell in errors {
            out.push_str(&format!(
                "- {}: {}\n",
                cell.name,
                cell.error.as_deref().unwrap_or_default()
            ));
        }
    }
    if !report.duration_check.is_empty() {
        out.push_str("\n## Duration check\n\nEach cell rerun at twice its duration (same rate, warm-up and speedup):\n\n");
        out.push_str(&duration_table(&report.duration_check).markdown());
    }
    if !heatmaps.is_empty() {
        out.push_str("\n## Heatmaps\n\n");
        for (title, file) in heatmaps {
            out.push_str(&format!("![{title}]({file})\n\n"));
        }
    }
    out.push_str("\n## Rerun a cell\n\n");
    for cell in &report.cells {
        out.push_str(&format!("- {}: `{}`\n", cell.name, cell.reproduce));
    }
    out
}

/// One heatmap cell: the ratio and whether the target was met.
pub type HeatValue = Option<(f64, bool)>;

/// Which of a verdict's ratio checks a figure shows.
pub type RatioPick = fn(&Verdict) -> &Option<RatioCheck>;

/// A heatmap of `values[row][column]`: ratios coloured green below 1, white at 1, red above
/// (log scale, saturating at 0.71x and 1.41x), each cell labelled with its ratio; cells
/// without a value grey.
pub fn heatmap(
    path: &Path,
    title: &str,
    rows: &[String],
    columns: &[String],
    values: &[Vec<HeatValue>],
) -> Result<(), PlotError> {
    register_font()?;
    let draw = |message: String| PlotError::Draw {
        path: path.display().to_string(),
        message,
    };
    let (left, top, cell_w, cell_h) = (230i32, 90i32, 150i32, 56i32);
    let width = (left + cell_w * columns.len().max(1) as i32 + 40) as u32;
    let height = (top + cell_h * rows.len().max(1) as i32 + 70) as u32;
    let root = BitMapBackend::new(path, (width.max(1000), height)).into_drawing_area();
    root.fill(&WHITE).map_err(|error| draw(error.to_string()))?;
    let font = |size: u32| ("sans-serif", size).into_font();
    root.draw(&Text::new(title.to_string(), (20, 20), font(22)))
        .map_err(|error| draw(error.to_string()))?;
    root.draw(&Text::new(
        "columns: working set / KV capacity; rows: shape @ offered load; green below 1.0x, red above"
            .to_string(),
        (20, 50),
        font(15),
    ))
    .map_err(|error| draw(error.to_string()))?;
    for (column, name) in columns.iter().enumerate() {
        let x = left + column as i32 * cell_w + cell_w / 2 - 20;
        root.draw(&Text::new(format!("{name}x"), (x, top - 22), font(16)))
            .map_err(|error| draw(error.to_string()))?;
    }
    for (row, name) in rows.iter().enumerate() {
        let y = top + row as i32 * cell_h;
        root.draw(&Text::new(name.clone(), (15, y + cell_h / 2 - 9), font(16)))
            .map_err(|error| draw(error.to_string()))?;
        for column in 0..columns.len() {
            let x = left + column as i32 * cell_w;
            let value = values
                .get(row)
                .and_then(|row| row.get(column))
                .copied()
                .flatten();
            let color = match value {
                Some((ratio, _)) => ratio_color(ratio),
                None => RGBColor(215, 215, 215),
            };
            root.draw(&Rectangle::new(
                [(x, y), (x + cell_w - 3, y + cell_h - 3)],
                color.filled(),
            ))
            .map_err(|error| draw(error.to_string()))?;
            let label = match value {
                Some((ratio, passed)) => {
                    format!("{ratio:.2}x{}", if passed { "" } else { " miss" })
                }
                None => "-".into(),
            };
            root.draw(&Text::new(label, (x + 22, y + cell_h / 2 - 10), font(18)))
                .map_err(|error| draw(error.to_string()))?;
        }
    }
    root.present().map_err(|error| draw(error.to_string()))?;
    Ok(())
}

/// Green (0.71x or lower) through white (1.0x) to red (1.41x or higher), on a log scale.
pub fn ratio_color(ratio: f64) -> RGBColor {
    let position = if ratio.is_finite() && ratio > 0.0 {
        (ratio.log2() * 2.0).clamp(-1.0, 1.0)
    } else {
        1.0
    };
    let fade = |full: u8, amount: f64| (255.0 - (255.0 - f64::from(full)) * amount).round() as u8;
    if position <= 0.0 {
        let amount = -position;
        RGBColor(fade(60, amount), fade(170, amount), fade(75, amount))
    } else {
        RGBColor(fade(215, position), fade(50, position), fade(45, position))
    }
}

/// The heatmaps' rows (`shape @ load%`) and columns (working sets), in grid order, and each
/// figure's values.
pub fn heat_values(
    cells: &[CellOutcome],
    pick: RatioPick,
) -> (Vec<String>, Vec<String>, Vec<Vec<HeatValue>>) {
    let mut rows: Vec<(String, String, f64)> = Vec::new();
    let mut columns: Vec<f64> = Vec::new();
    for outcome in cells {
        let row = (
            format!(
                "{} @ {}%",
                outcome.cell.shape.name(),
                ratio_name(outcome.cell.load * 100.0)
            ),
            outcome.cell.shape.name().to_string(),
            outcome.cell.load,
        );
        if !rows.iter().any(|existing| existing.0 == row.0) {
            rows.push(row);
        }
        if !columns.contains(&outcome.cell.working_set) {
            columns.push(outcome.cell.working_set);
        }
    }
    columns.sort_by(f64::total_cmp);
    let values = rows
        .iter()
        .map(|(_, shape, load)| {
            columns
                .iter()
                .map(|working_set| {
                    cells
                        .iter()
                        .find(|outcome| {
                            outcome.cell.shape.name() == shape
                                && outcome.cell.load == *load
                                && outcome.cell.working_set == *working_set
                        })
                        .and_then(|outcome| outcome.verdict.as_ref())
                        .and_then(|verdict| pick(verdict).as_ref())
                        .map(|check| (check.ratio, check.passed))
                })
                .collect()
        })
        .collect();
    (
        rows.into_iter().map(|row| row.0).collect(),
        columns.iter().map(|value| ratio_name(*value)).collect(),
        values,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::regimes::grid::Shape;
    use crate::regimes::verdict::{LegSpread, Spread, judge};

    fn outcome(shape: Shape, working_set: f64, p99: f64) -> CellOutcome {
        let cell = Cell {
            shape,
            working_set,
            load: 0.6,
        };
        let leg = |name: &str, p99: f64| LegFigures {
            name: name.into(),
            runs: 1,
            requests: 10,
            errors: 0,
            spread: LegSpread {
                ttft_p50_ms: Spread {
                    median: 50.0,
                    min: 50.0,
                    max: 50.0,
                },
                ttft_p99_ms: Spread {
                    median: p99,
                    min: p99,
                    max: p99,
                },
                throughput_rps: Spread {
                    median: 3.0,
                    min: 3.0,
                    max: 3.0,
                },
            },
            cache_hit_rate: None,
            prefix_resident_share: None,
        };
        let legs = vec![
            leg("least-load", 1000.0),
            leg("prefix+off", 1200.0),
            leg("prefix+auto", p99),
        ];
        CellOutcome {
            name: cell.name(),
            cell,
            dir: format!("cells/{}", cell.name()),
            plan: PlanFigures {
                working_set_tokens: 1,
                working_set: String::new(),
                kv_blocks: 100,
                working_set_ratio: working_set,
                capacity_rps: 5.0,
                rate_rps: 3.0,
                speedup: 10.0,
                duration_s: 150.0,
                warmup_s: 30.0,
                time_scale: None,
            },
            regime: None,
            verdict: Some(judge(&legs)),
            legs,
            error: None,
            gates_passed: Some(true),
            wall_s: 1.0,
            reproduce: "myelin bench".into(),
        }
    }

    #[test]
    fn the_report_tallies_and_renders_and_the_heatmap_draws() {
        let cells = vec![
            outcome(Shape::Rotating, 0.5, 800.0),
            outcome(Shape::Rotating, 1.5, 1100.0),
            outcome(Shape::AllActive, 0.5, 900.0),
        ];
        let mut report = GridReport {
            schema_version: GRID_SCHEMA_VERSION,
            myelin_version: "test",
            generated_at: "now".into(),
            command: "myelin bench regimes --quick".into(),
            quick: true,
            legs: vec![
                "least-load".into(),
                "prefix+off".into(),
                "prefix+auto".into(),
            ],
            repeat: 1,
            time_unit: "simulated",
            targets: Targets::default(),
            duration_check: vec![DurationCheck::of(&cells[0], &cells[1])],
            cells,
            complete: true,
            cells_passed: 0,
            cells_failed: 0,
            cells_errored: 0,
            passed: false,
        };
        report.tally();
        assert_eq!((report.cells_passed, report.cells_failed), (2, 1));
        assert!(!report.passed);
        let text = render_text(&report);
        assert!(text.contains("800/1000 least-load = 0.80x"), "{text}");
        assert!(text.contains("FAIL (p99)"), "{text}");
        assert!(text.contains("regime grid: FAIL — 2 of 3 cells"), "{text}");
        assert!(!report.duration_check[0].same_verdict);
        let markdown = render_markdown(&report, &[("P99", "heatmap_p99.png")]);
        assert!(markdown.contains("![P99](heatmap_p99.png)"));
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["cells"][0]["verdict"]["passed"], true);
        assert_eq!(json["cells"][1]["cell"]["shape"], "rotating");

        let (rows, columns, values) = heat_values(&report.cells, |verdict| &verdict.p99);
        assert_eq!(rows, ["rotating @ 60%", "all-active @ 60%"]);
        assert_eq!(columns, ["0.5", "1.5"]);
        assert_eq!(values[0][0], Some((0.8, true)));
        assert_eq!(values[1][1], None);
        let path = std::env::temp_dir().join(format!("myelin-heatmap-{}.png", std::process::id()));
        heatmap(&path, "TTFT P99", &rows, &columns, &values).unwrap();
        assert!(std::fs::read(&path).unwrap().starts_with(b"\x89PNG"));
        let _ = std::fs::remove_file(path);
        // Colours: white at 1, green below, red above.
        assert_eq!(ratio_color(1.0), RGBColor(255, 255, 255));
        assert_eq!(ratio_color(0.25), RGBColor(60, 170, 75));
        assert_eq!(ratio_color(4.0), RGBColor(215, 50, 45));
    }
}
