//! `myelin serve` configuration: command-line flags, `MYELIN_*` variables, the TOML file, defaults.
//!
//! Each flag is defined once, in [`ServeArgs`]: its name (which is also its config-file key),
//! its variable, its default and its help. Precedence: flag > environment variable > config
//! file > built-in default. The config file is applied as the flags' defaults
//! ([`parse_command_line`]), so clap itself resolves the order and a file value is checked by
//! the same parser as the flag. [`ServeConfig::from_args`] then checks what spans several flags
//! and turns the values into the types the server runs with.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use myelin_routing::{CostModel, Policy, ResidencyMode};

use crate::backend_spec::{BackendSpec, BackendSpecError};
use crate::cores::{CoreLayout, CoreLayoutError, decide_layout, online_cpus};

/// Memory per data core for each tokenizer cache, by default (`--tokenize-cache-bytes`).
pub const DEFAULT_TOKENIZE_CACHE_BYTES: usize = 16 * 1024 * 1024;

/// A `usize` flag of at least 1.
fn positive() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// `--sim-speedup`: a finite number above 0.
/// `MODEL=PATH`: a served model's name (as requests send it) and a file of its.
fn model_path(text: &str) -> Result<(String, PathBuf), String> {
    let (model, path) = text
        .split_once('=')
        .ok_or_else(|| format!("{text:?} is not MODEL=PATH"))?;
    if model.is_empty() || model.len() > MAX_MODEL_NAME_BYTES {
        return Err(format!(
            "the model name must have 1 to {MAX_MODEL_NAME_BYTES} bytes"
        ));
    }
    if path.is_empty() {
        return Err(format!("{text:?} names no file"));
    }
    Ok((model.to_string(), PathBuf::from(path)))
}

/// Longest model name `--model-tokenizer` and `--model-chat-template` take.
const MAX_MODEL_NAME_BYTES: usize = 256;

/// Most models with a tokenizer or chat template of their own: each costs every data core a
/// tokenizer and its caches (`--tokenize-cache-bytes` each).
pub const MAX_MODEL_TOKENIZERS: usize = 32;

fn speedup(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value.is_finite() && value > 0.0 => Ok(value),
        _ => Err(format!("{text:?} is not a positive number")),
    }
}

/// `--trace-sample`: a ratio from 0 to 1.
fn sample_ratio(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("{text:?} is not a ratio from 0 to 1")),
    }
}

/// `--health-path`: an absolute path.
fn health_path(text: &str) -> Result<String, String> {
    if text.starts_with('/') {
        Ok(text.to_string())
    } else {
        Err(format!("{text:?} does not start with `/`"))
    }
}

/// Flags of `myelin serve`. Each may also come from a `MYELIN_*` variable or the `--config` file.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Precedence: flag > MYELIN_* environment variable > --config file > default.\n\
                  See docs/reference/flags.md, docs/reference/metrics.md and docs/server.md."
)]
pub struct ServeArgs {
    /// TOML file holding any of these flags as kebab-case keys (`listen = "0.0.0.0:8080"`,
    /// `backend = ["http://h:8000"]`). Flags and MYELIN_* variables override it. [default: none]
    #[arg(long, env = "MYELIN_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,

