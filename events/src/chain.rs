//! Tamper evidence: every event's `hash = sha256(previous hash ‖ canonical event)`, in read
//! order, written by one chainer that follows the log (hashing at insert time would serialise
//! every writer), and `verify`, which recomputes the chain.

use std::time::Duration;

use sha2::{Digest, Sha256};
use sqlx::{PgPool, Row};
use tokio_util::task::AbortOnDropHandle;

use crate::follower::{save_checkpoint, Follower};
use crate::lease::Lease;
use crate::model::{Cursor, RecordedEvent};
use crate::notify::Notifier;
use crate::read::{columns, decode_at};

/// The chainer's follower and lease name.
pub const CHAINER: &str = "chainer";

/// The hash before the first event.
pub const GENESIS: [u8; 32] = [0; 32];

/// The bytes that are hashed for an event: every stored field, in a fixed order, as JSON
/// (serde_json writes object keys sorted, so equal content gives equal bytes).
pub fn canonical(event: &RecordedEvent) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!([
        event.position,
        event.transaction_id,
        event.stream,
        event.version,
        event.id,
        event.event_type,
        event.recorded_at.timestamp_micros(),
        event.data,
        event.metadata,
    ]))
    .expect("an event serialises")
}

/// The next link of the chain.
pub fn link(previous: &[u8; 32], event: &RecordedEvent) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(previous);
    h.update(canonical(event));
    h.finalize().into()
}

/// Chains one batch of new events; returns how many it chained. The hashes and the checkpoint
/// are written in one transaction.
pub async fn chain_batch(
    pool: &PgPool,
    follower: &mut Follower,
    limit: i64,
) -> Result<usize, sqlx::Error> {
    let batch = follower.next_batch(limit).await?;
    let Some(last) = batch.last().map(RecordedEvent::cursor) else {
        return Ok(0);
    };
    let mut previous = last_hash(pool).await?;
    let mut positions = Vec::with_capacity(batch.len());
    let mut txids = Vec::with_capacity(batch.len());
    let mut hashes = Vec::with_capacity(batch.len());
    for event in &batch {
        previous = link(&previous, event);
        positions.push(event.position);
        txids.push(event.transaction_id.to_string());
        hashes.push(previous.to_vec());
    }
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO event_hashes (position, transaction_id, hash)
         SELECT p, t::xid8, h FROM unnest($1::bigint[], $2::text[], $3::bytea[]) AS u(p, t, h)",
    )
    .bind(&positions)
    .bind(&txids)
    .bind(&hashes)
    .execute(&mut *tx)
    .await?;
    save_checkpoint(&mut *tx, CHAINER, last).await?;
    tx.commit().await?;
    follower.advance(last);
    Ok(batch.len())
}

async fn last_hash(pool: &PgPool) -> Result<[u8; 32], sqlx::Error> {
    let hash: Option<Vec<u8>> = sqlx::query_scalar(
        "SELECT hash FROM event_hashes ORDER BY transaction_id DESC, position DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(hash
        .and_then(|h| <[u8; 32]>::try_from(h.as_slice()).ok())
        .unwrap_or(GENESIS))
}

/// What `verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Events whose link was recomputed and matched.
    pub verified: u64,
    /// Events not chained yet (newer than the chainer's checkpoint).
    pub unchained: u64,
    /// The first break, if any.
    pub first_break: Option<ChainBreak>,
}

/// The first place where the stored log no longer matches its chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainBreak {
    /// Position of the event (or of the hash whose event is gone).
    pub position: i64,
    /// The event id, when the event still exists.
    pub event_id: Option<String>,
    /// The event's stream, when the event still exists.
    pub stream: Option<String>,
    /// What is wrong.
    pub reason: String,
}

/// Recomputes the chain over every chained event, in read order. `progress(done, total)` is
/// called as it goes.
pub async fn verify(
    pool: &PgPool,
    progress: impl FnMut(u64, u64),
) -> Result<VerifyReport, sqlx::Error> {
    verify_from(pool, Cursor::START, GENESIS, progress).await
}

/// The stored hash of the event at `at` (the link a check from there starts after).
pub async fn stored_hash(pool: &PgPool, at: Cursor) -> Result<Option<[u8; 32]>, sqlx::Error> {
    let hash: Option<Vec<u8>> = sqlx::query_scalar(
        "SELECT hash FROM event_hashes WHERE transaction_id = $1::text::xid8 AND position = $2",
    )
    .bind(at.transaction_id.to_string())
    .bind(at.position)
    .fetch_optional(pool)
    .await?;
    Ok(hash.and_then(|h| <[u8; 32]>::try_from(h.as_slice()).ok()))
}

