//! `myelin serve` configuration: command-line flags, `MYELIN_*` variables, the TOML file, defaults.
//!
//! Precedence: flag > environment variable > config file > built-in default. Every flag is an
//! `Option` here so that "not given" can fall through to the file; the defaults live in
//! [`Defaults`] and are spelled out in each flag's help text.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use myelin_routing::{Policy, ResidencyMode};
use serde::Deserialize;

use crate::backend_spec::{BackendSpec, BackendSpecError, parse_capacity};
use crate::cores::{CoreLayout, CoreLayoutError, decide_layout, online_cpus};

/// Built-in defaults (documented in `--help` and docs/reference/flags.md).
pub struct Defaults;

impl Defaults {
    pub const LISTEN: &'static str = "0.0.0.0:8080";
    pub const ADMIN_LISTEN: &'static str = "127.0.0.1:9090";
    pub const BLOCK_SIZE_TOKENS: usize = 16;
    pub const MAX_BODY_BYTES: usize = 8 * 1024 * 1024;
    pub const MAX_BODY_BUFFER_BYTES_PER_CORE: usize = 256 * 1024 * 1024;
    pub const MAX_CONNECTIONS_PER_CORE: usize = 4096;
    pub const MAX_IN_FLIGHT_PER_CORE: usize = 1024;
    pub const RETRY_AFTER_SECONDS: u64 = 1;
    pub const MAX_RETRIES: u32 = 2;
    pub const RETRY_BACKOFF_MS: u64 = 20;
    pub const CONNECT_TIMEOUT_MS: u64 = 2_000;
    pub const BODY_READ_TIMEOUT_MS: u64 = 30_000;
    pub const UPSTREAM_HEADER_TIMEOUT_MS: u64 = 30_000;
    pub const UPSTREAM_RESPONSE_TIMEOUT_MS: u64 = 600_000;
    pub const STREAM_IDLE_TIMEOUT_MS: u64 = 60_000;
    pub const ENGINE_STALL_MS: u64 = 30_000;
    pub const HEALTH_INTERVAL_MS: u64 = 2_000;
    pub const HEALTH_TIMEOUT_MS: u64 = 1_000;
    pub const HEALTH_PATH: &'static str = "/health";
    pub const HEALTHY_THRESHOLD: u32 = 2;
    pub const UNHEALTHY_THRESHOLD: u32 = 3;
    pub const BREAKER_FAILURES: u32 = 5;
    pub const BREAKER_OPEN_MS: u64 = 5_000;
    pub const DRAIN_TIMEOUT_MS: u64 = 30_000;
    pub const TOKENIZE_PREFIX_BYTES: usize = 2048;
    pub const TOKENIZE_CACHE_BYTES: usize = 16 * 1024 * 1024;
    pub const TOKENIZE_MAX_BYTES: usize = crate::route_tokens::DEFAULT_MAX_TOKENIZED_BYTES;
    pub const TOKENIZE_MAX_PIECE_BYTES: usize = crate::route_tokens::DEFAULT_MAX_PIECE_BYTES;
    pub const SIM_SPEEDUP: f64 = 1.0;
    pub const LOAD_BOUND_TOKENS: u64 = myelin_routing::DEFAULT_LOAD_BOUND_TOKENS;
    pub const DECODE_STEP_TOKENS: u64 = myelin_routing::DEFAULT_DECODE_STEP_TOKENS;
    pub const ENGINE_METRICS_INTERVAL_MS: u64 = 1000;
    pub const PENDING_RESIDENT_MS: u64 = 2000;
    pub const MAX_PREFIX_HOMES: u32 = myelin_routing::DEFAULT_MAX_PREFIX_HOMES;
    pub const ENGINE_STEP_TOKENS: u32 = myelin_routing::DEFAULT_ENGINE_TIMING.step_tokens;
}

