//! The grid's cells: prompt shapes (benches/regimes/*.toml, compiled in), the arithmetic that
//! turns a cell (shape, working set / KV capacity, offered load / capacity) into a workload
//! (KV blocks from the ratio, the rate from the load, the speedup from the rate), and the cell
//! filter. Pure apart from the capacity measurement, which runs on the engine model.

use serde::Serialize;

use crate::capacity;
use crate::workload::trace::TraceWorkload;
use crate::workload::{
    PromptFormat, TokenAlphabet, WorkloadConfig, WorkloadError, WorkloadKind, working_set,
};

/// A prompt shape of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Shape {
    /// Open-loop churn over a rotating prefix population.
    Rotating,
    /// The same prefixes, all active, nothing rotating.
    AllActive,
    /// Groups sharing a system prompt, each request a unique question.
    SharedSystem,
    /// Growing conversations, each turn resending its history.
    MultiTurn,
    /// The Mooncake slice, time-scaled to the load.
    Trace,
}

/// Every shape, in grid order.
pub const SHAPES: &[Shape] = &[
    Shape::Rotating,
    Shape::AllActive,
    Shape::SharedSystem,
    Shape::MultiTurn,
    Shape::Trace,
];

impl Shape {
    /// The shape's name (cell names, `--shapes`).
    pub fn name(self) -> &'static str {
        match self {
            Shape::Rotating => "rotating",
            Shape::AllActive => "all-active",
            Shape::SharedSystem => "shared-system",
            Shape::MultiTurn => "multi-turn",
            Shape::Trace => "trace",
        }
    }

    /// The shape named `name`.
    pub fn parse(name: &str) -> Option<Shape> {
        SHAPES.iter().copied().find(|shape| shape.name() == name)
    }

    /// The shape's workload file (benches/regimes/), compiled in.
    pub fn file(self) -> &'static str {
        match self {
            Shape::Rotating => include_str!("../../../../benches/regimes/rotating.toml"),
            Shape::AllActive => include_str!("../../../../benches/regimes/all-active.toml"),
            Shape::SharedSystem => include_str!("../../../../benches/regimes/shared-system.toml"),
            Shape::MultiTurn => include_str!("../../../../benches/regimes/multi-turn.toml"),
            Shape::Trace => include_str!("../../../../benches/regimes/trace.toml"),
        }
    }

    /// The shape's workload as its file gives it.
    pub fn base_config(self) -> Result<WorkloadConfig, WorkloadError> {
        WorkloadConfig::parse(self.name(), self.file())
    }
}

/// What `--quick` runs: working sets 0.5, 1.5 and 3x at 60% load on rotating and all-active
/// churn and on the shared system prompt.
pub const QUICK_SHAPES: &[Shape] = &[Shape::Rotating, Shape::AllActive, Shape::SharedSystem];
pub const QUICK_WORKING_SETS: &[f64] = &[0.5, 1.5, 3.0];
pub const QUICK_LOADS: &[f64] = &[0.6];
/// The full grid's axes.
pub const FULL_WORKING_SETS: &[f64] = &[0.3, 0.7, 1.0, 1.5, 3.0];
pub const FULL_LOADS: &[f64] = &[0.3, 0.6, 0.9];

/// One cell of the grid.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Cell {
    pub shape: Shape,
    /// Working set / the cluster's KV capacity.
    pub working_set: f64,
    /// Offered load / the cluster's capacity.
    pub load: f64,
}

