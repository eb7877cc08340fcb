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
        NodeEvent::TokenRotated(d) => {
            sqlx::query("UPDATE nodes SET updated_at = $2, version = $3 WHERE id = $1")
                .bind(&d.node_id)
                .bind(at)
                .bind(e.version)
                .execute(conn)
                .await?;
            return Ok(());
        }
        NodeEvent::Cordoned(d) => (d.node_id, "cordoned"),
        NodeEvent::Lost(d) => (d.node_id, "lost"),
        NodeEvent::Uncordoned(d) | NodeEvent::Recovered(d) => (d.node_id, "ready"),
    };
    sqlx::query("UPDATE nodes SET state = $2, updated_at = $3, version = $4 WHERE id = $1")
        .bind(&node_id)
        .bind(state)
        .bind(at)
        .bind(e.version)
        .execute(conn)
        .await?;
    Ok(())
}
