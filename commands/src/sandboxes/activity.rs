//! Idle pause's activity data (issue 40): for each ready sandbox whose template sets
//! `idleTimeoutSeconds`, its guest's last CPU sample and its last sign of life, in
//! `sandbox_activity`.
//!
//! Not the log, and not a projection: hosts report their guests' CPU seconds every few
//! seconds, and an event per report (or per sample) would grow the log by the fleet's size
//! each minute for a number nobody decides anything from afterwards. Like `node_heartbeats`
//! for liveness, the table holds only the latest word, and what it leads to is recorded as
//! ordinary events: `sandbox.pausing`/`sandbox.paused` or `sandbox.expired` with `reason:
//! idle`. Replay neither rebuilds nor compares it.
//!
//! - [`arm`]: a sandbox that becomes ready (or ready again) gets a row, its clock starting
//!   then ([`follow_template`]: a template update reaches its ready sandboxes); the
//!   reconciler [`prune`]s the rows of sandboxes that are no longer ready.
//! - [`sample`]: a host report's CPU seconds, at most one sample per [`SAMPLE_EVERY`] per
//!   guest. A sample is busy when the guest used at least `idleCpuPercent` of one vCPU since
//!   the last one, or its counter went back (a new process), or it is the first (nothing is
//!   known of the time before it). The row is `idle` once the samples show no busy stretch for
//!   `idleTimeoutSeconds` since its last sign of life: only observed quiet counts, so a host
//!   that reports no CPU seconds (or goes silent) never idles a sandbox out.
//! - [`touch`]: an exec session or a preview request is a sign of life.
//! - [`take_idle`]: the reconciler's pause or expiry claims an idle row (and drops it).
//!
//! Lock order: a sandbox's row (its projection) before its activity row, on every path.
//! [`arm`], [`follow_template`] and [`prune`] read `sandbox_templates` and `sandboxes` in the
//! statement that writes the activity rows, like a report's node lock reads `nodes` (one round
//! trip; docs/decisions/0022).

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::{PgConnection, PgExecutor};
use vps_domain::sandbox::Sandbox;

/// The shortest time between two samples of one guest: a report a second would otherwise
/// rewrite every row each second.
pub const SAMPLE_EVERY: TimeDelta = TimeDelta::seconds(10);

/// Gives the ready sandbox `s` an activity row when its template sets `idleTimeoutSeconds`
/// (and, made again, a fresh one): its clock starts at `now`, its samples anew.
pub async fn arm(
    tx: &mut PgConnection,
    s: &Sandbox,
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sandbox_activity (instance_id, sandbox_id, idle_timeout, busy_rate,
                                       active_at, idle)
         SELECT $1, $2, (doc->>'idleTimeoutSeconds')::float8,
                coalesce((doc->>'idleCpuPercent')::float8, 2) / 100, $3, false
           FROM sandbox_templates
          WHERE id = $4 AND doc ? 'idleTimeoutSeconds'
         ON CONFLICT (instance_id) DO UPDATE
            SET sandbox_id = excluded.sandbox_id, idle_timeout = excluded.idle_timeout,
                busy_rate = excluded.busy_rate, active_at = excluded.active_at,
                cpu_seconds = NULL, sampled_at = NULL, idle = false",
    )
    .bind(&s.instance_id)
    .bind(&s.id)
    .bind(now)
    .bind(&s.template_id)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// After an update of the template `template_id` at `now`: its ready sandboxes' rows take
/// its idle settings (their clocks run on), and those without one get one when it now sets
/// `idleTimeoutSeconds`.
pub async fn follow_template(
    tx: &mut PgConnection,
    template_id: &str,
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO sandbox_activity (instance_id, sandbox_id, idle_timeout, busy_rate,
                                       active_at, idle)
         SELECT s.instance_id, s.id, (t.doc->>'idleTimeoutSeconds')::float8,
                coalesce((t.doc->>'idleCpuPercent')::float8, 2) / 100, $2, false
           FROM sandbox_templates t JOIN sandboxes s ON s.template_id = t.id
          WHERE t.id = $1 AND t.doc ? 'idleTimeoutSeconds' AND s.state = 'ready'
         ON CONFLICT (instance_id) DO UPDATE
            SET idle_timeout = excluded.idle_timeout, busy_rate = excluded.busy_rate,
                idle = false",
    )
    .bind(template_id)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Records a report's CPU seconds at `now`, as `(instance id, seconds)`, for the guests that
/// have an activity row whose last sample is at least [`SAMPLE_EVERY`] old.
pub async fn sample(
    tx: &mut PgConnection,
    samples: &[(String, f64)],
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    if samples.is_empty() {
        return Ok(());
    }
    let (ids, seconds): (Vec<&str>, Vec<f64>) =
        samples.iter().map(|(id, s)| (id.as_str(), *s)).unzip();
    sqlx::query(
        "UPDATE sandbox_activity a
            SET cpu_seconds = r.cpu, sampled_at = $3,
                active_at = CASE WHEN r.busy THEN $3 ELSE a.active_at END,
                idle = NOT r.busy AND $3 >= a.active_at + make_interval(secs => a.idle_timeout)
           FROM (SELECT s.instance_id, x.cpu,
                        s.cpu_seconds IS NULL OR x.cpu < s.cpu_seconds
                        OR x.cpu - s.cpu_seconds
                           >= s.busy_rate * extract(epoch FROM $3 - s.sampled_at) AS busy
                   FROM unnest($1::text[], $2::float8[]) AS x(id, cpu)
                   JOIN sandbox_activity s ON s.instance_id = x.id
                  WHERE s.sampled_at IS NULL OR s.sampled_at <= $4) r
          WHERE a.instance_id = r.instance_id",
    )
    .bind(&ids)
    .bind(&seconds)
    .bind(now)
    .bind(now - SAMPLE_EVERY)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// An exec session or a preview request reached the instance's guest at `now`: its idle clock
/// starts again.
pub async fn touch(
    db: impl PgExecutor<'_>,
    instance_id: &str,
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE sandbox_activity SET active_at = greatest(active_at, $2), idle = false
          WHERE instance_id = $1",
    )
    .bind(instance_id)
    .bind(now)
    .execute(db)
    .await?;
    Ok(())
}

/// Up to `limit` sandboxes whose activity row is idle.
pub async fn idle_sandboxes(
    db: impl PgExecutor<'_>,
    limit: i64,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT sandbox_id FROM sandbox_activity WHERE idle ORDER BY active_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Claims the instance's idle activity row (it is dropped): whether it was still idle.
pub async fn take_idle(tx: &mut PgConnection, instance_id: &str) -> Result<bool, sqlx::Error> {
    let taken: Option<i32> = sqlx::query_scalar(
        "DELETE FROM sandbox_activity WHERE instance_id = $1 AND idle RETURNING 1",
    )
    .bind(instance_id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(taken.is_some())
}

/// Drops the rows of sandboxes that are no longer ready (paused, failed, deleted, gone): a
/// sandbox that is ready again is armed afresh. Answers how many it dropped.
pub async fn prune(db: impl PgExecutor<'_>) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM sandbox_activity a
          WHERE NOT EXISTS (SELECT 1 FROM sandboxes s
                             WHERE s.id = a.sandbox_id AND s.state = 'ready')",
    )
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}
