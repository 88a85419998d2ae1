//! The request path, top to bottom: accept -> parse -> tokenize -> lookup (own replica) ->
//! score -> proxy (with retries before the first byte) -> learn, plus the small endpoints
//! (models, health, metrics). The admin API is not here: it has its own listener on the
//! control core (`admin.rs`).

use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use glommio::timer::Timer;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use myelin_http::body::{Body, full};
use serde_json::Value;

use crate::backends::{BackendId, BackendState, Prefill};
use crate::body_budget::Reservation;
use crate::data_core::{DataCore, InFlightPermit, LoadGuard};
use crate::openai::{ApiError, Endpoint, GenerationRequest, parse_generation_request};
use crate::otel::{RequestTrace, TRACEPARENT, TraceParent};
use crate::pins::PromptBlocks;
use crate::proxy::{
    self, Attempt, BACKEND_HEADER, FailedAttempt, PREDICTED_TTFT_HEADER, TRACE_REQUEST_HEADER,
    TRACE_RESPONSE_HEADER, UpstreamRequest,
};
use crate::relay::{RelayBody, RelayObserver, StreamEnd, Usage};
use crate::routing_glue::deepest_match;
use crate::token_parity::{self, PromptKind};

/// Time allowed for one backend's `/v1/models` answer.
const MODELS_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest `/v1/models` answer read from one backend (larger ones are left out of the union).
const MAX_MODELS_BODY_BYTES: usize = 1024 * 1024;

/// The endpoints the router serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Generate(Endpoint),
    Models,
    Health,
    Metrics,
}

impl Route {
    /// Label of the request metric (bounded set of values).
    fn label(self) -> &'static str {
        match self {
            Route::Generate(endpoint) => endpoint.path(),
            Route::Models => "/v1/models",
            Route::Health => "/health",
            Route::Metrics => "/metrics",
        }
    }
}

/// Maps method and path to a route, or the 404/405 error. `/metrics` is a route only with
/// `metrics` (`--metrics-on-client-port`).
fn route_of(method: &Method, path: &str, metrics: bool) -> Result<Route, ApiError> {
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    let allow = |allowed: &str, route: Route, ok: bool| {
        if ok {
            Ok(route)
        } else {
            Err(ApiError::method_not_allowed(method.as_str(), path, allowed))
        }
    };
    let is_get = method == Method::GET || method == Method::HEAD;
    match path {
        "/v1/chat/completions" => allow(
            "POST",
            Route::Generate(Endpoint::ChatCompletions),
            method == Method::POST,
        ),
        "/v1/completions" => allow(
            "POST",
            Route::Generate(Endpoint::Completions),
            method == Method::POST,
        ),
        "/v1/models" => allow("GET", Route::Models, is_get),
        "/health" => allow("GET", Route::Health, is_get),
        "/metrics" if metrics => allow("GET", Route::Metrics, is_get),
        // The admin API (`/admin/...`) is only on --admin-listen: unknown here.
        _ => Err(ApiError::not_found(method.as_str(), path)),
    }
}

/// Entry point for every request a data core accepts.
pub async fn handle(core: Rc<DataCore>, request: Request<Incoming>) -> Response<Body> {
    let arrived = Instant::now();
    let routed = route_of(
        request.method(),
        request.uri().path(),
        core.config.metrics_on_client_port,
    );
    let (label, response) = match routed {
        Ok(route) => {
            let response = match route {
                Route::Generate(endpoint) => {
                    // Dropped before it answers: hyper dropped this future because the client
                    // went away (the engine attempt in flight is dropped with it: aborted).
                    let abandoned = AbandonGuard {
                        counter: Some(core.meters.client_disconnects.clone()),
                    };
                    // Sampled (`--otlp-endpoint`): the span goes with the relayed body, or
                    // ends here when the router answered itself.
                    let mut trace = core.tracer.as_ref().and_then(|tracer| {
                        let parent = request
                            .headers()
                            .get(TRACEPARENT)
                            .and_then(|value| TraceParent::parse(value.as_bytes()));
                        let mut trace = tracer.start(parent, arrived)?;
                        trace.set_name(&format!("POST {}", endpoint.path()));
                        Some(trace)
                    });
                    let response = generate(&core, endpoint, request, arrived, &mut trace).await;
                    if let Some(trace) = trace.as_mut() {
                        trace_status(trace, "the router", response.status());
                    }
                    abandoned.disarm();
                    response
                }
                Route::Models => models(&core).await,
                Route::Health => health(&core),
                Route::Metrics => crate::metrics::exposition(&core.metrics),
            };
            (route.label(), response)
        }
        Err(error) => ("other", error_response(&error)),
    };
    core.meters.request(label, response.status().as_u16());
    response
}

