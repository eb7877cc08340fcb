//! The `sandbox_templates`, `sandboxes` and `sandbox_snapshots` tables, from their streams.
//! Each row keeps the aggregate folded so far (`doc`) beside the columns reads and the
//! reconciler filter on. Snapshots are part of their sandbox's stream; their rows let a
//! snapshot be found by id, and a node's pending ones listed. What the rest of the workspace
//! reads of these tables is in `reads`.

use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use vps_domain::aggregate::Aggregate;
use vps_domain::sandbox::{Sandbox, SandboxEvent, Snapshot, SnapshotState};
use vps_domain::template::{Template, TemplateEvent};
use vps_events::RecordedEvent;

use crate::ProjectionError;

mod reads;
pub use reads::*;

/// What storing a sandbox changes of a row that exists (the batched rebuild stores with the
/// same clause).
macro_rules! sandbox_conflict {
    () => {
        " ON CONFLICT (id) DO UPDATE SET state = excluded.state, expires_at = excluded.expires_at,
            doc = excluded.doc, updated_at = excluded.updated_at, version = excluded.version,
            labels = excluded.labels"
    };
}

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
    sqlx::query(concat!(
        "INSERT INTO sandboxes (id, tenant_id, template_id, instance_id, owner_identity_id, state,
                                expires_at, doc, created_at, updated_at, version, labels)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        sandbox_conflict!()
    ))
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

/// [`apply_sandbox`] for many events at once (a replay): every sandbox event but the snapshot
/// ones folded in memory with the same `evolve`, the rows written with one statement. A
/// snapshot event goes through [`apply_sandbox`] after a flush, and its sandbox is then read
/// back ([`SandboxBatch::forget`]).
#[derive(Default)]
pub(crate) struct SandboxBatch {
    /// Stored documents (without snapshots) as they stand after the events folded.
    views: std::collections::HashMap<String, Sandbox>,
    dirty: Vec<String>,
    dirty_set: std::collections::HashSet<String>,
    /// Sandboxes created since the last flush (no row holds them yet).
    fresh: std::collections::HashSet<String>,
}

impl SandboxBatch {
    /// Whether [`SandboxBatch::fold`] takes the event (else: [`apply_sandbox`]).
    pub(crate) fn takes(event: &SandboxEvent) -> bool {
        snapshot_of(event).is_none()
    }

    /// Folds one sandbox event that [`SandboxBatch::takes`].
    pub(crate) async fn fold(
        &mut self,
        conn: &mut PgConnection,
        e: &RecordedEvent,
        event: &SandboxEvent,
    ) -> Result<(), ProjectionError> {
        let id = sandbox_id(e);
        let before = if e.version == 1 {
            None
        } else if let Some(s) = self.views.get(id) {
            Some(s.clone())
        } else {
            load_doc::<Sandbox>(conn, "sandboxes", id).await?
        };
        let created = before.is_none();
        let s = Sandbox::evolve(before, event, e.recorded_at).map_err(|err| {
            ProjectionError::Malformed {
                event_id: e.id.clone(),
                event_type: e.event_type.clone(),
                message: err.to_string(),
            }
        })?;
        let document = Sandbox {
            snapshots: Default::default(),
            ..s
        };
        if created {
            self.fresh.insert(document.id.clone());
        }
        if self.dirty_set.insert(document.id.clone()) {
            self.dirty.push(document.id.clone());
        }
        self.views.insert(document.id.clone(), document);
        Ok(())
    }

    /// Forgets a sandbox another projector wrote (read back at its next event).
    pub(crate) fn forget(&mut self, id: &str) {
        self.views.remove(id);
    }

    /// Whether anything waits to be written.
    pub(crate) fn is_empty(&self) -> bool {
        self.dirty.is_empty()
    }

    /// Writes the changed rows; deleted sandboxes are then forgotten.
    pub(crate) async fn flush(&mut self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        let (new, all): (Vec<&Sandbox>, Vec<&Sandbox>) = self
            .dirty
            .iter()
            .filter_map(|id| self.views.get(id))
            .partition(|s| self.fresh.contains(&s.id));
        if !new.is_empty() {
            copy_sandboxes(conn, &new).await?;
        }
        if !all.is_empty() {
            let text = |f: fn(&Sandbox) -> &str| all.iter().map(|s| f(s)).collect::<Vec<_>>();
            sqlx::query(concat!(
                "INSERT INTO sandboxes (id, tenant_id, template_id, instance_id, owner_identity_id,
                                        state, expires_at, doc, created_at, updated_at, version,
                                        labels)
                 SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                                      $6::text[], $7::timestamptz[], $8::jsonb[],
                                      $9::timestamptz[], $10::timestamptz[], $11::bigint[],
                                      $12::jsonb[])",
                sandbox_conflict!()
            ))
            .bind(text(|s| &s.id))
            .bind(text(|s| &s.tenant_id))
            .bind(text(|s| &s.template_id))
            .bind(text(|s| &s.instance_id))
            .bind(text(|s| &s.owner_identity_id))
            .bind(text(|s| s.state.as_str()))
            .bind(all.iter().map(|s| s.expires_at).collect::<Vec<_>>())
            .bind(all.iter().map(|s| Json(*s)).collect::<Vec<_>>())
            .bind(all.iter().map(|s| s.created_at).collect::<Vec<_>>())
            .bind(all.iter().map(|s| s.updated_at).collect::<Vec<_>>())
            .bind(all.iter().map(|s| s.version as i64).collect::<Vec<_>>())
            .bind(all.iter().map(|s| Json(&s.labels)).collect::<Vec<_>>())
            .execute(conn)
            .await?;
        }
        self.dirty.clear();
        self.dirty_set.clear();
        self.fresh.clear();
        self.views
            .retain(|_, s| s.state != vps_domain::sandbox::SandboxState::Deleted);
        Ok(())
    }
}

/// Copies the rows of sandboxes no row holds yet (the values the batch's upsert writes).
async fn copy_sandboxes(conn: &mut PgConnection, all: &[&Sandbox]) -> Result<(), ProjectionError> {
    const COLUMNS: [&str; 12] = [
        "id",
        "tenant_id",
        "template_id",
        "instance_id",
        "owner_identity_id",
        "state",
        "expires_at",
        "doc",
        "created_at",
        "updated_at",
        "version",
        "labels",
    ];
    vps_pg::copy::copy_rows(conn, "sandboxes", &COLUMNS, all, |row, s| {
        row.field(&s.id.as_str())?;
        row.field(&s.tenant_id.as_str())?;
        row.field(&s.template_id.as_str())?;
        row.field(&s.instance_id.as_str())?;
        row.field(&s.owner_identity_id.as_str())?;
        row.field(&s.state.as_str())?;
        row.field(&s.expires_at)?;
        row.jsonb(s)?;
        row.field(&s.created_at)?;
        row.field(&s.updated_at)?;
        row.field(&(s.version as i64))?;
        row.jsonb(&s.labels)
    })
    .await?;
    Ok(())
}

/// The sandbox a sandbox event's stream names.
pub(crate) fn sandbox_id(e: &RecordedEvent) -> &str {
    e.stream.split_once('-').map_or("", |(_, id)| id)
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
