//! glommio data plane and control core of the myelin router: `myelin serve`.
//!
//! [`run`] resolves the configuration, starts one executor per data core (each with its own
//! listener on the shared port, its own prefix shard, connection pool and tokenizer) and one
//! control core, prints `listening on http://ADDR` (`https://` with TLS) on stdout, and drains on SIGTERM/SIGINT.
//! [`start`] does the same without signals or printing, for embedding and tests.

mod admin;
/// Engine specs (`--backend`), shared with `myelin bench --engine`.
pub use myelin_http::backend_spec;
mod backends;
mod body_budget;
pub mod cluster;
pub mod config;
mod control;
pub mod cores;
mod data_core;
mod dns;
mod engine_metrics;
pub mod health;
pub mod kv_feed;
pub mod kv_subscriber;
mod mesh;
mod messages;
pub mod metrics;
pub mod openai;
pub mod otel;
mod pins;
mod proxy;
mod relay;
mod request_path;
/// The router's tokenization of prompts (its caches, the added-token split), in
/// `myelin-tokenize` beside the tokenizer it drives.
pub use myelin_tokenize::route as route_tokens;
mod routing_glue;
mod sim;
mod token_parity;
pub mod tokenize_cmd;
mod watchdog;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use glommio::ExecutorJoinHandle;
use myelin_http::executor::{ExecutorSpec, spawn_executor};
use myelin_http::server::ServeReport;
use myelin_tokenize::{ChatTemplate, FastBpe, Tokenizer, TokenizerSource};

pub use config::{ServeArgs, ServeConfig};

use crate::backends::{BackendId, BackendInfo, BackendState};
use crate::data_core::{CoreReady, DataCoreSetup, run_data_core};
use crate::mesh::build_mesh;
use crate::route_tokens::AddedTokens;

