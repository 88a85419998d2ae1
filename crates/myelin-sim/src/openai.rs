//! The OpenAI-compatible request bodies the simulator accepts and the JSON it answers with, in
//! vLLM's exact shapes (field names, `null`s, chunk sequence, usage with cached tokens).

use serde::Serialize;
use serde_json::{Value, json};

use crate::text::{TextError, TextModel};

/// Which endpoint a generation request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

/// A parsed generation request.
#[derive(Clone, Debug)]
pub struct GenerationRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// Model name as sent (echoed back; any name is accepted).
    pub model: Option<String>,
    /// One token sequence per choice (several only for a batched `/v1/completions` prompt).
    pub prompts: Vec<Vec<u32>>,
    /// `max_tokens` / `max_completion_tokens`.
    pub max_tokens: Option<usize>,
    /// vLLM's `ignore_eos`.
    pub ignore_eos: bool,
    /// SSE streaming.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// vLLM's `cache_salt` (an empty one is none, as in vLLM).
    pub cache_salt: Option<String>,
}

/// A request the simulator refuses (400, vLLM's wording where it has one).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or not an object.
    #[error("invalid JSON body: {0}")]
    Json(String),
    /// A field has the wrong type or value.
    #[error("{0}")]
    Field(String),
    /// Tokenisation or template rendering failed.
    #[error(transparent)]
    Text(#[from] TextError),
}

impl GenerationRequest {
    /// Parses and tokenises a request body.
    pub fn parse(endpoint: Endpoint, body: &[u8], text: &TextModel) -> Result<Self, RequestError> {
        let value: Value =
            serde_json::from_slice(body).map_err(|error| RequestError::Json(error.to_string()))?;
        let object = value
            .as_object()
            .ok_or_else(|| RequestError::Json("the body must be a JSON object".to_string()))?;
        let prompts = match endpoint {
            Endpoint::Completions => {
                let prompt = object
                    .get("prompt")
                    .ok_or_else(|| RequestError::Field("'prompt' is required".to_string()))?;
                completion_prompts(prompt, text)?
            }
            Endpoint::ChatCompletions => {
                let messages = object
                    .get("messages")
                    .filter(|messages| messages.as_array().is_some_and(|list| !list.is_empty()))
                    .ok_or_else(|| {
                        RequestError::Field("'messages' must be a non-empty list".to_string())
                    })?;
                let tools = object.get("tools").filter(|tools| !tools.is_null());
                vec![text.encode_chat_with_tools(messages, tools)?]
            }
        };
        if prompts.iter().any(Vec::is_empty) {
            return Err(RequestError::Field(
                "The prompt cannot be empty.".to_string(),
            ));
        }
        let max_tokens = match object
            .get("max_completion_tokens")
            .filter(|value| !value.is_null())
            .or_else(|| object.get("max_tokens").filter(|value| !value.is_null()))
        {
            None => None,
            Some(value) => match value.as_u64() {
                Some(count) if count >= 1 => Some(usize::try_from(count).unwrap_or(usize::MAX)),
                _ => {
                    return Err(RequestError::Field(
                        "max_tokens must be at least 1".to_string(),
                    ));
                }
            },
        };
        if let Some(n) = object.get("n").and_then(Value::as_u64)
            && n != 1
        {
            return Err(RequestError::Field(
                "the simulator supports n = 1 only".to_string(),
            ));
        }
        let flag = |name: &str| object.get(name).and_then(Value::as_bool).unwrap_or(false);
        let include_usage = object
            .get("stream_options")
            .and_then(|options| options.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let cache_salt = match object.get("cache_salt") {
            None | Some(Value::Null) => None,
            Some(Value::String(salt)) => Some(salt.clone()).filter(|salt| !salt.is_empty()),
            Some(_) => {
                return Err(RequestError::Field(
                    "cache_salt must be a string".to_string(),
                ));
            }
        };
        Ok(GenerationRequest {
            endpoint,
            cache_salt,
            model: object
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string),
            prompts,
            max_tokens,
            ignore_eos: flag("ignore_eos"),
            stream: flag("stream"),
            include_usage,
        })
    }
}