/// Flags of `myelin serve`. Each may also come from a `MYELIN_*` variable or the `--config` file.
#[derive(Debug, Clone, Default, clap::Args)]
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
    /// Port 0 picks a free port (printed on stdout). [default: 0.0.0.0:8080]
    #[arg(long, env = "MYELIN_LISTEN", value_name = "HOST:PORT")]
    pub listen: Option<SocketAddr>,

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

    /// Address of the admin API (`/admin/backends`), served by the control core and never on
    /// --listen: HOST:PORT, or `unix:PATH` for a Unix socket (created mode 0600, a stale one
    /// replaced, removed at exit). Port 0 picks a free port (printed on stdout). A non-loopback
    /// address needs --admin-token-file. [default: 127.0.0.1:9090]
    #[arg(long, env = "MYELIN_ADMIN_LISTEN", value_name = "HOST:PORT|unix:PATH")]
    pub admin_listen: Option<AdminListen>,

    /// File holding the admin API's bearer token (`Authorization: Bearer TOKEN`; surrounding
    /// whitespace ignored). Required when --admin-listen is not a loopback address.
    /// [default: none: no token on loopback]
    #[arg(long, env = "MYELIN_ADMIN_TOKEN_FILE", value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,

    /// An inference engine: `http://host:port[,kv-events=tcp://host:port]`. Repeat the flag
    /// for several; in MYELIN_BACKEND separate them with `;`. [default: none]
    #[arg(
        long = "backend",
        env = "MYELIN_BACKEND",
        value_name = "SPEC",
        value_delimiter = ';'
    )]
    pub backends: Vec<String>,

    /// Start N simulated vLLM engines in-process and use them as backends (added to any
    /// --backend). [default: 0]
    #[arg(long, env = "MYELIN_SIM", value_name = "N")]
    pub sim: Option<usize>,

    /// Simulated time runs this many times faster than real time (with --sim). [default: 1]
    #[arg(long, env = "MYELIN_SIM_SPEEDUP", value_name = "FACTOR")]
    pub sim_speedup: Option<f64>,

    /// The peer cluster (--gossip-listen, --peer, --node-id, --cluster-key-file).
    #[command(flatten)]
    pub gossip: crate::cluster::GossipArgs,

    /// Routing policy: `round-robin` (each backend in turn), `least-load` (fewest queued and
    /// active tokens) or `prefix` (lowest cost: the predicted time to first token, see --cost).
    /// [default: prefix]
    #[arg(long, env = "MYELIN_ROUTING", value_name = "POLICY",
          value_parser = |name: &str| name.parse::<Policy>())]
    pub routing: Option<Policy>,

    /// How much the prefix policy trusts its routing history: `off` (history only: a prefix
    /// routed to a backend counts as cached there), `estimate` (history discounted by an
    /// estimate of eviction from cache pressure), `verified` (only blocks the backend's
    /// KV-event stream confirms) or `auto` (verified where a KV-event stream is live, estimate
    /// elsewhere). [default: auto]
    #[arg(long, env = "MYELIN_RESIDENCY", value_name = "MODE",
          value_parser = |name: &str| name.parse::<ResidencyMode>())]
    pub residency: Option<ResidencyMode>,

    /// tokenizer.json of the served model. [default: the bundled deepseek-v3 tokenizer]
    #[arg(long, env = "MYELIN_TOKENIZER", value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,

    /// Chat template: the model's tokenizer_config.json (its `chat_template`) or a .jinja file.
    /// [default: built-in ChatML]
    #[arg(long, env = "MYELIN_CHAT_TEMPLATE", value_name = "PATH")]
    pub chat_template: Option<PathBuf>,

    /// KV-cache block size of the engines, in tokens (vLLM --block-size). [default: 16]
    #[arg(long, env = "MYELIN_BLOCK_SIZE", value_name = "TOKENS")]
    pub block_size: Option<usize>,

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

    /// Largest request body accepted; larger ones get 413. [default: 8388608]
    #[arg(long, env = "MYELIN_MAX_BODY_BYTES", value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,

    /// Bytes of request bodies one data core holds while reading them, before the requests
    /// are admitted; a body that would take more gets 429 `router_overloaded` at once
    /// (myelin_body_budget_rejections_total). [default: 268435456]
    #[arg(
        long,
        env = "MYELIN_MAX_BODY_BUFFER_BYTES_PER_CORE",
        value_name = "BYTES"
    )]
    pub max_body_buffer_bytes_per_core: Option<usize>,

    /// Client connections open at once per data core; one more is closed on accept
    /// (myelin_connections_refused_total). [default: 4096]
    #[arg(long, env = "MYELIN_MAX_CONNECTIONS_PER_CORE", value_name = "N")]
    pub max_connections_per_core: Option<usize>,

    /// Requests in flight per data core before new ones get 429 with Retry-After.
    /// [default: 1024]
    #[arg(long, env = "MYELIN_MAX_IN_FLIGHT_PER_CORE", value_name = "N")]
    pub max_in_flight_per_core: Option<usize>,

    /// The served model's context length (vLLM's --max-model-len): a request whose max_tokens
    /// or prompt alone exceeds it gets 400 before it is counted anywhere. [default: the
    /// smallest max_model_len the engines' GET /v1/models report, when they do]
    #[arg(long, env = "MYELIN_MAX_MODEL_LEN", value_name = "TOKENS")]
    pub max_model_len: Option<u64>,

    /// Retry-After value sent with 429. [default: 1]
    #[arg(long, env = "MYELIN_RETRY_AFTER_SECONDS", value_name = "SECONDS")]
    pub retry_after_seconds: Option<u64>,

    /// Attempts on other backends after a connect error or 502/503 before the first response
    /// byte; never after streaming began. [default: 2]
    #[arg(long, env = "MYELIN_MAX_RETRIES", value_name = "N")]
    pub max_retries: Option<u32>,

    /// Backoff before the first retry, doubled for each further one. [default: 20]
    #[arg(long, env = "MYELIN_RETRY_BACKOFF_MS", value_name = "MS")]
    pub retry_backoff_ms: Option<u64>,

    /// Timeout for connecting to an engine. [default: 2000]
    #[arg(long, env = "MYELIN_CONNECT_TIMEOUT_MS", value_name = "MS")]
    pub connect_timeout_ms: Option<u64>,

    /// Time a client has to send its whole request body once the head arrived; past it, 408.
    /// The in-flight slot is taken only once the body is complete. [default: 30000]
    #[arg(long, env = "MYELIN_BODY_READ_TIMEOUT_MS", value_name = "MS")]
    pub body_read_timeout_ms: Option<u64>,

    /// Time an engine has to send the response head of a streaming request (engines send it
    /// before the first token); past it the attempt counts as a failure (circuit breaker) and
    /// the request goes to another backend like after a connect error. [default: 30000]
    #[arg(long, env = "MYELIN_UPSTREAM_HEADER_TIMEOUT_MS", value_name = "MS")]
    pub upstream_header_timeout_ms: Option<u64>,

    /// Time an engine has to answer a non-streaming request (its head comes with the whole
    /// completion); past it, 504 and a breaker failure, no retry. [default: 600000]
    #[arg(long, env = "MYELIN_UPSTREAM_RESPONSE_TIMEOUT_MS", value_name = "MS")]
    pub upstream_response_timeout_ms: Option<u64>,

    /// Longest silence of an engine's response body (before its first byte and between two
    /// chunks); past it the engine request is aborted and an SSE stream ends with an error
    /// event. [default: 60000]
    #[arg(long, env = "MYELIN_STREAM_IDLE_TIMEOUT_MS", value_name = "MS")]
    pub stream_idle_timeout_ms: Option<u64>,

    /// An engine with requests in flight and no response byte on any of them for this long is
    /// taken as wedged: its circuit breaker opens (no new requests until its probation lets
    /// one through and that one is answered). Where the engine exports a generated-tokens
    /// counter (scraped metrics), only if that stood still as long; without one, only when
    /// streams are among the silent requests. 0 = off. [default: 30000]
    #[arg(long, env = "MYELIN_ENGINE_STALL_MS", value_name = "MS")]
    pub engine_stall_ms: Option<u64>,

    /// Interval of active health checks (GET --health-path on each engine). [default: 2000]
    #[arg(long, env = "MYELIN_HEALTH_INTERVAL_MS", value_name = "MS")]
    pub health_interval_ms: Option<u64>,

    /// Timeout of one health check. [default: 1000]
    #[arg(long, env = "MYELIN_HEALTH_TIMEOUT_MS", value_name = "MS")]
    pub health_timeout_ms: Option<u64>,

    /// Path probed by active health checks. [default: /health]
    #[arg(long, env = "MYELIN_HEALTH_PATH", value_name = "PATH")]
    pub health_path: Option<String>,

    /// Consecutive successful checks that bring a down backend up. [default: 2]
    #[arg(long, env = "MYELIN_HEALTHY_THRESHOLD", value_name = "N")]
    pub healthy_threshold: Option<u32>,

    /// Consecutive failed checks that take a backend down. [default: 3]
    #[arg(long, env = "MYELIN_UNHEALTHY_THRESHOLD", value_name = "N")]
    pub unhealthy_threshold: Option<u32>,

    /// Consecutive failed requests (connect errors, 5xx) that open a backend's circuit
    /// breaker. [default: 5]
    #[arg(long, env = "MYELIN_BREAKER_FAILURES", value_name = "N")]
    pub breaker_failures: Option<u32>,

    /// How long an open breaker stays open before its half-open probe (one GET --health-path;
    /// success closes it, failure opens it again). [default: 5000]
    #[arg(long, env = "MYELIN_BREAKER_OPEN_MS", value_name = "MS")]
    pub breaker_open_ms: Option<u64>,

    /// On SIGTERM/SIGINT: stop accepting, wait this long for in-flight requests, exit 0.
    /// [default: 30000]
    #[arg(long, env = "MYELIN_DRAIN_TIMEOUT_MS", value_name = "MS")]
    pub drain_timeout_ms: Option<u64>,

    /// Memory per data core for each tokenizer cache: token ids of prompt segments between
    /// special tokens, and of earlier prompts' leading bytes (system prompts, earlier turns);
    /// 0 disables both. [default: 16777216]
    #[arg(long, env = "MYELIN_TOKENIZE_CACHE_BYTES", value_name = "BYTES")]
    pub tokenize_cache_bytes: Option<usize>,

    /// Tokenize only this many leading bytes of a prompt first; the rest only when the prefix
    /// matches some backend to its end. 0 always tokenizes whole prompts. [default: 2048]
    #[arg(long, env = "MYELIN_TOKENIZE_PREFIX_BYTES", value_name = "BYTES")]
    pub tokenize_prefix_bytes: Option<usize>,

    /// Bytes of a prompt tokenized afresh for routing, at most (bytes served from the
    /// tokenizer caches are free); routing uses the prefix up to there, the request is still
    /// proxied whole. 0 = no bound. [default: 32768]
    #[arg(long, env = "MYELIN_TOKENIZE_MAX_BYTES", value_name = "BYTES")]
    pub tokenize_max_bytes: Option<usize>,

    /// A run of one character class (letters, digits, whitespace, other) longer than this
    /// ends routing's tokenization where it starts (one pre-token that long costs more per byte
    /// the longer it is). 0 = no bound. [default: 2048]
    #[arg(long, env = "MYELIN_TOKENIZE_MAX_PIECE_BYTES", value_name = "BYTES")]
    pub tokenize_max_piece_bytes: Option<usize>,

    /// Always tokenize with HuggingFace `tokenizers`, never with the built-in fast byte-level
    /// BPE path (same ids, checked at startup; used when the tokenizer is one it reproduces).
    #[arg(long, env = "MYELIN_NO_FAST_TOKENIZER")]
    pub no_fast_tokenizer: bool,

    /// Fault injection for tests: the control core drops every Nth message it sends to a data
    /// core, as if that core's queue were full. [default: 0, never]
    #[arg(
        long,
        env = "MYELIN_FAULT_DROP_CONTROL_MESSAGES",
        value_name = "N",
        hide = true
    )]
    pub fault_drop_control_messages: Option<u64>,

    /// Prefix policy: load differences up to this many tokens are treated as noise (a
    /// backend's load counts only beyond the least-loaded one's plus this); 0 means pure
    /// expected-cost scoring. [default: 2048]
    #[arg(long, env = "MYELIN_LOAD_BOUND_TOKENS", value_name = "TOKENS")]
    pub load_bound_tokens: Option<u64>,

    /// Prefix policy: what one decode step of an engine costs, in prompt tokens prefilled in the
    /// same time; the unit of the expected wait for KV memory on an engine whose memory is full
    /// (docs/routing.md, "KV memory"); 0 ignores KV memory. [default: 300]
    #[arg(long, env = "MYELIN_DECODE_STEP_TOKENS", value_name = "TOKENS")]
    pub decode_step_tokens: Option<u64>,

    /// How often the control core reads every engine's metrics endpoint (KV capacity and
    /// utilization, running and waiting requests). [default: 1000]
    #[arg(long, env = "MYELIN_ENGINE_METRICS_INTERVAL_MS", value_name = "MS")]
    pub engine_metrics_interval_ms: Option<u64>,

    /// Prefix policy: a backend routed a prompt's prefix this recently counts as holding it in
    /// every residency mode ("pending resident": it is prefilling it, or its KV events are on
    /// the way); 0 turns it off. [default: 2000]
    #[arg(long, env = "MYELIN_PENDING_RESIDENT_MS", value_name = "MS")]
    pub pending_resident_ms: Option<u64>,

    /// Prefix policy: most homes a prefix gets because engines holding it wait for KV memory
    /// (backends holding at least half of its longest match); 0 = no bound. [default: 3]
    #[arg(long, env = "MYELIN_MAX_PREFIX_HOMES", value_name = "N")]
    pub max_prefix_homes: Option<u32>,

    /// Prefix policy, `--cost ttft`: the prefill an engine would do beyond the least any
    /// engine would (re-prefilling a prefix another engine still holds) is charged this percent
    /// of its prefill time again, for the requests that will queue behind that work
    /// (docs/routing.md, "Extra prefill"); 0 = the request's own predicted TTFT only.
    /// [default: 100]
    #[arg(long, env = "MYELIN_EXTRA_PREFILL_PERCENT", value_name = "PERCENT",
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub extra_prefill_percent: Option<u32>,

    /// Prefix policy: the extra-prefill charge applies in full once this percent of the
    /// prompt tokens the history matched (over recent decisions) were found evicted by the
    /// residency mode, in proportion below it, so that where the caches hold everything asked
    /// for again a hot prefix may spread to idle engines (docs/routing.md, "Extra prefill");
    /// 0 = always in full. With `--residency off` the charge is always in full.
    /// [default: 25]
    #[arg(long, env = "MYELIN_EXTRA_PREFILL_RAMP_PERCENT", value_name = "PERCENT",
          value_parser = clap::value_parser!(u32).range(0..=100))]
    pub extra_prefill_ramp_percent: Option<u32>,

    /// Prefix policy: what it minimises. `ttft`: the predicted time to first token on each
    /// engine, from the prefill queued there, the prompt's uncached part and the wait for KV
    /// memory, at each engine's rates fitted from its own first tokens (docs/routing.md, "The
    /// cost in seconds"); `tokens`: the earlier cost in tokens (uncached prefill + load beyond
    /// --load-bound-tokens + KV wait at --decode-step-tokens). [default: ttft]
    #[arg(long, env = "MYELIN_COST", value_name = "MODEL",
          value_parser = |name: &str| name.parse::<myelin_routing::CostModel>())]
    pub cost: Option<myelin_routing::CostModel>,

    /// Tokens an engine schedules per step (vLLM's `--max-num-batched-tokens`: 2,048 on an
    /// A100's OpenAI server, 8,192 on H100-class GPUs), for the predicted time to first
    /// token. [default: 2048]
    #[arg(long, env = "MYELIN_ENGINE_STEP_TOKENS", value_name = "TOKENS",
          value_parser = clap::value_parser!(u32).range(1..=1_048_576))]
    pub engine_step_tokens: Option<u32>,
}

