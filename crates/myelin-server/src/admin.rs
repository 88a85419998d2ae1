//! The admin API: list, add, remove and drain backends at run time. It is served by the
//! control core on its own listener (`--admin-listen`, loopback by default), never on the
//! client port, and requires `Authorization: Bearer TOKEN` when `--admin-token-file` is set.
//! Changes are made on the control core, which answers once every data core has them.

use std::rc::Rc;
use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use myelin_http::body::Body;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::backend_spec::BackendSpec;
use crate::backends::{BackendId, BackendInfo, Load};
use crate::config::AdminListen;
use crate::control::{AdminOp, AdminOutcome, AdminServer, Control};
use crate::kv_subscriber::MirrorStatus;
use crate::messages::ReplicaSnapshot;
use crate::metrics as names;
use crate::openai::{ApiError, Endpoint};
use crate::request_path::{error_response, json_response};

/// Largest admin request body.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;
/// Time an admin client has to send its (small) body.
const ADMIN_BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the admin API's listener (`--admin-listen`: TCP, or a Unix socket) and serves it on
/// this (the control) core until `shutdown` ([`crate::control::StartAdmin`]).
/// With `tls`, over HTTPS (client certificates too when its files name a client CA).
pub fn start(
    control: &Rc<Control>,
    listen: &AdminListen,
    tls: Option<&myelin_http::tls::ServerTls>,
    shutdown: myelin_http::server::Shutdown,
) -> Result<AdminServer, String> {
    match listen {
        AdminListen::Tcp(addr) => {
            let listener =
                glommio::net::TcpListener::bind(addr).map_err(|error| error.to_string())?;
            let scheme = if tls.is_some() { "https" } else { "http" };
            let address = format!("{scheme}://{}", listener.local_addr().unwrap_or(*addr));
            Ok(AdminServer {
                task: serve(listener, control, tls, shutdown),
                address,
                socket: None,
            })
        }
        AdminListen::Unix(path) => Ok(AdminServer {
            task: serve(bind_unix(path)?, control, tls, shutdown),
            address: format!("unix:{}", path.display()),
            socket: Some(path.clone()),
        }),
    }
}

/// Serves the admin API on `listener` (TCP or Unix) until `shutdown`.
fn serve<L: myelin_http::server::Listener + 'static>(
    listener: L,
    control: &Rc<Control>,
    tls: Option<&myelin_http::tls::ServerTls>,
    shutdown: myelin_http::server::Shutdown,
) -> glommio::Task<myelin_http::server::ServeReport> {
    let admin_control = control.clone();
    glommio::spawn_local(myelin_http::server::serve(
        listener,
        move |request: Request<Incoming>| handle(admin_control.clone(), request),
        myelin_http::server::ServerConfig {
            header_read_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_millis(500),
            error_bodies: Some(crate::openai::protocol_error_body),
            tls: tls.cloned(),
            on_tls: Some(crate::metrics::admin_tls_event),
            ..Default::default()
        },
        shutdown,
    ))
}

/// Binds the admin API's Unix socket at `path`, readable and writable by this user only (mode
/// 0600: the umask is narrowed while the socket file is created, so it never exists with wider
/// permissions). A socket file left behind by a router that is gone (nothing accepts on it) is
/// replaced; a live socket or a file of another kind at `path` is an error.
fn bind_unix(path: &std::path::Path) -> Result<glommio::net::UnixListener, String> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(existing) if existing.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(format!(
                    "{} is in use (another process accepts on it)",
                    path.display()
                ));
            }
            std::fs::remove_file(path)
                .map_err(|error| format!("removing the stale {}: {error}", path.display()))?;
        }
        Ok(_) => {
            return Err(format!(
                "{} exists and is not a socket (not replaced)",
                path.display()
            ));
        }
        Err(_) => {}
    }
    // SAFETY: umask(2) only swaps the process's file-mode mask; restored right after.
    let previous = unsafe { libc::umask(0o177) };
    let bound = glommio::net::UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(previous) };
    let listener = bound.map_err(|error| error.to_string())?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|error| format!("setting {} to mode 0600: {error}", path.display()))?;
    Ok(listener)
}

/// The admin endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdminRoute {
    List,
    Add,
    Remove(BackendId),
    Drain(BackendId),
}

