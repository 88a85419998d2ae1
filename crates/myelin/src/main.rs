//! The single `myelin` binary: dispatches to the router, the simulated engine and the harness.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc rather than the system allocator: the request path (tokenization above all)
/// allocates many small objects per request; see docs/performance.md for the figures.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "myelin",
    version,
    about = "KV-cache-aware router for LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router in front of inference engines.
    Serve(myelin_server::ServeArgs),
    /// Run simulated vLLM engines.
    Sim(myelin_sim::SimArgs),
    /// Run the churn harness: identical traffic through several router configurations.
    Bench(myelin_bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => myelin_server::run(args),
        Command::Sim(args) => myelin_sim::run(args),
        Command::Bench(args) => myelin_bench::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("myelin: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
