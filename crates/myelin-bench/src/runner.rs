//! Running a benchmark: for every repeat and every leg, a fresh simulated cluster (or the
//! external engines of `--engine`, their caches emptied), the leg's router, the load generator
//! and a progress bar; then the summaries, gates, report files and plots. The only module that
//! sequences processes and threads.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::calibration::{self, CalibrationMode, CalibrationSetup, LegCalibration};
use crate::cluster::{ClusterError, EmbeddedCluster, start_cluster};
use crate::engine_tokens::EngineTokenizer;
use crate::engines::{ENGINE_IDLE_TIMEOUT, EngineError, ExternalEngines};
use crate::gates;
use crate::legs::{DEFAULT_LEGS, LegError, LegKind, LegSpec, all_legs, leg_order};
use crate::loadgen::{self, LoadPlan, LoadProgress, ResidentProbe, Target};
use crate::oracle::CacheOracle;
use crate::plot::{self, LegSeries, PlotError};
use crate::prometheus;
use crate::record::{LegRecords, write_csv};
use crate::report::{self, REPORT_SCHEMA_VERSION, Report};
use crate::router_process::{
    Gossip, RouterError, RouterProcess, RouterTiming, free_udp_ports, node_args, write_cluster_key,
};
use crate::stats::{self, EngineCounters, HistoryTokens, LegRun};
use crate::workload::alphabet::AlphabetError;
use crate::workload::{
    Arrival, PromptFormat, TokenAlphabet, Workload, WorkloadConfig, WorkloadError,
};
use crate::{BenchArgs, blocking_http};

/// The router's residency-downgrade counter.
pub const DOWNGRADES_METRIC: &str = "myelin_router_residency_route_downgrades_total";
/// The router's count of second homes made for prefixes (KV memory full at the first).
pub const REPLICATIONS_METRIC: &str = "myelin_router_prefix_replications_total";
pub const HISTORY_MATCHED_METRIC: &str = "myelin_router_history_matched_tokens_total";
pub const HISTORY_EVICTED_METRIC: &str = "myelin_router_history_evicted_tokens_total";

/// How often the progress bar refreshes.
const PROGRESS_TICK: Duration = Duration::from_millis(250);

