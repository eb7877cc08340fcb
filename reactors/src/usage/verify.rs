//! `vps usage verify`: recompute every record from the log alone, in memory, and compare it
//! with the `usage.recorded` events, record for record.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{Connection, Executor, PgPool};
use vps_domain::usage::record::EVENT_TYPE;
use vps_domain::usage::window::micros;
use vps_domain::usage::{Ledger, Micros, UsageRecord, Windows};
use vps_events::read::{read_filtered, Filter};
use vps_events::Cursor;

use super::{MeteringError, FOLLOWER};

/// Where the recorded and the recomputed records part.
// A verify answers one difference at most: the records' size (their labels) does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Difference {
    /// The log lacks a record the recomputation has.
    Missing(UsageRecord),
    /// The log has a record (this event id) the recomputation does not.
    Extra(String, UsageRecord),
    /// The same id holds another record.
    Changed {
        /// The event id.
        id: String,
        /// What the log holds.
        recorded: UsageRecord,
        /// What the log's instance events give.
        recomputed: UsageRecord,
    },
}

/// What a verify found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyReport {
    /// Records compared (recomputed ones in range).
    pub compared: usize,
    /// Windows are compared up to here: the metering reactor's settled mark, or `to`.
    pub until: Option<DateTime<Utc>>,
    /// The first difference by window start and id (`None`: equal).
    pub first_difference: Option<Difference>,
}

/// Recomputes the records of windows starting in `[from, to)` (and before the reactor's
/// settled mark) from one snapshot of the log, and compares them with the recorded ones.
pub async fn verify(
    pool: &PgPool,
    windows: Windows,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> Result<VerifyReport, MeteringError> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    tx.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await?;
    let settled: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT settled_until FROM usage_progress WHERE name = $1")
            .bind(FOLLOWER)
            .fetch_optional(&mut *tx)
            .await?;
    let Some(until) = settled.map(|s| s.min(to)) else {
        return Ok(VerifyReport {
            compared: 0,
            until: None,
            first_difference: None,
        });
    };
    let range = (micros(from), micros(until));
    let mut ledger = Ledger::new(windows);
    let mut recorded = BTreeMap::new();
    let everything = Filter {
        whole_snapshot: true,
        ..Filter::default()
    };
    let mut cursor = Cursor::START;
    loop {
        let page = read_filtered(&mut *tx, cursor, &everything, 5000).await?;
        let Some(last) = page.last() else { break };
        cursor = last.cursor();
        for e in &page {
            if e.event_type == EVENT_TYPE {
                let record = UsageRecord::from_data(&e.data)?;
                if in_range(&record, range) {
                    recorded.insert(key(&record, &e.id), record);
                }
            } else {
                ledger.apply(&e.stream, &e.event_type, &e.data, e.recorded_at);
            }
        }
    }
    tx.rollback().await?;
    let recomputed = settle_all(&mut ledger, range);
    Ok(VerifyReport {
        compared: recomputed.len(),
        until: Some(until),
        first_difference: first_difference(recorded, recomputed),
    })
}

type Key = (DateTime<Utc>, String);

fn key(record: &UsageRecord, id: &str) -> Key {
    (record.window_start, id.to_string())
}

fn in_range(record: &UsageRecord, (from, until): (Micros, Micros)) -> bool {
    let start = micros(record.window_start);
    start >= from && start < until
}

/// Every record of windows ending by `until` whose start is in range, keyed like the log's.
fn settle_all(ledger: &mut Ledger, range: (Micros, Micros)) -> BTreeMap<Key, UsageRecord> {
    let windows = ledger.windows();
    let until = windows.start_of(range.1);
    let mut out = BTreeMap::new();
    let Some(first) = ledger.earliest_start() else {
        return out;
    };
    // A day of windows at a time keeps memory bounded by the records in range.
    let mut from = windows.start_of(first);
    while from < until {
        let next = (from + 288 * windows.length()).min(until);
        for record in ledger.settle(from, next) {
            if in_range(&record, range) {
                let id = record.event_id();
                out.insert(key(&record, &id), record);
            }
        }
        from = next;
    }
    out
}

fn first_difference(
    mut recorded: BTreeMap<Key, UsageRecord>,
    recomputed: BTreeMap<Key, UsageRecord>,
) -> Option<Difference> {
    let mut first: Option<(Key, Difference)> = None;
    let mut keep = |k: &Key, d: Difference| {
        if first.as_ref().is_none_or(|(f, _)| k < f) {
            first = Some((k.clone(), d));
        }
    };
    for (k, mine) in recomputed {
        match recorded.remove(&k) {
            None => keep(&k, Difference::Missing(mine)),
            Some(theirs) if theirs != mine => keep(
                &k,
                Difference::Changed {
                    id: k.1.clone(),
                    recorded: theirs,
                    recomputed: mine,
                },
            ),
            Some(_) => {}
        }
    }
    if let Some((k, theirs)) = recorded.into_iter().next() {
        keep(&k, Difference::Extra(k.1.clone(), theirs));
    }
    first.map(|(_, d)| d)
}
