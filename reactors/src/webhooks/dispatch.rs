//! The dispatcher: delivers the queue of every subscription that is due, each subscription on
//! its own task, and records every attempt.
//!
//! **The fence.** A worker delivers a subscription only while it holds that subscription's
//! lease (`webhook_leases`, one row per subscription, a fresh token per claim). It renews the
//! lease before any POST that could outlast it, and every record of an outcome is conditional
//! on still holding it. So a second worker (another task, another replica) can take the
//! subscription only once the first has stopped renewing, and the first then stops before its
//! next POST and records nothing more: deliveries stay in log order, one attempt at a time, and
//! a slow receiver never gets the same event twice from a live worker. A failing endpoint only
//! pushes its own first row's `next_attempt_at` back; other subscriptions are claimed
//! regardless.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use reqwest::StatusCode;
use sqlx::{PgConnection, PgPool, Row};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::Instrument;
use vps_commands::webhooks::{disable_gone, open_secret, WebhookSecret};
use vps_commands::{CommandError, Ctx};
use vps_projections::webhooks::DeliveryStatus;

use super::backoff::{parse_retry_after, retry_delay};
use super::guard::describe;
use super::signature::sign;
use super::WebhookConfig;

/// A subscription whose lease this worker holds.
struct Lease {
    webhook_id: String,
    token: String,
    url: String,
    secret: WebhookSecret,
    /// When the lease was last renewed (taken before the renewal was sent: conservative).
    renewed: Instant,
}

