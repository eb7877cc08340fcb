//! The `sandbox_volumes` table from volume streams, and what a volume holds: its disk's node
//! allocation (`node_allocations.volume_id`) and its `diskGiB` charge in the tenant's quota.
//! Both are booked by `sandbox.volume.created`, grown by `resized` and released by `deleted`
//! (a deleting volume stays booked until its host let it go). Also the reads of volumes:
//! their public view, lists, and what still uses one.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use vps_domain::volume::{charge, InUse, Volume, VolumeEvent, VolumeState};
use vps_events::RecordedEvent;

use crate::instances::charge_quota;
use crate::sandboxes::{evolve, load_doc};
use crate::{bookings, ProjectionError};

const TABLE: &str = "sandbox_volumes";

/// Applies one volume event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let event = crate::typed::<VolumeEvent>(e)?;
    let v = evolve(conn, TABLE, e, &event, None, |v: &Volume| &v.id).await?;
    match &event {
        VolumeEvent::Created(c) => {
            let insert = concat!(
                "INSERT INTO node_allocations (id, node_id, volume_id, vcpu, memory_gib, disk_gib, gpus)
                 VALUES ($1, $2, $3, 0, 0, $4, 0)",
                bookings::returning!()
            );
            sqlx::query(&bookings::booking(insert, false))
                .bind(&c.allocation_id)
                .bind(&v.node_id)
                .bind(&v.id)
                .bind(i64::from(v.size_gib))
                .execute(&mut *conn)
                .await?;
            charge_quota(conn, &v.pool_id, &v.tenant_id, &charge(v.size_gib), 1).await?;
        }
        VolumeEvent::Resized(r) => {
            let update = concat!(
                "UPDATE node_allocations SET disk_gib = $2 WHERE volume_id = $1",
                bookings::returning!()
            );
            sqlx::query(&bookings::rebooking(update, "volume_id"))
                .bind(&v.id)
                .bind(i64::from(r.size_gib))
                .execute(&mut *conn)
                .await?;
            let growth = r.size_gib.saturating_sub(r.previous_size_gib);
            charge_quota(conn, &v.pool_id, &v.tenant_id, &charge(growth), 1).await?;
        }
        VolumeEvent::Deleted(_) => {
            let delete = concat!(
                "DELETE FROM node_allocations WHERE volume_id = $1",
                bookings::returning!()
            );
            sqlx::query(&bookings::booking(delete, true))
                .bind(&v.id)
                .execute(&mut *conn)
                .await?;
            charge_quota(conn, &v.pool_id, &v.tenant_id, &charge(v.size_gib), -1).await?;
        }
        VolumeEvent::Deleting(_) | VolumeEvent::Labeled(_) => {}
    }
    sqlx::query(
        "INSERT INTO sandbox_volumes (id, tenant_id, pool_id, name, node_id, state, size_gib,
                                      owner_identity_id, doc, created_at, updated_at, version)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
         ON CONFLICT (id) DO UPDATE SET state = excluded.state, size_gib = excluded.size_gib,
            doc = excluded.doc, updated_at = excluded.updated_at, version = excluded.version",
    )
    .bind(&v.id)
    .bind(&v.tenant_id)
    .bind(&v.pool_id)
    .bind(&v.name)
    .bind(&v.node_id)
    .bind(v.state.as_str())
    .bind(i64::from(v.size_gib))
    .bind(&v.owner_identity_id)
    .bind(Json(&v))
    .bind(v.created_at)
    .bind(v.updated_at)
    .bind(v.version as i64)
    .execute(conn)
    .await?;
    Ok(())
}

/// A volume as stored.
pub async fn load(conn: &mut PgConnection, id: &str) -> Result<Option<Volume>, ProjectionError> {
    load_doc(conn, TABLE, id).await
}

/// The public view of a volume (SPEC §5.1).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeView {
    /// `vol_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The hosted pool.
    pub pool_id: String,
    /// Unique among the tenant's volumes that are not deleted.
    pub name: String,
    /// Its size.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
    /// The node it lives on.
    pub node_id: String,
    /// `creating`, `ready`, `deleting` or `deleted`.
    pub state: VolumeState,
    /// The live instances attaching it.
    pub attached_to: Vec<String>,
    /// The guest sees it as `/dev/disk/by-id/virtio-<serial>`.
    pub serial: String,
    /// Who made it.
    pub owner_identity_id: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it was released.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Its labels.
    pub labels: vps_domain::labels::Labels,
    /// Its stream version.
    pub version: u64,
}

