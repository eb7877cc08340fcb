//! The work queue in PostgreSQL: one row per (kind, key), taken with `FOR UPDATE SKIP LOCKED`
//! under a lease, so several replicas share the work and no item runs twice at once.
//!
//! Leases are fenced: every take draws a fresh `lease_id`, and [`complete`] and [`fail`] change
//! the row only while it still carries the taker's. A holder that stalled past its lease (and
//! whose item another holder took meanwhile) changes nothing and is told so. [`holding`] keeps
//! the leases of a batch alive while it is worked on, however long its provider calls take.
//!
//! Two clocks meet here. When an item is due (`due_at`) is the server's clock (`Ctx::clock`):
//! callers pass its `now`, so a test that moves the clock brings items due. When a lease runs
//! out (`lease_until`) is the database's `now()`, the one clock every replica shares: a lease
//! read on one replica's clock and broken on another's could let two holders work one item.
//!
//! A pass returns its next look. A wake-up that arrives while the item is being worked on is
//! not lost: it bumps `wakes`, and completing an item whose `wakes` moved makes it due again.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::{PgExecutor, PgPool};
use tokio::sync::watch;
use vps_commands::wakeups::Wakeups;
use vps_commands::Ctx;

/// The PostgreSQL channel on which replicas tell each other that items fell due.
pub const CHANNEL: &str = "vps_work";

/// The longest a work loop sleeps without looking, in case a wake-up was lost.
pub const MAX_IDLE: Duration = Duration::from_secs(1);

/// Call once a transaction that made items of `kind` due ([`wake`], [`wake_all`]) has
/// committed: wakes this server's loop of that kind at once (through the context's
/// [`Wakeups`], by kind; loops wake on these and on their items' due times, not on every
/// commit of the log: a take per commit per loop was most of an idle server's statements),
/// and other replicas' through `pg_notify` (coalesced by the notifier). A lost notification
/// delays their look by at most [`MAX_IDLE`].
pub fn announce(ctx: &Ctx, kind: &'static str) {
    ctx.wakeups.wake(kind);
    ctx.notifier.hint(CHANNEL, kind);
}

/// Hears other replicas' [`announce`]s (kinds, comma-separated) for as long as the task
/// lives, and wakes this server's loops of those kinds.
pub async fn listen(pool: PgPool, wakeups: Wakeups) {
    vps_events::notify::listen_to(pool, CHANNEL, |kinds| {
        kinds.split(',').for_each(|kind| wakeups.wake(kind))
    })
    .await
}

/// The wake-ups of `kind`'s loop; mark them seen (`borrow_and_update`) before each take.
pub fn subscribe(ctx: &Ctx, kind: &str) -> watch::Receiver<u64> {
    ctx.wakeups.subscribe(kind)
}

/// The earliest-due items [`idle`] looks at. An item further down is due no sooner than all
/// of these, so the answer is exact unless every one of them is leased (items in flight are a
/// batch per replica); even then the nap is capped at [`MAX_IDLE`] and new work wakes it.
const NEXT_DUE_WINDOW: i64 = 64;

/// Waits until a wake-up comes, the clock is moved, or `kind`'s next item falls due (or its
/// lease runs out), at most [`MAX_IDLE`]. Reads the earliest-due items by the `(kind, due_at)`
/// index: the minimum over every item of the kind read them all, one per instance, after
/// every idle pass.
pub async fn idle(ctx: &Ctx, kind: &str, wake: &mut watch::Receiver<u64>) {
    let next: Result<Option<f64>, _> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(greatest(due_at - $3::timestamptz,
                                                coalesce(lease_until - now(), due_at - $3::timestamptz))))::float8
           FROM (SELECT due_at, lease_until
                   FROM work_items WHERE kind = $1 ORDER BY due_at LIMIT $2) earliest",
    )
    .bind(kind)
    .bind(NEXT_DUE_WINDOW)
    .bind(ctx.clock.now())
    .fetch_one(&ctx.pool)
    .await;
    let nap = match next {
        Ok(Some(seconds)) => Duration::from_secs_f64(seconds.clamp(0.0, MAX_IDLE.as_secs_f64())),
        Ok(None) => MAX_IDLE,
        Err(e) => {
            tracing::debug!(kind, error = %e, "cannot read the next due time");
            MAX_IDLE
        }
    };
    tokio::select! {
        _ = tokio::time::timeout(nap, wake.changed()) => {}
        () = ctx.clock.moved() => {}
    }
}

/// When to look at an item again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// After this long (or sooner, if woken).
    After(Duration),
    /// Only when woken.
    WhenWoken,
}

impl Next {
    /// How long a look that keeps its item waits: an item woken during its pass, which cannot
    /// be forgotten, is due at once.
    fn delay(self) -> Duration {
        match self {
            Next::After(d) => d,
            Next::WhenWoken => Duration::ZERO,
        }
    }
}

