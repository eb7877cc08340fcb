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
    /// The last event of the log the replay's snapshot held (the checkpoint it verified).
    pub last: Cursor,
    /// Tables that differ (empty = equal).
    pub diffs: Vec<TableDiff>,
    /// Tables not compared because their async projector had not caught up.
    pub skipped: Vec<String>,
    /// Tables a replay of what changed does not compare (rows many streams add to).
    pub unscoped: Vec<String>,
    /// The hash of each table found equal (its row count and the sums of its rows' md5 halves).
    pub hashes: std::collections::BTreeMap<String, String>,
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

/// Events read from the log in one page.
const PAGE: i64 = 20_000;

/// Events folded in memory before their rows are written (bounds the memory a replay holds).
const FLUSH_EVERY: usize = 500_000;

/// Replays the whole log into a scratch schema and compares every projection table with the
/// live one. The scratch schema is dropped afterwards. `progress(events_read)` is called per
/// page. Live writers may append meanwhile: the log and the live tables are read in one
/// repeatable-read transaction, and the rebuild replays exactly the events that snapshot can
/// see.
///
/// The rebuild folds the busy streams in memory (instances, sandboxes, usage records: see
/// [`Rebuild`]) and writes their rows in batches; every other event goes through its SQL
/// projector. The scratch tables get their unique indexes first (the projectors' upserts need
/// them) and the others after the load. Each table is compared by a hash of its rows; only a
/// table whose hashes differ is searched for the rows that differ.
pub async fn verify(
    pool: &PgPool,
    progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    run(pool, pool, None, progress).await
}

/// [`verify`] of what changed after `after` (a verified checkpoint): the streams with events
/// after it are replayed whole, and the rows they own are compared (instance views,
/// allocations and leases; sandboxes and their snapshots; a tenant's usage records). Rows
/// many streams add to (quotas, node sums, the free list, rollups, pools, nodes, ...) are not
/// compared: [`ReplayReport::unscoped`] names them. See docs/decisions/0023.
pub async fn verify_changed(
    pool: &PgPool,
    after: Cursor,
    progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    run(pool, pool, Some(after), progress).await
}

/// [`verify`] (or [`verify_changed`], given `after`) across two databases: the log and the
/// live tables are read from `live`, which may be a read replica (only read-only statements
/// run there), and the scratch schema is built in `scratch`, a migrated database (it may be
/// the same one). Each table is hashed on its own side; where hashes differ, the rows' hashes
/// are fetched from both sides and only the differing rows are named.
pub async fn verify_across(
    live: &PgPool,
    scratch: &PgPool,
    after: Option<Cursor>,
    progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    run(live, scratch, after, progress).await
}

/// Pages read ahead of the fold: the log's reader runs beside the fold and the writes.
const READ_AHEAD: usize = 2;

