//! The reads of `sandboxes`, `sandbox_templates` and `sandbox_snapshots`: what the commands,
//! the sandbox reconciler, the waker, `doctor` and the tools ask of these tables. Each keeps
//! the SQL (and its locking) its caller tuned; rows come back typed.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use vps_domain::sandbox::{Sandbox, Snapshot};
use vps_domain::template::Template;

use super::load_doc;
use crate::ProjectionError;

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

/// A page of sandboxes, newest first. Only the filter's conditions are in the statement, so
/// each combination's plan can walk the index that serves it (see `instances::page`).
pub async fn page(
    conn: &mut PgConnection,
    f: &SandboxFilter,
) -> Result<Vec<Sandbox>, ProjectionError> {
    // A label alone: the page is cut on ids first (see `pages` and the labels below).
    let ids_first = !f.labels.is_empty() && f.template_id.is_none();
    let mut q = crate::pages::open("sandboxes", ids_first);
    q.push("tenant_id = ").push_bind(&f.tenant_id);
    if let Some(owner) = &f.owner {
        q.push(" AND owner_identity_id = ").push_bind(owner);
    }
    if !f.deleted {
        q.push(" AND state <> 'deleted'");
    }
    if let Some(template_id) = &f.template_id {
        q.push(" AND template_id = ").push_bind(template_id);
    }
    if let Some(cursor) = &f.cursor {
        q.push(" AND (created_at, id) < (SELECT created_at, id FROM sandboxes WHERE id = ")
            .push_bind(cursor)
            .push(" AND tenant_id = ")
            .push_bind(&f.tenant_id)
            .push(")");
    }
    // Alone, a label filter is served by an index-only walk of the listing index (it includes
    // the labels) or, before a vacuum has marked the pages all-visible, by the labels' GIN
    // index's bitmap. Beside a template, the function form, which no index serves, leaves the plan
    // to the template's ordered walk: the planner takes a template and a label for
    // independent, and sorting the bitmap of a common label cost 56 ms at 100,000 rows.
    if !f.labels.is_empty() {
        let contains = match f.template_id {
            None => " AND labels @> ",
            Some(_) => " AND jsonb_contains(labels, ",
        };
        q.push(contains).push_bind(Json(&f.labels));
        if f.template_id.is_some() {
            q.push(")");
        }
    }
    crate::pages::close(&mut q, "sandboxes", ids_first, f.limit);
    let rows: Vec<Json<Sandbox>> = q.build_query_scalar().fetch_all(conn).await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}

/// Locks sandbox `id`'s row to the transaction's end unless another transaction holds it
/// (`FOR UPDATE SKIP LOCKED`). Whether it did (`false` too when there is no such row).
pub async fn lock_unless_held(conn: &mut PgConnection, id: &str) -> Result<bool, sqlx::Error> {
    let free: Option<String> =
        sqlx::query_scalar("SELECT id FROM sandboxes WHERE id = $1 FOR UPDATE SKIP LOCKED")
            .bind(id)
            .fetch_optional(conn)
            .await?;
    Ok(free.is_some())
}

/// The sandboxes of these ids, as stored, in no particular order.
pub async fn load_sandboxes<'e>(
    db: impl PgExecutor<'e>,
    ids: &[&str],
) -> Result<Vec<Sandbox>, sqlx::Error> {
    let rows: Vec<Json<Sandbox>> =
        sqlx::query_scalar("SELECT doc FROM sandboxes WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(|j| j.0).collect())
}

/// The row version of each of these sandboxes that exists (what a wait watches).
pub async fn versions<'e>(
    db: impl PgExecutor<'e>,
    ids: &[String],
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT id, version FROM sandboxes WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(db)
        .await
}

/// The bounds of the sandbox reconciler's read ([`looks`]).
#[derive(Debug, Clone, Copy)]
pub struct LookBounds {
    /// The pass's time: sandboxes expiring by then.
    pub now: DateTime<Utc>,
    /// Sandboxes expiring by then and not yet warned.
    pub horizon: DateTime<Utc>,
    /// The most of each kind, the most overdue first.
    pub limit: i64,
    /// `starting` since before this is past its deadline.
    pub starting_before: DateTime<Utc>,
    /// `pausing` since before this is past its deadline.
    pub pausing_before: DateTime<Utc>,
    /// `resuming` since before this is past its deadline.
    pub resuming_before: DateTime<Utc>,
}