impl VolumeView {
    /// The view of `v`, attached to `attached_to`.
    pub fn new(v: &Volume, attached_to: Vec<String>) -> VolumeView {
        VolumeView {
            id: v.id.clone(),
            tenant_id: v.tenant_id.clone(),
            pool_id: v.pool_id.clone(),
            name: v.name.clone(),
            size_gib: v.size_gib,
            node_id: v.node_id.clone(),
            state: v.state,
            attached_to,
            serial: v.serial.clone(),
            owner_identity_id: v.owner_identity_id.clone(),
            created_at: v.created_at,
            updated_at: v.updated_at,
            deleted_at: v.deleted_at,
            labels: v.labels.clone(),
            version: v.version,
        }
    }
}

/// Live instances attaching any of `ids`, per volume: `(instance id, read-only)`.
pub async fn attachments(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<BTreeMap<String, Vec<(String, bool)>>, ProjectionError> {
    // One containment probe per volume, each answered by the `instances_volumes` index.
    let probes: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| serde_json::json!([{ "volumeId": id }]))
        .collect();
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT a->>'volumeId', i.id, coalesce((a->>'readOnly')::boolean, false)
           FROM instances i, jsonb_array_elements(i.doc->'volumes') a
          WHERE i.doc ? 'volumes' AND i.doc->'volumes' @> ANY ($2::jsonb[])
            AND i.state <> 'deleted' AND a->>'volumeId' = ANY ($1)
          ORDER BY i.id",
    )
    .bind(ids)
    .bind(&probes)
    .fetch_all(conn)
    .await?;
    let mut out: BTreeMap<String, Vec<(String, bool)>> = BTreeMap::new();
    for (volume, instance, read_only) in rows {
        out.entry(volume).or_default().push((instance, read_only));
    }
    Ok(out)
}

/// What still uses a volume: live instances attaching it, live templates naming it.
pub async fn in_use(conn: &mut PgConnection, id: &str) -> Result<InUse, ProjectionError> {
    let instances = attachments(conn, &[id.to_string()])
        .await?
        .remove(id)
        .unwrap_or_default()
        .into_iter()
        .map(|(instance, _)| instance)
        .collect();
    let templates: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM sandbox_templates
          WHERE NOT deleted AND doc ? 'volumes'
            AND doc->'volumes' @> jsonb_build_array(jsonb_build_object('volumeId', $1::text))
          ORDER BY id",
    )
    .bind(id)
    .fetch_all(conn)
    .await?;
    Ok(InUse {
        instances,
        templates,
    })
}

/// The view of a volume as stored.
pub async fn view(conn: &mut PgConnection, v: &Volume) -> Result<VolumeView, ProjectionError> {
    let attached = attachments(conn, std::slice::from_ref(&v.id)).await?;
    Ok(VolumeView::new(v, instance_ids(&attached, &v.id)))
}

fn instance_ids(attached: &BTreeMap<String, Vec<(String, bool)>>, id: &str) -> Vec<String> {
    attached
        .get(id)
        .map(|a| a.iter().map(|(i, _)| i.clone()).collect())
        .unwrap_or_default()
}

/// What `sandboxVolumes.list` selects.
#[derive(Debug, Clone, Default)]
pub struct VolumeFilter {
    /// The tenant.
    pub tenant_id: String,
    /// Only this identity's (`scope: mine`).
    pub owner: Option<String>,
    /// Only in this pool.
    pub pool_id: Option<String>,
    /// Deleted ones too.
    pub include_deleted: bool,
    /// At most this many.
    pub limit: i64,
    /// Only those carrying every one of these labels.
    pub labels: vps_domain::labels::Labels,
}

