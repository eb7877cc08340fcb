//! The one path every instance change takes, whoever asks (the API, a host's report, liveness,
//! the reconcilers): facts are read, a pure `vps_domain` decision turns them into events, and
//! the events are appended with their inline projections here, in the caller's transaction.
//! The answer is the instance folded once from the recorded events. The caller's attempt runs
//! inside [`transaction`], the one way a command runs a transaction: it decides again on fresh
//! facts after a lost race.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Transaction};
use vps_domain::instance::{decide_all, Instance, InstanceCommand, InstanceEvent};
use vps_domain::DomainError;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::sandboxes::follow;
use crate::secrets;
pub use crate::stream::{
    change, change_existing, load, load_existing, record_events, record_existing,
};

/// Records an instance's events; a deleted instance's sealed secrets go with it, and the
/// sandbox driving it follows in the same transaction.
pub async fn record_instance(
    ctx: &Ctx,
    tx: &mut PgConnection,
    before: Option<&Instance>,
    events: Vec<InstanceEvent>,
) -> Result<Instance, CommandError> {
    let Some(first) = events.first() else {
        return before
            .cloned()
            .ok_or_else(|| DomainError::invalid_state("nothing to record").into());
    };
    let id = first.instance_id().to_string();
    let tenant = first.common().tenant_id.clone();
    let deleted = events
        .iter()
        .any(|e| matches!(e, InstanceEvent::Deleted(_)));
    let outcome = follow::outcome(&events);
    let after = record_existing(ctx, tx, &id, before, events, Some(&tenant)).await?;
    if deleted {
        secrets::forget(tx, &id).await?;
    }
    if let Some(outcome) = outcome.filter(|_| after.sandbox_id.is_some()) {
        follow::instance_changed(ctx, tx, &after, outcome).await?;
    }
    Ok(after)
}

/// Decides `commands` in turn on `instance` (those the state table refuses are skipped) and
/// records what they decided as one append. `None` when nothing changed.
pub async fn apply_commands(
    ctx: &Ctx,
    tx: &mut PgConnection,
    instance: &Instance,
    commands: &[InstanceCommand],
    now: DateTime<Utc>,
) -> Result<Option<Instance>, CommandError> {
    let events = decide_all(instance, commands, now)?;
    if events.is_empty() {
        return Ok(None);
    }
    record_instance(ctx, tx, Some(instance), events)
        .await
        .map(Some)
}

/// Commits and wakes this process's followers.
pub async fn commit(ctx: &Ctx, tx: Transaction<'_, Postgres>) -> Result<(), CommandError> {
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(())
}

/// Takes the transaction's advisory lock on `key` without waiting for it: while another
/// transaction holds it, a `CONFLICT` (`reason` `reason`) saying another `what` is in flight.
pub async fn hold_or_conflict(
    tx: &mut PgConnection,
    key: &str,
    what: &str,
    reason: &str,
) -> Result<(), CommandError> {
    let held: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
            .bind(key)
            .fetch_one(&mut *tx)
            .await?;
    if held {
        return Ok(());
    }
    let message = format!("another {what} is in flight; retry");
    Err(DomainError::conflict(message, "reason", reason).into())
}

/// A command's write: a fresh copy of `work` runs in a fresh transaction per attempt,
/// committed on success and rolled back at once on failure, and a lost race (a concurrent
/// append, a serialization failure, a deadlock, a racing unique insert:
/// [`CommandError::is_retryable`]) decides again on fresh facts, up to eight attempts with a
/// growing random pause, then `Contention` on `key`. `work` is cloned rather than borrowed per
/// attempt: a borrowed async closure's future is not provably `Send` (the API and
/// `tokio::spawn` need it).
pub async fn transaction<T>(
    ctx: &Ctx,
    key: &str,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, CommandError> + Clone,
) -> Result<T, CommandError> {
    for n in 0..8u32 {
        match attempt(ctx, work.clone()).await {
            Err(e) if e.is_retryable() => {
                let jitter = rand::random::<u64>() % (2 << n.min(6));
                tokio::time::sleep(std::time::Duration::from_millis(jitter)).await;
            }
            other => return other,
        }
    }
    Err(CommandError::Contention(key.to_string()))
}

/// One attempt of [`transaction`]: it commits when `work` succeeds and rolls back at once when
/// it fails, since a dropped transaction rolls back only when its connection is next used, and
/// would keep a hold (an advisory lock) taken inside it until then.
async fn attempt<T>(
    ctx: &Ctx,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, CommandError>,
) -> Result<T, CommandError> {
    let mut tx = ctx.pool.begin().await?;
    match work(&mut tx).await {
        Ok(done) => {
            commit(ctx, tx).await?;
            Ok(done)
        }
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}
