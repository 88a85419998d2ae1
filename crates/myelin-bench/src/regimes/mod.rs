//! `myelin bench regimes`: the regime grid. A cell is a prompt shape (rotating churn, all-active
//! churn, a shared system prompt with unique turns, growing multi-turn conversations, the
//! Mooncake slice), a working set / KV capacity ratio (which sets the engines' KV blocks) and an
//! offered load / capacity (which sets the Poisson rate, or the trace's time scale, against the
//! cluster's capacity measured on the engine model). Every cell runs the harness's legs
//! (least-load, prefix+off and the default, prefix+auto, `--repeat 3`) on fresh simulated
//! clusters through [`crate::runner::run_config`] into `OUT/cells/NAME/`, then the grid reads
//! each cell's report.json back, judges the default against the better baseline
//! ([`verdict`]), and writes report.json, report.md and two heatmaps ([`output`]).
//! docs/reference/benchmark.md ("Regime grid") is the user guide.

pub mod grid;
pub mod output;
pub mod verdict;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

use crate::cli::BenchArgs;
pub use crate::cli::{DEFAULT_REGIME_LEGS, RegimeArgs};
use crate::runner::{self, BenchError};
use crate::workload::{PromptFormat, WorkloadError};
use grid::{
    Cell, CellOptions, CellPlan, FULL_LOADS, FULL_WORKING_SETS, QUICK_LOADS, QUICK_SHAPES,
    QUICK_WORKING_SETS, SHAPES, Shape,
};
use output::{CellOutcome, DurationCheck, GridReport, PlanFigures, Targets};

/// Wall seconds a leg run costs besides its traffic (the cluster's and router's start, the
/// drain, the stop), for the plan's estimate; measured on the 2-core machine.
pub const LEG_OVERHEAD_S: f64 = 3.0;

/// Why the grid could not run.
#[derive(Debug, thiserror::Error)]
pub enum RegimeError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Bench(#[from] BenchError),
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> RegimeError + use<> {
    let path = path.display().to_string();
    move |source| RegimeError::Io { what, path, source }
}

/// A comma-separated list of numbers.
fn numbers(list: &str, what: &str) -> Result<Vec<f64>, RegimeError> {
    list.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<f64>()
                .ok()
                .filter(|value| value.is_finite() && *value > 0.0)
                .ok_or_else(|| {
                    RegimeError::Usage(format!("{what}: `{item}` is not a positive number"))
                })
        })
        .collect()
}

