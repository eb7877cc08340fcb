//! The fan-out follower: reads the log once for every subscription and enqueues, per matching
//! subscription, one `webhook_outbox` row per event, in the same transaction that moves its
//! checkpoint (so each match is enqueued exactly once, even across crashes). Batches that
//! match no subscription are passed over ([`Follower::pass_over`]): reading such a batch again
//! after a crash enqueues nothing, and most batches match nothing, so they do not each cost a
//! commit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::watch;
use tracing::Instrument;
use vps_events::envelope::cloud_event;
use vps_events::follower::save_checkpoint;
use vps_events::lease::Lease;
use vps_events::pattern;
use vps_events::{Cursor, Follower, Notifier, RecordedEvent};

use super::backoff::retry_delay;
use super::WebhookConfig;

/// The follower (checkpoint) name.
pub const FOLLOWER: &str = "webhooks";
/// The lease that keeps the fan-out single across replicas.
pub const LEASE: &str = "webhooks:fanout";

/// An active subscription, as the fan-out matches events against it.
struct Subscription {
    id: String,
    types: Vec<String>,
    tenant_id: Option<String>,
    created: Cursor,
}

impl Subscription {
    /// Events after the subscription's creation, of a wanted type, of its tenant if scoped.
    fn wants(&self, event: &RecordedEvent) -> bool {
        event.cursor() > self.created
            && self
                .types
                .iter()
                .any(|p| pattern::matches(p, &event.event_type))
            && (self.tenant_id.is_none() || self.tenant_id == event.metadata.tenant_id)
    }
}

/// The least time between two reads of the log when woken.
const FANOUT_PACE: Duration = Duration::from_millis(1);

/// How long the subscriptions read are trusted when the log shows no change to them.
const SUBSCRIPTIONS_FRESH: Duration = Duration::from_secs(5);

/// The active subscriptions as last read. Every change to one is an event of its `webhook-…`
/// stream, projected to the table in that event's transaction, so they are read again only
/// when a batch holds such an event (and every few seconds, whatever the log shows): most
/// batches hold none, and reading them for every batch was a statement per create.
#[derive(Default)]
struct Subscriptions {
    read: Option<(Instant, Vec<Subscription>)>,
}

impl Subscriptions {
    /// The subscriptions that apply to `batch`: every one created before an event of it is
    /// visible now (the event is below the read horizon, so its transaction is over).
    async fn for_batch(
        &mut self,
        pool: &PgPool,
        batch: &[RecordedEvent],
    ) -> Result<&[Subscription], sqlx::Error> {
        let changed = batch
            .iter()
            .any(|e| e.category() == vps_domain::webhook::CATEGORY);
        let stale = self
            .read
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() >= SUBSCRIPTIONS_FRESH);
        if changed || stale {
            self.read = Some((Instant::now(), active_subscriptions(pool).await?));
        }
        Ok(self.read.as_ref().map_or(&[], |(_, subs)| subs.as_slice()))
    }
}

/// Runs the fan-out forever (once the lease is held), moving `enqueued` on after each enqueue.
pub(crate) async fn run(
    pool: PgPool,
    notifier: Notifier,
    config: WebhookConfig,
    enqueued: Arc<watch::Sender<u64>>,
) {
    let _lease = Lease::acquire(&pool, LEASE, Duration::from_secs(1)).await;
    let mut failures = 0u32;
    let mut follower = loop {
        match Follower::load(pool.clone(), FOLLOWER, &notifier).await {
            // A few milliseconds of a busy moment's commits per read (deliveries are async).
            Ok(follower) => break follower.paced(FANOUT_PACE),
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "cannot load the webhook fan-out checkpoint");
                tokio::time::sleep(retry_delay(config.base_delay, config.max_delay, failures))
                    .await;
            }
        }
    };
    failures = 0;
    let mut subscriptions = Subscriptions::default();
    loop {
        let span = tracing::info_span!("webhook_fanout_pass", cursor = %follower.cursor());
        match pass(
            &pool,
            &mut follower,
            &mut subscriptions,
            config.fanout_batch,
        )
        .instrument(span)
        .await
        {
            Ok((0, _)) => {
                failures = 0;
                follower.wait().await;
            }
            Ok((_, queued)) => {
                failures = 0;
                if queued > 0 {
                    enqueued.send_modify(|n| *n = n.wrapping_add(1));
                }
                follower.wait_unless_full().await;
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, failures, "webhook fan-out failed; retrying");
                tokio::time::sleep(retry_delay(config.base_delay, config.max_delay, failures))
                    .await;
            }
        }
    }
}

