//! The admin API: list, add, remove and drain backends at run time. Changes go through the
//! control core, which answers once every data core has applied them.

use std::rc::Rc;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use myelin_http::body::Body;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::backend_spec::BackendSpec;
use crate::backends::{BackendEntry, BackendId, BackendInfo};
use crate::data_core::DataCore;
use crate::messages::{AdminOp, AdminOutcome};
use crate::openai::ApiError;
use crate::request_path::{error_response, json_response};
use crate::routing_glue::BlockCounts;

/// Largest admin request body.
const MAX_ADMIN_BODY_BYTES: usize = 64 * 1024;

/// Body of POST /admin/backends.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddBackend {
    url: String,
    #[serde(default, alias = "kv-events")]
    kv_events: Option<String>,
    #[serde(default, alias = "kv-replay")]
    kv_replay: Option<String>,
}

/// One backend as the admin API shows it. `counts` are the blocks the replica holds for it
/// (`None` when not gathered: the answer to an admin change).
fn backend_json(core: &DataCore, entry: &BackendEntry, counts: Option<&BlockCounts>) -> Value {
    let load = entry.total_load();
    let residency = core.routing.borrow().residency_of(entry.info.id);
    let mut json = json!({
        "id": entry.info.id,
        "url": entry.info.spec.url,
        "kv_events": entry.info.spec.kv_events,
        "kv_replay": entry.info.spec.kv_replay,
        "state": entry.info.state.as_str(),
        "in_flight_requests": load.requests,
        "in_flight_tokens": load.tokens,
        "residency": residency,
    });
    if let Some(counts) = counts {
        let backend = myelin_routing::BackendId(entry.info.id);
        let routed = counts.routed_of(backend);
        // What routing believes the engine holds: its own KV events when they are in effect,
        // else the learned routes (which `estimate` scores through the residency estimator).
        let (resident, source) = if residency == "verified" {
            (counts.mirrored_of(backend), "kv-events")
        } else {
            (routed, "routes")
        };
        json["routed_blocks"] = json!(routed);
        json["resident_blocks"] = json!(resident);
        json["resident_blocks_source"] = json!(source);
    }
    json
}

fn info_json(core: &DataCore, info: &BackendInfo) -> Value {
    let backends = core.backends.borrow();
    match backends.get(info.id) {
        Some(entry) => backend_json(core, entry, None),
        None => json!({
            "id": info.id,
            "url": info.spec.url,
            "kv_events": info.spec.kv_events,
            "state": info.state.as_str(),
        }),
    }
}

/// GET /admin/backends: every backend, with the blocks the answering core's replica holds for
/// it, and whether every core's replica holds the same.
pub async fn list(core: &Rc<DataCore>) -> Response<Body> {
    let (counts, all) = core.block_counts().await;
    let replicas_agree = all.iter().all(|other| *other == counts);
    let backends = core.backends.borrow();
    let list: Vec<Value> = backends
        .iter()
        .map(|entry| backend_json(core, entry, Some(&counts)))
        .collect();
    json_response(
        StatusCode::OK,
        &json!({
            "backends": list,
            "shards": core.shards,
            "shards_answered": all.len(),
            "replicas_agree": replicas_agree,
        }),
    )
}

/// POST /admin/backends with `{"url": "...", "kv_events": "..."}`.
pub async fn add(core: &Rc<DataCore>, request: Request<Incoming>) -> Response<Body> {
    let body = match crate::request_path::read_admin_body(request, MAX_ADMIN_BODY_BYTES).await {
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
    let spec = match BackendSpec::from_parts(&add.url, &add.url, add.kv_events, add.kv_replay) {
        Ok(spec) => spec,
        Err(error) => {
            return error_response(&ApiError::invalid_request(
                error.to_string(),
                Some("url"),
                "invalid_value",
            ));
        }
    };
    respond(core, AdminOp::Add(spec)).await
}

/// DELETE /admin/backends/{id}.
pub async fn remove(core: &Rc<DataCore>, id: BackendId) -> Response<Body> {
    respond(core, AdminOp::Remove(id)).await
}

/// POST /admin/backends/{id}/drain.
pub async fn drain(core: &Rc<DataCore>, id: BackendId) -> Response<Body> {
    respond(core, AdminOp::Drain(id)).await
}

async fn respond(core: &Rc<DataCore>, op: AdminOp) -> Response<Body> {
    match core.admin(op).await {
        Some(AdminOutcome::Added(info)) => {
            json_response(StatusCode::CREATED, &info_json(core, &info))
        }
        Some(AdminOutcome::Draining(info)) => {
            json_response(StatusCode::OK, &info_json(core, &info))
        }
        Some(AdminOutcome::Removed(info)) => json_response(
            StatusCode::OK,
            &json!({
                "id": info.id,
                "url": info.spec.url,
                "kv_events": info.spec.kv_events,
                "state": "removed",
            }),
        ),
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
            "the control core did not confirm the change in time",
        )),
    }
}