/// Counts a request whose client went away before its response head
/// (`myelin_client_disconnects_total`), unless disarmed.
struct AbandonGuard {
    /// The core's `myelin_client_disconnects_total` while armed.
    counter: Option<metrics::Counter>,
}

impl AbandonGuard {
    fn disarm(mut self) {
        self.counter = None;
    }
}

impl Drop for AbandonGuard {
    fn drop(&mut self) {
        if let Some(counter) = &self.counter {
            counter.increment(1);
        }
    }
}

/// The OpenAI error JSON as a response.
pub fn error_response(error: &ApiError) -> Response<Body> {
    let mut response = json_response(error.status, &error.to_json());
    if error.status == StatusCode::METHOD_NOT_ALLOWED
        && let Some(allowed) = error.message.split("(allowed: ").nth(1)
        && let Ok(value) = HeaderValue::from_str(allowed.trim_end_matches(')'))
    {
        response.headers_mut().insert(header::ALLOW, value);
    }
    response
}

/// A JSON response.
pub fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn with_retry_after(mut response: Response<Body>, seconds: u64) -> Response<Body> {
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// POST /v1/chat/completions and /v1/completions.
async fn generate(
    core: &Rc<DataCore>,
    endpoint: Endpoint,
    request: Request<Incoming>,
    arrived: Instant,
    trace: &mut Option<RequestTrace>,
) -> Response<Body> {
    if core.shutdown.is_triggered() {
        return with_retry_after(error_response(&ApiError::draining()), 1);
    }

    // Parse: the body, bounded in size and time, before anything else is held for the request
    // (a slow upload must not keep an in-flight slot: see Accept below).
    let (parts, body) = request.into_parts();
    let mut reservation = core.body_budget.reservation();
    let read = read_body(
        body,
        &parts.headers,
        core.config.max_body_bytes,
        Some(&mut reservation),
    );
    let body = match myelin_http::rt::timeout(core.config.body_read_timeout, read).await {
        Some(Ok(body)) => body,
        Some(Err(error)) => {
            // The only refusal of a body that is not about the body itself.
            if error.code == ApiError::body_budget().code {
                core.meters.body_budget_rejections.increment(1);
                return with_retry_after(error_response(&error), core.config.retry_after_seconds);
            }
            return error_response(&error);
        }
        None => {
            core.meters.timeout("body_read");
            return error_response(&ApiError::body_timeout());
        }
    };

    // Accept: a bounded number of requests in flight per core; past it, 429 right away
    // (cheaper for everyone than queueing behind engines that are already saturated).
    let admitted = core.admit();
    // Admitted or not, the body no longer counts against the budget: the in-flight limit
    // bounds admitted requests.
    drop(reservation);
    let Some(permit) = admitted else {
        core.meters.overload_rejections.increment(1);
        return with_retry_after(
            error_response(&ApiError::overloaded()),
            core.config.retry_after_seconds,
        );
    };
    let generation = match parse_generation_request(endpoint, &body) {
        Ok(generation) => generation,
        Err(error) => return error_response(&error),
    };
    if let Some(trace) = trace.as_mut() {
        describe_request(trace, &generation);
    }
    // A model no engine serves is refused before any work (404 `model_not_found`).
    let off_pool = match core.off_pool(&generation.model) {
        Ok(off_pool) => off_pool,
        Err(error) => return error_response(&error),
    };

    // Tokenize: render the chat template, then tokenize only the prompt's leading
    // `--tokenize-prefix-bytes` (with the per-core segment cache): a prefix that matches
    // nothing to its end cannot match further, so that is all routing needs.
    let tokenize_started = Instant::now();
    let prefix_limit = Some(core.config.tokenize_prefix_bytes).filter(|&limit| limit > 0);
    let rendered = {
        let tokenizer = core.tokenizer_for(&generation.model).borrow();
        let tools = match crate::openai::template_tools(
            &generation,
            &body,
            tokenizer.template_uses_tools(),
        ) {
            Ok(tools) => tools,
            Err(error) => return error_response(&error),
        };
        tokenizer.render_with_tools(&generation.prompt, tools.as_ref())
    };
    let tokenized = rendered.and_then(|rendered| {
        let mut tokenizer = core.tokenizer_for(&generation.model).borrow_mut();
        // A prefix that matched to its end before will again: go whole at once.
        let known_long =
            prefix_limit.is_some_and(|limit| tokenizer.is_known_long_prefix(&rendered, limit));
        let limit = if known_long { None } else { prefix_limit };
        let tokens = tokenizer.tokens(&rendered, limit)?;
        Ok((rendered, tokens, known_long))
    });
    let (rendered, mut tokens, known_long) = match tokenized {
        Ok(tokenized) => tokenized,
        Err(error) => return error_response(&ApiError::tokenize(&error)),
    };
    let mut tokenize_time = tokenize_started.elapsed();
    let mut tokenized_bytes = tokens.stats.tokenized_bytes;
    let mut extent = match (tokens.complete, known_long) {
        (_, true) => "known_long_prefix",
        (true, false) => "whole",
        (false, false) => "prefix",
    };

    // Lookup: this core's replica answers with every backend's match.
    let lookup_started = Instant::now();
    // Prompts of different LoRA adapters or cache salts share no cached block on the engine.
    let namespace = core.namespace_root(&generation.model, generation.cache_salt.as_deref());
    let mut query = core.routing.borrow().query_in(namespace, &tokens.ids);
    let mut answer = core.lookup(&query);
    let prefix_blocks = (tokens.ids.len() / core.config.block_size) as u32;
    // Only a prefix-first cut may be extended: a bound on work (a run too long, the budget) would
    // stop the whole prompt at the same place.
    if !tokens.complete
        && tokens.stats.truncation.is_none()
        && deepest_match(&answer).saturating_add(1) >= prefix_blocks
    {
        // The match reaches the end of what was tokenized: it may go further.
        let started = Instant::now();
        let whole = {
            let mut tokenizer = core.tokenizer_for(&generation.model).borrow_mut();
            if let Some(limit) = prefix_limit {
                tokenizer.remember_long_prefix(&rendered, limit);
            }
            tokenizer.tokens(&rendered, None)
        };
        tokens = match whole {
            Ok(whole) => whole,
            Err(error) => return error_response(&ApiError::tokenize(&error)),
        };
        tokenize_time += started.elapsed();
        tokenized_bytes += tokens.stats.tokenized_bytes;
        extent = "prefix_then_whole";
        query = core.routing.borrow().query_in(namespace, &tokens.ids);
        answer = core.lookup(&query);
    }
    if let Some(trace) = trace.as_mut() {
        trace.child(
            "tokenize",
            tokenize_started,
            tokenize_started + tokenize_time,
            vec![
                ("myelin.tokenize.extent", extent.into()),
                ("myelin.tokenize.bytes", tokenized_bytes.into()),
                (
                    "myelin.prompt_tokens",
                    (tokens.estimated_total as u64).into(),
                ),
            ],
        );
    }
    let meters = &core.meters;
    meters.tokenize_seconds.record(tokenize_time.as_secs_f64());
    meters.tokenize_prompts.get(extent).increment(1);
    meters
        .tokenize_cached_segments
        .increment(tokens.stats.cached_segments.into());
    meters
        .tokenize_segments
        .increment(tokens.stats.tokenized_segments.into());
    meters
        .tokenize_cached_prefix_bytes
        .increment(tokens.stats.cached_prefix_bytes.into());
    meters.tokenize_bytes.increment(tokenized_bytes);
    if let Some(truncation) = tokens.stats.truncation {
        meters
            .tokenize_truncated
            .get(truncation.as_str())
            .increment(1);
    }

    // Score: lowest expected cost wins.
    let prompt_tokens = tokens.estimated_total;
    let max_model_len = core.max_model_len();
    if let Some(limit) = max_model_len
        && let Err(error) = crate::openai::check_context(
            generation.max_tokens,
            tokens.complete.then_some(prompt_tokens as u64),
            limit,
        )
    {
        return error_response(&error);
    }
    // Backends that do not list the requested model are never tried (engines serving other
    // models or adapters), nor, on retries, those already tried.
    let mut tried: Vec<BackendId> = Vec::new();
    let excluded =
        |tried: &[BackendId]| -> Vec<BackendId> { off_pool.iter().chain(tried).copied().collect() };
    let shared = core.shared_tokens(&query.chain);
    let mut choice =
        core.routing
            .borrow_mut()
            .decide(&answer, prompt_tokens, &excluded(&tried), &shared);
    // `x-myelin-trace: 1`, honoured with --decision-trace: the decision's evidence goes back
    // in `x-myelin-decision` (the last decision's, after retries).
    let tracing = core.config.decision_trace
        && parts
            .headers
            .get(TRACE_REQUEST_HEADER)
            .is_some_and(|value| value.as_bytes() == b"1");
    let trace_of = |choice: &Option<crate::routing_glue::RouteChoice>| {
        tracing.then(|| {
            core.routing
                .borrow()
                .decision_trace(choice.as_ref().map(|chosen| chosen.backend))
        })
    };
    let mut decision_trace = trace_of(&choice);
    let decision_time = lookup_started
        .elapsed()
        .saturating_sub(if extent == "prefix_then_whole" {
            tokenize_time
        } else {
            Duration::ZERO
        });
    meters
        .routing_decision_seconds
        .record(decision_time.as_secs_f64());

    // Proxy: retried on another backend only before the first response byte.
    let mut upstream = UpstreamRequest {
        method: Method::POST,
        // The canonical path (a trailing slash was accepted), the client's query kept.
        path_and_query: match parts.uri.query() {
            Some(query) => format!("{}?{query}", endpoint.path()),
            None => endpoint.path().to_string(),
        },
        headers: proxy::end_to_end_headers(&parts.headers),
        body,
    };
    let decode_tokens =
        crate::backends::accounted_output_tokens(generation.max_tokens, max_model_len);
    // Tokenization parity: the engine's usage.prompt_tokens against the router's own count,
    // when the router tokenized the whole (single) prompt and the answer carries usage.
    let parity = (tokens.complete && !generation.batch && generation.usage_expected).then(|| {
        let kind = match generation.endpoint {
            Endpoint::ChatCompletions => PromptKind::Chat,
            Endpoint::Completions => PromptKind::Completion,
        };
        (tokens.ids.len() as u64, kind)
    });
    let mut backoff = core.config.retry_backoff;
    loop {
        let Some(chosen) = choice.take() else {
            return with_retry_after(error_response(&ApiError::no_backend()), 1);
        };
        let Some((base_url, selected)) = core
            .backends
            .borrow()
            .get(chosen.backend)
            .map(|entry| (entry.info.spec.url.clone(), entry.metrics.selected.clone()))
        else {
            return with_retry_after(error_response(&ApiError::no_backend()), 1);
        };
        let prefill_tokens = (prompt_tokens as u64).saturating_sub(chosen.expected_cached_tokens);
        let probe = core
            .routing
            .borrow()
            .probe(&answer, &chosen, prompt_tokens as u64);
        let history_cached = u64::from(chosen.matched_blocks) * core.config.block_size as u64;
        let admitted_prefill = (prompt_tokens as u64)
            .saturating_sub(history_cached.max(chosen.expected_cached_tokens));
        let mut load = core.start_load(
            chosen.backend,
            admitted_prefill,
            Prefill::of(prompt_tokens as u64, prefill_tokens),
            decode_tokens,
            PromptBlocks::new(query.chain.clone(), prompt_tokens as u64),
        );
        load.set_probe(probe);
        load.set_prediction(chosen.predicted_ttft);
        load.watch(generation.stream);
        if let Some(trace) = trace.as_mut() {
            describe_decision(trace, &chosen, tried.len());
            let traceparent =
                trace.begin_attempt(vec![("myelin.backend", u64::from(chosen.backend.0).into())]);
            upstream
                .headers
                .insert(http::HeaderName::from_static(TRACEPARENT), traceparent);
        }
        // A streaming answer's head comes before the first token; a non-streaming one's comes
        // with the whole completion, so it gets the longer deadline.
        let head_timeout = if generation.stream {
            core.config.upstream_header_timeout
        } else {
            core.config.upstream_response_timeout
        };
        let attempt = myelin_http::rt::timeout(
            head_timeout,
            proxy::attempt(&core.pool, &base_url, &upstream),
        );
        let attempted = if generation.stream {
            attempt.await
        } else {
            // A non-streaming answer's head is its end: its prompt counts as prefilled once
            // the predicted time to first token has passed, so that its decode is not priced
            // as prefill queued ahead of later requests (docs/routing.md).
            let mut attempt = std::pin::pin!(attempt);
            let predicted =
                Duration::from_secs_f64(chosen.predicted_ttft.seconds.clamp(0.0, 3600.0));
            let early = futures_lite::future::or(async { Some(attempt.as_mut().await) }, async {
                Timer::new(predicted).await;
                None
            })
            .await;
            match early {
                Some(attempted) => attempted,
                None => {
                    load.first_token(false);
                    attempt.await
                }
            }
        };
        let attempted = attempted.unwrap_or_else(|| {
            core.meters.timeout(if generation.stream {
                "upstream_header"
            } else {
                "upstream_response"
            });
            Attempt::Failed(FailedAttempt::Timeout(head_timeout))
        });
        let failure = match attempted {
            Attempt::Failed(failure) => failure,
            Attempt::Answered(response) => {
                if let Some(trace) = trace.as_mut() {
                    trace.set_attempt(
                        "http.response.status_code",
                        u64::from(response.status().as_u16()),
                    );
                    trace_status(trace, "the engine", response.status());
                }
                core.engine_progressed(chosen.backend);
                core.report_outcome(chosen.backend, !response.status().is_server_error());
                // Learn: the engine is working on this prompt now; every replica records it.
                if response.status().is_success() {
                    core.learn(&query, chosen.backend);
                }
                selected.increment(1);
                meters
                    .prefix_match_blocks
                    .record(f64::from(chosen.matched_blocks));
                if chosen.residency_downgrade {
                    meters.residency_downgrades.increment(1);
                }
                meters
                    .history_matched_tokens
                    .increment(chosen.history_matched_tokens);
                meters
                    .history_evicted_tokens
                    .increment(chosen.history_evicted_tokens);
                if chosen.prefix_replication {
                    meters.prefix_replications.increment(1);
                    core.note_prefix_replication(chosen.backend);
                }
                return with_trace(
                    relay_response(
                        response,
                        chosen.backend,
                        &generation,
                        arrived,
                        load,
                        permit,
                        core,
                        parity,
                        trace.take(),
                    ),
                    decision_trace,
                );
            }
        };

        // Nothing reached the client yet: another backend may take it. A non-streaming
        // request is retried only where the engine certainly did not run it (its own 502/503,
        // or it never received the request): after its bytes were sent, the engine may have
        // done the work (and after a timeout the client's own deadline has most likely
        // passed), so the client gets the error instead of a second run.
        core.report_outcome(chosen.backend, false);
        tried.push(chosen.backend);
        let reason = failure.retry_reason();
        if let Some(trace) = trace.as_mut() {
            trace.end_attempt(Some(reason.into()), Instant::now());
        }
        let retryable = generation.stream
            || match &failure {
                FailedAttempt::Status(_) => true,
                // The pool already resends a request a closed idle connection handed back
                // unwritten; any other HTTP error may come after the engine read it.
                FailedAttempt::Error(error) => error.is_connect(),
                FailedAttempt::Timeout(_) => false,
            };
        if retryable && tried.len() <= core.config.max_retries as usize {
            choice = core.routing.borrow_mut().decide(
                &answer,
                prompt_tokens,
                &excluded(&tried),
                &shared,
            );
            decision_trace = trace_of(&choice).or(decision_trace);
        }
        if choice.is_none() {
            return match failure {
                // The engine's own 502/503 goes through as it is.
                FailedAttempt::Status(response) => {
                    if let Some(trace) = trace.as_mut() {
                        trace_status(trace, "the engine", response.status());
                    }
                    with_trace(
                        relay_response(
                            response,
                            chosen.backend,
                            &generation,
                            arrived,
                            load,
                            permit,
                            core,
                            None,
                            trace.take(),
                        ),
                        decision_trace,
                    )
                }
                // Named by id: clients never learn the engines' addresses.
                FailedAttempt::Timeout(limit) => error_response(&ApiError {
                    status: StatusCode::GATEWAY_TIMEOUT,
                    message: format!(
                        "backend {} did not answer within {} ms",
                        chosen.backend,
                        limit.as_millis()
                    ),
                    error_type: "server_error",
                    param: None,
                    code: Some("upstream_timeout"),
                }),
                FailedAttempt::Error(error) => with_retry_after(
                    error_response(&ApiError::upstream(
                        StatusCode::BAD_GATEWAY,
                        format!(
                            "backend {} failed: {}",
                            chosen.backend,
                            proxy::describe_client_error(&error)
                        ),
                    )),
                    1,
                ),
            };
        }
        drop(failure);
        drop(load);
        meters.retries.get(reason).increment(1);
        Timer::new(backoff).await;
        backoff = backoff.saturating_mul(2);
    }
}

/// Reads a request body up to `limit` bytes (413 past it).
async fn read_body(
    mut body: Incoming,
    headers: &http::HeaderMap,
    limit: usize,
    mut reservation: Option<&mut Reservation>,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::body_too_large(limit));
    }
    // Held as the frames that arrived (memory grows only as bytes do: a client announcing
    // 8 MB and sending a byte a second holds what it sent), joined once at the end, so a large
    // body is copied once and one that came in one frame not at all. Past MAX_BODY_FRAMES
    // frames they are joined as they come, so tiny frames cannot cost more than their bytes.
    const MAX_BODY_FRAMES: usize = 16;
    let mut frames: Vec<Bytes> = Vec::new();
    let mut joined: Option<BytesMut> = None;
    let mut length = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| {
            ApiError::invalid_request(
                format!("could not read the request body: {error}"),
                None,
                "invalid_body",
            )
        })?;
        if let Ok(data) = frame.into_data() {
            if length + data.len() > limit {
                return Err(ApiError::body_too_large(limit));
            }
            // Counted before it is kept.
            if let Some(reservation) = reservation.as_deref_mut()
                && !reservation.grow(data.len())
            {
                return Err(ApiError::body_budget());
            }
            length += data.len();
            match joined.as_mut() {
                Some(joined) => joined.extend_from_slice(&data),
                None if frames.len() < MAX_BODY_FRAMES => frames.push(data),
                None => joined = Some(join(&frames, &data, length)),
            }
        }
    }
    Ok(match (joined, frames.len()) {
        (Some(joined), _) => joined.freeze(),
        (None, 0) => Bytes::new(),
        (None, 1) => frames.pop().unwrap_or_default(),
        (None, _) => join(&frames, &[], length).freeze(),
    })
}