    /// Address clients connect to; every data shard listens on it (SO_REUSEPORT).
    /// Port 0 picks a free port (printed on stdout).
    #[arg(
        long,
        env = "MYELIN_LISTEN",
        value_name = "HOST:PORT",
        default_value = "0.0.0.0:8080"
    )]
    pub listen: SocketAddr,

    /// Also serve GET /metrics on this address, without a token (the admin API always serves
    /// it, behind its token when one is set). [default: none]
    #[arg(long, env = "MYELIN_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<SocketAddr>,

    /// Also serve GET /metrics on --listen, to every client (its series name backends by id,
    /// never by address). [default: off: /metrics is on the admin API and --metrics-listen]
    #[arg(long, env = "MYELIN_METRICS_ON_CLIENT_PORT")]
    pub metrics_on_client_port: bool,

    /// Answer a request sent with `x-myelin-trace: 1` with its routing decision's evidence in
    /// an `x-myelin-decision` response header (every candidate backend's matched blocks,
    /// expected cached tokens, load, predicted TTFT and cost; backends by id, never by
    /// address). [default: off: the request header is ignored]
    #[arg(long, env = "MYELIN_DECISION_TRACE")]
    pub decision_trace: bool,

    /// Export OpenTelemetry traces of generation requests to this collector, over OTLP/HTTP
    /// with the JSON encoding: `http://HOST:PORT[/PATH]` (path `/v1/traces` when none; plain
    /// HTTP: run the collector beside the router). A client's W3C `traceparent` is continued
    /// and the engine gets one naming the router's span. [default: none: no traces, no cost]
    #[arg(long, env = "MYELIN_OTLP_ENDPOINT", value_name = "URL",
          value_parser = |text: &str| text.parse::<crate::otel::OtlpEndpoint>())]
    pub otlp_endpoint: Option<crate::otel::OtlpEndpoint>,

    /// Share of requests traced when the client sends no `traceparent` (0 to 1; a client's
    /// sampled flag always decides for its own requests). Needs --otlp-endpoint.
    #[arg(long, env = "MYELIN_TRACE_SAMPLE", value_name = "RATIO", default_value = "1",
          value_parser = sample_ratio)]
    pub trace_sample: f64,

    /// `service.name` of the exported traces (with --otlp-endpoint).
    #[arg(
        long,
        env = "MYELIN_OTEL_SERVICE_NAME",
        value_name = "NAME",
        default_value = "myelin"
    )]
    pub otel_service_name: String,

    /// Address of the admin API (`/admin/backends`), served by the control core and never on
    /// --listen: HOST:PORT, or `unix:PATH` for a Unix socket (created mode 0600, a stale one
    /// replaced, removed at exit). Port 0 picks a free port (printed on stdout). A non-loopback
    /// address needs --admin-token-file.
    #[arg(
        long,
        env = "MYELIN_ADMIN_LISTEN",
        value_name = "HOST:PORT|unix:PATH",
        default_value = "127.0.0.1:9090"
    )]
    pub admin_listen: AdminListen,

    /// File holding the admin API's bearer token (`Authorization: Bearer TOKEN`; surrounding
    /// whitespace ignored). Required when --admin-listen is not a loopback address.
    /// [default: none: no token on loopback]
    #[arg(long, env = "MYELIN_ADMIN_TOKEN_FILE", value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,

    /// Serve clients over TLS (HTTPS, ALPN h2 and http/1.1) with this PEM certificate chain,
    /// leaf first; needs --tls-key. The files are read again when they change (looked at once
    /// a second), so a renewed certificate serves new connections without a restart.
    /// [default: none: plain HTTP]
    #[arg(
        long,
        env = "MYELIN_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,

    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1). [default: none]
    #[arg(
        long,
        env = "MYELIN_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,

    /// Serve the admin API over TLS with this PEM certificate chain; needs --admin-tls-key.
    /// [default: none: plain HTTP]
    #[arg(
        long,
        env = "MYELIN_ADMIN_TLS_CERT",
        value_name = "PATH",
        requires = "admin_tls_key"
    )]
    pub admin_tls_cert: Option<PathBuf>,

    /// The PEM private key of --admin-tls-cert. [default: none]
    #[arg(
        long,
        env = "MYELIN_ADMIN_TLS_KEY",
        value_name = "PATH",
        requires = "admin_tls_cert"
    )]
    pub admin_tls_key: Option<PathBuf>,

    /// Admin clients must present a certificate signed by a CA of this PEM file (mutual TLS;
    /// needs --admin-tls-cert). With it, a non-loopback --admin-listen needs no token.
    /// [default: none]
    #[arg(
        long,
        env = "MYELIN_ADMIN_CLIENT_CA",
        value_name = "PATH",
        requires = "admin_tls_cert"
    )]
    pub admin_client_ca: Option<PathBuf>,

    /// Serve --metrics-listen over TLS with this PEM certificate chain; needs
    /// --metrics-tls-key and --metrics-listen. [default: none: plain HTTP]
    #[arg(
        long,
        env = "MYELIN_METRICS_TLS_CERT",
        value_name = "PATH",
        requires_all = ["metrics_tls_key", "metrics_listen"]
    )]
    pub metrics_tls_cert: Option<PathBuf>,

    /// The PEM private key of --metrics-tls-cert. [default: none]
    #[arg(
        long,
        env = "MYELIN_METRICS_TLS_KEY",
        value_name = "PATH",
        requires = "metrics_tls_cert"
    )]
    pub metrics_tls_key: Option<PathBuf>,

    /// Scrapers of --metrics-listen must present a certificate signed by a CA of this PEM
    /// file (mutual TLS; needs --metrics-tls-cert). [default: none]
    #[arg(
        long,
        env = "MYELIN_METRICS_CLIENT_CA",
        value_name = "PATH",
        requires = "metrics_tls_cert"
    )]
    pub metrics_client_ca: Option<PathBuf>,

    /// Trust the CA certificates of this PEM file for `https://` engines, instead of the
    /// system's roots. [default: none: the system's roots (SSL_CERT_FILE, SSL_CERT_DIR or the
    /// platform's store)]
    #[arg(long, env = "MYELIN_ENGINE_CA", value_name = "PATH")]
    pub engine_ca: Option<PathBuf>,

    /// Present this PEM client certificate chain to `https://` engines (mutual TLS); needs
    /// --engine-client-key. [default: none]
    #[arg(
        long,
        env = "MYELIN_ENGINE_CLIENT_CERT",
        value_name = "PATH",
        requires = "engine_client_key"
    )]
    pub engine_client_cert: Option<PathBuf>,

    /// The PEM private key of --engine-client-cert. [default: none]
    #[arg(
        long,
        env = "MYELIN_ENGINE_CLIENT_KEY",
        value_name = "PATH",
        requires = "engine_client_cert"
    )]
    pub engine_client_key: Option<PathBuf>,

    /// An inference engine: `http://host:port[,kv-events=tcp://host:port]`. Repeat the flag
    /// for several; in MYELIN_BACKEND separate them with `;`; in the config file a list of
    /// specs or tables (`{ url = "...", kv-events = "..." }`). Flags replace the file's list.
    /// [default: none]
    #[arg(
        long = "backend",
        alias = "backends",
        env = "MYELIN_BACKEND",
        value_name = "SPEC",
        value_delimiter = ';'
    )]
    pub backends: Vec<String>,

    /// Start N simulated vLLM engines in-process and use them as backends (added to any
    /// --backend).
    #[arg(long, env = "MYELIN_SIM", value_name = "N", default_value_t = 0)]
    pub sim: usize,

    /// Simulated time runs this many times faster than real time (with --sim).
    #[arg(long, env = "MYELIN_SIM_SPEEDUP", value_name = "FACTOR", default_value = "1",
          value_parser = speedup)]
    pub sim_speedup: f64,

    /// The peer cluster (--gossip-listen, --peer, --node-id, --cluster-key-file).
    #[command(flatten)]
    pub gossip: crate::cluster::GossipArgs,

    /// Routing policy: `round-robin` (each backend in turn), `least-load` (fewest queued and
    /// active tokens) or `prefix` (lowest cost: the predicted time to first token, see --cost).
    #[arg(long, env = "MYELIN_ROUTING", value_name = "POLICY", default_value = "prefix",
          value_parser = |name: &str| name.parse::<Policy>())]
    pub routing: Policy,

    /// How much the prefix policy trusts its routing history: `off` (history only: a prefix
    /// routed to a backend counts as cached there), `estimate` (history discounted by an
    /// estimate of eviction from cache pressure), `verified` (only blocks the backend's
    /// KV-event stream confirms) or `auto` (verified where a KV-event stream is live, estimate
    /// elsewhere).
    #[arg(long, env = "MYELIN_RESIDENCY", value_name = "MODE", default_value = "auto",
          value_parser = |name: &str| name.parse::<ResidencyMode>())]
    pub residency: ResidencyMode,

    /// tokenizer.json of the served model. [default: the bundled deepseek-v3 tokenizer]
    #[arg(long, env = "MYELIN_TOKENIZER", value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,

    /// Chat template: the model's tokenizer_config.json (its `chat_template`) or a .jinja file.
    /// [default: built-in ChatML]
    #[arg(long, env = "MYELIN_CHAT_TEMPLATE", value_name = "PATH")]
    pub chat_template: Option<PathBuf>,

    /// The tokenizer.json of one served model, `MODEL=PATH`: requests naming MODEL are
    /// tokenized with it (other models with --tokenizer). Repeat the flag for several models;
    /// in MYELIN_MODEL_TOKENIZER separate them with `;`. [default: none]
    #[arg(long = "model-tokenizer", env = "MYELIN_MODEL_TOKENIZER", value_name = "MODEL=PATH",
          value_delimiter = ';', value_parser = model_path)]
    pub model_tokenizers: Vec<(String, PathBuf)>,

    /// The chat template of one served model, `MODEL=PATH` (its tokenizer_config.json or a
    /// .jinja file): chats naming MODEL are rendered with it (other models with
    /// --chat-template). Repeatable like --model-tokenizer. [default: none]
    #[arg(long = "model-chat-template", env = "MYELIN_MODEL_CHAT_TEMPLATE",
          value_name = "MODEL=PATH", value_delimiter = ';', value_parser = model_path)]
    pub model_chat_templates: Vec<(String, PathBuf)>,

    /// KV-cache block size of the engines, in tokens (vLLM --block-size).
    #[arg(long, env = "MYELIN_BLOCK_SIZE", value_name = "TOKENS", default_value_t = 16,
          value_parser = positive())]
    pub block_size: usize,

    /// Data cores, pinned one shard per CPU (`0-7`, `2,4,6`). [default: every CPU but the
    /// control core]
    #[arg(long, env = "MYELIN_CORES", value_name = "LIST")]
    pub cores: Option<String>,

    /// Run N unpinned data shards instead of --cores (tests, laptops). [default: none]
    #[arg(long, env = "MYELIN_SHARDS", value_name = "N")]
    pub shards: Option<usize>,

    /// CPU of the control core (health checks, signals, fan-out). [default: the first CPU
    /// that is not a data core]
    #[arg(long, env = "MYELIN_CONTROL_CORE", value_name = "CPU")]
    pub control_core: Option<usize>,

    /// Do not pin executors to CPUs. [default: pin unless --shards]
    #[arg(long, env = "MYELIN_NO_PIN")]
    pub no_pin: bool,

    /// Largest request body accepted; larger ones get 413.
    #[arg(long, env = "MYELIN_MAX_BODY_BYTES", value_name = "BYTES",
          default_value_t = 8 * 1024 * 1024, value_parser = positive())]
    pub max_body_bytes: usize,

    /// Bytes of request bodies one data core holds while reading them, before the requests
    /// are admitted; a body that would take more gets 429 `router_overloaded` at once
    /// (myelin_body_budget_rejections_total).
    #[arg(long, env = "MYELIN_MAX_BODY_BUFFER_BYTES_PER_CORE", value_name = "BYTES",
          default_value_t = 256 * 1024 * 1024, value_parser = positive())]
    pub max_body_buffer_bytes_per_core: usize,

    /// Client connections open at once per data core; one more is closed on accept
    /// (myelin_connections_refused_total).
    #[arg(long, env = "MYELIN_MAX_CONNECTIONS_PER_CORE", value_name = "N",
          default_value_t = 4096, value_parser = positive())]
    pub max_connections_per_core: usize,

    /// Requests in flight per data core before new ones get 429 with Retry-After.
    #[arg(long, env = "MYELIN_MAX_IN_FLIGHT_PER_CORE", value_name = "N",
          default_value_t = 1024, value_parser = positive())]
    pub max_in_flight_per_core: usize,

    /// The served model's context length (vLLM's --max-model-len): a request whose max_tokens
    /// or prompt alone exceeds it gets 400 before it is counted anywhere. [default: the
    /// smallest max_model_len the engines' GET /v1/models report, when they do]
    #[arg(long, env = "MYELIN_MAX_MODEL_LEN", value_name = "TOKENS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_model_len: Option<u64>,

    /// Retry-After value sent with 429.
    #[arg(
        long,
        env = "MYELIN_RETRY_AFTER_SECONDS",
        value_name = "SECONDS",
        default_value_t = 1
    )]
    pub retry_after_seconds: u64,

    /// Attempts on other backends after a connect error or 502/503 before the first response
    /// byte; never after streaming began.
    #[arg(
        long,
        env = "MYELIN_MAX_RETRIES",
        value_name = "N",
        default_value_t = 2
    )]
    pub max_retries: u32,

    /// Backoff before the first retry, doubled for each further one.
    #[arg(
        long,
        env = "MYELIN_RETRY_BACKOFF_MS",
        value_name = "MS",
        default_value_t = 20
    )]
    pub retry_backoff_ms: u64,

    /// Timeout for connecting to an engine.
    #[arg(long, env = "MYELIN_CONNECT_TIMEOUT_MS", value_name = "MS", default_value_t = 2_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub connect_timeout_ms: u64,

    /// Time a client has to send its whole request body once the head arrived; past it, 408.
    /// The in-flight slot is taken only once the body is complete.
    #[arg(long, env = "MYELIN_BODY_READ_TIMEOUT_MS", value_name = "MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub body_read_timeout_ms: u64,

    /// Time an engine has to send the response head of a streaming request (engines send it
    /// before the first token); past it the attempt counts as a failure (circuit breaker) and
    /// the request goes to another backend like after a connect error.
    #[arg(long, env = "MYELIN_UPSTREAM_HEADER_TIMEOUT_MS", value_name = "MS",
          default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub upstream_header_timeout_ms: u64,

    /// Time an engine has to answer a non-streaming request (its head comes with the whole
    /// completion); past it, 504 and a breaker failure, no retry.
    #[arg(long, env = "MYELIN_UPSTREAM_RESPONSE_TIMEOUT_MS", value_name = "MS",
          default_value_t = 600_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub upstream_response_timeout_ms: u64,

    /// Longest silence of an engine's response body (before its first byte and between two
    /// chunks); past it the engine request is aborted and an SSE stream ends with an error
    /// event.
    #[arg(long, env = "MYELIN_STREAM_IDLE_TIMEOUT_MS", value_name = "MS",
          default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub stream_idle_timeout_ms: u64,

    /// An engine with requests in flight and no response byte on any of them for this long is
    /// taken as wedged: its circuit breaker opens (no new requests until its probation lets
    /// one through and that one is answered). Where the engine exports a generated-tokens
    /// counter (scraped metrics), only if that stood still as long; without one, only when
    /// streams are among the silent requests. 0 = off.
    #[arg(
        long,
        env = "MYELIN_ENGINE_STALL_MS",
        value_name = "MS",
        default_value_t = 30_000
    )]
    pub engine_stall_ms: u64,

    /// Interval of active health checks (GET --health-path on each engine).
    #[arg(long, env = "MYELIN_HEALTH_INTERVAL_MS", value_name = "MS", default_value_t = 2_000,
          value_parser = clap::value_parser!(u64).range(10..))]
    pub health_interval_ms: u64,

    /// Timeout of one health check.
    #[arg(long, env = "MYELIN_HEALTH_TIMEOUT_MS", value_name = "MS", default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub health_timeout_ms: u64,

    /// Path probed by active health checks.
    #[arg(long, env = "MYELIN_HEALTH_PATH", value_name = "PATH", default_value = "/health",
          value_parser = health_path)]
    pub health_path: String,

    /// Consecutive successful checks that bring a down backend up.
    #[arg(long, env = "MYELIN_HEALTHY_THRESHOLD", value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub healthy_threshold: u32,

    /// Consecutive failed checks that take a backend down.
    #[arg(long, env = "MYELIN_UNHEALTHY_THRESHOLD", value_name = "N", default_value_t = 3,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub unhealthy_threshold: u32,

    /// Consecutive failed requests (connect errors, 5xx) that open a backend's circuit
    /// breaker.
    #[arg(long, env = "MYELIN_BREAKER_FAILURES", value_name = "N", default_value_t = 5,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub breaker_failures: u32,

    /// How long an open breaker stays open before its half-open probe (one GET --health-path;
    /// success closes it, failure opens it again).
    #[arg(
        long,
        env = "MYELIN_BREAKER_OPEN_MS",
        value_name = "MS",
        default_value_t = 5_000
    )]
    pub breaker_open_ms: u64,

    /// On SIGTERM/SIGINT: stop accepting, wait this long for in-flight requests, exit 0.
    #[arg(
        long,
        env = "MYELIN_DRAIN_TIMEOUT_MS",
        value_name = "MS",
        default_value_t = 30_000
    )]
    pub drain_timeout_ms: u64,

    /// Memory per data core for each tokenizer cache: token ids of prompt segments between
    /// special tokens, and of earlier prompts' leading bytes (system prompts, earlier turns);
    /// 0 disables both.
    #[arg(long, env = "MYELIN_TOKENIZE_CACHE_BYTES", value_name = "BYTES",
          default_value_t = DEFAULT_TOKENIZE_CACHE_BYTES)]
    pub tokenize_cache_bytes: usize,

    /// Tokenize only this many leading bytes of a prompt first; the rest only when the prefix
    /// matches some backend to its end. 0 always tokenizes whole prompts.
    #[arg(
        long,
        env = "MYELIN_TOKENIZE_PREFIX_BYTES",
        value_name = "BYTES",
        default_value_t = 2048
    )]
    pub tokenize_prefix_bytes: usize,

    /// Bytes of a prompt tokenized afresh for routing, at most (bytes served from the
    /// tokenizer caches are free); routing uses the prefix up to there, the request is still
    /// proxied whole. 0 = no bound.
    #[arg(long, env = "MYELIN_TOKENIZE_MAX_BYTES", value_name = "BYTES",
          default_value_t = crate::route_tokens::DEFAULT_MAX_TOKENIZED_BYTES)]
    pub tokenize_max_bytes: usize,

    /// A run of one character class (letters, digits, whitespace, other) longer than this
    /// ends routing's tokenization where it starts (one pre-token that long costs more per byte
    /// the longer it is). 0 = no bound.
    #[arg(long, env = "MYELIN_TOKENIZE_MAX_PIECE_BYTES", value_name = "BYTES",
          default_value_t = crate::route_tokens::DEFAULT_MAX_PIECE_BYTES)]
    pub tokenize_max_piece_bytes: usize,

    /// Always tokenize with HuggingFace `tokenizers`, never with the built-in fast byte-level
    /// BPE path (same ids, checked at startup; used when the tokenizer is one it reproduces).
    #[arg(long, env = "MYELIN_NO_FAST_TOKENIZER")]
    pub no_fast_tokenizer: bool,

    /// Fault injection for tests: the control core drops every Nth message it sends to a data
    /// core, as if that core's queue were full; 0 = never. Not a config-file key.
    #[arg(
        long,
        env = "MYELIN_FAULT_DROP_CONTROL_MESSAGES",
        value_name = "N",
        default_value_t = 0,
        hide = true
    )]
    pub fault_drop_control_messages: u64,

    /// Prefix policy: load differences up to this many tokens are treated as noise (a
    /// backend's load counts only beyond the least-loaded one's plus this); 0 means pure
    /// expected-cost scoring.
    #[arg(long, env = "MYELIN_LOAD_BOUND_TOKENS", value_name = "TOKENS",
          default_value_t = myelin_routing::DEFAULT_LOAD_BOUND_TOKENS)]
    pub load_bound_tokens: u64,

    /// Prefix policy: what one decode step of an engine costs, in prompt tokens prefilled in the
    /// same time; the unit of the expected wait for KV memory on an engine whose memory is full
    /// (docs/routing.md, "KV memory"); 0 ignores KV memory.
    #[arg(long, env = "MYELIN_DECODE_STEP_TOKENS", value_name = "TOKENS",
          default_value_t = myelin_routing::DEFAULT_DECODE_STEP_TOKENS)]
    pub decode_step_tokens: u64,

    /// How often the control core reads every engine's metrics endpoint (KV capacity and
    /// utilization, running and waiting requests).
    #[arg(long, env = "MYELIN_ENGINE_METRICS_INTERVAL_MS", value_name = "MS",
          default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..))]
    pub engine_metrics_interval_ms: u64,

    /// Prefix policy: a backend routed a prompt's prefix this recently, or since its oldest
    /// request still without a first token was sent, counts as holding it in every residency
    /// mode ("pending resident": it is prefilling it, or its KV events are on the way); 0 turns
    /// it off.
    #[arg(
        long,
        env = "MYELIN_PENDING_RESIDENT_MS",
        value_name = "MS",
        default_value_t = 2000
    )]
    pub pending_resident_ms: u64,

    /// Prefix policy: most homes a prefix gets because engines holding it wait for KV memory
    /// (backends holding at least half of its longest match); 0 = no bound.
    #[arg(long, env = "MYELIN_MAX_PREFIX_HOMES", value_name = "N",
          default_value_t = myelin_routing::DEFAULT_MAX_PREFIX_HOMES)]
    pub max_prefix_homes: u32,

    /// Prefix policy, `--cost ttft`: the prefill an engine would do beyond the least any
    /// engine would (re-prefilling a prefix another engine still holds) is charged this percent
    /// of its prefill time again, for the requests that will queue behind that work
    /// (docs/routing.md, "Extra prefill"); 0 = the request's own predicted TTFT only.
    #[arg(long, env = "MYELIN_EXTRA_PREFILL_PERCENT", value_name = "PERCENT",
          default_value_t = myelin_routing::DEFAULT_EXTRA_PREFILL_PERCENT,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub extra_prefill_percent: u32,

    /// Prefix policy: the extra-prefill charge applies in full once this percent of the
    /// prompt tokens the history matched (over recent decisions) were found evicted by the
    /// residency mode, in proportion below it, so that where the caches hold everything asked
    /// for again a hot prefix may spread to idle engines (docs/routing.md, "Extra prefill");
    /// 0 = always in full. With `--residency off` the charge is always in full.
    #[arg(long, env = "MYELIN_EXTRA_PREFILL_RAMP_PERCENT", value_name = "PERCENT",
          default_value_t = myelin_routing::DEFAULT_EXTRA_PREFILL_RAMP_PERCENT,
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub extra_prefill_ramp_percent: u32,

    /// Prefix policy: what it minimises. `ttft`: the predicted time to first token on each
    /// engine, from the prefill queued there, the prompt's uncached part and the wait for KV
    /// memory, at each engine's rates fitted from its own first tokens (docs/routing.md, "The
    /// cost in seconds"); `tokens`: the earlier cost in tokens (uncached prefill + load beyond
    /// --load-bound-tokens + KV wait at --decode-step-tokens).
    #[arg(long, env = "MYELIN_COST", value_name = "MODEL", default_value = "ttft",
          value_parser = |name: &str| name.parse::<CostModel>())]
    pub cost: CostModel,

    /// Tokens an engine schedules per step (vLLM's `--max-num-batched-tokens`: 2,048 on an
    /// A100's OpenAI server, 8,192 on H100-class GPUs), for the predicted time to first
    /// token.
    #[arg(long, env = "MYELIN_ENGINE_STEP_TOKENS", value_name = "TOKENS",
          default_value_t = myelin_routing::DEFAULT_ENGINE_TIMING.step_tokens,
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub engine_step_tokens: u32,
}

