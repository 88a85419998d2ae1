//! glommio data plane and control core of the myelin router.

/// Command-line arguments (placeholder until the crate lands).
#[derive(Debug, clap::Args)]
pub struct ServeArgs {}

/// Runs the command.
pub fn run(_args: ServeArgs) -> Result<std::process::ExitCode, Box<dyn std::error::Error>> {
    Err("not implemented yet".into())
}