/// `frames` then `last`, in one buffer of `length` bytes.
fn join(frames: &[Bytes], last: &[u8], length: usize) -> BytesMut {
    let mut joined = BytesMut::with_capacity(length);
    for frame in frames {
        joined.extend_from_slice(frame);
    }
    joined.extend_from_slice(last);
    joined
}

/// Reads an admin request's body (small, bounded).
pub async fn read_admin_body(request: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let (parts, body) = request.into_parts();
    read_body(body, &parts.headers, limit, None).await
}

/// Tracks one relayed response: TTFT, duration, stream breaks, client disconnects; holds the
/// request's load and in-flight slot until the body ends or is dropped.
struct ResponseObserver {
    core: Rc<DataCore>,
    backend: BackendId,
    route: &'static str,
    arrived: Instant,
    load: LoadGuard,
    _permit: InFlightPermit,
    /// The router's token count of the prompt and its kind, to compare with the engine's
    /// `usage.prompt_tokens` (`None`: not comparable).
    parity: Option<(u64, PromptKind)>,
    /// The answer is an event stream: its first byte is the first token's.
    streamed: bool,
    /// The request's spans (`--otlp-endpoint`, sampled), exported when the relay ends.
    trace: Option<RequestTrace>,
    /// `myelin_model_ttft_seconds` of the request's model.
    model_ttft: metrics::Histogram,
}