/// An item taken for work.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Taken {
    /// The key (e.g. an instance id).
    pub key: String,
    /// The wake counter when taken.
    pub wakes: i64,
    /// Failed passes in a row.
    pub attempts: i32,
    /// The lease token: completing the item needs the row to still carry it.
    pub lease_id: i64,
    /// The earliest time the item's reconciler may call out again (after a failed call).
    pub retry_at: Option<DateTime<Utc>>,
}

/// How a pass ended: when to look again, and the retry time to keep on the item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// When to look again.
    pub next: Next,
    /// The earliest time to call out again (`None`: no failed call to wait for).
    pub retry_at: Option<DateTime<Utc>>,
}

impl From<Next> for Pass {
    /// A pass that leaves no retry time.
    fn from(next: Next) -> Self {
        Pass {
            next,
            retry_at: None,
        }
    }
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

/// Wakes many keys of one kind, due `now`.
pub async fn wake_all<'e>(
    db: impl PgExecutor<'e>,
    kind: &str,
    keys: &[String],
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO work_items (kind, key, due_at) SELECT $1, k, $3 FROM unnest($2::text[]) AS k
         ON CONFLICT (kind, key) DO UPDATE SET due_at = least(work_items.due_at, $3), wakes = work_items.wakes + 1",
    )
    .bind(kind)
    .bind(keys)
    .bind(now)
    .execute(db)
    .await?;
    Ok(())
}

/// Takes up to `limit` items of `kind` due at `now` under a lease of `lease`, each with a
/// fresh lease id.
pub async fn take(
    pool: &PgPool,
    kind: &str,
    limit: i64,
    lease: Duration,
    now: DateTime<Utc>,
) -> Result<Vec<Taken>, sqlx::Error> {
    sqlx::query_as(
        "UPDATE work_items w
            SET lease_until = now() + make_interval(secs => $3), lease_id = nextval('work_item_leases')
          WHERE (w.kind, w.key) IN (
                SELECT kind, key FROM work_items
                 WHERE kind = $1 AND due_at <= $4 AND (lease_until IS NULL OR lease_until < now())
                 ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED)
         RETURNING w.key, w.wakes, w.attempts, w.lease_id, w.retry_at",
    )
    .bind(kind)
    .bind(limit)
    .bind(lease.as_secs_f64())
    .bind(now)
    .fetch_all(pool)
    .await
}

/// Runs `work` while renewing the leases of `items` (still held) every third of `lease`, so a
/// batch whose passes wait on slow calls keeps its items for as long as it works on them.
pub async fn holding<F: Future>(
    pool: &PgPool,
    kind: &str,
    items: &[Taken],
    lease: Duration,
    work: F,
) -> F::Output {
    let renew = async {
        loop {
            tokio::time::sleep(lease / 3).await;
            if let Err(e) = extend(pool, kind, items, lease).await {
                tracing::warn!(kind, error = %e, "cannot renew work-item leases");
            }
        }
    };
    tokio::pin!(work);
    tokio::select! {
        out = &mut work => out,
        () = renew => work.await,
    }
}

/// Renews the leases of those `items` whose rows still carry their lease ids; returns how many.
pub async fn extend(
    pool: &PgPool,
    kind: &str,
    items: &[Taken],
    lease: Duration,
) -> Result<u64, sqlx::Error> {
    let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
    let leases: Vec<i64> = items.iter().map(|i| i.lease_id).collect();
    let renewed = sqlx::query(
        "UPDATE work_items w SET lease_until = now() + make_interval(secs => $4)
           FROM unnest($2::text[], $3::bigint[]) AS h(key, lease_id)
          WHERE w.kind = $1 AND w.key = h.key AND w.lease_id = h.lease_id",
    )
    .bind(kind)
    .bind(&keys)
    .bind(&leases)
    .bind(lease.as_secs_f64())
    .execute(pool)
    .await?;
    Ok(renewed.rows_affected())
}

/// Finishes a pass at `now`: records its retry time and schedules the next look (or due now,
/// if woken meanwhile). `false` when the lease was lost: another holder has the item, nothing
/// changed.
pub async fn complete(
    pool: &PgPool,
    kind: &str,
    item: &Taken,
    pass: Pass,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    Ok(complete_all(pool, kind, &[(item, pass)], now)
        .await?
        .is_empty())
}

