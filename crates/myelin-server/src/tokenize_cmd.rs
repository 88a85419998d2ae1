//! `myelin tokenize`: the token ids the router routes a request by, without starting it.
//!
//! The router's prefixes are only worth anything if its ids are the engine's. The running
//! router compares counts (`myelin_tokenization_mismatch_total`); this command prints the ids
//! themselves for one request body, rendered and tokenized by the same code `myelin serve`
//! uses (the same tokenizer loading, fast path and added-token split, the same chat template
//! renderer), so they can be compared id by id with an engine's own `POST /tokenize`.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use serde_json::json;

use crate::TokenizerParts;
use crate::config::DEFAULT_TOKENIZE_CACHE_BYTES;
use crate::openai::{Endpoint, parse_generation_request};
use crate::route_tokens::RouteTokenizer;

/// Which API the body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Api {
    /// `/v1/chat/completions` (`messages`, rendered with the chat template).
    Chat,
    /// `/v1/completions` (`prompt`).
    Completions,
}

/// `myelin tokenize`: prints the ids the router routes a request body by.
#[derive(Debug, Clone, Args)]
pub struct TokenizeArgs {
    /// The request body (JSON, as sent to the router); `-` reads it from stdin.
    #[arg(value_name = "FILE", default_value = "-")]
    pub body: PathBuf,

    /// The API the body is for. [default: chat when the body has `messages`, else completions]
    #[arg(long, value_enum)]
    pub api: Option<Api>,

    /// tokenizer.json of the served model, as given to `myelin serve`. [default: the bundled
    /// deepseek-v3 tokenizer]
    #[arg(long, env = "MYELIN_TOKENIZER", value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,

    /// Chat template, as given to `myelin serve` (tokenizer_config.json or a .jinja file).
    /// [default: ChatML]
    #[arg(long, env = "MYELIN_CHAT_TEMPLATE", value_name = "PATH")]
    pub chat_template: Option<PathBuf>,

    /// Tokenize with HuggingFace `tokenizers` only, as `myelin serve --no-fast-tokenizer`.
    #[arg(long)]
    pub no_fast_tokenizer: bool,
}

/// Runs `myelin tokenize`: one JSON object on stdout, `{"api", "ids", "count", "complete"}`
/// (plus `"text"`, the rendered prompt, for a chat). A body the router would refuse is refused
/// here with the router's error body and exit status 1.
pub fn run(args: TokenizeArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let body = if args.body.as_os_str() == "-" {
        let mut body = Vec::new();
        std::io::stdin().read_to_end(&mut body)?;
        body
    } else {
        std::fs::read(&args.body).map_err(|error| format!("{}: {error}", args.body.display()))?
    };
    let api = args.api.unwrap_or_else(|| {
        let has_messages = serde_json::from_slice::<serde_json::Value>(&body)
            .is_ok_and(|value| value.get("messages").is_some());
        if has_messages {
            Api::Chat
        } else {
            Api::Completions
        }
    });
    let endpoint = match api {
        Api::Chat => Endpoint::ChatCompletions,
        Api::Completions => Endpoint::Completions,
    };
    let request = match parse_generation_request(endpoint, &body) {
        Ok(request) => request,
        Err(error) => {
            println!("{}", error.to_json());
            return Ok(ExitCode::FAILURE);
        }
    };
    let parts = TokenizerParts::load(
        args.tokenizer.as_deref(),
        args.chat_template.as_deref(),
        !args.no_fast_tokenizer,
        |note| eprintln!("{note}"),
    )?;
    // The serving configuration's caches, no bound on the work: the whole prompt.
    let mut tokenizer = RouteTokenizer::new(
        parts.tokenizer,
        parts.fast,
        Arc::clone(&parts.template),
        parts.added_tokens,
        DEFAULT_TOKENIZE_CACHE_BYTES,
        1,
    )
    .with_limits(0, 0);
    let tools =
        match crate::openai::template_tools(&request, &body, tokenizer.template_uses_tools()) {
            Ok(tools) => tools,
            Err(error) => {
                println!("{}", error.to_json());
                return Ok(ExitCode::FAILURE);
            }
        };
    let rendered = tokenizer.render_with_tools(&request.prompt, tools.as_ref())?;
    let tokens = tokenizer.tokens(&rendered, None)?;
    let mut out = json!({
        "api": match api { Api::Chat => "chat", Api::Completions => "completions" },
        "count": tokens.ids.len(),
        "complete": tokens.complete,
        "ids": tokens.ids,
    });
    if let (Api::Chat, crate::route_tokens::RenderedPrompt::Text { text, .. }) = (api, &rendered) {
        out["text"] = json!(text);
    }
    println!("{out}");
    Ok(ExitCode::SUCCESS)
}
