//! The `sandbox_templates` and `sandboxes` tables, from their streams. Each row keeps the
//! aggregate folded so far (`doc`) beside the columns reads and the reconciler filter on.

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::aggregate::Aggregate;
use vps_domain::sandbox::{Sandbox, SandboxEvent};
use vps_domain::template::{Template, TemplateEvent};
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one template event.
pub async fn apply_template(
    conn: &mut PgConnection,
    e: &RecordedEvent,
) -> Result<(), ProjectionError> {
    let event = crate::typed::<TemplateEvent>(e)?;
    let t = evolve::<Template>(conn, "sandbox_templates", e, &event).await?;
    sqlx::query(
        "INSERT INTO sandbox_templates (id, tenant_id, name, pool_id, deleted, instance_version,
                                        doc, created_at, updated_at, version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
         ON CONFLICT (id) DO UPDATE SET deleted = excluded.deleted,
            instance_version = excluded.instance_version, doc = excluded.doc,
            updated_at = excluded.updated_at, version = excluded.version",
    )
    .bind(&t.id)
    .bind(&t.tenant_id)
    .bind(&t.name)
    .bind(&t.pool_id)
    .bind(t.deleted)
    .bind(t.instance_version as i64)
    .bind(Json(&t))
    .bind(t.created_at)
    .bind(t.updated_at)
    .bind(t.version as i64)
    .execute(conn)
    .await?;
    Ok(())
}

/// Applies one sandbox event.
pub async fn apply_sandbox(
    conn: &mut PgConnection,
    e: &RecordedEvent,
) -> Result<(), ProjectionError> {
    let event = crate::typed::<SandboxEvent>(e)?;
    let s = evolve::<Sandbox>(conn, "sandboxes", e, &event).await?;
    sqlx::query(
        "INSERT INTO sandboxes (id, tenant_id, template_id, instance_id, owner_identity_id, state,
                                expires_at, doc, created_at, updated_at, version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at,
            doc = excluded.doc, updated_at = excluded.updated_at, version = excluded.version",
    )
    .bind(&s.id)
    .bind(&s.tenant_id)
    .bind(&s.template_id)
    .bind(&s.instance_id)
    .bind(&s.owner_identity_id)
    .bind(s.state.as_str())
    .bind(s.expires_at)
    .bind(Json(&s))
    .bind(s.created_at)
    .bind(s.updated_at)
    .bind(s.version as i64)
    .execute(conn)
    .await?;
    Ok(())
}

/// The row's aggregate after `event` (the row's `doc` is the aggregate folded so far).
pub(crate) async fn evolve<A: Aggregate + DeserializeOwned + Serialize>(
    conn: &mut PgConnection,
    table: &str,
    e: &RecordedEvent,
    event: &A::Event,
) -> Result<A, ProjectionError> {
    let id = e.stream.split_once('-').map_or("", |(_, id)| id);
    let before = load_doc::<A>(conn, table, id).await?;
    A::evolve(before, event, e.recorded_at).map_err(|err| ProjectionError::Malformed {
        event_id: e.id.clone(),
        event_type: e.event_type.clone(),
        message: err.to_string(),
    })
}

pub(crate) async fn load_doc<A: DeserializeOwned>(
    conn: &mut PgConnection,
    table: &str,
    id: &str,
) -> Result<Option<A>, ProjectionError> {
    // `table` is a projection table named by the code, never input.
    let row = sqlx::query(&format!("SELECT doc FROM {table} WHERE id = $1"))
        .bind(id)
        .fetch_optional(conn)
        .await?;
    Ok(row.map(|r| r.get::<Json<A>, _>(0).0))
}

/// A template as stored (deleted ones too).
pub async fn load_template(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<Template>, ProjectionError> {
    load_doc(conn, "sandbox_templates", id).await
}

/// A sandbox as stored.
pub async fn load_sandbox(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<Sandbox>, ProjectionError> {
    load_doc(conn, "sandboxes", id).await
}

/// A tenant's live templates, by name.
pub async fn templates_of(
    conn: &mut PgConnection,
    tenant_id: &str,
) -> Result<Vec<Template>, ProjectionError> {
    let rows: Vec<Json<Template>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_templates WHERE tenant_id = $1 AND NOT deleted ORDER BY name",
    )
    .bind(tenant_id)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}

/// What `sandboxes.list` selects.
#[derive(Debug, Clone, Default)]
pub struct SandboxFilter {
    /// The tenant.
    pub tenant_id: String,
    /// Only this identity's (`scope: mine`).
    pub owner: Option<String>,
    /// Deleted ones too.
    pub deleted: bool,
    /// Only this template's.
    pub template_id: Option<String>,
    /// Page size.
    pub limit: i64,
    /// After this sandbox id (the previous page's last).
    pub cursor: Option<String>,
}

/// A page of sandboxes, newest first.
pub async fn page(
    conn: &mut PgConnection,
    f: &SandboxFilter,
) -> Result<Vec<Sandbox>, ProjectionError> {
    let rows: Vec<Json<Sandbox>> = sqlx::query_scalar(
        "SELECT doc FROM sandboxes s
          WHERE tenant_id = $1
            AND ($2::text IS NULL OR owner_identity_id = $2)
            AND ($3 OR state <> 'deleted')
            AND ($4::text IS NULL OR template_id = $4)
            AND ($5::text IS NULL OR (created_at, id) <
                 (SELECT created_at, id FROM sandboxes WHERE id = $5))
          ORDER BY created_at DESC, id DESC
          LIMIT $6",
    )
    .bind(&f.tenant_id)
    .bind(&f.owner)
    .bind(f.deleted)
    .bind(&f.template_id)
    .bind(&f.cursor)
    .bind(f.limit)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}
