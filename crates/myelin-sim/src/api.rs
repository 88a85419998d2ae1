//! The HTTP routes of one simulated engine: vLLM's OpenAI-compatible API plus its admin
//! endpoints, with fault injection. One handler per route; generation requests are parsed and
//! tokenised here, queued on the engine, and answered whole or as an SSE stream.

use std::rc::Rc;

use bytes::Bytes;
use futures_lite::future::or;
use http::{Method, StatusCode, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::{Request, Response};
use myelin_http::body::{self, Body, BodySender};
use serde_json::{Value, json};

use crate::engine::{RequestId, RequestSpec};
use crate::faults::RequestFault;
use crate::host::{AbortOnDrop, LocalEngine, OutputReceiver, output_queue, unix_seconds};
use crate::metrics::{self, MetricsSnapshot};
use crate::openai::{self, Endpoint, FinishedChoice, GenerationRequest, ResponseHead, Usage};

/// Largest request body accepted (a 128k-token prompt as JSON token ids fits).
const MAX_REQUEST_BODY_BYTES: usize = 32 * 1024 * 1024;

/// SSE chunks queued per response before the engine's output waits for the client.
const STREAM_QUEUE_CHUNKS: usize = 64;

/// Routes one request.
pub async fn handle(engine: Rc<LocalEngine>, request: Request<Incoming>) -> Response<Body> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    match (method, path.as_str()) {
        (Method::GET, "/health") => status_only(StatusCode::OK),
        (Method::GET, "/v1/models") => models(&engine),
        (Method::GET, "/metrics") if engine.shared.faults.no_metrics => {
            error_response(StatusCode::NOT_FOUND, "Not Found", "NotFoundError")
        }
        (Method::GET, "/metrics") => metrics_page(&engine),
        (Method::POST, "/reset_prefix_cache") => reset_prefix_cache(&engine),
        (Method::POST, "/v1/completions") => generate(engine, request, Endpoint::Completions).await,
        (Method::POST, "/v1/chat/completions") => {
            generate(engine, request, Endpoint::ChatCompletions).await
        }
        (Method::POST, "/sim/restart_kv_publisher") => restart_publisher(&engine),
        (Method::GET, "/sim/state") => sim_state(&engine),
        (Method::GET, "/kv_event_sources") => kv_event_sources(&engine),
        (
            _,
            "/health"
            | "/v1/models"
            | "/metrics"
            | "/reset_prefix_cache"
            | "/v1/completions"
            | "/v1/chat/completions"
            | "/sim/restart_kv_publisher"
            | "/sim/state",
        ) => error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "Method Not Allowed",
            "MethodNotAllowed",
        ),
        _ => error_response(StatusCode::NOT_FOUND, "Not Found", "NotFoundError"),
    }
}

fn status_only(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(body::empty());
    *response.status_mut() = status;
    response
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    json_text_response(status, value.to_string())
}