/// A sandbox as the reconciler looks at it, with its instance's `state` column (none when the
/// instance is gone).
#[derive(Debug, Clone)]
pub struct SandboxLook {
    /// As stored.
    pub sandbox: Sandbox,
    /// Its instance's `instances.state`.
    pub instance_state: Option<vps_domain::state_table::InstanceState>,
}

/// The sandboxes a reconciler pass may have work for, with their instances' states: those
/// past expiry or within the warning horizon and not warned, those past a transition's
/// deadline (at most `limit` of each), and those whose instance moved where they did not
/// follow (at most 100).
pub async fn looks<'e>(
    db: impl PgExecutor<'e>,
    b: &LookBounds,
) -> Result<Vec<SandboxLook>, sqlx::Error> {
    let rows: Vec<(Json<Sandbox>, Option<String>)> = sqlx::query_as(
        "SELECT s.doc, i.state FROM sandboxes s LEFT JOIN instances i ON i.id = s.instance_id
          WHERE s.id IN (
             (SELECT id FROM sandboxes
               WHERE state IN ('starting', 'ready', 'failed', 'pausing', 'paused', 'resuming')
                 AND expires_at <= $1
               ORDER BY expires_at LIMIT $3)
             UNION
             (SELECT id FROM sandboxes
               WHERE state IN ('starting', 'ready', 'failed', 'pausing', 'paused', 'resuming')
                 AND expires_at > $1 AND expires_at <= $2 AND NOT (doc->>'expiringSent')::boolean
               ORDER BY expires_at LIMIT $3)
             UNION
             (SELECT id FROM sandboxes
               WHERE state IN ('starting', 'pausing', 'resuming')
                 AND COALESCE((doc->>'stateSince')::timestamptz, created_at) <= CASE state
                       WHEN 'starting' THEN $4 WHEN 'pausing' THEN $5 ELSE $6 END
               LIMIT $3)
             UNION
             (SELECT s.id FROM sandboxes s LEFT JOIN instances i ON i.id = s.instance_id
               WHERE (s.state IN ('starting', 'resuming') AND i.state = 'running')
                  OR (s.state = 'pausing' AND i.state = 'paused')
                  OR (s.state <> 'deleted' AND (i.id IS NULL OR i.state = 'deleted')
                      AND NOT (s.state = 'failed' AND s.doc->>'reason' LIKE 'deadline:%'))
               LIMIT 100))",
    )
    .bind(b.now)
    .bind(b.horizon)
    .bind(b.limit)
    .bind(b.starting_before)
    .bind(b.pausing_before)
    .bind(b.resuming_before)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(Json(sandbox), instance_state)| SandboxLook {
            sandbox,
            instance_state: instance_state.map(crate::instances::reads::state_column),
        })
        .collect())
}

/// Open sandboxes well past their expiry (`doctor`'s expiry check).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OverdueSandboxes {
    /// How many.
    pub count: i64,
    /// The first five, the most overdue first.
    pub ids: Vec<String>,
    /// Seconds the most overdue is past its expiry.
    pub oldest_secs: Option<f64>,
}

/// Open sandboxes more than `grace_secs` past `expiresAt`, by the database's clock.
pub async fn overdue<'e>(
    db: impl PgExecutor<'e>,
    grace_secs: f64,
) -> Result<OverdueSandboxes, sqlx::Error> {
    let (count, ids, oldest_secs): (i64, Vec<String>, Option<f64>) = sqlx::query_as(
        "SELECT count(*),
                coalesce((array_agg(id ORDER BY expires_at))[1:5], '{}'::text[]),
                max(extract(epoch FROM now() - expires_at))::float8
           FROM sandboxes
          WHERE state IN ('starting', 'ready', 'failed')
            AND expires_at < now() - make_interval(secs => $1)",
    )
    .bind(grace_secs)
    .fetch_one(db)
    .await?;
    Ok(OverdueSandboxes {
        count,
        ids,
        oldest_secs,
    })
}

