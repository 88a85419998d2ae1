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
    /// A chat request with (non-null) `tools`: not read here, as most chat templates do not
    /// write them; [`read_tools`] gets them for one that does.
    pub tools_present: bool,
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
///
/// Only the members the router reads are parsed into JSON values; the others are checked for
/// syntax and skipped, and a `prompt` of token ids is read straight into ids, not into a JSON
/// value per id (docs/performance.md). The result is what parsing the whole body into one
/// JSON value would give ([`parse_generation_value`]; the tests compare the two).
pub fn parse_generation_request(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<GenerationRequest, ApiError> {
    // Skipped members are checked for syntax but not for UTF-8: the whole body is, first.
    let text = std::str::from_utf8(body).map_err(|error| {
        invalid_json(format!(
            "the body is not valid UTF-8 (at byte {})",
            error.valid_up_to()
        ))
    })?;
    let members = match serde_json::from_str::<Members>(text) {
        Ok(members) => members,
        // Valid JSON of another type, unless the rest of the body is broken too.
        Err(error) if error.classify() == serde_json::error::Category::Data => {
            return Err(match serde_json::from_str::<serde::de::IgnoredAny>(text) {
                Ok(_) => not_an_object(),
                Err(error) => invalid_json(error),
            });
        }
        Err(error) => return Err(invalid_json(error)),
    };
    let mut object = members.object;
    let mut request = match members.prompt {
        // The common completion: one prompt of token ids, no JSON value per id.
        Some(Item::Ids(ids)) if endpoint == Endpoint::Completions && !ids.is_empty() => {
            let mut request = parse_object(endpoint, object, false)?;
            request.prompt = PromptInput::Tokens(ids);
            request
        }
        prompt => {
            if let Some(prompt) = prompt {
                object.insert("prompt".into(), prompt.into_value());
            }
            parse_object(endpoint, object, true)?
        }
    };
    request.tools_present = endpoint == Endpoint::ChatCompletions && members.tools_present;
    Ok(request)
}

/// The `tools` a chat template gets for `request` (parsed from `body` by
/// [`parse_generation_request`]): read from the body only when the template reads them
/// (`template_uses_tools`) and the request has some; `None` otherwise.
pub fn template_tools(
    request: &GenerationRequest,
    body: &[u8],
    template_uses_tools: bool,
) -> Result<Option<Value>, ApiError> {
    if request.tools_present && template_uses_tools {
        read_tools(body)
    } else {
        Ok(None)
    }
}

/// The `tools` of a chat request's body (one [`parse_generation_request`] accepted; `None`
/// when absent or null). Tools that are not an array are refused as the engine would refuse
/// them.
fn read_tools(body: &[u8]) -> Result<Option<Value>, ApiError> {
    struct ToolsOnly(Option<Value>);
    impl<'de> serde::Deserialize<'de> for ToolsOnly {
        fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl<'de> serde::de::Visitor<'de> for Visitor {
                type Value = ToolsOnly;
                fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                    formatter.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<ToolsOnly, A::Error> {
                    let mut tools = None;
                    while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                        if key == "tools" {
                            tools = Some(map.next_value::<Value>()?);
                        } else {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                    Ok(ToolsOnly(tools))
                }
            }
            deserializer.deserialize_map(Visitor)
        }
    }
    let ToolsOnly(tools) = serde_json::from_slice(body).map_err(invalid_json)?;
    match tools {
        None | Some(Value::Null) => Ok(None),
        Some(tools @ Value::Array(_)) => Ok(Some(tools)),
        Some(_) => Err(wrong_type("tools", "an array of tool definitions")),
    }
}

/// [`parse_generation_request`] from the body parsed whole into one JSON value (the reference
/// the members-only parse must equal).
#[cfg(test)]
fn parse_generation_value(endpoint: Endpoint, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(invalid_json)?;
    let Value::Object(object) = value else {
        return Err(not_an_object());
    };
    let tools_present = object.get("tools").is_some_and(|tools| !tools.is_null());
    let mut request = parse_object(endpoint, object, true)?;
    request.tools_present = endpoint == Endpoint::ChatCompletions && tools_present;
    Ok(request)
}

fn invalid_json(error: impl std::fmt::Display) -> ApiError {
    ApiError::invalid_request(
        format!("We could not parse the JSON body of your request: {error}"),
        None,
        "invalid_json",
    )
}

fn not_an_object() -> ApiError {
    ApiError::invalid_request(
        "The request body must be a JSON object",
        None,
        "invalid_type",
    )
}

/// The members of a body the router reads, as JSON values; `prompt` apart (see [`Item`]).
/// Any other member is checked for syntax and skipped. A member given twice counts once, with
/// its last value (as in a JSON value parsed whole).
struct Members {
    object: Map<String, Value>,
    prompt: Option<Item>,
    /// The last `tools` member is not null (its value is skipped).
    tools_present: bool,
}

/// The top-level members [`parse_object`] reads (`prompt` is read apart).
const READ_MEMBERS: [&str; 9] = [
    "model",
    "stream",
    "vllm_xargs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "messages",
    "stream_options",
    "cache_salt",
];

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Members;
            fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
                formatter.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members, A::Error> {
                let mut members = Members {
                    object: Map::new(),
                    prompt: None,
                    tools_present: false,
                };
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if key == "prompt" {
                        members.prompt = Some(map.next_value()?);
                    } else if key == "tools" {
                        // Skipped; null reads as none.
                        members.tools_present =
                            map.next_value::<Option<serde::de::IgnoredAny>>()?.is_some();
                    } else if READ_MEMBERS.contains(&key.as_ref()) {
                        let value = map.next_value()?;
                        members.object.insert(key.into_owned(), value);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(members)
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// A body's `prompt`, or an item of it: a token id (an integer that fits 32 bits), an array of
/// token ids only (the prompt itself: read straight into ids), or anything else as a JSON value.
enum Item {
    Id(u32),
    Ids(Vec<u32>),
    Value(Value),
}

impl Item {
    fn into_value(self) -> Value {
        match self {
            Item::Id(id) => Value::from(id),
            Item::Ids(ids) => Value::Array(ids.into_iter().map(Value::from).collect()),
            Item::Value(value) => value,
        }
    }
}

impl<'de> serde::Deserialize<'de> for Item {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        serde::de::DeserializeSeed::deserialize(ItemSeed { prompt: true }, deserializer)
    }
}

/// Reads an [`Item`]; `prompt`: the prompt itself, whose array is read as ids while every
/// item is one (an array inside it is a JSON value).
#[derive(Clone, Copy)]
struct ItemSeed {
    prompt: bool,
}

impl<'de> serde::de::DeserializeSeed<'de> for ItemSeed {
    type Value = Item;
    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Item, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ItemSeed {
    type Value = Item;
    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("a JSON value")
    }
    fn visit_u64<E: serde::de::Error>(self, number: u64) -> Result<Item, E> {
        Ok(match u32::try_from(number) {
            Ok(id) => Item::Id(id),
            Err(_) => Item::Value(Value::from(number)),
        })
    }
    fn visit_i64<E: serde::de::Error>(self, number: i64) -> Result<Item, E> {
        Ok(Item::Value(Value::from(number)))
    }
    fn visit_f64<E: serde::de::Error>(self, number: f64) -> Result<Item, E> {
        Ok(Item::Value(Value::from(number)))
    }
    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Item, E> {
        Ok(Item::Value(Value::String(text.to_owned())))
    }
    fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Item, E> {
        Ok(Item::Value(Value::String(text)))
    }
    fn visit_bool<E: serde::de::Error>(self, flag: bool) -> Result<Item, E> {
        Ok(Item::Value(Value::Bool(flag)))
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Item, E> {
        Ok(Item::Value(Value::Null))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
        if !self.prompt {
            return serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(
                seq,
            ))
            .map(Item::Value);
        }
        let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(item) = seq.next_element_seed(ItemSeed { prompt: false })? {
            let Item::Id(id) = item else {
                let mut items: Vec<Value> = ids.into_iter().map(Value::from).collect();
                items.push(item.into_value());
                while let Some(value) = seq.next_element::<Value>()? {
                    items.push(value);
                }
                return Ok(Item::Value(Value::Array(items)));
            };
            ids.push(id);
        }
        Ok(Item::Ids(ids))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
        serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            .map(Item::Value)
    }
}

/// Validates a body's members. `with_prompt`: `prompt` is among them (otherwise the caller
/// sets it, from a prompt of token ids read apart, and the checks of `prompt` are skipped).
fn parse_object(
    endpoint: Endpoint,
    mut object: Map<String, Value>,
    with_prompt: bool,
) -> Result<GenerationRequest, ApiError> {
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
        Endpoint::Completions if with_prompt => parse_prompt(&mut object)?,
        Endpoint::Completions => PromptInput::Tokens(Vec::new()),
    };
    let batch = endpoint == Endpoint::Completions
        && with_prompt
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
        tools_present: false,
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

/// Validates `prompt` (a text is taken out of the body object, not copied).
fn parse_prompt(object: &mut Map<String, Value>) -> Result<PromptInput, ApiError> {
    let expected =
        "a string, an array of strings, an array of token ids or an array of arrays of token ids";
    let prompt = match object.get_mut("prompt") {
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
        Value::String(text) => Ok(PromptInput::Text(std::mem::take(text))),
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
                for item in items.iter() {
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
    fn tools_are_noted_and_read_only_when_asked() {
        let body = br#"{"model":"a","messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#;
        let request = chat(std::str::from_utf8(body).unwrap()).unwrap();
        assert!(request.tools_present);
        let tools = read_tools(body).unwrap().unwrap();
        assert_eq!(tools[0]["function"]["name"], "f");
        for (body, present) in [
            (
                r#"{"model":"a","messages":[{"role":"user","content":"q"}]}"#,
                false,
            ),
            (
                r#"{"model":"a","messages":[{"role":"user","content":"q"}],"tools":null}"#,
                false,
            ),
            (
                r#"{"model":"a","messages":[{"role":"user","content":"q"}],"tools":"x"}"#,
                true,
            ),
        ] {
            assert_eq!(chat(body).unwrap().tools_present, present, "{body}");
        }
        assert_eq!(read_tools(br#"{"tools":null}"#).unwrap(), None);
        let error = read_tools(br#"{"tools":"x"}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("tools"));
        // A completion's tools are not its prompt's business.
        assert!(
            !completion(r#"{"model":"a","prompt":"p","tools":[]}"#)
                .unwrap()
                .tools_present
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

    /// Completion bodies whose `prompt` is an array of token-id-like items: ids, numbers past
    /// 32 bits, negative numbers, floats, strings, nested arrays and other values.
    fn prompt_like_json() -> impl Strategy<Value = Value> {
        let item = prop_oneof![
            8 => any::<u32>().prop_map(Value::from),
            1 => any::<u64>().prop_map(Value::from),
            1 => any::<i64>().prop_map(Value::from),
            1 => any::<f64>().prop_map(Value::from),
            1 => "[a-z ]{0,6}".prop_map(Value::String),
            1 => prop::collection::vec(any::<u32>().prop_map(Value::from), 0..4).prop_map(Value::Array),
            1 => Just(Value::Null),
        ];
        let prompt = prop_oneof![
            6 => prop::collection::vec(item, 0..12).prop_map(Value::Array),
            1 => "[a-z ]{0,12}".prop_map(Value::String),
            1 => request_like_json(),
        ];
        (prompt, request_like_json()).prop_map(|(prompt, extra)| {
            let mut object = Map::new();
            object.insert("model".into(), Value::from("m"));
            object.insert("prompt".into(), prompt);
            object.insert("extra".into(), extra);
            Value::Object(object)
        })
    }

    /// The members-only parse gives what parsing the body whole gives: the same request, or
    /// an error of the same status and code (and message, unless the JSON itself is broken).
    fn same_as_whole_parse(endpoint: Endpoint, body: &[u8]) {
        let fast = parse_generation_request(endpoint, body);
        let whole = parse_generation_value(endpoint, body);
        match (&fast, &whole) {
            (Ok(fast), Ok(whole)) => assert_eq!(fast, whole),
            (Err(fast), Err(whole)) => {
                assert_eq!((fast.status, fast.code), (whole.status, whole.code));
                if whole.code != Some("invalid_json") {
                    assert_eq!(fast.message, whole.message);
                    assert_eq!(fast.param, whole.param);
                }
            }
            _ => panic!(
                "{}: {fast:?} against {whole:?}",
                String::from_utf8_lossy(body)
            ),
        }
    }

    #[test]
    fn reading_only_the_members_used_equals_parsing_the_body_whole() {
        let bodies: &[&str] = &[
            // A member given twice: the last counts.
            r#"{"model":"a","model":"b","prompt":[1,2],"prompt":"text"}"#,
            r#"{"model":"a","prompt":"text","prompt":[7,8,9]}"#,
            r#"{"model":"a","stream":true,"stream":"no","prompt":[1]}"#,
            // An escaped key is the same key.
            r#"{"mod\u0065l":"a","pr\u006fmpt":[1,2,3]}"#,
            // Ids past 32 bits, negative, fractional, mixed, nested, empty.
            r#"{"model":"a","prompt":[1,4294967296]}"#,
            r#"{"model":"a","prompt":[1,-2]}"#,
            r#"{"model":"a","prompt":[-0]}"#,
            r#"{"model":"a","prompt":[1,2.5]}"#,
            r#"{"model":"a","prompt":[1,"two"]}"#,
            r#"{"model":"a","prompt":[[1,2],[3]]}"#,
            r#"{"model":"a","prompt":[[],[3]]}"#,
            r#"{"model":"a","prompt":[]}"#,
            r#"{"model":"a","prompt":["x","y"]}"#,
            r#"{"model":"a","prompt":{"a":1}}"#,
            r#"{"model":"a","prompt":null}"#,
            r#"{"model":"a","prompt":1}"#,
            r#"{"model":"a"}"#,
            // Members the router does not read are still checked for syntax.
            r#"{"model":"a","prompt":[1],"tools":[{"a":}]}"#,
            r#"{"model":"a","prompt":[1],"tools":"\q"}"#,
            r#"{"model":"a","prompt":[1,]}"#,
            r#"{"model":"a","prompt":[1]} trailing"#,
            r#"[{"model":"a","prompt":[1]}]"#,
            r#""text""#,
            r#"1 x"#,
            r#"[1,"#,
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"prompt":[1]}"#,
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}"#,
        ];
        for body in bodies {
            same_as_whole_parse(Endpoint::Completions, body.as_bytes());
            same_as_whole_parse(Endpoint::ChatCompletions, body.as_bytes());
        }
    }

    #[test]
    fn invalid_utf8_is_refused_even_in_a_member_the_router_skips() {
        let mut body = br#"{"model":"a","prompt":[1],"user":"x"#.to_vec();
        body.push(0xff);
        body.extend_from_slice(br#""}"#);
        let error = parse_generation_request(Endpoint::Completions, &body).unwrap_err();
        assert_eq!(error.code, Some("invalid_json"));
        assert!(error.message.contains("UTF-8"), "{}", error.message);
        assert!(parse_generation_value(Endpoint::Completions, &body).is_err());
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
            same_as_whole_parse(Endpoint::ChatCompletions, body.as_bytes());
            same_as_whole_parse(Endpoint::Completions, body.as_bytes());
        }

        #[test]
        fn token_prompts_parse_as_the_whole_body_does(value in prompt_like_json()) {
            let body = value.to_string();
            same_as_whole_parse(Endpoint::Completions, body.as_bytes());
            same_as_whole_parse(Endpoint::ChatCompletions, body.as_bytes());
        }

        #[test]
        fn arbitrary_bytes_parse_as_the_whole_body_does(body in prop::collection::vec(any::<u8>(), 0..256)) {
            same_as_whole_parse(Endpoint::Completions, &body);
            same_as_whole_parse(Endpoint::ChatCompletions, &body);
        }
    }
}