impl RelayObserver for ResponseObserver {
    fn first_byte(&mut self) {
        self.load.first_token(self.streamed);
        if let Some(trace) = self.trace.as_mut() {
            trace.set(
                "myelin.time_to_first_byte_ms",
                self.arrived.elapsed().as_secs_f64() * 1e3,
            );
        }
        let elapsed = self.arrived.elapsed().as_secs_f64();
        self.core.meters.ttft.get(self.route).record(elapsed);
        self.model_ttft.record(elapsed);
    }

    fn wants_usage(&self) -> bool {
        self.load.has_probe() || self.parity.is_some() || self.trace.is_some()
    }

    fn frame(&mut self) {
        self.core.engine_progressed(self.backend);
    }

    fn usage(&mut self, usage: Usage) {
        if let Some(trace) = self.trace.as_mut() {
            if let Some(prompt_tokens) = usage.prompt_tokens {
                trace.set("gen_ai.usage.input_tokens", prompt_tokens);
            }
            if let Some(cached_tokens) = usage.cached_tokens {
                trace.set("myelin.engine_cached_tokens", cached_tokens);
            }
        }
        if let Some(cached_tokens) = usage.cached_tokens {
            self.load.reuse_reported(cached_tokens);
        }
        if let (Some((router_tokens, kind)), Some(engine_tokens)) =
            (self.parity, usage.prompt_tokens)
            && router_tokens != engine_tokens
        {
            let url = self
                .core
                .backends
                .borrow()
                .get(self.backend)
                .map(|entry| entry.info.spec.url.clone());
            if let Some(url) = url {
                token_parity::check(self.backend, &url, router_tokens, engine_tokens, kind);
            }
        }
    }

