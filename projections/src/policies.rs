//! The `policies` table, from the `policy-<id>` streams, and the reads behind
//! `policies.list` and the authorizer's rebuild. Deleted policies stay as tombstones, so the
//! highest `position` only grows and replicas can tell cheaply when to rebuild.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};
use vps_domain::policy::PolicyEvent;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one `policy.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let (id, tenant_id, text, deleted) = match crate::typed::<PolicyEvent>(e)? {
        PolicyEvent::Put(p) => (p.id, p.tenant_id, Some(p.text), false),
        PolicyEvent::Deleted(d) => (d.id, None, None, true),
    };
    sqlx::query(
        "INSERT INTO policies (id, tenant_id, text, deleted, version, position, updated_at)
         VALUES ($1, $2, coalesce($3, ''), $4, $5, $6, $7)
         ON CONFLICT (id) DO UPDATE SET
            tenant_id = CASE WHEN $4 THEN policies.tenant_id ELSE excluded.tenant_id END,
            text = CASE WHEN $4 THEN policies.text ELSE excluded.text END,
            deleted = $4, version = $5, position = $6, updated_at = $7",
    )
    .bind(&id)
    .bind(&tenant_id)
    .bind(&text)
    .bind(deleted)
    .bind(e.version)
    .bind(e.position)
    .bind(e.recorded_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// A stored policy as `policies.*` answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyView {
    /// Its id.
    pub id: String,
    /// When set, it applies only within this tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Cedar text.
    pub text: String,
    /// Events in its stream.
    pub version: i64,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

/// Every policy in force, by id.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<PolicyView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, tenant_id, text, version, updated_at FROM policies
          WHERE NOT deleted ORDER BY id",
    )
    .fetch_all(db)
    .await
}

/// What replicas compare to know whether the policies or the tenants being deleted changed:
/// the highest position either projection has applied.
pub async fn generation<'e>(db: impl PgExecutor<'e>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT greatest((SELECT coalesce(max(position), 0) FROM policies),
                         (SELECT coalesce(max(position), 0) FROM tenants))",
    )
    .fetch_one(db)
    .await
}