/// A ratio as cell names write it: `0.5`, `1.5`, `3`.
pub fn ratio_name(value: f64) -> String {
    let text = format!("{value:.2}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

impl Cell {
    /// `SHAPE-wsRATIO-loadPERCENT`, e.g. `rotating-ws1.5-load60`.
    pub fn name(&self) -> String {
        format!(
            "{}-ws{}-load{}",
            self.shape.name(),
            ratio_name(self.working_set),
            ratio_name(self.load * 100.0)
        )
    }
}

/// The grid: every shape x working set x load, in that order.
pub fn grid(shapes: &[Shape], working_sets: &[f64], loads: &[f64]) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &shape in shapes {
        for &load in loads {
            for &working_set in working_sets {
                cells.push(Cell {
                    shape,
                    working_set,
                    load,
                });
            }
        }
    }
    cells
}

/// Whether `name` matches `pattern`, where `*` matches any run of characters.
pub fn matches_pattern(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Whether a cell is selected by `--cells` (comma-separated patterns; none = every cell).
pub fn selected(patterns: Option<&str>, name: &str) -> bool {
    match patterns {
        None => true,
        Some(list) => list
            .split(',')
            .map(str::trim)
            .filter(|pattern| !pattern.is_empty())
            .any(|pattern| matches_pattern(pattern, name)),
    }
}

/// KV blocks per engine so that `working_set_tokens / (engines x blocks x block_size)` is
/// `ratio`: rounded up, so the ratio reached is at most the target (within one block).
pub fn kv_blocks_for(working_set_tokens: u64, ratio: f64, engines: u32, block_size: u32) -> u32 {
    let per_block = ratio * f64::from(engines.max(1)) * f64::from(block_size.max(1));
    ((working_set_tokens as f64 / per_block).ceil() as u32).max(1)
}

/// The simulator's speedup for a cell offering `rate_rps` simulated requests per second: at most
/// `max_speedup`, and low enough that the cell sends at most `max_wall_rps` requests per wall
/// second (what the 2-core machine serves without the harness lagging), in steps of 0.5.
pub fn speedup_for(rate_rps: f64, max_wall_rps: f64, max_speedup: f64) -> f64 {
    let fitting = (max_wall_rps / rate_rps.max(1e-9)).min(max_speedup);
    ((fitting * 2.0).floor() / 2.0).max(0.5)
}

/// The largest request a synthetic shape sends (prompt plus output tokens), to check it fits in
/// one engine's KV; `None` for a trace (its lines over the context are skipped and reported).
pub fn largest_request_tokens(config: &WorkloadConfig) -> Option<u64> {
    let output = u64::from(config.output_tokens);
    match config.kind {
        WorkloadKind::Churn | WorkloadKind::ChurnOpen => config.churn.as_ref().map(|churn| {
            u64::from(churn.prefix_tokens[1]) + u64::from(churn.suffix_tokens[1]) + output
        }),
        WorkloadKind::SharedPrefix | WorkloadKind::SharedPrefixOpen => {
            config.shared_prefix.as_ref().map(|shared| {
                u64::from(shared.system_tokens) + u64::from(shared.question_tokens) + output
            })
        }
        WorkloadKind::MultiTurn => config.multi_turn.as_ref().map(|multi| {
            u64::from(multi.first_tokens[1])
                + u64::from(multi.turns.saturating_sub(1))
                    * (output + u64::from(multi.turn_tokens[1]))
                + output
        }),
        WorkloadKind::Trace => None,
    }
}

/// Measured requests per leg run a cell's duration aims at: the warm-up plus this many
/// requests at the cell's rate, within [`MIN_DURATION_S`] and [`MAX_DURATION_S`].
pub const TARGET_REQUESTS: f64 = 600.0;
/// Shortest and longest simulated traffic per cell (synthetic shapes).
pub const MIN_DURATION_S: f64 = 60.0;
pub const MAX_DURATION_S: f64 = 120.0;
/// Simulated seconds of warm-up per leg (synthetic shapes).
pub const WARMUP_S: f64 = 20.0;

/// A synthetic cell's simulated seconds of traffic at `rate_rps`: the warm-up plus
/// `target_requests` at the rate, within [`MIN_DURATION_S`] and [`MAX_DURATION_S`].
pub fn duration_for(rate_rps: f64, warmup_s: f64, target_requests: f64) -> f64 {
    (warmup_s + target_requests / rate_rps.max(1e-9)).clamp(MIN_DURATION_S, MAX_DURATION_S)
}

/// How cells are run: what `myelin bench regimes`' flags set.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellOptions {
    pub engines: u32,
    pub seed: Option<u64>,
    pub prompt: Option<PromptFormat>,
    /// Trace cells: the trace file (`None`: the built-in slice) and how many of its first
    /// requests to replay (`None`: all).
    pub trace_path: Option<String>,
    pub trace_requests: Option<u32>,
    /// One duration for every synthetic cell, simulated seconds (`None`: [`duration_for`]; a
    /// trace replays its whole slice).
    pub duration_s: Option<f64>,
    pub warmup_s: f64,
    /// Measured requests per leg run the duration aims at.
    pub target_requests: f64,
    /// A fixed speedup for every cell (`None`: [`speedup_for`]).
    pub speedup: Option<f64>,
    pub max_wall_rps: f64,
    pub max_speedup: f64,
}

/// A cell made concrete: the workload it runs and the figures it was derived from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellPlan {
    pub name: String,
    pub cell: Cell,
    pub working_set_tokens: u64,
    pub working_set: String,
    pub kv_blocks: u32,
    /// The working set over the KV capacity the blocks give (the target, within a block).
    pub working_set_ratio: f64,
    /// The cluster's capacity, requests per simulated second (`crate::capacity`).
    pub capacity_rps: f64,
    /// The offered rate: load x capacity.
    pub rate_rps: f64,
    pub speedup: f64,
    pub duration_s: f64,
    pub warmup_s: f64,
    /// Trace cells: the time scale that gives the rate.
    pub time_scale: Option<f64>,
    /// Wall seconds of traffic per leg run (duration / speedup).
    pub wall_per_leg_s: f64,
    /// The workload the cell runs.
    pub config: WorkloadConfig,
}