/// The `--config` file: the same keys as the flags, kebab-case.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub metrics_on_client_port: Option<bool>,
    pub decision_trace: Option<bool>,
    pub admin_listen: Option<AdminListen>,
    pub admin_token_file: Option<PathBuf>,
    #[serde(default, alias = "backends")]
    pub backend: Vec<FileBackend>,
    pub sim: Option<usize>,
    pub sim_speedup: Option<f64>,
    pub gossip_listen: Option<SocketAddr>,
    pub gossip_advertise: Option<SocketAddr>,
    #[serde(default, alias = "peers")]
    pub peer: Vec<SocketAddr>,
    pub node_id: Option<String>,
    pub cluster_key_file: Option<PathBuf>,
    pub gossip_probe_interval_ms: Option<u64>,
    pub gossip_max_members: Option<usize>,
    pub routing: Option<String>,
    pub residency: Option<String>,
    pub tokenizer: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
    pub block_size: Option<usize>,
    pub cores: Option<String>,
    pub shards: Option<usize>,
    pub control_core: Option<usize>,
    pub no_pin: Option<bool>,
    pub max_body_bytes: Option<usize>,
    pub max_body_buffer_bytes_per_core: Option<usize>,
    pub max_connections_per_core: Option<usize>,
    pub max_in_flight_per_core: Option<usize>,
    pub max_model_len: Option<u64>,
    pub retry_after_seconds: Option<u64>,
    pub max_retries: Option<u32>,
    pub retry_backoff_ms: Option<u64>,
    pub connect_timeout_ms: Option<u64>,
    pub body_read_timeout_ms: Option<u64>,
    pub upstream_header_timeout_ms: Option<u64>,
    pub upstream_response_timeout_ms: Option<u64>,
    pub stream_idle_timeout_ms: Option<u64>,
    pub engine_stall_ms: Option<u64>,
    pub health_interval_ms: Option<u64>,
    pub health_timeout_ms: Option<u64>,
    pub health_path: Option<String>,
    pub healthy_threshold: Option<u32>,
    pub unhealthy_threshold: Option<u32>,
    pub breaker_failures: Option<u32>,
    pub breaker_open_ms: Option<u64>,
    pub drain_timeout_ms: Option<u64>,
    pub tokenize_cache_bytes: Option<usize>,
    pub tokenize_prefix_bytes: Option<usize>,
    pub tokenize_max_bytes: Option<usize>,
    pub tokenize_max_piece_bytes: Option<usize>,
    pub no_fast_tokenizer: Option<bool>,
    pub load_bound_tokens: Option<u64>,
    pub decode_step_tokens: Option<u64>,
    pub engine_metrics_interval_ms: Option<u64>,
    pub pending_resident_ms: Option<u64>,
    pub max_prefix_homes: Option<u32>,
    pub extra_prefill_percent: Option<u32>,
    pub extra_prefill_ramp_percent: Option<u32>,
    pub cost: Option<String>,
    pub engine_step_tokens: Option<u32>,
}

