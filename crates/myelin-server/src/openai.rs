//! OpenAI request validation (what routing needs from a body) and the OpenAI error JSON shape.
//!
//! The router never rewrites a request body: it validates the fields it must understand
//! (`model`, `messages`/`prompt`, `stream`) and forwards the original bytes unchanged. It
//! refuses the few engine options that would corrupt state it shares between clients
//! (`vllm_xargs.kv_cache_report_mode`).

use http::StatusCode;
use serde_json::{Map, Value};

/// The two generation endpoints the router understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// What the router tokenizes for routing (defined beside the tokenizer that renders it).
pub use myelin_tokenize::route::PromptInput;

/// A validated generation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationRequest {
    pub endpoint: Endpoint,
    pub model: String,
    pub stream: bool,
    pub prompt: PromptInput,
    /// `max_tokens` / `max_completion_tokens`, when given (used to estimate decode load).
    pub max_tokens: Option<u64>,
    /// A completion request with several prompts (`prompt` is only the first; the engine's
    /// `usage.prompt_tokens` counts them all).
    pub batch: bool,
    /// The answer carries `usage`: not streaming, or `stream_options.include_usage`.
    pub usage_expected: bool,
    /// vLLM's `cache_salt`: the engine shares cached blocks only between requests of the same
    /// salt, so the router keys the prompt by it too.
    pub cache_salt: Option<String>,
}

/// An error returned to the client in OpenAI's shape:
/// `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub error_type: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid_request(
        message: impl Into<String>,
        param: Option<&str>,
        code: &'static str,
    ) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            error_type: "invalid_request_error",
            param: param.map(str::to_string),
            code: Some(code),
        }
    }

    pub fn not_found(method: &str, path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("Unknown request URL: {method} {path}"),
            error_type: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
        }
    }

    /// The prompt could not be tokenized for routing.
    pub fn tokenize(error: &crate::route_tokens::RouteTokensError) -> Self {
        ApiError::invalid_request(
            format!("cannot tokenize the prompt: {error}"),
            None,
            "invalid_prompt",
        )
    }

    /// No backend lists `model` in its `GET /v1/models` (OpenAI's answer to an unknown model).
    pub fn model_not_found(model: &str) -> Self {
        let shown: String = model.chars().take(256).collect();
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "The model `{shown}` does not exist: no backend serves it (GET /v1/models lists the models served)"
            ),
            error_type: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    pub fn method_not_allowed(method: &str, path: &str, allowed: &str) -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("Method {method} not allowed for {path} (allowed: {allowed})"),
            error_type: "invalid_request_error",
            param: None,
            code: Some("method_not_allowed"),
        }
    }

    pub fn body_too_large(limit_bytes: usize) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("Request body is larger than the limit of {limit_bytes} bytes"),
            error_type: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// The client did not send its whole body within the body read deadline.
    pub fn body_timeout() -> Self {
        ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            message: "The request body did not arrive in time".into(),
            error_type: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
        }
    }

    pub fn overloaded() -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "The router is at its in-flight limit on this core; retry later".into(),
            error_type: "rate_limit_error",
            param: None,
            code: Some("router_overloaded"),
        }
    }

    /// A body that would take the core past its body-buffer budget.
    pub fn body_budget() -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: "The router is reading as many request bodies as this core may hold; \
                      retry later"
                .into(),
            error_type: "rate_limit_error",
            param: None,
            code: Some("router_overloaded"),
        }
    }

    pub fn no_backend() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "No healthy backend is available".into(),
            error_type: "server_error",
            param: None,
            code: Some("no_backend_available"),
        }
    }

    pub fn draining() -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "The router is shutting down".into(),
            error_type: "server_error",
            param: None,
            code: Some("router_draining"),
        }
    }

    pub fn upstream(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            error_type: "server_error",
            param: None,
            code: Some("upstream_error"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            error_type: "server_error",
            param: None,
            code: Some("internal_error"),
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// Validates a generation request body.
pub fn parse_generation_request(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<GenerationRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|error| {
        ApiError::invalid_request(
            format!("We could not parse the JSON body of your request: {error}"),
            None,
            "invalid_json",
        )
    })?;
    let Value::Object(mut object) = value else {
        return Err(ApiError::invalid_request(
            "The request body must be a JSON object",
            None,
            "invalid_type",
        ));
    };
    let model = match object.get("model") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_request(
                "Missing required parameter: 'model'",
                Some("model"),
                "missing_required_parameter",
            ));
        }
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid_request(
                "'model' must not be empty",
                Some("model"),
                "invalid_value",
            ));
        }
        Some(_) => return Err(wrong_type("model", "a string")),
    };
    let stream = match object.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(stream)) => *stream,
        Some(_) => return Err(wrong_type("stream", "a boolean")),
    };
    refuse_event_options(&object)?;
    let max_tokens = optional_count(&object, "max_tokens")?
        .or(optional_count(&object, "max_completion_tokens")?);
    optional_count(&object, "n")?;
    let prompt = match endpoint {
        Endpoint::ChatCompletions => PromptInput::Chat(parse_messages(&mut object)?),
        Endpoint::Completions => parse_prompt(&object)?,
    };
    let batch = endpoint == Endpoint::Completions
        && matches!(object.get("prompt"), Some(Value::Array(items))
            if items.len() > 1 && !items[0].is_number());
    let include_usage = object
        .get("stream_options")
        .and_then(|options| options.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let cache_salt = match object.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(salt)) => Some(salt.clone()),
        Some(_) => return Err(wrong_type("cache_salt", "a string")),
    };
    Ok(GenerationRequest {
        endpoint,
        model,
        stream,
        prompt,
        max_tokens,
        batch,
        usage_expected: !stream || include_usage,
        cache_salt,
    })
}

