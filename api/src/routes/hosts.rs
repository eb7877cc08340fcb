//! The host seam: `nodes.spec` (long-poll), `nodes.report`, `nodes.secret`. A node calls
//! with its own token and may only speak for itself; operators may call for any node.

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use vps_commands::hosts::{self, Report};
use vps_commands::Ctx;

use crate::error::ApiError;
use crate::rpc::{parse, Caller};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SpecQuery {
    node_id: String,
    after_generation: Option<i64>,
    wait_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SecretQuery {
    node_id: String,
    #[serde(rename = "ref")]
    reference: String,
}

/// The longest a spec request is held.
pub const MAX_WAIT: Duration = Duration::from_secs(30);

fn authorize(caller: &Caller, node_id: &str) -> Result<(), ApiError> {
    match &caller.node {
        Some(own) if own == node_id => Ok(()),
        Some(_) => Err(ApiError::new(
            "ACCESS_DENIED",
            "a node speaks only for itself",
        )),
        None => caller.operator(),
    }
}

/// Dispatches a host-seam method; `None` when `method` is not one.
pub async fn handle(
    ctx: &Ctx,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Option<Result<Value, ApiError>> {
    Some(match method {
        "spec" => spec(ctx, caller, body).await,
        "report" => report(ctx, caller, body).await,
        "secret" => secret(ctx, caller, body).await,
        _ => return None,
    })
}

async fn spec(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let q: SpecQuery = parse(body)?;
    authorize(caller, &q.node_id)?;
    let wait = Duration::from_millis(q.wait_ms.unwrap_or(0));
    if wait > MAX_WAIT {
        return Err(ApiError::invalid("waitMs", "at most 30000"));
    }
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM nodes WHERE id = $1)")
        .bind(&q.node_id)
        .fetch_one(&ctx.pool)
        .await?;
    if !exists {
        return Err(ApiError::new(
            "NOT_FOUND",
            format!("node {} not found", q.node_id),
        ));
    }
    let deadline = Instant::now() + wait;
    let mut wake = ctx.notifier.subscribe();
    loop {
        wake.borrow_and_update();
        let mut conn = ctx.pool.acquire().await?;
        let spec = vps_projections::node_specs::load(&mut conn, &q.node_id).await?;
        drop(conn);
        let newer = q
            .after_generation
            .is_none_or(|after| spec["generation"].as_i64().unwrap_or(0) > after);
        let now = Instant::now();
        if newer || now >= deadline {
            return Ok(spec);
        }
        // Woken by any commit in this process (or another replica's, via pg_notify); the
        // timeout bounds the latency of a missed wake-up.
        let _ = tokio::time::timeout(
            (deadline - now).min(Duration::from_millis(500)),
            wake.changed(),
        )
        .await;
    }
}

async fn report(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let report: Report = parse(body)?;
    authorize(caller, &report.node_id)?;
    let outcome = hosts::report(ctx, report).await?;
    Ok(json!({ "updated": outcome.updated, "orphans": outcome.orphans }))
}

async fn secret(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let q: SecretQuery = parse(body)?;
    // Only the node itself: an operator has no business reading tenants' user data.
    if caller.node.as_deref() != Some(q.node_id.as_str()) {
        return Err(ApiError::new(
            "ACCESS_DENIED",
            "only the node itself reads its instances' secrets",
        ));
    }
    let value = hosts::node_secret(ctx, &q.node_id, &q.reference).await?;
    Ok(json!({ "value": value }))
}