/// A backend in the config file: a spec string or a table.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum FileBackend {
    Spec(String),
    Table {
        url: String,
        #[serde(rename = "kv-events", alias = "kv_events")]
        kv_events: Option<String>,
        #[serde(default, rename = "kv-replay", alias = "kv_replay")]
        kv_replay: Option<String>,
        /// KV-cache capacity in tokens (residency estimate), when the engine's metrics lack it.
        #[serde(default, rename = "capacity-tokens", alias = "capacity_tokens")]
        capacity_tokens: Option<u64>,
    },
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
    pub admin_listen: AdminListen,
    /// Bearer token the admin API requires (always set when `admin_listen` is not loopback).
    pub admin_token: Option<AdminToken>,
    pub backends: Vec<BackendSpec>,
    pub sim: usize,
    pub sim_speedup: f64,
    /// The peer cluster (`None`: gossip off, a single router).
    pub gossip: Option<crate::cluster::GossipSettings>,
    pub routing: Policy,
    pub residency: ResidencyMode,
    pub tokenizer: Option<PathBuf>,
    pub chat_template: Option<PathBuf>,
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
    #[error(transparent)]
    Backend(#[from] BackendSpecError),
    #[error(transparent)]
    Cores(#[from] CoreLayoutError),
    #[error("no backends: give --backend URL (repeatable) or --sim N")]
    NoBackends,
    #[error("{0}")]
    Gossip(String),
    #[error("config file key cost: {0}")]
    Cost(myelin_routing::ParseNameError),
    #[error("config file key routing: {0}")]
    Routing(myelin_routing::ParseNameError),
    #[error("config file key residency: {0}")]
    Residency(myelin_routing::ParseNameError),
    #[error("config file key engine-step-tokens must be 1 to 1048576")]
    EngineStepTokens,
    #[error("config file key extra-prefill-percent must be 0 to 1000")]
    ExtraPrefillPercent,
    #[error("config file key extra-prefill-ramp-percent must be 0 to 100")]
    ExtraPrefillRampPercent,
    #[error("{0} must be at least 1")]
    MustBePositive(&'static str),
    #[error("--sim-speedup must be a positive number")]
    SimSpeedup,
    #[error("--health-path must start with `/`")]
    HealthPath,
    #[error(
        "--admin-listen {0} is not a loopback address: give --admin-token-file PATH (a bearer \
         token) or listen on 127.0.0.1 / [::1]"
    )]
    AdminTokenRequired(SocketAddr),
    #[error("reading --admin-token-file {path}: {source}")]
    AdminTokenFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--admin-token-file {0} holds no token (empty or only whitespace)")]
    AdminTokenEmpty(PathBuf),
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

impl<'de> Deserialize<'de> for AdminListen {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
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

impl FileConfig {
    /// Reads and parses a config file.
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::ParseFile {
            path: path.into(),
            source,
        })
    }
}

