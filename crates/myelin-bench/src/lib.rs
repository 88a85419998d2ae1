//! Churn harness (`myelin bench`): workloads, traffic replay, legs, reports and plots; and the
//! router overhead and scaling benchmark (`myelin bench overhead`, module [`overhead`]).
//!
//! A run sends the same workload through several router configurations ("legs"), each on a
//! fresh embedded simulated cluster, and compares TTFT, throughput, cache hit rate and
//! residency downgrades, with validity gates. docs/benchmark.md and docs/reference/benchmark.md
//! are the user guide.

pub mod blocking_http;
pub mod calibration;
pub mod capacity;
pub mod cli;
pub mod cluster;
pub mod engine_tokens;
pub mod engines;
pub mod gates;
pub mod kv_watch;
pub mod legs;
pub mod loadgen;
pub mod oracle;
pub mod overhead;
pub mod plot;
pub mod prometheus;
pub mod record;
pub mod regime;
pub mod regimes;
pub mod report;
pub mod request_body;
pub mod rng;
pub mod router_process;
pub mod runner;
pub mod soak;
pub mod stats;
pub mod stream;
pub mod workload;

pub use cli::{BenchArgs, BenchCommand};

/// Runs `myelin bench`: exit status 0 when every validity gate passed, 1 when a gate failed.
/// `myelin bench overhead`: 0 unless a request failed or a leg could not run (see
/// [`overhead::run`]). `myelin bench soak`: 0 on PASS, 1 on FAIL (see [`soak`]). `myelin bench
/// regimes`: 0 when every cell met its targets, 1 when one did not (see [`regimes`]).
pub fn run(args: BenchArgs) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    match args.command {
        Some(BenchCommand::Overhead(overhead)) => overhead::run(overhead).map_err(Into::into),
        Some(BenchCommand::Soak(soak)) => soak::run(soak).map_err(Into::into),
        Some(BenchCommand::Calibration(pool)) => calibration::run_pool(&pool).map_err(Into::into),
        Some(BenchCommand::Regimes(regimes)) => regimes::run(regimes).map_err(Into::into),
        None => runner::run(args).map_err(Into::into),
    }
}
