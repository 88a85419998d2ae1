//! `myelin bench` flags, and how they override the workload file.

use std::path::PathBuf;

use crate::legs::DEFAULT_LEGS;
use crate::workload::{PromptFormat, WorkloadConfig, WorkloadError, WorkloadKind};

/// Run identical traffic through several router configurations on embedded simulated engines
/// and compare them. With no flags: the churn workload and the default legs (round-robin,
/// least-load, the prefix legs and the oracle). Times in the workload and in reports are
/// simulated (wall x speedup).
/// `myelin bench overhead` is the router overhead and scaling benchmark instead.
#[derive(Debug, Clone, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Another benchmark instead of the churn harness.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,

    /// Workload: a built-in name (churn, churn-open, shared-prefix, shared-prefix-open,
    /// multi-turn, trace) or a path to a workload .toml file (see benches/) or .json file (as
    /// `myelin bench regimes` writes each cell's).
    #[arg(long, default_value = "churn")]
    pub workload: String,

    /// Legs to run, comma-separated: round-robin, least-load, prefix+off, prefix+estimate,
    /// prefix+verified, prefix+auto, oracle.
    #[arg(long, default_value = DEFAULT_LEGS)]
    pub legs: String,

    /// An external router leg, NAME='COMMAND {port} {backends}' (repeatable). The command runs
    /// under `sh -c` with {port} a free loopback port and {backends} the engine URLs separated
    /// by spaces; it must answer GET /health on that port.
    #[arg(long = "external", value_name = "NAME=COMMAND")]
    pub external: Vec<String>,

    /// Run every leg this many times, alternating the leg order between repeats.
    #[arg(long, default_value_t = 1)]
    pub repeat: u32,

    /// The short version CI runs (the workload's [quick] section: about 2.5 minutes for the
    /// default legs). Explicit flags still override it.
    #[arg(long)]
    pub quick: bool,

    /// Simulated engines per leg [workload default: 8].
    #[arg(long)]
    pub engines: Option<u32>,

    /// An engine you started, instead of the simulated ones (repeatable, one per engine):
    /// http://HOST:PORT[,kv-events=tcp://HOST:PORT][,kv-replay=tcp://HOST:PORT]
    /// [,capacity-tokens=N]. Every leg runs on these engines, their prefix caches emptied
    /// before each leg where they allow it (vLLM: VLLM_SERVER_DEV_MODE=1); times are wall time
    /// unless --speedup; no oracle leg, calibration or resident-prefix probe; evictions are
    /// unmeasured; open-loop workloads need --rate. See docs/reference/benchmark.md,
    /// "External engines".
    #[arg(long = "engine", value_name = "SPEC",
          conflicts_with_all = ["engines", "profile", "kv_blocks", "no_engine_metrics"])]
    pub engine: Vec<crate::engines::EngineSpec>,

    /// Closed-loop users [workload default: 60 for churn].
    #[arg(long)]
    pub users: Option<u32>,

    /// Simulated seconds of traffic per leg (wall seconds = duration / speedup).
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Simulated seconds at the start of each leg left out of latency statistics.
    #[arg(long, value_name = "SECONDS")]
    pub warmup: Option<f64>,

    /// Simulated time runs this many times faster than wall time [workload default: 10].
    #[arg(long)]
    pub speedup: Option<f64>,

    /// Engine performance profile [workload default: a100-40gb-llama-3.1-8b].
    #[arg(long)]
    pub profile: Option<String>,

    /// KV-cache capacity per engine, in blocks of 16 tokens [workload default].
    #[arg(long)]
    pub kv_blocks: Option<u32>,

    /// Simulate engines without a metrics endpoint (TensorRT-LLM, Ollama): `GET /metrics`
    /// answers 404, and routers get each engine's capacity as `capacity-tokens=` instead.
    #[arg(long)]
    pub no_engine_metrics: bool,

    /// Seed of every workload draw [workload default: 42].
    #[arg(long)]
    pub seed: Option<u64>,

    /// Prompt format: token-ids (completions with token-id prompts) or text.
    #[arg(long, value_parser = ["token-ids", "text"])]
    pub prompt: Option<String>,

    /// Mooncake-format trace to replay (selects the trace workload).
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,

    /// Multiply trace timestamps by this (0.5 replays twice as fast).
    #[arg(long)]
    pub time_scale: Option<f64>,

    /// Replay only the first N requests of the trace.
    #[arg(long)]
    pub max_requests: Option<u32>,

    /// churn-open, shared-prefix-open, multi-turn: arrival rate as a fraction of the cluster's
    /// measured capacity [workload default: 0.8 for churn-open].
    #[arg(long, value_name = "FRACTION")]
    pub rate_fraction: Option<f64>,

    /// churn-open, shared-prefix-open, multi-turn: arrival rate in requests per simulated
    /// second (skips the capacity measurement).
    #[arg(long, value_name = "RPS")]
    pub rate: Option<f64>,

    /// Output directory [default: results/<UTC timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// The myelin binary to run router legs with [default: this executable].
    #[arg(long, value_name = "PATH")]
    pub router_bin: Option<PathBuf>,

    /// An extra `myelin serve` flag for every myelin router leg, e.g.
    /// `--router-arg=--pending-resident-ms=0` (repeatable; replaces the harness's own setting
    /// of the same flag).
    #[arg(long = "router-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub router_args: Vec<String>,

    /// `myelin serve` nodes per myelin router leg, all in front of the same engines: closed-loop
    /// user u sends to node u % N, open-loop and trace request i to node i % N. With N > 1 the
    /// nodes form a peer cluster over UDP gossip on loopback (a random key in the output
    /// directory) unless --no-gossip.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub router_nodes: u32,

    /// With --router-nodes above 1: run the nodes independently, without gossip.
    #[arg(long)]
    pub no_gossip: bool,

    /// Wall-clock seconds one request may take before it counts as an error.
    #[arg(long, default_value_t = 300)]
    pub request_timeout: u64,

    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,

    /// Also the regression gates CI runs: prefix+off's TTFT P99 below round-robin's,
    /// prefix+auto's not above prefix+off's beyond the measured spread, prefix+auto
    /// downgrades, and the harness's loop lag below 10% of every leg's P99 (its failure alone
    /// exits 3, "machine too busy"). Needs legs round-robin, prefix+off and prefix+auto.
    #[arg(long)]
    pub ci_gates: bool,

    /// Legs that measure the residency estimate's calibration against the simulator's truth
    /// (reliability tables, Brier scores, predicted vs reported cached tokens): auto = the
    /// legs whose router runs the estimate (prefix+estimate, prefix+auto), on = every myelin
    /// router leg, off = none. Token-id prompts only.
    #[arg(long, value_enum, default_value_t = crate::calibration::CalibrationMode::Auto)]
    pub calibration: crate::calibration::CalibrationMode,

    /// No probe of the engines at each send for whether the request's reusable prefix is
    /// resident somewhere (the regime line's share; the probe reads the simulator in process,
    /// before the request's clock starts, at some 0.2 ms of the load generator's thread).
    #[arg(long)]
    pub no_resident_share: bool,

    /// Calibration samples one request in this many (drawn from the seed; 1 = every request,
    /// for pooled calibration runs, at some 200 us of the load generator's thread per request
    /// against 50 us with the default).
    #[arg(long, default_value_t = crate::calibration::SAMPLE_EVERY,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub calibration_every: u64,
}

