//! The NATS publisher (SPEC §4.3): follows the log from the durable checkpoint `nats` and
//! publishes every event's CloudEvent to JetStream on subject `<prefix>.<type>`, with
//! `Nats-Msg-Id` = the event id.
//!
//! Guarantees:
//! - **Nothing lost**: the checkpoint moves only past events JetStream acknowledged, so events
//!   appended while NATS (or this process) is down are sent when both are back.
//! - **Log order**: publishes are pipelined on the one connection, which keeps their order, and
//!   their acks awaited in log order; a batch stops at the first failure, and the retry starts
//!   at the first event not acknowledged.
//! - **No duplicates downstream**: a re-send (after a lost ack, or after a restart: the
//!   checkpoint is stored lazily, at most a second behind) carries the same `Nats-Msg-Id`,
//!   which JetStream drops within the stream's duplicate window (an hour).
//! - **Single publisher**: the lease `publisher:nats` keeps other replicas waiting.
//!
//! The stream captures every subject this publisher sends to. With a prefix that is one
//! wildcard (`vps.>`); without one, each event type's first token gets its own `<token>.>`
//! (the public catalog's `instance.>`, `sandbox.>`, `usage.>` from the start, others added to
//! the stream the first time such a type is published). A stream over `>` would also capture
//! replies and JetStream's own API subjects.

use std::collections::BTreeSet;
use std::time::Duration;

use async_nats::jetstream::{self, message::PublishMessage, stream};
use rand::Rng;
use sqlx::PgPool;
use tracing::Instrument;
use vps_domain::network::redact_credentials;
use vps_events::envelope::cloud_event;
use vps_events::lease::Lease;
use vps_events::{Follower, Notifier, RecordedEvent};

/// The lease that makes the publisher single across replicas.
pub const LEASE: &str = "publisher:nats";
/// The follower (checkpoint) name.
pub const FOLLOWER: &str = "nats";
/// The type prefixes the stream captures before any such event was published, so subscribers
/// can bind consumers to the public catalog at once.
pub const CATALOG_PREFIXES: &[&str] = &["instance", "sandbox", "usage"];

/// Events read from the log per pass.
const BATCH: i64 = 256;
/// How often a replica that does not hold the lease tries to take it.
const LEASE_RETRY: Duration = Duration::from_secs(1);
/// The first back-off after a failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);

/// Where and how to publish.
#[derive(Debug, Clone)]
pub struct NatsPublisherConfig {
    /// `nats://host:port`.
    pub url: String,
    /// Prepended to every subject: `""` publishes `instance.created`, `"vps"` (or `"vps."`)
    /// publishes `vps.instance.created`.
    pub subject_prefix: String,
    /// The JetStream stream that captures the subjects (created or extended as needed).
    pub stream_name: String,
    /// The stream's de-duplication window, used when the publisher creates the stream. A re-send
    /// later than this after the first send is stored twice, so it should exceed the longest
    /// database outage that can separate an ack from its checkpoint.
    pub duplicate_window: Duration,
    /// The longest wait between retries while NATS or the database is failing.
    pub max_backoff: Duration,
}

