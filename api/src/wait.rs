//! Waiting for the projections to reach a condition: `wait` on creates is woken by every commit
//! the notifier hears of (this process's, or another replica's via `pg_notify`), a spec
//! long-poll by its node's generation signal; never by a fixed polling interval.
//!
//! Create and claim waits are bounded per replica (`[limits] waits`; past it a call answers at
//! once, as a wait that timed out does) and share their reads: on a commit, one query reads
//! the versions of every row any wait is watching ([`Watched`]), and a wait reads its own row
//! only when that version moved. A thousand waits cost one read per commit, not a thousand.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio::sync::watch;
use vps_commands::{CommandError, Ctx};
use vps_events::Notifier;
use vps_projections::ProjectionError;

use crate::error::ApiError;

/// The longest a missed wake-up can delay an answer.
const RECHECK: Duration = Duration::from_millis(500);

/// Runs `probe` until it reports done or `deadline` passes, and answers its last value.
pub async fn until<T, F, Fut>(
    notifier: &Notifier,
    deadline: Instant,
    probe: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(bool, T), ApiError>>,
{
    woken_by(notifier.subscribe(), RECHECK, deadline, probe).await
}

/// The projection table a wait watches a row of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    /// `instances` (`instances.create`).
    Instances,
    /// `sandboxes` (`sandboxes.create`, a warm claim or a cold create).
    Sandboxes,
}

impl Table {
    /// The versions of the rows among `ids` that exist, as `(id, version)`.
    async fn versions(
        self,
        pool: &PgPool,
        ids: &[String],
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        match self {
            Table::Instances => vps_projections::instances::reads::versions(pool, ids).await,
            Table::Sandboxes => vps_projections::sandboxes::versions(pool, ids).await,
        }
    }
}

/// Every row this replica's waits watch, and the last shared read of their versions.
#[derive(Debug, Default)]
pub struct Watched {
    rows: Mutex<HashMap<(Table, String), usize>>,
    last: tokio::sync::Mutex<Option<Read>>,
}

/// One shared read: the notifier's generation when it began, when, and what it found.
#[derive(Debug, Clone)]
struct Read {
    generation: u64,
    at: Instant,
    versions: Arc<HashMap<(Table, String), i64>>,
}

impl Watched {
    fn watch(self: &Arc<Self>, table: Table, id: &str) -> Watch {
        let key = (table, id.to_string());
        *self
            .rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(key.clone())
            .or_insert(0) += 1;
        Watch {
            watched: self.clone(),
            key,
        }
    }

    /// The version of every watched row, from a read begun after the waiter saw `generation`
    /// (a read at most half a [`RECHECK`] old, when the waiter woke by its timer): the first
    /// waiter to ask reads for all of them; those that ask meanwhile wait for that read.
    async fn versions(
        &self,
        pool: &PgPool,
        notifier: &Notifier,
        generation: u64,
    ) -> Result<Arc<HashMap<(Table, String), i64>>, ApiError> {
        let mut last = self.last.lock().await;
        if let Some(read) = last.as_ref() {
            if read.generation >= generation && read.at.elapsed() < RECHECK / 2 {
                return Ok(read.versions.clone());
            }
        }
        let began = *notifier.subscribe().borrow();
        let at = Instant::now();
        let mut wanted: HashMap<Table, Vec<String>> = HashMap::new();
        for (table, id) in self.rows.lock().unwrap_or_else(|e| e.into_inner()).keys() {
            wanted.entry(*table).or_default().push(id.clone());
        }
        let mut versions = HashMap::new();
        for (table, ids) in wanted {
            let rows = table.versions(pool, &ids).await?;
            versions.extend(rows.into_iter().map(|(id, v)| ((table, id), v)));
        }
        let versions = Arc::new(versions);
        *last = Some(Read {
            generation: began,
            at,
            versions: versions.clone(),
        });
        Ok(versions)
    }
}

/// A row watched for as long as this lives.
struct Watch {
    watched: Arc<Watched>,
    key: (Table, String),
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut rows = self.watched.rows.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = rows.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                rows.remove(&self.key);
            }
        }
    }
}

/// A create's `wait`: answers `created` at once when `settled` holds for it, `wait` is zero or
/// this replica already has `[limits] waits` waiting; otherwise re-reads it (`load` of `id`
/// in `table`) each time its version moves, until `settled` holds or `wait` passes, and answers
/// the last copy read (`created` while `load` finds none).
pub async fn settled<T: Clone>(
    ctx: &Ctx,
    (guards, watched): (&crate::guards::Guards, &Arc<Watched>),
    wait: Duration,
    created: T,
    (table, id): (Table, &str),
    settled: impl Fn(&T) -> bool,
    load: impl AsyncFn(&mut PgConnection, &str) -> Result<Option<T>, ProjectionError>,
) -> Result<T, ApiError> {
    if settled(&created) || wait.is_zero() {
        return Ok(created);
    }
    // Past the cap the call answers as a wait that timed out would.
    let Some(_slot) = guards.wait() else {
        return Ok(created);
    };
    let _watch = watched.watch(table, id);
    let deadline = Instant::now() + wait;
    let mut wake = ctx.notifier.subscribe();
    let mut seen: Option<i64> = None;
    let mut current = created;
    loop {
        let generation = *wake.borrow_and_update();
        let versions = watched
            .versions(&ctx.pool, &ctx.notifier, generation)
            .await?;
        let version = versions.get(&(table, id.to_string())).copied();
        if version.is_some() && version != seen {
            seen = version;
            let mut conn = ctx.pool.acquire().await?;
            if let Some(now) = load(&mut conn, id).await.map_err(CommandError::from)? {
                current = now;
            }
            if settled(&current) {
                return Ok(current);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(current);
        }
        let _ = tokio::time::timeout((deadline - now).min(RECHECK), wake.changed()).await;
    }
}

/// Like [`until`], woken by `wake` (a narrower signal than every commit) and at least every
/// `recheck`, in case a wake-up was lost.
pub async fn woken_by<W, T, F, Fut>(
    mut wake: watch::Receiver<W>,
    recheck: Duration,
    deadline: Instant,
    mut probe: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(bool, T), ApiError>>,
{
    loop {
        wake.borrow_and_update();
        let (done, value) = probe().await?;
        let now = Instant::now();
        if done || now >= deadline {
            return Ok(value);
        }
        let _ = tokio::time::timeout((deadline - now).min(recheck), wake.changed()).await;
    }
}