    fn finished(&mut self, end: StreamEnd) {
        if let Some(trace) = self.trace.as_mut()
            && end != StreamEnd::Complete
        {
            trace.fail(format!("{end:?}"));
        }
        let meters = &self.core.meters;
        meters
            .duration
            .get(self.route)
            .record(self.arrived.elapsed().as_secs_f64());
        match end {
            StreamEnd::Complete => {}
            StreamEnd::UpstreamBroken => {
                meters.upstream_stream_errors.increment(1);
                self.core.report_outcome(self.backend, false);
            }
            StreamEnd::IdleTimeout => {
                meters.timeout("stream_idle");
                self.core.report_outcome(self.backend, false);
            }
            StreamEnd::Drained => meters.timeout("drain"),
            StreamEnd::ClientGone => meters.client_disconnects.increment(1),
        }
    }
}

/// The client's status on the server span, from `who` answered (the router itself, or the
/// engine whose answer is relayed); an error status fails the span.
fn trace_status(trace: &mut RequestTrace, who: &str, status: StatusCode) {
    trace.set("http.response.status_code", u64::from(status.as_u16()));
    if status.is_client_error() || status.is_server_error() {
        trace.fail(format!("{who} answered {status}"));
    }
}

/// The request's GenAI attributes on its server span (`{operation} {model}`).
fn describe_request(trace: &mut RequestTrace, generation: &GenerationRequest) {
    let operation = match generation.endpoint {
        Endpoint::ChatCompletions => "chat",
        Endpoint::Completions => "text_completion",
    };
    trace.set_name(&format!("{operation} {}", generation.model));
    trace.set("gen_ai.operation.name", operation);
    trace.set("gen_ai.request.model", generation.model.as_str());
    trace.set("http.request.method", "POST");
    trace.set("url.path", generation.endpoint.path());
    trace.set("myelin.stream", generation.stream);
    if let Some(max_tokens) = generation.max_tokens {
        trace.set("gen_ai.request.max_tokens", max_tokens);
    }
}