/// A command of the serve flags alone, for tests (`parse_command_line::<ServeCli>(argv, None)`).
#[cfg(test)]
#[derive(clap::Parser)]
pub(crate) struct ServeCli {
    #[command(flatten)]
    pub(crate) args: ServeArgs,
}

#[cfg(test)]
impl ServeArgs {
    /// `myelin serve FLAGS` as parsed, no config file (tests).
    pub(crate) fn from_flags(flags: &[&str]) -> ServeArgs {
        use clap::Parser;
        ServeCli::try_parse_from(std::iter::once("myelin").chain(flags.iter().copied()))
            .unwrap()
            .args
    }
}

/// Health checking and circuit breaking settings.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    pub interval: Duration,
    pub timeout: Duration,
    pub path: String,
    pub healthy_threshold: u32,
    pub unhealthy_threshold: u32,
    pub breaker_failures: u32,
    pub breaker_open: Duration,
}

/// The resolved configuration the server runs with.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    /// GET /metrics on `listen` too (`--metrics-on-client-port`).
    pub metrics_on_client_port: bool,
    /// `x-myelin-trace: 1` gets the decision's evidence (`--decision-trace`).
    pub decision_trace: bool,
    /// OpenTelemetry traces (`--otlp-endpoint`, `--trace-sample`, `--otel-service-name`).
    pub otlp: Option<crate::otel::OtlpConfig>,
    /// HTTPS on `listen` (`--tls-cert`, `--tls-key`).
    pub tls: Option<myelin_http::tls::ServerTls>,
    pub admin_listen: AdminListen,
    /// HTTPS on `admin_listen` (`--admin-tls-cert`, `--admin-tls-key`, `--admin-client-ca`).
    pub admin_tls: Option<myelin_http::tls::ServerTls>,
    /// HTTPS on `metrics_listen` (`--metrics-tls-cert`, `--metrics-tls-key`,
    /// `--metrics-client-ca`).
    pub metrics_tls: Option<myelin_http::tls::ServerTls>,
    /// Bearer token the admin API requires (always set when `admin_listen` is not loopback,
    /// unless admin clients need a certificate).
    pub admin_token: Option<AdminToken>,
    /// How `https://` engines are reached (`--engine-ca`, `--engine-client-cert`, `--engine-client-key`).
    pub engine_tls: std::sync::Arc<myelin_http::tls::ClientConfig>,
    pub backends: Vec<BackendSpec>,
    pub sim: usize,
    pub sim_speedup: f64,
    /// The peer cluster (`None`: gossip off, a single router).
    pub gossip: Option<crate::cluster::GossipSettings>,
    pub routing: Policy,
    pub residency: ResidencyMode,
    pub tokenizer: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    /// Models tokenized apart from the rest (`--model-tokenizer`, `--model-chat-template`),
    /// by name.
    pub model_tokenizers: Vec<ModelTokenizer>,
    pub block_size: usize,
    pub layout: CoreLayout,
    pub max_body_bytes: usize,
    /// `--max-body-buffer-bytes-per-core`.
    pub max_body_buffer_bytes_per_core: usize,
    pub max_connections_per_core: usize,
    pub max_in_flight_per_core: usize,
    pub max_model_len: Option<u64>,
    pub retry_after_seconds: u64,
    pub max_retries: u32,
    pub retry_backoff: Duration,
    pub connect_timeout: Duration,
    pub body_read_timeout: Duration,
    pub upstream_header_timeout: Duration,
    pub upstream_response_timeout: Duration,
    pub stream_idle_timeout: Duration,
    /// `--engine-stall-ms` (`None`: off).
    pub engine_stall: Option<Duration>,
    pub health: HealthConfig,
    pub drain_timeout: Duration,
    pub tokenize_cache_bytes: usize,
    pub tokenize_prefix_bytes: usize,
    pub tokenize_max_bytes: usize,
    pub tokenize_max_piece_bytes: usize,
    pub fast_tokenizer: bool,
    pub load_bound_tokens: u64,
    pub decode_step_tokens: u64,
    pub engine_metrics_interval: Duration,
    pub pending_resident_ms: u64,
    pub max_prefix_homes: u32,
    pub extra_prefill_percent: u32,
    pub extra_prefill_ramp_percent: u32,
    pub cost: myelin_routing::CostModel,
    pub engine_step_tokens: u32,
    /// `--fault-drop-control-messages` (tests only; 0 = off).
    pub fault_drop_control_messages: u64,
}

