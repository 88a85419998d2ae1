//! The single `myelin` binary: dispatches to the router, the simulated engine and the harness.

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// mimalloc rather than the system allocator: the request path (tokenization above all)
/// allocates many small objects per request; see docs/performance.md for the figures.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "myelin",
    version,
    about = "KV-cache-aware router for LLM serving",
    arg_required_else_help = true
)]
struct Cli {
    /// Print the licenses of the third-party files embedded in this binary (the bundled
    /// DeepSeek-V3 tokenizer, the plots' DejaVu Sans font) and exit.
    #[arg(long, exclusive = true)]
    licenses: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

/// The license of the font `myelin bench` draws its plots with (embedded by myelin-bench).
const FONT_LICENSE: &str = include_str!("../../../assets/fonts/LICENSE");

/// What `myelin --licenses` prints.
fn licenses() -> String {
    format!(
        "myelin is licensed under {}.\n\
         \n\
         It embeds third-party files, under these licenses:\n\
         \n\
         == {} ({}) ==\n\n{}\n\
         == DejaVu Sans (assets/fonts/DejaVuSans.ttf), used in `myelin bench` plots ==\n\n{}",
        env!("CARGO_PKG_LICENSE"),
        myelin_tokenize::BUNDLED_TOKENIZER_NAME,
        myelin_tokenize::BUNDLED_TOKENIZER_RELATIVE,
        myelin_tokenize::BUNDLED_TOKENIZER_LICENSE.trim_end(),
        FONT_LICENSE.trim_end(),
    )
}

#[derive(Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "one value, parsed once at startup: its size costs nothing"
)]
enum Command {
    /// Run the router in front of inference engines.
    Serve(myelin_server::ServeArgs),
    /// Run simulated vLLM engines.
    Sim(myelin_sim::SimArgs),
    /// Run the churn harness: identical traffic through several router configurations.
    Bench(myelin_bench::BenchArgs),
    /// Print the token ids the router routes a request body by (compare them with an
    /// engine's POST /tokenize).
    Tokenize(myelin_server::tokenize_cmd::TokenizeArgs),
}

fn main() -> ExitCode {
    // `myelin serve --config FILE`: the file's keys are the serve flags' defaults.
    let cli: Cli =
        match myelin_server::config::parse_command_line(std::env::args_os(), Some("serve")) {
            Ok(cli) => cli,
            Err(myelin_server::config::ConfigError::Cli(error)) => error.exit(),
            Err(error) => {
                eprintln!("myelin: error: {error}");
                return ExitCode::FAILURE;
            }
        };
    let result = match cli.command {
        Some(Command::Serve(args)) => myelin_server::run(args),
        Some(Command::Sim(args)) => myelin_sim::run(args),
        Some(Command::Bench(args)) => myelin_bench::run(args),
        Some(Command::Tokenize(args)) => myelin_server::tokenize_cmd::run(args),
        None if cli.licenses => {
            println!("{}", licenses());
            return ExitCode::SUCCESS;
        }
        None => {
            // Unreachable through clap (`arg_required_else_help`), kept total.
            let _ = Cli::command().print_help();
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("myelin: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