/// Why the server could not start or stop cleanly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] myelin_tokenize::TokenizeError),
    #[error("chat template: {0}")]
    Template(#[from] myelin_tokenize::TemplateError),
    #[error("starting executor {name}: {source}")]
    Executor {
        name: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Startup(String),
    #[error("simulated engines: {0}")]
    Sim(#[from] myelin_sim::SimError),
    #[error("installing signal handlers: {0}")]
    Signals(std::io::Error),
}

/// A running router.
pub struct Server {
    /// Address the data cores listen on (port 0 resolved).
    pub addr: SocketAddr,
    /// Address of the `--metrics-listen` server, when configured.
    pub metrics_addr: Option<SocketAddr>,
    /// The admin API (`--admin-listen`): `http://HOST:PORT` (port 0 resolved) or `unix:PATH`.
    pub admin_addr: Option<String>,
    /// Number of data shards.
    pub shards: usize,
    stop: Arc<AtomicBool>,
    control_stop: Arc<AtomicBool>,
    data_cores: Vec<ExecutorJoinHandle<ServeReport>>,
    control_core: Option<ExecutorJoinHandle<()>>,
    /// The OTLP exporter thread (`--otlp-endpoint`), finished once the data cores stopped.
    exporter: Option<otel::Exporter>,
    _sim: Option<sim::SimEngines>,
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Connections still open when the drain deadline passed, over all data cores.
    pub abandoned_connections: usize,
}

impl Server {
    /// Starts the drain (as SIGTERM does).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Waits for every data core to drain, then stops the control core.
    pub fn wait(mut self) -> Result<DrainReport, ServeError> {
        let mut report = DrainReport::default();
        let mut failure = None;
        for handle in self.data_cores.drain(..) {
            match handle.join() {
                Ok(serve_report) => report.abandoned_connections += serve_report.abandoned,
                Err(error) => {
                    failure = Some(ServeError::Startup(format!("data core failed: {error}")))
                }
            }
        }
        // No data core sends spans any more: the exporter sends what it holds and ends.
        if let Some(exporter) = self.exporter.take() {
            exporter.finish();
        }
        self.control_stop.store(true, Ordering::Release);
        if let Some(handle) = self.control_core.take()
            && let Err(error) = handle.join()
        {
            failure = Some(ServeError::Startup(format!("control core failed: {error}")));
        }
        match failure {
            Some(error) => Err(error),
            None => Ok(report),
        }
    }
}

/// The exact fast tokenizer path for `source`, when it reproduces this tokenizer and agrees
/// with HuggingFace `tokenizers` on the self-check corpus; says through `note` which path is used.
fn fast_tokenizer(
    source: &TokenizerSource,
    tokenizer: &Tokenizer,
    note: &impl Fn(&str),
) -> Option<FastBpe> {
    match FastBpe::verified_source(source, tokenizer) {
        Ok(fast) => {
            note("myelin: tokenizer fast path on (matches tokenizers on the self-check corpus)");
            Some(fast)
        }
        Err(reason) => {
            note(&format!(
                "myelin: tokenizer fast path off ({reason}); using tokenizers"
            ));
            None
        }
    }
}

/// The added tokens of `source` for the per-segment tokenization cache.
fn added_tokens(source: &TokenizerSource) -> Option<AddedTokens> {
    match source {
        TokenizerSource::File(path) => AddedTokens::from_tokenizer_json(path),
        TokenizerSource::Bundled => {
            AddedTokens::from_tokenizer_json_str(myelin_tokenize::BUNDLED_TOKENIZER_JSON)
        }
    }
}

/// What tokenizes prompts for routing, loaded once and shared by every data core (and by
/// `myelin tokenize`).
#[derive(Clone)]
pub(crate) struct TokenizerParts {
    pub tokenizer: Tokenizer,
    pub template: Arc<ChatTemplate>,
    pub added_tokens: Option<Arc<AddedTokens>>,
    pub fast: Option<FastBpe>,
}

impl TokenizerParts {
    /// Loads `--tokenizer` (the bundled one by default) and `--chat-template` (ChatML by
    /// default), with the fast path when `fast` and it verifies; says what it chose through
    /// `note`.
    pub(crate) fn load(
        tokenizer: Option<&std::path::Path>,
        chat_template: Option<&std::path::Path>,
        fast: bool,
        note: impl Fn(&str),
    ) -> Result<TokenizerParts, ServeError> {
        let source = TokenizerSource::from_option(tokenizer);
        let loaded = Tokenizer::load(&source)?;
        note(&format!("myelin: tokenizer {source}"));
        let template = load_template(chat_template)?;
        let fast = if fast {
            fast_tokenizer(&source, &loaded, &note)
        } else {
            note("myelin: tokenizer fast path off (--no-fast-tokenizer)");
            None
        };
        Ok(TokenizerParts {
            added_tokens: added_tokens(&source).map(Arc::new),
            tokenizer: loaded,
            template,
            fast,
        })
    }
}

/// A chat template file (`None`: the built-in ChatML).
fn load_template(path: Option<&std::path::Path>) -> Result<Arc<ChatTemplate>, ServeError> {
    Ok(Arc::new(match path {
        Some(path) => ChatTemplate::from_path(path)?,
        None => ChatTemplate::chatml(),
    }))
}

/// The tokenizer parts of each model named by `--model-tokenizer` or `--model-chat-template`:
/// its own tokenizer or the router-wide `default`, and its own chat template or
/// `--chat-template`. An error names the model.
fn model_tokenizer_parts(
    config: &ServeConfig,
    default: &TokenizerParts,
) -> Result<Vec<(String, TokenizerParts)>, ServeError> {
    config
        .model_tokenizers
        .iter()
        .map(|entry| {
            let template = entry
                .chat_template
                .as_deref()
                .or(config.chat_template.as_deref());
            let parts = match entry.tokenizer.as_deref() {
                Some(tokenizer) => {
                    TokenizerParts::load(Some(tokenizer), template, config.fast_tokenizer, |note| {
                        println!("{note} (model {})", entry.model)
                    })
                }
                None => load_template(template).map(|template| TokenizerParts {
                    template,
                    ..default.clone()
                }),
            };
            parts
                .map(|parts| (entry.model.clone(), parts))
                .map_err(|error| ServeError::Startup(format!("model {}: {error}", entry.model)))
        })
        .collect()
}

/// Starts the router. Setting `stop` (or calling [`Server::stop`]) begins a graceful drain.
pub fn start(config: ServeConfig, stop: Arc<AtomicBool>) -> Result<Server, ServeError> {
    let tokenizer = TokenizerParts::load(
        config.tokenizer.as_deref(),
        config.chat_template.as_deref(),
        config.fast_tokenizer,
        |note| println!("{note}"),
    )?;
    let model_tokenizers = model_tokenizer_parts(&config, &tokenizer)?;

    let mut config = config;
    let sim = if config.sim > 0 {
        let engines = sim::SimEngines::start(
            config.sim,
            config.sim_speedup,
            config.tokenizer.as_deref(),
            config.chat_template.as_deref(),
        )?;
        config.backends.extend(engines.backend_specs());
        Some(engines)
    } else {
        None
    };
    let config = Arc::new(config);
    let metrics = metrics::install();
    let (tracing, exporter) = match &config.otlp {
        Some(otlp) => {
            let (handle, thread) = otel::start(otlp.clone()).map_err(|source| {
                ServeError::Startup(format!("cannot start the OTLP exporter thread: {source}"))
            })?;
            (Some(handle), Some(thread))
        }
        None => (None, None),
    };

    let shards = config.layout.shard_count();
    let initial_backends: Vec<BackendInfo> = config
        .backends
        .iter()
        .enumerate()
        .map(|(index, spec)| BackendInfo {
            id: BackendId(index as u32),
            spec: spec.clone(),
            state: BackendState::Up,
        })
        .collect();
    // Engine host names, resolved here (before any core serves) and then by the control core's
    // resolver thread: data cores never call the blocking system resolver.
    let authorities: Vec<String> = config
        .backends
        .iter()
        .map(|spec| spec.authority.clone())
        .collect();
    let initial_addresses = dns::resolve_now(&authorities);
    let mut mesh_ends = build_mesh(shards + 1).into_iter();
    let control_stop = Arc::new(AtomicBool::new(false));
    let (ready_sender, ready) = mpsc::channel();

    let mut data_cores = Vec::with_capacity(shards);
    let clock_origin = std::time::Instant::now();
    let mut listen = config.listen;
    let mut startup_error = None;
    for shard in 0..shards {
        let name = format!("myelin-data-{shard}");
        let spec = match config.layout.data_cpus[shard] {
            Some(cpu) => ExecutorSpec::pinned(name.clone(), cpu),
            None => ExecutorSpec::unpinned(name.clone()),
        };
        let Some(ends) = mesh_ends.next() else {
            return Err(ServeError::Startup("mesh has too few ends".into()));
        };
        let setup = DataCoreSetup {
            shard,
            shards,
            config: config.clone(),
            listen,
            mesh_ends: ends,
            initial_backends: initial_backends.clone(),
            initial_addresses: initial_addresses.clone(),
            tokenizer: tokenizer.clone(),
            model_tokenizers: model_tokenizers.clone(),
            metrics: metrics.clone(),
            stop: stop.clone(),
            ready: ready_sender.clone(),
            clock_origin,
            tracing: tracing.clone(),
        };
        let handle = spawn_executor(spec, move || run_data_core(setup, request_path::handle))
            .map_err(|source| ServeError::Executor { name, source })?;
        data_cores.push(handle);
        // Port 0: the first shard picks the port, the others join it (SO_REUSEPORT).
        match ready.recv() {
            Ok(CoreReady::Bound(addr)) => listen = addr,
            Ok(CoreReady::Failed(message)) => {
                startup_error = Some(message);
                stop.store(true, Ordering::Release);
            }
            Ok(CoreReady::Serving) | Err(_) => {
                startup_error = Some(format!("shard {shard} did not report its address"));
                stop.store(true, Ordering::Release);
            }
        }
    }

    // Only the cores hold senders now: a core that dies during startup ends the wait below.
    drop(ready_sender);
    drop(tracing);
    let (control_ready_sender, control_ready) = mpsc::channel();
    let control_spec = match config.layout.control_cpu {
        Some(cpu) => ExecutorSpec::pinned("myelin-control", cpu),
        None => ExecutorSpec::unpinned("myelin-control"),
    };
    let Some(control_ends) = mesh_ends.next() else {
        return Err(ServeError::Startup("mesh has too few ends".into()));
    };
    let control_config = config.clone();
    let control_metrics = metrics.clone();
    let control_flag = control_stop.clone();
    let control_core = spawn_executor(control_spec, move || {
        control::run_control(
            control_config,
            shards,
            control_ends,
            initial_backends,
            control_metrics,
            control_flag,
            control_ready_sender,
            admin::start,
        )
    })
    .map_err(|source| ServeError::Executor {
        name: "myelin-control".into(),
        source,
    })?;

    let mut serving = 0;
    while serving < shards && startup_error.is_none() {
        match ready.recv() {
            Ok(CoreReady::Serving) => serving += 1,
            Ok(CoreReady::Failed(message)) => startup_error = Some(message),
            Ok(CoreReady::Bound(_)) => {}
            Err(_) => startup_error = Some("a data core stopped during startup".into()),
        }
    }
    let control_addrs = match control_ready.recv() {
        Ok(Ok(addrs)) => addrs,
        Ok(Err(message)) => {
            startup_error.get_or_insert(message);
            control::ControlAddrs::default()
        }
        Err(_) => {
            startup_error.get_or_insert("the control core stopped during startup".into());
            control::ControlAddrs::default()
        }
    };
    let server = Server {
        addr: listen,
        metrics_addr: control_addrs.metrics,
        admin_addr: control_addrs.admin,
        shards,
        stop,
        control_stop,
        data_cores,
        control_core: Some(control_core),
        exporter,
        _sim: sim,
    };
    if let Some(message) = startup_error {
        server.stop();
        let _ = server.wait();
        return Err(ServeError::Startup(message));
    }
    Ok(server)
}

/// `myelin serve`: runs until SIGTERM/SIGINT, drains, exits 0. A second signal during the
/// drain exits at once with status 1.
pub fn run(args: ServeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let config = ServeConfig::resolve(args)?;
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register_conditional_shutdown(signal, 1, stop.clone())
            .map_err(ServeError::Signals)?;
        signal_hook::flag::register(signal, stop.clone()).map_err(ServeError::Signals)?;
    }
    let summary = format!(
        "{} shards, {} backends{}, routing {}, residency {}",
        config.layout.shard_count(),
        config.backends.len(),
        if config.sim > 0 {
            format!(" + {} simulated", config.sim)
        } else {
            String::new()
        },
        config.routing.as_str(),
        config.residency.as_str(),
    );
    let scheme_of = |tls: &Option<myelin_http::tls::ServerTls>| {
        if tls.is_some() { "https" } else { "http" }
    };
    let (scheme, metrics_scheme) = (scheme_of(&config.tls), scheme_of(&config.metrics_tls));
    let server = start(config, stop)?;
    let metrics_note = server
        .metrics_addr
        .map(|addr| format!(", metrics on {metrics_scheme}://{addr}/metrics"))
        .unwrap_or_default();
    let admin_note = server
        .admin_addr
        .as_ref()
        .map(|addr| format!(", admin on {addr}"))
        .unwrap_or_default();
    println!(
        "myelin: listening on {scheme}://{} ({summary}{metrics_note}{admin_note})",
        server.addr
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let report = server.wait()?;
    if report.abandoned_connections > 0 {
        eprintln!(
            "myelin: drain deadline passed with {} connections still open",
            report.abandoned_connections
        );
    }
    Ok(ExitCode::SUCCESS)
}