/// Why the configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag or variable clap refused (or `--help`, `--version`): `exit()` prints it.
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("reading config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parsing config file {path}: {source}")]
    ParseFile {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("config file {path}, key {key}: {message}")]
    FileKey {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error(transparent)]
    Backend(#[from] BackendSpecError),
    #[error(transparent)]
    Cores(#[from] CoreLayoutError),
    #[error("no backends: give --backend URL (repeatable) or --sim N")]
    NoBackends,
    #[error("{0}")]
    Gossip(String),
    #[error(
        "--admin-listen {0} is not a loopback address: give --admin-token-file PATH (a bearer \
         token) or --admin-client-ca PATH (client certificates), or listen on 127.0.0.1 / [::1]"
    )]
    AdminTokenRequired(SocketAddr),
    #[error("{flags}: {source}")]
    Tls {
        flags: &'static str,
        source: myelin_http::tls::TlsError,
    },
    #[error("reading --admin-token-file {path}: {source}")]
    AdminTokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--admin-token-file {0} holds no token (empty or only whitespace)")]
    AdminTokenEmpty(PathBuf),
    #[error("{flag}: model {model} is named twice")]
    ModelTwice { flag: &'static str, model: String },
    #[error(
        "--model-tokenizer and --model-chat-template name {0} models; at most {MAX_MODEL_TOKENIZERS}"
    )]
    TooManyModels(usize),
}

/// A served model tokenized apart from the rest: its own tokenizer.json or chat template (or
/// both; `None`: the router-wide `--tokenizer` / `--chat-template`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelTokenizer {
    pub model: String,
    pub tokenizer: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
}