async fn run(
    live: &PgPool,
    scratch: &PgPool,
    changed_after: Option<Cursor>,
    mut progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    let schema = format!("replay_{}", std::process::id());
    let mut live_tx = live.begin().await?;
    live_tx
        .execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await?;
    let mut conn = scratch.acquire().await?;
    let conn: &mut PgConnection = &mut conn;
    sweep(conn).await?;
    let mut tx = conn.begin().await?;
    same_text_forms(&mut live_tx, &mut tx).await?;
    let mut timings = Timings::default();
    let later_indexes = scratch_schema(&mut tx, &schema).await?;
    let scope = match changed_after {
        Some(after) => Some(scope(&mut live_tx, after).await?),
        None => None,
    };
    tx.execute(format!("SET LOCAL search_path = {schema}, public").as_str())
        .await?;
    // The log is read on its own connection in a task of its own, a page or two ahead of
    // the fold, so reading and decoding overlap folding and writing.
    let (pages, mut next_page) = tokio::sync::mpsc::channel(READ_AHEAD);
    let reader = tokio::spawn(async move {
        let (mut cursor, mut seconds) = (Cursor::START, 0.0);
        loop {
            // Within one snapshot nothing can commit late, so read all it sees, in order.
            let at = std::time::Instant::now();
            let page = read_all_visible(&mut live_tx, cursor, PAGE).await?;
            seconds += at.elapsed().as_secs_f64();
            let Some(last) = page.last() else { break };
            cursor = last.cursor();
            if pages.send(page).await.is_err() {
                break; // The fold failed and stopped listening.
            }
        }
        Ok::<_, sqlx::Error>((live_tx, cursor, seconds))
    });
    let mut rebuild = Rebuild {
        into_empty: true,
        ..Rebuild::default()
    };
    let (mut read, mut events) = (0u64, 0u64);
    while let Some(mut page) = next_page.recv().await {
        read += page.len() as u64;
        if let Some(streams) = &scope {
            page.retain(|e: &vps_events::RecordedEvent| streams.contains(&e.stream));
        }
        events += page.len() as u64;
        rebuild.apply_page(&mut tx, page).await?;
        progress(read);
    }
    let (mut live_tx, cursor, read_seconds) = reader
        .await
        .map_err(|e| ProjectionError::Reader(e.to_string()))??;
    timings.read += read_seconds;
    rebuild.flush(&mut tx).await?;
    timings.fold += rebuild.fold_seconds;
    timings.write += rebuild.write_seconds;
    let at = std::time::Instant::now();
    for index in &later_indexes {
        tx.execute(index.as_str()).await?;
    }
    if scope.is_none() {
        crate::node_specs::refresh_all(&mut tx).await?;
    }
    timings.index += at.elapsed().as_secs_f64();
    let at = std::time::Instant::now();
    let behind = behind(&mut live_tx, &mut tx, &schema, cursor).await?;
    let sides = Sides {
        live: &mut live_tx,
        scratch: &mut tx,
        schema: &schema,
    };
    let compared = compare_all(sides, &behind, scope.as_ref()).await?;
    timings.compare += at.elapsed().as_secs_f64();
    live_tx.rollback().await?;
    tx.rollback().await?;
    Ok(ReplayReport {
        events,
        last: cursor,
        diffs: compared.diffs,
        skipped: compared.skipped,
        unscoped: compared.unscoped,
        hashes: compared.hashes,
        timings,
    })
}

/// Gives the scratch transaction the live one's text forms of values (time zone, date and
/// interval styles, float digits): rows are hashed as text on each side, and two databases
/// (or roles) may default to different forms.
async fn same_text_forms(
    live: &mut PgConnection,
    scratch: &mut PgConnection,
) -> Result<(), sqlx::Error> {
    const SETTINGS: [&str; 4] = [
        "TimeZone",
        "DateStyle",
        "IntervalStyle",
        "extra_float_digits",
    ];
    for setting in SETTINGS {
        let value: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(setting)
            .fetch_one(&mut *live)
            .await?;
        sqlx::query("SELECT set_config($1, $2, true)")
            .bind(setting)
            .bind(value)
            .execute(&mut *scratch)
            .await?;
    }
    Ok(())
}

/// The streams with events after `after`.
async fn scope(
    live: &mut PgConnection,
    after: Cursor,
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT DISTINCT stream FROM events WHERE (transaction_id, position) > ($1::text::xid8, $2)",
    )
    .bind(after.transaction_id.to_string())
    .bind(after.position)
    .fetch_all(&mut *live)
    .await
    .map(|streams: Vec<String>| streams.into_iter().collect())
}

