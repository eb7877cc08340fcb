//! Reads of the `instances` view (and of the IP leases its projector keeps) beyond
//! [`super::load`], [`super::page`] and [`super::load_many`]: row locks, the light views the
//! reconcilers and host reports decide on, and counts.

use chrono::{DateTime, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use vps_domain::instance::{Instance, ReportView};
use vps_domain::state_table::InstanceState;
use vps_domain::template::WarmMember;

use crate::instance_doc::{self, InstanceDoc};

/// Locks an instance's row to the transaction's end and answers the instance as the locked
/// row holds it (`None`: no such instance).
pub async fn lock(
    tx: &mut PgConnection,
    instance_id: &str,
) -> Result<Option<Instance>, sqlx::Error> {
    let row: Option<Json<InstanceDoc>> =
        sqlx::query_scalar("SELECT doc FROM instances WHERE id = $1 FOR UPDATE")
            .bind(instance_id)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(row.map(instance_doc::instance))
}

/// An instance's `state` column read back as the domain's state; a value the domain does not
/// know reads as `error`, so it is never taken for a settled state.
pub fn state_column(state: String) -> InstanceState {
    serde_json::from_value(serde_json::Value::String(state)).unwrap_or(InstanceState::Error)
}

/// The oldest settled (`stopped` or `paused`) warm instance of a template's version that is
/// not being deleted and no concurrent transaction holds, its row locked to the transaction's
/// end (`FOR UPDATE SKIP LOCKED`: concurrent claims never wait on each other).
pub async fn lock_warm(
    tx: &mut PgConnection,
    template_id: &str,
    template_version: i64,
) -> Result<Option<Instance>, sqlx::Error> {
    let row: Option<Json<InstanceDoc>> = sqlx::query_scalar(
        "SELECT doc FROM instances
          WHERE warm_template_id = $1 AND template_version = $2
            AND state IN ('stopped', 'paused') AND desired_state <> 'deleted'
          ORDER BY created_at, id
          LIMIT 1
          FOR UPDATE SKIP LOCKED",
    )
    .bind(template_id)
    .bind(template_version)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.map(instance_doc::instance))
}

/// A template's warm instances that are not being deleted.
pub async fn warm_members<'e>(
    db: impl PgExecutor<'e>,
    template_id: &str,
) -> Result<Vec<WarmMember>, sqlx::Error> {
    let rows: Vec<(String, Option<i64>, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT id, template_version, state, created_at FROM instances
          WHERE warm_template_id = $1 AND desired_state <> 'deleted' AND state <> 'deleted'",
    )
    .bind(template_id)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(id, version, state, created_at)| WarmMember {
            id,
            template_version: version.unwrap_or(0) as u64,
            state: state_column(state),
            created_at,
        })
        .collect())
}

/// How many warm instances (not deleted) each pool holds, by state: `(pool, state, count)`.
pub async fn warm_counts<'e>(
    db: impl PgExecutor<'e>,
) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT pool_id, state, count(*) FROM instances
          WHERE warm_template_id IS NOT NULL AND state <> 'deleted'
          GROUP BY 1, 2",
    )
    .fetch_all(db)
    .await
}

/// The columns of a [`ReportView`] row, for [`report_view`].
macro_rules! report_view_columns {
    () => {
        "SELECT id, state, coalesce(jsonb_array_length(doc->'conditions'), 0) > 0,
                coalesce(doc->'addresses', '[]'),
                doc->'restoreFrom'->>'principalInstanceId' IS NOT NULL,
                doc->>'sandboxId' IS NOT NULL"
    };
}

/// The light views of the live instances placed on a node, as `(id, view)`: what a host
/// report first compares, without the documents.
pub async fn report_rows(
    tx: &mut PgConnection,
    node_id: &str,
) -> Result<Vec<(String, ReportView)>, sqlx::Error> {
    let rows = sqlx::query_as(concat!(
        report_view_columns!(),
        " FROM instances
           WHERE node_id = $1 AND state <> 'deleted'"
    ))
    .bind(node_id)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().map(report_view).collect())
}

/// [`report_rows`] of only the instances among `ids`.
pub async fn report_rows_of(
    tx: &mut PgConnection,
    node_id: &str,
    ids: &[String],
) -> Result<Vec<(String, ReportView)>, sqlx::Error> {
    let rows = sqlx::query_as(concat!(
        report_view_columns!(),
        " FROM instances
           WHERE id = ANY($2) AND node_id = $1 AND state <> 'deleted'"
    ))
    .bind(node_id)
    .bind(ids)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().map(report_view).collect())
}