impl AdminRoute {
    fn label(self) -> &'static str {
        match self {
            AdminRoute::List | AdminRoute::Add => "/admin/backends",
            AdminRoute::Remove(_) => "/admin/backends/{id}",
            AdminRoute::Drain(_) => "/admin/backends/{id}/drain",
        }
    }
}

fn admin_route_of(method: &Method, path: &str) -> Result<AdminRoute, ApiError> {
    let path = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    if path == "/admin/backends" {
        return match *method {
            Method::GET | Method::HEAD => Ok(AdminRoute::List),
            Method::POST => Ok(AdminRoute::Add),
            _ => Err(ApiError::method_not_allowed(
                method.as_str(),
                path,
                "GET, POST",
            )),
        };
    }
    let Some(rest) = path.strip_prefix("/admin/backends/") else {
        return Err(ApiError::not_found(method.as_str(), path));
    };
    let (id_text, drain) = match rest.strip_suffix("/drain") {
        Some(id_text) => (id_text, true),
        None => (rest, false),
    };
    let Ok(id) = id_text.parse::<u32>().map(BackendId) else {
        return Err(ApiError::not_found(method.as_str(), path));
    };
    let (route, allowed) = if drain {
        (AdminRoute::Drain(id), Method::POST)
    } else {
        (AdminRoute::Remove(id), Method::DELETE)
    };
    if *method == allowed {
        Ok(route)
    } else {
        Err(ApiError::method_not_allowed(
            method.as_str(),
            path,
            allowed.as_str(),
        ))
    }
}

/// Entry point of every request on the admin listener.
pub async fn handle(control: Rc<Control>, request: Request<Incoming>) -> Response<Body> {
    let (label, response) = if !authorized(&control, &request) {
        ("other", unauthorized())
    } else if from_a_browser(&request) {
        ("other", refused_browser())
    } else if request.uri().path() == "/metrics" {
        let response = if matches!(*request.method(), Method::GET | Method::HEAD) {
            names::exposition(control.metrics())
        } else {
            error_response(&ApiError::method_not_allowed(
                request.method().as_str(),
                "/metrics",
                "GET",
            ))
        };
        ("/metrics", response)
    } else if let Some(endpoint) = explained_endpoint(request.uri().path()) {
        ("/admin/explain", explain(&control, request, endpoint).await)
    } else if request.uri().path().trim_end_matches('/') == "/admin/cluster" {
        (
            "/admin/cluster",
            crate::control::gossip::cluster_admin(&control, request.method()),
        )
    } else {
        match admin_route_of(request.method(), request.uri().path()) {
            Ok(route) => {
                let response = match route {
                    AdminRoute::List => list(&control).await,
                    AdminRoute::Add => add(&control, request).await,
                    AdminRoute::Remove(id) => respond(&control, AdminOp::Remove(id)).await,
                    AdminRoute::Drain(id) => respond(&control, AdminOp::Drain(id)).await,
                };
                (route.label(), response)
            }
            Err(error) => ("other", error_response(&error)),
        }
    };
    metrics::counter!(
        names::REQUESTS_TOTAL,
        "route" => label, "status" => response.status().as_str().to_string()
    )
    .increment(1);
    response
}

/// The generation endpoint an `/admin/explain/...` path names (`/admin/explain` followed by the
/// client-port path: `/v1/chat/completions` or `/v1/completions`).
fn explained_endpoint(path: &str) -> Option<Endpoint> {
    match path.strip_prefix("/admin/explain")?.trim_end_matches('/') {
        "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
        "/v1/completions" => Some(Endpoint::Completions),
        _ => None,
    }
}

/// POST /admin/explain/v1/chat/completions (or /v1/completions) with the body a client would
/// send: where the router would send it now and why (every candidate's matched blocks,
/// expected cached tokens, load, predicted TTFT and cost), without sending it.
async fn explain(
    control: &Rc<Control>,
    request: Request<Incoming>,
    endpoint: Endpoint,
) -> Response<Body> {
    if request.method() != Method::POST {
        return error_response(&ApiError::method_not_allowed(
            request.method().as_str(),
            request.uri().path(),
            "POST",
        ));
    }
    let what = "POST /admin/explain takes the JSON body a client would send";
    let body = match json_body(request, what, control.max_body_bytes).await {
        Ok(body) => body,
        Err(error) => return error_response(&error),
    };
    match control.explain(endpoint, body).await {
        Some(Ok(explained)) => json_response(StatusCode::OK, &explained),
        Some(Err(error)) => error_response(&error),
        None => error_response(&ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "no data core answered within 1 s".into(),
            error_type: "server_error",
            param: None,
            code: Some("explain_timeout"),
        }),
    }
}