/// The shape's config for a cell before its KV and rate: the options applied.
fn shaped(cell: &Cell, options: &CellOptions) -> Result<WorkloadConfig, WorkloadError> {
    let mut config = cell.shape.base_config()?;
    config.name = cell.name();
    config.cluster.engines = options.engines;
    if let Some(seed) = options.seed {
        config.seed = seed;
    }
    if let Some(prompt) = options.prompt {
        config.prompt = prompt;
    }
    if let Some(trace) = config.trace.as_mut() {
        if options.trace_path.is_some() {
            trace.path = options.trace_path.clone();
        }
        if options.trace_requests.is_some() {
            trace.max_requests = options.trace_requests;
        }
    }
    // Placeholders until the rate is known (see `cell_plan`).
    config.duration_s = options.duration_s.unwrap_or(MAX_DURATION_S);
    config.warmup_s = options.warmup_s.min(config.duration_s / 5.0);
    Ok(config)
}

/// The KV blocks a cell's working-set ratio gives, and its working set, before the capacity
/// (which depends on the blocks but not on the load, so cells of one shape and ratio share it).
pub fn cell_kv(
    cell: &Cell,
    options: &CellOptions,
) -> Result<(WorkloadConfig, u64, String), WorkloadError> {
    let mut config = shaped(cell, options)?;
    let set = working_set(&config)?;
    config.cluster.kv_blocks = kv_blocks_for(
        set.tokens,
        cell.working_set,
        config.cluster.engines,
        config.cluster.block_size,
    );
    if let Some(largest) = largest_request_tokens(&config) {
        let per_engine = u64::from(config.cluster.kv_blocks) * u64::from(config.cluster.block_size);
        if largest > per_engine {
            return Err(WorkloadError::Invalid {
                name: config.name.clone(),
                problem: format!(
                    "an engine's KV ({per_engine} tokens at this working-set ratio) cannot hold \
                     the shape's largest request ({largest} tokens)"
                ),
            });
        }
    }
    Ok((config, set.tokens, set.definition))
}

/// The cluster's capacity for a cell's workload (its KV set).
pub fn cell_capacity(config: &WorkloadConfig) -> Result<f64, WorkloadError> {
    let capacity = capacity::measure(config)?;
    if capacity.requests_per_s <= 0.0 {
        return Err(WorkloadError::Invalid {
            name: config.name.clone(),
            problem: "the cluster completed no request in the capacity measurement".into(),
        });
    }
    Ok(capacity.requests_per_s)
}

