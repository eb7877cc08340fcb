//! Reading one stream, and the whole log in the agreed order below the horizon.

use futures::{StreamExt, TryStreamExt};
use sqlx::postgres::PgRow;
use sqlx::{PgExecutor, Row};

use crate::model::{Cursor, RecordedEvent};

/// The event columns of table or alias `t`, in the order `decode_at` expects.
///
/// The text form of the transaction id gets its own name: an output column called
/// `transaction_id` would capture `ORDER BY transaction_id` and sort the ids as text
/// ("100003" < "99999"), silently breaking the read order once ids gain a digit.
pub(crate) fn columns(t: &str) -> String {
    format!(
        "{t}.position, {t}.transaction_id::text AS transaction_id_text, {t}.stream, {t}.version, \
         {t}.id, {t}.type, {t}.data, {t}.metadata, {t}.recorded_at"
    )
}

/// Turns a row whose first columns are `columns(..)` into a record.
pub(crate) fn decode(row: &PgRow) -> Result<RecordedEvent, sqlx::Error> {
    decode_at(row, 0)
}

/// Like `decode`, for rows where the event columns start at `offset`.
pub(crate) fn decode_at(row: &PgRow, offset: usize) -> Result<RecordedEvent, sqlx::Error> {
    let txid: String = row.try_get(offset + 1)?;
    let metadata: sqlx::types::Json<crate::model::Metadata> = row.try_get(offset + 7)?;
    Ok(RecordedEvent {
        position: row.try_get(offset)?,
        transaction_id: txid.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        stream: row.try_get(offset + 2)?,
        version: row.try_get(offset + 3)?,
        id: row.try_get(offset + 4)?,
        event_type: row.try_get(offset + 5)?,
        data: row.try_get(offset + 6)?,
        metadata: metadata.0,
        recorded_at: row.try_get(offset + 8)?,
    })
}

/// Every event of a stream, oldest first.
pub async fn read_stream<'e>(
    db: impl PgExecutor<'e>,
    stream: &str,
) -> Result<Vec<RecordedEvent>, sqlx::Error> {
    events_where(db, "stream = $1", stream).await
}

/// The events `condition` selects, `$1` bound to `value`, in version order. The condition is
/// fixed SQL (`'static`): values go in bound, never formatted in.
pub(crate) async fn events_where<'e, T>(
    db: impl PgExecutor<'e>,
    condition: &'static str,
    value: T,
) -> Result<Vec<RecordedEvent>, sqlx::Error>
where
    T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send,
{
    let sql = format!(
        "SELECT {} FROM events WHERE {condition} ORDER BY version",
        columns("events")
    );
    let rows = sqlx::query(&sql).bind(value).fetch_all(db).await?;
    rows.iter().map(decode).collect()
}

/// Up to `limit` events after `after` in the read order, only from transactions older than
/// every transaction still running: a transaction that commits later can then never land
/// before an event already handed out.
pub async fn read_after<'e>(
    db: impl PgExecutor<'e>,
    after: Cursor,
    limit: i64,
) -> Result<Vec<RecordedEvent>, sqlx::Error> {
    read_filtered(db, after, &Filter::default(), limit).await
}

/// The highest position handed out so far (an upper bound for lag metrics).
pub async fn head_position<'e>(db: impl PgExecutor<'e>) -> Result<i64, sqlx::Error> {
    // The sequence, not max(position): no index serves that, and lag is an estimate anyway.
    sqlx::query_scalar(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM events_position_seq",
    )
    .fetch_one(db)
    .await
}

/// Narrows a read of the whole log.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Type patterns (`instance.*`); empty = every type.
    pub types: Vec<String>,
    /// Only this stream.
    pub stream: Option<String>,
    /// Only events whose metadata names this tenant.
    pub tenant_id: Option<String>,
    /// Read everything the caller's snapshot sees instead of stopping at the horizon: only
    /// for a reader inside one repeatable-read snapshot (a replay), which nothing can change.
    pub whole_snapshot: bool,
}

impl Filter {
    /// Whether `event` passes the filter, as the SQL of a read decides it (a whole snapshot
    /// aside, which is not about single events).
    pub fn admits(&self, event: &RecordedEvent) -> bool {
        (self.types.is_empty()
            || self
                .types
                .iter()
                .any(|p| crate::pattern::matches(p, &event.event_type)))
            && self.stream.as_ref().is_none_or(|s| *s == event.stream)
            && self
                .tenant_id
                .as_ref()
                .is_none_or(|t| event.metadata.tenant_id.as_ref() == Some(t))
    }
}