/// Drops the scratch schemas of replays that ended without dropping theirs. A replay's schema
/// lives in its rolled-back transaction and so never outlasts it; this catches any left by an
/// older version or by hand.
async fn sweep(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    let left: Vec<String> = sqlx::query_scalar(
        r"SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'replay\_%'",
    )
    .fetch_all(&mut *conn)
    .await?;
    for schema in left {
        conn.execute(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE").as_str())
            .await?;
    }
    Ok(())
}

/// Creates `schema` with an empty copy of every projection table and its unique indexes
/// (which the projectors' upserts need); answers the other indexes, to build after the load.
async fn scratch_schema(tx: &mut PgConnection, schema: &str) -> Result<Vec<String>, sqlx::Error> {
    tx.execute(format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}").as_str())
        .await?;
    let mut later = Vec::new();
    // Unlogged: the scratch tables live in a transaction that is rolled back, so their writes
    // need no WAL.
    for table in TABLES {
        tx.execute(
            format!(
                "CREATE UNLOGGED TABLE {schema}.{table} (LIKE public.{table} INCLUDING ALL EXCLUDING INDEXES)"
            )
            .as_str(),
        )
        .await?;
        let indexes: Vec<(String, bool)> = sqlx::query_as(
            "SELECT pg_get_indexdef(i.indexrelid), i.indisunique
               FROM pg_index i
              WHERE i.indrelid = ('public.' || $1)::regclass
              ORDER BY i.indexrelid",
        )
        .bind(table)
        .fetch_all(&mut *tx)
        .await?;
        for (definition, unique) in indexes {
            let here = definition.replacen(
                &format!(" ON public.{table} "),
                &format!(" ON {schema}.{table} "),
                1,
            );
            if unique {
                tx.execute(here.as_str()).await?;
            } else {
                later.push(here);
            }
        }
    }
    Ok(later)
}

/// The projectors run over many events: instance, sandbox and usage-record events are folded
/// in memory and their rows written in batches (`instances::batch`, `SandboxBatch`,
/// `usage::apply_records`; new rows are copied, see `copy`); any other event a projector takes is applied by it after the
/// batches are written, so it sees the tables as the event-by-event projection would.
#[derive(Default)]
pub(crate) struct Rebuild {
    instances: crate::instances::batch::Batch,
    sandboxes: crate::sandboxes::SandboxBatch,
    records: Vec<(String, vps_domain::usage::UsageRecord)>,
    record_ids: std::collections::HashSet<String>,
    pending: usize,
    /// The tables started empty (a scratch schema): no usage record is in them yet.
    into_empty: bool,
    fold_seconds: f64,
    write_seconds: f64,
}

impl Rebuild {
    /// Applies a page of events in order.
    pub(crate) async fn apply_page(
        &mut self,
        conn: &mut PgConnection,
        page: Vec<vps_events::RecordedEvent>,
    ) -> Result<(), ProjectionError> {
        let at = std::time::Instant::now();
        let written = self.write_seconds;
        for mut e in page {
            self.apply(conn, &mut e).await?;
        }
        self.fold_seconds += at.elapsed().as_secs_f64() - (self.write_seconds - written);
        Ok(())
    }

    async fn apply(
        &mut self,
        conn: &mut PgConnection,
        e: &mut vps_events::RecordedEvent,
    ) -> Result<(), ProjectionError> {
        use vps_domain::sandbox::SandboxEvent;
        match e.category() {
            "instance" => self.instances.fold(conn, e).await?,
            "sandbox" => {
                let event = crate::typed::<SandboxEvent>(e)?;
                if crate::sandboxes::SandboxBatch::takes(&event) {
                    self.sandboxes.fold(conn, e, &event).await?;
                } else {
                    self.flush(conn).await?;
                    apply(conn, e).await?;
                    self.sandboxes.forget(crate::sandboxes::sandbox_id(e));
                }
            }
            "tenant" if e.event_type == vps_domain::usage::record::EVENT_TYPE => {
                let record = vps_domain::usage::UsageRecord::from_data(&e.data).map_err(|err| {
                    ProjectionError::Malformed {
                        event_id: e.id.clone(),
                        event_type: e.event_type.clone(),
                        message: err.to_string(),
                    }
                })?;
                // A record applied twice in one statement would be summed twice.
                if self.record_ids.insert(e.id.clone()) {
                    self.records.push((e.id.clone(), record));
                }
            }
            "tenant" => return Ok(()),
            category if crate::PROJECTED.contains(&category) => {
                self.flush(conn).await?;
                return apply(conn, e).await;
            }
            // No projector takes it (audit checkpoints, host reports, ...).
            _ => return Ok(()),
        }
        self.pending += 1;
        if self.pending >= FLUSH_EVERY {
            self.flush(conn).await?;
        }
        Ok(())
    }

    /// Writes everything folded so far.
    pub(crate) async fn flush(&mut self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        if self.pending == 0 {
            return Ok(());
        }
        let at = std::time::Instant::now();
        if !self.instances.is_empty() {
            self.instances.flush(conn).await?;
        }
        if !self.sandboxes.is_empty() {
            self.sandboxes.flush(conn).await?;
        }
        let records: Vec<(String, &vps_domain::usage::UsageRecord)> =
            self.records.iter().map(|(id, r)| (id.clone(), r)).collect();
        if self.into_empty {
            crate::usage::copy_records(conn, &records).await?;
        } else {
            crate::usage::apply_records(conn, &records).await?;
        }
        self.records.clear();
        self.record_ids.clear();
        self.pending = 0;
        self.write_seconds += at.elapsed().as_secs_f64();
        Ok(())
    }
}

/// Projects every event after `after` into the tables `search_path` names, in the caller's
/// transaction, as the inline projectors would have (batched as a replay does); answers the
/// last event's cursor. For tools that build a log without running its commands (`vps bench
/// replay`): it reads every committed event, not stopping at the read horizon, so nothing may
/// be appending meanwhile.
pub async fn project_after(
    conn: &mut PgConnection,
    after: Cursor,
) -> Result<Cursor, ProjectionError> {
    let mut cursor = after;
    let mut rebuild = Rebuild::default();
    loop {
        let page = read_all_visible(&mut *conn, cursor, PAGE).await?;
        let Some(last) = page.last() else { break };
        cursor = last.cursor();
        rebuild.apply_page(conn, page).await?;
    }
    rebuild.flush(conn).await?;
    Ok(cursor)
}

/// The prefixes of the tables whose projector runs behind the log and has not yet caught up
/// with what this snapshot sees (`cursor` is the last event it holds):
/// - the NodeSpec projector (`node_spec_*`), a follower with a checkpoint;
/// - the metering reactor's projection (`usage_*`), which commits a batch's records to the
///   log first and projects them in a transaction of its own: it is behind while the log
///   holds a record past the window it marked settled with its projection.
async fn behind(
    live: &mut PgConnection,
    scratch: &mut PgConnection,
    schema: &str,
    cursor: Cursor,
) -> Result<Vec<&'static str>, sqlx::Error> {
    let specs_at: Option<(String, i64)> = sqlx::query_as(
        "SELECT transaction_id::text, position FROM follower_checkpoints WHERE name = $1",
    )
    .bind(crate::node_specs::FOLLOWER)
    .fetch_optional(&mut *live)
    .await?;
    let specs_done = specs_at
        .and_then(|(t, p)| {
            Some(Cursor {
                transaction_id: t.parse().ok()?,
                position: p,
            })
        })
        .is_some_and(|at| at >= cursor);
    // As text with its offset, so it reads back alike whatever the other side's time zone.
    let settled: Option<String> =
        sqlx::query_scalar("SELECT max(settled_until)::text FROM usage_progress")
            .fetch_one(&mut *live)
            .await?;
    let usage_done: bool = sqlx::query_scalar(&format!(
        "SELECT NOT EXISTS (
             SELECT 1 FROM {schema}.usage_records
              WHERE window_end > coalesce($1::text::timestamptz, '-infinity'))"
    ))
    .bind(settled)
    .fetch_one(&mut *scratch)
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

