//! Rebuilding every projection from the log into a scratch schema and comparing it, row for
//! row, with the live tables (`vps replay --verify`).

use sqlx::{Connection, Executor, PgConnection, PgPool};
use vps_events::read::{read_filtered, Filter};
use vps_events::Cursor;

use crate::{apply, ProjectionError, TABLES};

/// One table's differences between the rebuilt and the live projection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDiff {
    /// The table.
    pub table: String,
    /// Rows (as JSON) only the live table has.
    pub only_live: Vec<String>,
    /// Rows (as JSON) only the rebuild has.
    pub only_rebuilt: Vec<String>,
}

/// What a verify found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    /// Events replayed.
    pub events: u64,
    /// Tables that differ (empty = equal).
    pub diffs: Vec<TableDiff>,
    /// Tables not compared because their async projector had not caught up.
    pub skipped: Vec<String>,
    /// Where the time went.
    pub timings: Timings,
}

/// Where a replay's time went, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Reading the log (and decoding it).
    pub read: f64,
    /// Folding events (in memory, or by the SQL projectors, which also write).
    pub fold: f64,
    /// Writing folded rows into the scratch tables.
    pub write: f64,
    /// Building indexes after the load (and the NodeSpecs from the rebuilt views).
    pub index: f64,
    /// Comparing the rebuilt tables with the live ones.
    pub compare: f64,
}

impl std::fmt::Display for Timings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "read {:.2} s, fold {:.2} s, write {:.2} s, indexes {:.2} s, comparison {:.2} s",
            self.read, self.fold, self.write, self.index, self.compare
        )
    }
}

/// Replays the whole log into a scratch schema and compares every projection table with the
/// live one. The scratch schema is dropped afterwards. `progress(events_done)` is called per
/// page. Live writers may append meanwhile: the comparison runs in one repeatable-read
/// transaction, and the rebuild replays exactly the events that snapshot can see.
pub async fn verify(
    pool: &PgPool,
    mut progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    let schema = format!("replay_{}", std::process::id());
    let mut conn = pool.acquire().await?;
    let conn: &mut PgConnection = &mut conn;
    let mut tx = conn.begin().await?;
    tx.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await?;
    tx.execute(format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}").as_str())
        .await?;
    for table in TABLES {
        tx.execute(
            format!("CREATE TABLE {schema}.{table} (LIKE public.{table} INCLUDING ALL)").as_str(),
        )
        .await?;
    }
    tx.execute(format!("SET LOCAL search_path = {schema}, public").as_str())
        .await?;
    let mut timings = Timings::default();
    let mut cursor = Cursor::START;
    let mut events = 0u64;
    loop {
        // Within one snapshot nothing can commit late, so read all it sees, in the agreed order.
        let at = std::time::Instant::now();
        let page = read_all_visible(&mut tx, cursor, 2000).await?;
        timings.read += at.elapsed().as_secs_f64();
        let Some(last) = page.last() else { break };
        cursor = last.cursor();
        let at = std::time::Instant::now();
        for event in &page {
            apply(&mut tx, event).await?;
        }
        timings.fold += at.elapsed().as_secs_f64();
        events += page.len() as u64;
        progress(events);
    }
    let at = std::time::Instant::now();
    crate::node_specs::refresh_all(&mut tx).await?;
    timings.index += at.elapsed().as_secs_f64();
    let at = std::time::Instant::now();
    let behind = behind(&mut tx, &schema, cursor).await?;
    let (diffs, skipped) = compare_all(&mut tx, &schema, &behind).await?;
    timings.compare += at.elapsed().as_secs_f64();
    tx.rollback().await?;
    Ok(ReplayReport {
        events,
        diffs,
        skipped,
        timings,
    })
}

/// Projects every event after `after` into the tables `search_path` names, in the caller's
/// transaction, as the inline projectors would have; answers the last event's cursor. For
/// tools that build a log without running its commands (`vps bench replay`).
pub async fn project_after(
    conn: &mut PgConnection,
    after: Cursor,
) -> Result<Cursor, ProjectionError> {
    let mut cursor = after;
    loop {
        let page = vps_events::read::read_after(&mut *conn, cursor, 5000).await?;
        let Some(last) = page.last() else {
            return Ok(cursor);
        };
        cursor = last.cursor();
        for event in &page {
            apply(conn, event).await?;
        }
    }
}

