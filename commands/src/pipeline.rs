//! The one path every instance change takes, whoever asks (the API, a host's report, liveness,
//! the reconcilers): facts are read, a pure `vps_domain` decision turns them into events, and
//! the events are appended with their inline projections here, in the caller's transaction.
//! The answer is the instance folded once from the recorded events. The caller's attempt runs
//! inside [`crate::error::retrying`], which decides again on fresh facts after a lost race.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Postgres, Transaction};
use vps_domain::aggregate::{Aggregate, Event};
use vps_domain::instance::{decide_all, Instance, InstanceCommand, InstanceEvent};
use vps_domain::DomainError;
use vps_events::ExpectedVersion;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::record::record;
use crate::sandboxes::follow;
use crate::secrets;

/// Records `events` on the aggregate's stream (expecting the version `before` was read at)
/// and answers the aggregate after them, folded once with the recorded times.
pub async fn record_events<A: Aggregate>(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    before: Option<&A>,
    events: Vec<A::Event>,
    tenant: Option<&str>,
) -> Result<Option<A>, CommandError> {
    if events.is_empty() {
        return Ok(before.cloned());
    }
    let expected = before.map_or(ExpectedVersion::NoStream, |b| {
        ExpectedVersion::Exact(b.version() as i64)
    });
    let pairs = events
        .iter()
        .map(|e| (e.event_type().to_string(), e.data()))
        .collect();
    let stored = record(tx, &A::stream(id), expected, pairs, &ctx.metadata(tenant)).await?;
    let mut state = before.cloned();
    for (event, recorded) in events.iter().zip(&stored) {
        let next = A::evolve(state, event, recorded.recorded_at)
            .map_err(|e| DomainError::invalid_state(e.to_string()))?;
        state = Some(next);
    }
    Ok(state)
}

/// The aggregate `id` folded from its stream, or `None` when the stream is empty.
pub async fn load<A: Aggregate>(
    tx: &mut PgConnection,
    id: &str,
) -> Result<Option<A>, CommandError> {
    let stored = vps_events::read::read_stream(&mut *tx, &A::stream(id)).await?;
    let mut state = None;
    for e in &stored {
        let event = A::Event::from_parts(&e.event_type, e.data.clone())
            .map_err(|err| DomainError::invalid_state(err.to_string()))?;
        state = Some(
            A::evolve(state, &event, e.recorded_at)
                .map_err(|err| DomainError::invalid_state(err.to_string()))?,
        );
    }
    Ok(state)
}

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
    let after = record_events(ctx, tx, &id, before, events, Some(&tenant))
        .await?
        .expect("at least one event");
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

/// Loads aggregate `id`, lets `decide` judge it, and records what it decided, all in `tx`.
/// Answers the aggregate after the events (`None` when it does not exist and nothing was
/// decided).
pub async fn change<A: Aggregate>(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    tenant: Option<&str>,
    decide: impl FnOnce(Option<&A>) -> Result<Vec<A::Event>, DomainError>,
) -> Result<Option<A>, CommandError> {
    let before = load::<A>(tx, id).await?;
    let events = decide(before.as_ref())?;
    record_events(ctx, tx, id, before.as_ref(), events, tenant).await
}
