//! Named, durable followers of the log.
//!
//! A follower reads the log after its checkpoint in the one agreed order, hands batches to its
//! owner, and moves the checkpoint only when told that a batch is done: stored in the same
//! transaction as the owner's writes ([`save_checkpoint`], then [`Follower::advance`]), or,
//! for a batch that needed no write or whose repeat is harmless, lazily
//! ([`Follower::pass_over`]). Restarting resumes where it stopped.

use std::time::{Duration, Instant};

use sqlx::{PgExecutor, PgPool, Row};
use tokio::sync::watch;

use crate::model::{Cursor, RecordedEvent};
use crate::notify::Notifier;
use crate::read::{head_position, Filter, Page};

pub use crate::notify::POLL_INTERVAL;

/// How long the stored checkpoint may trail events the owner passed over (they needed no write
/// of its own). A restart reads them again, which costs only the reading; storing after every
/// batch would cost a commit per commit of the log, and each of those commits holds back every
/// follower's read horizon while it runs.
const PASSED_STORE_EVERY: Duration = Duration::from_secs(1);

/// How long the log must stay quiet after a pass before the checkpoint of events passed over
/// is stored. Waiting for a whole poll interval instead, a stream of commits as often as the
/// interval (usage windows of half a second) kept the stored checkpoint one batch behind the
/// head for good: every store came on a wake-up, just before the new batch was read, so
/// `vps replay --verify` never found the NodeSpec follower at the head to compare its tables.
const QUIET: Duration = Duration::from_millis(100);

/// How often a follower publishes its lag: the head of the log costs a query.
const LAG_EVERY: Duration = Duration::from_secs(1);

/// A durable reader of the log.
pub struct Follower {
    name: String,
    pool: PgPool,
    cursor: Cursor,
    /// Reads through the process's shared tail of the log, when it has one.
    notifier: Notifier,
    wake: watch::Receiver<u64>,
    pace: Duration,
    last_read: Instant,
    lag_reported: Option<Instant>,
    /// The last read filled its limit: more may be waiting.
    full: bool,
    /// The checkpoint as stored, and when it was stored (or known stored).
    stored: Cursor,
    stored_at: Instant,
}

impl Follower {
    /// Loads (or creates) the checkpoint of the follower called `name`.
    pub async fn load(pool: PgPool, name: &str, notifier: &Notifier) -> Result<Self, sqlx::Error> {
        let cursor = load_checkpoint(&pool, name).await?;
        Ok(Follower {
            name: name.to_string(),
            pool,
            cursor,
            notifier: notifier.clone(),
            wake: notifier.subscribe_readable(),
            pace: Duration::ZERO,
            last_read: Instant::now(),
            lag_reported: None,
            full: false,
            stored: cursor,
            stored_at: Instant::now(),
        })
    }

    /// Reads at most once per `pace` when woken: every commit wakes every follower, and one
    /// that nobody waits on (metering, the chainer, the webhook fan-out) takes the commits of
    /// a busy moment in one read instead of one read each. A read after a quiet spell is not
    /// delayed.
    pub fn paced(mut self, pace: Duration) -> Self {
        self.pace = pace;
        self
    }

    /// Reads the database itself, never the process's shared tail, woken by every commit: for
    /// a follower that must know its read came after a moment it took (metering takes the
    /// log's time horizon and then reads every event recorded before it). The tail's last read
    /// may be older than that moment.
    pub fn reading_alone(mut self) -> Self {
        self.notifier = self.notifier.without_tail();
        self.wake = self.notifier.subscribe_readable();
        self
    }

    /// The follower's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the follower stands: after the last event it was told is done.
    pub fn cursor(&self) -> Cursor {
        self.cursor
    }

    /// The next events after the cursor (empty when caught up). Does not move the cursor.
    pub async fn next_batch(&mut self, limit: i64) -> Result<Vec<RecordedEvent>, sqlx::Error> {
        self.reading();
        let batch = self
            .notifier
            .read_after(&self.pool, self.cursor, limit)
            .await?;
        self.full = batch.len() as i64 >= limit;
        Ok(batch)
    }

    /// Marks wake-ups seen before a read, so one arriving during the read is not lost, and
    /// starts the pace.
    fn reading(&mut self) {
        self.wake.borrow_and_update();
        self.last_read = Instant::now();
    }

    /// Moves the in-memory cursor after the owner's transaction (that called
    /// [`save_checkpoint`]) committed.
    pub fn advance(&mut self, cursor: Cursor) {
        self.cursor = cursor;
        self.stored = cursor;
        self.stored_at = Instant::now();
    }