/// Why a run could not be carried out (a run that completes but fails its gates is not an
/// error: it reports and exits non-zero).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Legs(#[from] LegError),
    #[error(transparent)]
    Alphabet(#[from] AlphabetError),
    #[error("finding the tokenizer: {0}")]
    Tokenizer(#[from] myelin_tokenize::TokenizeError),
    #[error("the engines' text model: {0}")]
    EngineText(#[from] myelin_sim::text::TextError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Engines(#[from] EngineError),
    #[error(transparent)]
    Router(#[from] RouterError),
    #[error(transparent)]
    Plot(#[from] PlotError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("the load generator failed: {0}")]
    LoadGenerator(String),
    #[error("asking engine {url} for its model: {problem}")]
    Model { url: String, problem: String },
    #[error("interrupted")]
    Interrupted,
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> BenchError + use<> {
    let path = path.display().to_string();
    move |source| BenchError::Io { what, path, source }
}

/// What every harness run sets up: its output directory (with `logs/`), the myelin executable
/// its routers run, and the flag SIGINT and SIGTERM set.
pub(crate) struct RunSetup {
    pub out_dir: PathBuf,
    pub router_exe: PathBuf,
    pub interrupted: Arc<AtomicBool>,
}

/// Creates `out` (or `default_out`) with its `logs/`, resolves `router_bin` (or this
/// executable) and installs the interrupt flag. An error names what failed and on what.
pub(crate) fn run_setup(
    out: Option<&Path>,
    default_out: PathBuf,
    router_bin: Option<&Path>,
) -> Result<RunSetup, (&'static str, PathBuf, std::io::Error)> {
    let out_dir = out.map_or(default_out, Path::to_path_buf);
    std::fs::create_dir_all(out_dir.join("logs"))
        .map_err(|source| ("creating", out_dir.clone(), source))?;
    let router_exe = match router_bin {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()
            .map_err(|source| ("locating", PathBuf::from("the myelin executable"), source))?,
    };
    let interrupted = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(signal, interrupted.clone()).map_err(|source| {
            (
                "installing a handler for",
                PathBuf::from("SIGINT/SIGTERM"),
                source,
            )
        })?;
    }
    Ok(RunSetup {
        out_dir,
        router_exe,
        interrupted,
    })
}

/// Everything a run needs, resolved from the flags.
struct RunContext {
    config: WorkloadConfig,
    legs: Vec<LegSpec>,
    repeat: u32,
    quick: bool,
    out_dir: PathBuf,
    router_exe: PathBuf,
    /// `--router-arg`s: extra `myelin serve` flags for myelin legs.
    router_args: Vec<String>,
    /// `myelin serve` nodes per myelin router leg (`--router-nodes`).
    router_nodes: u32,
    /// With several nodes and gossip on: the cluster key file (in the output directory).
    gossip_key: Option<PathBuf>,
    request_timeout: Duration,
    show_progress: bool,
    ci_gates: bool,
    command_line: String,
    workload: Arc<Workload>,
    alphabet: Arc<TokenAlphabet>,
    interrupted: Arc<AtomicBool>,
    /// Which legs measure the residency calibration (token-id prompts only).
    calibration: CalibrationMode,
    /// Every leg run's calibration, in run order.
    calibrations: std::cell::RefCell<Vec<LegCalibration>>,
    /// One request in this many is sampled for the calibration.
    calibration_every: u64,
    /// Whether every send probes the engines for the request's resident prefix.
    resident_share: bool,
    /// Text prompts: how the engines tokenize them.
    engine_tokenizer: Option<Arc<EngineTokenizer>>,
    /// `--engine`: the engines every leg runs on, instead of a simulated cluster.
    external: Option<ExternalEngines>,
}

/// The engines one leg runs on.
enum LegEngines<'a> {
    Simulated(EmbeddedCluster),
    External(&'a ExternalEngines),
}

impl LegEngines<'_> {
    fn backends(&self) -> Vec<crate::router_process::BackendEndpoint> {
        match self {
            LegEngines::Simulated(cluster) => cluster.backends(),
            LegEngines::External(engines) => engines.backends(),
        }
    }

    fn counters(&self) -> Result<EngineCounters, BenchError> {
        Ok(match self {
            LegEngines::Simulated(cluster) => cluster.counters(),
            LegEngines::External(engines) => engines.counters()?,
        })
    }

    fn block_size(&self) -> u32 {
        match self {
            LegEngines::Simulated(cluster) => cluster.block_size(),
            LegEngines::External(engines) => engines.block_size,
        }
    }

    /// The engines' true state, where the harness can read it (the simulator only).
    fn oracle(&self) -> Option<Arc<dyn CacheOracle>> {
        match self {
            LegEngines::Simulated(cluster) => Some(cluster.oracle()),
            LegEngines::External(_) => None,
        }
    }

    /// What the engines hold, for the calibration and the resident-prefix probe: the
    /// simulator's truth, or the external engines' KV-event streams.
    fn residency_truth(&self) -> Option<Arc<dyn CacheOracle>> {
        match self {
            LegEngines::Simulated(cluster) => Some(cluster.oracle()),
            LegEngines::External(engines) => engines.truth(),
        }
    }

    fn stop(self) {
        if let LegEngines::Simulated(cluster) = self {
            cluster.stop();
        }
    }
}

/// `myelin bench`.
pub fn run(args: BenchArgs) -> Result<ExitCode, BenchError> {
    let config = args.workload_config()?;
    run_config(&args, config)
}

/// `myelin bench` on a workload given as a config (its flags' workload overrides are not
/// applied: `config` is the workload as it runs): what `myelin bench regimes` runs per cell.
pub fn run_config(args: &BenchArgs, config: WorkloadConfig) -> Result<ExitCode, BenchError> {
    config.validate()?;
    let context = prepare(args, config)?;
    let runs = run_all_legs(&context)?;
    finish(&context, &runs)
}

fn prepare(args: &BenchArgs, mut config: WorkloadConfig) -> Result<RunContext, BenchError> {
    let external = if args.engine.is_empty() {
        None
    } else {
        let engines = ExternalEngines::discover(args.engine.clone(), config.cluster.block_size)?;
        config.cluster.block_size = engines.block_size;
        config.cluster.engines = engines.engines.len() as _;
        if let Some(blocks) = engines.kv_blocks {
            config.cluster.kv_blocks = blocks;
        }
        if crate::capacity::needs_measurement(&config) {
            return Err(EngineError::Unsupported(
                "an open-loop or trace workload on external engines needs its rate (--rate, or \
                 capacity_rps in the workload file): the capacity is measured on the simulator's \
                 engine model, not on your engines"
                    .into(),
            )
            .into());
        }
        eprintln!(
            "myelin bench: {} external engine(s), block size {}, {}",
            engines.engines.len(),
            engines.block_size,
            engines
                .kv_blocks
                .map_or("KV capacity unknown".into(), |blocks| format!(
                    "{blocks} KV blocks per engine (the smallest stated)"
                ))
        );
        Some(engines)
    };
    // Open-loop churn: the rate is a fraction of the cluster's capacity, measured once here so
    // every leg gets the same schedule.
    let started = Instant::now();
    if let Some(capacity) = crate::capacity::resolve_rate(&mut config)? {
        eprintln!(
            "myelin bench: cluster capacity {:.2} req/s (round-robin, engines saturated: {} requests \
             in {:.0} simulated s on the engine model, measured in {:.1} s{})",
            capacity.requests_per_s,
            capacity.completed,
            capacity.window_s,
            started.elapsed().as_secs_f64(),
            if config.kind == crate::workload::WorkloadKind::Trace {
                "; the replay keeps the trace's rate"
            } else {
                ""
            }
        );
    }
    let mut legs = all_legs(&args.legs, &args.external)?;
    if external.is_some() && legs.iter().any(|leg| leg.kind == LegKind::Oracle) {
        if args.legs != DEFAULT_LEGS {
            return Err(EngineError::Unsupported(
                "the oracle leg routes with the simulator's true cache contents and queues: it \
                 cannot run on external engines (leave it out of --legs)"
                    .into(),
            )
            .into());
        }
        eprintln!(
            "myelin bench: external engines: the default legs run without the oracle (it needs \
             the simulator's truth)"
        );
        legs.retain(|leg| leg.kind != LegKind::Oracle);
    }
    // The routers key the prefix tree by the engines' block size.
    let mut router_args = args.router_args.clone();
    if external.is_some()
        && !router_args
            .iter()
            .any(|arg| arg == "--block-size" || arg.starts_with("--block-size="))
    {
        router_args.insert(0, format!("--block-size={}", config.cluster.block_size));
    }
    // Text prompts use single-token words of the bundled tokenizer, the one the simulated
    // engines and the router tokenize with, so a prompt planned as N tokens is N tokens there.
    let alphabet = match config.prompt {
        PromptFormat::TokenIds => TokenAlphabet::token_ids(),
        PromptFormat::Text => {
            TokenAlphabet::words_from_tokenizer(&myelin_tokenize::bundled_tokenizer_path()?)?
        }
    };
    let workload = Workload::build(&config, alphabet.clone())?;
    // How the engines tokenize text prompts, for the oracle's and the resident-prefix probes.
    let engine_tokenizer = match config.prompt {
        PromptFormat::TokenIds => None,
        PromptFormat::Text => Some(Arc::new(EngineTokenizer::bundled()?)),
    };
    if let Some(skipped) = workload
        .skipped_over_context()
        .filter(|skipped| skipped.count > 0)
    {
        eprintln!(
            "myelin bench: skipping {} trace line(s) whose prompt plus output exceed the engines' \
             context of {} tokens, on every leg (lines {:?})",
            skipped.count, skipped.context_tokens, skipped.lines
        );
    }
    let RunSetup {
        out_dir,
        router_exe,
        interrupted,
    } = run_setup(
        args.out.as_deref(),
        PathBuf::from("results").join(report::utc_now().1),
        args.router_bin.as_deref(),
    )
    .map_err(|(what, path, source)| io_error(what, &path)(source))?;
    let router_nodes = args.router_nodes.max(1);
    let gossip_key = if router_nodes > 1 && !args.no_gossip {
        let path = out_dir.join("cluster.key");
        write_cluster_key(&path)?;
        Some(path)
    } else {
        None
    };
    let truth_known = external
        .as_ref()
        .is_none_or(|engines| engines.kv_watch.is_some());
    Ok(RunContext {
        legs,
        repeat: args.repeat.max(1),
        quick: args.quick,
        out_dir,
        router_exe,
        router_args,
        router_nodes,
        gossip_key,
        request_timeout: Duration::from_secs(args.request_timeout.max(1)),
        show_progress: !args.no_progress,
        ci_gates: args.ci_gates,
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        workload: Arc::new(workload),
        alphabet: Arc::new(alphabet),
        interrupted,
        // The calibration and the resident-prefix probe read the engines' truth: the
        // simulator's, or the external engines' KV-event streams.
        calibration: if config.prompt == PromptFormat::TokenIds && truth_known {
            args.calibration
        } else {
            CalibrationMode::Off
        },
        calibrations: Default::default(),
        calibration_every: args.calibration_every,
        resident_share: !args.no_resident_share && truth_known,
        engine_tokenizer,
        config,
        external,
    })
}

fn run_all_legs(context: &RunContext) -> Result<Vec<LegRun>, BenchError> {
    let config = &context.config;
    let traffic_s = context.workload.traffic_s(config.duration_s);
    eprintln!(
        "myelin bench: workload {} ({}), {} engines, {}, speedup {}, {:.0} simulated s of traffic \
         per leg (~{:.0} wall s), legs: {}{}; output in {}",
        config.name,
        context.workload.describe(),
        config.cluster.engines,
        match (context.router_nodes, &context.gossip_key) {
            (1, _) => "1 router node".to_string(),
            (nodes, key) => format!(
                "{nodes} router nodes, gossip {}",
                if key.is_some() { "on" } else { "off" }
            ),
        },
        config.cluster.speedup,
        traffic_s,
        traffic_s / config.cluster.speedup,
        context
            .legs
            .iter()
            .map(|leg| leg.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if context.repeat > 1 {
            format!(" x{} repeats", context.repeat)
        } else {
            String::new()
        },
        context.out_dir.display(),
    );
    let mut runs = Vec::new();
    for repeat in 0..context.repeat {
        for index in leg_order(context.legs.len(), repeat) {
            let run = run_leg(context, &context.legs[index], repeat)?;
            let summary = stats::summarize(&[&run]);
            eprintln!(
                "  {} (run {}): {} requests, {} errors, TTFT p50 {:.0} ms p99 {:.0} ms, hit rate {}, {} evictions{}",
                run.name,
                repeat + 1,
                summary.requests,
                summary.errors,
                summary.ttft_ms.p50,
                summary.ttft_ms.p99,
                summary
                    .cache_hit_rate
                    .map_or("-".into(), |rate| format!("{:.1}%", rate * 100.0)),
                summary
                    .evictions
                    .map_or("unmeasured".into(), |count| count.to_string()),
                summary
                    .downgrades
                    .map_or(String::new(), |count| format!(", {count} downgrades")),
            );
            runs.push(run);
        }
    }
    Ok(runs)
}

fn file_safe(name: &str) -> String {
    name.chars()
        .map(|character| {
            if character.is_ascii_alphanumeric() || character == '-' {
                character
            } else {
                '_'
            }
        })
        .collect()
}

fn progress_bar(context: &RunContext, leg: &LegSpec, repeat: u32) -> ProgressBar {
    let traffic_s = context.workload.traffic_s(context.config.duration_s);
    let wall_ms = (traffic_s / context.config.cluster.speedup * 1000.0) as u64;
    let bar = ProgressBar::with_draw_target(
        Some(wall_ms.max(1)),
        if context.show_progress {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    if let Ok(style) = ProgressStyle::with_template("{prefix:>22} [{bar:30}] {percent:>3}% {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(if context.repeat > 1 {
        format!("{} #{}", leg.name, repeat + 1)
    } else {
        leg.name.clone()
    });
    bar
}

fn run_leg(context: &RunContext, leg: &LegSpec, repeat: u32) -> Result<LegRun, BenchError> {
    let config = &context.config;
    let speedup = config.cluster.speedup;
    let kv_events = context.legs.iter().any(|spec| spec.kind.wants_kv_events());
    let cluster = match &context.external {
        Some(engines) => {
            engines.prepare_leg(ENGINE_IDLE_TIMEOUT)?;
            LegEngines::External(engines)
        }
        None => LegEngines::Simulated(start_cluster(&config.cluster, kv_events)?),
    };
    let backends = cluster.backends();
    let model = match &config.model {
        Some(model) => model.clone(),
        None => engine_model(backends.first().map_or("", |backend| backend.url.as_str()))?,
    };
    let log_path =
        context
            .out_dir
            .join("logs")
            .join(format!("{}-{}.log", file_safe(&leg.name), repeat + 1));
    let timing = RouterTiming::scaled(config.cluster.speedup);
    let router_args: Vec<String> = context
        .router_args
        .iter()
        .chain(&leg.router_args)
        .cloned()
        .collect();
    let routers: Vec<RouterProcess> = match leg.kind {
        LegKind::Oracle => Vec::new(),
        LegKind::External => vec![RouterProcess::start_external(
            &leg.name,
            leg.command.as_deref().unwrap_or_default(),
            &backends,
            &log_path,
        )?],
        kind if context.router_nodes <= 1 => vec![RouterProcess::start_myelin(
            &context.router_exe,
            &leg.name,
            kind,
            &backends,
            &timing,
            &[],
            &router_args,
            &log_path,
        )?],
        kind => {
            // Several nodes in front of the same engines; a node that fails to start fails the
            // leg with its log, and the nodes already started stop when dropped.
            let nodes = context.router_nodes as usize;
            let gossip = match &context.gossip_key {
                Some(key_file) => Some(Gossip {
                    ports: free_udp_ports(nodes)?,
                    key_file: key_file.clone(),
                    probe_interval_ms: timing.gossip_probe_interval_ms,
                }),
                None => None,
            };
            let mut started = Vec::with_capacity(nodes);
            for index in 0..nodes {
                let node_log = context.out_dir.join("logs").join(format!(
                    "{}-{}-node{index}.log",
                    file_safe(&leg.name),
                    repeat + 1
                ));
                started.push(RouterProcess::start_myelin(
                    &context.router_exe,
                    &format!("{} node{index}", leg.name),
                    kind,
                    &backends,
                    &timing,
                    &node_args(index, gossip.as_ref()),
                    &router_args,
                    &node_log,
                )?);
            }
            started
        }
    };
    let target = match routers.as_slice() {
        [] => Target::Oracle {
            engine_urls: backends.iter().map(|backend| backend.url.clone()).collect(),
            // Refused with external engines when the legs were read.
            oracle: cluster.oracle().ok_or_else(|| {
                EngineError::Unsupported("the oracle leg needs the simulator".into())
            })?,
            block_size: cluster.block_size(),
            engine_tokenizer: context.engine_tokenizer.clone(),
        },
        [router] => Target::Router {
            base_url: router.base_url().to_string(),
        },
        nodes => Target::Routers {
            base_urls: nodes
                .iter()
                .map(|router| router.base_url().to_string())
                .collect(),
        },
    };
    let progress = Arc::new(LoadProgress::default());
    let plan = LoadPlan {
        workload: context.workload.clone(),
        alphabet: context.alphabet.clone(),
        api: config.api,
        prompt: config.prompt,
        model,
        speedup,
        duration_s: config.duration_s,
        stagger_s: config.warmup_s.min(10.0),
        request_timeout: context.request_timeout,
        progress: progress.clone(),
    };
    let calibration = cluster
        .residency_truth()
        .filter(|_| context.calibration.applies_to(leg.kind))
        .map(|oracle| CalibrationSetup {
            sample_every: context.calibration_every,
            ..CalibrationSetup::new(oracle, &config.cluster, config.seed)
        });
    let resident = cluster
        .residency_truth()
        .filter(|_| context.resident_share)
        .map(|oracle| ResidentProbe {
            oracle,
            block_size: cluster.block_size(),
            engine_tokenizer: context.engine_tokenizer.clone(),
        });
    // External engines count from their own start: a leg's figures are what moved during it.
    let at_start = cluster.counters()?;
    let handle = loadgen::start_probed(plan, target, calibration, resident)
        .map_err(io_error("starting", Path::new("the load generator")))?;

    let traffic_wall_s = context.workload.traffic_s(config.duration_s) / speedup;
    let bar = progress_bar(context, leg, repeat);
    let started = Instant::now();
    let warmup_wall = Duration::from_secs_f64(config.warmup_s / speedup);
    let mut at_warmup: Option<EngineCounters> = None;
    while !progress.finished.load(Ordering::Acquire) {
        if context.interrupted.load(Ordering::Relaxed) {
            bar.abandon_with_message("interrupted");
            drop(routers);
            return Err(BenchError::Interrupted);
        }
        std::thread::sleep(PROGRESS_TICK);
        let elapsed = started.elapsed();
        if at_warmup.is_none() && elapsed >= warmup_wall {
            at_warmup = Some(cluster.counters()?);
        }
        bar.set_position(elapsed.as_millis() as u64);
        bar.set_message(format!(
            "{} done, {} in flight, {} errors{}",
            progress.completed.load(Ordering::Relaxed),
            progress
                .sent
                .load(Ordering::Relaxed)
                .saturating_sub(progress.completed.load(Ordering::Relaxed)),
            progress.errors.load(Ordering::Relaxed),
            if elapsed.as_secs_f64() > traffic_wall_s {
                " (draining)"
            } else {
                ""
            }
        ));
    }
    let mut outcome = handle
        .join()
        .map_err(|error| BenchError::LoadGenerator(error.to_string()))?;
    if let Some(mut measured) = outcome.calibration.take() {
        measured.leg = leg.name.clone();
        measured.repeat = repeat + 1;
        context.calibrations.borrow_mut().push(measured);
    }
    bar.finish_and_clear();

    let at_end = cluster.counters()?;
    let engines_measured = at_end.since(at_warmup.as_ref().unwrap_or(&at_start));
    let engines_total = at_end.since(&at_start);
    // Every node's /metrics (the nodes that answered): counters are summed over them.
    let router_metrics: Vec<String> = if leg.kind.uses_myelin_router() {
        routers
            .iter()
            .filter_map(RouterProcess::scrape_metrics)
            .collect()
    } else {
        Vec::new()
    };
    // A counter that never moved may not be exported yet: a scrape without it means 0.
    let counter = |name| {
        (!router_metrics.is_empty()).then(|| {
            router_metrics
                .iter()
                .map(|text| prometheus::sum_count(text, name).unwrap_or(0))
                .sum::<u64>()
        })
    };
    let downgrades = counter(DOWNGRADES_METRIC);
    let replications = counter(REPLICATIONS_METRIC);
    let history_tokens = counter(HISTORY_MATCHED_METRIC)
        .zip(counter(HISTORY_EVICTED_METRIC))
        .map(|(matched, evicted)| HistoryTokens { matched, evicted });
    for router in routers {
        router.stop();
    }
    cluster.stop();

    let window_s = match context.workload.arrival() {
        Arrival::ClosedLoop { .. } => config.duration_s - config.warmup_s,
        Arrival::OpenLoop { .. } => {
            let last_send_s = outcome
                .records
                .iter()
                .map(|record| record.sent_at_us as f64 * speedup / 1e6)
                .fold(0.0, f64::max);
            (last_send_s - config.warmup_s).max(1.0)
        }
    };
    Ok(LegRun {
        name: leg.name.clone(),
        kind: leg.kind,
        repeat,
        speedup,
        warmup_s: config.warmup_s,
        window_s,
        records: outcome.records,
        engines_measured,
        engines_total,
        downgrades,
        replications,
        history_tokens,
        harness: outcome.harness,
    })
}

/// The model the engines serve (the first one `GET /v1/models` lists).
fn engine_model(engine_url: &str) -> Result<String, BenchError> {
    let url = format!("{engine_url}/v1/models");
    let problem = |problem: String| BenchError::Model {
        url: engine_url.to_string(),
        problem,
    };
    let response = blocking_http::get(&url, Duration::from_secs(10))
        .map_err(|error| problem(error.to_string()))?;
    let document: serde_json::Value = serde_json::from_str(&response.body)
        .map_err(|error| problem(format!("bad JSON: {error}")))?;
    document["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| problem("no data[0].id in the answer".into()))
}

fn finish(context: &RunContext, runs: &[LegRun]) -> Result<ExitCode, BenchError> {
    let config = &context.config;
    let summaries = stats::summarize_all(runs);
    let residency_legs: Vec<&str> = context
        .legs
        .iter()
        .filter(|leg| leg.kind.weights_residency())
        .map(|leg| leg.name.as_str())
        .collect();
    let overlaps = stats::overlaps(&summaries);
    let mut gates = gates::evaluate(&summaries, &residency_legs);
    if context.ci_gates {
        gates.extend(gates::ci_gates(&summaries, config.cluster.speedup));
    }
    let verdict = gates::verdict(&gates);
    let passed = verdict == gates::Verdict::Valid;
    let regime = match crate::regime::Regime::of(config, &context.workload, &summaries) {
        Ok(regime) => Some(regime),
        Err(error) => {
            eprintln!("myelin bench: no regime line: {error}");
            None
        }
    };
    let report = Report {
        schema_version: REPORT_SCHEMA_VERSION,
        myelin_version: env!("CARGO_PKG_VERSION"),
        generated_at: report::utc_now().0,
        command: context.command_line.clone(),
        time_unit: if context.external.is_some() && config.cluster.speedup == 1.0 {
            "wall"
        } else {
            "simulated"
        },
        speedup: config.cluster.speedup,
        repeat: context.repeat,
        quick: context.quick,
        workload: config,
        traffic: context.workload.describe(),
        skipped_over_context: context.workload.skipped_over_context().cloned(),
        router_nodes: context.router_nodes,
        external_engines: context
            .external
            .as_ref()
            .map_or_else(Vec::new, |engines| engines.urls()),
        gossip: context.gossip_key.is_some(),
        regime,
        legs: &summaries,
        overlaps: &overlaps,
        gates: &gates,
        passed,
    };
    let out = &context.out_dir;

    let json_path = out.join("report.json");
    let calibrations = context.calibrations.borrow();
    // Pooled only where a leg ran more than once.
    let pooled: Vec<_> = calibration::pool(&calibrations)
        .into_iter()
        .filter(|leg| leg.runs > 1)
        .collect();
    let json = serde_json::to_string_pretty(&calibration::WithCalibration {
        report: &report,
        calibration: &calibrations,
        calibration_pooled: &pooled,
    })
    .map_err(|error| BenchError::Io {
        what: "serialising",
        path: json_path.display().to_string(),
        source: std::io::Error::other(error),
    })?;
    std::fs::write(&json_path, json + "\n").map_err(io_error("writing", &json_path))?;

    let csv_path = out.join("requests.csv");
    let csv_file = std::fs::File::create(&csv_path).map_err(io_error("creating", &csv_path))?;
    let leg_records: Vec<LegRecords<'_>> = runs
        .iter()
        .map(|run| LegRecords {
            leg: &run.name,
            repeat: run.repeat,
            speedup: run.speedup,
            warmup_s: run.warmup_s,
            records: &run.records,
        })
        .collect();
    write_csv(std::io::BufWriter::new(csv_file), &leg_records)
        .map_err(io_error("writing", &csv_path))?;

    let series: Vec<LegSeries> = summaries
        .iter()
        .map(|summary| LegSeries {
            name: summary.name.clone(),
            points: runs
                .iter()
                .filter(|run| run.name == summary.name)
                .flat_map(|run| {
                    run.records
                        .iter()
                        .filter(|record| !record.outcome.is_error())
                        .filter_map(move |record| {
                            let send_s = record.sent_at_us as f64 * run.speedup / 1e6;
                            record
                                .ttft_us
                                .map(|ttft| (send_s, ttft as f64 * run.speedup / 1000.0))
                        })
                })
                .collect(),
        })
        .collect();
    let measured_series: Vec<LegSeries> = series
        .iter()
        .map(|leg| LegSeries {
            name: leg.name.clone(),
            points: leg
                .points
                .iter()
                .copied()
                .filter(|point| point.0 >= config.warmup_s)
                .collect(),
        })
        .collect();
    let window_s = (config.duration_s / 40.0).max(5.0);
    plot::ttft_cdf(
        &out.join("ttft_cdf.png"),
        &measured_series,
        &format!("TTFT CDF, {} workload (after warm-up)", config.name),
    )?;
    plot::ttft_over_time(
        &out.join("ttft_over_time.png"),
        &series,
        window_s,
        &format!("TTFT P99 over time, {} workload", config.name),
    )?;

    let reliability_png = (!calibrations.is_empty()).then(|| out.join("reliability.png"));
    if let Some(path) = &reliability_png {
        calibration::reliability_diagram(path, &calibrations)?;
    }
    let markdown_path = out.join("report.md");
    let mut markdown = report::render_markdown(
        &report,
        &[
            ("TTFT CDF", "ttft_cdf.png"),
            ("TTFT P99 over time", "ttft_over_time.png"),
        ],
    );
    markdown.push_str(&calibration::render_markdown(
        &calibrations,
        reliability_png.as_ref().map(|_| "reliability.png"),
    ));
    markdown.push_str(&calibration::render_pooled_markdown(&pooled));
    std::fs::write(&markdown_path, markdown).map_err(io_error("writing", &markdown_path))?;

    print!("{}", report::render_text(&report));
    print!("{}", calibration::render_text(&calibrations));
    print!("{}", calibration::render_pooled_text(&pooled));
    println!(
        "report: {}, {}, {}, plots: {}, {}",
        json_path.display(),
        markdown_path.display(),
        csv_path.display(),
        out.join("ttft_cdf.png").display(),
        out.join("ttft_over_time.png").display()
    );
    match verdict {
        gates::Verdict::Valid => {}
        gates::Verdict::Invalid => eprintln!(
            "myelin bench: the run is INVALID (a validity or routing gate failed; see above); \
             exiting with status 1"
        ),
        gates::Verdict::MachineTooBusy => eprintln!(
            "myelin bench: the machine was too busy to judge routing (the harness's loop lag \
             gate failed; see above); exiting with status 3"
        ),
    }
    Ok(ExitCode::from(verdict.exit_status()))
}