/// Refuses, before anything is counted, a request that cannot fit the model's context of
/// `limit` tokens: its `max_tokens` alone, or its prompt alone (`prompt_tokens`, when the
/// router counted the whole prompt), reaches past it. The sum of the two is left to the
/// engine: the router's count of a chat prompt can differ from the engine's by a token or two
/// (BOS, template whitespace), and refusing on the sum would refuse requests the engine takes.
pub fn check_context(
    max_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    limit: u64,
) -> Result<(), ApiError> {
    if let Some(max_tokens) = max_tokens.filter(|&max_tokens| max_tokens > limit) {
        return Err(ApiError::invalid_request(
            format!(
                "'max_tokens' is too large: {max_tokens}. This model's maximum context length \
                 is {limit} tokens"
            ),
            Some("max_tokens"),
            "invalid_value",
        ));
    }
    if let Some(prompt) = prompt_tokens.filter(|&prompt| prompt >= limit) {
        return Err(ApiError::invalid_request(
            format!(
                "This model's maximum context length is {limit} tokens. However, your prompt \
                 has {prompt} tokens, which leaves no room for an answer"
            ),
            Some("messages"),
            "context_length_exceeded",
        ));
    }
    Ok(())
}

/// vLLM options a client could set per request that change what the engine publishes on its
/// KV-event stream, which the router's mirror follows for every client: with
/// `kv_cache_report_mode` vLLM announces the blocks a request reuses as stored again, and each
/// announcement would count as another copy that vLLM never removes (the mirror would keep
/// evicted blocks resident). Refused rather than stripped: the router never rewrites a body.
const EVENT_OPTIONS: &[&str] = &["kv_cache_report_mode"];

fn refuse_event_options(object: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Object(extra)) = object.get("vllm_xargs") else {
        return Ok(());
    };
    match EVENT_OPTIONS
        .iter()
        .find(|option| extra.contains_key(**option))
    {
        None => Ok(()),
        Some(option) => Err(ApiError::invalid_request(
            format!(
                "'vllm_xargs.{option}' is not accepted through this router: it changes the \
                 engine's KV-cache events, which the router follows for every client"
            ),
            Some(&format!("vllm_xargs.{option}")),
            "unsupported_parameter",
        )),
    }
}

fn wrong_type(param: &str, expected: &str) -> ApiError {
    ApiError::invalid_request(
        format!("Invalid type for '{param}': expected {expected}"),
        Some(param),
        "invalid_type",
    )
}

fn optional_count(object: &Map<String, Value>, param: &str) -> Result<Option<u64>, ApiError> {
    match object.get(param) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(number)) => number
            .as_u64()
            .map(Some)
            .ok_or_else(|| wrong_type(param, "a non-negative integer")),
        Some(_) => Err(wrong_type(param, "a non-negative integer")),
    }
}