fn report_view(
    (id, state, has_conditions, Json(addresses), shares_principal, drives_sandbox): (
        String,
        String,
        bool,
        Json<Vec<String>>,
        bool,
        bool,
    ),
) -> (String, ReportView) {
    let view = ReportView {
        state: state_column(state),
        has_conditions,
        addresses,
        shares_principal,
        drives_sandbox,
    };
    (id, view)
}

/// Where a reader of report views stands, to ask later which instances changed since: the
/// statement's snapshot, and the reading transaction's own id when it has one (its own writes
/// count as seen by its snapshot, though a later reader must read them again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkPoint {
    snapshot: String,
    own: Option<String>,
}

/// The point a transaction stands at now.
pub async fn mark_point(tx: &mut PgConnection) -> Result<MarkPoint, sqlx::Error> {
    let (snapshot, own) = sqlx::query_as(
        "SELECT pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text",
    )
    .fetch_one(&mut *tx)
    .await?;
    Ok(MarkPoint { snapshot, own })
}

/// The instances placed on (or taken off) a node by writes `since` did not see, with the
/// point now: `instance_marks`, which a trigger on `instances` keeps, one row a placement,
/// read through the index of the node's recent transactions (only those not older than the
/// oldest one running at `since`).
pub async fn marked_since(
    tx: &mut PgConnection,
    node_id: &str,
    since: &MarkPoint,
) -> Result<(MarkPoint, Vec<String>), sqlx::Error> {
    let (snapshot, own, marked) = sqlx::query_as(
        "SELECT pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text,
                ARRAY(SELECT instance_id FROM instance_marks
                       WHERE node_id = $1
                         AND transaction_id >= pg_snapshot_xmin($2::pg_snapshot)
                         AND (NOT pg_visible_in_snapshot(transaction_id, $2::pg_snapshot)
                              OR transaction_id = $3::xid8))",
    )
    .bind(node_id)
    .bind(&since.snapshot)
    .bind(&since.own)
    .fetch_one(&mut *tx)
    .await?;
    Ok((MarkPoint { snapshot, own }, marked))
}

/// Deletes the marks of instances no longer live on the marked node (deleted, gone, or moved
/// off it) that last moved before `before`; answers how many. A mark is needed only by copies
/// of the node's views read before it moved, and a copy is read whole again once it is older
/// than [`MARKS_KEPT`] (commands' `report_views`), so `before` is at least that long ago.
pub async fn prune_marks(
    conn: &mut PgConnection,
    before: chrono::DateTime<chrono::Utc>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM instance_marks m
          WHERE m.marked_at < $1
            AND NOT EXISTS (SELECT 1 FROM instances i
                             WHERE i.id = m.instance_id AND i.node_id = m.node_id
                               AND i.state <> 'deleted')",
    )
    .bind(before)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// How long the mark of an instance no longer on its node is kept: well beyond the age at
/// which a copy of the node's views is read whole again.
pub const MARKS_KEPT: std::time::Duration = std::time::Duration::from_secs(3600);

/// The age at which a copy of a node's views is read whole again instead of brought up to date
/// from the marks (so marks older than [`MARKS_KEPT`] are needed by no copy).
pub const COPY_READ_WHOLE_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// The live instances placed on a node, their rows locked in id order (the lock order).
pub async fn lock_all_placed(
    tx: &mut PgConnection,
    node_id: &str,
) -> Result<Vec<Instance>, sqlx::Error> {
    let sql = "SELECT doc FROM instances WHERE node_id = $1 AND state <> 'deleted'
                ORDER BY id FOR UPDATE";
    let rows: Vec<Json<InstanceDoc>> = sqlx::query_scalar(sql)
        .bind(node_id)
        .fetch_all(&mut *tx)
        .await?;
    Ok(rows.into_iter().map(instance_doc::instance).collect())
}

/// Locks the rows of `ids` still live on `node_id`, in id order, and answers them as locked.
pub async fn lock_placed(
    tx: &mut PgConnection,
    node_id: &str,
    ids: &[String],
) -> Result<Vec<Instance>, sqlx::Error> {
    let rows: Vec<Json<InstanceDoc>> = sqlx::query_scalar(
        "SELECT doc FROM instances WHERE id = ANY($1) AND node_id = $2 AND state <> 'deleted'
          ORDER BY id FOR UPDATE",
    )
    .bind(ids)
    .bind(node_id)
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows.into_iter().map(instance_doc::instance).collect())
}

/// Whether instance `instance_id` is live on `node_id`.
pub async fn placed_on(
    conn: &mut PgConnection,
    instance_id: &str,
    node_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM instances WHERE id = $1 AND node_id = $2 AND state <> 'deleted')")
        .bind(instance_id)
        .bind(node_id)
        .fetch_one(&mut *conn)
        .await
}

