//! The metering reactor (SPEC §3.9): a follower of the log that folds instance and volume
//! events into the [`Ledger`] and, once a window has closed *and* every event recorded before
//! its end is readable, appends one `usage.recorded` per (meter, resource, window piece).
//!
//! - **Once across replicas**: the lease [`LEASE`] makes one replica the metering worker.
//! - **Never twice**: a record's event id derives from (meter, resource, window start); ids
//!   already in the log are skipped and an append of a stored id is a no-op, so a second
//!   worker, a restart or a replay cannot record a window twice.
//! - **Never missed**: a transaction can commit long after it started, and an event's
//!   `recorded_at` is its transaction's start. A window is settled only below
//!   [`vps_events::read::time_horizon`], taken before a read that reached the log's horizon,
//!   so no event recorded inside it can still appear.
//! - **Crash-safe**: a batch's records commit to the log first; then their projections, the
//!   ledger's changed resources, the settled mark and the follower's checkpoint commit in a
//!   second transaction. After a crash the worker resumes from the last settled mark and
//!   computes the same records again, and the append and the projection each skip what they
//!   already hold.
//!
//! [`verify`] recomputes the records from the log alone and compares them (`vps usage verify`).

pub mod verify;

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::{PgConnection, PgPool, Row};
use tracing::Instrument;
use vps_domain::usage::record::EVENT_TYPE;
use vps_domain::usage::window::{at, micros};
use vps_domain::usage::{InstanceMeter, Ledger, Micros, UsageRecord, Windows};
use vps_events::lease::Lease;
use vps_events::read::Filter;
use vps_events::{AppendError, Follower, Metadata, NewEvent, Notifier};
use vps_events::{Cursor, RecordedEvent};
use vps_projections::ProjectionError;

/// The lease that makes metering single across replicas.
pub const LEASE: &str = "usage-metering";
/// The follower (checkpoint) name, also the `usage_progress` row.
pub const FOLLOWER: &str = "usage";
/// Who the records say appended them.
pub const ACTOR: &str = "reactor:usage";

/// Events read per pass.
const BATCH: i64 = 5000;
/// Records settled per pass, at most (a window is never split across passes).
const RECORDS_PER_PASS: usize = 20_000;
/// Records per append and per projecting statement.
const CHUNK: usize = 2000;
/// The least time between two reads of the log when woken.
const PACE: Duration = Duration::from_millis(250);