/// Validates and takes the `messages` array out of the body object (no copy).
fn parse_messages(object: &mut Map<String, Value>) -> Result<Value, ApiError> {
    let messages = match object.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_request(
                "Missing required parameter: 'messages'",
                Some("messages"),
                "missing_required_parameter",
            ));
        }
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err(wrong_type("messages", "an array")),
    };
    if messages.is_empty() {
        return Err(ApiError::invalid_request(
            "'messages' must contain at least one message",
            Some("messages"),
            "invalid_value",
        ));
    }
    for (index, message) in messages.iter().enumerate() {
        let Value::Object(message) = message else {
            return Err(wrong_type(&format!("messages[{index}]"), "an object"));
        };
        match message.get("role") {
            Some(Value::String(role)) if !role.is_empty() => {}
            None | Some(Value::Null) => {
                return Err(ApiError::invalid_request(
                    format!("Missing required parameter: 'messages[{index}].role'"),
                    Some(&format!("messages[{index}].role")),
                    "missing_required_parameter",
                ));
            }
            Some(_) => {
                return Err(wrong_type(
                    &format!("messages[{index}].role"),
                    "a non-empty string",
                ));
            }
        };
        match message.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => check_content_parts(parts, index)?,
            Some(_) => {
                return Err(wrong_type(
                    &format!("messages[{index}].content"),
                    "a string or an array of content parts",
                ));
            }
        }
    }
    Ok(object.remove("messages").unwrap_or_default())
}

fn check_content_parts(parts: &[Value], index: usize) -> Result<(), ApiError> {
    for part in parts {
        let Value::Object(part) = part else {
            return Err(wrong_type(
                &format!("messages[{index}].content"),
                "an array of objects",
            ));
        };
        match part.get("type") {
            Some(Value::String(kind)) if kind == "text" => match part.get("text") {
                Some(Value::String(_)) => {}
                _ => {
                    return Err(wrong_type(
                        &format!("messages[{index}].content.text"),
                        "a string",
                    ));
                }
            },
            Some(Value::String(_)) => {}
            _ => {
                return Err(ApiError::invalid_request(
                    format!("Missing required parameter: 'messages[{index}].content.type'"),
                    Some(&format!("messages[{index}].content.type")),
                    "missing_required_parameter",
                ));
            }
        }
    }
    Ok(())
}

fn parse_prompt(object: &Map<String, Value>) -> Result<PromptInput, ApiError> {
    let expected =
        "a string, an array of strings, an array of token ids or an array of arrays of token ids";
    let prompt = match object.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid_request(
                "Missing required parameter: 'prompt'",
                Some("prompt"),
                "missing_required_parameter",
            ));
        }
        Some(prompt) => prompt,
    };
    match prompt {
        Value::String(text) => Ok(PromptInput::Text(text.clone())),
        Value::Array(items) if items.is_empty() => Err(ApiError::invalid_request(
            "'prompt' must not be an empty array",
            Some("prompt"),
            "invalid_value",
        )),
        Value::Array(items) => match &items[0] {
            Value::String(first) => {
                if items.iter().all(Value::is_string) {
                    Ok(PromptInput::Text(first.clone()))
                } else {
                    Err(wrong_type("prompt", expected))
                }
            }
            Value::Number(_) => Ok(PromptInput::Tokens(
                token_ids(items).ok_or_else(|| wrong_type("prompt", expected))?,
            )),
            Value::Array(first) => {
                let mut first_ids = None;
                for item in items {
                    let Value::Array(ids) = item else {
                        return Err(wrong_type("prompt", expected));
                    };
                    let ids = token_ids(ids).ok_or_else(|| wrong_type("prompt", expected))?;
                    first_ids.get_or_insert(ids);
                }
                if first.is_empty() {
                    return Err(ApiError::invalid_request(
                        "'prompt' token arrays must not be empty",
                        Some("prompt"),
                        "invalid_value",
                    ));
                }
                Ok(PromptInput::Tokens(first_ids.unwrap_or_default()))
            }
            _ => Err(wrong_type("prompt", expected)),
        },
        _ => Err(wrong_type("prompt", expected)),
    }
}