/// The routing decision's evidence on the server span (the last attempt's, after retries).
fn describe_decision(
    trace: &mut RequestTrace,
    chosen: &crate::routing_glue::RouteChoice,
    retries: usize,
) {
    trace.set("myelin.backend", u64::from(chosen.backend.0));
    trace.set("myelin.matched_blocks", u64::from(chosen.matched_blocks));
    trace.set(
        "myelin.expected_cached_tokens",
        chosen.expected_cached_tokens,
    );
    trace.set(
        "myelin.predicted_ttft_ms",
        chosen.predicted_ttft.seconds * 1e3,
    );
    trace.set("myelin.residency_downgrade", chosen.residency_downgrade);
    trace.set("myelin.prefix_replication", chosen.prefix_replication);
    trace.set("myelin.retries", retries as u64);
}

/// `response` with the decision trace in `x-myelin-decision`, when one was asked for.
fn with_trace(mut response: Response<Body>, trace: Option<String>) -> Response<Body> {
    if let Some(value) = trace.and_then(|trace| HeaderValue::from_str(&trace).ok()) {
        response.headers_mut().insert(TRACE_RESPONSE_HEADER, value);
    }
    response
}

/// The client's response: the engine's status and end-to-end headers, `x-myelin-backend`
/// (the backend's id, as the admin API lists it: never its address), and the body relayed
/// frame by frame.
#[allow(clippy::too_many_arguments)]
fn relay_response(
    response: Response<Incoming>,
    backend: BackendId,
    generation: &GenerationRequest,
    arrived: Instant,
    load: LoadGuard,
    permit: InFlightPermit,
    core: &Rc<DataCore>,
    parity: Option<(u64, PromptKind)>,
    trace: Option<RequestTrace>,
) -> Response<Body> {
    let (parts, body) = response.into_parts();
    let is_event_stream = proxy::is_event_stream(&parts.headers);
    let predicted_ttft = load.predicted_ttft_seconds();
    let model = core.meters.models.get(core.model_label(&generation.model));
    model.requests.increment(1);
    let observer = ResponseObserver {
        core: core.clone(),
        backend: load.backend(),
        route: generation.endpoint.path(),
        arrived,
        load,
        _permit: permit,
        parity,
        streamed: is_event_stream,
        trace,
        model_ttft: model.ttft,
    };
    let drain_expired = core.drain_expired.clone();
    let relayed = RelayBody::new(body, is_event_stream, observer)
        .with_idle_timeout(core.config.stream_idle_timeout)
        .with_cut_off(Box::pin(async move { drain_expired.wait().await }));
    let mut client_response = Response::new(Body::new(relayed));
    *client_response.status_mut() = parts.status;
    *client_response.headers_mut() = proxy::end_to_end_headers(&parts.headers);
    if let Some(length) = parts.headers.get(header::CONTENT_LENGTH) {
        client_response
            .headers_mut()
            .insert(header::CONTENT_LENGTH, length.clone());
    }
    client_response
        .headers_mut()
        .insert(BACKEND_HEADER, HeaderValue::from(backend.0));
    if let Some(seconds) = predicted_ttft.filter(|seconds| seconds.is_finite()) {
        client_response.headers_mut().insert(
            PREDICTED_TTFT_HEADER,
            HeaderValue::from((seconds * 1e6).clamp(0.0, 1e12) as u64),
        );
    }
    client_response
}

