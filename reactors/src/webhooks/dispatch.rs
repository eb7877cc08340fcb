//! The dispatcher: attempts the first undelivered event of every subscription that is due,
//! each subscription on its own task, and records every attempt.
//!
//! Only a subscription's first queued event (in log order) is ever claimed, and a claim is a
//! lease on that row, so one subscription has at most one attempt in flight across every
//! replica: deliveries stay in log order. A failing endpoint only pushes its own first row's
//! `next_attempt_at` back; the other subscriptions' rows are claimed regardless.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use reqwest::StatusCode;
use sqlx::{PgConnection, PgPool, Row};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::Instrument;
use vps_commands::webhooks::{disable_gone, WebhookSecret};
use vps_commands::{CommandError, Ctx};
use vps_projections::webhooks::DeliveryStatus;

use super::backoff::{parse_retry_after, retry_delay};
use super::signature::sign;
use super::WebhookConfig;

/// How much longer than the request timeout a claim lasts: enough to record the outcome.
const LEASE_MARGIN: Duration = Duration::from_secs(30);

/// A claimed queue row with what it takes to deliver it.
struct Claimed {
    id: i64,
    lease_token: String,
    webhook_id: String,
    event_id: String,
    body: String,
    attempts: i32,
    url: String,
    secret: WebhookSecret,
}

/// What an attempt came to.
enum Outcome {
    /// 2xx.
    Delivered(u16),
    /// 410: the subscription is disabled.
    Gone(u16),
    /// Any other answer, or none.
    Failed {
        code: Option<u16>,
        error: Option<String>,
        retry_after: Option<Duration>,
    },
}