/// The two transactions a comparison reads: the live tables' (public) and the rebuild's
/// (`schema`), on connections of their own, possibly to different databases.
struct Sides<'a> {
    live: &'a mut PgConnection,
    scratch: &'a mut PgConnection,
    schema: &'a str,
}

/// Compares every projection table of the scratch schema with the live one: the tables that
/// differ, those not compared because their async projector had not caught up, and the hash
/// of each table found equal. Both sides of a table are hashed at once, each by its own
/// database.
async fn compare_all(
    sides: Sides<'_>,
    behind: &[&str],
    scope: Option<&std::collections::HashSet<String>>,
) -> Result<Compared, ProjectionError> {
    let Sides {
        live,
        scratch,
        schema,
    } = sides;
    let mut compared = Compared::default();
    for table in TABLES {
        // A generation counts changes, not content: the entries are what is compared.
        if *table == "node_specs" {
            continue;
        }
        if behind.iter().any(|prefix| table.starts_with(prefix)) {
            compared.skipped.push(table.to_string());
            continue;
        }
        let (live_from, rebuilt_from, owned) = match scope {
            Some(streams) => {
                let Some((column, category)) = owned_by_scope(table) else {
                    compared.unscoped.push(table.to_string());
                    continue;
                };
                let only = |from: &str| {
                    format!("(SELECT * FROM {from} t WHERE t.{column} = ANY($1)) AS {table}")
                };
                let prefix = format!("{category}-");
                let ids: Vec<String> = streams
                    .iter()
                    .filter_map(|s| s.strip_prefix(&prefix).map(str::to_string))
                    .collect();
                (
                    only(&format!("public.{table}")),
                    only(&format!("{schema}.{table}")),
                    Some(ids),
                )
            }
            None => (comparable(table, "public"), comparable(table, schema), None),
        };
        let live_side = Side {
            sql: &live_from,
            owned: owned.as_deref(),
        };
        let rebuilt_side = Side {
            sql: &rebuilt_from,
            owned: owned.as_deref(),
        };
        let (live_hash, rebuilt_hash) = tokio::try_join!(
            hash(&mut *live, &live_side),
            hash(&mut *scratch, &rebuilt_side)
        )?;
        if live_hash == rebuilt_hash {
            compared.hashes.insert(table.to_string(), rebuilt_hash);
            continue;
        }
        let (only_live, only_rebuilt) =
            compare(&mut *live, &mut *scratch, &live_side, &rebuilt_side).await?;
        // Rows whose text differs may still be equal values: only the rows decide.
        if only_live.is_empty() && only_rebuilt.is_empty() {
            compared.hashes.insert(table.to_string(), rebuilt_hash);
        } else {
            compared.diffs.push(TableDiff {
                table: table.to_string(),
                only_live,
                only_rebuilt,
            });
        }
    }
    Ok(compared)
}