fn token_ids(items: &[Value]) -> Option<Vec<u32>> {
    items
        .iter()
        .map(|item| item.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect()
}

/// The OpenAI error JSON of hyper's own answer to a request it could not parse (a malformed
/// head: 400; a URI or head too large: 414, 431), which would otherwise have no body. Counted
/// like any answer (`route="other"`).
pub fn protocol_error_body(status: u16) -> Option<bytes::Bytes> {
    let (message, code) = match status {
        400 => ("The request is not valid HTTP/1.1", "invalid_http_request"),
        414 => ("The request URI is too long", "uri_too_long"),
        431 => (
            "The request header fields are too large",
            "headers_too_large",
        ),
        _ => return None,
    };
    // Called by the HTTP server without the core at hand: this thread's (this core's) own
    // handles, registered on first use like `CoreMetrics::request`.
    thread_local! {
        static COUNTERS: std::cell::RefCell<Vec<(u16, metrics::Counter)>> =
            const { std::cell::RefCell::new(Vec::new()) };
    }
    COUNTERS.with_borrow_mut(|counters| {
        if let Some((_, counter)) = counters.iter().find(|(s, _)| *s == status) {
            counter.increment(1);
        } else {
            let counter = metrics::counter!(
                crate::metrics::REQUESTS_TOTAL,
                "route" => "other", "status" => status.to_string()
            );
            counter.increment(1);
            counters.push((status, counter));
        }
    });
    let error = ApiError {
        status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
        message: message.into(),
        error_type: "invalid_request_error",
        param: None,
        code: Some(code),
    };
    Some(bytes::Bytes::from(error.to_json().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<GenerationRequest, ApiError> {
        parse_generation_request(Endpoint::ChatCompletions, body.as_bytes())
    }

    fn completion(body: &str) -> Result<GenerationRequest, ApiError> {
        parse_generation_request(Endpoint::Completions, body.as_bytes())
    }

    #[test]
    fn valid_chat() {
        let request = chat(
            r#"{"model":"m","stream":true,"max_tokens":5,"messages":[
                {"role":"system","content":"be brief"},
                {"role":"user","content":[{"type":"text","text":"hi "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
                {"role":"assistant","content":null}]}"#,
        )
        .unwrap();
        assert!(request.stream);
        assert_eq!(request.max_tokens, Some(5));
        let PromptInput::Chat(messages) = request.prompt else {
            panic!("not chat")
        };
        assert_eq!(messages.as_array().map(Vec::len), Some(3));
    }

    #[test]
    fn cache_salt_is_read_and_must_be_a_string() {
        let salted = completion(r#"{"model":"m","prompt":"abc","cache_salt":"tenant-1"}"#);
        assert_eq!(salted.unwrap().cache_salt.as_deref(), Some("tenant-1"));
        let unsalted = completion(r#"{"model":"m","prompt":"abc","cache_salt":null}"#);
        assert_eq!(unsalted.unwrap().cache_salt, None);
        let error = completion(r#"{"model":"m","prompt":"abc","cache_salt":7}"#).unwrap_err();
        assert_eq!(error.status, StatusCode::BAD_REQUEST);
        assert_eq!(error.param.as_deref(), Some("cache_salt"));
    }

    #[test]
    fn completion_prompt_shapes() {
        assert_eq!(
            completion(r#"{"model":"m","prompt":"abc"}"#)
                .unwrap()
                .prompt,
            PromptInput::Text("abc".into())
        );
        assert_eq!(
            completion(r#"{"model":"m","prompt":["a","b"]}"#)
                .unwrap()
                .prompt,
            PromptInput::Text("a".into())
        );
        assert_eq!(
            completion(r#"{"model":"m","prompt":[1,2,3]}"#)
                .unwrap()
                .prompt,
            PromptInput::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            completion(r#"{"model":"m","prompt":[[4,5],[6]]}"#)
                .unwrap()
                .prompt,
            PromptInput::Tokens(vec![4, 5])
        );
    }

    fn code_of(
        result: Result<GenerationRequest, ApiError>,
    ) -> (u16, Option<String>, Option<&'static str>) {
        let error = result.unwrap_err();
        (error.status.as_u16(), error.param, error.code)
    }

    #[test]
    fn bad_inputs() {
        assert_eq!(code_of(chat("{")).2, Some("invalid_json"));
        assert_eq!(code_of(chat("[1]")).2, Some("invalid_type"));
        assert_eq!(
            code_of(chat(r#"{"messages":[]}"#)).1.as_deref(),
            Some("model")
        );
        assert_eq!(
            code_of(chat(r#"{"model":3,"messages":[]}"#)).2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(chat(r#"{"model":"m"}"#)).1.as_deref(),
            Some("messages")
        );
        assert_eq!(
            code_of(chat(r#"{"model":"m","messages":{}}"#)).2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(chat(r#"{"model":"m","messages":[]}"#)).2,
            Some("invalid_value")
        );
        assert_eq!(
            code_of(chat(r#"{"model":"m","messages":[{"content":"x"}]}"#)).2,
            Some("missing_required_parameter")
        );
        assert_eq!(
            code_of(chat(
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#
            ))
            .2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(chat(
                r#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#
            ))
            .1
            .as_deref(),
            Some("stream")
        );
        assert_eq!(
            code_of(chat(
                r#"{"model":"m","max_tokens":-1,"messages":[{"role":"user","content":"x"}]}"#
            ))
            .1
            .as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m"}"#)).1.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":5}"#)).2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":[]}"#)).2,
            Some("invalid_value")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":["a",1]}"#)).2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":[1,-2]}"#)).2,
            Some("invalid_type")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":[[]]}"#)).2,
            Some("invalid_value")
        );
        assert_eq!(
            code_of(completion(r#"{"model":"m","prompt":[1,5000000000]}"#)).2,
            Some("invalid_type")
        );
        for result in [chat("{"), completion(r#"{"model":"m"}"#)] {
            assert_eq!(result.unwrap_err().status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn requests_past_the_context_are_refused_before_they_count() {
        assert!(check_context(None, None, 8192).is_ok());
        assert!(check_context(Some(8192), Some(8191), 8192).is_ok());
        let huge = check_context(Some(4_611_686_018_427_387_904), None, 8192).unwrap_err();
        assert_eq!(huge.status, StatusCode::BAD_REQUEST);
        assert_eq!(huge.param.as_deref(), Some("max_tokens"));
        assert!(huge.message.contains("8192"), "{}", huge.message);
        let long = check_context(Some(16), Some(8192), 8192).unwrap_err();
        assert_eq!(long.code, Some("context_length_exceeded"));
        // An estimated prompt length (not counted whole) is never refused here.
        assert!(check_context(Some(16), None, 8192).is_ok());
    }

    #[test]
    fn options_that_change_the_engines_kv_events_are_refused() {
        let refused = completion(
            r#"{"model":"m","prompt":"x","vllm_xargs":{"kv_cache_report_mode":"full"}}"#,
        );
        assert_eq!(
            code_of(refused),
            (
                400,
                Some("vllm_xargs.kv_cache_report_mode".to_string()),
                Some("unsupported_parameter")
            )
        );
        // Other engine options pass through untouched.
        assert!(
            completion(r#"{"model":"m","prompt":"x","vllm_xargs":{"priority_boost":1}}"#).is_ok()
        );
        assert!(
            chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"vllm_xargs":{"kv_cache_report_mode":"full"}}"#)
                .is_err()
        );
    }

    #[test]
    fn error_json_shape() {
        let json = ApiError::not_found("GET", "/nope").to_json();
        let error = &json["error"];
        assert!(error["message"].as_str().unwrap().contains("/nope"));
        assert_eq!(error["type"], "invalid_request_error");
        assert!(error["param"].is_null());
        assert_eq!(error["code"], "unknown_url");
    }
}

/// Untrusted request bodies: whatever the bytes, parsing never panics, and a rejection is a
/// client error carrying an OpenAI error body.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// JSON values shaped like requests: the keys the parser looks at, with any types.
    fn request_like_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "[a-z ]{0,12}".prop_map(Value::String),
        ];
        let key = prop_oneof![
            Just("model".to_string()),
            Just("messages".to_string()),
            Just("prompt".to_string()),
            Just("stream".to_string()),
            Just("max_tokens".to_string()),
            Just("n".to_string()),
            Just("role".to_string()),
            Just("content".to_string()),
            Just("type".to_string()),
            Just("text".to_string()),
            "[a-z_]{1,8}",
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(key.clone(), inner, 0..6)
                    .prop_map(|map| Value::Object(map.into_iter().collect())),
            ]
        })
    }

    fn check(endpoint: Endpoint, body: &[u8]) {
        if let Err(error) = parse_generation_request(endpoint, body) {
            assert!(error.status.is_client_error(), "{:?}", error.status);
            let json = error.to_json();
            assert!(
                json["error"]["message"]
                    .as_str()
                    .is_some_and(|message| !message.is_empty())
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn arbitrary_bytes_are_rejected_cleanly(body in prop::collection::vec(any::<u8>(), 0..256)) {
            check(Endpoint::ChatCompletions, &body);
            check(Endpoint::Completions, &body);
        }

        #[test]
        fn request_shaped_json_never_panics(value in request_like_json()) {
            let body = value.to_string();
            check(Endpoint::ChatCompletions, body.as_bytes());
            check(Endpoint::Completions, body.as_bytes());
        }
    }
}
