//! The one path every instance change takes, whoever asks (the API, a host's report, liveness,
//! the reconcilers): facts are read, a pure `vps_domain` decision turns them into events, and
//! the events are appended with their inline projections here, in the caller's transaction.
//! The answer is the instance folded once from the recorded events. The caller's attempt runs
//! inside [`crate::error::retrying`], which decides again on fresh facts after a lost race.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Transaction};
use vps_domain::instance::{decide_all, evolve, Instance, InstanceCommand, InstanceEvent};
use vps_domain::DomainError;
use vps_events::ExpectedVersion;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::record::record;
use crate::secrets;

/// Records `events` on the instance's stream (expecting the version `before` was read at)
/// and answers the instance after them.
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
    let expected = before.map_or(ExpectedVersion::NoStream, |b| {
        ExpectedVersion::Exact(b.version as i64)
    });
    let pairs = events
        .iter()
        .map(|e| (e.event_type().to_string(), e.data()))
        .collect();
    let stream = format!("instance-{id}");
    let stored = record(tx, &stream, expected, pairs, &ctx.metadata(Some(&tenant))).await?;
    if events
        .iter()
        .any(|e| matches!(e, InstanceEvent::Deleted(_)))
    {
        secrets::forget(tx, &id).await?;
    }
    // The instance as the projector just stored it: one fold, with the recorded times.
    let mut state = before.cloned();
    for (event, recorded) in events.iter().zip(&stored) {
        let next = evolve(state, event, recorded.recorded_at)
            .map_err(|e| DomainError::invalid_state(e.to_string()))?;
        state = Some(next);
    }
    Ok(state.expect("at least one event"))
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
