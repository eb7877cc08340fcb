//! The `nodes` table, from a node's stream (registration, liveness, orphans).

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::PgConnection;
use vps_domain::node::NodeEvent;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one node event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    let (node_id, state) = match crate::typed::<NodeEvent>(e)? {
        NodeEvent::Registered(d) => {
            sqlx::query(
            "INSERT INTO nodes (id, pool_id, name, state, capacity, labels, runtimes, cpu_model,
                                created_at, updated_at, version)
             VALUES ($1, $2, $3, 'ready', $4, $5, $6, $7, $8, $8, $9)",
        )
        .bind(&d.node_id)
        .bind(&d.pool_id)
        .bind(&d.name)
        .bind(Json(&d.capacity))
        .bind(Json(&d.labels))
        .bind(Json(&d.runtimes))
        .bind(&d.cpu_model)
        .bind(at)
        .bind(e.version)
        .execute(conn)
        .await?;
            return Ok(());
        }
        NodeEvent::Orphaned(d) => {
            sqlx::query("UPDATE nodes SET orphans = $2, version = $3 WHERE id = $1")
                .bind(&d.node_id)
                .bind(Json(&d.instance_ids))
                .bind(e.version)
                .execute(conn)
                .await?;
            return Ok(());
        }
        NodeEvent::TokenRotated(d) => (d.node_id, None),
        NodeEvent::Cordoned(d) => (d.node_id, Some("cordoned")),
        NodeEvent::Lost(d) => (d.node_id, Some("lost")),
        NodeEvent::Uncordoned(d) | NodeEvent::Recovered(d) => (d.node_id, Some("ready")),
    };
    // The other events stamp the node; those that move it set its state too.
    sqlx::query(
        "UPDATE nodes SET state = coalesce($2, state), updated_at = $3, version = $4 WHERE id = $1",
    )
    .bind(&node_id)
    .bind(state)
    .bind(at)
    .bind(e.version)
    .execute(conn)
    .await?;
    Ok(())
}

/// Locks `node_ids` (in id order) to the transaction's end.
pub async fn lock(tx: &mut PgConnection, node_ids: &[String]) -> Result<(), sqlx::Error> {
    if !node_ids.is_empty() {
        sqlx::query("SELECT id FROM nodes WHERE id = ANY($1) ORDER BY id FOR UPDATE")
            .bind(node_ids)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// A node's name; `None` when there is no such node.
pub async fn name(tx: &mut PgConnection, node_id: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT name FROM nodes WHERE id = $1")
        .bind(node_id)
        .fetch_optional(&mut *tx)
        .await
}

/// A node's CPU model; `None` when it stated none or there is no such node.
pub async fn cpu_model(
    tx: &mut PgConnection,
    node_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    let model: Option<Option<String>> =
        sqlx::query_scalar("SELECT cpu_model FROM nodes WHERE id = $1")
            .bind(node_id)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(model.flatten())
}

/// The pool of a node; `None` when there is no such node.
pub async fn pool_id(tx: &mut PgConnection, node_id: &str) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT pool_id FROM nodes WHERE id = $1")
        .bind(node_id)
        .fetch_optional(&mut *tx)
        .await
}

/// The nodes of pools with `lostAfterSeconds` that have been silent that long, counting from
/// their last report (`node_heartbeats`, or their registration), but never from before
/// `resumed`, as of `now`.
pub async fn silent<'e>(
    db: impl sqlx::PgExecutor<'e>,
    resumed: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT n.id FROM nodes n
           JOIN pools p ON p.id = n.pool_id
           LEFT JOIN node_heartbeats h ON h.node_id = n.id
          WHERE n.state IN ('ready', 'cordoned', 'unreachable')
            AND p.policy->>'lostAfterSeconds' IS NOT NULL
            AND greatest(coalesce(h.last_report_at, n.created_at), $1)
                < $2 - make_interval(secs => (p.policy->>'lostAfterSeconds')::float8)",
    )
    .bind(resumed)
    .bind(now)
    .fetch_all(db)
    .await
}

/// The nodes `lost` or `unreachable`, or silent for over `silent` seconds (no report in
/// `node_heartbeats` since, counting from registration), by id: each node's id, name, state
/// and seconds since its last report (or its registration).
pub async fn unwell<'e>(
    db: impl sqlx::PgExecutor<'e>,
    silent: f64,
) -> Result<Vec<(String, String, String, f64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT n.id, n.name, n.state,
                extract(epoch FROM now() - coalesce(h.last_report_at, n.created_at))::float8
           FROM nodes n LEFT JOIN node_heartbeats h ON h.node_id = n.id
          WHERE n.state IN ('lost', 'unreachable')
             OR coalesce(h.last_report_at, n.created_at) < now() - make_interval(secs => $1)
          ORDER BY n.id",
    )
    .bind(silent)
    .fetch_all(db)
    .await
}

/// How many nodes there are.
pub async fn count<'e>(db: impl sqlx::PgExecutor<'e>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM nodes")
        .fetch_one(db)
        .await
}
