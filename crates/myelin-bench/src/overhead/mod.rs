//! `myelin bench overhead`: what the router itself costs. Instant engines (answers with no
//! simulated GPU time) behind `myelin serve` at several core counts, and behind external
//! routers, against the load generator talking straight to an engine (`direct`). For every
//! prompt shape: peak req/s (closed loop), added latency (open loop, one request at a time),
//! router CPU per request and how evenly the data cores share the routing lookups.
//! docs/reference/benchmark.md ("Overhead and scaling benchmark") is the user guide.

pub mod args;
pub mod cpus;
pub mod engine;
pub mod figures;
pub mod loadgen;
pub mod procstat;
pub mod report;
pub mod shapes;
pub mod targets;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub use args::OverheadArgs;

use self::args::Settings;
use self::cpus::{CpuError, Pinning, RouterLayout, available_cpus, format_cpu_list};
use self::engine::InstantEngines;
use self::loadgen::{
    ClosedLoop, ClosedLoopConfig, OPEN_LOOP_IDLE_CONNECTIONS, OpenLoopConfig, Target,
    percentile_ms, run_open_loop,
};
use self::report::{
    Figures, LegKind, LegResult, Machine, OVERHEAD_SCHEMA_VERSION, OverheadReport,
    busiest_shard_share, median_figures, subtract_direct,
};
use self::shapes::{Shape, ShapeGenerator};
use self::targets::Status;
use crate::legs::{LegError, external_command, parse_external};
use crate::plot::{self, PlotError, XySeries};
use crate::prometheus;
use crate::router_process::{RouterProcess, free_port};
use crate::workload::TokenAlphabet;
use crate::workload::alphabet::AlphabetError;

/// The router counter of routing lookups served, labelled by data core (`shard`).
pub const LOOKUPS_METRIC: &str = "myelin_router_lookups_total";

/// The endpoint every request goes to.
const CHAT_PATH: &str = "/v1/chat/completions";

/// Request-index space of one load phase (each phase starts at a fresh multiple, so unique
/// shapes stay unique across phases and legs).
const PHASE_INDEXES: u64 = 1 << 36;

/// How often waits check for Ctrl-C.
const INTERRUPT_POLL: Duration = Duration::from_millis(50);