/// One batch: returns (events read, rows enqueued).
async fn pass(
    pool: &PgPool,
    follower: &mut Follower,
    subscriptions: &mut Subscriptions,
    limit: i64,
) -> Result<(usize, usize), sqlx::Error> {
    let batch = follower.next_batch(limit).await?;
    let Some(last) = batch.last().map(RecordedEvent::cursor) else {
        follower.report_lag().await?;
        return Ok((0, 0));
    };
    let subscriptions = subscriptions.for_batch(pool, &batch).await?;
    let mut webhook_ids = Vec::new();
    let mut event_ids = Vec::new();
    let mut txids = Vec::new();
    let mut positions = Vec::new();
    let mut bodies = Vec::new();
    for event in &batch {
        let mut body = None;
        for sub in subscriptions.iter().filter(|s| s.wants(event)) {
            let body = body.get_or_insert_with(|| cloud_event(event).to_string());
            webhook_ids.push(sub.id.clone());
            event_ids.push(event.id.clone());
            txids.push(event.transaction_id.to_string());
            positions.push(event.position);
            bodies.push(body.clone());
        }
    }
    if webhook_ids.is_empty() {
        follower.pass_over(last).await?;
        return Ok((batch.len(), 0));
    }
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO webhook_outbox
                (webhook_id, event_id, event_transaction_id, event_position, body)
         SELECT w, e, t::xid8, p, b
           FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[])
                AS x(w, e, t, p, b)
         ON CONFLICT (webhook_id, event_id) DO NOTHING",
    )
    .bind(&webhook_ids)
    .bind(&event_ids)
    .bind(&txids)
    .bind(&positions)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    save_checkpoint(&mut *tx, follower.name(), last).await?;
    tx.commit().await?;
    // Only now: had the commit failed, the batch must be read again.
    follower.advance(last);
    metrics::counter!("vps_webhook_enqueued_total").increment(webhook_ids.len() as u64);
    tracing::debug!(
        events = batch.len(),
        enqueued = webhook_ids.len(),
        "fanned out"
    );
    Ok((batch.len(), webhook_ids.len()))
}

async fn active_subscriptions(pool: &PgPool) -> Result<Vec<Subscription>, sqlx::Error> {
    let active = vps_projections::webhooks::active(pool).await?;
    Ok(active
        .into_iter()
        .map(|w| Subscription {
            id: w.id,
            types: w.types,
            tenant_id: w.tenant_id,
            created: w.created,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vps_events::Metadata;

    fn event(event_type: &str, tenant: Option<&str>, position: i64) -> RecordedEvent {
        RecordedEvent {
            position,
            transaction_id: 100,
            stream: "instance-inst_1".into(),
            version: 1,
            id: format!("evt_{position}"),
            event_type: event_type.into(),
            data: json!({}),
            metadata: Metadata {
                tenant_id: tenant.map(Into::into),
                ..Metadata::default()
            },
            recorded_at: crate::fixtures::now(),
        }
    }

    #[test]
    fn a_subscription_wants_later_events_of_its_types_and_tenant() {
        let sub = Subscription {
            id: "whk_1".into(),
            types: vec!["instance.*".into()],
            tenant_id: Some("acme".into()),
            created: Cursor {
                transaction_id: 100,
                position: 5,
            },
        };
        assert!(sub.wants(&event("instance.created", Some("acme"), 6)));
        assert!(!sub.wants(&event("instance.created", Some("acme"), 4)));
        assert!(!sub.wants(&event("instance.created", Some("globex"), 6)));
        assert!(!sub.wants(&event("instance.created", None, 6)));
        assert!(!sub.wants(&event("sandbox.created", Some("acme"), 6)));
    }
}