    /// Moves past events that needed no write of the owner's, or whose effects a repeat does
    /// not harm. The checkpoint is stored once the stored one is [`PASSED_STORE_EVERY`] old,
    /// or when the log falls quiet for [`QUIET`] (see [`Follower::wait`]).
    pub async fn pass_over(&mut self, cursor: Cursor) -> Result<(), sqlx::Error> {
        self.cursor = cursor;
        if self.stored_at.elapsed() >= PASSED_STORE_EVERY {
            self.store().await?;
        }
        Ok(())
    }

    /// Stores the cursor, if the stored checkpoint trails it.
    async fn store(&mut self) -> Result<(), sqlx::Error> {
        if self.stored != self.cursor {
            save_checkpoint(&self.pool, &self.name, self.cursor).await?;
        }
        self.advance(self.cursor);
        Ok(())
    }

    /// After a pass over a batch: waits (as [`Follower::wait`]) unless the batch filled its
    /// limit. A shorter batch held everything readable then, and a commit during the pass has
    /// already marked a wake-up, so reading again at once would mostly find nothing.
    pub async fn wait_unless_full(&mut self) {
        if !self.full {
            self.wait().await;
        }
    }

    /// Waits for a wake-up or the poll interval, whichever comes first, and then for the
    /// rest of the pace since the last read. The checkpoint of events passed over is stored
    /// once the log has been quiet for [`QUIET`] (no wake-up since the pass) or it is
    /// [`PASSED_STORE_EVERY`] old; a failure only waits for the next chance.
    pub async fn wait(&mut self) {
        let trailing = self.stored != self.cursor;
        let first = if trailing { QUIET } else { POLL_INTERVAL };
        let mut woken = tokio::time::timeout(first, self.wake.changed())
            .await
            .is_ok();
        if trailing && !woken {
            self.try_store().await;
            let rest = POLL_INTERVAL.saturating_sub(QUIET);
            woken = tokio::time::timeout(rest, self.wake.changed())
                .await
                .is_ok();
        }
        if !woken || self.stored_at.elapsed() >= PASSED_STORE_EVERY {
            self.try_store().await;
        }
        tokio::time::sleep_until((self.last_read + self.pace).into()).await;
    }

    /// [`Follower::store`], logging a failure: the next chance stores it.
    async fn try_store(&mut self) {
        if let Err(e) = self.store().await {
            tracing::debug!(follower = %self.name, error = %e, "cannot store the checkpoint; later");
        }
    }

    /// Like [`Follower::next_batch`], keeping only the events that pass `filter`: a follower
    /// that needs few of the log's events does not fetch the rest. The page's `next` is past
    /// the events it skipped; advance to it once the page is done.
    pub async fn next_page(&mut self, filter: &Filter, limit: i64) -> Result<Page, sqlx::Error> {
        self.reading();
        self.notifier
            .read_page(&self.pool, self.cursor, filter, limit)
            .await
    }

    /// Publishes how far behind the head of the log this follower is, in events (at most once
    /// a second).
    pub async fn report_lag(&mut self) -> Result<(), sqlx::Error> {
        if self.lag_reported.is_some_and(|at| at.elapsed() < LAG_EVERY) {
            return Ok(());
        }
        self.lag_reported = Some(Instant::now());
        let head = head_position(&self.pool).await?;
        let lag = (head - self.cursor.position).max(0);
        metrics::gauge!("vps_follower_lag_events", "follower" => self.name.clone()).set(lag as f64);
        Ok(())
    }
}

/// Reads a follower's checkpoint, creating it at the start of the log.
pub async fn load_checkpoint(pool: &PgPool, name: &str) -> Result<Cursor, sqlx::Error> {
    let row = sqlx::query(
        "INSERT INTO follower_checkpoints (name) VALUES ($1)
         ON CONFLICT (name) DO UPDATE SET name = excluded.name
         RETURNING transaction_id::text, position",
    )
    .bind(name)
    .fetch_one(pool)
    .await?;
    let txid: String = row.try_get(0)?;
    Ok(Cursor {
        transaction_id: txid.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
        position: row.try_get(1)?,
    })
}

/// Stores a follower's checkpoint.
pub async fn save_checkpoint<'e>(
    db: impl PgExecutor<'e>,
    name: &str,
    cursor: Cursor,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO follower_checkpoints (name, transaction_id, position, updated_at)
         VALUES ($1, $2::text::xid8, $3, now())
         ON CONFLICT (name) DO UPDATE
            SET transaction_id = excluded.transaction_id, position = excluded.position,
                updated_at = now()",
    )
    .bind(name)
    .bind(cursor.transaction_id.to_string())
    .bind(cursor.position)
    .execute(db)
    .await?;
    Ok(())
}
