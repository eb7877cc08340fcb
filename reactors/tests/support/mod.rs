//! Shared by the delivery tests: a fresh log, and waits on conditions (never fixed sleeps).

#![allow(dead_code)] // each test file uses part of it

use std::fmt::Debug;
use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use vps_events::read::read_after;
use vps_events::{Cursor, RecordedEvent};

/// How long a wait lasts before the test fails: generous, so a busy 2-core CI machine does
/// not flake. A passing test never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// How often a wait looks again.
pub const POLL: Duration = Duration::from_millis(20);

/// A fresh database with the schema.
pub async fn fresh_log() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 30).await
}

/// Calls `check` every [`POLL`] until it answers `Ok`, and returns that value; the test fails
/// after `within`, naming `what` and what was seen instead.
pub async fn eventually_ok<T, E, F, Fut>(what: &str, within: Duration, check: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    vps_pg::testing::eventually_every(what, within, POLL, check).await
}

/// Waits until `condition` holds, failing the test naming `what` after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_ok(what, within, || {
        let holds = condition();
        async move { holds.await.then_some(()).ok_or("not yet") }
    })
    .await
}

/// The log's events that `keep` keeps, in the agreed read order, once there are exactly `n`
/// of them readable (below the horizon, as every follower sees them).
pub async fn readable(
    pool: &PgPool,
    n: usize,
    keep: impl Fn(&RecordedEvent) -> bool,
) -> Vec<RecordedEvent> {
    let what = format!("{n} events readable");
    eventually_ok(&what, PATIENCE, || async {
        let events: Vec<RecordedEvent> = read_after(pool, Cursor::START, 1_000_000)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| keep(e))
            .collect();
        if events.len() == n {
            Ok(events)
        } else {
            Err(format!("{} of them", events.len()))
        }
    })
    .await
}

/// How many events of the log the durable follower `name` has not handled yet (all of them
/// when it has no checkpoint yet).
pub async fn events_after_follower(pool: &PgPool, name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM events e
          WHERE (e.transaction_id, e.position) > (
                coalesce((SELECT transaction_id FROM follower_checkpoints WHERE name = $1), '0'),
                coalesce((SELECT position FROM follower_checkpoints WHERE name = $1), 0))",
    )
    .bind(name)
    .fetch_one(pool)
    .await
    .unwrap()
}