/// The benchmarks `myelin bench` runs besides the churn harness.
#[derive(Debug, Clone, clap::Subcommand)]
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum BenchCommand {
    /// Router overhead and scaling on instant engines: req/s, added latency, CPU per request
    /// and shard balance, against the load generator straight to an engine and against
    /// external routers.
    Overhead(crate::overhead::OverheadArgs),
    /// Memory soak (not in CI): churn through the router for --duration seconds (an hour by
    /// default) with its RSS sampled every --sample-interval seconds; PASS when no request
    /// failed and the final RSS is within 10% of its value after the warm-up.
    Soak(crate::soak::SoakArgs),
    /// Pools the residency calibration of several runs' report.json per leg (reliability
    /// tables summed, sampling noise from the pooled pairs and from the runs' spread) and
    /// prints it as markdown, with the refit of the estimate's recalibration map.
    Calibration(crate::calibration::PoolArgs),
    /// The regime grid: working set / KV capacity x offered load x prompt shape, every cell
    /// with the legs least-load, prefix+off and the default (prefix+auto), a verdict per cell
    /// and overall, heatmaps, report.json/md (docs/reference/benchmark.md, "Regime grid").
    Regimes(RegimeArgs),
}

impl BenchArgs {
    /// The workload with `--quick` and every override applied, validated.
    pub fn workload_config(&self) -> Result<WorkloadConfig, WorkloadError> {
        let name = if self.trace.is_some() && self.workload == "churn" {
            "trace"
        } else {
            self.workload.as_str()
        };
        let mut config = WorkloadConfig::load(name)?;
        if self.quick {
            config.apply_quick();
        }
        let invalid = |problem: &str| WorkloadError::Invalid {
            name: config.name.clone(),
            problem: problem.to_string(),
        };
        if let Some(engines) = self.engines {
            config.cluster.engines = engines;
        }
        if let Some(users) = self.users {
            config.users = users;
        }
        if let Some(duration) = self.duration {
            config.duration_s = duration;
            if self.warmup.is_none() && config.warmup_s >= duration {
                config.warmup_s = duration / 10.0;
            }
        }
        if let Some(warmup) = self.warmup {
            config.warmup_s = warmup;
        }
        if !self.engine.is_empty() {
            config.cluster.engines = u32::try_from(self.engine.len()).unwrap_or(u32::MAX);
            // Real engines run in wall time.
            config.cluster.speedup = 1.0;
        }
        if let Some(speedup) = self.speedup {
            config.cluster.speedup = speedup;
        }
        if let Some(profile) = &self.profile {
            config.cluster.profile = profile.clone();
        }
        if let Some(kv_blocks) = self.kv_blocks {
            config.cluster.kv_blocks = kv_blocks;
        }
        if self.no_engine_metrics {
            config.cluster.engine_metrics = false;
        }
        if let Some(seed) = self.seed {
            config.seed = seed;
        }
        if let Some(prompt) = &self.prompt {
            config.prompt = if prompt == "text" {
                PromptFormat::Text
            } else {
                PromptFormat::TokenIds
            };
        }
        if self.rate_fraction.is_some() || self.rate.is_some() {
            let Some(open) = config
                .open_loop
                .as_mut()
                .filter(|_| config.kind.is_poisson())
            else {
                return Err(invalid(
                    "--rate-fraction and --rate need a Poisson workload (churn-open, \
                     shared-prefix-open, multi-turn)",
                ));
            };
            if let Some(fraction) = self.rate_fraction {
                open.rate_fraction = fraction;
                open.rate_rps = None;
            }
            if let Some(rate) = self.rate {
                open.rate_rps = Some(rate);
            }
        }
        let trace_flags =
            self.trace.is_some() || self.time_scale.is_some() || self.max_requests.is_some();
        if trace_flags {
            let Some(trace) = config
                .trace
                .as_mut()
                .filter(|_| config.kind == WorkloadKind::Trace)
            else {
                return Err(invalid(
                    "--trace, --time-scale and --max-requests need a trace workload",
                ));
            };
            if let Some(path) = &self.trace {
                trace.path = Some(path.display().to_string());
            }
            if let Some(time_scale) = self.time_scale {
                trace.time_scale = time_scale;
            }
            if let Some(max_requests) = self.max_requests {
                trace.max_requests = Some(max_requests);
            }
        }
        config.validate()?;
        Ok(config)
    }
}

