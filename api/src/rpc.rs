//! `POST /api/compute/<group>/<method>`: authentication, body parsing, dispatch.

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use tracing::Instrument;
use vps_commands::Ctx;
use vps_domain::ErrorCode;

use crate::error::ApiError;
use crate::methods::registry;
use crate::registry::Call;
use crate::request::authenticate;
use crate::state::AppState;

/// The one route every method goes through.
pub async fn dispatch(
    State(state): State<AppState>,
    Path((group, method)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let caller = authenticate(&state, &headers).await?;
    let method = registry()
        .get(&group, &method)
        .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no method {group}.{method}")))?;
    // Read with the method's own limit so an oversized body is INVALID_INPUT like any bad
    // input, refused before its handler runs (a refused report does not keep a node alive).
    // A larger limit is for the hosts that need it: anyone else gets the default.
    let max = match caller.node {
        Some(_) => method.max_body,
        None => method.max_body.min(crate::registry::MAX_BODY),
    };
    let body: Bytes = axum::body::to_bytes(body, max)
        .await
        .map_err(|_| ApiError::invalid("body", format!("larger than {max} bytes, or cut short")))?;
    let ctx = Ctx {
        pool: state.pool.clone(),
        notifier: state.notifier.clone(),
        spec_signals: state.spec_signals.clone(),
        secrets: state.secrets.clone(),
        actor: caller.actor.clone(),
        request_id: Some(vps_commands::record::new_id("req")),
        clock: state.clock.clone(),
        wakeups: state.wakeups.clone(),
        reports: state.reports.clone(),
    };
    let span = tracing::info_span!("command", method = %method.full_name(), identity = %caller.actor.identity);
    metrics::counter!("vps_api_requests_total", "method" => method.full_name()).increment(1);
    let guard = crate::authz::Guard {
        snapshot: state.authz.snapshot(),
        principal: caller.principal(),
        action: method.action.clone(),
    };
    let call = Call {
        ctx,
        caller,
        admitter: state.admitter.clone(),
        guards: state.guards.clone(),
        watched: state.watched.clone(),
        config: state.config.clone(),
        guard,
        authz: state.authz.clone(),
        snapshots: state.snapshots.clone(),
        sandbox_ca: state.sandbox_ca.clone(),
        preview_url: state.preview_url.clone(),
        specs: state.specs.clone(),
        spec_signals: state.spec_signals.clone(),
    };
    let answer = method.call(call, &body).instrument(span).await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], answer).into_response())
}
