//! The `tenants` table, from the `tenant-<id>` streams (teardown), and the reads behind it.

use sqlx::{PgConnection, PgExecutor};
use vps_domain::tenant::{TenantEvent, TenantState};
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one `tenant.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let (tenant, state) = match crate::typed::<TenantEvent>(e)? {
        TenantEvent::Deleting(t) => (t.tenant_id, TenantState::Deleting),
        TenantEvent::Deleted(t) => (t.tenant_id, TenantState::Deleted),
    };
    sqlx::query(
        "INSERT INTO tenants (id, state, position, updated_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (id) DO UPDATE SET state = $2, position = $3, updated_at = $4",
    )
    .bind(&tenant)
    .bind(state.as_str())
    .bind(e.position)
    .bind(e.recorded_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Tenants deleted or being deleted: they take no new work.
pub async fn deleted<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM tenants ORDER BY id")
        .fetch_all(db)
        .await
}

/// Tenants whose teardown is under way.
pub async fn deleting<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM tenants WHERE state = 'deleting' ORDER BY id")
        .fetch_all(db)
        .await
}