/// The prefixes of the tables whose projector runs behind the log and has not yet caught up
/// with what this snapshot sees (`cursor` is the last event it holds):
/// - the NodeSpec projector (`node_spec_*`), a follower with a checkpoint;
/// - the metering reactor's projection (`usage_*`), which commits a batch's records to the
///   log first and projects them in a transaction of its own: it is behind while the log
///   holds a record past the window it marked settled with its projection.
async fn behind(
    tx: &mut PgConnection,
    schema: &str,
    cursor: Cursor,
) -> Result<Vec<&'static str>, sqlx::Error> {
    let specs_at: Option<(String, i64)> = sqlx::query_as(
        "SELECT transaction_id::text, position FROM follower_checkpoints WHERE name = $1",
    )
    .bind(crate::node_specs::FOLLOWER)
    .fetch_optional(&mut *tx)
    .await?;
    let specs_done = specs_at
        .and_then(|(t, p)| {
            Some(Cursor {
                transaction_id: t.parse().ok()?,
                position: p,
            })
        })
        .is_some_and(|at| at >= cursor);
    let usage_done: bool = sqlx::query_scalar(&format!(
        "SELECT NOT EXISTS (
             SELECT 1 FROM {schema}.usage_records
              WHERE window_end > coalesce((SELECT max(settled_until) FROM public.usage_progress),
                                          '-infinity'))"
    ))
    .fetch_one(&mut *tx)
    .await?;
    let mut behind = Vec::new();
    if !specs_done {
        behind.push("node_spec_");
    }
    if !usage_done {
        behind.push("usage_");
    }
    Ok(behind)
}

/// Compares every projection table of `schema` with the live one: the tables that differ, and
/// those not compared because their async projector had not caught up.
async fn compare_all(
    tx: &mut PgConnection,
    schema: &str,
    behind: &[&str],
) -> Result<(Vec<TableDiff>, Vec<String>), ProjectionError> {
    let mut skipped = Vec::new();
    let mut diffs = Vec::new();
    for table in TABLES {
        // A generation counts changes, not content: the entries are what is compared.
        if *table == "node_specs" {
            continue;
        }
        if behind.iter().any(|prefix| table.starts_with(prefix)) {
            skipped.push(table.to_string());
            continue;
        }
        let diff = compare(
            &mut *tx,
            &comparable(table, "public"),
            &comparable(table, schema),
        )
        .await?;
        if !diff.0.is_empty() || !diff.1.is_empty() {
            diffs.push(TableDiff {
                table: table.to_string(),
                only_live: diff.0,
                only_rebuilt: diff.1,
            });
        }
    }
    Ok((diffs, skipped))
}

async fn read_all_visible(
    conn: &mut PgConnection,
    after: Cursor,
    limit: i64,
) -> Result<Vec<vps_events::RecordedEvent>, sqlx::Error> {
    let everything = Filter {
        whole_snapshot: true,
        ..Filter::default()
    };
    read_filtered(conn, after, &everything, limit).await
}

/// What of a table a replay compares: every row; of a spec entry, all but the generation it
/// was written at (it counts changes, not content); of a free address, all but the
/// transaction that freed it (the replay's own).
fn comparable(table: &str, schema: &str) -> String {
    let without = |column: &str| {
        format!("(SELECT to_jsonb(t) - '{column}' AS row FROM {schema}.{table} t) AS {table}")
    };
    match table {
        "ip_free" => without("freed_by"),
        t if t.starts_with("node_spec_") => without("generation"),
        _ => format!("{schema}.{table}"),
    }
}

async fn compare(
    conn: &mut PgConnection,
    live: &str,
    rebuilt: &str,
) -> Result<(Vec<String>, Vec<String>), sqlx::Error> {
    let diff = |a: &str, b: &str| {
        format!("SELECT to_jsonb(x)::text FROM (SELECT * FROM {a} EXCEPT ALL SELECT * FROM {b}) x LIMIT 20")
    };
    let only_live = sqlx::query_scalar(&diff(live, rebuilt))
        .fetch_all(&mut *conn)
        .await?;
    let only_rebuilt = sqlx::query_scalar(&diff(rebuilt, live))
        .fetch_all(&mut *conn)
        .await?;
    Ok((only_live, only_rebuilt))
}