/// Why a run could not be carried out (a run whose targets fail is not an error).
#[derive(Debug, thiserror::Error)]
pub enum OverheadError {
    #[error("{0}")]
    Settings(String),
    #[error(transparent)]
    Cpus(#[from] CpuError),
    #[error(transparent)]
    Legs(#[from] LegError),
    #[error("an external leg may not be called {0:?} (a built-in leg has that name)")]
    ReservedName(String),
    #[error(transparent)]
    Alphabet(#[from] AlphabetError),
    #[error("finding the tokenizer: {0}")]
    Tokenizer(#[from] myelin_tokenize::TokenizeError),
    #[error("starting the instant engines: {0}")]
    Engines(std::io::Error),
    #[error("the load generator: {0}")]
    LoadGenerator(String),
    #[error(transparent)]
    Plot(#[from] PlotError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("interrupted")]
    Interrupted,
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> OverheadError {
    let path = path.display().to_string();
    move |source| OverheadError::Io { what, path, source }
}

/// One leg of the plan: what routes, at how many cores.
#[derive(Debug, Clone)]
struct LegPlan {
    name: String,
    kind: LegKind,
    layout: Option<RouterLayout>,
    /// External legs: the command template.
    template: Option<String>,
    /// A myelin leg serving its clients over TLS (`--tls`: `myelin+tls`).
    tls: bool,
}

impl LegPlan {
    fn cores(&self) -> Option<usize> {
        self.layout.as_ref().map(|layout| layout.data.len())
    }

    fn label(&self) -> String {
        match self.cores() {
            Some(cores) => format!("{} @{cores}", self.name),
            None => self.name.clone(),
        }
    }
}

/// Everything a run needs, resolved from the flags.
struct Context {
    settings: Settings,
    pinning: Pinning,
    available: Vec<usize>,
    legs: Vec<LegPlan>,
    generators: Vec<Arc<ShapeGenerator>>,
    out_dir: PathBuf,
    router_exe: PathBuf,
    command_line: String,
    interrupted: Arc<AtomicBool>,
    next_phase: std::cell::Cell<u64>,
    /// With `--tls`: the test certificate's files and the load generator's client side.
    tls: Option<TlsLegs>,
}

/// What the `myelin+tls` legs use: the test certificate (for 127.0.0.1) and key, written into
/// the output directory, and a client configuration that trusts only the test CA.
struct TlsLegs {
    cert: PathBuf,
    key: PathBuf,
    client: Arc<myelin_http::tls::ClientConfig>,
}

/// The test PKI of `crates/myelin-http/tests/fixtures/tls`, built into the harness: for
/// measuring TLS on loopback only, never for serving.
const TEST_CA: &str = include_str!("../../../myelin-http/tests/fixtures/tls/ca.pem");
const TEST_CERT: &str = include_str!("../../../myelin-http/tests/fixtures/tls/server.pem");
const TEST_KEY: &str = include_str!("../../../myelin-http/tests/fixtures/tls/server.key");

impl TlsLegs {
    fn write(out_dir: &std::path::Path) -> Result<TlsLegs, OverheadError> {
        let dir = out_dir.join("tls");
        std::fs::create_dir_all(&dir).map_err(io_error("creating", &dir))?;
        let [ca, cert, key] = [
            ("ca.pem", TEST_CA),
            ("cert.pem", TEST_CERT),
            ("key.pem", TEST_KEY),
        ]
        .map(|(name, text)| (dir.join(name), text));
        for (path, text) in [&ca, &cert, &key] {
            std::fs::write(path, text).map_err(io_error("writing", path))?;
        }
        let client = myelin_http::tls::client_config(&myelin_http::tls::ClientTlsFiles {
            ca: Some(ca.0),
            identity: None,
        })
        .map_err(|error| OverheadError::Settings(format!("the test CA: {error}")))?;
        Ok(TlsLegs {
            cert: cert.0,
            key: key.0,
            client,
        })
    }
}

impl Context {
    fn phase_base(&self) -> u64 {
        let phase = self.next_phase.get();
        self.next_phase.set(phase + 1);
        phase * PHASE_INDEXES
    }

    /// Sleeps `duration`, returning early with an error on Ctrl-C.
    fn sleep(&self, duration: Duration) -> Result<(), OverheadError> {
        let deadline = Instant::now() + duration;
        loop {
            if self.interrupted.load(Ordering::Relaxed) {
                return Err(OverheadError::Interrupted);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(());
            }
            std::thread::sleep(INTERRUPT_POLL.min(deadline - now));
        }
    }
}

/// A leg that ran: its figures per shape.
struct LegRun {
    leg: usize,
    repeat: u32,
    command: Option<String>,
    shapes: Vec<(Shape, Figures)>,
}

/// `myelin bench overhead`: exit status 0 unless a request failed or a leg could not run
/// (or, with `--strict`, a target failed).
pub fn run(args: OverheadArgs) -> Result<ExitCode, OverheadError> {
    let context = prepare(&args)?;
    let engines = InstantEngines::start(context.settings.engines, &context.pinning.engines)
        .map_err(OverheadError::Engines)?;
    print_plan(&context, &engines);
    let mut runs = Vec::new();
    let mut failures = Vec::new();
    for repeat in 0..context.settings.repeat {
        for (index, leg) in context.legs.iter().enumerate() {
            match run_leg(&context, &engines, index, repeat)? {
                Ok(run) => runs.push(run),
                Err(failure) => {
                    eprintln!("  {} FAILED: {failure}", leg.label());
                    failures.push(format!(
                        "{} (repeat {}): {failure}",
                        leg.label(),
                        repeat + 1
                    ));
                }
            }
        }
    }
    let machine = Machine {
        available_cpus: format_cpu_list(&context.available),
        cpu_count: context.available.len(),
        router_cpus: format_cpu_list(&context.pinning.router),
        engine_cpus: format_cpu_list(&context.pinning.engines),
        loadgen_cpus: format_cpu_list(&context.pinning.loadgen),
        shared: context.pinning.shared(),
        engine_urls: engines.urls(),
    };
    engines.stop();
    finish(&context, &machine, runs, &failures)
}

fn prepare(args: &OverheadArgs) -> Result<Context, OverheadError> {
    let settings = args.settings().map_err(OverheadError::Settings)?;
    let available = available_cpus();
    let pinning = Pinning::resolve(
        &available,
        args.router_cpus.as_deref(),
        args.engine_cpus.as_deref(),
        args.loadgen_cpus.as_deref(),
    )?;
    let mut legs = vec![LegPlan {
        name: "direct".into(),
        kind: LegKind::Direct,
        layout: None,
        template: None,
        tls: false,
    }];
    let mut externals = Vec::new();
    for spec in &args.external {
        let external = parse_external(spec)?;
        if ["direct", "myelin", "myelin+tls"].contains(&external.name.as_str()) {
            return Err(OverheadError::ReservedName(external.name));
        }
        if externals
            .iter()
            .any(|(name, _): &(String, String)| *name == external.name)
        {
            return Err(LegError::Duplicate(external.name).into());
        }
        externals.push((external.name, external.command.unwrap_or_default()));
    }
    for &cores in &settings.router_cores {
        let layout = pinning.router_layout(cores)?;
        legs.push(LegPlan {
            name: "myelin".into(),
            kind: LegKind::Myelin,
            layout: Some(layout.clone()),
            template: None,
            tls: false,
        });
        if settings.tls {
            legs.push(LegPlan {
                name: "myelin+tls".into(),
                kind: LegKind::Myelin,
                layout: Some(layout.clone()),
                template: None,
                tls: true,
            });
        }
        for (name, template) in &externals {
            legs.push(LegPlan {
                name: name.clone(),
                kind: LegKind::External,
                layout: Some(layout.clone()),
                template: Some(template.clone()),
                tls: false,
            });
        }
    }
    if let Some(list) = &args.legs {
        let wanted: Vec<&str> = list.split(',').map(str::trim).collect();
        if let Some(unknown) = wanted
            .iter()
            .find(|name| !legs.iter().any(|leg| leg.name == **name))
        {
            return Err(OverheadError::Settings(format!(
                "--legs: no leg {unknown:?} (legs: direct, myelin{}{})",
                if settings.tls { ", myelin+tls" } else { "" },
                externals
                    .iter()
                    .map(|(name, _)| format!(", {name}"))
                    .collect::<String>()
            )));
        }
        legs.retain(|leg| wanted.contains(&leg.name.as_str()));
    }
    // Prompts are single-token words of the bundled tokenizer, the router's default.
    let alphabet =
        TokenAlphabet::words_from_tokenizer(&myelin_tokenize::bundled_tokenizer_path()?)?;
    let generators = settings
        .shapes
        .iter()
        .map(|&shape| {
            ShapeGenerator::new(
                shape,
                &alphabet,
                settings.seed,
                settings.max_tokens,
                settings.stream,
            )
            .map(Arc::new)
            .map_err(OverheadError::Settings)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let crate::runner::RunSetup {
        out_dir,
        router_exe,
        interrupted,
    } = crate::runner::run_setup(
        args.out.as_deref(),
        PathBuf::from("results").join(format!("overhead-{}", crate::report::utc_now().1)),
        args.router_bin.as_deref(),
    )
    .map_err(|(what, path, source)| io_error(what, &path)(source))?;
    let tls = if settings.tls {
        Some(TlsLegs::write(&out_dir)?)
    } else {
        None
    };
    Ok(Context {
        settings,
        pinning,
        available,
        legs,
        generators,
        out_dir,
        router_exe,
        command_line: std::env::args().collect::<Vec<_>>().join(" "),
        interrupted,
        next_phase: std::cell::Cell::new(0),
        tls,
    })
}

fn print_plan(context: &Context, engines: &InstantEngines) {
    let pinning = &context.pinning;
    eprintln!(
        "myelin bench overhead: shapes {}; legs {}; output in {}",
        context
            .settings
            .shapes
            .iter()
            .map(|shape| shape.name())
            .collect::<Vec<_>>()
            .join(", "),
        context
            .legs
            .iter()
            .map(LegPlan::label)
            .collect::<Vec<_>>()
            .join(", "),
        context.out_dir.display(),
    );
    eprintln!(
        "  {} instant engines on CPUs {} ({}); load generator on CPUs {}; router CPUs {}{}",
        engines.urls().len(),
        format_cpu_list(engines.cpus()),
        engines.urls().join(" "),
        format_cpu_list(&pinning.loadgen),
        format_cpu_list(&pinning.router),
        if pinning.shared() {
            " (shared: router, engines and load generator overlap)"
        } else {
            ""
        },
    );
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

/// Starts the leg's router (if any) and measures every shape through it. The outer error
/// aborts the run; the inner one is a leg that could not run (its router did not start).
fn run_leg(
    context: &Context,
    engines: &InstantEngines,
    index: usize,
    repeat: u32,
) -> Result<Result<LegRun, String>, OverheadError> {
    let leg = &context.legs[index];
    let urls = engines.urls();
    let log_path = context.out_dir.join("logs").join(format!(
        "{}-{}-{}.log",
        file_safe(&leg.name),
        leg.cores().unwrap_or(0),
        repeat + 1
    ));
    let start_timeout = context.settings.start_timeout();
    let started = match (&leg.layout, leg.kind) {
        (None, _) | (_, LegKind::Direct) => None,
        (Some(layout), kind) => {
            let port = match free_port() {
                Ok(port) => port,
                Err(error) => return Ok(Err(error.to_string())),
            };
            let mut metrics_listener = None;
            let (command, description) = if kind == LegKind::Myelin {
                let mut arguments: Vec<String> = vec![
                    "serve".into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}"),
                    // Unused here; a free port keeps routers from colliding on the default.
                    "--admin-listen".into(),
                    "127.0.0.1:0".into(),
                    // The harness reads the router's /metrics where it sends its requests.
                    "--metrics-on-client-port".into(),
                ];
                arguments.extend(layout.serve_flags());
                for url in &urls {
                    arguments.push("--backend".into());
                    arguments.push(url.clone());
                }
                if let (true, Some(tls)) = (leg.tls, &context.tls) {
                    // Clients over TLS; the harness reads /metrics in plain HTTP beside them.
                    let metrics_port = match free_port() {
                        Ok(port) => port,
                        Err(error) => return Ok(Err(error.to_string())),
                    };
                    arguments.extend([
                        "--tls-cert".into(),
                        tls.cert.display().to_string(),
                        "--tls-key".into(),
                        tls.key.display().to_string(),
                        "--metrics-listen".into(),
                        format!("127.0.0.1:{metrics_port}"),
                    ]);
                    metrics_listener = Some(metrics_port);
                }
                let mut command = Command::new(&context.router_exe);
                command.args(&arguments);
                let description =
                    format!("{} {}", context.router_exe.display(), arguments.join(" "));
                (command, description)
            } else {
                let line =
                    external_command(leg.template.as_deref().unwrap_or_default(), port, &urls);
                let cpus = format_cpu_list(&layout.all());
                let mut command = Command::new("taskset");
                command.args(["-c", &cpus, "sh", "-c", &line]);
                (command, format!("taskset -c {cpus} sh -c '{line}'"))
            };
            eprintln!(
                "  {} (run {}): {layout}; engines on CPUs {}; load generator on CPUs {}\n    $ {description}",
                leg.label(),
                repeat + 1,
                format_cpu_list(engines.cpus()),
                format_cpu_list(&context.pinning.loadgen),
            );
            let started = match metrics_listener {
                Some(metrics_port) => RouterProcess::start_command_tls(
                    &leg.name,
                    command,
                    description.clone(),
                    (port, metrics_port),
                    &log_path,
                    start_timeout,
                ),
                None => RouterProcess::start_command(
                    &leg.name,
                    command,
                    description.clone(),
                    port,
                    &log_path,
                    start_timeout,
                ),
            };
            match started {
                Ok(router) => Some((router, description)),
                Err(error) => return Ok(Err(error.to_string())),
            }
        }
    };
    if started.is_none() {
        eprintln!(
            "  {} (run {}): load generator (CPUs {}) straight to engine {} (CPUs {})",
            leg.label(),
            repeat + 1,
            format_cpu_list(&context.pinning.loadgen),
            urls[0],
            format_cpu_list(engines.cpus()),
        );
    }
    let base_url = match &started {
        Some((router, _)) => router.base_url().to_string(),
        None => urls[0].clone(),
    };
    let client_tls = leg
        .tls
        .then(|| context.tls.as_ref().map(|tls| tls.client.clone()))
        .flatten();
    let target =
        Target::new(&base_url, CHAT_PATH, client_tls).map_err(OverheadError::LoadGenerator)?;
    let router = started.as_ref().map(|(router, _)| router);
    let mut shapes = Vec::new();
    for generator in &context.generators {
        let figures = measure_shape(context, leg, router, &target, generator)?;
        eprintln!(
            "    {:<17} {:>9.0} req/s  p50 {} ms  p99 {} ms  CPU {} us/req  busiest shard {}  {} errors",
            generator.shape().name(),
            figures.rps,
            figures
                .p50_ms
                .map_or("-".into(), |value| format!("{value:.3}")),
            figures
                .p99_ms
                .map_or("-".into(), |value| format!("{value:.3}")),
            figures
                .cpu_us_per_request
                .map_or("-".into(), |value| format!("{value:.1}")),
            figures
                .busiest_shard_share
                .map_or("-".into(), |value| format!("{value:.2}")),
            figures.errors,
        );
        shapes.push((generator.shape(), figures));
    }
    let command = started.map(|(router, description)| {
        router.stop();
        description
    });
    Ok(Ok(LegRun {
        leg: index,
        repeat,
        command,
        shapes,
    }))
}

/// A point in the closed loop's measured window.
struct Snapshot {
    at: Instant,
    completed: u64,
    cpu_us: Option<u64>,
    lookups: BTreeMap<String, f64>,
}

fn snapshot(closed: &ClosedLoop, router: Option<&RouterProcess>, scrape: bool) -> Snapshot {
    let at = Instant::now();
    let completed = closed.completed();
    let cpu_us = router.and_then(|router| procstat::group_cpu_us(router.pid()));
    let lookups = match router {
        Some(router) if scrape => router
            .scrape_metrics()
            .map(|text| prometheus::samples_by_label(&text, LOOKUPS_METRIC, "shard"))
            .unwrap_or_default(),
        _ => BTreeMap::new(),
    };
    Snapshot {
        at,
        completed,
        cpu_us,
        lookups,
    }
}

fn measure_shape(
    context: &Context,
    leg: &LegPlan,
    router: Option<&RouterProcess>,
    target: &Target,
    generator: &Arc<ShapeGenerator>,
) -> Result<Figures, OverheadError> {
    let settings = &context.settings;
    let scrape = leg.kind == LegKind::Myelin;
    let closed = ClosedLoop::start(ClosedLoopConfig {
        target: target.clone(),
        generator: generator.clone(),
        connections: settings.connections,
        cpus: context.pinning.loadgen.clone(),
        first_index: context.phase_base(),
        request_timeout: settings.request_timeout(),
    })
    .map_err(|error| OverheadError::LoadGenerator(error.to_string()))?;
    context.sleep(Duration::from_secs_f64(settings.warmup_s))?;
    let before = snapshot(&closed, router, scrape);
    context.sleep(Duration::from_secs_f64(settings.duration_s))?;
    let after = snapshot(&closed, router, scrape);
    let totals = closed.finish();
    if let Some(problem) = &totals.first_error {
        eprintln!(
            "    {} {}: {} closed-loop errors, the first: {problem}",
            leg.label(),
            generator.shape().name(),
            totals.errors
        );
    }

    let open = run_open_loop(
        OpenLoopConfig {
            target: target.clone(),
            generator: generator.clone(),
            warmup: settings.open_warmup,
            requests: settings.open_requests,
            rate: settings.open_rate,
            cpu: context.pinning.loadgen.first().copied(),
            first_index: context.phase_base(),
            request_timeout: settings.request_timeout(),
        },
        context.interrupted.clone(),
    )
    .map_err(OverheadError::LoadGenerator)?;
    if context.interrupted.load(Ordering::Relaxed) {
        return Err(OverheadError::Interrupted);
    }
    if let Some(problem) = &open.first_error {
        eprintln!(
            "    {} {}: {} open-loop errors, the first: {problem}",
            leg.label(),
            generator.shape().name(),
            open.errors
        );
    }
    // More connections than the open loop keeps idle: requests waited on new connections
    // (TCP, and with TLS a handshake each), which is part of their latency.
    if open.connections_opened > OPEN_LOOP_IDLE_CONNECTIONS {
        eprintln!(
            "    {} {}: the open loop opened {} connections (it keeps up to {} idle): \
             requests waited on new connections",
            leg.label(),
            generator.shape().name(),
            open.connections_opened,
            OPEN_LOOP_IDLE_CONNECTIONS
        );
    }

    let requests = after.completed.saturating_sub(before.completed);
    let window = after.at.duration_since(before.at).as_secs_f64();
    let cpu_us_per_request = match (before.cpu_us, after.cpu_us) {
        (Some(start), Some(end)) if requests > 0 => {
            Some(end.saturating_sub(start) as f64 / requests as f64)
        }
        _ => None,
    };
    let share = busiest_shard_share(&before.lookups, &after.lookups);
    Ok(Figures {
        rps: if window > 0.0 {
            requests as f64 / window
        } else {
            0.0
        },
        requests,
        errors: totals.errors + open.errors,
        p50_ms: percentile_ms(&open.latency_us, 0.50),
        p99_ms: percentile_ms(&open.latency_us, 0.99),
        first_byte_p50_ms: percentile_ms(&open.first_byte_us, 0.50),
        first_byte_p99_ms: percentile_ms(&open.first_byte_us, 0.99),
        added_p50_ms: None,
        added_p99_ms: None,
        cpu_us_per_request,
        busiest_shard_share: share.as_ref().map(|(share, _)| *share),
        shard_lookups: share.map(|(_, deltas)| deltas),
        open_loop_requests: open.latency_us.len() as u64,
        measured_s: window,
    })
}

/// Added latency against the direct leg, medians over repeats, one result per leg and shape.
fn results(context: &Context, mut runs: Vec<LegRun>) -> Vec<LegResult> {
    let direct: BTreeMap<(u32, Shape), Figures> = runs
        .iter()
        .filter(|run| context.legs[run.leg].kind == LegKind::Direct)
        .flat_map(|run| {
            run.shapes
                .iter()
                .map(move |(shape, figures)| ((run.repeat, *shape), figures.clone()))
        })
        .collect();
    for run in &mut runs {
        if context.legs[run.leg].kind == LegKind::Direct {
            continue;
        }
        for (shape, figures) in &mut run.shapes {
            if let Some(base) = direct.get(&(run.repeat, *shape)) {
                subtract_direct(figures, base);
            }
        }
    }
    let mut results = Vec::new();
    for (index, leg) in context.legs.iter().enumerate() {
        for &shape in &context.settings.shapes {
            let repeats: Vec<Figures> = runs
                .iter()
                .filter(|run| run.leg == index)
                .flat_map(|run| run.shapes.iter())
                .filter(|(run_shape, _)| *run_shape == shape)
                .map(|(_, figures)| figures.clone())
                .collect();
            if repeats.is_empty() {
                continue;
            }
            let command = runs
                .iter()
                .find(|run| run.leg == index)
                .and_then(|run| run.command.clone());
            results.push(LegResult {
                name: leg.name.clone(),
                kind: leg.kind,
                router_cores: leg.cores(),
                shape: shape.name().to_string(),
                cpus: leg
                    .layout
                    .as_ref()
                    .map(|layout| format_cpu_list(&layout.all())),
                command,
                figures: median_figures(&repeats),
                repeats,
            });
        }
    }
    results
}

fn write_plots(
    out_dir: &Path,
    legs: &[LegResult],
    shapes: &[Shape],
) -> Result<Vec<(&'static str, &'static str)>, OverheadError> {
    let cores: Vec<usize> = {
        let mut cores: Vec<usize> = legs.iter().filter_map(|leg| leg.router_cores).collect();
        cores.sort_unstable();
        cores.dedup();
        cores
    };
    let mut names: Vec<(&str, LegKind)> = Vec::new();
    for leg in legs {
        if leg.kind != LegKind::Direct && !names.contains(&(leg.name.as_str(), leg.kind)) {
            names.push((&leg.name, leg.kind));
        }
    }
    let series = |value: fn(&LegResult) -> Option<f64>, with_direct: bool| {
        let mut lines = Vec::new();
        for shape in shapes {
            for (name, kind) in &names {
                let points: Vec<(f64, f64)> = legs
                    .iter()
                    .filter(|leg| leg.name == *name && leg.shape == shape.name())
                    .filter_map(|leg| Some((leg.router_cores? as f64, value(leg)?)))
                    .collect();
                if !points.is_empty() {
                    lines.push(XySeries {
                        name: format!("{name} {}", shape.name()),
                        points,
                        secondary: *kind == LegKind::External,
                    });
                }
            }
            if with_direct
                && let Some(direct) = legs
                    .iter()
                    .find(|leg| leg.kind == LegKind::Direct && leg.shape == shape.name())
            {
                lines.push(XySeries {
                    name: format!("direct {} (no router)", shape.name()),
                    points: cores
                        .iter()
                        .map(|&cores| (cores as f64, direct.figures.rps))
                        .collect(),
                    secondary: true,
                });
            }
        }
        lines
    };
    let plots: [(&str, &str, &str, Vec<XySeries>); 3] = [
        (
            "req/s vs router cores",
            "rps_vs_cores.png",
            "req/s (closed loop)",
            series(|leg| Some(leg.figures.rps), true),
        ),
        (
            "added p50 latency vs router cores",
            "added_p50_vs_cores.png",
            "added p50 (ms, vs direct)",
            series(|leg| leg.figures.added_p50_ms, false),
        ),
        (
            "added p99 latency vs router cores",
            "added_p99_vs_cores.png",
            "added p99 (ms, vs direct)",
            series(|leg| leg.figures.added_p99_ms, false),
        ),
    ];
    let mut written = Vec::new();
    for (title, file, y_desc, lines) in plots {
        plot::xy_lines(&out_dir.join(file), &lines, title, "router cores", y_desc)?;
        written.push((title, file));
    }
    let lines = cpu_against_turns(legs);
    if !lines.is_empty() {
        let title = "router CPU per request vs conversation length";
        let file = "cpu_vs_turns.png";
        plot::xy_lines(
            &out_dir.join(file),
            &lines,
            title,
            "turns per conversation (agentic: steps)",
            "CPU us/request",
        )?;
        written.push((title, file));
    }
    Ok(written)
}

/// CPU per request of the conversation shapes against their length: one line per router leg
/// and core count over multi-turn-N, and the agentic shape as its own line.
fn cpu_against_turns(legs: &[LegResult]) -> Vec<XySeries> {
    let mut lines: Vec<XySeries> = Vec::new();
    for leg in legs.iter().filter(|leg| leg.kind != LegKind::Direct) {
        let (Some(shape), Some(cores), Some(cpu)) = (
            Shape::from_name(&leg.shape),
            leg.router_cores,
            leg.figures.cpu_us_per_request,
        ) else {
            continue;
        };
        if !shape.is_conversation() {
            continue;
        }
        let family = if shape == Shape::Agentic {
            "agentic"
        } else {
            "multi-turn"
        };
        let name = format!("{} @{cores} {family}", leg.name);
        let point = (shape.turns() as f64, cpu);
        match lines.iter_mut().find(|line| line.name == name) {
            Some(line) => line.points.push(point),
            None => lines.push(XySeries {
                name,
                points: vec![point],
                secondary: leg.kind == LegKind::External,
            }),
        }
    }
    for line in &mut lines {
        line.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    lines
}

fn finish(
    context: &Context,
    machine: &Machine,
    runs: Vec<LegRun>,
    failures: &[String],
) -> Result<ExitCode, OverheadError> {
    let legs = results(context, runs);
    let targets = targets::evaluate(&legs, context.available.len());
    let errors: u64 = legs.iter().map(|leg| leg.figures.errors).sum();
    let report = OverheadReport {
        schema_version: OVERHEAD_SCHEMA_VERSION,
        benchmark: "overhead",
        myelin_version: env!("CARGO_PKG_VERSION"),
        generated_at: crate::report::utc_now().0,
        command: context.command_line.clone(),
        settings: &context.settings,
        machine,
        legs: &legs,
        failures,
        targets: &targets,
        valid: errors == 0 && failures.is_empty(),
    };
    let out_dir = &context.out_dir;
    let plots = write_plots(out_dir, &legs, &context.settings.shapes)?;
    let json_path = out_dir.join("report.json");
    let json = serde_json::to_string_pretty(&report).map_err(|error| OverheadError::Io {
        what: "serializing",
        path: json_path.display().to_string(),
        source: std::io::Error::other(error),
    })?;
    std::fs::write(&json_path, json + "\n").map_err(io_error("writing", &json_path))?;
    let markdown_path = out_dir.join("report.md");
    std::fs::write(&markdown_path, report::render_markdown(&report, &plots))
        .map_err(io_error("writing", &markdown_path))?;
    println!();
    print!("{}", report::render_text(&report));
    println!("report: {}", out_dir.display());
    let target_failed = targets.iter().any(|target| target.status == Status::Fail);
    Ok(
        if !report.valid || (context.settings.strict && target_failed) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        },
    )
}