/// Of the rows of `table`, those the streams in scope own: the column holding the owner's id
/// and the owner's stream category; `None`: a table whose rows many streams add to.
fn owned_by_scope(table: &str) -> Option<(&'static str, &'static str)> {
    Some(match table {
        "instances" => ("id", "instance"),
        "node_allocations" | "ip_leases" => ("instance_id", "instance"),
        "sandboxes" => ("id", "sandbox"),
        "sandbox_snapshots" => ("sandbox_id", "sandbox"),
        "usage_records" => ("tenant_id", "tenant"),
        _ => return None,
    })
}

/// What [`compare_all`] found.
#[derive(Default)]
struct Compared {
    diffs: Vec<TableDiff>,
    skipped: Vec<String>,
    unscoped: Vec<String>,
    hashes: std::collections::BTreeMap<String, String>,
}

/// One side of a table's comparison: a from-item ([`comparable`], or the rows in scope, whose
/// owners' ids are bound as `$1`).
struct Side<'a> {
    sql: &'a str,
    owned: Option<&'a [String]>,
}

impl Side<'_> {
    /// `sql` (over the from-item) with `$1` bound when the from-item takes the owners' ids.
    fn query<'q, O>(
        &'q self,
        sql: &'q str,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>
    where
        O: Send + Unpin,
        (O,): for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
    {
        let query = sqlx::query_scalar(sql);
        match self.owned {
            Some(ids) => query.bind(ids),
            None => query,
        }
    }

    /// The number of the first parameter after the from-item's own.
    fn next_parameter(&self) -> usize {
        if self.owned.is_some() {
            2
        } else {
            1
        }
    }
}