/// The legs every cell runs by default.
pub const DEFAULT_REGIME_LEGS: &str = "least-load,prefix+off,prefix+auto";

/// `myelin bench regimes` (run by `crate::regimes`; defined here with the other commands, so
/// the command line does not depend on the grid's runner).
/// The regime grid (docs/reference/benchmark.md, "Regime grid").
#[derive(Debug, Clone, clap::Args)]
pub struct RegimeArgs {
    /// The short grid: working sets 0.5, 1.5 and 3x at 60% load on rotating, all-active and
    /// shared-system (9 cells, under 30 minutes on a 2-core machine with the default legs and 3
    /// repeats). Without it: the full grid (5 shapes x working sets 0.3, 0.7, 1, 1.5, 3 x loads
    /// 0.3, 0.6, 0.9: 75 cells, about 4 hours).
    #[arg(long)]
    pub quick: bool,

    /// Shapes, comma-separated: rotating, all-active, shared-system, multi-turn, trace
    /// [quick: the first three; full: all].
    #[arg(long)]
    pub shapes: Option<String>,

    /// Working set / KV capacity ratios, comma-separated [quick: 0.5,1.5,3; full:
    /// 0.3,0.7,1,1.5,3].
    #[arg(long, value_name = "RATIOS")]
    pub working_sets: Option<String>,

    /// Offered loads as fractions of the cluster's capacity, comma-separated [quick: 0.6;
    /// full: 0.3,0.6,0.9].
    #[arg(long, value_name = "FRACTIONS")]
    pub loads: Option<String>,