impl RegimeArgs {
    /// The selected cells, in grid order.
    pub fn cells(&self) -> Result<Vec<Cell>, RegimeError> {
        let shapes: Vec<Shape> = match &self.shapes {
            Some(list) => list
                .split(',')
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(|name| {
                    Shape::parse(name).ok_or_else(|| {
                        RegimeError::Usage(format!(
                            "unknown shape `{name}` (known: {})",
                            SHAPES
                                .iter()
                                .map(|shape| shape.name())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })
                })
                .collect::<Result<_, _>>()?,
            None if self.quick => QUICK_SHAPES.to_vec(),
            None => SHAPES.to_vec(),
        };
        let working_sets = match &self.working_sets {
            Some(list) => numbers(list, "--working-sets")?,
            None if self.quick => QUICK_WORKING_SETS.to_vec(),
            None => FULL_WORKING_SETS.to_vec(),
        };
        let loads = match &self.loads {
            Some(list) => numbers(list, "--loads")?,
            None if self.quick => QUICK_LOADS.to_vec(),
            None => FULL_LOADS.to_vec(),
        };
        let cells: Vec<Cell> = grid::grid(&shapes, &working_sets, &loads)
            .into_iter()
            .filter(|cell| grid::selected(self.cells.as_deref(), &cell.name()))
            .collect();
        if cells.is_empty() {
            return Err(RegimeError::Usage("no cell selected".into()));
        }
        Ok(cells)
    }

    /// How cells are run.
    pub fn options(&self) -> CellOptions {
        CellOptions {
            engines: self.engines.max(1),
            seed: self.seed,
            prompt: self.prompt.as_deref().map(|prompt| {
                if prompt == "text" {
                    PromptFormat::Text
                } else {
                    PromptFormat::TokenIds
                }
            }),
            trace_path: self.trace.as_ref().map(|path| path.display().to_string()),
            trace_requests: self.trace_requests,
            duration_s: self.duration,
            warmup_s: self.warmup,
            target_requests: self.requests_per_leg.max(1.0),
            speedup: self.speedup,
            max_wall_rps: self.max_wall_rps,
            max_speedup: self.max_speedup,
        }
    }

    /// The `myelin bench` flags of one cell's run (its workload is passed as a config), and the
    /// command line that reruns it alone.
    fn cell_args(&self, dir: &Path, workload: &Path) -> (Vec<String>, String) {
        let mut args: Vec<String> = vec![
            "--legs".into(),
            self.legs.clone(),
            "--repeat".into(),
            self.repeat.max(1).to_string(),
            "--calibration".into(),
            clap::ValueEnum::to_possible_value(&self.calibration)
                .expect("every calibration mode has a name")
                .get_name()
                .to_string(),
            "--calibration-every".into(),
            self.calibration_every.to_string(),
            "--request-timeout".into(),
            self.request_timeout.to_string(),
        ];
        for external in &self.external {
            args.push("--external".into());
            args.push(external.clone());
        }
        if let Some(router_bin) = &self.router_bin {
            args.push("--router-bin".into());
            args.push(router_bin.display().to_string());
        }
        for router_arg in &self.router_args {
            args.push(format!("--router-arg={router_arg}"));
        }
        let quote = |arg: &str| {
            if arg
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_+=.,/:".contains(c))
            {
                arg.to_string()
            } else {
                format!("'{}'", arg.replace('\'', "'\\''"))
            }
        };
        let mut reproduce = vec![
            "myelin".to_string(),
            "bench".into(),
            "--workload".into(),
            workload.display().to_string(),
        ];
        reproduce.extend(args.iter().cloned());
        reproduce.push("--out".into());
        reproduce.push(dir.display().to_string());
        let reproduce = reproduce
            .iter()
            .map(|arg| quote(arg))
            .collect::<Vec<_>>()
            .join(" ");
        args.push("--out".into());
        args.push(dir.display().to_string());
        if self.no_progress {
            args.push("--no-progress".into());
        }
        (args, reproduce)
    }
}

#[derive(Parser)]
struct BenchCommandLine {
    #[command(flatten)]
    args: BenchArgs,
}

/// Plans every cell: KV blocks from the ratio, the capacity (measured once per shape and
/// ratio), the rate and the speedup.
pub fn plan_cells(cells: &[Cell], options: &CellOptions) -> Vec<(Cell, Result<CellPlan, String>)> {
    let mut capacities: Vec<((&'static str, u64), f64)> = Vec::new();
    cells
        .iter()
        .map(|cell| {
            let planned = (|| {
                let (config, tokens, definition) = grid::cell_kv(cell, options)?;
                let key = (cell.shape.name(), cell.working_set.to_bits());
                let capacity = match capacities.iter().find(|(known, _)| *known == key) {
                    Some((_, capacity)) => *capacity,
                    None => {
                        let capacity = grid::cell_capacity(&config)?;
                        capacities.push((key, capacity));
                        capacity
                    }
                };
                grid::cell_plan(cell, options, config, tokens, definition, capacity)
            })();
            (
                *cell,
                planned.map_err(|error: WorkloadError| error.to_string()),
            )
        })
        .collect()
}

/// Wall seconds a planned cell takes: legs x repeats x (traffic + [`LEG_OVERHEAD_S`]).
pub fn estimated_wall_s(plan: &CellPlan, legs: usize, repeat: u32) -> f64 {
    legs as f64 * f64::from(repeat.max(1)) * (plan.wall_per_leg_s + LEG_OVERHEAD_S)
}

fn plan_table(plans: &[(Cell, Result<CellPlan, String>)], legs: usize, repeat: u32) -> String {
    let table = crate::report::Table {
        header: [
            "cell",
            "working set",
            "kv blocks",
            "ws/KV",
            "capacity",
            "rate",
            "speedup",
            "duration",
            "wall/leg",
            "cell wall",
        ]
        .iter()
        .map(|cell| cell.to_string())
        .collect(),
        rows: plans
            .iter()
            .map(|(cell, plan)| match plan {
                Ok(plan) => vec![
                    plan.name.clone(),
                    plan.working_set_tokens.to_string(),
                    plan.kv_blocks.to_string(),
                    format!("{:.2}", plan.working_set_ratio),
                    format!("{:.2}", plan.capacity_rps),
                    format!("{:.2}", plan.rate_rps),
                    grid::ratio_name(plan.speedup),
                    format!("{:.0} s", plan.duration_s),
                    format!("{:.0} s", plan.wall_per_leg_s),
                    format!("{:.1} min", estimated_wall_s(plan, legs, repeat) / 60.0),
                ],
                Err(error) => vec![cell.name(), format!("cannot run: {error}")],
            })
            .collect(),
    };
    table.plain()
}

/// Runs one planned cell into `out/cells/NAME/` (or reads its report there with `--resume`).
fn run_cell(args: &RegimeArgs, out: &Path, plan: &CellPlan) -> Result<CellOutcome, RegimeError> {
    let relative = PathBuf::from("cells").join(&plan.name);
    let dir = out.join(&relative);
    std::fs::create_dir_all(&dir).map_err(io_error("creating", &dir))?;
    let workload_path = dir.join("workload.json");
    let report_path = dir.join("report.json");
    let (bench_args, reproduce) = args.cell_args(&dir, &workload_path);
    let started = Instant::now();
    let mut error = None;
    if !(args.resume && report_path.exists() && same_workload(&workload_path, &plan.config)) {
        let json =
            serde_json::to_string_pretty(&plan.config).map_err(|source| RegimeError::Io {
                what: "serialising",
                path: workload_path.display().to_string(),
                source: std::io::Error::other(source),
            })?;
        std::fs::write(&workload_path, json + "\n").map_err(io_error("writing", &workload_path))?;
        // A stale report must not stand in for this run's.
        let _ = std::fs::remove_file(&report_path);
        let argv = std::iter::once("bench".to_string())
            .chain(std::iter::once("--workload".into()))
            .chain(std::iter::once(workload_path.display().to_string()))
            .chain(bench_args);
        let parsed = BenchCommandLine::try_parse_from(argv)
            .map_err(|error| RegimeError::Usage(error.to_string()))?;
        eprintln!(
            "myelin bench regimes: cell {} (kv_blocks {}, {:.2} req/s of a capacity of {:.2}, speedup {})",
            plan.name,
            plan.kv_blocks,
            plan.rate_rps,
            plan.capacity_rps,
            grid::ratio_name(plan.speedup)
        );
        match runner::run_config(&parsed.args, plan.config.clone()) {
            Ok(_) => {}
            Err(BenchError::Interrupted) => return Err(BenchError::Interrupted.into()),
            Err(failure) => error = Some(failure.to_string()),
        }
    }
    let mut outcome = CellOutcome {
        name: plan.name.clone(),
        cell: plan.cell,
        dir: relative.display().to_string(),
        plan: PlanFigures::from(plan),
        regime: None,
        legs: Vec::new(),
        verdict: None,
        error,
        gates_passed: None,
        wall_s: started.elapsed().as_secs_f64(),
        reproduce,
    };
    if outcome.error.is_none() {
        match verdict::read_report(&report_path) {
            Ok(report) => {
                outcome.verdict = Some(verdict::judge(&report.legs));
                outcome.regime = report.regime;
                outcome.gates_passed = Some(report.passed);
                outcome.legs = report.legs;
            }
            Err(failure) => outcome.error = Some(failure.to_string()),
        }
    }
    Ok(outcome)
}

/// Whether the workload.json at `path` is `config` (a resumed cell must have run the workload
/// this grid plans for it).
fn same_workload(path: &Path, config: &crate::workload::WorkloadConfig) -> bool {
    let stored = std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok());
    stored.is_some() && stored == serde_json::to_value(config).ok()
}

fn cell_line(outcome: &CellOutcome) -> String {
    let resident = outcome
        .regime
        .as_ref()
        .and_then(|regime| regime.prefix_resident_share)
        .map_or("-".into(), |share| format!("{:.1}%", share * 100.0));
    let ratio = |check: &Option<verdict::RatioCheck>| {
        check
            .as_ref()
            .map_or("-".into(), |check| format!("{:.2}x", check.ratio))
    };
    match &outcome.verdict {
        Some(verdict) => format!(
            "myelin bench regimes: {} {}: P99 {} and P50 {} the better baseline's, prefix resident {}, {:.0} s",
            outcome.name,
            verdict.describe(),
            ratio(&verdict.p99),
            ratio(&verdict.p50),
            resident,
            outcome.wall_s
        ),
        None => format!(
            "myelin bench regimes: {} ERROR: {}",
            outcome.name,
            outcome.error.as_deref().unwrap_or("no report")
        ),
    }
}

/// `myelin bench regimes`: exit 0 when every cell met every target, 1 when one did not (or
/// could not run).
pub fn run(args: RegimeArgs) -> Result<ExitCode, RegimeError> {
    let cells = args.cells()?;
    let options = args.options();
    let legs = crate::legs::all_legs(&args.legs, &args.external)
        .map_err(|error| RegimeError::Usage(error.to_string()))?;
    let external_text_only =
        !args.external.is_empty() && options.prompt != Some(PromptFormat::Text);
    if external_text_only {
        eprintln!(
            "myelin bench regimes: note: external legs get token-id prompts; the SGLang gateway \
             takes text only (add --prompt text)"
        );
    }
    let started = Instant::now();
    let plans = plan_cells(&cells, &options);
    eprintln!(
        "myelin bench regimes: {} cell(s), legs {}, {} repeat(s); planned in {:.1} s:\n{}",
        plans.len(),
        args.legs,
        args.repeat.max(1),
        started.elapsed().as_secs_f64(),
        plan_table(&plans, legs.len(), args.repeat)
    );
    let check_patterns = args.duration_check.as_deref().map(|patterns| {
        if patterns.trim() == "all" {
            "*".to_string()
        } else {
            patterns.to_string()
        }
    });
    let planned_s: f64 = plans
        .iter()
        .filter_map(|(_, plan)| plan.as_ref().ok())
        .map(|plan| {
            let doubled = check_patterns
                .as_deref()
                .filter(|patterns| grid::selected(Some(patterns), &plan.name))
                .and_then(|_| grid::doubled(plan))
                .map_or(0.0, |longer| {
                    estimated_wall_s(&longer, legs.len(), args.repeat)
                });
            estimated_wall_s(plan, legs.len(), args.repeat) + doubled
        })
        .sum();
    eprintln!(
        "myelin bench regimes: estimated {:.0} minutes on a quiet 2-core machine",
        planned_s / 60.0
    );
    if args.plan {
        return Ok(ExitCode::SUCCESS);
    }
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from("results").join(format!("regimes-{}", crate::report::utc_now().1))
    });
    std::fs::create_dir_all(&out).map_err(io_error("creating", &out))?;

    let mut report = GridReport {
        schema_version: output::GRID_SCHEMA_VERSION,
        myelin_version: env!("CARGO_PKG_VERSION"),
        generated_at: String::new(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        quick: args.quick,
        legs: legs.iter().map(|leg| leg.name.clone()).collect(),
        repeat: args.repeat.max(1),
        time_unit: "simulated",
        targets: Targets::default(),
        cells: Vec::new(),
        duration_check: Vec::new(),
        complete: false,
        cells_passed: 0,
        cells_failed: 0,
        cells_errored: 0,
        passed: false,
    };
    let mut interrupted = None;
    'cells: for (cell, plan) in &plans {
        let plan = match plan {
            Ok(plan) => plan,
            Err(error) => {
                report.cells.push(unplanned(cell, error));
                eprintln!("myelin bench regimes: {} ERROR: {error}", cell.name());
                continue;
            }
        };
        let outcome = match run_cell(&args, &out, plan) {
            Ok(outcome) => outcome,
            Err(error) => {
                interrupted = Some(error);
                break 'cells;
            }
        };
        eprintln!("{}", cell_line(&outcome));
        let check = check_patterns
            .as_deref()
            .filter(|patterns| grid::selected(Some(patterns), &plan.name))
            .and_then(|_| grid::doubled(plan));
        report.cells.push(outcome);
        if let Some(longer) = check {
            match run_cell(&args, &out, &longer) {
                Ok(long) => {
                    eprintln!("{}", cell_line(&long));
                    let short = report.cells.last().unwrap_or_else(|| unreachable!());
                    report.duration_check.push(DurationCheck::of(short, &long));
                }
                Err(error) => {
                    interrupted = Some(error);
                    break 'cells;
                }
            }
        }
        write_outputs(&out, &mut report)?;
    }
    report.complete = interrupted.is_none() && report.cells.len() == plans.len();
    write_outputs(&out, &mut report)?;
    print!("{}", output::render_text(&report));
    println!(
        "report: {}, {}, heatmaps: {}, {} (elapsed {:.1} min)",
        out.join("report.json").display(),
        out.join("report.md").display(),
        out.join("heatmap_p99.png").display(),
        out.join("heatmap_p50.png").display(),
        started.elapsed().as_secs_f64() / 60.0
    );
    if let Some(error) = interrupted {
        return Err(error);
    }
    Ok(if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The outcome of a cell that could not be planned.
fn unplanned(cell: &Cell, error: &str) -> CellOutcome {
    CellOutcome {
        name: cell.name(),
        cell: *cell,
        dir: String::new(),
        plan: PlanFigures {
            working_set_tokens: 0,
            working_set: String::new(),
            kv_blocks: 0,
            working_set_ratio: cell.working_set,
            capacity_rps: 0.0,
            rate_rps: 0.0,
            speedup: 0.0,
            duration_s: 0.0,
            warmup_s: 0.0,
            time_scale: None,
        },
        regime: None,
        legs: Vec::new(),
        verdict: None,
        error: Some(error.to_string()),
        gates_passed: None,
        wall_s: 0.0,
        reproduce: String::new(),
    }
}

/// Writes report.json, report.md and the heatmaps for the cells so far.
fn write_outputs(out: &Path, report: &mut GridReport) -> Result<(), RegimeError> {
    report.generated_at = crate::report::utc_now().0;
    report.tally();
    let json_path = out.join("report.json");
    let json = serde_json::to_string_pretty(report).map_err(|source| RegimeError::Io {
        what: "serialising",
        path: json_path.display().to_string(),
        source: std::io::Error::other(source),
    })?;
    std::fs::write(&json_path, json + "\n").map_err(io_error("writing", &json_path))?;
    let default_leg = verdict::DEFAULT_LEG;
    let figures: [(&str, &str, output::RatioPick); 2] = [
        ("heatmap_p99.png", "TTFT P99", |verdict| &verdict.p99),
        ("heatmap_p50.png", "TTFT P50", |verdict| &verdict.p50),
    ];
    let mut heatmaps = Vec::new();
    for (file, figure, pick) in figures {
        let (rows, columns, values) = output::heat_values(&report.cells, pick);
        let title = format!(
            "{figure}: {default_leg} / the better of least-load and prefix+off (medians of {} repeats)",
            report.repeat
        );
        output::heatmap(&out.join(file), &title, &rows, &columns, &values)?;
        heatmaps.push((figure, file));
    }
    let markdown_path = out.join("report.md");
    std::fs::write(&markdown_path, output::render_markdown(report, &heatmaps))
        .map_err(io_error("writing", &markdown_path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Parser)]
    struct Harness {
        #[command(flatten)]
        args: RegimeArgs,
    }

    fn parse(flags: &[&str]) -> RegimeArgs {
        Harness::parse_from(std::iter::once("regimes").chain(flags.iter().copied())).args
    }

    #[test]
    fn quick_and_full_grids_and_their_filters() {
        let quick = parse(&["--quick"]);
        let cells = quick.cells().unwrap();
        assert_eq!(cells.len(), 9);
        let options = quick.options();
        assert_eq!((options.duration_s, options.warmup_s), (None, 20.0));
        assert_eq!(options.target_requests, 600.0);
        assert_eq!(quick.repeat, 3);
        assert_eq!(quick.legs, "least-load,prefix+off,prefix+auto");
        let full = parse(&[]);
        assert_eq!(full.cells().unwrap().len(), 75);
        let some = parse(&["--quick", "--cells", "rotating-*,*-ws3-load60"]);
        let names: Vec<String> = some.cells().unwrap().iter().map(Cell::name).collect();
        assert_eq!(
            names,
            [
                "rotating-ws0.5-load60",
                "rotating-ws1.5-load60",
                "rotating-ws3-load60",
                "all-active-ws3-load60",
                "shared-system-ws3-load60"
            ]
        );
        let axes = parse(&[
            "--shapes",
            "trace",
            "--working-sets",
            "1",
            "--loads",
            "0.3,0.9",
        ]);
        let names: Vec<String> = axes.cells().unwrap().iter().map(Cell::name).collect();
        assert_eq!(names, ["trace-ws1-load30", "trace-ws1-load90"]);
        assert!(parse(&["--shapes", "nope"]).cells().is_err());
        assert!(parse(&["--loads", "0"]).cells().is_err());
        assert!(parse(&["--cells", "nothing"]).cells().is_err());
        let fixed = parse(&["--quick", "--duration", "20", "--warmup", "1"]).options();
        assert_eq!((fixed.duration_s, fixed.warmup_s), (Some(20.0), 1.0));
    }

    #[test]
    fn a_cell_runs_the_harness_with_its_legs_and_can_be_rerun_alone() {
        let args = parse(&[
            "--quick",
            "--external",
            "smg=smg --port {port}",
            "--router-arg=--x=1",
            "--no-progress",
        ]);
        let (flags, reproduce) = args.cell_args(
            Path::new("/o/cells/c"),
            Path::new("/o/cells/c/workload.json"),
        );
        let argv = std::iter::once("bench".to_string())
            .chain(["--workload".into(), "/o/cells/c/workload.json".into()])
            .chain(flags);
        let parsed = BenchCommandLine::try_parse_from(argv).unwrap().args;
        assert_eq!(parsed.legs, DEFAULT_REGIME_LEGS);
        assert_eq!(parsed.repeat, 3);
        assert_eq!(parsed.external, ["smg=smg --port {port}"]);
        assert_eq!(parsed.router_args, ["--x=1"]);
        assert_eq!(parsed.out.as_deref(), Some(Path::new("/o/cells/c")));
        assert!(parsed.no_progress);
        assert_eq!(parsed.calibration, crate::calibration::CalibrationMode::Off);
        let calibrated = parse(&[
            "--quick",
            "--calibration",
            "auto",
            "--calibration-every",
            "1",
        ]);
        let (flags, _) = calibrated.cell_args(
            Path::new("/o/cells/c"),
            Path::new("/o/cells/c/workload.json"),
        );
        let argv = std::iter::once("bench".to_string())
            .chain(["--workload".into(), "/o/cells/c/workload.json".into()])
            .chain(flags);
        let parsed_calibrated = BenchCommandLine::try_parse_from(argv).unwrap().args;
        assert_eq!(
            parsed_calibrated.calibration,
            crate::calibration::CalibrationMode::Auto
        );
        assert_eq!(parsed_calibrated.calibration_every, 1);
        assert!(
            reproduce.starts_with(
                "myelin bench --workload /o/cells/c/workload.json --legs least-load,prefix+off,prefix+auto --repeat 3"
            ),
            "{reproduce}"
        );
        assert!(
            reproduce.contains("--external 'smg=smg --port {port}'"),
            "{reproduce}"
        );
        assert!(reproduce.ends_with("--out /o/cells/c"), "{reproduce}");
    }

    #[test]
    fn a_cell_resumes_only_from_the_workload_it_is_planned_with() {
        let cell = Cell {
            shape: Shape::SharedSystem,
            working_set: 1.5,
            load: 0.6,
        };
        let options = parse(&["--quick"]).options();
        let (config, tokens, definition) = grid::cell_kv(&cell, &options).unwrap();
        let plan = grid::cell_plan(&cell, &options, config, tokens, definition, 8.1).unwrap();
        let path = std::env::temp_dir().join(format!("myelin-resume-{}.json", std::process::id()));
        std::fs::write(&path, serde_json::to_string_pretty(&plan.config).unwrap()).unwrap();
        assert!(same_workload(&path, &plan.config));
        // The stored workload parses back as the same config (it reruns the cell alone), less
        // the shape file's [quick] section, which is not written.
        let stored = crate::workload::WorkloadConfig::load(path.to_str().unwrap()).unwrap();
        let expected = crate::workload::WorkloadConfig {
            quick: None,
            ..plan.config.clone()
        };
        assert_eq!(stored, expected);
        let mut other = plan.config.clone();
        other.cluster.kv_blocks += 1;
        assert!(!same_workload(&path, &other));
        let _ = std::fs::remove_file(&path);
        assert!(!same_workload(&path, &plan.config), "no file, no resume");
    }
}