/// GET /v1/models: the union of every up backend's models, by id.
async fn models(core: &Rc<DataCore>) -> Response<Body> {
    let urls: Vec<String> = core
        .backends
        .borrow()
        .iter()
        .filter(|entry| entry.info.state == BackendState::Up)
        .map(|entry| entry.info.spec.url.clone())
        .collect();
    if urls.is_empty() {
        return with_retry_after(error_response(&ApiError::no_backend()), 1);
    }
    let fetches: Vec<_> = urls
        .into_iter()
        .map(|url| {
            let core = core.clone();
            glommio::spawn_local(async move {
                let fetched = myelin_http::rt::timeout(MODELS_TIMEOUT, fetch_models(&core, &url));
                fetched.await.unwrap_or_else(|| {
                    core.meters.timeout("models");
                    None
                })
            })
        })
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    let mut data = Vec::new();
    let mut answered = 0;
    for fetch in fetches {
        let Some(models) = fetch.await else {
            continue;
        };
        answered += 1;
        for model in models {
            let id = model.get("id").and_then(Value::as_str).map(str::to_string);
            if let Some(id) = id
                && seen.insert(id)
            {
                data.push(model);
            }
        }
    }
    if answered == 0 {
        return error_response(&ApiError::upstream(
            StatusCode::BAD_GATEWAY,
            "no backend answered GET /v1/models",
        ));
    }
    json_response(
        StatusCode::OK,
        &serde_json::json!({ "object": "list", "data": data }),
    )
}