/// Every open sandbox (not deleting or deleted).
pub async fn open_ids<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM sandboxes WHERE state NOT IN ('deleting', 'deleted')")
        .fetch_all(db)
        .await
}

/// Every live template's id.
pub async fn live_template_ids<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM sandbox_templates WHERE NOT deleted")
        .fetch_all(db)
        .await
}

/// How many live templates a tenant has.
pub async fn live_template_count<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM sandbox_templates WHERE tenant_id = $1 AND NOT deleted",
    )
    .bind(tenant_id)
    .fetch_one(db)
    .await
}

/// The id of the tenant's live template called `name`.
pub async fn live_template_named<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: &str,
    name: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM sandbox_templates WHERE tenant_id = $1 AND name = $2 AND NOT deleted",
    )
    .bind(tenant_id)
    .bind(name)
    .fetch_optional(db)
    .await
}

/// Whether another live template of the tenant (not `id`) is called `name`.
pub async fn template_name_taken<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: &str,
    name: &str,
    id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sandbox_templates
                         WHERE tenant_id = $1 AND name = $2 AND NOT deleted AND id <> $3)",
    )
    .bind(tenant_id)
    .bind(name)
    .bind(id)
    .fetch_one(db)
    .await
}

/// Whether template `id` is live at `instance_version`, its row held (`FOR SHARE`) to the
/// transaction's end; `None` when there is no such template.
pub async fn template_unchanged(
    conn: &mut PgConnection,
    id: &str,
    instance_version: i64,
) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT NOT deleted AND instance_version = $2 FROM sandbox_templates
              WHERE id = $1 FOR SHARE",
    )
    .bind(id)
    .bind(instance_version)
    .fetch_optional(conn)
    .await
}

/// A template the warm-pool pass visits: its id, and the template unless it is gone, deleted
/// or its tenant's teardown began (then its pool is drained).
#[derive(Debug, Clone)]
pub struct WarmTemplate {
    /// `sbxt_…`.
    pub id: String,
    /// The live template, if any.
    pub template: Option<Template>,
}

/// Every template with a warm pool, and every template (deleted ones too) that still has warm
/// instances that are not being deleted.
pub async fn warm_templates<'e>(db: impl PgExecutor<'e>) -> Result<Vec<WarmTemplate>, sqlx::Error> {
    let rows: Vec<(String, Option<Json<Template>>)> = sqlx::query_as(
        "SELECT w.id, t.doc FROM (
             SELECT id FROM sandbox_templates WHERE NOT deleted AND doc->'warm' IS NOT NULL
             UNION
             SELECT DISTINCT warm_template_id FROM instances
              WHERE warm_template_id IS NOT NULL AND desired_state <> 'deleted'
         ) w LEFT JOIN sandbox_templates t ON t.id = w.id
               AND NOT EXISTS (SELECT 1 FROM tenants d WHERE d.id = t.tenant_id)",
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, template)| WarmTemplate {
            id,
            template: template.map(|Json(t)| t),
        })
        .collect())
}

/// A live template with `warm.min`, as `doctor`'s warm check judges it.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmPool {
    /// `sbxt_…`.
    pub template_id: String,
    /// Its `warm.min`.
    pub min: i64,
    /// Its settled, unclaimed warm instances of the current version.
    pub settled: i64,
    /// Seconds since its last refill or change.
    pub since_secs: f64,
}

/// Every live template with a `warm.min` above 0, by id.
pub async fn warm_pools<'e>(db: impl PgExecutor<'e>) -> Result<Vec<WarmPool>, sqlx::Error> {
    let rows: Vec<(String, i64, i64, f64)> = sqlx::query_as(
        "SELECT t.id, (t.doc->'warm'->>'min')::bigint,
                (SELECT count(*) FROM instances i
                  WHERE i.warm_template_id = t.id AND i.template_version = t.instance_version
                    AND i.state IN ('stopped', 'paused') AND i.desired_state <> 'deleted'
                    AND i.doc->>'sandboxId' IS NULL),
                extract(epoch FROM now() - greatest(t.updated_at,
                    (SELECT max(i.created_at) FROM instances i WHERE i.warm_template_id = t.id)))::float8
           FROM sandbox_templates t
          WHERE NOT t.deleted AND coalesce((t.doc->'warm'->>'min')::bigint, 0) > 0
          ORDER BY t.id",
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(template_id, min, settled, since_secs)| WarmPool {
            template_id,
            min,
            settled,
            since_secs,
        })
        .collect())
}

