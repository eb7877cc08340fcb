//! The `sandbox_templates`, `sandboxes` and `sandbox_snapshots` tables, from their streams.
//! Each row keeps the aggregate folded so far (`doc`) beside the columns reads and the
//! reconciler filter on. Snapshots are part of their sandbox's stream; their rows let a
//! snapshot be found by id, and a node's pending ones listed.

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::aggregate::Aggregate;
use vps_domain::sandbox::{Sandbox, SandboxEvent, Snapshot, SnapshotState};
use vps_domain::template::{Template, TemplateEvent};
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one template event.
pub async fn apply_template(
    conn: &mut PgConnection,
    e: &RecordedEvent,
) -> Result<(), ProjectionError> {
    let event = crate::typed::<TemplateEvent>(e)?;
    let t = evolve(
        conn,
        "sandbox_templates",
        e,
        &event,
        None,
        |t: &Template| &t.id,
    )
    .await?;
    sqlx::query(
        "INSERT INTO sandbox_templates (id, tenant_id, name, pool_id, deleted, instance_version,
                                        doc, created_at, updated_at, version, labels)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
         ON CONFLICT (id) DO UPDATE SET deleted = excluded.deleted,
            instance_version = excluded.instance_version, doc = excluded.doc,
            updated_at = excluded.updated_at, version = excluded.version,
            labels = excluded.labels",
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
    .bind(Json(&t.labels))
    .execute(conn)
    .await?;
    Ok(())
}

/// Applies one sandbox event.
pub async fn apply_sandbox(
    conn: &mut PgConnection,
    e: &RecordedEvent,
    prior: Option<&Sandbox>,
) -> Result<(), ProjectionError> {
    let event = crate::typed::<SandboxEvent>(e)?;
    // The stored document holds no snapshots (they have their own rows, so a sandbox's row
    // does not grow with its snapshot history): a snapshot event's fold takes the snapshot it
    // is about from `sandbox_snapshots`.
    let before = match crate::known_before(e, prior, |s: &Sandbox| &s.id) {
        Ok(known) => known,
        Err(()) => load_doc::<Sandbox>(conn, "sandboxes", sandbox_id(e)).await?,
    };
    let before = match (before, snapshot_of(&event)) {
        (Some(mut b), Some(id)) if !b.snapshots.contains_key(id) => {
            if let Some(snap) = load_doc::<Snapshot>(conn, "sandbox_snapshots", id).await? {
                b.snapshots.insert(id.to_string(), snap);
            }
            Some(b)
        }
        (before, _) => before,
    };
    let s = Sandbox::evolve(before, &event, e.recorded_at).map_err(|err| {
        ProjectionError::Malformed {
            event_id: e.id.clone(),
            event_type: e.event_type.clone(),
            message: err.to_string(),
        }
    })?;
    let document = Sandbox {
        snapshots: Default::default(),
        ..s.clone()
    };
    sqlx::query(
        "INSERT INTO sandboxes (id, tenant_id, template_id, instance_id, owner_identity_id, state,
                                expires_at, doc, created_at, updated_at, version, labels)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at,
            doc = excluded.doc, updated_at = excluded.updated_at, version = excluded.version,
            labels = excluded.labels",
    )
    .bind(&s.id)
    .bind(&s.tenant_id)
    .bind(&s.template_id)
    .bind(&s.instance_id)
    .bind(&s.owner_identity_id)
    .bind(s.state.as_str())
    .bind(s.expires_at)
    .bind(Json(&document))
    .bind(s.created_at)
    .bind(s.updated_at)
    .bind(s.version as i64)
    .bind(Json(&s.labels))
    .execute(&mut *conn)
    .await?;
    if let Some(snap) = snapshot_of(&event).and_then(|id| s.snapshots.get(id)) {
        upsert_snapshot(conn, snap).await?;
    }
    Ok(())
}

/// The sandbox a sandbox event's stream names.
fn sandbox_id(e: &RecordedEvent) -> &str {
    e.stream.split_once('-').map_or("", |(_, id)| id)
}

/// A sandbox's live snapshots, oldest first, from their own rows.
pub async fn snapshots_of(
    conn: &mut PgConnection,
    sandbox_id: &str,
) -> Result<Vec<Snapshot>, ProjectionError> {
    let rows: Vec<Json<Snapshot>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_snapshots WHERE sandbox_id = $1 AND NOT deleted
          ORDER BY created_at, id",
    )
    .bind(sandbox_id)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}