/// `prompt` of `/v1/completions`: a string, a list of strings, a list of token ids, or a list
/// of lists of token ids.
fn completion_prompts(prompt: &Value, text: &TextModel) -> Result<Vec<Vec<u32>>, RequestError> {
    let invalid = || {
        RequestError::Field(
            "'prompt' must be a string, a list of strings, a list of token ids or a list of \
             lists of token ids"
                .to_string(),
        )
    };
    match prompt {
        Value::String(single) => Ok(vec![text.encode_prompt(single)?]),
        Value::Array(items) if items.is_empty() => Err(invalid()),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|item| Ok(text.encode_prompt(item.as_str().unwrap_or_default())?))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_number) => {
            Ok(vec![token_ids(items).ok_or_else(invalid)?])
        }
        Value::Array(items) => items
            .iter()
            .map(|item| {
                item.as_array()
                    .and_then(|ids| token_ids(ids))
                    .ok_or_else(invalid)
            })
            .collect(),
        _ => Err(invalid()),
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|item| item.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

/// Token counts of a finished request (summed over choices).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
}

/// vLLM's `usage` object, fields in vLLM's order.
#[derive(Serialize)]
struct UsageJson {
    prompt_tokens: usize,
    total_tokens: usize,
    completion_tokens: usize,
    prompt_tokens_details: PromptTokensDetails,
}

#[derive(Serialize)]
struct PromptTokensDetails {
    cached_tokens: usize,
}

impl Usage {
    fn json(self) -> UsageJson {
        UsageJson {
            prompt_tokens: self.prompt_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
            completion_tokens: self.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.cached_tokens,
            },
        }
    }
}

/// Response identity: id, creation time and model name, shared by all chunks of a response.
#[derive(Clone, Debug)]
pub struct ResponseHead {
    /// `cmpl-...` or `chatcmpl-...`.
    pub id: String,
    /// UNIX seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
}

/// One finished choice of a non-streaming response.
#[derive(Clone, Debug)]
pub struct FinishedChoice {
    /// Choice index.
    pub index: usize,
    /// Generated text.
    pub text: String,
    /// `stop` or `length`.
    pub finish_reason: &'static str,
}

/// Serialises a response struct. These structs hold only strings, numbers and nulls, which
/// always serialise; an empty object stands in for the impossible failure.
fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "{}".to_string())
}

/// Always serialises as `null` (vLLM's unset optional fields).
type Null = Option<()>;

#[derive(Serialize)]
struct CompletionResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<CompletionChoice<'a>>,
    service_tier: Null,
    system_fingerprint: Null,
    usage: UsageJson,
    kv_transfer_params: Null,
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: usize,
    text: &'a str,
    logprobs: Null,
    finish_reason: Option<&'a str>,
    stop_reason: Null,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Null>,
}

/// Non-streaming `/v1/completions` response.
pub fn completion_response(
    head: &ResponseHead,
    choices: &[FinishedChoice],
    usage: Usage,
) -> String {
    to_json(&CompletionResponse {
        id: &head.id,
        object: "text_completion",
        created: head.created,
        model: &head.model,
        choices: choices
            .iter()
            .map(|choice| CompletionChoice {
                index: choice.index,
                text: &choice.text,
                logprobs: None,
                finish_reason: Some(choice.finish_reason),
                stop_reason: None,
                prompt_logprobs: Some(None),
            })
            .collect(),
        service_tier: None,
        system_fingerprint: None,
        usage: usage.json(),
        kv_transfer_params: None,
    })
}

#[derive(Serialize)]
struct ChatResponse<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChoice<'a>; 1],
    service_tier: Null,
    system_fingerprint: Null,
    usage: UsageJson,
    prompt_logprobs: Null,
    kv_transfer_params: Null,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: usize,
    message: ChatMessage<'a>,
    logprobs: Null,
    finish_reason: &'a str,
    stop_reason: Null,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
    refusal: Null,
    annotations: Null,
    audio: Null,
    function_call: Null,
    tool_calls: [(); 0],
    reasoning_content: Null,
}

/// Non-streaming `/v1/chat/completions` response.
pub fn chat_response(head: &ResponseHead, choice: &FinishedChoice, usage: Usage) -> String {
    to_json(&ChatResponse {
        id: &head.id,
        object: "chat.completion",
        created: head.created,
        model: &head.model,
        choices: [ChatChoice {
            index: choice.index,
            message: ChatMessage {
                role: "assistant",
                content: &choice.text,
                refusal: None,
                annotations: None,
                audio: None,
                function_call: None,
                tool_calls: [],
                reasoning_content: None,
            },
            logprobs: None,
            finish_reason: choice.finish_reason,
            stop_reason: None,
        }],
        service_tier: None,
        system_fingerprint: None,
        usage: usage.json(),
        prompt_logprobs: None,
        kv_transfer_params: None,
    })
}