/// A tenant's kept snapshots that count against its allowance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptSnapshots {
    /// How many.
    pub count: i64,
    /// Their bytes.
    pub bytes: i64,
}

/// The tenant's kept snapshots (not deleted, not failed).
pub async fn kept_snapshots<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: &str,
) -> Result<KeptSnapshots, sqlx::Error> {
    let (count, bytes): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(sum((doc->>'sizeBytes')::bigint), 0)::bigint
           FROM sandbox_snapshots
          WHERE tenant_id = $1 AND keep AND NOT deleted AND state <> 'failed'",
    )
    .bind(tenant_id)
    .fetch_one(db)
    .await?;
    Ok(KeptSnapshots { count, bytes })
}

/// The sandbox snapshot `id` belongs to.
pub async fn sandbox_of_snapshot<'e>(
    db: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT sandbox_id FROM sandbox_snapshots WHERE id = $1")
        .bind(id)
        .fetch_optional(db)
        .await
}

/// The sandbox snapshot `id` belongs to, its row held (`FOR SHARE`) to the transaction's end,
/// so a concurrent delete (and so a purge) waits for it.
pub async fn sandbox_of_snapshot_for_share(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT sandbox_id FROM sandbox_snapshots WHERE id = $1 FOR SHARE")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// A snapshot by its ids: its own, its sandbox's and its tenant's.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SnapshotRef {
    /// `snap_…`.
    pub id: String,
    /// Its sandbox.
    pub sandbox_id: String,
    /// The tenant.
    pub tenant_id: String,
}

/// Which of these snapshots are `pending` on `node_id`, by sandbox then id.
pub async fn pending_on_node<'e>(
    db: impl PgExecutor<'e>,
    ids: &[&str],
    node_id: &str,
) -> Result<Vec<SnapshotRef>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, sandbox_id, tenant_id FROM sandbox_snapshots
          WHERE id = ANY($1) AND node_id = $2 AND state = 'pending' ORDER BY sandbox_id, id",
    )
    .bind(ids)
    .bind(node_id)
    .fetch_all(db)
    .await
}

/// A snapshot and its tenant (what names its object in the store).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SnapshotOfTenant {
    /// `snap_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
}

/// Which of these snapshots are `pending` on `node_id`, by id.
pub async fn pending_tenants_on_node<'e>(
    db: impl PgExecutor<'e>,
    ids: &[&str],
    node_id: &str,
) -> Result<Vec<SnapshotOfTenant>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, tenant_id FROM sandbox_snapshots
          WHERE id = ANY($1) AND node_id = $2 AND state = 'pending' ORDER BY id",
    )
    .bind(ids)
    .bind(node_id)
    .fetch_all(db)
    .await
}

/// Deleted snapshots whose object may go (their upload settled, no live instance restores
/// from them), up to `limit`, by id.
pub async fn purgeable<'e>(
    db: impl PgExecutor<'e>,
    limit: i64,
) -> Result<Vec<SnapshotRef>, sqlx::Error> {
    sqlx::query_as(
        "SELECT s.id, s.sandbox_id, s.tenant_id FROM sandbox_snapshots s
          WHERE s.deleted AND NOT s.purged AND s.state <> 'pending'
            AND NOT EXISTS (SELECT 1 FROM instances i
                             WHERE i.doc->'restoreFrom'->>'snapshotId' = s.id
                               AND i.state <> 'deleted')
          ORDER BY s.id LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Pending snapshots asked for before `before`, up to `limit`, the oldest first.
pub async fn overdue_snapshots<'e>(
    db: impl PgExecutor<'e>,
    before: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<SnapshotRef>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, sandbox_id, tenant_id FROM sandbox_snapshots
          WHERE state = 'pending' AND created_at < $1 ORDER BY created_at LIMIT $2",
    )
    .bind(before)
    .bind(limit)
    .fetch_all(db)
    .await
}
