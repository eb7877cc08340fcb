//! The work queue in PostgreSQL: one row per (kind, key), taken with `FOR UPDATE SKIP LOCKED`
//! under a lease, so several replicas share the work and no item runs twice at once.
//!
//! A pass returns its next look. A wake-up that arrives while the item is being worked on is
//! not lost: it bumps `wakes`, and completing an item whose `wakes` moved makes it due again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool, Row};

/// When to look at an item again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// After this long (or sooner, if woken).
    After(Duration),
    /// Only when woken.
    WhenWoken,
}

/// An item taken for work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    /// The key (e.g. an instance id).
    pub key: String,
    /// The wake counter when taken.
    pub wakes: i64,
    /// Failed passes in a row.
    pub attempts: i32,
}

/// The longest an item waits after repeated failures.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);

/// Makes `kind/key` due at `due_at` (or keeps an earlier due time) and counts a wake-up.
pub async fn wake<'e>(
    db: impl PgExecutor<'e>,
    kind: &str,
    key: &str,
    due_at: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO work_items (kind, key, due_at) VALUES ($1, $2, $3)
         ON CONFLICT (kind, key) DO UPDATE
            SET due_at = least(work_items.due_at, excluded.due_at), wakes = work_items.wakes + 1",
    )
    .bind(kind)
    .bind(key)
    .bind(due_at)
    .execute(db)
    .await?;
    Ok(())
}

/// Wakes many keys of one kind, due now.
pub async fn wake_all<'e>(
    db: impl PgExecutor<'e>,
    kind: &str,
    keys: &[String],
) -> Result<(), sqlx::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO work_items (kind, key, due_at) SELECT $1, k, now() FROM unnest($2::text[]) AS k
         ON CONFLICT (kind, key) DO UPDATE SET due_at = least(work_items.due_at, now()), wakes = work_items.wakes + 1",
    )
    .bind(kind)
    .bind(keys)
    .execute(db)
    .await?;
    Ok(())
}

/// Takes up to `limit` due items of `kind` under a lease of `lease`.
pub async fn take(
    pool: &PgPool,
    kind: &str,
    limit: i64,
    lease: Duration,
) -> Result<Vec<Taken>, sqlx::Error> {
    let rows = sqlx::query(
        "UPDATE work_items w SET lease_until = now() + make_interval(secs => $3)
          WHERE (w.kind, w.key) IN (
                SELECT kind, key FROM work_items
                 WHERE kind = $1 AND due_at <= now() AND (lease_until IS NULL OR lease_until < now())
                 ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED)
         RETURNING w.key, w.wakes, w.attempts",
    )
    .bind(kind)
    .bind(limit)
    .bind(lease.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|r| Taken {
            key: r.get(0),
            wakes: r.get(1),
            attempts: r.get(2),
        })
        .collect())
}

/// Finishes a pass: schedules the next look (or due now, if woken meanwhile).
pub async fn complete(
    pool: &PgPool,
    kind: &str,
    item: &Taken,
    next: Next,
) -> Result<(), sqlx::Error> {
    match next {
        Next::WhenWoken => {
            // Forget the item unless it was woken during the pass.
            let deleted =
                sqlx::query("DELETE FROM work_items WHERE kind = $1 AND key = $2 AND wakes = $3")
                    .bind(kind)
                    .bind(&item.key)
                    .bind(item.wakes)
                    .execute(pool)
                    .await?;
            if deleted.rows_affected() == 0 {
                reschedule(pool, kind, item, Duration::ZERO, 0, None).await?;
            }
        }
        Next::After(d) => reschedule(pool, kind, item, d, 0, None).await?,
    }
    Ok(())
}

/// Records a failed pass and backs off exponentially (capped at [`MAX_BACKOFF`]).
pub async fn fail(pool: &PgPool, kind: &str, item: &Taken, error: &str) -> Result<(), sqlx::Error> {
    let attempts = item.attempts.saturating_add(1);
    let backoff =
        Duration::from_millis(200u64.saturating_mul(1 << attempts.min(16))).min(MAX_BACKOFF);
    reschedule(pool, kind, item, backoff, attempts, Some(error)).await
}

async fn reschedule(
    pool: &PgPool,
    kind: &str,
    item: &Taken,
    after: Duration,
    attempts: i32,
    error: Option<&str>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE work_items SET lease_until = NULL, attempts = $5, last_error = $6,
                due_at = CASE WHEN wakes = $3 THEN now() + make_interval(secs => $4) ELSE now() END
          WHERE kind = $1 AND key = $2",
    )
    .bind(kind)
    .bind(&item.key)
    .bind(item.wakes)
    .bind(after.as_secs_f64())
    .bind(attempts)
    .bind(error)
    .execute(pool)
    .await?;
    Ok(())
}