impl Default for NatsPublisherConfig {
    fn default() -> Self {
        NatsPublisherConfig {
            url: "nats://127.0.0.1:4222".into(),
            subject_prefix: String::new(),
            stream_name: "VPS_EVENTS".into(),
            duplicate_window: Duration::from_secs(3600),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// Why a publishing pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum NatsPublishError {
    /// The connection to NATS could not be opened.
    #[error("cannot connect to NATS at {url}: {source}")]
    Connect {
        /// The configured URL.
        url: String,
        /// What the client said.
        source: async_nats::ConnectError,
    },
    /// The JetStream stream could not be created or extended to a subject.
    #[error("cannot create or update JetStream stream {stream}: {message}")]
    Stream {
        /// The stream's name.
        stream: String,
        /// What the server said.
        message: String,
    },
    /// JetStream did not acknowledge a publish (timeout, no stream, connection lost).
    #[error("JetStream did not acknowledge event {event_id}: {source}")]
    Publish {
        /// The event being published.
        event_id: String,
        /// What the client said.
        source: jetstream::context::PublishError,
    },
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Publishes the log to JetStream forever. Spawn it once per process; replicas wait on the
/// lease. Failures are logged and retried with back-off, never returned.
pub async fn run_publisher(pool: PgPool, notifier: Notifier, config: NatsPublisherConfig) {
    let _lease = Lease::acquire(&pool, LEASE, LEASE_RETRY).await;
    tracing::info!(url = %redact_credentials(&config.url), stream = %config.stream_name, "NATS publisher holds its lease");
    let mut failures = 0u32;
    let mut follower = loop {
        match Follower::load(pool.clone(), FOLLOWER, &notifier).await {
            Ok(follower) => break follower,
            Err(e) => {
                tracing::warn!(error = %e, "cannot load the NATS publisher's checkpoint");
                failures += 1;
                tokio::time::sleep(backoff(failures, config.max_backoff)).await;
            }
        }
    };
    let mut sink: Option<Sink> = None;
    failures = 0;
    loop {
        let span = tracing::info_span!("nats_publish_pass", cursor = %follower.cursor());
        match pass(&mut follower, &mut sink, &config)
            .instrument(span)
            .await
        {
            Ok(0) => {
                failures = 0;
                follower.wait().await;
            }
            Ok(_) => {
                failures = 0;
                follower.wait_unless_full().await;
            }
            Err(e) => {
                failures += 1;
                metrics::counter!("vps_nats_publish_errors_total").increment(1);
                tracing::warn!(error = %e, failures, "NATS publication failed; retrying");
                tokio::time::sleep(backoff(failures, config.max_backoff)).await;
            }
        }
    }
}

/// The subject an event is published on, or `None` when its type cannot be a NATS subject
/// (empty tokens, wildcards or whitespace).
pub fn subject_for(prefix: &str, event_type: &str) -> Option<String> {
    let subject = format!("{}{event_type}", normalized_prefix(prefix));
    let valid = subject.split('.').all(|token| {
        !token.is_empty()
            && !token.contains(['*', '>'])
            && !token.chars().any(|c| c.is_whitespace() || c.is_control())
    });
    valid.then_some(subject)
}

/// The stream subject that captures `event_type`'s subject: `<prefix>.>` with a prefix,
/// else `<first token>.>` (or the type itself when it has a single token).
pub fn capture_subject(prefix: &str, event_type: &str) -> String {
    let prefix = normalized_prefix(prefix);
    if !prefix.is_empty() {
        return format!("{prefix}>");
    }
    match event_type.split_once('.') {
        Some((first, _)) => format!("{first}.>"),
        None => event_type.to_string(),
    }
}

/// `""` stays empty; anything else ends with exactly one dot.
fn normalized_prefix(prefix: &str) -> String {
    let trimmed = prefix.trim_end_matches('.');
    if trimmed.is_empty() {
        String::new()
    } else {
        format!("{trimmed}.")
    }
}

/// One pass: the next batch, published in order; the checkpoint moves past what was acked.
async fn pass(
    follower: &mut Follower,
    sink: &mut Option<Sink>,
    config: &NatsPublisherConfig,
) -> Result<usize, NatsPublishError> {
    let batch = follower.next_batch(BATCH).await?;
    if batch.is_empty() {
        follower.report_lag().await?;
        return Ok(0);
    }
    let sink = match sink {
        Some(sink) => sink,
        None => sink.insert(Sink::connect(config).await?),
    };
    let mut acked = None;
    let mut result = Ok(());
    // Publishes are pipelined (several in flight on the one connection, which keeps their
    // order) and their acks awaited in log order; the checkpoint stops at the first failure.
    let mut in_flight = std::collections::VecDeque::new();
    for event in &batch {
        match sink.send(config, event).await {
            Ok(pending) => in_flight.push_back((event, pending)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
        let full = in_flight.len() >= PIPELINE;
        if let Some((event, pending)) = in_flight.pop_front_if(|_| full) {
            if let Err(e) = sink.confirm(event, pending).await {
                result = Err(e);
                in_flight.clear();
                break;
            }
            acked = Some(event.cursor());
        }
    }
    while let Some((event, pending)) = in_flight.pop_front() {
        if result.is_err() {
            break;
        }
        match sink.confirm(event, pending).await {
            Ok(()) => acked = Some(event.cursor()),
            Err(e) => result = Err(e),
        }
    }
    // Keep what was acknowledged even when a later event failed: the retry starts there. The
    // checkpoint is stored lazily: JetStream drops what a restart publishes again.
    if let Some(cursor) = acked {
        follower.pass_over(cursor).await?;
    }
    result?;
    tracing::debug!(events = batch.len(), "published");
    Ok(batch.len())
}

/// Publishes in flight at once, at most.
const PIPELINE: usize = 64;

/// A JetStream connection and the stream subjects known to be captured.
struct Sink {
    js: jetstream::Context,
    captured: BTreeSet<String>,
}

impl Sink {
    async fn connect(config: &NatsPublisherConfig) -> Result<Sink, NatsPublishError> {
        let client = async_nats::ConnectOptions::new()
            .name("vps-nats-publisher")
            .connection_timeout(Duration::from_secs(5))
            // Reconnect soon after NATS comes back; the default waits up to several seconds.
            .reconnect_delay_callback(|attempts| {
                Duration::from_millis(100 * 2u64.pow(attempts.min(5) as u32))
            })
            .connect(config.url.as_str())
            .await
            .map_err(|source| NatsPublishError::Connect {
                url: redact_credentials(&config.url),
                source,
            })?;
        let mut sink = Sink {
            js: jetstream::new(client),
            captured: BTreeSet::new(),
        };
        let catalog: Vec<String> = CATALOG_PREFIXES
            .iter()
            .map(|t| capture_subject(&config.subject_prefix, &format!("{t}.x")))
            .collect();
        sink.capture(config, &catalog).await?;
        Ok(sink)
    }

    /// Sends one event; its ack is awaited with [`Sink::confirm`]. `None`: nothing to await
    /// (an unpublishable type, skipped).
    async fn send(
        &mut self,
        config: &NatsPublisherConfig,
        event: &RecordedEvent,
    ) -> Result<Option<async_nats::jetstream::context::PublishAckFuture>, NatsPublishError> {
        let Some(subject) = subject_for(&config.subject_prefix, &event.event_type) else {
            // Such a type can never be published; blocking on it would stop every later event.
            metrics::counter!("vps_nats_unpublishable_total").increment(1);
            tracing::error!(event_id = %event.id, r#type = %event.event_type,
                "event type is not a valid NATS subject; not published");
            return Ok(None);
        };
        self.capture(
            config,
            &[capture_subject(&config.subject_prefix, &event.event_type)],
        )
        .await?;
        let body = serde_json::to_vec(&cloud_event(event)).expect("a CloudEvent serialises");
        let sent = self
            .js
            .send_publish(
                subject,
                PublishMessage::build()
                    .payload(body.into())
                    .message_id(&event.id),
            )
            .await;
        match sent {
            Ok(pending) => Ok(Some(pending)),
            Err(e) => Err(self.failed(event, e)),
        }
    }

    /// Waits for the ack of a sent event.
    async fn confirm(
        &mut self,
        event: &RecordedEvent,
        pending: Option<async_nats::jetstream::context::PublishAckFuture>,
    ) -> Result<(), NatsPublishError> {
        let Some(pending) = pending else {
            return Ok(());
        };
        match pending.await {
            Ok(ack) => {
                if ack.duplicate {
                    metrics::counter!("vps_nats_duplicates_total").increment(1);
                }
                metrics::counter!("vps_nats_published_total").increment(1);
                Ok(())
            }
            Err(e) => Err(self.failed(event, e)),
        }
    }

    fn failed(
        &mut self,
        event: &RecordedEvent,
        source: async_nats::jetstream::context::PublishError,
    ) -> NatsPublishError {
        // The stream may have been deleted or changed: look again before the retry.
        self.captured.clear();
        NatsPublishError::Publish {
            event_id: event.id.clone(),
            source,
        }
    }

    /// Makes sure the stream exists and captures `subjects`, keeping any subjects it has.
    async fn capture(
        &mut self,
        config: &NatsPublisherConfig,
        subjects: &[String],
    ) -> Result<(), NatsPublishError> {
        if subjects.iter().all(|s| self.captured.contains(s)) {
            return Ok(());
        }
        let fail = |message: String| NatsPublishError::Stream {
            stream: config.stream_name.clone(),
            message,
        };
        let wanted: BTreeSet<String> = self.captured.iter().chain(subjects).cloned().collect();
        let stream = self
            .js
            .get_or_create_stream(stream::Config {
                name: config.stream_name.clone(),
                subjects: wanted.iter().cloned().collect(),
                storage: stream::StorageType::File,
                duplicate_window: config.duplicate_window,
                description: Some("vps events as CloudEvents (SPEC §4.3)".into()),
                ..Default::default()
            })
            .await
            .map_err(|e| fail(e.to_string()))?;
        let mut stream_config = stream.cached_info().config.clone();
        let missing: Vec<String> = wanted
            .iter()
            .filter(|s| !stream_config.subjects.contains(s))
            .cloned()
            .collect();
        if !missing.is_empty() {
            tracing::info!(stream = %config.stream_name, subjects = ?missing,
                "extending the JetStream stream");
            stream_config.subjects.extend(missing);
            self.js
                .update_stream(&stream_config)
                .await
                .map_err(|e| fail(e.to_string()))?;
        }
        self.captured = stream_config.subjects.into_iter().collect();
        Ok(())
    }
}

/// Doubling back-off from [`FIRST_BACKOFF`], capped, with up to 25% jitter.
fn backoff(failures: u32, cap: Duration) -> Duration {
    let exp = FIRST_BACKOFF.saturating_mul(2u32.saturating_pow(failures.saturating_sub(1)));
    let delay = exp.min(cap);
    let jitter = rand::thread_rng().gen_range(0.0..0.25);
    delay.mul_f64(1.0 - jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_the_prefix_and_the_type() {
        assert_eq!(
            subject_for("", "instance.created").as_deref(),
            Some("instance.created")
        );
        assert_eq!(
            subject_for("vps", "instance.created").as_deref(),
            Some("vps.instance.created")
        );
        assert_eq!(
            subject_for("vps.", "instance.created").as_deref(),
            Some("vps.instance.created")
        );
        assert_eq!(subject_for("", "bad..type"), None);
        assert_eq!(subject_for("", "bad.*"), None);
        assert_eq!(subject_for("", "has space"), None);
    }

    #[test]
    fn the_stream_captures_a_wildcard_per_first_token_or_the_prefix() {
        assert_eq!(capture_subject("", "instance.created"), "instance.>");
        assert_eq!(capture_subject("", "sandbox.snapshot.ready"), "sandbox.>");
        assert_eq!(capture_subject("", "single"), "single");
        assert_eq!(capture_subject("vps", "instance.created"), "vps.>");
    }

    #[test]
    fn back_off_doubles_and_stays_under_the_cap() {
        let cap = Duration::from_secs(2);
        assert!(backoff(1, cap) <= FIRST_BACKOFF);
        assert!(backoff(3, cap) > FIRST_BACKOFF * 2);
        assert!(backoff(30, cap) <= cap);
    }
}