/// Whether a live instance of `tenant_id` other than `instance_id` answers to SSH principal
/// `principal`: the principal itself, or a restore that names it as its principal.
pub async fn shares_principal(
    tx: &mut PgConnection,
    instance_id: &str,
    principal: &str,
    tenant_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM instances
                         WHERE id <> $1 AND tenant_id = $3 AND state NOT IN ('deleting', 'deleted')
                           AND desired_state <> 'deleted'
                           AND (id = $2 OR doc->'restoreFrom'->>'principalInstanceId' = $2))",
    )
    .bind(instance_id)
    .bind(principal)
    .bind(tenant_id)
    .fetch_one(&mut *tx)
    .await
}

/// How many addresses of a pool are leased.
pub async fn leased(tx: &mut PgConnection, pool_id: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM ip_leases WHERE pool_id = $1")
        .bind(pool_id)
        .fetch_one(&mut *tx)
        .await
}

/// Locks an instance's row to the transaction's end, reading nothing.
pub async fn lock_row(tx: &mut PgConnection, instance_id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT 1 FROM instances WHERE id = $1 FOR UPDATE")
        .bind(instance_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Whether `tenant_id` has a running instance other than `instance_id` on `node_id`.
pub async fn tenant_runs_on(
    tx: &mut PgConnection,
    node_id: &str,
    tenant_id: &str,
    instance_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM instances WHERE node_id = $1 AND tenant_id = $2 AND id <> $3 AND state = 'running')",
    )
    .bind(node_id)
    .bind(tenant_id)
    .bind(instance_id)
    .fetch_one(&mut *tx)
    .await
}

/// The instances of a pool waiting for placement (`scheduling`).
pub async fn scheduling(tx: &mut PgConnection, pool_id: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM instances WHERE pool_id = $1 AND state = 'scheduling'")
        .bind(pool_id)
        .fetch_all(&mut *tx)
        .await
}

/// Instances `deleting` with no change for over `stuck` seconds: how many, the ids of the
/// five oldest, and the oldest's age in seconds (`None` when there is none).
pub async fn stuck_deleting<'e>(
    db: impl PgExecutor<'e>,
    stuck: f64,
) -> Result<(i64, Vec<String>, Option<f64>), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*),
                coalesce((array_agg(id ORDER BY updated_at))[1:5], '{}'::text[]),
                max(extract(epoch FROM now() - updated_at))::float8
           FROM instances
          WHERE state = 'deleting' AND updated_at < now() - make_interval(secs => $1)",
    )
    .bind(stuck)
    .fetch_one(db)
    .await
}

/// The instances not `deleted`, with the template of each warm one.
pub async fn live_with_template<'e>(
    db: impl PgExecutor<'e>,
) -> Result<Vec<(String, Option<String>)>, sqlx::Error> {
    sqlx::query_as("SELECT id, warm_template_id FROM instances WHERE state <> 'deleted'")
        .fetch_all(db)
        .await
}

/// An instance's `state` column; `None` when there is no such instance.
pub async fn state<'e>(
    db: impl PgExecutor<'e>,
    instance_id: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT state FROM instances WHERE id = $1")
        .bind(instance_id)
        .fetch_optional(db)
        .await
}

/// How many warm instances of `template_id` are `paused`.
pub async fn warm_paused<'e>(
    db: impl PgExecutor<'e>,
    template_id: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM instances WHERE warm_template_id = $1 AND state = 'paused'",
    )
    .bind(template_id)
    .fetch_one(db)
    .await
}

/// How many warm instances of `template_id` are `paused`, and how many instances (of any
/// template or none) are neither `paused` nor `deleted`.
pub async fn warm_paused_and_busy<'e>(
    db: impl PgExecutor<'e>,
    template_id: &str,
) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE warm_template_id = $1 AND state = 'paused'),
                count(*) FILTER (WHERE state NOT IN ('paused', 'deleted'))
           FROM instances",
    )
    .bind(template_id)
    .fetch_one(db)
    .await
}

/// How many instances there are (deleted ones too).
pub async fn count<'e>(db: impl PgExecutor<'e>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM instances")
        .fetch_one(db)
        .await
}

/// How many instances are in each state, as `(state, count)`.
pub async fn state_counts<'e>(db: impl PgExecutor<'e>) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT state, count(*) FROM instances GROUP BY state")
        .fetch_all(db)
        .await
}

/// The versions of the instances among `ids` that exist, as `(id, version)`.
pub async fn versions<'e>(
    db: impl PgExecutor<'e>,
    ids: &[String],
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT id, version FROM instances WHERE id = ANY($1)")
        .bind(ids)
        .fetch_all(db)
        .await
}