fn json_text_response(status: StatusCode, json: String) -> Response<Body> {
    let mut response = Response::new(body::full(json));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(status: StatusCode, message: &str, error_type: &str) -> Response<Body> {
    json_response(
        status,
        &openai::error_body(message, error_type, status.as_u16()),
    )
}

fn models(engine: &LocalEngine) -> Response<Body> {
    let max_model_len = engine.shared.model().config().effective_max_model_len();
    json_response(
        StatusCode::OK,
        &openai::models_response(
            &engine.shared.model_name,
            &engine.shared.lora_adapters,
            engine.shared.created_unix_seconds,
            max_model_len,
        ),
    )
}

fn metrics_page(engine: &LocalEngine) -> Response<Body> {
    let text = {
        let model = engine.shared.model();
        metrics::render(&MetricsSnapshot {
            model_name: &engine.shared.model_name,
            engine: engine.shared.index,
            block_size: model.config().block_size,
            num_gpu_blocks: model.config().num_gpu_blocks,
            counters: model.counters(),
            load: model.load(),
        })
    };
    let mut response = Response::new(body::full(text));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

fn reset_prefix_cache(engine: &LocalEngine) -> Response<Body> {
    let mut model = engine.shared.model();
    if model.reset_prefix_cache() {
        engine.shared.flush_events(&mut model);
        status_only(StatusCode::OK)
    } else {
        // vLLM only logs "Failed to reset prefix cache" while blocks are in use; say so.
        error_response(
            StatusCode::CONFLICT,
            "Failed to reset prefix cache: requests still hold KV blocks",
            "Conflict",
        )
    }
}

/// vLLM 0.31+: `{dp_rank: KVEventsConfig}` so clients can find the event stream.
fn kv_event_sources(engine: &LocalEngine) -> Response<Body> {
    match &engine.shared.kv_source {
        Some(source) if source.wire != myelin_kv_events::WireVersion::V0_22 => json_response(
            StatusCode::OK,
            &json!({
                "0": {
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": source.endpoint,
                    "replay_endpoint": source.replay_endpoint,
                    "buffer_steps": source.buffer_steps,
                    "hwm": crate::publisher::DEFAULT_HWM,
                    "max_queue_size": 100_000,
                    "topic": source.topic,
                }
            }),
        ),
        _ => error_response(StatusCode::NOT_FOUND, "Not Found", "NotFoundError"),
    }
}

fn restart_publisher(engine: &LocalEngine) -> Response<Body> {
    match &engine.shared.publisher {
        Some(publisher) => {
            publisher.restart();
            status_only(StatusCode::OK)
        }
        None => error_response(
            StatusCode::NOT_FOUND,
            "KV events are not enabled on this engine",
            "NotFoundError",
        ),
    }
}

fn sim_state(engine: &LocalEngine) -> Response<Body> {
    let model = engine.shared.model();
    let counters = model.counters();
    let load = model.load();
    json_response(
        StatusCode::OK,
        &json!({
            "engine": engine.shared.index,
            "profile": model.performance().name(),
            "block_size": model.config().block_size,
            "num_gpu_blocks": model.config().num_gpu_blocks,
            "cached_blocks": model.pool().num_cached_hashes(),
            "free_blocks": model.pool().num_free(),
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": load.kv_usage,
            "pending_prefill_tokens": load.pending_prefill_tokens,
            "pending_prefill_pairs": load.pending_prefill_pairs,
            "pending_decode_tokens": load.pending_decode_tokens,
            "prefix_cache_queries": counters.prefix_cache_queries,
            "prefix_cache_hits": counters.prefix_cache_hits,
            "preemptions": counters.preemptions,
            "evictions": counters.evictions,
            "requests_aborted": counters.requests_aborted,
            "steps": counters.steps,
        }),
    )
}

/// Response identity for a new generation.
fn response_head(engine: &LocalEngine, endpoint: Endpoint, model: Option<String>) -> ResponseHead {
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::ChatCompletions => "chatcmpl",
    };
    let serial = engine
        .shared
        .generation_requests
        .load(std::sync::atomic::Ordering::Relaxed);
    ResponseHead {
        id: format!(
            "{prefix}-{:08x}{:08x}{:016x}",
            engine.shared.index, engine.shared.created_unix_seconds as u32, serial
        ),
        created: unix_seconds(),
        model: model.unwrap_or_else(|| engine.shared.model_name.clone()),
    }
}

async fn generate(
    engine: Rc<LocalEngine>,
    request: Request<Incoming>,
    endpoint: Endpoint,
) -> Response<Body> {
    let nth = engine.shared.count_generation_request();
    let fault = engine.shared.faults.for_request(nth);
    if fault == RequestFault::Fail {
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "Service Unavailable (simulated fault)",
            "ServiceUnavailableError",
        );
    }
    let body = match Limited::new(request.into_body(), MAX_REQUEST_BODY_BYTES)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body: {error}"),
                "BadRequestError",
            );
        }
    };
    if fault == RequestFault::Stall {
        // Hold the connection until the client gives up or the server stops.
        std::future::pending::<()>().await;
    }
    let parsed = match GenerationRequest::parse(endpoint, &body, &engine.shared.text) {
        Ok(parsed) => parsed,
        Err(error) => {
            return error_response(
                StatusCode::BAD_REQUEST,
                &error.to_string(),
                "BadRequestError",
            );
        }
    };
    let (sink, outputs) = output_queue();
    let mut request_ids: Vec<RequestId> = Vec::with_capacity(parsed.prompts.len());
    let mut prompt_tokens = 0;
    for (choice, prompt) in parsed.prompts.iter().enumerate() {
        prompt_tokens += prompt.len();
        let spec = RequestSpec {
            prompt_token_ids: prompt.clone(),
            max_tokens: parsed.max_tokens,
            ignore_eos: parsed.ignore_eos,
            // A request naming an adapter runs on it (any other name is the base model).
            lora: parsed
                .model
                .clone()
                .filter(|model| engine.shared.lora_adapters.contains(model)),
            cache_salt: parsed.cache_salt.clone(),
        };
        match engine.submit(spec, choice, sink.clone()) {
            Ok(id) => request_ids.push(id),
            Err(error) => {
                for &id in &request_ids {
                    engine.abort(id);
                }
                return error_response(
                    StatusCode::BAD_REQUEST,
                    &error.to_string(),
                    "BadRequestError",
                );
            }
        }
    }
    drop(sink);
    let guard = AbortOnDrop::new(engine.clone(), request_ids);
    let head = response_head(&engine, endpoint, parsed.model.clone());
    let die_after_first_token = fault == RequestFault::DieMidStream;
    let choices = parsed.prompts.len();
    if parsed.stream {
        let (sender, body) = body::channel(STREAM_QUEUE_CHUNKS);
        let stream = StreamState {
            engine,
            head,
            endpoint,
            include_usage: parsed.include_usage,
            choices,
            prompt_tokens,
            die_after_first_token,
        };
        glommio::spawn_local(async move {
            let _guard = guard;
            stream.run(outputs, sender).await;
        })
        .detach();
        let mut response = Response::new(body);
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        return response;
    }
    let collected = collect_outputs(&engine, outputs, choices, die_after_first_token).await;
    drop(guard);
    let Some((finished, usage)) = collected else {
        // Simulated death: the body breaks after the headers.
        let (sender, body) = body::channel(1);
        let _ = sender.abort("simulated engine death").await;
        return Response::new(body);
    };
    let usage = Usage {
        prompt_tokens,
        ..usage
    };
    let json = match endpoint {
        Endpoint::Completions => openai::completion_response(&head, &finished, usage),
        Endpoint::ChatCompletions => match finished.first() {
            Some(choice) => openai::chat_response(&head, choice, usage),
            None => openai::chat_response(
                &head,
                &FinishedChoice {
                    index: 0,
                    text: String::new(),
                    finish_reason: "length",
                },
                usage,
            ),
        },
    };
    json_text_response(StatusCode::OK, json)
}

