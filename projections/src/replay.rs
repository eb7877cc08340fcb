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
/// page. Live writers may append meanwhile: the comparison runs in one repeatable-read
/// transaction, and the rebuild replays exactly the events that snapshot can see.
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
    run(pool, None, progress).await
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
    run(pool, Some(after), progress).await
}

async fn run(
    pool: &PgPool,
    changed_after: Option<Cursor>,
    mut progress: impl FnMut(u64),
) -> Result<ReplayReport, ProjectionError> {
    let schema = format!("replay_{}", std::process::id());
    let mut conn = pool.acquire().await?;
    let conn: &mut PgConnection = &mut conn;
    sweep(conn).await?;
    let mut tx = conn.begin().await?;
    tx.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .await?;
    let mut timings = Timings::default();
    let later_indexes = scratch_schema(&mut tx, &schema).await?;
    let scope = match changed_after {
        Some(after) => Some(scope(&mut tx, &schema, after).await?),
        None => None,
    };
    tx.execute(format!("SET LOCAL search_path = {schema}, public").as_str())
        .await?;
    let mut rebuild = Rebuild::default();
    let mut cursor = Cursor::START;
    let (mut read, mut events) = (0u64, 0u64);
    loop {
        // Within one snapshot nothing can commit late, so read all it sees, in the agreed order.
        let at = std::time::Instant::now();
        let mut page = read_all_visible(&mut tx, cursor, PAGE).await?;
        timings.read += at.elapsed().as_secs_f64();
        let Some(last) = page.last() else { break };
        cursor = last.cursor();
        read += page.len() as u64;
        if let Some(streams) = &scope {
            page.retain(|e| streams.contains(&e.stream));
        }
        rebuild.apply_page(&mut tx, &page).await?;
        events += page.len() as u64;
        progress(read);
    }
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
    let behind = behind(&mut tx, &schema, cursor).await?;
    let compared = compare_all(&mut tx, &schema, &behind, scope.is_some()).await?;
    timings.compare += at.elapsed().as_secs_f64();
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

/// The streams with events after `after`, kept in `schema.replay_scope` for the comparison.
async fn scope(
    tx: &mut PgConnection,
    schema: &str,
    after: Cursor,
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    tx.execute(format!("CREATE TABLE {schema}.replay_scope (stream text PRIMARY KEY)").as_str())
        .await?;
    sqlx::query_scalar(&format!(
        "INSERT INTO {schema}.replay_scope
         SELECT DISTINCT stream FROM public.events
          WHERE (transaction_id, position) > ($1::text::xid8, $2)
         RETURNING stream"
    ))
    .bind(after.transaction_id.to_string())
    .bind(after.position)
    .fetch_all(&mut *tx)
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
    for table in TABLES {
        tx.execute(
            format!(
                "CREATE TABLE {schema}.{table} (LIKE public.{table} INCLUDING ALL EXCLUDING INDEXES)"
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
/// `usage::apply_records`); any other event a projector takes is applied by it after the
/// batches are written, so it sees the tables as the event-by-event projection would.
#[derive(Default)]
pub(crate) struct Rebuild {
    instances: crate::instances::batch::Batch,
    sandboxes: crate::sandboxes::SandboxBatch,
    records: Vec<(String, vps_domain::usage::UsageRecord)>,
    record_ids: std::collections::HashSet<String>,
    pending: usize,
    fold_seconds: f64,
    write_seconds: f64,
}

impl Rebuild {
    /// Applies a page of events in order.
    pub(crate) async fn apply_page(
        &mut self,
        conn: &mut PgConnection,
        page: &[vps_events::RecordedEvent],
    ) -> Result<(), ProjectionError> {
        let at = std::time::Instant::now();
        let written = self.write_seconds;
        for e in page {
            self.apply(conn, e).await?;
        }
        self.fold_seconds += at.elapsed().as_secs_f64() - (self.write_seconds - written);
        Ok(())
    }

    async fn apply(
        &mut self,
        conn: &mut PgConnection,
        e: &vps_events::RecordedEvent,
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
        crate::usage::apply_records(conn, &records).await?;
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
        rebuild.apply_page(conn, &page).await?;
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

/// Compares every projection table of `schema` with the live one: the tables that differ,
/// those not compared because their async projector had not caught up, and the hash of each
/// table found equal.
async fn compare_all(
    tx: &mut PgConnection,
    schema: &str,
    behind: &[&str],
    scoped: bool,
) -> Result<Compared, ProjectionError> {
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
        let (live, rebuilt) = if scoped {
            let Some(owned) = owned_by_scope(table, schema) else {
                compared.unscoped.push(table.to_string());
                continue;
            };
            let only = |from: &str| format!("(SELECT * FROM {from} t WHERE {owned}) AS {table}");
            (
                only(&format!("public.{table}")),
                only(&format!("{schema}.{table}")),
            )
        } else {
            (comparable(table, "public"), comparable(table, schema))
        };
        let (live_hash, rebuilt_hash): (String, String) =
            sqlx::query_as(&format!("SELECT ({}), ({})", hash(&live), hash(&rebuilt)))
                .fetch_one(&mut *tx)
                .await?;
        if live_hash == rebuilt_hash {
            compared.hashes.insert(table.to_string(), rebuilt_hash);
            continue;
        }
        // Rows whose text differs may still be equal values: only the rows decide.
        let diff = compare(&mut *tx, &live, &rebuilt).await?;
        if diff.0.is_empty() && diff.1.is_empty() {
            compared.hashes.insert(table.to_string(), rebuilt_hash);
        } else {
            compared.diffs.push(TableDiff {
                table: table.to_string(),
                only_live: diff.0,
                only_rebuilt: diff.1,
            });
        }
    }
    Ok(compared)
}

/// Of the rows of `table`, those the streams in `schema.replay_scope` own (a condition on
/// `t`); `None`: a table whose rows many streams add to.
fn owned_by_scope(table: &str, schema: &str) -> Option<String> {
    let ids = |category: &str| {
        format!(
            "(SELECT substr(stream, {}) FROM {schema}.replay_scope WHERE stream LIKE '{category}-%')",
            category.len() + 2
        )
    };
    let condition = match table {
        "instances" => format!("t.id IN {}", ids("instance")),
        "node_allocations" | "ip_leases" => format!("t.instance_id IN {}", ids("instance")),
        "sandboxes" => format!("t.id IN {}", ids("sandbox")),
        "sandbox_snapshots" => format!("t.sandbox_id IN {}", ids("sandbox")),
        "usage_records" => format!("t.tenant_id IN {}", ids("tenant")),
        _ => return None,
    };
    Some(condition)
}

/// What [`compare_all`] found.
#[derive(Default)]
struct Compared {
    diffs: Vec<TableDiff>,
    skipped: Vec<String>,
    unscoped: Vec<String>,
    hashes: std::collections::BTreeMap<String, String>,
}

/// The query of a hash of the rows of `from` (a [`comparable`] from-item): the row count and
/// the sums of the two halves of each row's md5, so equal rows in any physical order hash
/// alike, with no sort.
fn hash(from: &str) -> String {
    format!(
        "SELECT count(*) || ':' || coalesce(sum(('x' || substr(h, 1, 16))::bit(64)::bigint::numeric), 0)
                || ':' || coalesce(sum(('x' || substr(h, 17, 16))::bit(64)::bigint::numeric), 0)
           FROM (SELECT md5(x::text) AS h FROM (SELECT * FROM {from}) x) hashed"
    )
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
