//! Churn harness: workloads, traffic replay, legs, reports and plots.

/// Command-line arguments (placeholder until the crate lands).
#[derive(Debug, clap::Args)]
pub struct BenchArgs {}

/// Runs the command.
pub fn run(_args: BenchArgs) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    Err("not implemented yet".into())
}
