//! The `nodes` table, from a node's stream (registration, liveness, orphans).

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
