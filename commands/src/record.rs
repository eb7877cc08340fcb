//! Appending a decision's events and applying the inline projections, in one transaction.

use serde_json::Value;
use sqlx::PgConnection;
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, RecordedEvent};
use vps_projections::Prior;

use crate::error::CommandError;

/// A fresh `evt_…` id.
pub fn event_id() -> String {
    vps_domain::ids::prefixed("evt", &ulid::Ulid::generate().to_string().to_lowercase())
}

/// A fresh id with `prefix` (`pool`, `node`, …).
pub fn new_id(prefix: &str) -> String {
    vps_domain::ids::prefixed(prefix, &ulid::Ulid::generate().to_string().to_lowercase())
}

/// The digest a create keeps of its request, so a replay with the same idempotency key is told
/// apart from a different request under that key (`CONFLICT`).
pub fn request_hash(request: &impl serde::Serialize) -> String {
    use sha2::Digest;
    let body = serde_json::to_vec(request).expect("a request serialises");
    data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(body))
}

/// Appends `(type, data)` events to `stream` and applies every inline projector to them;
/// `prior` is the stream's aggregate the events were decided on, when the caller has it.
pub async fn record(
    conn: &mut PgConnection,
    stream: &str,
    expected: ExpectedVersion,
    events: Vec<(String, Value)>,
    metadata: &Metadata,
    prior: Prior<'_>,
) -> Result<Vec<RecordedEvent>, CommandError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let new: Vec<NewEvent> = events
        .into_iter()
        .map(|(event_type, data)| NewEvent {
            id: event_id(),
            event_type,
            data,
            metadata: metadata.clone(),
        })
        .collect();
    let stored = append(&mut *conn, stream, expected, &new).await?;
    vps_projections::apply_all(&mut *conn, &stored, prior).await?;
    Ok(stored)
}