/// Runs the dispatcher forever as `ctx`; `enqueued` wakes it when the fan-out queued rows.
pub(crate) async fn run(
    ctx: Ctx,
    config: WebhookConfig,
    client: reqwest::Client,
    enqueued: Arc<Notify>,
) {
    let mut inflight: JoinSet<Option<Duration>> = JoinSet::new();
    // The earliest retry this process scheduled, so short back-offs are not stretched to the
    // poll interval.
    let mut next_retry: Option<Instant> = None;
    loop {
        let room = config.concurrency.saturating_sub(inflight.len());
        if room > 0 {
            let span = tracing::debug_span!("webhook_dispatch_pass", inflight = inflight.len());
            match claim(&ctx.pool, &config, room as i64)
                .instrument(span)
                .await
            {
                Ok(items) => {
                    for item in items {
                        let span = tracing::info_span!("webhook_attempt",
                            webhook = %item.webhook_id, event = %item.event_id,
                            attempt = item.attempts + 1);
                        inflight.spawn(
                            attempt(ctx.clone(), config.clone(), client.clone(), item)
                                .instrument(span),
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot claim webhook deliveries"),
            }
        }
        let now = Instant::now();
        let mut wait = config.poll_interval;
        if let Some(at) = next_retry {
            if at <= now {
                next_retry = None;
            } else {
                wait = wait.min(at - now);
            }
        }
        tokio::select! {
            Some(done) = inflight.join_next(), if !inflight.is_empty() => {
                if let Ok(Some(delay)) = done {
                    let at = Instant::now() + delay;
                    next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
                }
            }
            _ = enqueued.notified() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Leases up to `limit` due first rows of active subscriptions.
async fn claim(
    pool: &PgPool,
    config: &WebhookConfig,
    limit: i64,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let token = ulid::Ulid::generate().to_string();
    let lease = (config.request_timeout + LEASE_MARGIN).as_secs_f64();
    // The lease condition is checked again on the locked row, so two replicas racing for the
    // same first row cannot both win it.
    let rows = sqlx::query(
        "WITH heads AS (
             SELECT h.id FROM webhooks w
             CROSS JOIN LATERAL (
                 SELECT o.id, o.next_attempt_at, o.lease_until FROM webhook_outbox o
                  WHERE o.webhook_id = w.id
                  ORDER BY o.event_transaction_id, o.event_position LIMIT 1) h
              WHERE w.state = 'active' AND h.next_attempt_at <= now()
                AND (h.lease_until IS NULL OR h.lease_until < now())
              ORDER BY h.next_attempt_at
              LIMIT $3
         ), claimed AS (
             UPDATE webhook_outbox o
                SET lease_token = $1, lease_until = now() + make_interval(secs => $2)
              WHERE o.id IN (SELECT id FROM heads)
                AND (o.lease_until IS NULL OR o.lease_until < now())
             RETURNING o.id, o.webhook_id, o.event_id, o.body, o.attempts
         )
         SELECT c.id, c.webhook_id, c.event_id, c.body, c.attempts, w.url, s.secret
           FROM claimed c
           JOIN webhooks w ON w.id = c.webhook_id
           JOIN webhook_secrets s ON s.webhook_id = c.webhook_id",
    )
    .bind(&token)
    .bind(lease)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(Claimed {
                id: row.try_get(0)?,
                lease_token: token.clone(),
                webhook_id: row.try_get(1)?,
                event_id: row.try_get(2)?,
                body: row.try_get(3)?,
                attempts: row.try_get(4)?,
                url: row.try_get(5)?,
                secret: WebhookSecret(row.try_get(6)?),
            })
        })
        .collect()
}

/// POSTs a subscription's queue in order, starting with `item`. Healthy deliveries are
/// recorded in runs: one statement logs a run and claims the next rows of the queue, so an
/// endpoint that keeps up costs a fraction of a round trip per event. The first failure ends
/// the task (recorded with its back-off, which is returned); the rows claimed after it are
/// released untouched, so order is kept.
async fn attempt(
    ctx: Ctx,
    config: WebhookConfig,
    client: reqwest::Client,
    item: Claimed,
) -> Option<Duration> {
    let mut run = vec![item];
    let mut delivered_total = 0;
    loop {
        let mut delivered = Vec::new();
        let mut failure = None;
        let mut rest = Vec::new();
        for item in run {
            if failure.is_some() {
                rest.push(item);
                continue;
            }
            match post(&client, &item).await {
                Outcome::Delivered(code) => delivered.push((item, code)),
                outcome => failure = Some((item, outcome)),
            }
        }
        delivered_total += delivered.len();
        // Claim more only while all went well and the task has not had its share.
        let more = if failure.is_none() && delivered_total < BURST {
            RUN
        } else {
            0
        };
        let next = match record_delivered(&ctx.pool, &config, &delivered, more).await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "cannot record webhook deliveries");
                return None;
            }
        };
        if let Err(e) = release(&ctx.pool, &rest).await {
            tracing::warn!(error = %e, "cannot release claimed webhook rows; their lease will expire");
        }
        if let Some((item, outcome)) = failure {
            return match record(&ctx, &config, &item, outcome).await {
                Ok(Recorded { retry_in, disabled }) => {
                    if disabled {
                        ctx.notifier.committed();
                    }
                    retry_in
                }
                Err(e) => {
                    // The claim runs out and the row is attempted again: at-least-once, and
                    // receivers de-duplicate by `webhook-id`.
                    tracing::warn!(error = %e, "cannot record a webhook attempt");
                    None
                }
            };
        }
        if next.is_empty() {
            return None;
        }
        run = next;
    }
}

/// Rows claimed at once while an endpoint keeps up.
const RUN: i64 = 32;
/// Deliveries one task makes before handing back to the dispatcher.
const BURST: usize = 1000;

