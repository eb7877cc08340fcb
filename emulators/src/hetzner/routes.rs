//! The HTTP face of the emulated project: routes, authentication, faults and JSON shapes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use vps_clock::Clock;

use super::cloud::{not_found, ApiError, Cloud, NewServer, Server};
use crate::faults::Faults;
use crate::provider::{guard, Credential, ProviderAnswers, ProviderState};

/// Hetzner's user data limit.
const MAX_USER_DATA_BYTES: usize = 32 * 1024;
const LOCATIONS: [&str; 6] = ["fsn1", "nbg1", "hel1", "ash", "hil", "sin"];

type AppState = ProviderState<Cloud>;

pub(super) fn router(cloud: Arc<Mutex<Cloud>>, faults: Faults, token: String) -> Router {
    let state = AppState::new(cloud, faults, format!("Bearer {token}"));
    Router::new()
        .route("/v1/servers", get(list_servers).post(create_server))
        .route("/v1/servers/{id}", get(get_server).delete(delete_server))
        .route("/v1/servers/{id}/actions/{action}", post(server_action))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "not_found", "not found") })
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::<Cloud>,
        ))
        .with_state(state)
}

impl ProviderAnswers for Cloud {
    fn unauthorized(_: Credential) -> Response {
        error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "unable to authenticate",
        )
    }

    fn rate_limited(seconds: u64) -> Response {
        rate_limited(seconds)
    }

    fn unavailable() -> Response {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "service unavailable",
        )
    }

    fn is_create(request: &Request) -> bool {
        request.method() == Method::POST && request.uri().path() == "/v1/servers"
    }
}

async fn list_servers(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let mut cloud = state.lock();
    cloud.settle();
    let name = query.get("name");
    let servers: Vec<Value> = if name.is_some() && cloud.hidden_lookups > 0 {
        cloud.hidden_lookups -= 1;
        Vec::new()
    } else {
        cloud
            .servers()
            .filter(|s| name.is_none_or(|n| &s.name == n))
            .map(server_json)
            .collect()
    };
    let total = servers.len();
    Json(json!({
        "servers": servers,
        "meta": { "pagination": {
            "page": 1, "per_page": 25, "previous_page": null, "next_page": null,
            "last_page": 1, "total_entries": total
        }}
    }))
    .into_response()
}