fn authorized(control: &Control, request: &Request<Incoming>) -> bool {
    match control.admin_token() {
        None => true,
        Some(token) => request
            .headers()
            .get(header::AUTHORIZATION)
            .is_some_and(|value| token.accepts(value.as_bytes())),
    }
}

/// A page in a browser on the host can send simple cross-site requests (a form POST, no
/// preflight) to a loopback listener. Browsers mark every such request with `Origin` or
/// `Sec-Fetch-Site`; the admin API is for operators' tools (curl, scripts), which send neither,
/// so a request carrying either is refused before it is routed.
fn from_a_browser(request: &Request<Incoming>) -> bool {
    let headers = request.headers();
    headers.contains_key(header::ORIGIN)
        || headers
            .get("sec-fetch-site")
            .is_some_and(|site| site.as_bytes() != b"none")
}

fn refused_browser() -> Response<Body> {
    error_response(&ApiError {
        status: StatusCode::FORBIDDEN,
        message: "the admin API does not accept requests from web pages (Origin or \
                  Sec-Fetch-Site header present)"
            .into(),
        error_type: "invalid_request_error",
        param: None,
        code: Some("admin_browser_request"),
    })
}

/// Whether a request's body is declared JSON (`application/json`, parameters allowed).
/// An admin request's JSON body, up to `limit` bytes within [`ADMIN_BODY_TIMEOUT`]: 415 when
/// it is not declared JSON (`what` says what the endpoint takes), 413 past the limit, 408 late.
async fn json_body(
    request: Request<Incoming>,
    what: &str,
    limit: usize,
) -> Result<bytes::Bytes, ApiError> {
    if !declares_json(&request) {
        return Err(ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: format!("{what} (Content-Type: application/json)"),
            error_type: "invalid_request_error",
            param: None,
            code: Some("unsupported_media_type"),
        });
    }
    let read = crate::request_path::read_admin_body(request, limit);
    myelin_http::rt::timeout(ADMIN_BODY_TIMEOUT, read)
        .await
        .unwrap_or_else(|| Err(ApiError::body_timeout()))
}