async fn fetch_models(core: &DataCore, base_url: &str) -> Option<Vec<Value>> {
    let upstream = UpstreamRequest {
        method: Method::GET,
        path_and_query: "/v1/models".into(),
        headers: http::HeaderMap::new(),
        body: Bytes::new(),
    };
    let Attempt::Answered(response) = proxy::attempt(&core.pool, base_url, &upstream).await else {
        return None;
    };
    if !response.status().is_success() {
        return None;
    }
    let body = proxy::collect_limited(response.into_body(), MAX_MODELS_BODY_BYTES).await?;
    let value: Value = serde_json::from_slice(&body).ok()?;
    value.get("data")?.as_array().cloned()
}

/// GET /health: 200 when at least one backend is up.
fn health(core: &DataCore) -> Response<Body> {
    let backends = core.backends.borrow();
    let up = backends
        .iter()
        .filter(|entry| entry.info.state == BackendState::Up)
        .count();
    let status = if core.shutdown.is_triggered() {
        "draining"
    } else if up > 0 {
        "ok"
    } else {
        "unavailable"
    };
    let code = if status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(
        code,
        &serde_json::json!({ "status": status, "backends_up": up, "backends": backends.len() }),
    )
}

/// GET /metrics: Prometheus text.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(
            route_of(&Method::POST, "/v1/chat/completions", false),
            Ok(Route::Generate(Endpoint::ChatCompletions))
        );
        assert_eq!(
            route_of(&Method::GET, "/v1/models/", false),
            Ok(Route::Models)
        );
        let status =
            |method: Method, path: &str| route_of(&method, path, false).unwrap_err().status;
        // /metrics is on the admin API unless --metrics-on-client-port.
        assert_eq!(status(Method::GET, "/metrics"), StatusCode::NOT_FOUND);
        assert_eq!(route_of(&Method::GET, "/metrics", true), Ok(Route::Metrics));
        assert_eq!(
            status(Method::GET, "/v1/chat/completions"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            status(Method::POST, "/health"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(status(Method::GET, "/v2/chat"), StatusCode::NOT_FOUND);
        // The admin API is not on the client listener.
        for (method, path) in [
            (Method::GET, "/admin/backends"),
            (Method::POST, "/admin/backends"),
            (Method::DELETE, "/admin/backends/3"),
            (Method::POST, "/admin/backends/3/drain"),
        ] {
            assert_eq!(status(method, path), StatusCode::NOT_FOUND, "{path}");
        }
    }

    #[test]
    fn method_not_allowed_carries_allow_header() {
        let error = route_of(&Method::GET, "/v1/completions", false).unwrap_err();
        let response = error_response(&error);
        assert_eq!(response.headers()[header::ALLOW], "POST");
    }
}
