//! Any aggregate's stream: folded from the log (`load`), and the events a decision made
//! appended with their inline projections (`record_events`), both in the caller's
//! transaction. [`crate::pipeline`] builds the instance path on these.
//!
//! Each has an `_existing` twin for callers that need the aggregate itself: it answers the
//! aggregate or `NOT_FOUND`, never an `Option` to unwrap.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use vps_domain::aggregate::{Aggregate, Event};
use vps_domain::DomainError;
use vps_events::ExpectedVersion;
use vps_projections::Prior;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::record::record;

/// Records `events` on the aggregate's stream (expecting the version `before` was read at)
/// and answers the aggregate after them, folded once with the recorded times (`None` when
/// there was none and nothing was recorded).
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
    let prior = before.map_or(Prior::Unknown, |b| Prior::of(b));
    let metadata = ctx.metadata(tenant);
    let stored = record(tx, &A::stream(id), expected, pairs, &metadata, prior).await?;
    let times = stored.iter().map(|r| r.recorded_at);
    fold_onto(id, before.cloned(), events.iter().zip(times)).map(Some)
}

/// [`record_events`] for a caller that needs the aggregate: `NOT_FOUND` when there was none
/// and nothing was recorded.
pub async fn record_existing<A: Aggregate>(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    before: Option<&A>,
    events: Vec<A::Event>,
    tenant: Option<&str>,
) -> Result<A, CommandError> {
    record_events(ctx, tx, id, before, events, tenant)
        .await?
        .ok_or_else(|| missing::<A>(id))
}

/// `state` (`None`: a new stream) after `events`, each recorded at its time: the aggregate,
/// or `NOT_FOUND` when there was none and there are no events.
pub fn fold_onto<'e, A: Aggregate>(
    id: &str,
    mut state: Option<A>,
    events: impl IntoIterator<Item = (&'e A::Event, DateTime<Utc>)>,
) -> Result<A, CommandError> {
    for (event, at) in events {
        let next =
            A::evolve(state, event, at).map_err(|e| DomainError::invalid_state(e.to_string()))?;
        state = Some(next);
    }
    state.ok_or_else(|| missing::<A>(id))
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

/// [`load`], `NOT_FOUND` when the stream is empty.
pub async fn load_existing<A: Aggregate>(
    tx: &mut PgConnection,
    id: &str,
) -> Result<A, CommandError> {
    load::<A>(tx, id).await?.ok_or_else(|| missing::<A>(id))
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

/// [`change`] for a caller that needs the aggregate: `NOT_FOUND` when it does not exist and
/// nothing was decided.
pub async fn change_existing<A: Aggregate>(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    tenant: Option<&str>,
    decide: impl FnOnce(Option<&A>) -> Result<Vec<A::Event>, DomainError>,
) -> Result<A, CommandError> {
    change(ctx, tx, id, tenant, decide)
        .await?
        .ok_or_else(|| missing::<A>(id))
}

/// `NOT_FOUND` for aggregate `id` (`sandbox sbx_…`).
fn missing<A: Aggregate>(id: &str) -> CommandError {
    CommandError::not_found(format!("{} {id}", A::CATEGORY))
}