/// The snapshot a sandbox event is about.
fn snapshot_of(event: &SandboxEvent) -> Option<&str> {
    match event {
        SandboxEvent::SnapshotRequested(e) => Some(&e.snapshot_id),
        SandboxEvent::SnapshotReady(e) => Some(&e.snapshot_id),
        SandboxEvent::SnapshotFailed(e) => Some(&e.snapshot_id),
        SandboxEvent::SnapshotDeleted(e) | SandboxEvent::SnapshotPurged(e) => Some(&e.snapshot_id),
        _ => None,
    }
}

async fn upsert_snapshot(conn: &mut PgConnection, snap: &Snapshot) -> Result<(), ProjectionError> {
    sqlx::query(
        "INSERT INTO sandbox_snapshots (id, sandbox_id, tenant_id, owner_identity_id, template_id,
                                        node_id, instance_id, state, include_memory, keep,
                                        deleted, purged, doc, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, deleted = excluded.deleted,
            purged = excluded.purged, doc = excluded.doc",
    )
    .bind(&snap.id)
    .bind(&snap.sandbox_id)
    .bind(&snap.tenant_id)
    .bind(&snap.owner_identity_id)
    .bind(&snap.template_id)
    .bind(&snap.node_id)
    .bind(&snap.instance_id)
    .bind(snapshot_state(snap.state))
    .bind(snap.include_memory)
    .bind(snap.keep)
    .bind(snap.is_deleted())
    .bind(snap.purged)
    .bind(Json(snap))
    .bind(snap.created_at)
    .execute(conn)
    .await?;
    Ok(())
}

fn snapshot_state(state: SnapshotState) -> &'static str {
    match state {
        SnapshotState::Pending => "pending",
        SnapshotState::Ready => "ready",
        SnapshotState::Failed => "failed",
    }
}

/// What `sandboxSnapshots.list` selects.
#[derive(Debug, Clone, Default)]
pub struct SnapshotFilter {
    /// The tenant.
    pub tenant_id: String,
    /// Only this identity's (`scope: mine`).
    pub owner: Option<String>,
    /// Only this sandbox's.
    pub sandbox_id: Option<String>,
    /// Page size.
    pub limit: i64,
    /// After this snapshot id (the previous page's last).
    pub cursor: Option<String>,
}

/// A page of live snapshots, newest first.
pub async fn snapshot_page(
    conn: &mut PgConnection,
    f: &SnapshotFilter,
) -> Result<Vec<Snapshot>, ProjectionError> {
    let rows: Vec<Json<Snapshot>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_snapshots
          WHERE tenant_id = $1 AND NOT deleted
            AND ($2::text IS NULL OR owner_identity_id = $2)
            AND ($3::text IS NULL OR sandbox_id = $3)
            AND ($4::text IS NULL OR (created_at, id) <
                 (SELECT created_at, id FROM sandbox_snapshots WHERE id = $4 AND tenant_id = $1))
          ORDER BY created_at DESC, id DESC
          LIMIT $5",
    )
    .bind(&f.tenant_id)
    .bind(&f.owner)
    .bind(&f.sandbox_id)
    .bind(&f.cursor)
    .bind(f.limit)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}

/// The row's aggregate after `event` (the row's `doc` is the aggregate folded so far).
pub(crate) async fn evolve<A: Aggregate + DeserializeOwned + Serialize>(
    conn: &mut PgConnection,
    table: &str,
    e: &RecordedEvent,
    event: &A::Event,
    prior: Option<&A>,
    id_of: impl Fn(&A) -> &str,
) -> Result<A, ProjectionError> {
    let id = e.stream.split_once('-').map_or("", |(_, id)| id);
    let before = match crate::known_before(e, prior, id_of) {
        Ok(known) => known,
        Err(()) => load_doc::<A>(conn, table, id).await?,
    };
    A::evolve(before, event, e.recorded_at).map_err(|err| ProjectionError::Malformed {
        event_id: e.id.clone(),
        event_type: e.event_type.clone(),
        message: err.to_string(),
    })
}

/// The aggregate stored in row `id` of `table` (its `doc`), if there is one.
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
    match row {
        Some(row) => Ok(Some(row.try_get::<Json<A>, _>(0)?.0)),
        None => Ok(None),
    }
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
    /// Only those carrying every one of these labels.
    pub labels: vps_domain::labels::Labels,
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
                 (SELECT created_at, id FROM sandboxes WHERE id = $5 AND tenant_id = $1))
            AND labels @> $7
          ORDER BY created_at DESC, id DESC
          LIMIT $6",
    )
    .bind(&f.tenant_id)
    .bind(&f.owner)
    .bind(f.deleted)
    .bind(&f.template_id)
    .bind(&f.cursor)
    .bind(f.limit)
    .bind(Json(&f.labels))
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}