/// Waits for every choice to finish; `None` when a simulated death cuts the response.
async fn collect_outputs(
    engine: &LocalEngine,
    outputs: OutputReceiver,
    choices: usize,
    die_after_first_token: bool,
) -> Option<(Vec<FinishedChoice>, Usage)> {
    let mut texts = vec![String::new(); choices];
    let mut finish_reasons: Vec<Option<&'static str>> = vec![None; choices];
    let mut usage = Usage::default();
    let mut remaining = choices;
    while remaining > 0 {
        let (choice, output) = outputs.recv().await?;
        if die_after_first_token {
            return None;
        }
        if output.output_tokens == 1 {
            usage.cached_tokens += output.cached_prompt_tokens;
        }
        usage.completion_tokens += 1;
        if let Some(text) = texts.get_mut(choice) {
            text.push_str(&engine.shared.text.token_text(output.token_id));
        }
        if let Some(reason) = output.finished {
            if let Some(slot) = finish_reasons.get_mut(choice) {
                *slot = Some(reason.as_str());
            }
            remaining -= 1;
        }
    }
    let finished = texts
        .into_iter()
        .zip(finish_reasons)
        .enumerate()
        .map(|(index, (text, reason))| FinishedChoice {
            index,
            text,
            finish_reason: reason.unwrap_or("length"),
        })
        .collect();
    Some((finished, usage))
}

/// One SSE response in flight.
struct StreamState {
    engine: Rc<LocalEngine>,
    head: ResponseHead,
    endpoint: Endpoint,
    include_usage: bool,
    choices: usize,
    prompt_tokens: usize,
    die_after_first_token: bool,
}

impl StreamState {
    /// Forwards outputs as SSE chunks until every choice finished or the client went away
    /// (then the caller's guard aborts the requests and frees their blocks).
    async fn run(self, outputs: OutputReceiver, sender: BodySender) {
        let mut usage = Usage {
            prompt_tokens: self.prompt_tokens,
            ..Usage::default()
        };
        let mut remaining = self.choices;
        while remaining > 0 {
            let next = or(async { Some(outputs.recv().await) }, async {
                sender.closed().await;
                None
            })
            .await;
            let Some(Some((choice, output))) = next else {
                return; // Client gone, or the engine stopped.
            };
            let text = self.engine.shared.text.token_text(output.token_id);
            let finish_reason = output.finished.map(|reason| reason.as_str());
            let mut chunk = String::new();
            if output.output_tokens == 1 {
                usage.cached_tokens += output.cached_prompt_tokens;
                if self.endpoint == Endpoint::ChatCompletions {
                    chunk.push_str(&openai::sse_data(&openai::chat_role_chunk(
                        &self.head, choice,
                    )));
                }
            }
            usage.completion_tokens += 1;
            let json = match self.endpoint {
                Endpoint::Completions => {
                    openai::completion_chunk(&self.head, choice, &text, finish_reason)
                }
                Endpoint::ChatCompletions => {
                    openai::chat_content_chunk(&self.head, choice, &text, finish_reason)
                }
            };
            chunk.push_str(&openai::sse_data(&json));
            if sender.send(Bytes::from(chunk)).await.is_err() {
                return;
            }
            if self.die_after_first_token {
                let _ = sender.abort("simulated engine death mid-stream").await;
                return;
            }
            if output.finished.is_some() {
                remaining -= 1;
            }
        }
        let mut tail = String::new();
        if self.include_usage {
            let json = match self.endpoint {
                Endpoint::Completions => openai::completion_usage_chunk(&self.head, usage),
                Endpoint::ChatCompletions => openai::chat_usage_chunk(&self.head, usage),
            };
            tail.push_str(&openai::sse_data(&json));
        }
        tail.push_str(openai::SSE_DONE);
        let _ = sender.send(Bytes::from(tail)).await;
    }
}