/// Logs a run of deliveries (their queue rows gone) and claims up to `more` next rows of the
/// subscription, in one statement. The claimed rows come back in log order.
async fn record_delivered(
    pool: &PgPool,
    config: &WebhookConfig,
    delivered: &[(Claimed, u16)],
    more: i64,
) -> Result<Vec<Claimed>, sqlx::Error> {
    let Some((first, _)) = delivered.first() else {
        return Ok(Vec::new());
    };
    metrics::counter!("vps_webhook_attempts_total", "outcome" => "delivered")
        .increment(delivered.len() as u64);
    let ids: Vec<i64> = delivered.iter().map(|(c, _)| c.id).collect();
    let codes: Vec<i32> = delivered.iter().map(|(_, code)| i32::from(*code)).collect();
    let lease = (config.request_timeout + LEASE_MARGIN).as_secs_f64();
    // The deleted rows are still visible to the other parts of the statement: exclude them.
    let rows = sqlx::query(
        "WITH done AS (
             DELETE FROM webhook_outbox WHERE id = ANY($1) AND lease_token = $2
             RETURNING id, webhook_id, event_id, attempts
         ), logged AS (
             INSERT INTO webhook_deliveries (webhook_id, event_id, attempt, status, response_code)
             SELECT d.webhook_id, d.event_id, d.attempts + 1, 'delivered', c.code
               FROM done d JOIN unnest($1::bigint[], $3::int[]) AS c(id, code) ON c.id = d.id
         ), next AS (
             -- The head index serves this: the queue may hold thousands of rows.
             SELECT o.id FROM webhook_outbox o
              WHERE o.webhook_id = $4 AND o.id <> ALL($1)
                AND (SELECT count(*) FROM done) = cardinality($1)
                AND EXISTS (SELECT 1 FROM webhooks w WHERE w.id = $4 AND w.state = 'active')
              ORDER BY o.event_transaction_id, o.event_position
              LIMIT $5
         )
         UPDATE webhook_outbox o
            SET lease_token = $2, lease_until = now() + make_interval(secs => $6)
           FROM next
          WHERE o.id = next.id AND o.next_attempt_at <= now()
            AND (o.lease_until IS NULL OR o.lease_until < now())
         RETURNING o.id, o.event_id, o.body, o.attempts,
                   o.event_transaction_id::text, o.event_position",
    )
    .bind(&ids)
    .bind(&first.lease_token)
    .bind(&codes)
    .bind(&first.webhook_id)
    .bind(more)
    .bind(lease)
    .fetch_all(pool)
    .await?;
    let mut next = rows
        .iter()
        .map(|row| {
            let txid: String = row.try_get(4)?;
            let order = (
                txid.parse::<u64>().unwrap_or(u64::MAX),
                row.try_get::<i64, _>(5)?,
            );
            Ok((
                order,
                Claimed {
                    id: row.try_get(0)?,
                    lease_token: first.lease_token.clone(),
                    webhook_id: first.webhook_id.clone(),
                    event_id: row.try_get(1)?,
                    body: row.try_get(2)?,
                    attempts: row.try_get(3)?,
                    url: first.url.clone(),
                    secret: first.secret.clone(),
                },
            ))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    next.sort_by_key(|(order, _)| *order);
    Ok(next.into_iter().map(|(_, c)| c).collect())
}

/// Gives claimed rows back unattempted.
async fn release(pool: &PgPool, rows: &[Claimed]) -> Result<(), sqlx::Error> {
    let Some(first) = rows.first() else {
        return Ok(());
    };
    let ids: Vec<i64> = rows.iter().map(|c| c.id).collect();
    sqlx::query("UPDATE webhook_outbox SET lease_token = NULL, lease_until = NULL WHERE id = ANY($1) AND lease_token = $2")
        .bind(&ids)
        .bind(&first.lease_token)
        .execute(pool)
        .await?;
    Ok(())
}

/// One signed POST of a claimed row.
async fn post(client: &reqwest::Client, item: &Claimed) -> Outcome {
    let timestamp = Utc::now().timestamp();
    let signature = sign(&item.secret, &item.event_id, timestamp, &item.body);
    let started = Instant::now();
    let response = client
        .post(&item.url)
        .header("content-type", "application/json")
        .header("webhook-id", &item.event_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(item.body.clone())
        .send()
        .await;
    metrics::histogram!("vps_webhook_request_seconds").record(started.elapsed().as_secs_f64());
    match response {
        Ok(r) if r.status().is_success() => Outcome::Delivered(r.status().as_u16()),
        Ok(r) if r.status() == StatusCode::GONE => Outcome::Gone(r.status().as_u16()),
        Ok(r) => Outcome::Failed {
            code: Some(r.status().as_u16()),
            error: None,
            retry_after: r
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| parse_retry_after(v, Utc::now())),
        },
        Err(e) => Outcome::Failed {
            code: None,
            error: Some(describe(&e)),
            retry_after: None,
        },
    }
}

struct Recorded {
    retry_in: Option<Duration>,
    disabled: bool,
}

/// What an attempt's outcome makes of its delivery.
struct Verdict {
    status: DeliveryStatus,
    code: Option<u16>,
    error: Option<String>,
    /// When the next attempt is due (`Pending` only).
    retry_in: Option<Duration>,
}

/// Records an attempt and moves the queue, only if the claim is still ours; a `410 Gone`
/// disables the subscription in the same transaction.
async fn record(
    ctx: &Ctx,
    config: &WebhookConfig,
    item: &Claimed,
    outcome: Outcome,
) -> Result<Recorded, CommandError> {
    let attempt = item.attempts + 1;
    let gone = matches!(outcome, Outcome::Gone(_));
    let mut tx = ctx.pool.begin().await?;
    let verdict = judge(config, attempt, outcome);
    if !settle(&mut tx, item, attempt, &verdict).await? {
        // Deleted or disabled meanwhile, or the claim ran out and another replica took it.
        return Ok(Recorded {
            retry_in: None,
            disabled: false,
        });
    }
    log_attempt(&mut tx, item, attempt, &verdict).await?;
    let disabled =
        gone && disable_gone(ctx, &mut tx, &item.webhook_id, StatusCode::GONE.as_u16()).await?;
    if disabled {
        tracing::info!("endpoint answered 410 Gone; subscription disabled");
    }
    tx.commit().await?;
    Ok(Recorded {
        retry_in: verdict.retry_in,
        disabled,
    })
}

/// The delivery's status after attempt number `attempt`, and its back-off when another follows.
fn judge(config: &WebhookConfig, attempt: i32, outcome: Outcome) -> Verdict {
    let verdict = |status, code, error, retry_in| Verdict {
        status,
        code,
        error,
        retry_in,
    };
    match outcome {
        Outcome::Delivered(code) => {
            metrics::counter!("vps_webhook_attempts_total", "outcome" => "delivered").increment(1);
            verdict(DeliveryStatus::Delivered, Some(code), None, None)
        }
        Outcome::Gone(code) => {
            metrics::counter!("vps_webhook_attempts_total", "outcome" => "gone").increment(1);
            verdict(DeliveryStatus::Failed, Some(code), None, None)
        }
        Outcome::Failed { code, error, .. } if attempt >= config.max_attempts as i32 => {
            metrics::counter!("vps_webhook_attempts_total", "outcome" => "failed").increment(1);
            tracing::warn!(
                ?code,
                ?error,
                "webhook delivery abandoned after the last attempt"
            );
            verdict(DeliveryStatus::Failed, code, error, None)
        }
        Outcome::Failed {
            code,
            error,
            retry_after,
        } => {
            metrics::counter!("vps_webhook_attempts_total", "outcome" => "retry").increment(1);
            let delay = match retry_after {
                Some(asked) => asked.min(config.max_delay),
                None => retry_delay(config.base_delay, config.max_delay, attempt as u32),
            };
            verdict(DeliveryStatus::Pending, code, error, Some(delay))
        }
    }
}

/// Reschedules the queue row (`Pending`) or removes it (the delivery is over), if the claim is
/// still ours. Whether it was.
async fn settle(
    tx: &mut PgConnection,
    item: &Claimed,
    attempt: i32,
    verdict: &Verdict,
) -> Result<bool, sqlx::Error> {
    let done = if verdict.status == DeliveryStatus::Pending {
        sqlx::query(
            "UPDATE webhook_outbox
                SET attempts = $3, next_attempt_at = now() + make_interval(secs => $4),
                    lease_token = NULL, lease_until = NULL
              WHERE id = $1 AND lease_token = $2",
        )
        .bind(item.id)
        .bind(&item.lease_token)
        .bind(attempt)
        .bind(verdict.retry_in.unwrap_or_default().as_secs_f64())
        .execute(tx)
        .await?
    } else {
        sqlx::query("DELETE FROM webhook_outbox WHERE id = $1 AND lease_token = $2")
            .bind(item.id)
            .bind(&item.lease_token)
            .execute(tx)
            .await?
    };
    Ok(done.rows_affected() == 1)
}

/// Adds the attempt to the subscription's delivery log.
async fn log_attempt(
    tx: &mut PgConnection,
    item: &Claimed,
    attempt: i32,
    verdict: &Verdict,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO webhook_deliveries
                (webhook_id, event_id, attempt, status, response_code, error)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&item.webhook_id)
    .bind(&item.event_id)
    .bind(attempt)
    .bind(verdict.status.as_str())
    .bind(verdict.code.map(i32::from))
    .bind(&verdict.error)
    .execute(tx)
    .await?;
    Ok(())
}

/// A transport error with its causes, without the URL (it may carry credentials).
fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    let mut out = kind.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