/// `--model-tokenizer` and `--model-chat-template` as one entry per model, in the order the
/// models are first named. A model named twice by one flag is an error, and so are more than
/// [`MAX_MODEL_TOKENIZERS`] models.
fn model_tokenizers(
    tokenizers: &[(String, PathBuf)],
    templates: &[(String, PathBuf)],
) -> Result<Vec<ModelTokenizer>, ConfigError> {
    let mut models: Vec<ModelTokenizer> = Vec::new();
    for (flag, list) in [
        ("--model-tokenizer", tokenizers),
        ("--model-chat-template", templates),
    ] {
        for (model, path) in list {
            let index = match models.iter().position(|entry| entry.model == *model) {
                Some(index) => index,
                None => {
                    models.push(ModelTokenizer {
                        model: model.clone(),
                        tokenizer: None,
                        chat_template: None,
                    });
                    models.len() - 1
                }
            };
            let slot = if flag == "--model-tokenizer" {
                &mut models[index].tokenizer
            } else {
                &mut models[index].chat_template
            };
            if slot.replace(path.clone()).is_some() {
                return Err(ConfigError::ModelTwice {
                    flag,
                    model: model.clone(),
                });
            }
        }
    }
    if models.len() > MAX_MODEL_TOKENIZERS {
        return Err(ConfigError::TooManyModels(models.len()));
    }
    Ok(models)
}

/// Where the admin API listens: a TCP address, or a Unix stream socket (`unix:PATH`), which
/// only processes on this host that may open the file reach (it is created mode 0600).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AdminListen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// Longest Unix socket path (`sun_path` is 108 bytes, the final NUL included).
const MAX_UNIX_SOCKET_PATH: usize = 107;

impl std::str::FromStr for AdminListen {
    type Err = String;

    fn from_str(text: &str) -> Result<AdminListen, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path (unix:/run/myelin/admin.sock)".into());
            }
            if path.len() > MAX_UNIX_SOCKET_PATH {
                return Err(format!(
                    "the Unix socket path {path:?} is longer than {MAX_UNIX_SOCKET_PATH} bytes"
                ));
            }
            return Ok(AdminListen::Unix(PathBuf::from(path)));
        }
        text.parse::<SocketAddr>()
            .map(AdminListen::Tcp)
            .map_err(|error| format!("{text:?} is neither HOST:PORT nor unix:PATH ({error})"))
    }
}

impl std::fmt::Display for AdminListen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdminListen::Tcp(addr) => write!(f, "{addr}"),
            AdminListen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The admin API's bearer token. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// Reads a token file (surrounding whitespace, such as the final newline, is dropped).
    pub fn from_file(path: &Path) -> Result<AdminToken, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::AdminTokenFile {
            path: path.into(),
            source,
        })?;
        AdminToken::new(text.trim()).ok_or_else(|| ConfigError::AdminTokenEmpty(path.into()))
    }

    /// A token, or `None` when empty.
    pub fn new(token: &str) -> Option<AdminToken> {
        (!token.is_empty()).then(|| AdminToken(token.to_string()))
    }

    /// True when `authorization` (an `Authorization` header value) is `Bearer TOKEN`. The
    /// comparison takes the same time wherever the first difference is.
    pub fn accepts(&self, authorization: &[u8]) -> bool {
        let Some(presented) = authorization
            .strip_prefix(b"Bearer ")
            .or_else(|| authorization.strip_prefix(b"bearer "))
        else {
            return false;
        };
        let expected = self.0.as_bytes();
        let mut difference = presented.len() ^ expected.len();
        for (index, byte) in expected.iter().enumerate() {
            difference |= usize::from(byte ^ presented.get(index).copied().unwrap_or(0));
        }
        difference == 0
    }
}

/// Parses the command line of `C`, whose subcommand `serve` (or, with `subcommand` `None`,
/// the command itself) takes [`ServeArgs`], with the keys of its `--config` file as the
/// flags' defaults: a flag or a `MYELIN_*` variable still overrides a file value, and a file
/// value is checked by the flag's own parser (an error names the file and the key).
pub fn parse_command_line<C: clap::Parser>(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
    subcommand: Option<&str>,
) -> Result<C, ConfigError> {
    let argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let matches = C::command().try_get_matches_from(&argv)?;
    let serve = match subcommand {
        Some(name) => matches.subcommand_matches(name),
        None => Some(&matches),
    };
    let Some(path) = serve.and_then(|serve| serve.get_one::<PathBuf>("config")) else {
        return Ok(C::from_arg_matches(&matches)?);
    };
    let file = load_file(path)?;
    let mut command = C::command();
    let serve = match subcommand {
        Some(name) => command
            .find_subcommand_mut(name)
            .expect("the subcommand just matched"),
        None => &mut command,
    };
    *serve = with_file_defaults(std::mem::take(serve), &file, path)?;
    Ok(C::from_arg_matches(&command.try_get_matches_from(&argv)?)?)
}

/// Reads and parses a config file.
fn load_file(path: &Path) -> Result<toml::Table, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.into(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::ParseFile {
        path: path.into(),
        source,
    })
}

/// `command` with each key of `file` as the default of the flag of that name.
fn with_file_defaults(
    mut command: clap::Command,
    file: &toml::Table,
    path: &Path,
) -> Result<clap::Command, ConfigError> {
    for (key, value) in file {
        let error = |message: String| ConfigError::FileKey {
            path: path.into(),
            key: key.clone(),
            message,
        };
        let arg = command
            .get_arguments()
            .filter(|arg| !arg.is_hide_set() && arg.get_id() != "config")
            .find(|arg| {
                arg.get_long() == Some(key.as_str())
                    || arg
                        .get_all_aliases()
                        .is_some_and(|aliases| aliases.contains(&key.as_str()))
            })
            .ok_or_else(|| error("no flag of `myelin serve` has this name".into()))?;
        let values = match (arg.get_action(), value) {
            (clap::ArgAction::SetTrue, toml::Value::Boolean(flag)) => vec![flag.to_string()],
            (clap::ArgAction::SetTrue, _) => return Err(error("takes true or false".into())),
            (clap::ArgAction::Append, toml::Value::Array(items)) => items
                .iter()
                .map(|item| file_value(key, item))
                .collect::<Result<Vec<_>, _>>()
                .map_err(error)?,
            (_, toml::Value::Array(_)) => return Err(error("takes one value, not a list".into())),
            (_, value) => vec![file_value(key, value).map_err(error)?],
        };
        if !matches!(arg.get_action(), clap::ArgAction::SetTrue) {
            for value in &values {
                check_value(arg, value).map_err(error)?;
            }
        }
        let id = arg.get_id().clone();
        command = command.mut_arg(id, |arg| arg.default_values(values));
    }
    Ok(command)
}

/// Whether `value` is one `arg` accepts: the flag's own parser and bounds, given the value on
/// a command line of that flag alone.
fn check_value(arg: &clap::Arg, value: &str) -> Result<(), String> {
    let long = arg.get_long().unwrap_or_default();
    clap::Command::new("myelin serve")
        .no_binary_name(true)
        .arg(arg.clone())
        .try_get_matches_from([format!("--{long}={value}")])
        .map(drop)
        .map_err(|clap_error| first_line(&clap_error))
}

/// A clap error's message, without its `error: ` and the hint after it.
fn first_line(error: &clap::Error) -> String {
    let text = error.to_string();
    let line = text.lines().next().unwrap_or_default();
    line.strip_prefix("error: ").unwrap_or(line).to_string()
}

/// One TOML value as the text a flag would be given. A table is a backend (`{ url = ...,
/// kv-events = ... }`), written as a spec.
fn file_value(key: &str, value: &toml::Value) -> Result<String, String> {
    match value {
        toml::Value::String(text) => Ok(text.clone()),
        toml::Value::Integer(number) => Ok(number.to_string()),
        toml::Value::Float(number) => Ok(number.to_string()),
        toml::Value::Boolean(flag) => Ok(flag.to_string()),
        toml::Value::Table(table) if key == "backend" || key == "backends" => backend_spec(table),
        toml::Value::Table(_) => Err("takes a value, not a table".into()),
        toml::Value::Array(_) => Err("takes a list of values, not of lists".into()),
        toml::Value::Datetime(_) => Err("takes no date".into()),
    }
}

