//! `myelin bench overhead` flags, and the settings they resolve to (`--quick` defaults, then
//! explicit flags).

use std::path::PathBuf;
use std::time::Duration;

use super::shapes::Shape;

/// Closed-loop seconds measured per leg and shape [full run, --quick].
pub const DURATION_S: (f64, f64) = (10.0, 2.0);
/// Closed-loop seconds before the measured window (connections open, caches warm).
pub const WARMUP_S: (f64, f64) = (2.0, 0.5);
/// Open-loop requests measured per leg and shape.
pub const OPEN_REQUESTS: (usize, usize) = (2_000, 200);
/// Open-loop requests sent first and left out.
pub const OPEN_WARMUP: (usize, usize) = (100, 20);
/// Shapes of a --quick run.
pub const QUICK_SHAPES: &str = "short,shared-prefix-2k";

/// Router overhead and scaling on instant engines: the load generator straight to an engine
/// (`direct`), then through `myelin serve` at each router core count, then through each
/// --external router, for every prompt shape. Prints tables and PASS/FAIL target lines;
/// writes report.json, report.md and PNG plots.
#[derive(Debug, Clone, clap::Args)]
pub struct OverheadArgs {
    /// The short version CI runs: 2 s closed loop, 200 open-loop requests, shapes short and
    /// shared-prefix-2k. Explicit flags still override it.
    #[arg(long)]
    pub quick: bool,

    /// Prompt shapes, comma-separated: short, shared-prefix-2k, unique-2k, repeated-2k,
    /// multi-turn-5, multi-turn-20, multi-turn-50 (multi-turn: all three), agentic, or all. [default: all; --quick: short,shared-prefix-2k]
    #[arg(long, value_name = "LIST")]
    pub shapes: Option<String>,

    /// Router core counts to run myelin (and each external router) at.
    #[arg(long, value_name = "LIST", default_value = "1,2")]
    pub router_cores: String,

    /// CPUs for the router: N router cores use the first N as data cores and the next as
    /// the control core. [default: all CPUs below 8 CPUs (shared), else the first half]
    #[arg(long, value_name = "LIST")]
    pub router_cpus: Option<String>,

    /// CPUs for the instant engines (one executor each). [default: all CPUs below 8 CPUs
    /// (shared), else the third quarter]
    #[arg(long, value_name = "LIST")]
    pub engine_cpus: Option<String>,

    /// CPUs for the load generator (one executor each). [default: all CPUs below 8 CPUs
    /// (shared), else the last quarter]
    #[arg(long, value_name = "LIST")]
    pub loadgen_cpus: Option<String>,

    /// Instant engines behind the router.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub engines: usize,

    /// An external router leg, NAME='COMMAND {port} {backends}' (repeatable), run at every
    /// router core count under `taskset -c` with myelin's CPUs. The command runs under
    /// `sh -c` with {port} a free loopback port and {backends} the engine URLs separated by
    /// spaces; it must answer GET /health on that port.
    #[arg(long = "external", value_name = "NAME=COMMAND")]
    pub external: Vec<String>,

    /// Legs to run, comma-separated: direct, myelin and --external names. Without direct
    /// there is no added latency. [default: all]
    #[arg(long, value_name = "LIST")]
    pub legs: Option<String>,

    /// Closed-loop seconds measured per leg and shape. [default: 10; --quick: 2]
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Closed-loop seconds before the measured window. [default: 2; --quick: 0.5]
    #[arg(long, value_name = "SECONDS")]
    pub warmup: Option<f64>,

    /// Closed-loop keep-alive connections.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub connections: usize,

    /// Open-loop requests measured per leg and shape (one at a time at --open-rate).
    /// [default: 2000; --quick: 200]
    #[arg(long, value_name = "N")]
    pub open_requests: Option<usize>,

    /// Open-loop warm-up requests, left out. [default: 100; --quick: 20]
    #[arg(long, value_name = "N")]
    pub open_warmup: Option<usize>,

    /// Open-loop send rate, requests per second.
    #[arg(long, value_name = "RATE", default_value_t = 500.0)]
    pub open_rate: f64,

    /// Run every leg this many times; report.json keeps every repeat and the medians.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeat: u32,

    /// max_tokens of every request.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub max_tokens: u32,

    /// Ask for streamed (SSE) responses.
    #[arg(long)]
    pub stream: bool,

    /// Also run every myelin leg with TLS on its client listener, as the leg `myelin+tls`
    /// beside the plain one (a test certificate the load generator verifies; keep-alive
    /// connections, so the handshake is paid once per connection): what TLS adds.
    #[arg(long)]
    pub tls: bool,

    /// Seed of the prompt texts.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,

    /// Output directory [default: results/overhead-<UTC timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// The myelin binary to run router legs with [default: this executable].
    #[arg(long, value_name = "PATH")]
    pub router_bin: Option<PathBuf>,

    /// Seconds a router gets to answer GET /health before the run fails.
    #[arg(long, value_name = "SECONDS", default_value_t = 15)]
    pub start_timeout: u64,

    /// Seconds one request may take before it counts as an error.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    pub request_timeout: u64,

    /// Exit non-zero when a target fails (targets are informational otherwise).
    #[arg(long)]
    pub strict: bool,
}