/// [`verify`] of the events after `after` only, whose link before them is `previous` (the
/// stored hash at `after`, trusted: a check that ended there verified it). Counts are of
/// those events.
pub async fn verify_from(
    pool: &PgPool,
    after: Cursor,
    previous: [u8; 32],
    mut progress: impl FnMut(u64, u64),
) -> Result<VerifyReport, sqlx::Error> {
    const PAGE: i64 = 20_000;
    let (total, all_events): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM event_hashes
                  WHERE (transaction_id, position) > ($1::text::xid8, $2)),
                (SELECT count(*) FROM events
                  WHERE (transaction_id, position) > ($1::text::xid8, $2))",
    )
    .bind(after.transaction_id.to_string())
    .bind(after.position)
    .fetch_one(pool)
    .await?;
    let mut previous = previous;
    let mut verified = 0u64;
    let sql = format!(
        "SELECT h.position, h.transaction_id::text, h.hash, e.position IS NOT NULL, {}
           FROM event_hashes h
           LEFT JOIN events e ON e.transaction_id = h.transaction_id AND e.position = h.position
          WHERE (h.transaction_id, h.position) > ($1::text::xid8, $2)
          ORDER BY h.transaction_id, h.position
          LIMIT $3",
        columns("e")
    );
    // The next page is read while this one is hashed: the read is the database's work and the
    // hashing this process's, so they overlap on two cores. Dropped unread (a break found, an
    // error), the read ahead is aborted.
    let read = |after: Cursor| {
        let (pool, sql) = (pool.clone(), sql.clone());
        AbortOnDropHandle::new(tokio::spawn(async move {
            sqlx::query(&sql)
                .bind(after.transaction_id.to_string())
                .bind(after.position)
                .bind(PAGE)
                .fetch_all(&pool)
                .await
        }))
    };
    let mut next = read(after);
    loop {
        let rows = (&mut next)
            .await
            .map_err(|e| sqlx::Error::Io(std::io::Error::other(e)))??;
        let Some(last) = rows.last() else {
            break;
        };
        let txid: String = last.try_get(1)?;
        next = read(Cursor {
            transaction_id: txid.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            position: last.try_get(0)?,
        });
        for row in &rows {
            let position: i64 = row.try_get(0)?;
            let stored: Vec<u8> = row.try_get(2)?;
            let present: bool = row.try_get(3)?;
            let broken = |event: Option<&RecordedEvent>, reason: &str| ChainBreak {
                position,
                event_id: event.map(|e| e.id.clone()),
                stream: event.map(|e| e.stream.clone()),
                reason: reason.to_string(),
            };
            if !present {
                return Ok(report(
                    verified,
                    all_events,
                    broken(None, "the event was removed"),
                ));
            }
            let event = decode_at(row, 4)?;
            let expected = link(&previous, &event);
            if stored.as_slice() != expected {
                return Ok(report(
                    verified,
                    all_events,
                    broken(
                        Some(&event),
                        "its stored content no longer matches its hash",
                    ),
                ));
            }
            previous = expected;
            verified += 1;
        }
        progress(verified, total as u64);
    }
    Ok(VerifyReport {
        verified,
        unchained: (all_events as u64).saturating_sub(verified),
        first_break: None,
    })
}

fn report(verified: u64, all_events: i64, first_break: ChainBreak) -> VerifyReport {
    VerifyReport {
        verified,
        unchained: (all_events as u64).saturating_sub(verified),
        first_break: Some(first_break),
    }
}

/// Runs the chainer for as long as the task lives: takes the lease (one chainer across
/// replicas), then chains batches as the log grows.
pub async fn run_chainer(pool: PgPool, notifier: Notifier) -> Result<(), sqlx::Error> {
    let _lease = Lease::acquire(&pool, CHAINER, Duration::from_secs(2)).await;
    // Nobody waits on the chain: it links the commits of a busy moment in one pass.
    let mut follower = Follower::load(pool.clone(), CHAINER, &notifier)
        .await?
        .paced(Duration::from_millis(20));
    loop {
        let chained = chain_batch(&pool, &mut follower, 2000).await?;
        if chained == 0 {
            follower.report_lag().await?;
        }
        follower.wait_unless_full().await;
    }
}