/// A streamed `/v1/completions` chunk or its final usage chunk (vLLM serialises every field).
#[derive(Serialize)]
struct CompletionChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<CompletionChoice<'a>>,
    usage: Option<UsageJson>,
}

/// A streamed `/v1/completions` chunk (`usage: null` included, as vLLM does).
pub fn completion_chunk(
    head: &ResponseHead,
    index: usize,
    text: &str,
    finish_reason: Option<&str>,
) -> String {
    to_json(&CompletionChunk {
        id: &head.id,
        object: "text_completion",
        created: head.created,
        model: &head.model,
        choices: vec![CompletionChoice {
            index,
            text,
            logprobs: None,
            finish_reason,
            stop_reason: None,
            prompt_logprobs: None,
        }],
        usage: None,
    })
}

/// The final usage chunk of a streamed `/v1/completions` (`stream_options.include_usage`).
pub fn completion_usage_chunk(head: &ResponseHead, usage: Usage) -> String {
    to_json(&CompletionChunk {
        id: &head.id,
        object: "text_completion",
        created: head.created,
        model: &head.model,
        choices: Vec::new(),
        usage: Some(usage.json()),
    })
}

/// A streamed chat chunk. vLLM serialises these with `exclude_unset`: `usage` only on the usage
/// chunk, `stop_reason` only with the finish reason, `role` only on the first delta.
#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Vec<ChatChunkChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageJson>,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: usize,
    delta: Delta<'a>,
    logprobs: Null,
    finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Null>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

fn chat_chunk<'a>(
    head: &'a ResponseHead,
    choice: Option<ChatChunkChoice<'a>>,
    usage: Option<Usage>,
) -> String {
    to_json(&ChatChunk {
        id: &head.id,
        object: "chat.completion.chunk",
        created: head.created,
        model: &head.model,
        choices: choice.into_iter().collect(),
        usage: usage.map(Usage::json),
    })
}

/// The first streamed chat chunk: the assistant role with empty content.
pub fn chat_role_chunk(head: &ResponseHead, index: usize) -> String {
    let choice = ChatChunkChoice {
        index,
        delta: Delta {
            role: Some("assistant"),
            content: "",
        },
        logprobs: None,
        finish_reason: None,
        stop_reason: None,
    };
    chat_chunk(head, Some(choice), None)
}

/// A streamed chat content chunk; the last one carries `finish_reason` and `stop_reason`.
pub fn chat_content_chunk(
    head: &ResponseHead,
    index: usize,
    text: &str,
    finish_reason: Option<&str>,
) -> String {
    let choice = ChatChunkChoice {
        index,
        delta: Delta {
            role: None,
            content: text,
        },
        logprobs: None,
        finish_reason,
        stop_reason: finish_reason.map(|_| None),
    };
    chat_chunk(head, Some(choice), None)
}

/// The final usage chunk of a streamed chat.
pub fn chat_usage_chunk(head: &ResponseHead, usage: Usage) -> String {
    chat_chunk(head, None, Some(usage))
}

/// vLLM's error body.
pub fn error_body(message: &str, error_type: &str, code: u16) -> Value {
    json!({
        "error": {
            "message": message,
            "type": error_type,
            "param": null,
            "code": code,
        }
    })
}

/// `GET /v1/models`: the model, then each LoRA adapter with the model as its parent (as vLLM
/// lists adapters loaded with `--lora-modules` or `/v1/load_lora_adapter`).
pub fn models_response(
    model: &str,
    adapters: &[String],
    created: u64,
    max_model_len: usize,
) -> Value {
    let card = |id: &str, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": id,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{id}"),
                "object": "model_permission",
                "created": created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    };
    let data: Vec<Value> = std::iter::once(card(model, None))
        .chain(adapters.iter().map(|adapter| card(adapter, Some(model))))
        .collect();
    json!({"object": "list", "data": data})
}

/// One SSE event carrying the JSON text `json`.
pub fn sse_data(json: &str) -> String {
    format!("data: {json}\n\n")
}

/// The SSE stream terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";
