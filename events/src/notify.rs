//! Wake-ups for followers. A wake-up is only a hint: followers also poll, so a lost wake-up
//! costs latency, never an event.
//!
//! Appenders in this process bump a local counter at once; other processes learn through
//! `pg_notify` on one channel. The notify is sent by a background task, coalesced, and outside
//! the writers' transactions: a NOTIFY inside a transaction takes a global lock at commit and
//! would serialise every writer. Other hints for other replicas (a spec's generation, a work
//! queue's kind) go through the same task ([`Notifier::hint`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{watch, Notify};

use crate::model::{Cursor, RecordedEvent};
use crate::read::{read_after, read_page, Filter, Page};
use crate::tail::{counted, Tail};

/// How long a follower (or the tail) waits for a wake-up before it polls anyway.
pub const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// The PostgreSQL channel the log's wake-ups travel on.
pub const CHANNEL: &str = "vps_events";

/// Parts to send, by channel.
type Hints = BTreeMap<&'static str, BTreeSet<String>>;

/// Shared by every appender and follower of one process.
#[derive(Clone)]
pub struct Notifier {
    local: Arc<watch::Sender<u64>>,
    pending: Arc<AtomicBool>,
    /// Hints for other processes by channel, sent with the next notify ([`Notifier::hint`]);
    /// `None` where nothing sends them (a notifier that reaches only this process).
    hints: Option<Arc<Mutex<Hints>>>,
    kick: Arc<Notify>,
    /// The process's shared read of the newest events, if it keeps one.
    tail: Option<Tail>,
}

impl Notifier {
    /// Starts the notify sender and the listener for other processes' appends.
    pub fn start(pool: PgPool) -> Notifier {
        let notifier = Notifier {
            hints: Some(Arc::default()),
            ..Notifier::local_only()
        };
        tokio::spawn(send_notifies(pool.clone(), notifier.clone()));
        tokio::spawn(listen(pool, notifier.clone()));
        notifier
    }

    /// A notifier that reaches only this process (tests, tools).
    pub fn local_only() -> Notifier {
        let (tx, _) = watch::channel(0);
        Notifier {
            local: Arc::new(tx),
            pending: Arc::new(AtomicBool::new(false)),
            hints: None,
            kick: Arc::new(Notify::new()),
            tail: None,
        }
    }

    /// Call after a transaction that appended has committed.
    pub fn committed(&self) {
        self.bump();
        self.pending.store(true, Ordering::Release);
        self.kick.notify_one();
    }

    /// Tells other processes `part` on `channel`, with the next notify: within
    /// [`NOTIFY_GAP`] the parts of a channel are deduplicated and joined with commas into as
    /// few payloads as fit, so a listener must split its payload on `,`. Sent one at a time,
    /// these hints were two notifies per create, each waking every listening session.
    pub fn hint(&self, channel: &'static str, part: &str) {
        let Some(hints) = &self.hints else { return };
        hints
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(channel)
            .or_default()
            .insert(part.to_string());
        self.kick.notify_one();
    }

    /// A receiver that sees every wake-up after it was made.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.local.subscribe()
    }

    /// Starts a shared tail of the log that this notifier's followers read from: a process
    /// with several followers reads the newest events once instead of once per follower.
    pub fn with_tail(mut self, pool: PgPool) -> Notifier {
        self.tail = Some(Tail::spawn(pool, self.subscribe(), POLL_INTERVAL));
        self
    }

    /// This notifier without its tail: its readers read the database themselves and are woken
    /// by every commit.
    pub fn without_tail(&self) -> Notifier {
        Notifier {
            tail: None,
            ..self.clone()
        }
    }

    /// The process's shared tail of the log, if it keeps one.
    pub fn tail(&self) -> Option<&Tail> {
        self.tail.as_ref()
    }

    /// A receiver woken when new events are readable: by the tail once it holds them, or by
    /// every commit when there is no tail.
    pub fn subscribe_readable(&self) -> watch::Receiver<u64> {
        match &self.tail {
            Some(tail) => tail.subscribe(),
            None => self.subscribe(),
        }
    }

    /// [`read_after`], from the tail when it covers `after`.
    pub async fn read_after(
        &self,
        pool: &PgPool,
        after: Cursor,
        limit: i64,
    ) -> Result<Vec<RecordedEvent>, sqlx::Error> {
        if let Some(events) = self.tail.as_ref().and_then(|t| t.after(after, limit)) {
            counted("tail");
            return Ok(events);
        }
        counted("database");
        read_after(pool, after, limit).await
    }

    /// [`read_page`], from the tail when it covers `after`.
    pub async fn read_page(
        &self,
        pool: &PgPool,
        after: Cursor,
        filter: &Filter,
        limit: i64,
    ) -> Result<Page, sqlx::Error> {
        if let Some(page) = self
            .tail
            .as_ref()
            .and_then(|t| t.page(after, filter, limit))
        {
            counted("tail");
            return Ok(page);
        }
        counted("database");
        read_page(pool, after, filter, limit).await
    }

    fn bump(&self) {
        self.local.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// The shortest gap between two notifies: under load, many commits share one, and other
/// replicas' followers learn of them at most this much later (this process's at once).
pub const NOTIFY_GAP: Duration = Duration::from_millis(10);

/// A notification's payload stays under PostgreSQL's 8000-byte limit.
pub const MAX_PAYLOAD: usize = 7000;

async fn send_notifies(pool: PgPool, notifier: Notifier) {
    loop {
        notifier.kick.notified().await;
        tokio::time::sleep(NOTIFY_GAP).await;
        if notifier.pending.swap(false, Ordering::AcqRel) {
            send(&pool, CHANNEL, "").await;
        }
        let hints = notifier
            .hints
            .as_ref()
            .map(|h| std::mem::take(&mut *h.lock().unwrap_or_else(|e| e.into_inner())));
        for (channel, parts) in hints.into_iter().flatten() {
            for payload in payloads(parts) {
                send(&pool, channel, &payload).await;
            }
        }
    }
}

/// `parts` joined with commas into payloads of at most [`MAX_PAYLOAD`] bytes (a longer part
/// goes alone).
pub fn payloads(parts: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for part in parts {
        if !current.is_empty() && current.len() + 1 + part.len() > MAX_PAYLOAD {
            out.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(',');
        }
        current.push_str(&part);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// Sends `payload` on `channel`, outside any transaction. A failure is only logged: every
/// listener also polls, so a lost notification costs latency, never an event.
pub async fn send(pool: &PgPool, channel: &str, payload: &str) {
    if let Err(e) = sqlx::query("SELECT pg_notify($1, $2)")
        .bind(channel)
        .bind(payload)
        .execute(pool)
        .await
    {
        tracing::debug!(error = %e, channel, "pg_notify failed; listeners will poll");
    }
}

async fn listen(pool: PgPool, notifier: Notifier) {
    listen_to(pool, CHANNEL, |_| notifier.bump()).await
}

/// Hands every notification's payload on `channel` to `on`, for as long as the task lives;
/// a lost connection is made again a second later (what was sent meanwhile is lost, so
/// listeners must also poll).
pub async fn listen_to(pool: PgPool, channel: &str, mut on: impl FnMut(&str)) {
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => {
                if listener.listen(channel).await.is_ok() {
                    while let Ok(notification) = listener.recv().await {
                        on(notification.payload());
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, channel, "cannot listen; polling"),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
