//! `/healthz`, `/readyz` and `/metrics`.
//!
//! `/readyz` answers anyone, so it says only whether the replica is ready, from a result kept
//! for [`READINESS_TTL`](crate::doctor::readiness::READINESS_TTL): a flood of probes costs the database one check a second. The doctor's
//! findings name other tenants' resources and the fleet's internals, so they need an operator
//! token (`/readyz?verbose`, or `vps doctor`).

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::state::AppState;

/// The process is up.
pub async fn healthz() -> &'static str {
    "ok"
}

/// Anonymous: 200 `{"ready": true}` or 503 `{"ready": false}`, nothing else. With `?verbose`
/// and an operator's token: every `vps doctor` finding as `checks` (those after the
/// database's bounded by a second, so a slow check never holds the answer up).
pub async fn readyz(
    State(state): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if query.contains_key("verbose") {
        return match verbose(&state, &headers).await {
            Ok(answer) => answer,
            Err(e) => e.into_response(),
        };
    }
    let ready = state.readiness.ready(&state.pool, &state.clock).await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({ "ready": ready }))).into_response()
}

/// The findings, for operators only.
async fn verbose(
    state: &AppState,
    headers: &HeaderMap,
) -> Result<Response, crate::error::ApiError> {
    crate::request::authenticate(state, headers)
        .await?
        .operator()?;
    let checks = crate::doctor::run(crate::doctor::Ctx {
        pool: Ok(&state.pool),
        config: &state.config,
        budget: READYZ_BUDGET,
    })
    .await;
    Ok(match crate::doctor::readiness(&checks) {
        Ok(()) => (
            StatusCode::OK,
            Json(json!({ "ready": true, "checks": checks })),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "ready": false, "reason": reason, "checks": checks })),
        ),
    }
    .into_response())
}

/// What the checks after the database's may take in `/readyz?verbose`.
const READYZ_BUDGET: Duration = Duration::from_secs(1);

/// Prometheus text exposition.
pub async fn metrics() -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        crate::telemetry::metrics_handle().render(),
    )
}