/// [`complete`] for a batch's passes, in one statement (one commit, not one per item): answers
/// the keys whose lease was lost.
///
/// An item woken while the statement waited for its row is left to [`reschedule`], which reads
/// it anew: the statement decides between forgetting and rescheduling on the row it first saw.
///
/// Planned for each call's own keys (an unnamed statement, never a kept plan): a generic plan
/// made while the table's statistics are those of a small table serves `kind = $1` from an
/// index and filters every item of the kind (8,400 rows, 1–2.5 ms per batch at 16 clients in
/// `bench api`), even with the keys also matched by `= ANY`, which a plan for the actual keys
/// reads from the primary key.
pub async fn complete_all(
    pool: &PgPool,
    kind: &str,
    passes: &[(&Taken, Pass)],
    now: DateTime<Utc>,
) -> Result<Vec<String>, sqlx::Error> {
    if passes.is_empty() {
        return Ok(Vec::new());
    }
    let items = || passes.iter().map(|(item, _)| item);
    let ends = || passes.iter().map(|(_, pass)| pass);
    let done: Vec<String> = sqlx::query_scalar(
        "WITH p AS (SELECT * FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::float8[],
                                          $6::bool[], $7::timestamptz[])
                              AS p(key, wakes, lease_id, after, forget, retry_at)),
              gone AS (DELETE FROM work_items w USING p
                        WHERE w.kind = $1 AND w.key = ANY($2) AND w.key = p.key
                          AND w.lease_id = p.lease_id
                          AND p.forget AND w.wakes = p.wakes
                       RETURNING w.key),
              kept AS (UPDATE work_items w
                          SET lease_until = NULL, lease_id = NULL, attempts = 0, last_error = NULL,
                              retry_at = p.retry_at,
                              due_at = CASE WHEN w.wakes = p.wakes
                                            THEN $8 + make_interval(secs => p.after)
                                            ELSE $8 END
                         FROM p
                        WHERE w.kind = $1 AND w.key = ANY($2) AND w.key = p.key
                          AND w.lease_id = p.lease_id
                          AND NOT (p.forget AND w.wakes = p.wakes)
                       RETURNING w.key)
         SELECT key FROM gone UNION ALL SELECT key FROM kept",
    )
    .bind(kind)
    .bind(items().map(|i| i.key.as_str()).collect::<Vec<_>>())
    .bind(items().map(|i| i.wakes).collect::<Vec<_>>())
    .bind(items().map(|i| i.lease_id).collect::<Vec<_>>())
    .bind(
        ends()
            .map(|p| p.next.delay().as_secs_f64())
            .collect::<Vec<_>>(),
    )
    .bind(
        ends()
            .map(|p| p.next == Next::WhenWoken)
            .collect::<Vec<_>>(),
    )
    .bind(ends().map(|p| p.retry_at).collect::<Vec<_>>())
    .bind(now)
    .persistent(false)
    .fetch_all(pool)
    .await?;
    let mut lost = Vec::new();
    for (item, pass) in passes.iter().filter(|(i, _)| !done.contains(&i.key)) {
        let after = pass.next.delay();
        let at = later(now, after);
        if !reschedule(pool, kind, item, at, now, Outcome::Done(pass.retry_at)).await? {
            lost.push(item.key.clone());
        }
    }
    Ok(lost)
}

/// Records a pass that failed at `now` and backs off exponentially (capped at
/// [`MAX_BACKOFF`]); the item's retry time stays. `false` when the lease was lost: another
/// holder has the item.
pub async fn fail(
    pool: &PgPool,
    kind: &str,
    item: &Taken,
    error: &str,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    let attempts = item.attempts.saturating_add(1);
    let backoff =
        Duration::from_millis(200u64.saturating_mul(1 << attempts.min(16))).min(MAX_BACKOFF);
    reschedule(
        pool,
        kind,
        item,
        later(now, backoff),
        now,
        Outcome::Failed { attempts, error },
    )
    .await
}

/// What a rescheduled pass leaves on its item.
enum Outcome<'a> {
    /// It completed: attempts start over, and this is the retry time.
    Done(Option<DateTime<Utc>>),
    /// It failed, `attempts` times in a row now; the retry time stays.
    Failed { attempts: i32, error: &'a str },
}

/// Releases the item due `at` (`now`, if woken during the pass), if it is still ours.
async fn reschedule(
    pool: &PgPool,
    kind: &str,
    item: &Taken,
    at: DateTime<Utc>,
    now: DateTime<Utc>,
    outcome: Outcome<'_>,
) -> Result<bool, sqlx::Error> {
    let (attempts, error, retry_at) = match outcome {
        Outcome::Done(retry_at) => (0, None, retry_at),
        Outcome::Failed { attempts, error } => (attempts, Some(error), item.retry_at),
    };
    let updated = sqlx::query(
        "UPDATE work_items SET lease_until = NULL, lease_id = NULL, attempts = $5, last_error = $6,
                retry_at = $8,
                due_at = CASE WHEN wakes = $3 THEN $4 ELSE $9 END
          WHERE kind = $1 AND key = $2 AND lease_id = $7",
    )
    .bind(kind)
    .bind(&item.key)
    .bind(item.wakes)
    .bind(at)
    .bind(attempts)
    .bind(error)
    .bind(item.lease_id)
    .bind(retry_at)
    .bind(now)
    .execute(pool)
    .await?;
    Ok(updated.rows_affected() == 1)
}

/// `after` past `now`, or the end of time.
fn later(now: DateTime<Utc>, after: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(after)
        .ok()
        .and_then(|d| now.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}