    /// Only the cells whose name matches one of these patterns (comma-separated, `*` matches
    /// anything), e.g. `rotating-*,*-ws3-load60`. Cell names: SHAPE-wsRATIO-loadPERCENT.
    #[arg(long, value_name = "PATTERNS")]
    pub cells: Option<String>,

    /// Legs every cell runs (the verdict needs least-load, prefix+off and prefix+auto).
    #[arg(long, default_value = DEFAULT_REGIME_LEGS)]
    pub legs: String,

    /// An external router leg for every cell, NAME='COMMAND {port} {backends}' (repeatable; as
    /// `myelin bench --external`). The SGLang gateway needs text prompts: add `--prompt text`.
    #[arg(long = "external", value_name = "NAME=COMMAND")]
    pub external: Vec<String>,

    /// Run every leg of every cell this many times (the verdict reads medians).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,

    /// Simulated seconds of traffic for every cell [default: per cell, the warm-up plus
    /// --requests-per-leg at the cell's rate, within 60 and 120 s]; trace cells replay the
    /// whole slice whatever this is.
    #[arg(long, value_name = "SECONDS")]
    pub duration: Option<f64>,

    /// Simulated seconds at the start of each leg left out of the statistics (at most a fifth
    /// of the duration; trace cells: a tenth of the replay).
    #[arg(long, value_name = "SECONDS", default_value_t = crate::regimes::grid::WARMUP_S)]
    pub warmup: f64,

    /// Measured requests per leg run a cell's duration aims at.
    #[arg(long, value_name = "N", default_value_t = crate::regimes::grid::TARGET_REQUESTS)]
    pub requests_per_leg: f64,

    /// One speedup for every cell [default: per cell, the highest up to --max-speedup at which
    /// the cell offers at most --max-wall-rps requests per wall second].
    #[arg(long)]
    pub speedup: Option<f64>,

    /// Most requests per wall second a cell may offer when its speedup is chosen.
    #[arg(long, default_value_t = 50.0, value_name = "RPS")]
    pub max_wall_rps: f64,

    /// Highest speedup a cell is given.
    #[arg(long, default_value_t = 10.0)]
    pub max_speedup: f64,

    /// Simulated engines per cell.
    #[arg(long, default_value_t = 8)]
    pub engines: u32,

    /// Seed of every workload draw [the shapes' default: 42].
    #[arg(long)]
    pub seed: Option<u64>,

    /// Trace cells replay this Mooncake-format JSONL file (one request a line: `timestamp`,
    /// `input_length`, `output_length`, `hash_ids`) instead of the built-in 300-request slice,
    /// e.g. benches/data/mooncake-1200.jsonl.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,

    /// Trace cells replay only the first N requests of the trace.
    #[arg(long, value_name = "N")]
    pub trace_requests: Option<u32>,

    /// Prompt format for every cell: token-ids or text (text for external legs such as the
    /// SGLang gateway, which take text only).
    #[arg(long, value_parser = ["token-ids", "text"])]
    pub prompt: Option<String>,

    /// Also rerun the cells matching these patterns (comma-separated, `*` wildcard; `all` for
    /// every selected cell) at twice their duration, and compare their verdicts (trace cells
    /// replay the slice once and are left out).
    #[arg(long, value_name = "PATTERNS")]
    pub duration_check: Option<String>,

    /// Print each cell's plan (KV blocks, capacity, rate, speedup, the time it will take) and
    /// the total, and exit without running anything.
    #[arg(long)]
    pub plan: bool,

    /// Keep the cells whose report.json is already in --out and whose workload.json is the one
    /// this grid plans (an interrupted grid resumes; a cell planned differently reruns).
    #[arg(long)]
    pub resume: bool,

    /// Output directory [default: results/regimes-<UTC timestamp>].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,

    /// The myelin binary to run router legs with [default: this executable].
    #[arg(long, value_name = "PATH")]
    pub router_bin: Option<PathBuf>,

    /// An extra `myelin serve` flag for every myelin router leg (repeatable).
    #[arg(long = "router-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub router_args: Vec<String>,

    /// Wall-clock seconds one request may take before it counts as an error.
    #[arg(long, default_value_t = 300)]
    pub request_timeout: u64,

    /// Residency calibration in every cell, as `myelin bench --calibration` [default: off, the
    /// verdict does not read it]; with `--legs prefix+estimate` and several `--seed`s, the
    /// cells' report.json pool in `myelin bench calibration` (a recalibration fit across
    /// regimes).
    #[arg(long, value_enum, default_value_t = crate::calibration::CalibrationMode::Off)]
    pub calibration: crate::calibration::CalibrationMode,

