//! Metric names, their help texts and the Prometheus recorder (rendered by GET /metrics; no
//! exporter thread and no tokio: the control core runs the recorder's upkeep).

use std::cell::RefCell;
use std::collections::HashMap;

use metrics::{Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// GET /metrics: the Prometheus text of every series, wherever it is served (the admin API,
/// `--metrics-listen`, the client port with `--metrics-on-client-port`).
pub fn exposition(handle: &PrometheusHandle) -> http::Response<myelin_http::body::Body> {
    let mut response = http::Response::new(myelin_http::body::full(handle.render()));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    response
}

/// Requests answered, by `route` (path or `other`) and HTTP `status`.
pub const REQUESTS_TOTAL: &str = "myelin_requests_total";
/// Router-observed time from request arrival to the first response byte from the engine.
pub const TTFT_SECONDS: &str = "myelin_request_ttft_seconds";
/// Generation requests relayed to an engine, by served `model` (bounded: see [`ModelMeters`]).
pub const MODEL_REQUESTS_TOTAL: &str = "myelin_model_requests_total";
/// Arrival to the engine's first response body byte, by served `model`.
pub const MODEL_TTFT_SECONDS: &str = "myelin_model_ttft_seconds";
/// Router-observed time from request arrival to the end of the response body.
pub const REQUEST_DURATION_SECONDS: &str = "myelin_request_duration_seconds";
/// Time to decide a backend: owner-shard lookup (local or by message) plus scoring.
pub const ROUTING_DECISION_SECONDS: &str = "myelin_routing_decision_seconds";
/// Time to render the chat template and tokenize a prompt.
pub const TOKENIZE_SECONDS: &str = "myelin_tokenize_seconds";
/// Prompts tokenized, by `extent`: `whole` (short or token ids), `prefix` (only the leading
/// `--tokenize-prefix-bytes`: its match ended before its end), `prefix_then_whole` (the match
/// reached the prefix's end), `known_long_prefix` (whole at once: that prefix matched to its
/// end before).
pub const TOKENIZE_PROMPTS_TOTAL: &str = "myelin_tokenize_prompts_total";
/// Prompt segments whose token ids came from the per-core cache.
pub const TOKENIZE_CACHED_SEGMENTS_TOTAL: &str = "myelin_tokenize_cached_segments_total";
/// Leading prompt bytes whose token ids came from the prefix cache.
pub const TOKENIZE_CACHED_PREFIX_BYTES_TOTAL: &str = "myelin_tokenize_cached_prefix_bytes_total";
/// Prompt bytes tokenized afresh for routing (not served from a tokenizer cache).
pub const TOKENIZE_BYTES_TOTAL: &str = "myelin_tokenize_bytes_total";
/// Prompts whose routing tokenization stopped early, by `reason`: `length` (1 MiB looked at),
/// `long_piece` (a run of one character class over `--tokenize-max-piece-bytes`), `budget`
/// (`--tokenize-max-bytes` tokenized).
pub const TOKENIZE_TRUNCATED_TOTAL: &str = "myelin_tokenize_truncated_total";
/// Bytes held by each data core's tokenizer caches, by `cache` (segment, prefix) and `shard`.
pub const TOKENIZE_CACHE_BYTES: &str = "myelin_tokenize_cache_bytes";
/// Bytes of request bodies each data core holds while reading them (before admission), by
/// `shard` (`--max-body-buffer-bytes-per-core` bounds it).
pub const BODY_BUFFER_BYTES: &str = "myelin_body_buffer_bytes";
/// Prompt segments tokenized afresh (not from the segment cache).
pub const TOKENIZE_SEGMENTS_TOTAL: &str = "myelin_tokenize_segments_total";
/// Requests in flight on a backend, by `backend` (its URL).
pub const BACKEND_IN_FLIGHT: &str = "myelin_backend_in_flight_requests";
/// Times a backend was chosen, by `backend`.
pub const BACKEND_SELECTED_TOTAL: &str = "myelin_backend_selected_total";
/// 1 when a backend may receive requests (up, breaker closed, not draining), by `backend`.
pub const BACKEND_UP: &str = "myelin_backend_up";
/// Routing lookups served by each data core's replica, by `shard` (the core's index).
pub const LOOKUPS_TOTAL: &str = "myelin_router_lookups_total";
/// Prefix match length, in blocks, of the chosen backend.
pub const PREFIX_MATCH_BLOCKS: &str = "myelin_router_prefix_match_blocks";
/// The backend with the longest historical match lost because its residency was discounted.
pub const RESIDENCY_DOWNGRADES_TOTAL: &str = "myelin_router_residency_route_downgrades_total";
/// Requests sent to a second home of their prefix because the engine holding it had its KV
/// memory full (the expected wait for memory cost more than prefilling the prefix elsewhere).
pub const PREFIX_REPLICATIONS_TOTAL: &str = "myelin_router_prefix_replications_total";
/// Prompt tokens the prefix history matched, summed over every eligible backend of each
/// routed request.
pub const HISTORY_MATCHED_TOKENS_TOTAL: &str = "myelin_router_history_matched_tokens_total";
/// Of those, the tokens the residency mode found evicted: their ratio is the share of what
/// clients ask for again that the caches no longer hold (it scales the extra-prefill charge).
pub const HISTORY_EVICTED_TOKENS_TOTAL: &str = "myelin_router_history_evicted_tokens_total";
/// Spans the OTLP exporter delivered to the collector (`--otlp-endpoint`).
pub const OTLP_SPANS_EXPORTED_TOTAL: &str = "myelin_otlp_spans_exported_total";
/// Spans not delivered, by `reason`: `queue_full` (the exporter fell behind; a data core never
/// waits for it) or `export_failed` (the collector was unreachable, slow or refused the batch).
pub const OTLP_SPANS_DROPPED_TOTAL: &str = "myelin_otlp_spans_dropped_total";
/// Attempts sent to another backend before the first response byte, by `reason`.
pub const RETRIES_TOTAL: &str = "myelin_retries_total";
/// Circuit-breaker transitions, by `backend`, `from` and `to` (closed, open, half_open).
pub const BREAKER_TRANSITIONS_TOTAL: &str = "myelin_circuit_breaker_transitions_total";
/// Active health-check verdict changes, by `backend` and `to` (up, down).
pub const HEALTH_TRANSITIONS_TOTAL: &str = "myelin_health_check_transitions_total";
/// Engines found wedged by the progress watchdog (`--engine-stall-ms`), by `backend` and
/// `evidence` (`streams_silent`, `progress_counter_still`): each opened its breaker.
pub const ENGINE_STALLS_TOTAL: &str = "myelin_engine_stalls_total";
/// The `evidence` label values of [`ENGINE_STALLS_TOTAL`].
pub const STALL_EVIDENCE: [&str; 2] = ["streams_silent", "progress_counter_still"];
/// Messages sent between cores, by sending `shard` (`control` for the control core) and `kind`.
pub const CROSS_CORE_MESSAGES_TOTAL: &str = "myelin_cross_core_messages_total";
/// Messages dropped because the receiving core's queue was full, by `kind`.
pub const CROSS_CORE_DROPPED_TOTAL: &str = "myelin_cross_core_dropped_messages_total";
/// Age of a load update when another core applies it (staleness of the load view).
pub const LOAD_VIEW_STALENESS_SECONDS: &str = "myelin_load_view_staleness_seconds";
/// Requests refused with 429 because the core was at its in-flight limit.
pub const OVERLOAD_REJECTIONS_TOTAL: &str = "myelin_overload_rejections_total";
/// Requests refused with 429 because their body would take the core past
/// `--max-body-buffer-bytes-per-core`.
pub const BODY_BUDGET_REJECTIONS_TOTAL: &str = "myelin_body_budget_rejections_total";
/// Streams that broke after the first byte and were ended with an SSE error event.
pub const UPSTREAM_STREAM_ERRORS_TOTAL: &str = "myelin_upstream_stream_errors_total";
/// Deadlines that passed, by `kind`: `body_read` (client body, 408), `upstream_header`
/// (streaming request's head, retried), `upstream_response` (non-streaming answer, 504),
/// `stream_idle` (engine body silent, aborted), `models` (a backend's /v1/models),
/// `health_check` (an active check or breaker probe), `drain` (a response still running at the
/// drain deadline, ended with an SSE error event).
pub const TIMEOUTS_TOTAL: &str = "myelin_timeouts_total";
/// Every `kind` of [`TIMEOUTS_TOTAL`] (exported at 0 from the start).
pub const TIMEOUT_KINDS: &[&str] = &[
    "body_read",
    "upstream_header",
    "upstream_response",
    "stream_idle",
    "models",
    "health_check",
    "drain",
];

/// Counts one passed deadline of `kind` (one of [`TIMEOUT_KINDS`]).
pub fn timeout(kind: &'static str) {
    metrics::counter!(TIMEOUTS_TOTAL, "kind" => kind).increment(1);
}
/// Responses the client abandoned before their end (the upstream request was cancelled).
pub const CLIENT_DISCONNECTS_TOTAL: &str = "myelin_client_disconnects_total";
/// KV-event batches applied to the mirror, by backend (live and replayed).
pub const KV_EVENTS_BATCHES_TOTAL: &str = "myelin_kv_events_batches_total";
/// Blocks the KV-event feeds stored or removed in the mirror, by event.
pub const KV_EVENTS_BLOCKS_TOTAL: &str = "myelin_kv_events_blocks_total";
/// KV-event blocks not mirrored, by reason.
pub const KV_EVENTS_SKIPPED_BLOCKS_TOTAL: &str = "myelin_kv_events_skipped_blocks_total";
/// KV-event messages that could not be decoded (skipped), by backend.
pub const KV_EVENTS_DECODE_ERRORS_TOTAL: &str = "myelin_kv_events_decode_errors_total";
/// Gaps in a backend's KV-event sequence (batches the engine's PUB socket dropped).
pub const KV_EVENTS_GAPS_TOTAL: &str = "myelin_kv_events_gaps_total";
/// Engine restarts seen in the KV-event sequence (the mirror of that backend is cleared).
pub const KV_EVENTS_RESTARTS_TOTAL: &str = "myelin_kv_events_restarts_total";
/// Gaps in a backend's KV-event sequence that could not be filled (no replay socket, or batches
/// no longer buffered): its mirror was cleared and is not live until exact again, by backend.
pub const KV_EVENTS_UNSYNCED_TOTAL: &str = "myelin_kv_events_unsynced_total";
/// Cross-core state re-sent after a dropped message, by `kind`: `mirror` (a data core's mirror
/// rebuilt from the KV-event feeds), `backends` (the backend list, re-sent every second).
pub const STATE_RESYNCS_TOTAL: &str = "myelin_state_resyncs_total";
/// Gaps a data core found in the control core's numbered mirror writes (a write to it was
/// dropped): its mirrors are not routed on until their snapshots have rebuilt them.
pub const MIRROR_WRITE_GAPS_TOTAL: &str = "myelin_mirror_write_gaps_total";
/// Engine host-name resolutions on the resolver thread, by `result` (`ok`, `error`: the last
/// good address is kept).
pub const DNS_RESOLUTIONS_TOTAL: &str = "myelin_dns_resolutions_total";
/// Client connections closed on accept because `--max-connections-per-core` were open.
pub const CONNECTIONS_REFUSED_TOTAL: &str = "myelin_connections_refused_total";

/// Counts one connection refused at the cap (the server loop's `on_refused`).
pub fn connection_refused() {
    metrics::counter!(CONNECTIONS_REFUSED_TOTAL).increment(1);
}

/// TLS events of a listener (`listener`: client, admin or metrics; `event`: reloaded,
/// reload_failed, handshake_failed).
pub const TLS_EVENTS_TOTAL: &str = "myelin_tls_events_total";

/// Counts a TLS event of the client listener (the server loop's `on_tls`).
pub fn client_tls_event(event: myelin_http::tls::TlsEvent) {
    tls_event("client", event);
}

/// Counts a TLS event of the admin listener (the server loop's `on_tls`).
pub fn admin_tls_event(event: myelin_http::tls::TlsEvent) {
    tls_event("admin", event);
}

/// Counts a TLS event of the `--metrics-listen` listener (the server loop's `on_tls`).
pub fn metrics_tls_event(event: myelin_http::tls::TlsEvent) {
    tls_event("metrics", event);
}

fn tls_event(listener: &'static str, event: myelin_http::tls::TlsEvent) {
    use myelin_http::tls::TlsEvent;
    metrics::counter!(TLS_EVENTS_TOTAL, "listener" => listener, "event" => event.name())
        .increment(1);
    match event {
        TlsEvent::Reloaded => {
            eprintln!("myelin: {listener} listener: TLS certificate files changed, reloaded");
        }
        TlsEvent::ReloadFailed(why) => eprintln!(
            "myelin: {listener} listener: the changed TLS certificate files do not load (the \
             previous certificate stays in use until they change again): {why}"
        ),
        TlsEvent::HandshakeFailed => {}
    }
}

/// 1 while a backend's KV-event mirror is live (in sync), by backend.
pub const KV_EVENTS_LIVE: &str = "myelin_kv_events_live";
/// 1 while a backend's live mirror is partial (it may lack blocks the engine cached before the
/// router saw its stream, or before a gap), by backend.
pub const KV_EVENTS_PARTIAL: &str = "myelin_kv_events_partial";
/// The block size of a backend's KV events while it is not the router's `--block-size` (its
/// cache is then not mirrored), 0 otherwise, by backend.
pub const KV_EVENTS_BLOCK_SIZE_MISMATCH: &str = "myelin_kv_events_block_size_mismatch";
/// Fraction of a backend's KV cache in use, as its metrics endpoint reports it, by backend.
pub const BACKEND_KV_UTILIZATION: &str = "myelin_backend_kv_utilization";
/// Reported minus predicted cached prompt tokens of each estimated request whose engine
/// reported its reuse (`usage.prompt_tokens_details.cached_tokens`).
pub const RESIDENCY_PREDICTED_VS_REPORTED_TOKENS: &str =
    "myelin_residency_predicted_vs_reported_tokens";
/// Predicted minus observed time to first token of each streamed request, seconds (send to the
/// engine's first byte; the prediction is the routing cost's, made when it was sent).
pub const TTFT_PREDICTION_ERROR: &str = "myelin_router_ttft_prediction_error";
/// |predicted − observed| / observed time to first token of each streamed request.
pub const TTFT_PREDICTION_RELATIVE_ERROR: &str = "myelin_router_ttft_prediction_relative_error";
/// Reuse reports of estimated requests, by `outcome`: `as_history` (the engine reused at least
/// what history said), `short` (less: an eviction the estimate learns from).
pub const RESIDENCY_REUSE_REPORTS_TOTAL: &str = "myelin_residency_reuse_reports_total";
/// Counter: answers whose `usage.prompt_tokens` differs from the router's own token count for
/// the request, by backend (`token_parity`).
pub const TOKENIZATION_MISMATCH_TOTAL: &str = "myelin_tokenization_mismatch_total";

/// The handles a data core records into on its request path, registered once per core (and
/// per label value on its first use): `metrics::counter!` and friends look the series up in the
/// recorder's registry, a sharded map behind read-write locks, on every call, whereas a handle
/// is an `Arc` of the series' atomics. Nothing here is shared between cores except those
/// atomics, so recording takes no lock. Per-backend handles are in [`BackendMetrics`].
pub struct CoreMetrics {
    pub client_disconnects: Counter,
    pub overload_rejections: Counter,
    pub body_budget_rejections: Counter,
    pub tokenize_seconds: Histogram,
    pub tokenize_cached_segments: Counter,
    pub tokenize_segments: Counter,
    pub tokenize_cached_prefix_bytes: Counter,
    pub tokenize_bytes: Counter,
    pub routing_decision_seconds: Histogram,
    pub prefix_match_blocks: Histogram,
    pub residency_downgrades: Counter,
    pub prefix_replications: Counter,
    pub history_matched_tokens: Counter,
    pub history_evicted_tokens: Counter,
    pub upstream_stream_errors: Counter,
    pub load_view_staleness: Histogram,
    pub residency_predicted_vs_reported: Histogram,
    pub ttft_prediction_error: Histogram,
    pub ttft_prediction_relative_error: Histogram,
    pub backend_resyncs: Counter,
    pub mirror_write_gaps: Counter,
    /// Pins of in-flight prompts released because their unpin was lost (`pins.rs`).
    pub pins_reconciled: Counter,
    /// By `extent`.
    pub tokenize_prompts: Family<Counter>,
    /// By `reason`.
    pub tokenize_truncated: Family<Counter>,
    /// By `reason`.
    pub retries: Family<Counter>,
    /// By `kind` (see [`TIMEOUT_KINDS`]).
    pub timeouts: Family<Counter>,
    /// By `route`.
    pub ttft: Family<Histogram>,
    /// By `route`.
    pub duration: Family<Histogram>,
    /// By `outcome`.
    pub reuse_reports: Family<Counter>,
    /// By `kind`, this core's `shard` label fixed.
    pub cross_core_messages: Family<Counter>,
    /// By `kind`.
    pub cross_core_dropped: Family<Counter>,
    /// `myelin_requests_total` by `route` and `status`.
    requests: RefCell<HashMap<(&'static str, u16), Counter>>,
    /// By served `model`.
    pub models: ModelMeters,
}

impl CoreMetrics {
    /// Registers the handles of the core whose `shard` label is `shard`.
    pub fn new(shard: &str) -> Self {
        let shard = shard.to_string();
        CoreMetrics {
            client_disconnects: metrics::counter!(CLIENT_DISCONNECTS_TOTAL),
            overload_rejections: metrics::counter!(OVERLOAD_REJECTIONS_TOTAL),
            body_budget_rejections: metrics::counter!(BODY_BUDGET_REJECTIONS_TOTAL),
            tokenize_seconds: metrics::histogram!(TOKENIZE_SECONDS),
            tokenize_cached_segments: metrics::counter!(TOKENIZE_CACHED_SEGMENTS_TOTAL),
            tokenize_segments: metrics::counter!(TOKENIZE_SEGMENTS_TOTAL),
            tokenize_cached_prefix_bytes: metrics::counter!(TOKENIZE_CACHED_PREFIX_BYTES_TOTAL),
            tokenize_bytes: metrics::counter!(TOKENIZE_BYTES_TOTAL),
            routing_decision_seconds: metrics::histogram!(ROUTING_DECISION_SECONDS),
            prefix_match_blocks: metrics::histogram!(PREFIX_MATCH_BLOCKS),
            residency_downgrades: metrics::counter!(RESIDENCY_DOWNGRADES_TOTAL),
            prefix_replications: metrics::counter!(PREFIX_REPLICATIONS_TOTAL),
            history_matched_tokens: metrics::counter!(HISTORY_MATCHED_TOKENS_TOTAL),
            history_evicted_tokens: metrics::counter!(HISTORY_EVICTED_TOKENS_TOTAL),
            upstream_stream_errors: metrics::counter!(UPSTREAM_STREAM_ERRORS_TOTAL),
            load_view_staleness: metrics::histogram!(LOAD_VIEW_STALENESS_SECONDS),
            residency_predicted_vs_reported: metrics::histogram!(
                RESIDENCY_PREDICTED_VS_REPORTED_TOKENS
            ),
            ttft_prediction_error: metrics::histogram!(TTFT_PREDICTION_ERROR),
            ttft_prediction_relative_error: metrics::histogram!(TTFT_PREDICTION_RELATIVE_ERROR),
            backend_resyncs: metrics::counter!(STATE_RESYNCS_TOTAL, "kind" => "backends"),
            mirror_write_gaps: metrics::counter!(MIRROR_WRITE_GAPS_TOTAL),
            pins_reconciled: metrics::counter!(STATE_RESYNCS_TOTAL, "kind" => "kv_pins"),
            tokenize_prompts: Family::new(
                |extent| metrics::counter!(TOKENIZE_PROMPTS_TOTAL, "extent" => extent),
            ),
            tokenize_truncated: Family::new(
                |reason| metrics::counter!(TOKENIZE_TRUNCATED_TOTAL, "reason" => reason),
            ),
            retries: Family::new(|reason| metrics::counter!(RETRIES_TOTAL, "reason" => reason)),
            timeouts: Family::new(|kind| metrics::counter!(TIMEOUTS_TOTAL, "kind" => kind)),
            ttft: Family::new(|route| metrics::histogram!(TTFT_SECONDS, "route" => route)),
            duration: Family::new(
                |route| metrics::histogram!(REQUEST_DURATION_SECONDS, "route" => route),
            ),
            reuse_reports: Family::new(
                |outcome| metrics::counter!(RESIDENCY_REUSE_REPORTS_TOTAL, "outcome" => outcome),
            ),
            cross_core_messages: Family::new(move |kind| {
                metrics::counter!(
                    CROSS_CORE_MESSAGES_TOTAL, "shard" => shard.clone(), "kind" => kind
                )
            }),
            cross_core_dropped: Family::new(
                |kind| metrics::counter!(CROSS_CORE_DROPPED_TOTAL, "kind" => kind),
            ),
            requests: RefCell::new(HashMap::new()),
            models: ModelMeters::default(),
        }
    }

    /// Counts one answered request (`myelin_requests_total{route, status}`).
    pub fn request(&self, route: &'static str, status: u16) {
        if let Some(counter) = self.requests.borrow().get(&(route, status)) {
            counter.increment(1);
            return;
        }
        let counter = metrics::counter!(
            REQUESTS_TOTAL, "route" => route, "status" => status.to_string()
        );
        counter.increment(1);
        self.requests.borrow_mut().insert((route, status), counter);
    }

    /// Counts one passed deadline of `kind` (one of [`TIMEOUT_KINDS`]).
    pub fn timeout(&self, kind: &'static str) {
        self.timeouts.get(kind).increment(1);
    }
}

/// The per-model metrics' handles (`myelin_model_requests_total`, `myelin_model_ttft_seconds`)
/// by model, registered on first use. The label is a client's string, so its values are bounded
/// twice: the caller passes only names an engine serves or the configuration names (others
/// count as [`OTHER_MODEL`]), and past [`MAX_MODEL_LABELS`] names a core counts the rest as
/// [`OTHER_MODEL`] too.
#[derive(Default)]
pub struct ModelMeters {
    handles: RefCell<Vec<(String, ModelHandles)>>,
}

/// One model's handles.
#[derive(Clone)]
pub struct ModelHandles {
    pub requests: Counter,
    pub ttft: Histogram,
}

/// The `model` label of requests for models the router does not know to be served.
pub const OTHER_MODEL: &str = "other";

/// Most distinct `model` label values per data core (besides [`OTHER_MODEL`]).
pub const MAX_MODEL_LABELS: usize = 64;

impl ModelMeters {
    /// The handles of `model` (`None`: not a known model, counted as [`OTHER_MODEL`]).
    pub fn get(&self, model: Option<&str>) -> ModelHandles {
        let model = model.unwrap_or(OTHER_MODEL);
        let mut known = self.handles.borrow_mut();
        let listed = |known: &[(String, ModelHandles)], label: &str| {
            known.iter().position(|(name, _)| name == label)
        };
        // Past the bound a new name counts as `other`; known names keep their own.
        let label = match listed(&known, model) {
            None if known.len() >= MAX_MODEL_LABELS => OTHER_MODEL,
            _ => model,
        };
        if let Some(index) = listed(&known, label) {
            return known[index].1.clone();
        }
        let handles = ModelHandles {
            requests: metrics::counter!(MODEL_REQUESTS_TOTAL, "model" => label.to_string()),
            ttft: metrics::histogram!(MODEL_TTFT_SECONDS, "model" => label.to_string()),
        };
        known.push((label.to_string(), handles.clone()));
        handles
    }
}

/// One metric's handles by the value of its one free label, registered on first use. The label
/// values are a small fixed set (`&'static str`), so a scan of a short list finds them.
pub struct Family<T> {
    handles: RefCell<Vec<(&'static str, T)>>,
    register: Box<dyn Fn(&'static str) -> T>,
}

impl<T: Clone> Family<T> {
    fn new(register: impl Fn(&'static str) -> T + 'static) -> Self {
        Family {
            handles: RefCell::new(Vec::new()),
            register: Box::new(register),
        }
    }

    /// The handle for `value` (an `Arc` clone).
    pub fn get(&self, value: &'static str) -> T {
        if let Some((_, handle)) = self.handles.borrow().iter().find(|(v, _)| *v == value) {
            return handle.clone();
        }
        let handle = (self.register)(value);
        self.handles.borrow_mut().push((value, handle.clone()));
        handle
    }
}

/// A backend's labelled handles on one data core, registered when the core adds the backend
/// (kept with it in the core's backend table, `backends.rs`).
#[derive(Debug, Clone)]
pub struct BackendMetrics {
    /// `myelin_backend_selected_total{backend}`.
    pub selected: Counter,
    /// `myelin_backend_in_flight_requests{backend}`.
    pub in_flight: Gauge,
}

impl BackendMetrics {
    /// Registers the handles of backend `id` ([`backend_label`]).
    pub fn new(id: myelin_routing::BackendId) -> Self {
        BackendMetrics {
            selected: metrics::counter!(BACKEND_SELECTED_TOTAL, "backend" => backend_label(id)),
            in_flight: metrics::gauge!(BACKEND_IN_FLIGHT, "backend" => backend_label(id)),
        }
    }
}

/// Histogram buckets for `_seconds` metrics: 10 µs to 60 s.
const SECONDS_BUCKETS: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Histogram buckets for prefix-match lengths in blocks.
const BLOCK_BUCKETS: &[f64] = &[
    0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];

/// Histogram buckets for signed token differences (reported minus predicted cached tokens).
const SIGNED_TOKEN_BUCKETS: &[f64] = &[
    -65536.0, -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 1.0, 16.0, 64.0, 256.0,
    1024.0, 4096.0, 16384.0, 65536.0,
];

/// Histogram buckets for signed prediction errors in seconds (predicted minus observed TTFT).
const SIGNED_SECONDS_BUCKETS: &[f64] = &[
    -30.0, -10.0, -5.0, -2.5, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Histogram buckets for relative errors (|predicted − observed| / observed).
const RELATIVE_BUCKETS: &[f64] = &[0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0];

/// Installs the process-wide recorder and returns the handle that renders it. Called once;
/// a second call (tests running several servers in one process) keeps the first recorder.
pub fn install() -> PrometheusHandle {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .and_then(|builder| {
            builder.set_buckets_for_metric(Matcher::Full(PREFIX_MATCH_BLOCKS.into()), BLOCK_BUCKETS)
        })
        .and_then(|builder| {
            builder.set_buckets_for_metric(
                Matcher::Full(RESIDENCY_PREDICTED_VS_REPORTED_TOKENS.into()),
                SIGNED_TOKEN_BUCKETS,
            )
        })
        .and_then(|builder| {
            builder.set_buckets_for_metric(
                Matcher::Full(TTFT_PREDICTION_ERROR.into()),
                SIGNED_SECONDS_BUCKETS,
            )
        })
        .and_then(|builder| {
            builder.set_buckets_for_metric(
                Matcher::Full(TTFT_PREDICTION_RELATIVE_ERROR.into()),
                RELATIVE_BUCKETS,
            )
        });
    let recorder = match builder {
        Ok(builder) => builder.build_recorder(),
        // Only fails on empty bucket lists, which the constants above are not.
        Err(_) => PrometheusBuilder::new().build_recorder(),
    };
    let handle = recorder.handle();
    // Fails only when a recorder is already installed (in-process tests): keep that one.
    let _ = metrics::set_global_recorder(recorder);
    describe();
    // Counters without labels are exported from the start, so a scrape before the first event
    // reads 0 instead of a missing series (dashboards and the harness rate() them).
    for counter in [
        RESIDENCY_DOWNGRADES_TOTAL,
        PREFIX_REPLICATIONS_TOTAL,
        HISTORY_MATCHED_TOKENS_TOTAL,
        HISTORY_EVICTED_TOKENS_TOTAL,
        OVERLOAD_REJECTIONS_TOTAL,
        UPSTREAM_STREAM_ERRORS_TOTAL,
        CLIENT_DISCONNECTS_TOTAL,
        TOKENIZE_BYTES_TOTAL,
        CONNECTIONS_REFUSED_TOTAL,
    ] {
        metrics::counter!(counter).increment(0);
    }
    for kind in TIMEOUT_KINDS {
        metrics::counter!(TIMEOUTS_TOTAL, "kind" => *kind).increment(0);
    }
    for listener in ["client", "admin", "metrics"] {
        for event in myelin_http::tls::TlsEvent::NAMES {
            metrics::counter!(TLS_EVENTS_TOTAL, "listener" => listener, "event" => event)
                .increment(0);
        }
    }
    for reason in RETRY_REASONS {
        metrics::counter!(RETRIES_TOTAL, "reason" => *reason).increment(0);
    }
    for reason in KV_SKIP_REASONS {
        metrics::counter!(KV_EVENTS_SKIPPED_BLOCKS_TOTAL, "reason" => *reason).increment(0);
    }
    handle
}

/// Every `reason` of `myelin_retries_total` (`FailedAttempt::retry_reason`).
pub const RETRY_REASONS: &[&str] = &[
    "status_502",
    "status_503",
    "connect",
    "no_response",
    "header_timeout",
];

/// Every `reason` of `myelin_kv_events_skipped_blocks_total` (`kv_subscriber.rs`).
pub const KV_SKIP_REASONS: &[&str] = &[
    "other_cache",
    "lora",
    "extra_keys",
    "block_size",
    "malformed",
    "orphan",
    "unknown_removal",
];

/// The `backend` label of a backend's series: its id, as `GET /admin/backends` and the
/// `x-myelin-backend` header show it (engine addresses stay on the admin API).
pub fn backend_label(id: myelin_routing::BackendId) -> String {
    id.to_string()
}

/// Exports a backend's labelled counters and gauges at 0 from when it is added (Prometheus'
/// advice: an alert on `rate(...)` or `> 0` over a series that does not exist yet never
/// fires); the KV-event series too when it publishes KV events.
pub fn export_backend_series(id: myelin_routing::BackendId, kv_events: bool) {
    let label = backend_label(id);
    metrics::counter!(TOKENIZATION_MISMATCH_TOTAL, "backend" => label.clone()).increment(0);
    for to in ["up", "down"] {
        metrics::counter!(HEALTH_TRANSITIONS_TOTAL, "backend" => label.clone(), "to" => to)
            .increment(0);
    }
    for evidence in STALL_EVIDENCE {
        metrics::counter!(ENGINE_STALLS_TOTAL, "backend" => label.clone(), "evidence" => evidence)
            .increment(0);
    }
    if kv_events {
        for counter in [
            KV_EVENTS_BATCHES_TOTAL,
            KV_EVENTS_DECODE_ERRORS_TOTAL,
            KV_EVENTS_GAPS_TOTAL,
            KV_EVENTS_RESTARTS_TOTAL,
            KV_EVENTS_UNSYNCED_TOTAL,
        ] {
            metrics::counter!(counter, "backend" => label.clone()).increment(0);
        }
        metrics::gauge!(KV_EVENTS_PARTIAL, "backend" => label.clone()).set(0.0);
        metrics::gauge!(KV_EVENTS_BLOCK_SIZE_MISMATCH, "backend" => label).set(0.0);
    }
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(REQUESTS_TOTAL, "Requests answered, by route and status.");
    describe_counter!(
        OTLP_SPANS_EXPORTED_TOTAL,
        "Spans the OTLP exporter delivered to the collector."
    );
    describe_counter!(
        OTLP_SPANS_DROPPED_TOTAL,
        "Spans not delivered, by reason (queue_full, export_failed)."
    );
    describe_counter!(
        TOKENIZATION_MISMATCH_TOTAL,
        "Answers whose usage.prompt_tokens differs from the router's own token count of the \
         prompt (a different chat template or tokenizer than the engine's), by backend."
    );
    describe_histogram!(
        TTFT_PREDICTION_ERROR,
        Unit::Seconds,
        "Predicted minus observed time to first token (send to first byte), streamed requests."
    );
    describe_histogram!(
        TTFT_PREDICTION_RELATIVE_ERROR,
        "|predicted - observed| / observed time to first token, streamed requests."
    );
    describe_histogram!(
        TTFT_SECONDS,
        Unit::Seconds,
        "Arrival to first response byte."
    );
    describe_counter!(
        MODEL_REQUESTS_TOTAL,
        "Generation requests relayed to an engine, by served model (other: not known to be served)."
    );
    describe_histogram!(
        MODEL_TTFT_SECONDS,
        Unit::Seconds,
        "Arrival to first response byte of relayed generation requests, by served model."
    );
    describe_histogram!(
        REQUEST_DURATION_SECONDS,
        Unit::Seconds,
        "Arrival to end of the response."
    );
    describe_histogram!(
        ROUTING_DECISION_SECONDS,
        Unit::Seconds,
        "Owner-shard lookup plus scoring."
    );
    describe_histogram!(
        TOKENIZE_SECONDS,
        Unit::Seconds,
        "Template rendering plus tokenization."
    );
    describe_counter!(
        TOKENIZE_PROMPTS_TOTAL,
        "Prompts tokenized, by how much of them."
    );
    describe_counter!(
        TOKENIZE_CACHED_SEGMENTS_TOTAL,
        "Prompt segments served from cache."
    );
    describe_counter!(TOKENIZE_SEGMENTS_TOTAL, "Prompt segments tokenized afresh.");
    describe_counter!(
        TOKENIZE_CACHED_PREFIX_BYTES_TOTAL,
        Unit::Bytes,
        "Leading prompt bytes whose token ids came from the prefix cache."
    );
    describe_gauge!(
        TOKENIZE_CACHE_BYTES,
        Unit::Bytes,
        "Bytes held by each data core's tokenizer caches, by cache and shard."
    );
    describe_gauge!(
        BODY_BUFFER_BYTES,
        Unit::Bytes,
        "Bytes of request bodies each data core holds while reading them, by shard."
    );
    describe_gauge!(BACKEND_IN_FLIGHT, "Requests in flight per backend.");
    describe_gauge!(
        BACKEND_KV_UTILIZATION,
        "Fraction of the backend's KV cache in use (its metrics endpoint)."
    );
    describe_histogram!(
        RESIDENCY_PREDICTED_VS_REPORTED_TOKENS,
        "Reported minus predicted cached prompt tokens of estimated requests."
    );
    describe_counter!(
        RESIDENCY_REUSE_REPORTS_TOTAL,
        "Engines' reuse reports of estimated requests, by outcome."
    );
    describe_counter!(BACKEND_SELECTED_TOTAL, "Times each backend was chosen.");
    describe_gauge!(BACKEND_UP, "1 when the backend may receive requests.");
    describe_counter!(
        LOOKUPS_TOTAL,
        "Routing lookups served by each data core's own replica, by shard."
    );
    describe_histogram!(
        PREFIX_MATCH_BLOCKS,
        "Matched prefix blocks of the chosen backend."
    );
    describe_counter!(
        RESIDENCY_DOWNGRADES_TOTAL,
        "Longest historical match not chosen because its residency was discounted."
    );
    describe_counter!(
        PREFIX_REPLICATIONS_TOTAL,
        "Requests sent to a second home of their prefix because the engine holding it had its KV memory full."
    );
    describe_counter!(
        HISTORY_MATCHED_TOKENS_TOTAL,
        "Prompt tokens the prefix history matched, over every eligible backend of each routed request."
    );
    describe_counter!(
        HISTORY_EVICTED_TOKENS_TOTAL,
        "Prompt tokens the prefix history matched that the residency mode found evicted."
    );
    describe_counter!(
        RETRIES_TOTAL,
        "Retries on another backend before the first byte."
    );
    describe_counter!(
        BREAKER_TRANSITIONS_TOTAL,
        "Circuit-breaker state transitions."
    );
    describe_counter!(
        HEALTH_TRANSITIONS_TOTAL,
        "Active health-check verdict changes."
    );
    describe_counter!(
        ENGINE_STALLS_TOTAL,
        "Engines found wedged (requests in flight, nothing sent for --engine-stall-ms): each opened its breaker."
    );
    describe_counter!(CROSS_CORE_MESSAGES_TOTAL, "Messages sent between cores.");
    describe_counter!(
        CROSS_CORE_DROPPED_TOTAL,
        "Cross-core messages dropped on a full queue."
    );
    describe_histogram!(
        LOAD_VIEW_STALENESS_SECONDS,
        Unit::Seconds,
        "Age of load updates when applied by another core."
    );
    describe_counter!(OVERLOAD_REJECTIONS_TOTAL, "Requests refused with 429.");
    describe_counter!(
        UPSTREAM_STREAM_ERRORS_TOTAL,
        "Streams broken after the first byte."
    );
    describe_counter!(
        CLIENT_DISCONNECTS_TOTAL,
        "Responses abandoned by the client."
    );
    describe_counter!(TIMEOUTS_TOTAL, "Deadlines that passed, by kind.");
    describe_counter!(
        KV_EVENTS_UNSYNCED_TOTAL,
        "KV-event gaps that could not be filled (mirror cleared, not live until exact)."
    );
    describe_counter!(
        DNS_RESOLUTIONS_TOTAL,
        "Engine host-name resolutions off the executors, by result."
    );
    describe_counter!(
        STATE_RESYNCS_TOTAL,
        "Cross-core state re-sent after a dropped message, by kind."
    );
    describe_counter!(
        MIRROR_WRITE_GAPS_TOTAL,
        "Lost mirror writes a data core noticed: its mirrors are not routed on until rebuilt."
    );
    describe_counter!(
        TOKENIZE_BYTES_TOTAL,
        "Prompt bytes tokenized afresh for routing."
    );
    describe_counter!(
        TOKENIZE_TRUNCATED_TOTAL,
        "Prompts whose routing tokenization stopped early, by reason."
    );
    describe_counter!(
        KV_EVENTS_BATCHES_TOTAL,
        "KV-event batches applied to the verified mirror."
    );
    describe_counter!(
        KV_EVENTS_BLOCKS_TOTAL,
        "Blocks stored or removed in the verified mirror."
    );
    describe_counter!(
        KV_EVENTS_SKIPPED_BLOCKS_TOTAL,
        "KV-event blocks not mirrored, by reason."
    );
    describe_counter!(
        KV_EVENTS_DECODE_ERRORS_TOTAL,
        "KV-event messages that could not be decoded."
    );
    describe_counter!(KV_EVENTS_GAPS_TOTAL, "Gaps in KV-event sequences.");
    describe_counter!(
        KV_EVENTS_RESTARTS_TOTAL,
        "Engine restarts seen in KV-event sequences."
    );
    describe_gauge!(
        KV_EVENTS_LIVE,
        "1 while a backend's KV-event mirror is in sync."
    );
    describe_gauge!(
        KV_EVENTS_PARTIAL,
        "1 while a backend's live KV-event mirror is partial (may lack blocks cached before it)."
    );
    describe_counter!(
        CONNECTIONS_REFUSED_TOTAL,
        "Client connections closed on accept at --max-connections-per-core."
    );
    describe_counter!(
        TLS_EVENTS_TOTAL,
        "TLS events by listener (client, admin): certificate reloads, failed reloads, failed handshakes."
    );
    describe_gauge!(
        KV_EVENTS_BLOCK_SIZE_MISMATCH,
        "Block size of a backend's KV events while it is not the router's (not mirrored), else 0."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_labels_are_bounded_per_core() {
        let meters = ModelMeters::default();
        let labels = |meters: &ModelMeters| -> Vec<String> {
            meters
                .handles
                .borrow()
                .iter()
                .map(|(name, _)| name.clone())
                .collect()
        };
        meters.get(Some("a"));
        meters.get(None);
        meters.get(Some("a"));
        assert_eq!(labels(&meters), ["a", OTHER_MODEL]);
        for index in 0..2 * MAX_MODEL_LABELS {
            meters.get(Some(&format!("m{index}")));
        }
        let all = labels(&meters);
        assert_eq!(all.len(), MAX_MODEL_LABELS);
        assert_eq!(all.iter().filter(|name| *name == OTHER_MODEL).count(), 1);
        // Past the bound every new name counts as `other`, known ones keep their own.
        meters.get(Some("one-more"));
        meters.get(Some("a"));
        assert_eq!(labels(&meters), all);
    }
}