fn declares_json(request: &Request<Incoming>) -> bool {
    request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

fn unauthorized() -> Response<Body> {
    let mut response = error_response(&ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "the admin API needs `Authorization: Bearer TOKEN` (--admin-token-file)".into(),
        error_type: "authentication_error",
        param: None,
        code: Some("invalid_admin_token"),
    });
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Body of POST /admin/backends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBackend {
    url: String,
    #[serde(default, alias = "kv-events")]
    kv_events: Option<String>,
    #[serde(default, alias = "kv-replay")]
    kv_replay: Option<String>,
    #[serde(default, alias = "capacity-tokens")]
    capacity_tokens: Option<u64>,
}

/// A backend's identity and state as the control core knows it.
fn info_json(info: &BackendInfo) -> Value {
    json!({
        "id": info.id.0,
        "url": info.spec.url,
        "kv_events": info.spec.kv_events,
        "kv_replay": info.spec.kv_replay,
        "capacity_tokens_configured": info.spec.capacity_tokens,
        "state": info.state.as_str(),
    })
}

/// GET /admin/backends: every backend with its load (summed over the data cores), the
/// residency in effect and the blocks the first answering core's replica holds for it, and
/// whether every answering replica holds the same.
async fn list(control: &Rc<Control>) -> Response<Body> {
    let snapshots: Vec<ReplicaSnapshot> = control
        .snapshots()
        .await
        .into_iter()
        .map(|(_, snapshot)| snapshot)
        .collect();
    let reference = snapshots.first();
    let replicas_agree =
        reference.is_some_and(|first| snapshots.iter().all(|other| other.counts == first.counts));
    let fallback_residency = match control.residency() {
        myelin_routing::ResidencyMode::Auto => "estimate",
        mode => mode.as_str(),
    };
    let list: Vec<Value> = control
        .backend_infos()
        .iter()
        .map(|info| {
            let mut load = Load::default();
            // The residency estimate's figures, per answering core (each corrects its own).
            let mut corrections = Vec::new();
            // The predicted-TTFT cost's figures, per answering core (each fits its own).
            let mut timings = Vec::new();
            for snapshot in &snapshots {
                if let Some(entry) = snapshot.backends.iter().find(|entry| entry.id == info.id) {
                    load.add(&entry.local);
                    corrections.push(json!({
                        "effective_capacity_tokens": entry.cache.effective_capacity_tokens,
                        "correction": entry.cache.correction,
                        "learned": entry.cache.learned,
                        "reuse_reports": entry.cache.reports,
                        "corrections": entry.cache.corrections,
                        // Tokens admitted to the backend as this core's estimate counts them:
                        // every data core's and, in a peer cluster, every router's.
                        "admitted_tokens_clock": entry.cache.admitted_tokens,
                        // Uses stamped below this are known evicted (never above the clock).
                        "evicted_below_stamp": entry.cache.evicted_below,
                    }));
                    if let Some(figures) = entry.timing {
                        timings.push(json!({
                            "step_ms": figures.timing.step_s * 1e3,
                            "step_ms_per_sequence": figures.timing.step_s_per_sequence * 1e3,
                            "prefill_ms_per_1k_tokens": figures.timing.prefill_s_per_token * 1e6,
                            // Attention: ms per million (query, key) pairs of prefill.
                            "prefill_ms_per_1m_pairs": figures.timing.prefill_s_per_token_pair * 1e9,
                            "step_tokens": figures.timing.step_tokens,
                            "observations": figures.observations,
                            "predictions_scored": figures.error.count,
                            "error_bias_ms": figures.error.bias_s * 1e3,
                            "error_mean_abs_ms": figures.error.mean_abs_s * 1e3,
                            "error_mean_abs_relative": figures.error.mean_abs_relative,
                        }));
                    }
                }
            }
            let engine_cache = control.engine_cache(info.id);
            let residency = reference
                .and_then(|first| first.backends.iter().find(|entry| entry.id == info.id))
                .map_or(fallback_residency, |entry| entry.residency);
            let backend = info.id;
            let routed = reference.map_or(0, |first| first.counts.routed_of(backend));
            // What routing believes the engine holds: its own KV events when they are in
            // effect (a partial mirror: what they show for sure), else the learned routes
            // (which `estimate` scores through the estimator).
            let (resident, source) = if residency == "verified" || residency == "partial" {
                (
                    reference.map_or(0, |first| first.counts.mirrored_of(backend)),
                    "kv-events",
                )
            } else {
                (routed, "routes")
            };
            let mut json = info_json(info);
            json["in_flight_requests"] = json!(load.requests);
            json["in_flight_tokens"] = json!(load.tokens);
            json["residency"] = json!(residency);
            json["routed_blocks"] = json!(routed);
            json["resident_blocks"] = json!(resident);
            json["resident_blocks_source"] = json!(source);
            // The KV-event mirror: live, or why not (null: no KV-event stream).
            json["kv_events_mirror"] = match control.mirror_status(info.id) {
                None => Value::Null,
                Some(MirrorStatus::Exact) => json!({"live": true, "partial": false}),
                Some(MirrorStatus::Partial(why)) => {
                    json!({"live": true, "partial": true, "reason": why.describe()})
                }
                Some(MirrorStatus::NotLive(why)) => {
                    json!({"live": false, "partial": false, "reason": why.describe()})
                }
            };
            json["kv_capacity_tokens_reported"] = json!(engine_cache.capacity_tokens);
            json["kv_utilization"] = json!(engine_cache.utilization);
            json["admitted_tokens"] = json!(load.admitted_tokens);
            // KV memory: the engine's queue at the last scrape, and the requests sent here as
            // a prefix's second home because its first home's memory was full.
            json["kv_running_requests"] = json!(engine_cache.running);
            json["kv_waiting_requests"] = json!(engine_cache.waiting);
            // The context length its GET /v1/models reports (checked when --max-model-len is
            // not set).
            json["max_model_len_reported"] = json!(control.max_model_len(info.id));
            // The LoRA adapters it lists there (requests naming one are keyed by it).
            json["lora_adapters"] = json!(control.lora_adapters(info.id));
            json["prefix_replications"] = json!(load.prefix_replications);
            // The prompt tokens the requests in flight hold there, shared prefixes once: the
            // router's own view of the KV memory, used when the engine reports none.
            json["kv_pinned_prompt_tokens"] = json!(load.pinned_prompt_tokens);
            json["residency_estimate"] = json!(corrections);
            json["ttft_model"] = json!(timings);
            // Tokenization parity: answers whose usage.prompt_tokens differed from the router's
            // count, and the last one (with both counts and the likely cause).
            let parity = crate::token_parity::of(info.id);
            json["tokenization"] = json!({
                "mismatches": parity.mismatches,
                "last_mismatch": parity.last.as_ref().map(crate::token_parity::Mismatch::to_json),
            });
            json
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "backends": list,
            "shards": control.shards(),
            "shards_answered": snapshots.len(),
            "replicas_agree": replicas_agree,
        }),
    )
}