/// The cell's plan from its KV'd config and the measured capacity: the rate (load x capacity;
/// for a trace, the time scale that gives it and the duration of the whole slice), the speedup.
pub fn cell_plan(
    cell: &Cell,
    options: &CellOptions,
    mut config: WorkloadConfig,
    working_set_tokens: u64,
    working_set: String,
    capacity_rps: f64,
) -> Result<CellPlan, WorkloadError> {
    let rate_rps = cell.load * capacity_rps;
    let mut time_scale = None;
    if config.kind.is_poisson() {
        if let Some(open) = config.open_loop.as_mut() {
            open.rate_fraction = cell.load;
            open.capacity_rps = Some(capacity_rps);
            open.rate_rps = Some(rate_rps);
        }
        config.duration_s = options
            .duration_s
            .unwrap_or_else(|| duration_for(rate_rps, options.warmup_s, options.target_requests));
        config.warmup_s = options.warmup_s.min(config.duration_s / 5.0);
    } else if config.kind == WorkloadKind::Trace {
        // The slice's own mean rate, at time scale 1, over the lines the engines accept.
        if let Some(trace) = config.trace.as_mut() {
            trace.time_scale = 1.0;
        }
        let native = TraceWorkload::load(&config, TokenAlphabet::token_ids())?;
        let scale = native.mean_rate_rps() / rate_rps.max(1e-9);
        let span_s = native.span_s() * scale;
        if let Some(trace) = config.trace.as_mut() {
            trace.time_scale = scale;
            trace.capacity_rps = Some(capacity_rps);
        }
        // The whole slice, a tenth of it as warm-up.
        config.duration_s = span_s + 1.0;
        config.warmup_s = span_s / 10.0;
        time_scale = Some(scale);
    }
    let speedup = options
        .speedup
        .unwrap_or_else(|| speedup_for(rate_rps, options.max_wall_rps, options.max_speedup));
    config.cluster.speedup = speedup;
    config.validate()?;
    let kv = crate::workload::working_set::kv_capacity_tokens(&config);
    Ok(CellPlan {
        name: cell.name(),
        cell: *cell,
        working_set_tokens,
        working_set,
        kv_blocks: config.cluster.kv_blocks,
        working_set_ratio: working_set_tokens as f64 / kv.max(1) as f64,
        capacity_rps,
        rate_rps,
        speedup,
        duration_s: config.duration_s,
        warmup_s: config.warmup_s,
        time_scale,
        wall_per_leg_s: config.duration_s / speedup,
        config,
    })
}

