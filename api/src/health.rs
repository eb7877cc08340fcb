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

/// The database answers and every migration is applied.
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let applied: Result<i64, _> =
        sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE success")
            .fetch_one(&state.pool)
            .await;
    let wanted = vps_events::db::MIGRATOR.iter().count() as i64;
    match applied {
        Ok(n) if n >= wanted => (StatusCode::OK, Json(json!({ "ready": true }))),
        Ok(n) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({ "ready": false, "reason": format!("{n} of {wanted} migrations applied") }),
            ),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({ "ready": false, "reason": "database unreachable" })),
        ),
    }
}

/// Prometheus text exposition.
pub async fn metrics() -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        crate::telemetry::metrics_handle().render(),
    )
}