/// A backend table as a `--backend` spec: `url` and any of `kv-events`, `kv-replay` and
/// `capacity-tokens` (also written with `_`).
fn backend_spec(table: &toml::Table) -> Result<String, String> {
    let mut url = None;
    let mut options = String::new();
    for (name, value) in table {
        let text = match value {
            toml::Value::String(text) => text.clone(),
            toml::Value::Integer(number) => number.to_string(),
            _ => return Err(format!("backend key {name} takes a string or a number")),
        };
        match name.replace('_', "-").as_str() {
            "url" => url = Some(text),
            option @ ("kv-events" | "kv-replay" | "capacity-tokens") => {
                options.push_str(&format!(",{option}={text}"));
            }
            _ => {
                return Err(format!(
                    "backend key {name} is none of url, kv-events, kv-replay, capacity-tokens"
                ));
            }
        }
    }
    let url = url.ok_or("a backend table needs a url")?;
    Ok(format!("{url}{options}"))
}

impl ServeConfig {
    /// The configuration `args` describe, on this machine's CPUs.
    pub fn resolve(args: ServeArgs) -> Result<ServeConfig, ConfigError> {
        Self::from_args(args, &online_cpus())
    }

    /// The configuration `args` describe; `online` is the list of usable CPUs. Checks what
    /// spans several flags (each flag's own value was checked as it was parsed).
    pub fn from_args(args: ServeArgs, online: &[usize]) -> Result<ServeConfig, ConfigError> {
        let backends = args
            .backends
            .iter()
            .map(|spec| BackendSpec::parse(spec))
            .collect::<Result<Vec<_>, _>>()?;
        if backends.is_empty() && args.sim == 0 {
            return Err(ConfigError::NoBackends);
        }
        let layout = decide_layout(
            args.cores.as_deref(),
            args.shards,
            args.control_core,
            args.no_pin,
            online,
        )?;
        let gossip = crate::cluster::resolve(args.gossip).map_err(ConfigError::Gossip)?;
        let admin_token = match &args.admin_token_file {
            Some(path) => Some(AdminToken::from_file(path)?),
            None => None,
        };
        if let AdminListen::Tcp(addr) = args.admin_listen
            && admin_token.is_none()
            && args.admin_client_ca.is_none()
            && !addr.ip().is_loopback()
        {
            return Err(ConfigError::AdminTokenRequired(addr));
        }
        let server_tls = |flags, cert: &Option<PathBuf>, key: &Option<PathBuf>, client_ca| {
            let (Some(cert), Some(key)) = (cert, key) else {
                return Ok(None);
            };
            let files = myelin_http::tls::ServerTlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca,
            };
            myelin_http::tls::ServerTls::load(files, true)
                .map(Some)
                .map_err(|source| ConfigError::Tls { flags, source })
        };
        let tls = server_tls("--tls-cert/--tls-key", &args.tls_cert, &args.tls_key, None)?;
        let admin_tls = server_tls(
            "--admin-tls-cert/--admin-tls-key/--admin-client-ca",
            &args.admin_tls_cert,
            &args.admin_tls_key,
            args.admin_client_ca.clone(),
        )?;
        let metrics_tls = server_tls(
            "--metrics-tls-cert/--metrics-tls-key/--metrics-client-ca",
            &args.metrics_tls_cert,
            &args.metrics_tls_key,
            args.metrics_client_ca.clone(),
        )?;
        let engine_tls = myelin_http::tls::client_config(&myelin_http::tls::ClientTlsFiles {
            ca: args.engine_ca.clone(),
            identity: args
                .engine_client_cert
                .clone()
                .zip(args.engine_client_key.clone()),
        })
        .map_err(|source| ConfigError::Tls {
            flags: "--engine-ca/--engine-client-cert/--engine-client-key",
            source,
        })?;
        let millis = Duration::from_millis;
        Ok(ServeConfig {
            listen: args.listen,
            metrics_listen: args.metrics_listen,
            metrics_on_client_port: args.metrics_on_client_port,
            decision_trace: args.decision_trace,
            otlp: args
                .otlp_endpoint
                .clone()
                .map(|endpoint| crate::otel::OtlpConfig {
                    endpoint,
                    sample_ratio: args.trace_sample,
                    service_name: args.otel_service_name.clone(),
                }),
            tls,
            admin_listen: args.admin_listen,
            admin_tls,
            metrics_tls,
            admin_token,
            engine_tls,
            backends,
            sim: args.sim,
            sim_speedup: args.sim_speedup,
            gossip,
            routing: args.routing,
            residency: args.residency,
            model_tokenizers: model_tokenizers(&args.model_tokenizers, &args.model_chat_templates)?,
            tokenizer: args.tokenizer,
            chat_template: args.chat_template,
            block_size: args.block_size,
            layout,
            max_body_bytes: args.max_body_bytes,
            max_body_buffer_bytes_per_core: args.max_body_buffer_bytes_per_core,
            max_connections_per_core: args.max_connections_per_core,
            max_in_flight_per_core: args.max_in_flight_per_core,
            max_model_len: args.max_model_len,
            retry_after_seconds: args.retry_after_seconds,
            max_retries: args.max_retries,
            retry_backoff: millis(args.retry_backoff_ms),
            connect_timeout: millis(args.connect_timeout_ms),
            body_read_timeout: millis(args.body_read_timeout_ms),
            upstream_header_timeout: millis(args.upstream_header_timeout_ms),
            upstream_response_timeout: millis(args.upstream_response_timeout_ms),
            stream_idle_timeout: millis(args.stream_idle_timeout_ms),
            engine_stall: (args.engine_stall_ms > 0).then(|| millis(args.engine_stall_ms)),
            health: HealthConfig {
                interval: millis(args.health_interval_ms),
                timeout: millis(args.health_timeout_ms),
                path: args.health_path,
                healthy_threshold: args.healthy_threshold,
                unhealthy_threshold: args.unhealthy_threshold,
                breaker_failures: args.breaker_failures,
                breaker_open: millis(args.breaker_open_ms),
            },
            drain_timeout: millis(args.drain_timeout_ms),
            tokenize_cache_bytes: args.tokenize_cache_bytes,
            tokenize_prefix_bytes: args.tokenize_prefix_bytes,
            tokenize_max_bytes: args.tokenize_max_bytes,
            tokenize_max_piece_bytes: args.tokenize_max_piece_bytes,
            fast_tokenizer: !args.no_fast_tokenizer,
            load_bound_tokens: args.load_bound_tokens,
            decode_step_tokens: args.decode_step_tokens,
            engine_metrics_interval: millis(args.engine_metrics_interval_ms),
            pending_resident_ms: args.pending_resident_ms,
            max_prefix_homes: args.max_prefix_homes,
            extra_prefill_percent: args.extra_prefill_percent,
            extra_prefill_ramp_percent: args.extra_prefill_ramp_percent,
            cost: args.cost,
            engine_step_tokens: args.engine_step_tokens,
            fault_drop_control_messages: args.fault_drop_control_messages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `flags` over the config file `text` (none when `None`), as `myelin serve` parses them.
    fn parse_over(flags: &[&str], text: Option<&str>) -> Result<ServeArgs, ConfigError> {
        let mut argv = vec!["myelin".to_string()];
        argv.extend(flags.iter().map(|flag| flag.to_string()));
        let dir = std::env::temp_dir().join(format!(
            "myelin-config-{}-{}",
            std::process::id(),
            std::thread::current()
                .name()
                .unwrap_or("t")
                .replace("::", "-")
        ));
        if let Some(text) = text {
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("myelin.toml");
            std::fs::write(&path, text).unwrap();
            argv.extend(["--config".to_string(), path.display().to_string()]);
        }
        let parsed = parse_command_line::<ServeCli>(argv, None).map(|cli| cli.args);
        std::fs::remove_dir_all(&dir).ok();
        parsed
    }

    fn parse(flags: &[&str]) -> ServeArgs {
        ServeArgs::from_flags(flags)
    }

    /// One backend, then `flags`, over the config file `text`.
    fn merge(flags: &[&str], text: &str) -> Result<ServeConfig, ConfigError> {
        let mut argv = vec!["--backend", "http://a:1"];
        argv.extend_from_slice(flags);
        ServeConfig::from_args(parse_over(&argv, Some(text))?, &[0])
    }

    /// The key and message of a config-file error.
    fn file_error(result: Result<ServeConfig, ConfigError>) -> (String, String) {
        match result {
            Err(ConfigError::FileKey { key, message, .. }) => (key, message),
            other => panic!("not a file key error: {other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let config =
            ServeConfig::from_args(parse(&["--backend", "http://a:1"]), &[0, 1, 2]).unwrap();
        assert_eq!(config.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(config.admin_listen.to_string(), "127.0.0.1:9090");
        assert_eq!(config.admin_token, None);
        assert_eq!(config.routing, Policy::Prefix);
        assert_eq!(config.residency, ResidencyMode::Auto);
        assert_eq!(config.cost, CostModel::default());
        assert_eq!(config.block_size, 16);
        assert_eq!(config.layout.data_cpus, vec![Some(1), Some(2)]);
        assert_eq!(config.layout.control_cpu, Some(0));
        assert_eq!(config.health.path, "/health");
        assert_eq!(config.body_read_timeout, Duration::from_secs(30));
        assert_eq!(config.upstream_header_timeout, Duration::from_secs(30));
        assert_eq!(config.upstream_response_timeout, Duration::from_secs(600));
        assert_eq!(config.stream_idle_timeout, Duration::from_secs(60));
        assert_eq!(config.engine_stall, Some(Duration::from_secs(30)));
        assert_eq!(config.tokenize_cache_bytes, DEFAULT_TOKENIZE_CACHE_BYTES);
        assert_eq!(config.extra_prefill_percent, 100);
        assert_eq!(config.extra_prefill_ramp_percent, 25);
        assert_eq!(config.engine_step_tokens, 2048);
        assert!(config.fast_tokenizer && !config.decision_trace && config.gossip.is_none());
        assert_eq!(config.fault_drop_control_messages, 0);
        assert_eq!(
            merge(&["--engine-stall-ms", "0"], "").unwrap().engine_stall,
            None
        );
    }

    #[test]
    fn flags_override_file() {
        let config = ServeConfig::from_args(
            parse_over(
                &["--routing", "least-load", "--shards", "2"],
                Some(
                    r#"
                    listen = "127.0.0.1:9000"
                    routing = "round-robin"
                    residency = "verified"
                    backend = ["http://a:1", { url = "http://b:2", kv-events = "tcp://b:5557" }]
                    max-body-bytes = 1000
                    sim-speedup = 2.5
                    no-pin = true
                    decision-trace = true
                    "#,
                ),
            )
            .unwrap(),
            &[0],
        )
        .unwrap();
        assert_eq!(config.routing, Policy::LeastLoad);
        assert_eq!(config.residency, ResidencyMode::Verified);
        assert_eq!(config.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(config.max_body_bytes, 1000);
        assert_eq!(config.sim_speedup, 2.5);
        assert!(config.decision_trace);
        assert_eq!(config.backends.len(), 2);
        assert_eq!(
            config.backends[1].kv_events.as_deref(),
            Some("tcp://b:5557")
        );
        assert_eq!(config.layout.shard_count(), 2);
        // A boolean key can say false, and the flag still turns it on.
        assert!(!merge(&[], "decision-trace = false").unwrap().decision_trace);
        assert!(
            merge(&["--decision-trace"], "decision-trace = false")
                .unwrap()
                .decision_trace
        );
    }

    #[test]
    fn routing_and_residency_parse_from_flags_and_file_and_bad_names_name_their_key() {
        let text = "routing = \"least-load\"\nresidency = \"verified\"";
        let config = merge(&[], text).unwrap();
        assert_eq!(
            (config.routing, config.residency),
            (Policy::LeastLoad, ResidencyMode::Verified)
        );
        let config = merge(&["--routing", "round-robin", "--residency", "off"], text).unwrap();
        assert_eq!(
            (config.routing, config.residency),
            (Policy::RoundRobin, ResidencyMode::Off)
        );
        let (key, message) = file_error(merge(&[], "routing = \"fastest\""));
        assert_eq!(key, "routing");
        assert!(
            message.contains("fastest") && message.contains("least-load"),
            "{message}"
        );
        let (key, _) = file_error(merge(&[], "residency = \"maybe\""));
        assert_eq!(key, "residency");
        let (key, _) = file_error(merge(&[], "cost = \"cheapest\""));
        assert_eq!(key, "cost");
        let Err(ConfigError::Cli(error)) = parse_over(&["--routing", "fastest"], None) else {
            panic!("--routing fastest parsed");
        };
        let error = error.to_string();
        assert!(error.contains("least-load"), "{error}");
    }

    #[test]
    fn bounds_hold_for_flags_and_file_keys_alike() {
        let text = "extra-prefill-percent = 250";
        assert_eq!(merge(&[], text).unwrap().extra_prefill_percent, 250);
        let config = merge(&["--extra-prefill-percent", "0"], text).unwrap();
        assert_eq!(config.extra_prefill_percent, 0);
        for (text, key) in [
            ("extra-prefill-percent = 5000", "extra-prefill-percent"),
            (
                "extra-prefill-ramp-percent = 101",
                "extra-prefill-ramp-percent",
            ),
            ("engine-step-tokens = 0", "engine-step-tokens"),
            ("block-size = 0", "block-size"),
            ("max-in-flight-per-core = -1", "max-in-flight-per-core"),
            ("sim-speedup = 0", "sim-speedup"),
            ("health-path = \"health\"", "health-path"),
            ("health-interval-ms = 5", "health-interval-ms"),
            ("gossip-max-members = 1", "gossip-max-members"),
        ] {
            let (got, message) = file_error(merge(&[], text));
            assert_eq!(got, key, "{text}: {message}");
        }
        for flags in [
            ["--extra-prefill-percent", "1001"],
            ["--extra-prefill-ramp-percent", "101"],
            ["--block-size", "0"],
            ["--sim-speedup", "inf"],
            ["--health-path", "health"],
        ] {
            assert!(
                matches!(parse_over(&flags, None), Err(ConfigError::Cli(_))),
                "{flags:?}"
            );
        }
    }

    #[test]
    fn flag_backends_replace_file_backends() {
        let config = ServeConfig::from_args(
            parse_over(
                &["--backend", "http://x:1;http://y:2", "--shards", "1"],
                Some(r#"backend = ["http://a:1"]"#),
            )
            .unwrap(),
            &[0],
        )
        .unwrap();
        let urls: Vec<_> = config.backends.iter().map(|b| b.url.as_str()).collect();
        assert_eq!(urls, ["http://x:1", "http://y:2"]);
        // The file's list alone, tables included, under either spelling of the key.
        let text = "backends = [{ url = \"http://b:2\", kv-events = \"tcp://b:5557\", \
                    kv_replay = \"tcp://b:5558\", capacity-tokens = 4096 }]";
        let config = ServeConfig::from_args(parse_over(&[], Some(text)).unwrap(), &[0]).unwrap();
        assert_eq!(config.backends[0].url, "http://b:2");
        assert_eq!(
            config.backends[0].kv_replay.as_deref(),
            Some("tcp://b:5558")
        );
        assert_eq!(config.backends[0].capacity_tokens, Some(4096));
    }

    #[test]
    fn rejects_unknown_hidden_and_misshapen_file_keys_and_missing_backends() {
        for (text, needle) in [
            ("lisen = \"x\"", "no flag"),
            ("config = \"other.toml\"", "no flag"),
            ("fault-drop-control-messages = 3", "no flag"),
            ("listen = [\"127.0.0.1:1\"]", "not a list"),
            ("listen = { url = \"x\" }", "not a table"),
            ("backend = [{ url = \"http://a:1\", weight = 2 }]", "weight"),
            ("backend = [{ kv-events = \"tcp://a:1\" }]", "needs a url"),
        ] {
            let (_, message) = file_error(merge(&[], text));
            assert!(message.contains(needle), "{text}: {message}");
        }
        assert!(matches!(
            merge(&[], "listen = "),
            Err(ConfigError::ParseFile { .. })
        ));
        assert!(matches!(
            ServeConfig::from_args(parse(&[]), &[0]),
            Err(ConfigError::NoBackends)
        ));
    }

    #[test]
    fn admin_off_loopback_needs_a_token() {
        let merge = |flags: &[&str]| {
            let mut all = vec!["--backend", "http://a:1", "--shards", "1"];
            all.extend_from_slice(flags);
            ServeConfig::from_args(parse_over(&all, None)?, &[0])
        };
        assert!(merge(&["--admin-listen", "[::1]:0"]).is_ok());
        // A Unix socket is local: no token needed.
        let unix = merge(&["--admin-listen", "unix:/tmp/myelin-admin.sock"]).unwrap();
        assert_eq!(
            unix.admin_listen,
            AdminListen::Unix("/tmp/myelin-admin.sock".into())
        );
        assert_eq!(unix.admin_listen.to_string(), "unix:/tmp/myelin-admin.sock");
        for bad in ["unix:", "localhost", &format!("unix:/{}", "a".repeat(120))] {
            assert!(bad.parse::<AdminListen>().is_err(), "{bad}");
        }
        let from_file = parse_over(&[], Some(r#"admin-listen = "unix:/run/m.sock""#)).unwrap();
        assert_eq!(
            from_file.admin_listen,
            AdminListen::Unix("/run/m.sock".into())
        );
        let error = merge(&["--admin-listen", "0.0.0.0:9090"]).unwrap_err();
        assert!(matches!(error, ConfigError::AdminTokenRequired(_)));
        assert!(error.to_string().contains("--admin-token-file"), "{error}");

        let dir = std::env::temp_dir().join(format!("myelin-admin-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token_path = dir.join("token");
        std::fs::write(&token_path, "s3cret\n").unwrap();
        let path = token_path.to_str().unwrap();
        let config = merge(&["--admin-listen", "0.0.0.0:9090", "--admin-token-file", path])
            .expect("a token makes any address acceptable");
        let token = config.admin_token.expect("token");
        assert!(!format!("{token:?}").contains("s3cret"));
        assert!(token.accepts(b"Bearer s3cret"));
        for wrong in [
            &b"Bearer s3cre"[..],
            b"Bearer s3cret2",
            b"s3cret",
            b"Bearer ",
            b"",
        ] {
            assert!(!token.accepts(wrong), "{wrong:?}");
        }
        std::fs::write(&token_path, " \n").unwrap();
        assert!(matches!(
            merge(&["--admin-token-file", path]),
            Err(ConfigError::AdminTokenEmpty(_))
        ));
        assert!(matches!(
            merge(&["--admin-token-file", "/nonexistent/myelin/token"]),
            Err(ConfigError::AdminTokenFile { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn sim_alone_is_enough() {
        let config = ServeConfig::from_args(parse(&["--sim", "2"]), &[0]).unwrap();
        assert_eq!(config.sim, 2);
        assert!(config.backends.is_empty());
    }

    #[test]
    fn model_tokenizers_merge_by_model_and_refuse_what_is_ambiguous() {
        let config = |flags: &[&str]| {
            let mut all = vec!["--sim", "1"];
            all.extend_from_slice(flags);
            ServeConfig::from_args(parse(&all), &[0])
        };
        let models = config(&[
            "--model-tokenizer",
            "a=/m/a/tokenizer.json",
            "--model-chat-template",
            "b=/m/b.jinja",
            "--model-chat-template",
            "a=/m/a/tokenizer_config.json",
        ])
        .unwrap()
        .model_tokenizers;
        assert_eq!(
            models,
            [
                ModelTokenizer {
                    model: "a".into(),
                    tokenizer: Some("/m/a/tokenizer.json".into()),
                    chat_template: Some("/m/a/tokenizer_config.json".into()),
                },
                ModelTokenizer {
                    model: "b".into(),
                    tokenizer: None,
                    chat_template: Some("/m/b.jinja".into()),
                },
            ]
        );
        // A model's name may hold `=` after the first one only in its path.
        assert_eq!(
            model_path("org/m:7b=/p=q.json").unwrap(),
            ("org/m:7b".into(), PathBuf::from("/p=q.json"))
        );
        for bad in ["no-equals", "=/path", "m="] {
            assert!(model_path(bad).is_err(), "{bad}");
        }
        assert!(model_path(&format!("{}=/p", "m".repeat(MAX_MODEL_NAME_BYTES + 1))).is_err());
        assert!(matches!(
            config(&["--model-tokenizer", "a=/x", "--model-tokenizer", "a=/y"]),
            Err(ConfigError::ModelTwice {
                flag: "--model-tokenizer",
                ..
            })
        ));
        let many: Vec<String> = (0..=MAX_MODEL_TOKENIZERS)
            .map(|index| format!("--model-tokenizer=m{index}=/t.json"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(matches!(config(&many), Err(ConfigError::TooManyModels(33))));
    }

    /// docs/reference/flags.md lists every flag with the default its definition gives (the
    /// definition in [`ServeArgs`] is the one source; this keeps the page in step with it).
    #[test]
    fn the_flags_page_lists_every_flag_with_its_default() {
        let page = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/reference/flags.md"),
        )
        .unwrap();
        let command = ServeCli::command();
        for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
            let Some(long) = arg.get_long() else { continue };
            if long == "help" {
                continue;
            }
            let row = page
                .lines()
                .find(|line| {
                    line.strip_prefix(&format!("| `--{long}"))
                        .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('`'))
                })
                .unwrap_or_else(|| panic!("docs/reference/flags.md has no row for --{long}"));
            let defaults = arg.get_default_values();
            if matches!(arg.get_action(), clap::ArgAction::SetTrue) || defaults.is_empty() {
                continue;
            }
            let default = defaults[0].to_string_lossy();
            let cells: Vec<String> = row
                .split('|')
                .map(|cell| cell.trim().trim_matches('`').to_string())
                .collect();
            assert!(
                cells.iter().any(|cell| *cell == default),
                "docs/reference/flags.md: the row of --{long} does not give its default \
                 {default}: {row}"
            );
        }
    }

    #[test]
    fn tls_flags_come_in_pairs_and_load_their_files() {
        let fixture = |name: &str| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../myelin-http/tests/fixtures/tls")
                .join(name)
                .to_string_lossy()
                .into_owned()
        };
        let (cert, key, ca) = (
            fixture("server.pem"),
            fixture("server.key"),
            fixture("ca.pem"),
        );
        let resolve = |flags: &[&str]| {
            let mut argv = vec!["--backend", "https://a:1"];
            argv.extend_from_slice(flags);
            ServeConfig::from_args(parse_over(&argv, None)?, &[0])
        };
        let plain = resolve(&[]).unwrap();
        assert!(plain.tls.is_none() && plain.admin_tls.is_none());
        assert_eq!(plain.backends[0].url, "https://a:1");
        let tls = resolve(&["--tls-cert", &cert, "--tls-key", &key]).unwrap();
        assert_eq!(tls.tls.unwrap().files().cert, Path::new(&cert));
        // Half a pair is refused by the flag parser.
        for half in [
            ["--tls-cert", &cert],
            ["--admin-tls-key", &key],
            ["--engine-client-cert", &cert],
        ] {
            assert!(
                matches!(resolve(&half), Err(ConfigError::Cli(_))),
                "{half:?}"
            );
        }
        assert!(matches!(
            resolve(&["--admin-client-ca", &ca]),
            Err(ConfigError::Cli(_))
        ));
        // A key that is not the certificate's names the flags and the file.
        let error =
            resolve(&["--tls-cert", &cert, "--tls-key", &fixture("client.key")]).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("--tls-cert/--tls-key") && text.contains("client.key"),
            "{text}"
        );
        let error = resolve(&["--engine-ca", &fixture("missing.pem")]).unwrap_err();
        assert!(error.to_string().contains("--engine-ca"), "{error}");
        // Client certificates stand in for the admin token on a non-loopback address.
        let admin = [
            "--admin-listen",
            "0.0.0.0:9090",
            "--admin-tls-cert",
            &cert,
            "--admin-tls-key",
            &key,
        ];
        assert!(matches!(
            resolve(&admin),
            Err(ConfigError::AdminTokenRequired(_))
        ));
        let mut mutual = admin.to_vec();
        mutual.extend(["--admin-client-ca", &ca]);
        let config = resolve(&mutual).unwrap();
        assert_eq!(
            config.admin_tls.unwrap().files().client_ca.as_deref(),
            Some(Path::new(&ca))
        );
        assert!(config.admin_token.is_none());
        // The metrics listener's TLS needs the listener, and its own pair.
        let metrics = [
            "--metrics-listen",
            "127.0.0.1:9100",
            "--metrics-tls-cert",
            &cert,
            "--metrics-tls-key",
            &key,
            "--metrics-client-ca",
            &ca,
        ];
        let config = resolve(&metrics).unwrap();
        let files = config.metrics_tls.unwrap();
        assert_eq!(files.files().cert, Path::new(&cert));
        assert_eq!(files.files().client_ca.as_deref(), Some(Path::new(&ca)));
        for missing in [&metrics[2..], &metrics[..4], &metrics[..2]] {
            let mut partial = missing.to_vec();
            if missing.len() == 2 {
                partial.extend(["--metrics-client-ca", &ca]);
            }
            assert!(
                matches!(resolve(&partial), Err(ConfigError::Cli(_))),
                "{partial:?}"
            );
        }
    }
}