/// A hash of the rows of `from`: the row count and the sums of two 64-bit hashes of each row,
/// so equal rows in any physical order hash alike, with no sort. The row hashes are
/// PostgreSQL's own hash of the record's values (`hash_record_extended`, seeds 0 and 1), which
/// hashes each column in its binary form: an md5 of each row's text cost four to five times
/// as much, most of it writing `jsonb` documents out as text. Values that are equal hash
/// alike (`1.0` and `1.00`). `sum(bigint)` is exact (it answers numeric) and adds in 128 bits.
async fn hash(conn: &mut PgConnection, from: &Side<'_>) -> Result<String, sqlx::Error> {
    let sql = format!(
        "SELECT count(*) || ':' || coalesce(sum(hash_record_extended(x, 0)), 0)
                || ':' || coalesce(sum(hash_record_extended(x, 1)), 0)
           FROM (SELECT * FROM {}) x",
        from.sql
    );
    from.query(&sql).fetch_one(conn).await
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

/// Rows named per side when a table differs.
const NAMED: i64 = 20;

/// Rows fetched per side to find those that differ by value (rows whose text differs but
/// whose values are equal are left out by comparing them as `jsonb`).
const CANDIDATES: usize = 1_000;

/// The rows (as JSON) only the live side has and only the rebuilt side has, at most [`NAMED`]
/// each: each side answers its rows' md5s; those not matched on the other side (as a
/// multiset) are fetched, and compared by value on the scratch connection.
async fn compare(
    live: &mut PgConnection,
    scratch: &mut PgConnection,
    live_side: &Side<'_>,
    rebuilt_side: &Side<'_>,
) -> Result<(Vec<String>, Vec<String>), sqlx::Error> {
    let hashes =
        |side: &Side<'_>| format!("SELECT md5(x::text) FROM (SELECT * FROM {}) x", side.sql);
    let (live_sql, rebuilt_sql) = (hashes(live_side), hashes(rebuilt_side));
    let (live_hashes, rebuilt_hashes): (Vec<String>, Vec<String>) = tokio::try_join!(
        live_side.query(&live_sql).fetch_all(&mut *live),
        rebuilt_side.query(&rebuilt_sql).fetch_all(&mut *scratch)
    )?;
    let mut balance: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
    for h in live_hashes {
        *balance.entry(h).or_default() += 1;
    }
    for h in rebuilt_hashes {
        *balance.entry(h).or_default() -= 1;
    }
    let pick = |sign: i64| -> Vec<String> {
        balance
            .iter()
            .filter(|(_, n)| n.signum() == sign)
            .map(|(h, _)| h.clone())
            .take(CANDIDATES)
            .collect()
    };
    let (live_only, rebuilt_only) = (pick(1), pick(-1));
    let rows = |side: &Side<'_>| {
        format!(
            "SELECT to_jsonb(x)::text FROM (SELECT * FROM {}) x WHERE md5(x::text) = ANY(${})",
            side.sql,
            side.next_parameter()
        )
    };
    let (live_sql, rebuilt_sql) = (rows(live_side), rows(rebuilt_side));
    let (live_rows, rebuilt_rows): (Vec<String>, Vec<String>) = tokio::try_join!(
        live_side
            .query(&live_sql)
            .bind(&live_only)
            .fetch_all(&mut *live),
        rebuilt_side
            .query(&rebuilt_sql)
            .bind(&rebuilt_only)
            .fetch_all(&mut *scratch)
    )?;
    let diff = |a: u8, b: u8| {
        format!(
            "SELECT r::text FROM (SELECT unnest(${a}::text[])::jsonb AS r
                                  EXCEPT ALL SELECT unnest(${b}::text[])::jsonb) d LIMIT {NAMED}"
        )
    };
    let (first, second) = (diff(1, 2), diff(2, 1));
    let only_live = sqlx::query_scalar(&first)
        .bind(&live_rows)
        .bind(&rebuilt_rows)
        .fetch_all(&mut *scratch)
        .await?;
    let only_rebuilt = sqlx::query_scalar(&second)
        .bind(&live_rows)
        .bind(&rebuilt_rows)
        .fetch_all(&mut *scratch)
        .await?;
    Ok((only_live, only_rebuilt))
}