impl ServeConfig {
    /// Resolves flags (already merged with the environment by clap) over the config file.
    pub fn resolve(args: ServeArgs) -> Result<ServeConfig, ConfigError> {
        let file = match &args.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        Self::merge(args, file, &online_cpus())
    }

    /// Merges flags over a parsed file; `online` is the list of usable CPUs.
    pub fn merge(
        args: ServeArgs,
        file: FileConfig,
        online: &[usize],
    ) -> Result<ServeConfig, ConfigError> {
        let backends = if args.backends.is_empty() {
            file.backend
                .iter()
                .map(|backend| match backend {
                    FileBackend::Spec(spec) => BackendSpec::parse(spec),
                    FileBackend::Table {
                        url,
                        kv_events,
                        kv_replay,
                        capacity_tokens,
                    } => BackendSpec::from_parts(url, url, kv_events.clone(), kv_replay.clone())
                        .and_then(|mut spec| {
                            spec.capacity_tokens = match *capacity_tokens {
                                Some(tokens) => Some(parse_capacity(url, &tokens.to_string())?),
                                None => None,
                            };
                            Ok(spec)
                        }),
                })
                .collect::<Result<Vec<_>, _>>()?
        } else {
            args.backends
                .iter()
                .map(|spec| BackendSpec::parse(spec))
                .collect::<Result<Vec<_>, _>>()?
        };
        let sim = args.sim.or(file.sim).unwrap_or(0);
        if backends.is_empty() && sim == 0 {
            return Err(ConfigError::NoBackends);
        }
        let cores = args.cores.or(file.cores);
        let shards = args.shards.or(file.shards);
        let control_core = args.control_core.or(file.control_core);
        let no_pin = args.no_pin || file.no_pin.unwrap_or(false);
        let layout = decide_layout(cores.as_deref(), shards, control_core, no_pin, online)?;

        let positive_usize = |value: usize, name: &'static str| {
            if value == 0 {
                Err(ConfigError::MustBePositive(name))
            } else {
                Ok(value)
            }
        };
        let positive_u32 = |value: u32, name: &'static str| {
            if value == 0 {
                Err(ConfigError::MustBePositive(name))
            } else {
                Ok(value)
            }
        };
        let health_path = args
            .health_path
            .or(file.health_path)
            .unwrap_or_else(|| Defaults::HEALTH_PATH.into());
        if !health_path.starts_with('/') {
            return Err(ConfigError::HealthPath);
        }
        let sim_speedup = args
            .sim_speedup
            .or(file.sim_speedup)
            .unwrap_or(Defaults::SIM_SPEEDUP);
        if !(sim_speedup.is_finite() && sim_speedup > 0.0) {
            return Err(ConfigError::SimSpeedup);
        }
        let gossip = crate::cluster::resolve(
            args.gossip,
            crate::cluster::GossipFile {
                gossip_listen: file.gossip_listen,
                gossip_advertise: file.gossip_advertise,
                peers: file.peer.clone(),
                node_id: file.node_id.clone(),
                cluster_key_file: file.cluster_key_file.clone(),
                gossip_probe_interval_ms: file.gossip_probe_interval_ms,
                gossip_max_members: file.gossip_max_members,
            },
        )
        .map_err(ConfigError::Gossip)?;
        let millis = Duration::from_millis;
        let listen = match args.listen.or(file.listen) {
            Some(listen) => listen,
            None => SocketAddr::from(([0, 0, 0, 0], 8080)),
        };
        let admin_listen = args
            .admin_listen
            .or(file.admin_listen)
            .unwrap_or_else(|| AdminListen::Tcp(SocketAddr::from(([127, 0, 0, 1], 9090))));
        let admin_token = match args.admin_token_file.or(file.admin_token_file) {
            Some(path) => Some(AdminToken::from_file(&path)?),
            None => None,
        };
        if let AdminListen::Tcp(addr) = admin_listen
            && admin_token.is_none()
            && !addr.ip().is_loopback()
        {
            return Err(ConfigError::AdminTokenRequired(addr));
        }
        Ok(ServeConfig {
            listen,
            metrics_listen: args.metrics_listen.or(file.metrics_listen),
            metrics_on_client_port: args.metrics_on_client_port
                || file.metrics_on_client_port.unwrap_or(false),
            decision_trace: args.decision_trace || file.decision_trace.unwrap_or(false),
            admin_listen,
            admin_token,
            backends,
            sim,
            sim_speedup,
            gossip,
            routing: match (args.routing, &file.routing) {
                (Some(policy), _) => policy,
                (None, Some(name)) => name.parse().map_err(ConfigError::Routing)?,
                (None, None) => Policy::Prefix,
            },
            residency: match (args.residency, &file.residency) {
                (Some(mode), _) => mode,
                (None, Some(name)) => name.parse().map_err(ConfigError::Residency)?,
                (None, None) => ResidencyMode::Auto,
            },
            tokenizer: args.tokenizer.or(file.tokenizer),
            chat_template: args.chat_template.or(file.chat_template),
            block_size: positive_usize(
                args.block_size
                    .or(file.block_size)
                    .unwrap_or(Defaults::BLOCK_SIZE_TOKENS),
                "--block-size",
            )?,
            layout,
            max_body_bytes: positive_usize(
                args.max_body_bytes
                    .or(file.max_body_bytes)
                    .unwrap_or(Defaults::MAX_BODY_BYTES),
                "--max-body-bytes",
            )?,
            max_body_buffer_bytes_per_core: positive_usize(
                args.max_body_buffer_bytes_per_core
                    .or(file.max_body_buffer_bytes_per_core)
                    .unwrap_or(Defaults::MAX_BODY_BUFFER_BYTES_PER_CORE),
                "--max-body-buffer-bytes-per-core",
            )?,
            max_connections_per_core: positive_usize(
                args.max_connections_per_core
                    .or(file.max_connections_per_core)
                    .unwrap_or(Defaults::MAX_CONNECTIONS_PER_CORE),
                "--max-connections-per-core",
            )?,
            max_in_flight_per_core: positive_usize(
                args.max_in_flight_per_core
                    .or(file.max_in_flight_per_core)
                    .unwrap_or(Defaults::MAX_IN_FLIGHT_PER_CORE),
                "--max-in-flight-per-core",
            )?,
            max_model_len: match args.max_model_len.or(file.max_model_len) {
                Some(0) => return Err(ConfigError::MustBePositive("--max-model-len")),
                other => other,
            },
            retry_after_seconds: args
                .retry_after_seconds
                .or(file.retry_after_seconds)
                .unwrap_or(Defaults::RETRY_AFTER_SECONDS),
            max_retries: args
                .max_retries
                .or(file.max_retries)
                .unwrap_or(Defaults::MAX_RETRIES),
            retry_backoff: millis(
                args.retry_backoff_ms
                    .or(file.retry_backoff_ms)
                    .unwrap_or(Defaults::RETRY_BACKOFF_MS),
            ),
            connect_timeout: millis(
                args.connect_timeout_ms
                    .or(file.connect_timeout_ms)
                    .unwrap_or(Defaults::CONNECT_TIMEOUT_MS)
                    .max(1),
            ),
            body_read_timeout: millis(
                args.body_read_timeout_ms
                    .or(file.body_read_timeout_ms)
                    .unwrap_or(Defaults::BODY_READ_TIMEOUT_MS)
                    .max(1),
            ),
            upstream_header_timeout: millis(
                args.upstream_header_timeout_ms
                    .or(file.upstream_header_timeout_ms)
                    .unwrap_or(Defaults::UPSTREAM_HEADER_TIMEOUT_MS)
                    .max(1),
            ),
            upstream_response_timeout: millis(
                args.upstream_response_timeout_ms
                    .or(file.upstream_response_timeout_ms)
                    .unwrap_or(Defaults::UPSTREAM_RESPONSE_TIMEOUT_MS)
                    .max(1),
            ),
            stream_idle_timeout: millis(
                args.stream_idle_timeout_ms
                    .or(file.stream_idle_timeout_ms)
                    .unwrap_or(Defaults::STREAM_IDLE_TIMEOUT_MS)
                    .max(1),
            ),
            engine_stall: Some(
                args.engine_stall_ms
                    .or(file.engine_stall_ms)
                    .unwrap_or(Defaults::ENGINE_STALL_MS),
            )
            .filter(|&ms| ms > 0)
            .map(millis),
            health: HealthConfig {
                interval: millis(
                    args.health_interval_ms
                        .or(file.health_interval_ms)
                        .unwrap_or(Defaults::HEALTH_INTERVAL_MS)
                        .max(10),
                ),
                timeout: millis(
                    args.health_timeout_ms
                        .or(file.health_timeout_ms)
                        .unwrap_or(Defaults::HEALTH_TIMEOUT_MS)
                        .max(1),
                ),
                path: health_path,
                healthy_threshold: positive_u32(
                    args.healthy_threshold
                        .or(file.healthy_threshold)
                        .unwrap_or(Defaults::HEALTHY_THRESHOLD),
                    "--healthy-threshold",
                )?,
                unhealthy_threshold: positive_u32(
                    args.unhealthy_threshold
                        .or(file.unhealthy_threshold)
                        .unwrap_or(Defaults::UNHEALTHY_THRESHOLD),
                    "--unhealthy-threshold",
                )?,
                breaker_failures: positive_u32(
                    args.breaker_failures
                        .or(file.breaker_failures)
                        .unwrap_or(Defaults::BREAKER_FAILURES),
                    "--breaker-failures",
                )?,
                breaker_open: millis(
                    args.breaker_open_ms
                        .or(file.breaker_open_ms)
                        .unwrap_or(Defaults::BREAKER_OPEN_MS),
                ),
            },
            drain_timeout: millis(
                args.drain_timeout_ms
                    .or(file.drain_timeout_ms)
                    .unwrap_or(Defaults::DRAIN_TIMEOUT_MS),
            ),
            tokenize_cache_bytes: args
                .tokenize_cache_bytes
                .or(file.tokenize_cache_bytes)
                .unwrap_or(Defaults::TOKENIZE_CACHE_BYTES),
            tokenize_prefix_bytes: args
                .tokenize_prefix_bytes
                .or(file.tokenize_prefix_bytes)
                .unwrap_or(Defaults::TOKENIZE_PREFIX_BYTES),
            tokenize_max_bytes: args
                .tokenize_max_bytes
                .or(file.tokenize_max_bytes)
                .unwrap_or(Defaults::TOKENIZE_MAX_BYTES),
            tokenize_max_piece_bytes: args
                .tokenize_max_piece_bytes
                .or(file.tokenize_max_piece_bytes)
                .unwrap_or(Defaults::TOKENIZE_MAX_PIECE_BYTES),
            fast_tokenizer: !(args.no_fast_tokenizer || file.no_fast_tokenizer.unwrap_or(false)),
            load_bound_tokens: args
                .load_bound_tokens
                .or(file.load_bound_tokens)
                .unwrap_or(Defaults::LOAD_BOUND_TOKENS),
            decode_step_tokens: args
                .decode_step_tokens
                .or(file.decode_step_tokens)
                .unwrap_or(Defaults::DECODE_STEP_TOKENS),
            engine_metrics_interval: Duration::from_millis(
                args.engine_metrics_interval_ms
                    .or(file.engine_metrics_interval_ms)
                    .unwrap_or(Defaults::ENGINE_METRICS_INTERVAL_MS)
                    .max(10),
            ),
            pending_resident_ms: args
                .pending_resident_ms
                .or(file.pending_resident_ms)
                .unwrap_or(Defaults::PENDING_RESIDENT_MS),
            max_prefix_homes: args
                .max_prefix_homes
                .or(file.max_prefix_homes)
                .unwrap_or(Defaults::MAX_PREFIX_HOMES),
            extra_prefill_percent: within(
                args.extra_prefill_percent.or(file.extra_prefill_percent),
                0..=1000,
                myelin_routing::DEFAULT_EXTRA_PREFILL_PERCENT,
                ConfigError::ExtraPrefillPercent,
            )?,
            extra_prefill_ramp_percent: within(
                args.extra_prefill_ramp_percent
                    .or(file.extra_prefill_ramp_percent),
                0..=100,
                myelin_routing::DEFAULT_EXTRA_PREFILL_RAMP_PERCENT,
                ConfigError::ExtraPrefillRampPercent,
            )?,

            cost: match (args.cost, &file.cost) {
                (Some(cost), _) => cost,
                (None, Some(name)) => name.parse().map_err(ConfigError::Cost)?,
                (None, None) => myelin_routing::CostModel::default(),
            },
            engine_step_tokens: within(
                args.engine_step_tokens.or(file.engine_step_tokens),
                1..=1_048_576,
                Defaults::ENGINE_STEP_TOKENS,
                ConfigError::EngineStepTokens,
            )?,
            fault_drop_control_messages: args.fault_drop_control_messages.unwrap_or(0),
        })
    }
}