/// Why a metering pass stopped; the supervisor restarts the reactor from the database.
#[derive(Debug, thiserror::Error)]
pub enum MeteringError {
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// The log refused an append.
    #[error(transparent)]
    Append(#[from] AppendError),
    /// A projector failed.
    #[error(transparent)]
    Projection(#[from] ProjectionError),
    /// A stored ledger entry cannot be read.
    #[error("usage_meters holds a malformed entry: {0}")]
    State(#[from] serde_json::Error),
}

/// Meters the log for as long as the task lives: waits for the lease, then catches up and
/// waits for the log to move.
pub async fn run(pool: PgPool, notifier: Notifier, windows: Windows) -> Result<(), MeteringError> {
    let _lease = Lease::acquire(&pool, LEASE, Duration::from_secs(2)).await;
    tracing::info!(
        window_micros = windows.length(),
        "usage metering holds its lease"
    );
    let mut metering = Metering::load(pool, &notifier, windows).await?;
    loop {
        metering.catch_up().await?;
        metering.follower.wait().await;
    }
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pass {
    /// Events read and folded.
    pub events: usize,
    /// Records appended (`None`: nothing was settled).
    pub records: Option<usize>,
}

/// The worker's state: its follower, its ledger and how far windows are settled.
pub struct Metering {
    pool: PgPool,
    notifier: Notifier,
    follower: Follower,
    ledger: Ledger,
    settled_until: Option<Micros>,
}

impl Metering {
    /// Loads the checkpoint, the ledger and the settled mark.
    pub async fn load(
        pool: PgPool,
        notifier: &Notifier,
        windows: Windows,
    ) -> Result<Metering, MeteringError> {
        // Windows close every few minutes: reading on every commit would only burn the CPU
        // the commands need. Its reads must come after the time horizon it takes, so never
        // from the shared tail, whose last read may be older.
        let follower = Follower::load(pool.clone(), FOLLOWER, notifier)
            .await?
            .paced(PACE)
            .reading_alone();
        let rows = sqlx::query("SELECT resource_id, state FROM usage_meters")
            .fetch_all(&pool)
            .await?;
        let mut kept = Vec::with_capacity(rows.len());
        for row in rows {
            let state: serde_json::Value = row.try_get(1)?;
            kept.push((
                row.try_get(0)?,
                serde_json::from_value::<InstanceMeter>(state)?,
            ));
        }
        let progress: Option<(chrono::DateTime<chrono::Utc>, i64)> = sqlx::query_as(
            "SELECT settled_until, window_micros FROM usage_progress WHERE name = $1",
        )
        .bind(FOLLOWER)
        .fetch_optional(&pool)
        .await?;
        if let Some((_, length)) = progress.filter(|(_, l)| *l != windows.length()) {
            tracing::warn!(
                recorded = length,
                configured = windows.length(),
                "[timings] usage_window changed: windows after the settled mark use the new length"
            );
        }
        Ok(Metering {
            pool,
            notifier: notifier.clone(),
            follower,
            ledger: Ledger::restore(windows, kept),
            settled_until: progress.map(|(t, _)| micros(t)),
        })
    }

    /// Reads one batch, settles what may be settled, and commits both.
    pub async fn pass(&mut self) -> Result<Pass, MeteringError> {
        let Some(batch) = self.prepare().await? else {
            return Ok(Pass::default());
        };
        let appended = batch.log(&self.pool, &self.notifier).await?;
        let cursor = batch.cursor;
        let pass = batch.views(&self.pool, appended).await?;
        if let Some(cursor) = cursor {
            self.follower.advance(cursor);
        }
        Ok(pass)
    }

    /// Passes while work waits: it stops after a pass that read a short page and settled up
    /// to the horizon, so a steady stream of events costs a pass per paced wake-up, not one
    /// per event (each pass commits). Answers how many passes committed. A pass's records go
    /// to the log in one transaction and to the views (with the ledger, the settled mark and
    /// the checkpoint) in a second one, which commits after the first. The two stages run as
    /// a pipeline on two connections (so on two of the database's cores): while one batch is
    /// appended, the one before it is projected and the one after it is read and settled.
    /// Appends stay one at a time, in order, since they share a tenant's stream.
    ///
    /// A crash between a batch's two commits leaves the settled mark before it, so the worker
    /// computes the same records again: the append skips the ids the log holds and the
    /// projection those it holds, and no projected record is ever missing from the log. The
    /// next read starts past the page being committed; if a commit fails, the error ends the
    /// worker, which restarts from what the database holds.
    pub async fn catch_up(&mut self) -> Result<usize, MeteringError> {
        let (pool, notifier) = (self.pool.clone(), self.notifier.clone());
        let mut passes = 0;
        let mut logged: Option<(Batch, usize)> = None;
        let mut next = self.prepare().await?;
        while next.is_some() || logged.is_some() {
            let current = next.take();
            if let Some(cursor) = current.as_ref().and_then(|b| b.cursor) {
                self.follower.advance(cursor);
            }
            let (appended, projected, prepared) = tokio::join!(
                async {
                    match &current {
                        Some(batch) => batch.log(&pool, &notifier).await.map(Some),
                        None => Ok(None),
                    }
                },
                async {
                    match logged.take() {
                        Some((batch, appended)) => batch.views(&pool, appended).await.map(Some),
                        None => Ok(None),
                    }
                },
                async {
                    match &current {
                        Some(batch) if batch.more => self.prepare().await,
                        _ => Ok(None),
                    }
                }
            );
            passes += usize::from(projected?.is_some());
            logged = current.zip(appended?);
            next = prepared?;
        }
        Ok(passes)
    }

    /// Reads one batch, folds it and settles what may be settled: the pass's work, ready to
    /// commit (`None`: nothing to do).
    async fn prepare(&mut self) -> Result<Option<Batch>, MeteringError> {
        // Taken before the read: if the read reaches the horizon, it holds every event
        // recorded before this time.
        let horizon = vps_events::read::time_horizon(&self.pool).await?;
        let page = self.follower.next_page(&metered(), BATCH).await?;
        for event in &page.events {
            self.fold(event);
        }
        let settled = if (page.events.len() as i64) < BATCH {
            self.settle(micros(horizon))
        } else {
            None
        };
        // Past the events the filter skipped (the records themselves, mostly), even when the
        // page holds none.
        let cursor = (page.next != self.follower.cursor()).then_some(page.next);
        if page.events.is_empty() && settled.is_none() && cursor.is_none() {
            return Ok(None);
        }
        if let Some(until) = self.settled_until {
            let lag = micros(horizon).saturating_sub(until) as f64 / 1e6;
            metrics::gauge!("vps_usage_settled_lag_seconds").set(lag);
        }
        let target = self.ledger.windows().start_of(micros(horizon));
        Ok(Some(Batch {
            more: page.events.len() as i64 >= BATCH
                || self.settled_until.is_some_and(|until| until < target),
            events: page.events.len(),
            cursor,
            settled: settled.is_some(),
            records: Records::new(settled.unwrap_or_default()),
            dirty: self.ledger.take_dirty(),
            settled_until: self.settled_until,
            windows: self.ledger.windows(),
        }))
    }

    fn fold(&mut self, event: &RecordedEvent) {
        let settled = self.settled_until.map(at);
        // Below the horizon nothing recorded before a settled window can arrive; if it ever
        // did, it is applied at the settled mark (never rewriting a recorded window) and
        // counted, and `vps usage verify` names the difference.
        let recorded_at = match settled {
            Some(s) if event.recorded_at < s => {
                metrics::counter!("vps_usage_late_events_total").increment(1);
                tracing::warn!(event = %event.id, "event recorded before the settled usage mark");
                s
            }
            _ => event.recorded_at,
        };
        self.ledger
            .apply(&event.stream, &event.event_type, &event.data, recorded_at);
    }

    /// Settles whole windows up to the one holding `horizon`, at most [`RECORDS_PER_PASS`]
    /// records' worth; `None` when the mark did not move.
    fn settle(&mut self, horizon: Micros) -> Option<Vec<UsageRecord>> {
        let windows = self.ledger.windows();
        let target = windows.start_of(horizon);
        // The mark first: the earliest start is a walk over every meter, and a pass with the
        // mark at the horizon (most of them) needs neither.
        if self.settled_until.is_some_and(|s| s >= target) {
            return None;
        }
        let earliest = self.ledger.earliest_start();
        let from = match (self.settled_until, earliest) {
            (Some(s), _) => s,
            (None, Some(first)) => windows.start_of(first).min(target),
            (None, None) => target,
        };
        let mut records = Vec::new();
        let mut until = from;
        if earliest.is_none() {
            until = target; // nothing accrues: no window holds a record
        }
        while until < target && records.len() < RECORDS_PER_PASS {
            let next = (until + windows.length()).min(target);
            records.extend(self.ledger.settle(until, next));
            until = next;
        }
        self.settled_until = Some(until);
        Some(records)
    }
}

/// A pass's work: what it read and settled, waiting to be committed.
struct Batch {
    /// The page was full or the settling stopped short of the horizon: more work waits.
    more: bool,
    events: usize,
    /// Where the follower reads on from once this commits.
    cursor: Option<Cursor>,
    /// Whether the settled mark moved.
    settled: bool,
    records: Records,
    /// The ledger's changed resources.
    dirty: Vec<(String, Option<InstanceMeter>)>,
    settled_until: Option<Micros>,
    windows: Windows,
}

/// Settled records with their event ids, grouped by stream. A window's records can be tens of
/// thousands (one per meter and instance), so the events that record them are built a chunk
/// at a time as they are appended, and the views take them a chunk at a time too: a window
/// boundary costs the server a chunk's worth of memory, not the window's.
struct Records {
    records: Vec<UsageRecord>,
    ids: Vec<String>,
    /// Indexes into `records`, by the stream each is appended to.
    by_stream: BTreeMap<String, Vec<usize>>,
}

impl Records {
    fn new(records: Vec<UsageRecord>) -> Records {
        let ids: Vec<String> = records.iter().map(UsageRecord::event_id).collect();
        let mut by_stream: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (n, record) in records.iter().enumerate() {
            by_stream.entry(record.stream()).or_default().push(n);
        }
        Records {
            records,
            ids,
            by_stream,
        }
    }

    /// The `usage.recorded` event of record `n`.
    fn event(&self, n: usize) -> NewEvent {
        let record = &self.records[n];
        NewEvent {
            id: self.ids[n].clone(),
            event_type: EVENT_TYPE.to_string(),
            data: record.data(),
            metadata: Metadata {
                tenant_id: Some(record.tenant_id.clone()),
                actor: Some(ACTOR.to_string()),
                ..Metadata::default()
            },
        }
    }

    /// Appends the records the log does not hold yet, one stream per tenant; answers how many
    /// it appended.
    async fn append(&self, conn: &mut PgConnection) -> Result<usize, MeteringError> {
        let mut appended = 0;
        for (stream, indexes) in &self.by_stream {
            for chunk in indexes.chunks(CHUNK) {
                let events: Vec<NewEvent> = chunk.iter().map(|&n| self.event(n)).collect();
                appended += vps_events::append_unseen(conn, stream, &events).await?;
            }
        }
        Ok(appended)
    }

    /// Projects the records the views do not hold yet.
    async fn project(&self, conn: &mut PgConnection) -> Result<(), ProjectionError> {
        for (ids, records) in self.ids.chunks(CHUNK).zip(self.records.chunks(CHUNK)) {
            let projected: Vec<(String, &UsageRecord)> = ids.iter().cloned().zip(records).collect();
            vps_projections::usage::apply_records(conn, &projected).await?;
        }
        // A chunk's bound arrays run to hundreds of kilobytes, and a connection keeps its
        // write buffer at the largest message it sent: give that back to the pool's memory.
        sqlx::Connection::shrink_buffers(conn);
        Ok(())
    }
}

impl Batch {
    /// Appends the records the log does not hold yet, in a transaction of its own; answers
    /// how many it appended.
    async fn log(&self, pool: &PgPool, notifier: &Notifier) -> Result<usize, MeteringError> {
        if self.records.records.is_empty() {
            return Ok(0); // a pass that only moves past the log's other events
        }
        let span = tracing::info_span!("usage_append", records = self.records.records.len());
        let appended = async {
            let mut tx = pool.begin().await?;
            let appended = self.records.append(&mut tx).await?;
            tx.commit().await?;
            Ok::<_, MeteringError>(appended)
        }
        .instrument(span)
        .await?;
        if appended > 0 {
            notifier.committed();
        }
        metrics::counter!("vps_usage_records_total").increment(appended as u64);
        Ok(appended)
    }

    /// Once the log holds the records: projects them and saves the ledger's changes, the
    /// settled mark and the checkpoint, in one transaction.
    async fn views(self, pool: &PgPool, appended: usize) -> Result<Pass, MeteringError> {
        let span = tracing::info_span!("usage_pass", events = self.events, records = appended);
        async {
            let mut tx = pool.begin().await?;
            self.records.project(&mut tx).await?;
            save_ledger(&mut tx, self.dirty).await?;
            if let Some(until) = self.settled_until {
                save_progress(&mut tx, until, self.windows).await?;
            }
            if let Some(cursor) = self.cursor {
                vps_events::follower::save_checkpoint(&mut *tx, FOLLOWER, cursor).await?;
            }
            tx.commit().await?;
            Ok(Pass {
                events: self.events,
                records: self.settled.then_some(appended),
            })
        }
        .instrument(span)
        .await
    }
}

/// The events that move a meter: instances', sandbox volumes' and snapshots'. The rest of the
/// log (the records this reactor appends among it) is skipped by the read.
fn metered() -> Filter {
    Filter {
        types: vec![
            "instance.*".into(),
            "sandbox.volume.*".into(),
            "sandbox.snapshot.*".into(),
        ],
        ..Filter::default()
    }
}

async fn save_ledger(
    conn: &mut PgConnection,
    changed: Vec<(String, Option<InstanceMeter>)>,
) -> Result<(), MeteringError> {
    let (kept, gone): (Vec<_>, Vec<_>) = changed.into_iter().partition(|(_, m)| m.is_some());
    let gone: Vec<String> = gone.into_iter().map(|(id, _)| id).collect();
    sqlx::query("DELETE FROM usage_meters WHERE resource_id = ANY($1)")
        .bind(&gone)
        .execute(&mut *conn)
        .await?;
    let ids: Vec<&str> = kept.iter().map(|(id, _)| id.as_str()).collect();
    let states = kept
        .iter()
        .map(|(_, m)| serde_json::to_value(m))
        .collect::<Result<Vec<_>, _>>()?;
    sqlx::query(
        "INSERT INTO usage_meters (resource_id, state)
         SELECT * FROM unnest($1::text[], $2::jsonb[])
         ON CONFLICT (resource_id) DO UPDATE SET state = excluded.state",
    )
    .bind(&ids)
    .bind(&states)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn save_progress(
    conn: &mut PgConnection,
    until: Micros,
    windows: Windows,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO usage_progress (name, settled_until, window_micros) VALUES ($1, $2, $3)
         ON CONFLICT (name) DO UPDATE
            SET settled_until = excluded.settled_until, window_micros = excluded.window_micros",
    )
    .bind(FOLLOWER)
    .bind(at(until))
    .bind(windows.length())
    .execute(conn)
    .await?;
    Ok(())
}
