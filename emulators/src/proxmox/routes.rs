//! The HTTP face of the emulated node: routes, token authentication, faults, `{ "data": … }`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::node::{server_error, Node, PveError};
use crate::faults::Faults;
use crate::provider::{guard, Credential, ProviderAnswers, ProviderState};

type AppState = ProviderState<Node>;

pub(super) fn router(node: Arc<Mutex<Node>>, faults: Faults, authorization: String) -> Router {
    let state = AppState::new(node, faults, authorization);
    let api = Router::new()
        .route("/cluster/nextid", get(next_id))
        .route("/nodes/{node}/qemu", get(list_vms))
        .route(
            "/nodes/{node}/qemu/{vmid}",
            axum::routing::delete(destroy_vm),
        )
        .route("/nodes/{node}/qemu/{vmid}/clone", post(clone_vm))
        .route("/nodes/{node}/qemu/{vmid}/status/current", get(vm_status))
        .route("/nodes/{node}/qemu/{vmid}/status/{action}", post(power))
        .route(
            "/nodes/{node}/qemu/{vmid}/config",
            get(config).put(set_config),
        )
        .route(
            "/nodes/{node}/qemu/{vmid}/agent/network-get-interfaces",
            get(agent_interfaces),
        )
        .route("/nodes/{node}/tasks/{upid}/status", get(task_status));
    Router::new()
        .nest("/api2/json", api)
        .fallback(|| async { failure(StatusCode::NOT_IMPLEMENTED, "Method not implemented") })
        .layer(middleware::from_fn_with_state(state.clone(), guard::<Node>))
        .with_state(state)
}

impl ProviderAnswers for Node {
    fn unauthorized(credential: Credential) -> Response {
        match credential {
            Credential::Missing => failure(StatusCode::UNAUTHORIZED, "No ticket"),
            _ => failure(StatusCode::UNAUTHORIZED, "invalid token value!"),
        }
    }

    fn rate_limited(seconds: u64) -> Response {
        rate_limited(seconds)
    }

    fn unavailable() -> Response {
        failure(StatusCode::SERVICE_UNAVAILABLE, "service unavailable")
    }

    fn is_create(request: &Request) -> bool {
        request.method() == Method::POST && request.uri().path().ends_with("/clone")
    }
}

/// `429` asking for a wait of `seconds`.
fn rate_limited(seconds: u64) -> Response {
    let mut response = failure(StatusCode::TOO_MANY_REQUESTS, "too many requests");
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, seconds.into());
    response
}

async fn next_id(State(state): State<AppState>) -> Response {
    // The real API answers the vmid as a string.
    answer(with_node(&state, None, |node| {
        Ok(json!(node.next_id().to_string()))
    }))
}

async fn list_vms(State(state): State<AppState>, Path(node): Path<String>) -> Response {
    answer(with_node(&state, Some(&node), |node| {
        Ok(json!(node.list()))
    }))
}

async fn clone_vm(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
    body: Bytes,
) -> Response {
    answer(with_params(&state, &node, &body, |node, params| {
        node.clone_vm(vmid, &params).map(|upid| json!(upid))
    }))
}

async fn vm_status(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| node.status(vmid)))
}

async fn power(
    State(state): State<AppState>,
    Path((node, vmid, action)): Path<(String, u32, String)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| {
        node.power(vmid, &action).map(|upid| json!(upid))
    }))
}

async fn destroy_vm(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| {
        node.destroy(vmid).map(|upid| json!(upid))
    }))
}

async fn config(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| node.config(vmid)))
}

async fn set_config(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
    body: Bytes,
) -> Response {
    answer(with_params(&state, &node, &body, |node, params| {
        node.set_config(vmid, params).map(|()| Value::Null)
    }))
}

async fn agent_interfaces(
    State(state): State<AppState>,
    Path((node, vmid)): Path<(String, u32)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| {
        node.agent_interfaces(vmid)
    }))
}

async fn task_status(
    State(state): State<AppState>,
    Path((node, upid)): Path<(String, String)>,
) -> Response {
    answer(with_node(&state, Some(&node), |node| {
        node.task_status(&upid)
    }))
}

/// Runs `f` on the node after settling due tasks; a request for another node fails as the
/// real API does when it cannot resolve the node's name.
fn with_node(
    state: &AppState,
    name: Option<&str>,
    f: impl FnOnce(&mut Node) -> Result<Value, PveError>,
) -> Result<Value, PveError> {
    let mut node = state.lock();
    if let Some(name) = name.filter(|name| *name != node.name) {
        return Err(server_error(format!(
            "hostname lookup '{name}' failed - failed to get address info for: {name}: Name or service not known"
        )));
    }
    node.settle();
    f(&mut node)
}

/// Like [`with_node`], with the body's parameters; a body that does not parse is refused
/// before the node is touched.
fn with_params(
    state: &AppState,
    name: &str,
    body: &[u8],
    f: impl FnOnce(&mut Node, BTreeMap<String, String>) -> Result<Value, PveError>,
) -> Result<Value, PveError> {
    let params = params(body)?;
    with_node(state, Some(name), |node| f(node, params))
}

/// Form-encoded parameters (the API also takes a JSON object).
fn params(body: &[u8]) -> Result<BTreeMap<String, String>, PveError> {
    if body.first() == Some(&b'{') {
        let object: BTreeMap<String, Value> = serde_json::from_slice(body)
            .map_err(|e| server_error(format!("unable to parse JSON body: {e}")))?;
        return Ok(object
            .into_iter()
            .map(|(k, v)| match v {
                Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect());
    }
    serde_urlencoded::from_bytes(body)
        .map_err(|e| server_error(format!("unable to parse form body: {e}")))
}

fn answer(result: Result<Value, PveError>) -> Response {
    match result {
        Ok(data) => Json(json!({ "data": data })).into_response(),
        Err(error) => error.into_response(),
    }
}

/// An error as the API answers it: the message (newline-terminated) and `data: null`.
fn failure(status: StatusCode, message: &str) -> Response {
    let body = json!({ "data": null, "message": format!("{message}\n") });
    (status, Json(body)).into_response()
}

impl IntoResponse for PveError {
    fn into_response(self) -> Response {
        let mut body = json!({ "data": null, "message": format!("{}\n", self.message) });
        if let Some(errors) = self.errors {
            body["errors"] = json!(errors);
        }
        (self.status, Json(body)).into_response()
    }
}