async fn create_server(State(state): State<AppState>, body: Bytes) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "json_error", "invalid JSON");
    };
    let new = match new_server(&body) {
        Ok(new) => new,
        Err(e) => return e.into_response(),
    };
    let mut cloud = state.lock();
    cloud.settle();
    let action_id = cloud.action_id();
    let next_action_id = cloud.action_id();
    match cloud.create(new) {
        Ok(server) => (
            StatusCode::CREATED,
            Json(json!({
                "server": server_json(server),
                "action": action_json(action_id, "create_server", server.id),
                "next_actions": [action_json(next_action_id, "start_server", server.id)],
                "root_password": null,
            })),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn get_server(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    let mut cloud = state.lock();
    cloud.settle();
    match parse_id(&id).and_then(|id| cloud.get(id)) {
        Ok(server) => Json(json!({ "server": server_json(server) })).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn server_action(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
) -> Response {
    act_on_server(&state, &id, |cloud, id, action_id| {
        let command = cloud.power(id, &action)?;
        Ok((
            StatusCode::CREATED,
            Json(json!({ "action": action_json(action_id, command, id) })),
        )
            .into_response())
    })
}

async fn delete_server(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    act_on_server(&state, &id, |cloud, id, action_id| {
        cloud.delete(id)?;
        Ok(Json(json!({ "action": action_json(action_id, "delete_server", id) })).into_response())
    })
}

/// Runs an action on server `id` in the settled cloud, with the id the action gets; an id
/// that does not parse is `not_found` and draws no action id.
fn act_on_server(
    state: &AppState,
    id: &str,
    f: impl FnOnce(&mut Cloud, u64, u64) -> Result<Response, ApiError>,
) -> Response {
    let mut cloud = state.lock();
    cloud.settle();
    let result = parse_id(id).and_then(|id| {
        let action_id = cloud.action_id();
        f(&mut cloud, id, action_id)
    });
    result.unwrap_or_else(IntoResponse::into_response)
}

fn new_server(body: &Value) -> Result<NewServer, ApiError> {
    let text = |field: &str| body.get(field).and_then(Value::as_str).map(str::to_owned);
    let name = text("name")
        .filter(|n| is_hostname(n))
        .ok_or_else(|| invalid_input("name", "must be a valid hostname (RFC 1123)"))?;
    let server_type = text("server_type")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| invalid_input("server_type", "is required"))?;
    let image = text("image")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| invalid_input("image", "is required"))?;
    let location = match text("location") {
        None => "fsn1".to_owned(),
        Some(l) if LOCATIONS.contains(&l.as_str()) => l,
        Some(l) => {
            return Err(invalid_input(
                "location",
                &format!("location '{l}' not found"),
            ))
        }
    };
    let user_data = text("user_data");
    if user_data
        .as_ref()
        .is_some_and(|u| u.len() > MAX_USER_DATA_BYTES)
    {
        return Err(invalid_input("user_data", "is longer than 32 KiB"));
    }
    let labels = match body.get("labels") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(Value::Object(map)) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(v) => Ok((k.clone(), v.clone())),
                _ => Err(invalid_input("labels", "values must be strings")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid_input("labels", "must be an object")),
    };
    Ok(NewServer {
        name,
        server_type,
        image,
        location,
        labels,
        user_data,
    })
}

fn server_json(server: &Server) -> Value {
    json!({
        "id": server.id,
        "name": server.name,
        "status": server.status,
        "created": server.created.to_rfc3339(),
        "public_net": {
            "ipv4": { "id": server.id, "ip": format!("203.0.113.{}", server.id % 254 + 1),
                      "blocked": false, "dns_ptr": format!("static.{}.example", server.id) },
            "ipv6": { "id": server.id, "ip": format!("2001:db8:{:x}::/64", server.id % 0xffff),
                      "blocked": false, "dns_ptr": [] },
            "floating_ips": [],
            "firewalls": []
        },
        "private_net": [],
        "server_type": { "name": server.server_type },
        "datacenter": { "name": format!("{}-dc1", server.location),
                        "location": { "name": server.location } },
        "image": { "name": server.image },
        "labels": server.labels,
        "locked": false,
        "protection": { "delete": false, "rebuild": false },
        "rescue_enabled": false,
        "volumes": [],
        "load_balancers": []
    })
}

fn action_json(id: u64, command: &str, server_id: u64) -> Value {
    json!({
        "id": id,
        "command": command,
        "status": "running",
        "progress": 0,
        "started": Clock::system().now().to_rfc3339(),
        "finished": null,
        "resources": [{ "id": server_id, "type": "server" }],
        "error": null
    })
}

fn rate_limited(seconds: u64) -> Response {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_exceeded",
        "limit of 3600 requests per hour reached",
    );
    let headers = response.headers_mut();
    headers.insert("RateLimit-Limit", 3600.into());
    headers.insert("RateLimit-Remaining", 0.into());
    headers.insert("RateLimit-Reset", (now + seconds).into());
    headers.insert(header::RETRY_AFTER, seconds.into());
    response
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = json!({ "error": { "code": code, "message": message, "details": {} } });
    (status, Json(body)).into_response()
}

fn invalid_input(field: &str, problem: &str) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        code: "invalid_input",
        message: format!("invalid input in field '{field}': {problem}"),
    }
}

fn parse_id(id: &str) -> Result<u64, ApiError> {
    id.parse().map_err(|_| not_found(id))
}

/// RFC 1123 hostname: dot-separated labels of letters, digits and inner hyphens.
fn is_hostname(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error(self.status, self.code, &self.message)
    }
}