/// `value` (flag or file key), or `default` when neither gave one; `error` when out of `range`.
fn within(
    value: Option<u32>,
    range: std::ops::RangeInclusive<u32>,
    default: u32,
    error: ConfigError,
) -> Result<u32, ConfigError> {
    match value {
        Some(value) if !range.contains(&value) => Err(error),
        value => Ok(value.unwrap_or(default)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct TestCli {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn parse(flags: &[&str]) -> ServeArgs {
        let mut argv = vec!["myelin"];
        argv.extend_from_slice(flags);
        TestCli::try_parse_from(argv).unwrap().args
    }

    fn file(text: &str) -> FileConfig {
        toml::from_str(text).unwrap()
    }

    /// One backend, then `flags`, over the config file `text`.
    fn merge(flags: &[&str], text: &str) -> Result<ServeConfig, ConfigError> {
        let mut argv = vec!["--backend", "http://a:1"];
        argv.extend_from_slice(flags);
        ServeConfig::merge(parse(&argv), file(text), &[0])
    }

    #[test]
    fn defaults() {
        let config = ServeConfig::merge(
            parse(&["--backend", "http://a:1"]),
            FileConfig::default(),
            &[0, 1, 2],
        )
        .unwrap();
        assert_eq!(config.listen.to_string(), Defaults::LISTEN);
        assert_eq!(config.admin_listen.to_string(), Defaults::ADMIN_LISTEN);
        assert_eq!(config.admin_token, None);
        assert_eq!(config.routing, Policy::Prefix);
        assert_eq!(config.residency, ResidencyMode::Auto);
        assert_eq!(config.block_size, 16);
        assert_eq!(config.layout.data_cpus, vec![Some(1), Some(2)]);
        assert_eq!(config.layout.control_cpu, Some(0));
        assert_eq!(config.health.path, "/health");
        assert_eq!(config.body_read_timeout, Duration::from_secs(30));
        assert_eq!(config.upstream_header_timeout, Duration::from_secs(30));
        assert_eq!(config.upstream_response_timeout, Duration::from_secs(600));
        assert_eq!(config.stream_idle_timeout, Duration::from_secs(60));
        assert_eq!(config.engine_stall, Some(Duration::from_secs(30)));
    }

    #[test]
    fn flags_override_file() {
        let config = ServeConfig::merge(
            parse(&["--routing", "least-load", "--shards", "2"]),
            file(
                r#"
                listen = "127.0.0.1:9000"
                routing = "round-robin"
                residency = "verified"
                backend = ["http://a:1", { url = "http://b:2", kv-events = "tcp://b:5557" }]
                max-body-bytes = 1000
                "#,
            ),
            &[0],
        )
        .unwrap();
        assert_eq!(config.routing, Policy::LeastLoad);
        assert_eq!(config.residency, ResidencyMode::Verified);
        assert_eq!(config.listen.to_string(), "127.0.0.1:9000");
        assert_eq!(config.max_body_bytes, 1000);
        assert_eq!(config.backends.len(), 2);
        assert_eq!(
            config.backends[1].kv_events.as_deref(),
            Some("tcp://b:5557")
        );
        assert_eq!(config.layout.shard_count(), 2);
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
        let error = merge(&[], "routing = \"fastest\"").unwrap_err();
        assert!(matches!(error, ConfigError::Routing(_)), "{error}");
        assert!(error.to_string().contains("routing") && error.to_string().contains("fastest"));
        let error = merge(&[], "residency = \"maybe\"").unwrap_err();
        assert!(matches!(error, ConfigError::Residency(_)), "{error}");
        let argv = ["myelin", "--routing", "fastest", "--backend", "http://a:1"];
        let Err(error) = TestCli::try_parse_from(argv) else {
            panic!("--routing fastest parsed");
        };
        let error = error.to_string();
        assert!(error.contains("least-load"), "{error}");
    }

    #[test]
    fn extra_prefill_charge_from_defaults_file_and_flags_within_bounds() {
        assert_eq!(merge(&[], "").unwrap().extra_prefill_percent, 100);
        let text = "extra-prefill-percent = 250";
        assert_eq!(merge(&[], text).unwrap().extra_prefill_percent, 250);
        let config = merge(&["--extra-prefill-percent", "0"], text).unwrap();
        assert_eq!(config.extra_prefill_percent, 0);
        assert!(matches!(
            merge(&[], "extra-prefill-percent = 5000"),
            Err(ConfigError::ExtraPrefillPercent)
        ));
        let mut argv = vec!["myelin", "--extra-prefill-percent", "1001"];
        argv.extend(["--backend", "http://a:1"]);
        assert!(TestCli::try_parse_from(argv).is_err());

        assert_eq!(merge(&[], "").unwrap().extra_prefill_ramp_percent, 25);
        let text = "extra-prefill-ramp-percent = 40";
        assert_eq!(merge(&[], text).unwrap().extra_prefill_ramp_percent, 40);
        let config = merge(&["--extra-prefill-ramp-percent", "0"], text).unwrap();
        assert_eq!(config.extra_prefill_ramp_percent, 0);
        assert!(matches!(
            merge(&[], "extra-prefill-ramp-percent = 101"),
            Err(ConfigError::ExtraPrefillRampPercent)
        ));
        let mut argv = vec!["myelin", "--extra-prefill-ramp-percent", "101"];
        argv.extend(["--backend", "http://a:1"]);
        assert!(TestCli::try_parse_from(argv).is_err());
    }

    #[test]
    fn flag_backends_replace_file_backends() {
        let config = ServeConfig::merge(
            parse(&["--backend", "http://x:1;http://y:2", "--shards", "1"]),
            file(r#"backend = ["http://a:1"]"#),
            &[0],
        )
        .unwrap();
        let urls: Vec<_> = config.backends.iter().map(|b| b.url.as_str()).collect();
        assert_eq!(urls, ["http://x:1", "http://y:2"]);
    }

    #[test]
    fn rejects_unknown_file_keys_and_missing_backends() {
        assert!(toml::from_str::<FileConfig>("lisen = \"x\"").is_err());
        assert!(matches!(
            ServeConfig::merge(parse(&[]), FileConfig::default(), &[0]),
            Err(ConfigError::NoBackends)
        ));
        assert!(matches!(
            ServeConfig::merge(
                parse(&["--backend", "http://a:1", "--health-path", "health"]),
                FileConfig::default(),
                &[0]
            ),
            Err(ConfigError::HealthPath)
        ));
    }

    #[test]
    fn admin_off_loopback_needs_a_token() {
        let merge = |flags: &[&str]| {
            let mut all = vec!["--backend", "http://a:1", "--shards", "1"];
            all.extend_from_slice(flags);
            ServeConfig::merge(parse(&all), FileConfig::default(), &[0])
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
        let file: FileConfig = toml::from_str(r#"admin-listen = "unix:/run/m.sock""#).unwrap();
        assert_eq!(
            file.admin_listen,
            Some(AdminListen::Unix("/run/m.sock".into()))
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
        let config =
            ServeConfig::merge(parse(&["--sim", "2"]), FileConfig::default(), &[0]).unwrap();
        assert_eq!(config.sim, 2);
        assert!(config.backends.is_empty());
    }
}