/// POST /admin/backends with `{"url": "...", "kv_events": "...", "kv_replay": "..."}`.
async fn add(control: &Rc<Control>, request: Request<Incoming>) -> Response<Body> {
    let what = "POST /admin/backends takes a JSON body";
    let body = match json_body(request, what, MAX_ADMIN_BODY_BYTES).await {
        Ok(body) => body,
        Err(error) => return error_response(&error),
    };
    let add: AddBackend = match serde_json::from_slice(&body) {
        Ok(add) => add,
        Err(error) => {
            return error_response(&ApiError::invalid_request(
                format!(
                    "expected {{\"url\": \"http://host:port\", \"kv_events\": optional, \"kv_replay\": optional}}: {error}"
                ),
                None,
                "invalid_json",
            ));
        }
    };
    let capacity = match add.capacity_tokens {
        Some(tokens) => {
            crate::backend_spec::parse_capacity(&add.url, &tokens.to_string()).map(Some)
        }
        None => Ok(None),
    };
    let spec = BackendSpec::from_parts(&add.url, &add.url, add.kv_events, add.kv_replay).and_then(
        |mut spec| {
            spec.capacity_tokens = capacity?;
            Ok(spec)
        },
    );
    let spec = match spec {
        Ok(spec) => spec,
        Err(error) => {
            return error_response(&ApiError::invalid_request(
                error.to_string(),
                Some("url"),
                "invalid_value",
            ));
        }
    };
    respond(control, AdminOp::Add(spec)).await
}

async fn respond(control: &Rc<Control>, op: AdminOp) -> Response<Body> {
    match control.admin_change(op).await {
        Some(AdminOutcome::Added(info)) => json_response(StatusCode::CREATED, &info_json(&info)),
        Some(AdminOutcome::Draining(info)) => json_response(StatusCode::OK, &info_json(&info)),
        Some(AdminOutcome::Removed(info)) => {
            let mut json = info_json(&info);
            json["state"] = json!("removed");
            json_response(StatusCode::OK, &json)
        }
        Some(AdminOutcome::NotFound(id)) => error_response(&ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no backend with id {id}"),
            error_type: "invalid_request_error",
            param: Some("id".into()),
            code: Some("backend_not_found"),
        }),
        Some(AdminOutcome::Duplicate(url)) => error_response(&ApiError {
            status: StatusCode::CONFLICT,
            message: format!("backend {url} already exists"),
            error_type: "invalid_request_error",
            param: Some("url".into()),
            code: Some("backend_exists"),
        }),
        None => error_response(&ApiError::upstream(
            StatusCode::SERVICE_UNAVAILABLE,
            "not every data core confirmed the change in time (it is made on the control core \
             and is being re-sent to them)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_routes() {
        assert_eq!(
            admin_route_of(&Method::GET, "/admin/backends/"),
            Ok(AdminRoute::List)
        );
        assert_eq!(
            admin_route_of(&Method::POST, "/admin/backends"),
            Ok(AdminRoute::Add)
        );
        assert_eq!(
            admin_route_of(&Method::DELETE, "/admin/backends/3"),
            Ok(AdminRoute::Remove(BackendId(3)))
        );
        assert_eq!(
            admin_route_of(&Method::POST, "/admin/backends/3/drain"),
            Ok(AdminRoute::Drain(BackendId(3)))
        );
        let status = |method: Method, path: &str| admin_route_of(&method, path).unwrap_err().status;
        assert_eq!(
            status(Method::PUT, "/admin/backends"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            status(Method::GET, "/admin/backends/3"),
            StatusCode::METHOD_NOT_ALLOWED
        );
        assert_eq!(
            status(Method::DELETE, "/admin/backends/x"),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            status(Method::POST, "/v1/chat/completions"),
            StatusCode::NOT_FOUND
        );
    }
}