/// The resolved settings of a run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Settings {
    pub quick: bool,
    #[serde(serialize_with = "shape_names")]
    pub shapes: Vec<Shape>,
    pub router_cores: Vec<usize>,
    pub engines: usize,
    pub duration_s: f64,
    pub warmup_s: f64,
    pub connections: usize,
    pub open_requests: usize,
    pub open_warmup: usize,
    pub open_rate: f64,
    pub repeat: u32,
    pub max_tokens: u32,
    pub stream: bool,
    pub tls: bool,
    pub seed: u64,
    pub start_timeout_s: u64,
    pub request_timeout_s: u64,
    pub strict: bool,
}

fn shape_names<S: serde::Serializer>(shapes: &[Shape], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(shapes.iter().map(|shape| shape.name()))
}

impl Settings {
    pub fn start_timeout(&self) -> Duration {
        Duration::from_secs(self.start_timeout_s.max(1))
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_s.max(1))
    }
}

/// Parses `--router-cores`: comma-separated counts >= 1, ascending, without repeats.
pub fn parse_core_counts(list: &str) -> Result<Vec<usize>, String> {
    let mut counts: Vec<usize> = Vec::new();
    for part in list.split(',').map(str::trim) {
        let count: usize = part
            .parse()
            .map_err(|_| format!("--router-cores: {part:?} is not a core count"))?;
        if count == 0 {
            return Err("--router-cores: counts must be at least 1".into());
        }
        if !counts.contains(&count) {
            counts.push(count);
        }
    }
    counts.sort_unstable();
    Ok(counts)
}

impl OverheadArgs {
    /// The settings, with --quick's defaults where a flag was not given.
    pub fn settings(&self) -> Result<Settings, String> {
        let pick = |pair: (f64, f64)| if self.quick { pair.1 } else { pair.0 };
        let pick_count = |pair: (usize, usize)| if self.quick { pair.1 } else { pair.0 };
        let shapes = match (&self.shapes, self.quick) {
            (Some(list), _) => Shape::parse_list(list)?,
            (None, true) => Shape::parse_list(QUICK_SHAPES)?,
            (None, false) => Shape::ALL.to_vec(),
        };
        let settings = Settings {
            quick: self.quick,
            shapes,
            router_cores: parse_core_counts(&self.router_cores)?,
            engines: self.engines,
            duration_s: self.duration.unwrap_or(pick(DURATION_S)),
            warmup_s: self.warmup.unwrap_or(pick(WARMUP_S)),
            connections: self.connections,
            open_requests: self.open_requests.unwrap_or(pick_count(OPEN_REQUESTS)),
            open_warmup: self.open_warmup.unwrap_or(pick_count(OPEN_WARMUP)),
            open_rate: self.open_rate,
            repeat: self.repeat.max(1),
            max_tokens: self.max_tokens,
            stream: self.stream,
            tls: self.tls,
            seed: self.seed,
            start_timeout_s: self.start_timeout,
            request_timeout_s: self.request_timeout,
            strict: self.strict,
        };
        if !(settings.duration_s > 0.0 && settings.duration_s.is_finite()) {
            return Err("--duration must be a positive number of seconds".into());
        }
        if !(settings.warmup_s >= 0.0 && settings.warmup_s.is_finite()) {
            return Err("--warmup must be zero or more seconds".into());
        }
        if settings.connections == 0 || settings.engines == 0 || settings.open_requests == 0 {
            return Err("--connections, --engines and --open-requests must be at least 1".into());
        }
        if !(settings.open_rate > 0.0 && settings.open_rate.is_finite()) {
            return Err("--open-rate must be a positive rate".into());
        }
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Harness {
        #[command(flatten)]
        args: OverheadArgs,
    }

    fn settings(flags: &[&str]) -> Result<Settings, String> {
        Harness::parse_from(std::iter::once("overhead").chain(flags.iter().copied()))
            .args
            .settings()
    }

    #[test]
    fn defaults_are_the_full_run() {
        let settings = settings(&[]).unwrap();
        assert_eq!(settings.shapes, Shape::ALL);
        assert_eq!(settings.router_cores, [1, 2]);
        assert_eq!((settings.duration_s, settings.open_requests), (10.0, 2_000));
        assert_eq!(settings.connections, 64);
        assert!(!settings.stream);
    }

    #[test]
    fn quick_shortens_and_flags_override_it() {
        let quick = settings(&["--quick"]).unwrap();
        assert_eq!(quick.shapes, [Shape::Short, Shape::SharedPrefix2k]);
        assert_eq!((quick.duration_s, quick.open_requests), (2.0, 200));
        let overridden = settings(&[
            "--quick",
            "--duration",
            "0.5",
            "--open-requests",
            "20",
            "--shapes",
            "multi-turn",
            "--router-cores",
            "4,1,2,2",
        ])
        .unwrap();
        assert_eq!(
            overridden.shapes,
            [Shape::MultiTurn5, Shape::MultiTurn20, Shape::MultiTurn50]
        );
        assert_eq!((overridden.duration_s, overridden.open_requests), (0.5, 20));
        assert_eq!(overridden.router_cores, [1, 2, 4]);
    }

    #[test]
    fn nonsense_is_refused() {
        assert!(settings(&["--router-cores", "0"]).is_err());
        assert!(settings(&["--router-cores", "x"]).is_err());
        assert!(settings(&["--duration", "0"]).is_err());
        assert!(settings(&["--open-rate", "0"]).is_err());
        assert!(settings(&["--shapes", "long"]).is_err());
    }
}