    /// Calibration samples one request in this many, as `myelin bench --calibration-every`.
    #[arg(long, default_value_t = crate::calibration::SAMPLE_EVERY,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub calibration_every: u64,

    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Harness {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(flags: &[&str]) -> BenchArgs {
        Harness::parse_from(std::iter::once("bench").chain(flags.iter().copied())).args
    }

    #[test]
    fn overhead_is_a_subcommand_and_the_churn_flags_stay_top_level() {
        let args = parse(&["overhead", "--quick", "--router-cores", "1"]);
        match args.command {
            Some(BenchCommand::Overhead(overhead)) => {
                assert!(overhead.quick);
                assert_eq!(overhead.router_cores, "1");
            }
            _ => panic!("not the overhead subcommand"),
        }
        let churn = parse(&["--quick", "--legs", "oracle"]);
        assert!(churn.command.is_none());
        assert!(churn.quick);
        assert!(
            Harness::try_parse_from(["bench", "--legs", "oracle", "overhead"]).is_err(),
            "churn flags do not combine with the overhead subcommand"
        );
    }

    #[test]
    fn no_flags_is_the_default_churn_comparison() {
        let args = parse(&[]);
        assert_eq!(args.legs, DEFAULT_LEGS);
        let config = args.workload_config().unwrap();
        assert_eq!(config.name, "churn");
        assert_eq!(config.users, 60);
        assert!(
            config.cluster.engine_metrics,
            "engines serve metrics unless told not to"
        );
    }

    #[test]
    fn flags_override_the_file_and_quick() {
        let config = parse(&[
            "--quick",
            "--users",
            "12",
            "--engines",
            "3",
            "--duration",
            "20",
            "--speedup",
            "5",
            "--no-engine-metrics",
        ])
        .workload_config()
        .unwrap();
        assert!(!config.cluster.engine_metrics);
        assert_eq!((config.users, config.cluster.engines), (12, 3));
        assert_eq!(config.duration_s, 20.0);
        // The quick warm-up (30 s) would swallow a 20 s leg: it shrinks to a tenth.
        assert_eq!(config.warmup_s, 2.0);
        assert_eq!(config.cluster.speedup, 5.0);
    }

    #[test]
    fn external_engines_set_the_count_and_wall_time() {
        let config = parse(&[
            "--engine",
            "http://a:1",
            "--engine",
            "http://b:2,capacity-tokens=64",
        ])
        .workload_config()
        .unwrap();
        assert_eq!((config.cluster.engines, config.cluster.speedup), (2, 1.0));
        let sped = parse(&["--engine", "http://a:1", "--speedup", "10"])
            .workload_config()
            .unwrap();
        assert_eq!(sped.cluster.speedup, 10.0);
        let bad = Harness::try_parse_from(["bench", "--engine", "a:1"])
            .err()
            .unwrap();
        assert!(bad.to_string().contains("http://"), "{bad}");
        assert!(
            Harness::try_parse_from(["bench", "--engine", "http://a:1", "--engines", "3"]).is_err(),
            "simulated and external engines do not mix"
        );
    }

    #[test]
    fn trace_flags_select_and_shape_the_trace_workload() {
        let config = parse(&[
            "--trace",
            "x.jsonl",
            "--max-requests",
            "10",
            "--time-scale",
            "0.5",
        ])
        .workload_config()
        .unwrap();
        assert_eq!(config.kind, WorkloadKind::Trace);
        let trace = config.trace.unwrap();
        assert_eq!(trace.path.as_deref(), Some("x.jsonl"));
        assert_eq!((trace.max_requests, trace.time_scale), (Some(10), 0.5));
        assert!(
            parse(&["--workload", "shared-prefix", "--max-requests", "3"])
                .workload_config()
                .is_err()
        );
    }

    #[test]
    fn rate_flags_shape_the_open_loop_churn() {
        let config = parse(&["--workload", "churn-open", "--rate-fraction", "0.5"])
            .workload_config()
            .unwrap();
        let open = config.open_loop.unwrap();
        assert_eq!((open.rate_fraction, open.rate_rps), (0.5, None));
        let config = parse(&["--workload", "churn-open", "--rate", "3"])
            .workload_config()
            .unwrap();
        assert_eq!(config.open_loop.unwrap().rate_rps, Some(3.0));
        assert!(parse(&["--rate", "3"]).workload_config().is_err());
        assert!(
            parse(&["--workload", "churn-open", "--rate-fraction=-1"])
                .workload_config()
                .is_err()
        );
    }
}