/// A queued event of a leased subscription.
#[derive(sqlx::FromRow)]
struct Queued {
    id: i64,
    event_id: String,
    body: String,
    attempts: i32,
    due: bool,
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

/// Runs the dispatcher forever as `ctx`; `enqueued` moves on when the fan-out queued rows.
pub(crate) async fn run(
    ctx: Ctx,
    config: WebhookConfig,
    client: reqwest::Client,
    enqueued: Arc<watch::Sender<u64>>,
) {
    let mut inflight: JoinSet<Option<Duration>> = JoinSet::new();
    // The earliest retry this process scheduled, so short back-offs are not stretched to the
    // poll interval.
    let mut next_retry: Option<Instant> = None;
    let mut woken = enqueued.subscribe();
    loop {
        woken.borrow_and_update();
        let room = config.concurrency.saturating_sub(inflight.len());
        if room > 0 {
            let span = tracing::debug_span!("webhook_dispatch_pass", inflight = inflight.len());
            match claim(&ctx, &config, room as i64).instrument(span).await {
                Ok(leases) => {
                    for lease in leases {
                        let span =
                            tracing::info_span!("webhook_delivery", webhook = %lease.webhook_id);
                        inflight.spawn(
                            deliver(
                                ctx.clone(),
                                config.clone(),
                                client.clone(),
                                lease,
                                enqueued.subscribe(),
                            )
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
            _ = woken.changed() => {}
            _ = tokio::time::sleep(wait) => {}
            // A moved clock may have made back-offs run out.
            () = ctx.clock.moved() => {}
        }
    }
}

/// How long a lease lasts: the longest POST plus the margin to record its outcome.
fn lease_length(config: &WebhookConfig) -> Duration {
    config.request_timeout + config.lease_margin
}

/// Leases up to `limit` active subscriptions whose first queued event is due and that no
/// worker holds, and opens their signing secrets. Due is the context's clock; leases are the
/// database's (one clock for every replica).
async fn claim(ctx: &Ctx, config: &WebhookConfig, limit: i64) -> Result<Vec<Lease>, sqlx::Error> {
    let (pool, key) = (&ctx.pool, &ctx.secrets);
    let token = ulid::Ulid::generate().to_string();
    let renewed = Instant::now();
    // The upsert takes a lease only where none is live: two workers racing for one
    // subscription serialize on its row, and the second sees the first's fresh lease.
    let rows = sqlx::query(
        "WITH due AS (
             SELECT w.id FROM webhooks w
             CROSS JOIN LATERAL (
                 SELECT o.next_attempt_at FROM webhook_outbox o
                  WHERE o.webhook_id = w.id
                  ORDER BY o.event_transaction_id, o.event_position LIMIT 1) h
              WHERE w.state = 'active' AND h.next_attempt_at <= $4
                AND NOT EXISTS (SELECT 1 FROM webhook_leases l
                                 WHERE l.webhook_id = w.id AND l.lease_until >= now())
              ORDER BY h.next_attempt_at
              LIMIT $3
         ), leased AS (
             INSERT INTO webhook_leases (webhook_id, token, lease_until)
             SELECT id, $1, now() + make_interval(secs => $2) FROM due
             ON CONFLICT (webhook_id) DO UPDATE
                SET token = excluded.token, lease_until = excluded.lease_until
              WHERE webhook_leases.lease_until < now()
             RETURNING webhook_id
         )
         SELECT l.webhook_id, w.url FROM leased l JOIN webhooks w ON w.id = l.webhook_id",
    )
    .bind(&token)
    .bind(lease_length(config).as_secs_f64())
    .bind(limit)
    .bind(ctx.clock.now())
    .fetch_all(pool)
    .await?;
    let mut leases = Vec::new();
    let mut conn = pool.acquire().await?;
    for row in &rows {
        let webhook_id: String = row.try_get(0)?;
        let Some(secret) = open_secret(&mut conn, key, &webhook_id).await? else {
            // Sealed under another key (a replica configured differently): leave it to
            // whoever can open it.
            tracing::warn!(webhook = %webhook_id, "the signing secret does not open; not delivering");
            release_lease(&mut *conn, &webhook_id, &token).await?;
            continue;
        };
        leases.push(Lease {
            webhook_id,
            token: token.clone(),
            url: row.try_get(1)?,
            secret,
            renewed,
        });
    }
    Ok(leases)
}

/// Delivers a leased subscription's queue in order. Healthy deliveries are recorded in runs
/// (one statement per run), so an endpoint that keeps up costs a fraction of a round trip per
/// event. The first failure ends the task (recorded with its back-off, which is returned); so
/// does a lost lease (nothing more is posted or recorded) and the end of the task's share.
async fn deliver(
    ctx: Ctx,
    config: WebhookConfig,
    client: reqwest::Client,
    mut lease: Lease,
    mut enqueued: watch::Receiver<u64>,
) -> Option<Duration> {
    let finished = deliver_queue(&ctx, &config, &client, &mut lease, &mut enqueued).await;
    let retry_in = match finished {
        Ok(retry_in) => retry_in,
        Err(e) => {
            // The lease runs out and the queue is taken up again: at-least-once, and
            // receivers de-duplicate by `webhook-id`.
            tracing::warn!(error = %e, "webhook delivery stopped");
            None
        }
    };
    if let Err(e) = release(&ctx.pool, &lease).await {
        tracing::warn!(error = %e, "cannot release a webhook lease; it will run out");
    }
    retry_in
}

/// Why a delivery task stopped early.
#[derive(Debug, thiserror::Error)]
enum Stop {
    /// Another worker holds the subscription now.
    #[error("the subscription's lease was lost to another worker")]
    LeaseLost,
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A command failed.
    #[error(transparent)]
    Command(#[from] CommandError),
}

async fn deliver_queue(
    ctx: &Ctx,
    config: &WebhookConfig,
    client: &reqwest::Client,
    lease: &mut Lease,
    enqueued: &mut watch::Receiver<u64>,
) -> Result<Option<Duration>, Stop> {
    let mut delivered_total = 0;
    let mut idle_until = Instant::now() + config.linger;
    while delivered_total < BURST {
        enqueued.borrow_and_update();
        let run = next_run(&ctx.pool, config, lease, ctx.clock.now()).await?;
        match run.first() {
            // Caught up: linger, so what the fan-out queues next goes out without a new claim.
            None => match tokio::time::timeout_at(idle_until.into(), enqueued.changed()).await {
                Ok(Ok(())) => continue,
                _ => return Ok(None),
            },
            // Backing off: the dispatcher claims it again when due.
            Some(first) if !first.due => return Ok(None),
            Some(_) => idle_until = Instant::now() + config.linger,
        }
        let mut delivered = Vec::new();
        let mut failure = None;
        for item in run {
            keep_lease(&ctx.pool, config, lease).await?;
            match post(ctx, client, config, lease, &item).await {
                Outcome::Delivered(code) => delivered.push((item, code)),
                outcome => {
                    failure = Some((item, outcome));
                    break;
                }
            }
        }
        delivered_total += delivered.len();
        record_delivered(&ctx.pool, lease, &delivered).await?;
        if let Some((item, outcome)) = failure {
            let recorded = record(ctx, config, lease, &item, outcome).await?;
            if recorded.disabled {
                ctx.notifier.committed();
            }
            return Ok(recorded.retry_in);
        }
    }
    Ok(None)
}

/// Rows read at once while an endpoint keeps up.
const RUN: i64 = 32;
/// Deliveries one task makes before handing back to the dispatcher.
const BURST: usize = 1000;

/// Keeps the lease (see [`keep_lease`]) and reads the subscription's next `RUN` queued events
/// in log order, due or not at `now`. A lease lost meanwhile stops the task before its next POST: it was renewed
/// too long ago to be trusted, so `keep_lease` renews it, and the renewal finds it gone.
async fn next_run(
    pool: &PgPool,
    config: &WebhookConfig,
    lease: &mut Lease,
    now: DateTime<Utc>,
) -> Result<Vec<Queued>, Stop> {
    keep_lease(pool, config, lease).await?;
    let queued = sqlx::query_as(
        "SELECT id, event_id, body, attempts, next_attempt_at <= $3 AS due FROM webhook_outbox
          WHERE webhook_id = $1
          ORDER BY event_transaction_id, event_position
          LIMIT $2",
    )
    .bind(&lease.webhook_id)
    .bind(RUN)
    .bind(now)
    .fetch_all(pool)
    .await?;
    Ok(queued)
}

/// Renews the lease when what is left of it might not cover a POST that takes the whole
/// request timeout plus half the margin.
async fn keep_lease(pool: &PgPool, config: &WebhookConfig, lease: &mut Lease) -> Result<(), Stop> {
    if lease.renewed.elapsed() >= config.lease_margin / 2 {
        renew(pool, config, lease).await?;
    }
    Ok(())
}

/// Extends the lease, if it is still ours; [`Stop::LeaseLost`] otherwise.
async fn renew(pool: &PgPool, config: &WebhookConfig, lease: &mut Lease) -> Result<(), Stop> {
    let started = Instant::now();
    let renewed = sqlx::query(
        "UPDATE webhook_leases SET lease_until = now() + make_interval(secs => $3)
          WHERE webhook_id = $1 AND token = $2",
    )
    .bind(&lease.webhook_id)
    .bind(&lease.token)
    .bind(lease_length(config).as_secs_f64())
    .execute(pool)
    .await?;
    if renewed.rows_affected() != 1 {
        return Err(Stop::LeaseLost);
    }
    lease.renewed = started;
    Ok(())
}

/// Lets the subscription be claimed again at once, if the lease is still ours.
async fn release(pool: &PgPool, lease: &Lease) -> Result<(), sqlx::Error> {
    release_lease(pool, &lease.webhook_id, &lease.token).await
}

async fn release_lease<'e>(
    db: impl sqlx::PgExecutor<'e>,
    webhook_id: &str,
    token: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM webhook_leases WHERE webhook_id = $1 AND token = $2")
        .bind(webhook_id)
        .bind(token)
        .execute(db)
        .await?;
    Ok(())
}

/// Logs a run of deliveries and removes their queue rows, in one statement, only while the
/// lease is ours ([`Stop::LeaseLost`] otherwise: the new holder delivers them again).
async fn record_delivered(
    pool: &PgPool,
    lease: &Lease,
    delivered: &[(Queued, u16)],
) -> Result<(), Stop> {
    if delivered.is_empty() {
        return Ok(());
    }
    metrics::counter!("vps_webhook_attempts_total", "outcome" => "delivered")
        .increment(delivered.len() as u64);
    let ids: Vec<i64> = delivered.iter().map(|(q, _)| q.id).collect();
    let codes: Vec<i32> = delivered.iter().map(|(_, code)| i32::from(*code)).collect();
    let done = sqlx::query(
        "WITH done AS (
             DELETE FROM webhook_outbox
              WHERE id = ANY($1) AND webhook_id = $3
                AND EXISTS (SELECT 1 FROM webhook_leases
                             WHERE webhook_id = $3 AND token = $4)
             RETURNING id, webhook_id, event_id, attempts
         )
         INSERT INTO webhook_deliveries (webhook_id, event_id, attempt, status, response_code)
         SELECT d.webhook_id, d.event_id, d.attempts + 1, 'delivered', c.code
           FROM done d JOIN unnest($1::bigint[], $2::int[]) AS c(id, code) ON c.id = d.id",
    )
    .bind(&ids)
    .bind(&codes)
    .bind(&lease.webhook_id)
    .bind(&lease.token)
    .execute(pool)
    .await?;
    if done.rows_affected() != ids.len() as u64 {
        return Err(Stop::LeaseLost);
    }
    Ok(())
}

/// One signed POST of a queued event. An IP-literal URL never reaches the resolver, so its
/// address is checked here.
async fn post(
    ctx: &Ctx,
    client: &reqwest::Client,
    config: &WebhookConfig,
    lease: &Lease,
    item: &Queued,
) -> Outcome {
    if let Some(address) = literal_address(&lease.url) {
        if !vps_domain::network::reachable(address, &config.allow_private) {
            return Outcome::Failed {
                code: None,
                error: Some(super::guard::Blocked.to_string()),
                retry_after: None,
            };
        }
    }
    let timestamp = ctx.clock.now().timestamp();
    let signature = sign(&lease.secret, &item.event_id, timestamp, &item.body);
    let started = Instant::now();
    let response = client
        .post(&lease.url)
        .header("content-type", "application/json")
        .header("webhook-id", &item.event_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(item.body.clone())
        .send()
        .await;
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            return Outcome::Failed {
                code: None,
                error: Some(describe(&e)),
                retry_after: None,
            }
        }
    };
    let status = response.status();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, ctx.clock.now()));
    drain(response).await;
    metrics::histogram!("vps_webhook_request_seconds").record(started.elapsed().as_secs_f64());
    match status {
        s if s.is_success() => Outcome::Delivered(s.as_u16()),
        StatusCode::GONE => Outcome::Gone(status.as_u16()),
        s => Outcome::Failed {
            code: Some(s.as_u16()),
            error: None,
            retry_after,
        },
    }
}

