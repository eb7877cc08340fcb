//! Any aggregate's stream: folded from the log (`load`), and the events a decision made
//! appended with their inline projections (`record_events`), both in the caller's
//! transaction. [`crate::pipeline`] builds the instance path on these.

use sqlx::PgConnection;
use vps_domain::aggregate::{Aggregate, Event};
use vps_domain::DomainError;
use vps_events::ExpectedVersion;
use vps_projections::Prior;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::record::record;

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
    let prior = before.map_or(Prior::Unknown, |b| Prior::of(b));
    let metadata = ctx.metadata(tenant);
    let stored = record(tx, &A::stream(id), expected, pairs, &metadata, prior).await?;
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
