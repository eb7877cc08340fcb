//! One shared read of the log's newest events per process.
//!
//! Every commit wakes every follower, and each used to read the log on its own: six reads of
//! the same few events per commit, each with its own horizon check, on the cores that also run
//! the appends. The tail reads once per wake-up, keeps the newest events in memory, and hands
//! each follower at its head the events after its cursor from there.
//!
//! What it holds is always a run of the log without gaps in the read order, below the horizon
//! of its last read: exactly what a follower's own read would have returned then. A follower
//! behind that run (a restart, a long pass) or ahead of it (it read the database since) reads
//! the database as before, and so does every follower while the tail has not read for a while
//! (its reads fail): the tail saves reads, and never decides what a follower sees.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::watch;

use crate::model::{Cursor, RecordedEvent};
use crate::read::{read_page, Filter, Page};

/// The newest events kept. A follower further behind reads the database.
const KEPT: usize = 1024;

/// Events read at once.
const READ: i64 = 1000;

/// After this long without a read, followers stop trusting the tail and read the database.
const STALE: Duration = Duration::from_secs(2);

/// The shared tail: cheap to clone.
#[derive(Clone)]
pub struct Tail {
    run: Arc<Mutex<Run>>,
    moved: watch::Sender<u64>,
}

/// The events held, and the stretch of the read order they cover.
struct Run {
    /// Every event after `from` up to `to` is in `events`, in read order.
    from: Cursor,
    to: Cursor,
    events: VecDeque<RecordedEvent>,
    /// The last read that succeeded (`None` before the first).
    read_at: Option<Instant>,
}

impl Run {
    /// Whether the tail read recently enough to be trusted.
    fn fresh(&self) -> bool {
        self.read_at.is_some_and(|at| at.elapsed() < STALE)
    }
}

impl Tail {
    /// Starts reading the log from its current horizon on, woken by `wake` and at least every
    /// `poll` (wake-ups are hints).
    pub(crate) fn spawn(pool: PgPool, wake: watch::Receiver<u64>, poll: Duration) -> Tail {
        let (moved, _) = watch::channel(0);
        let tail = Tail {
            run: Arc::new(Mutex::new(Run {
                from: Cursor::START,
                to: Cursor::START,
                events: VecDeque::new(),
                read_at: None,
            })),
            moved,
        };
        tokio::spawn(tail.clone().follow(pool, wake, poll));
        tail
    }

    /// Woken each time the tail holds new events.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.moved.subscribe()
    }

    /// Where the run of events held begins, once the tail has read (`None` before, or while
    /// its reads fail).
    pub fn start(&self) -> Option<Cursor> {
        let run = self.run.lock().unwrap_or_else(|e| e.into_inner());
        run.fresh().then_some(run.from)
    }

    /// Up to `limit` events after `after`, if the tail covers `after`; `None` says read the
    /// database.
    pub fn after(&self, after: Cursor, limit: i64) -> Option<Vec<RecordedEvent>> {
        self.page(after, &Filter::default(), limit)
            .map(|page| page.events)
    }

    /// Like [`read_page`], from memory, if the tail covers `after`; `None` says read the
    /// database.
    pub fn page(&self, after: Cursor, filter: &Filter, limit: i64) -> Option<Page> {
        let run = self.run.lock().unwrap_or_else(|e| e.into_inner());
        if filter.whole_snapshot || !run.fresh() || after < run.from || after > run.to {
            return None;
        }
        let first = run.events.partition_point(|e| e.cursor() <= after);
        let limit = usize::try_from(limit).unwrap_or(0);
        let events: Vec<RecordedEvent> = run
            .events
            .range(first..)
            .filter(|e| filter.admits(e))
            .take(limit)
            .cloned()
            .collect();
        let next = match events.last() {
            Some(last) if events.len() >= limit => last.cursor(),
            _ => run.to,
        };
        Some(Page { events, next })
    }

    /// Reads on every wake-up and at least every `poll`, from the horizon at its start:
    /// followers behind it read the database anyway.
    async fn follow(self, pool: PgPool, mut wake: watch::Receiver<u64>, poll: Duration) {
        loop {
            match read_page(&pool, Cursor::START, &Filter::default(), 0).await {
                Ok(page) => {
                    let mut run = self.run.lock().unwrap_or_else(|e| e.into_inner());
                    (run.from, run.to) = (page.next, page.next);
                    break;
                }
                Err(e) => tracing::debug!(error = %e, "the log's tail cannot start; later"),
            }
            tokio::time::sleep(poll).await;
        }
        loop {
            wake.borrow_and_update();
            if let Err(e) = self.read(&pool).await {
                tracing::debug!(error = %e, "the log's tail cannot read; followers read alone");
            }
            let woken = tokio::time::timeout(poll, wake.changed()).await;
            if let Ok(Err(_)) = woken {
                return; // the notifier is gone, and with it every follower that read here
            }
        }
    }

    /// Reads everything readable after the run, page by page, waking the followers after each
    /// page that held events (they start on it while the next is read).
    async fn read(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        loop {
            let to = self.run.lock().unwrap_or_else(|e| e.into_inner()).to;
            counted("shared");
            let page = read_page(pool, to, &Filter::default(), READ).await?;
            let (found, full) = (!page.events.is_empty(), page.events.len() as i64 >= READ);
            self.extend(page);
            if found {
                self.moved.send_modify(|n| *n = n.wrapping_add(1));
            }
            if !full {
                return Ok(());
            }
        }
    }

    /// Adds a page read after the run's end, dropping the oldest events beyond [`KEPT`].
    fn extend(&self, page: Page) {
        let mut run = self.run.lock().unwrap_or_else(|e| e.into_inner());
        run.events.extend(page.events);
        run.to = page.next;
        while run.events.len() > KEPT {
            if let Some(dropped) = run.events.pop_front() {
                run.from = dropped.cursor();
            }
        }
        run.read_at = Some(Instant::now());
    }
}

/// Counts a read of the log by where it was served from: `tail` (memory), `database` (the
/// reader's own read), or `shared` (the tail's read for every follower).
pub(crate) fn counted(source: &'static str) {
    metrics::counter!("vps_log_reads_total", "source" => source).increment(1);
}