/// The most of an answer's body read, and thrown away, so that its connection can carry the
/// next delivery; a longer body closes the connection instead.
const DRAIN_LIMIT: usize = 1 << 20;
/// The longest wait for the rest of an answer's body: a body that trickles in would hold its
/// subscription's next delivery back for longer than a new connection costs.
const DRAIN_WAIT: Duration = Duration::from_millis(500);

/// Reads the rest of an answer's body, up to [`DRAIN_LIMIT`] and [`DRAIN_WAIT`]. hyper reuses a
/// connection only once its answer was read to the end: left unread, an answer longer than
/// what came with its head (64 KiB, an error page) cost every later delivery to that endpoint
/// a connection of its own, and for HTTPS a handshake. What the body says does not matter: the
/// status, which came before it, decides the attempt.
async fn drain(mut response: reqwest::Response) {
    let read_all = async {
        let mut read = 0;
        while read <= DRAIN_LIMIT {
            match response.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                Ok(None) | Err(_) => return,
            }
        }
    };
    // Cut short, the answer is dropped and its connection closed.
    let _ = tokio::time::timeout(DRAIN_WAIT, read_all).await;
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

/// Records an attempt and moves the queue, only if the lease is still ours; a `410 Gone`
/// disables the subscription in the same transaction.
async fn record(
    ctx: &Ctx,
    config: &WebhookConfig,
    lease: &Lease,
    item: &Queued,
    outcome: Outcome,
) -> Result<Recorded, CommandError> {
    let attempt = item.attempts + 1;
    let gone = matches!(outcome, Outcome::Gone(_));
    let mut tx = ctx.pool.begin().await?;
    let verdict = judge(config, attempt, outcome);
    if !settle(&mut tx, lease, item, attempt, &verdict, ctx.clock.now()).await? {
        // Deleted or disabled meanwhile, or the lease ran out and another worker took it.
        return Ok(Recorded {
            retry_in: None,
            disabled: false,
        });
    }
    log_attempt(&mut tx, lease, item, attempt, &verdict).await?;
    let disabled =
        gone && disable_gone(ctx, &mut tx, &lease.webhook_id, StatusCode::GONE.as_u16()).await?;
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

/// Reschedules the queue row (`Pending`) or removes it (the delivery is over), if the lease is
/// still ours; a retry is due its back-off after `now`. Whether it was.
async fn settle(
    tx: &mut PgConnection,
    lease: &Lease,
    item: &Queued,
    attempt: i32,
    verdict: &Verdict,
    now: DateTime<Utc>,
) -> Result<bool, sqlx::Error> {
    const HELD: &str = "EXISTS (SELECT 1 FROM webhook_leases WHERE webhook_id = $2 AND token = $3)";
    let done = if verdict.status == DeliveryStatus::Pending {
        sqlx::query(&format!(
            "UPDATE webhook_outbox
                SET attempts = $4, next_attempt_at = $6 + make_interval(secs => $5)
              WHERE id = $1 AND {HELD}"
        ))
        .bind(item.id)
        .bind(&lease.webhook_id)
        .bind(&lease.token)
        .bind(attempt)
        .bind(verdict.retry_in.unwrap_or_default().as_secs_f64())
        .bind(now)
        .execute(tx)
        .await?
    } else {
        sqlx::query(&format!(
            "DELETE FROM webhook_outbox WHERE id = $1 AND {HELD}"
        ))
        .bind(item.id)
        .bind(&lease.webhook_id)
        .bind(&lease.token)
        .execute(tx)
        .await?
    };
    Ok(done.rows_affected() == 1)
}

/// Adds the attempt to the subscription's delivery log.
async fn log_attempt(
    tx: &mut PgConnection,
    lease: &Lease,
    item: &Queued,
    attempt: i32,
    verdict: &Verdict,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO webhook_deliveries
                (webhook_id, event_id, attempt, status, response_code, error)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&lease.webhook_id)
    .bind(&item.event_id)
    .bind(attempt)
    .bind(verdict.status.as_str())
    .bind(verdict.code.map(i32::from))
    .bind(&verdict.error)
    .execute(tx)
    .await?;
    Ok(())
}

/// The URL's host as an address, when it is an IP literal.
fn literal_address(url: &str) -> Option<std::net::IpAddr> {
    vps_domain::webhook::literal_address(&reqwest::Url::parse(url).ok()?)
}