/// Like [`read_after`], keeping only events that pass `filter`.
pub async fn read_filtered<'e>(
    db: impl PgExecutor<'e>,
    after: Cursor,
    filter: &Filter,
    limit: i64,
) -> Result<Vec<RecordedEvent>, sqlx::Error> {
    let sql = format!(
        "SELECT {} FROM events
          WHERE {}
            AND ($7 OR transaction_id < (SELECT pg_snapshot_xmin(pg_current_snapshot())))
          ORDER BY transaction_id, position
          LIMIT $3",
        columns("events"),
        conditions(filter),
    );
    // Each row is decoded as it arrives, while the server still sends the rest.
    bind_filter(sqlx::query(&sql), after, filter, limit)
        .bind(filter.whole_snapshot)
        .fetch(db)
        .map(|row| decode(&row?))
        .try_collect()
        .await
}

/// A page of a filtered read, and where the next read starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// The events that passed the filter, in read order.
    pub events: Vec<RecordedEvent>,
    /// Where to read on from. When the page is not full this is past every event below the
    /// read horizon, matching or not: a reader waiting for a rare event does not scan the same
    /// non-matching events again on every wake-up.
    pub next: Cursor,
}

/// Like [`read_filtered`] (never a whole snapshot), answering also how far the read got.
pub async fn read_page<'e>(
    db: impl PgExecutor<'e>,
    after: Cursor,
    filter: &Filter,
    limit: i64,
) -> Result<Page, sqlx::Error> {
    let sql = format!(
        "WITH horizon AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
         SELECT h.xmin::text, e.* FROM horizon h LEFT JOIN LATERAL (
             SELECT {} FROM events
              WHERE {} AND transaction_id < h.xmin
              ORDER BY transaction_id, position
              LIMIT $3) e ON true",
        columns("events"),
        conditions(filter),
    );
    let query = bind_filter(sqlx::query(&sql), after, filter, limit);
    let mut rows = query.fetch(db);
    let mut events = Vec::new();
    let mut horizon = 0u64;
    // Each row is decoded as it arrives, while the server still sends the rest.
    while let Some(row) = rows.try_next().await? {
        let xmin: String = row.try_get(0)?;
        horizon = xmin.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        if row.try_get::<Option<i64>, _>(1)?.is_some() {
            events.push(decode_at(&row, 1)?);
        }
    }
    let next = match events.last() {
        Some(last) if events.len() as i64 >= limit => last.cursor(),
        _ => after.max(Cursor {
            transaction_id: horizon.saturating_sub(1),
            position: i64::MAX,
        }),
    };
    Ok(Page { events, next })
}

/// The conditions of a read after `($1, $2)` through `filter` (`$4` type patterns, `$5`
/// stream, `$6` tenant). Only the filters in use are written, so the planner sees a plain
/// equality it can serve from an index (`events_by_tenant`).
fn conditions(filter: &Filter) -> String {
    let mut conditions = vec!["(transaction_id, position) > ($1::text::xid8, $2)"];
    if !filter.types.is_empty() {
        conditions.push("type LIKE ANY($4)");
    }
    if filter.stream.is_some() {
        conditions.push("stream = $5");
    }
    if filter.tenant_id.is_some() {
        conditions.push("metadata->>'tenantId' = $6");
    }
    conditions.join(" AND ")
}

/// Binds `$1` to `$6` of [`conditions`].
fn bind_filter<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    after: Cursor,
    filter: &Filter,
    limit: i64,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let likes: Vec<String> = filter
        .types
        .iter()
        .map(|p| crate::pattern::to_like(p))
        .collect();
    query
        .bind(after.transaction_id.to_string())
        .bind(after.position)
        .bind(limit)
        .bind(likes)
        .bind(filter.stream.clone())
        .bind(filter.tenant_id.clone())
}

/// A time before which every event of the log is already readable: any event a follower has
/// not read yet, and any event appended later, has `recorded_at` at or after it.
///
/// `recorded_at` is its transaction's start, and a transaction can commit long after it
/// started, so "now" is not such a time. The bound is the earliest of: now; the start of every
/// transaction running in this database (it may still append); and the recorded time of every
/// committed event a follower cannot read yet (above the horizon, behind a running
/// transaction). Compute it *before* a read that reaches the horizon: that read then has
/// every event recorded before the bound.
pub async fn time_horizon<'e>(
    db: impl PgExecutor<'e>,
) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT least(
                    now(),
                    (SELECT min(xact_start) FROM pg_stat_activity
                      WHERE datname = current_database() AND backend_type = 'client backend'
                        AND xact_start IS NOT NULL),
                    (SELECT min(recorded_at) FROM events
                      WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot())))",
    )
    .fetch_one(db)
    .await
}