/// The volumes `filter` selects, oldest first, with what attaches them.
pub async fn list(
    conn: &mut PgConnection,
    f: &VolumeFilter,
) -> Result<Vec<VolumeView>, ProjectionError> {
    let rows: Vec<Json<Volume>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_volumes
          WHERE tenant_id = $1
            AND ($2::text IS NULL OR owner_identity_id = $2)
            AND ($3::text IS NULL OR pool_id = $3)
            AND ($4 OR state <> 'deleted')
            AND labels @> $6
          ORDER BY created_at, id
          LIMIT $5",
    )
    .bind(&f.tenant_id)
    .bind(&f.owner)
    .bind(&f.pool_id)
    .bind(f.include_deleted)
    .bind(f.limit)
    .bind(Json(&f.labels))
    .fetch_all(&mut *conn)
    .await?;
    let volumes: Vec<Volume> = rows.into_iter().map(|Json(v)| v).collect();
    let ids: Vec<String> = volumes.iter().map(|v| v.id.clone()).collect();
    let attached = attachments(conn, &ids).await?;
    Ok(volumes
        .iter()
        .map(|v| VolumeView::new(v, instance_ids(&attached, &v.id)))
        .collect())
}

/// Whether the tenant has a volume (not deleted) called `name`.
pub async fn name_taken<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: &str,
    name: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sandbox_volumes
                         WHERE tenant_id = $1 AND name = $2 AND state <> 'deleted')",
    )
    .bind(tenant_id)
    .bind(name)
    .fetch_one(db)
    .await
}

/// Locks volume `id`'s row to the transaction's end if it is `deleting` and no other
/// transaction holds it (`FOR UPDATE SKIP LOCKED`). Whether it did.
pub async fn lock_deleting_unless_held(
    conn: &mut PgConnection,
    id: &str,
) -> Result<bool, sqlx::Error> {
    let free: Option<String> = sqlx::query_scalar(
        "SELECT id FROM sandbox_volumes WHERE id = $1 AND state = 'deleting'
                FOR UPDATE SKIP LOCKED",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?;
    Ok(free.is_some())
}

/// Locks volume `id`'s row (if any) to the transaction's end.
pub async fn lock(conn: &mut PgConnection, id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1 FROM sandbox_volumes WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// The tenant's volumes (not deleted) of these names, by id, held (`FOR SHARE`) to the
/// transaction's end.
pub async fn named_for_share(
    conn: &mut PgConnection,
    tenant_id: &str,
    names: &[&str],
) -> Result<Vec<Volume>, sqlx::Error> {
    let found: Vec<Json<Volume>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_volumes
          WHERE tenant_id = $1 AND name = ANY($2) AND state <> 'deleted'
          ORDER BY id FOR SHARE",
    )
    .bind(tenant_id)
    .bind(names)
    .fetch_all(conn)
    .await?;
    Ok(found.into_iter().map(|j| j.0).collect())
}

/// The volumes of these ids, by id, locked (`FOR UPDATE`) to the transaction's end.
pub async fn lock_many(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<Vec<Volume>, sqlx::Error> {
    let volumes: Vec<Json<Volume>> = sqlx::query_scalar(
        "SELECT doc FROM sandbox_volumes WHERE id = ANY($1) ORDER BY id FOR UPDATE",
    )
    .bind(ids)
    .fetch_all(conn)
    .await?;
    Ok(volumes.into_iter().map(|j| j.0).collect())
}

/// Deleting volumes their host let go, by id, up to `limit`: absent from `node_spec_volumes`
/// (the NodeSpec follower took them out of the spec, at a generation no later than the
/// node's current one), and the host has applied that generation or is gone.
pub async fn releasable<'e>(
    db: impl PgExecutor<'e>,
    limit: i64,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT v.id FROM sandbox_volumes v
           LEFT JOIN nodes n ON n.id = v.node_id
           LEFT JOIN node_heartbeats h ON h.node_id = v.node_id
          WHERE v.state = 'deleting'
            AND NOT EXISTS (SELECT 1 FROM node_spec_volumes s WHERE s.volume_id = v.id)
            AND (n.id IS NULL OR n.state = 'lost'
                 OR h.applied_generation >= coalesce(
                        (SELECT generation FROM node_specs s WHERE s.node_id = v.node_id), 0))
          ORDER BY v.id
          LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}
