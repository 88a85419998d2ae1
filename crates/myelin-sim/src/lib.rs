//! Simulated vLLM engine: scheduler, KV block pool, OpenAI API, real-format KV events.

/// Command-line arguments (placeholder until the crate lands).
#[derive(Debug, clap::Args)]
pub struct SimArgs {}

/// Runs the command.
pub fn run(_args: SimArgs) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    Err("not implemented yet".into())
}
