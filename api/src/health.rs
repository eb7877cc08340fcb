//! `/healthz`, `/readyz` and `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;

use crate::state::AppState;

/// The process is up.
pub async fn healthz() -> &'static str {
    "ok"
}

/// Ready when the database answers and every migration is applied; the body carries every
/// `vps doctor` finding as `checks` (those after the database's bounded by a second, so a slow
/// check never holds readiness up).
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let checks = crate::doctor::run(crate::doctor::Ctx {
        pool: Ok(&state.pool),
        config: &state.config,
        budget: READYZ_BUDGET,
    })
    .await;
    match crate::doctor::readiness(&checks) {
        Ok(()) => (
            StatusCode::OK,
            Json(json!({ "ready": true, "checks": checks })),
        ),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "ready": false, "reason": reason, "checks": checks })),
        ),
    }
}

/// What the checks after the database's may take in `/readyz`.
const READYZ_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

/// Prometheus text exposition.
pub async fn metrics() -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        crate::telemetry::metrics_handle().render(),
    )
}