/// A plan at twice the duration (the duration check): the same cell, workload and rate, the
/// warm-up unchanged, so the measured window is longer. `None` for a trace cell (the slice
/// has one length).
pub fn doubled(plan: &CellPlan) -> Option<CellPlan> {
    if plan.config.kind == WorkloadKind::Trace {
        return None;
    }
    let mut longer = plan.clone();
    longer.name = format!("{}-2x", plan.name);
    longer.duration_s = plan.duration_s * 2.0;
    longer.config.duration_s = longer.duration_s;
    longer.config.name = longer.name.clone();
    longer.wall_per_leg_s = longer.duration_s / longer.speedup;
    Some(longer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> CellOptions {
        CellOptions {
            engines: 8,
            seed: None,
            prompt: None,
            trace_path: None,
            trace_requests: None,
            duration_s: None,
            warmup_s: 20.0,
            target_requests: 600.0,
            speedup: None,
            max_wall_rps: 40.0,
            max_speedup: 10.0,
        }
    }

    #[test]
    fn every_shape_parses_and_the_quick_grid_has_nine_cells() {
        for shape in SHAPES {
            let config = shape.base_config().unwrap();
            assert_eq!(config.name, shape.name());
            assert_eq!(Shape::parse(shape.name()), Some(*shape));
            assert!(working_set(&config).unwrap().tokens > 0);
        }
        let quick = grid(QUICK_SHAPES, QUICK_WORKING_SETS, QUICK_LOADS);
        let names: Vec<String> = quick.iter().map(Cell::name).collect();
        assert_eq!(names.len(), 9);
        assert_eq!(names[0], "rotating-ws0.5-load60");
        assert_eq!(names[2], "rotating-ws3-load60");
        assert_eq!(names[8], "shared-system-ws3-load60");
        let full = grid(SHAPES, FULL_WORKING_SETS, FULL_LOADS);
        assert_eq!(full.len(), 5 * 5 * 3);
        assert!(full.iter().any(|cell| cell.name() == "trace-ws0.3-load90"));
    }

    #[test]
    fn kv_blocks_give_the_ratio_and_rates_the_load() {
        // 240,000 tokens at 1.5x over 8 engines of 16-token blocks: 160,000 tokens of KV,
        // 1,250 blocks per engine.
        assert_eq!(kv_blocks_for(240_000, 1.5, 8, 16), 1250);
        // Rounded up: the ratio reached is at most the target.
        let blocks = kv_blocks_for(240_001, 1.5, 8, 16);
        assert_eq!(blocks, 1251);
        assert!(240_001.0 / f64::from(blocks * 8 * 16) <= 1.5);
        assert_eq!(kv_blocks_for(10, 100.0, 8, 16), 1);
        // The plan: the rate is load x capacity, the ratio the target.
        let cell = Cell {
            shape: Shape::Rotating,
            working_set: 1.5,
            load: 0.6,
        };
        let (config, tokens, definition) = cell_kv(&cell, &options()).unwrap();
        let plan = cell_plan(&cell, &options(), config, tokens, definition, 4.0).unwrap();
        assert!((plan.rate_rps - 2.4).abs() < 1e-12);
        let open = plan.config.open_loop.clone().unwrap();
        assert_eq!(
            (open.rate_fraction, open.capacity_rps, open.rate_rps),
            (0.6, Some(4.0), Some(plan.rate_rps))
        );
        assert!(plan.working_set_ratio <= 1.5 && plan.working_set_ratio > 1.49);
        assert_eq!(plan.config.cluster.kv_blocks, plan.kv_blocks);
        // 2.4 req/s: 40 / 2.4 = 16.7 wall requests' worth, capped at speedup 10.
        assert_eq!(plan.speedup, 10.0);
        // 20 s of warm-up and 600 requests at 2.4 req/s: 270 s, cut to the longest, 120 s.
        assert_eq!(plan.config.duration_s, 120.0);
        assert_eq!(plan.wall_per_leg_s, 12.0);
        let longer = doubled(&plan).unwrap();
        assert_eq!(longer.config.duration_s, 240.0);
        assert_eq!(longer.config.warmup_s, plan.config.warmup_s);
        assert_eq!(longer.name, "rotating-ws1.5-load60-2x");
    }

    #[test]
    fn the_duration_aims_at_the_target_requests_within_its_bounds() {
        // 20 s + 600 requests at 10 req/s: 80 s.
        assert_eq!(duration_for(10.0, 20.0, 600.0), 80.0);
        assert_eq!(duration_for(100.0, 20.0, 600.0), MIN_DURATION_S);
        assert_eq!(duration_for(1.0, 20.0, 600.0), MAX_DURATION_S);
        // A fixed duration wins.
        let cell = Cell {
            shape: Shape::AllActive,
            working_set: 1.5,
            load: 0.6,
        };
        let fixed = CellOptions {
            duration_s: Some(30.0),
            ..options()
        };
        let (config, tokens, definition) = cell_kv(&cell, &fixed).unwrap();
        let plan = cell_plan(&cell, &fixed, config, tokens, definition, 40.0).unwrap();
        assert_eq!((plan.duration_s, plan.warmup_s), (30.0, 6.0));
    }

    #[test]
    fn the_speedup_keeps_the_wall_rate_bounded() {
        assert_eq!(speedup_for(2.0, 40.0, 10.0), 10.0);
        assert_eq!(speedup_for(8.0, 40.0, 10.0), 5.0);
        // 40 / 6 = 6.67: down to a half step.
        assert_eq!(speedup_for(6.0, 40.0, 10.0), 6.5);
        assert_eq!(speedup_for(1000.0, 40.0, 10.0), 0.5);
    }

    #[test]
    fn a_trace_cell_replays_the_requests_and_file_it_is_given() {
        let cell = Cell {
            shape: Shape::Trace,
            working_set: 1.0,
            load: 0.5,
        };
        let (_, whole, _) = cell_kv(&cell, &options()).unwrap();
        let first_100 = CellOptions {
            trace_requests: Some(100),
            ..options()
        };
        let (config, tokens, definition) = cell_kv(&cell, &first_100).unwrap();
        assert_eq!(config.trace.as_ref().unwrap().max_requests, Some(100));
        assert!(tokens < whole, "{tokens} of {whole}");
        let plan = cell_plan(&cell, &first_100, config, tokens, definition, 4.0).unwrap();
        let native = TraceWorkload::load(&plan.config, TokenAlphabet::token_ids()).unwrap();
        assert_eq!(native.len(), 100);
        // A file: the first 50 lines of the slice, written out.
        let path = std::env::temp_dir().join(format!("regimes-trace-{}.jsonl", std::process::id()));
        let lines: Vec<&str> = crate::workload::trace::BUILTIN_SLICE
            .lines()
            .take(50)
            .collect();
        std::fs::write(&path, lines.join("\n")).unwrap();
        let from_file = CellOptions {
            trace_path: Some(path.display().to_string()),
            ..options()
        };
        let (config, tokens, _) = cell_kv(&cell, &from_file).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            config.trace.as_ref().unwrap().path.as_deref(),
            Some(path.to_str().unwrap())
        );
        assert!(tokens < whole);
    }

    #[test]
    fn a_trace_cell_scales_time_to_the_load_and_replays_the_whole_slice() {
        let cell = Cell {
            shape: Shape::Trace,
            working_set: 1.0,
            load: 0.5,
        };
        let (config, tokens, definition) = cell_kv(&cell, &options()).unwrap();
        // The slice's 300 lines over 102 s: 2.94 req/s. At half of a capacity of 4 req/s
        // (2 req/s) the replay is stretched by 1.47.
        let plan = cell_plan(&cell, &options(), config, tokens, definition, 4.0).unwrap();
        let scale = plan.time_scale.unwrap();
        assert!((scale - 300.0 / 102.0 / 2.0).abs() < 1e-9, "{scale}");
        assert!((plan.duration_s - (102.0 * scale + 1.0)).abs() < 1e-9);
        assert!(plan.warmup_s < plan.duration_s);
        assert_eq!(plan.config.trace.clone().unwrap().capacity_rps, Some(4.0));
        assert!(doubled(&plan).is_none());
    }

    #[test]
    fn a_ratio_whose_engines_cannot_hold_a_request_is_refused() {
        let cell = Cell {
            shape: Shape::Rotating,
            working_set: 30.0,
            load: 0.6,
        };
        let error = cell_kv(&cell, &options()).unwrap_err();
        assert!(error.to_string().contains("largest request"), "{error}");
    }

    #[test]
    fn cell_patterns() {
        assert!(matches_pattern("rotating-*", "rotating-ws1.5-load60"));
        assert!(matches_pattern("*-ws3-*", "all-active-ws3-load60"));
        assert!(!matches_pattern("*-ws3-*", "all-active-ws0.3-load60"));
        assert!(matches_pattern("trace-ws1-load30", "trace-ws1-load30"));
        assert!(!matches_pattern("trace", "trace-ws1-load30"));
        assert!(matches_pattern("*", "anything"));
        assert!(selected(None, "x"));
        assert!(selected(
            Some("a-*, rotating-ws0.5-load60"),
            "rotating-ws0.5-load60"
        ));
        assert!(!selected(Some("a-*"), "rotating-ws0.5-load60"));
        assert_eq!(ratio_name(0.3), "0.3");
        assert_eq!(ratio_name(3.0), "3");
        assert_eq!(ratio_name(60.0), "60");
    }
}
