//! The signed, ordered, retried delivery of webhook subscriptions (SPEC §4.3).
//!
//! Subscriptions themselves are elsewhere: the aggregate and its rules in
//! `vps_domain::webhook`, create/delete (and the secret) in `vps_commands::webhooks`, the
//! `webhooks` table and the reads in `vps_projections::webhooks`. Here:
//! - `signature`: Standard Webhooks signatures;
//! - `fanout`, `dispatch`, `backoff`: the delivery worker ([`run_webhook_delivery`]), which
//!   disables a subscription whose endpoint answers `410 Gone` through the same command path.
//!
//! ## Why a fan-out follower and a queue, not one follower per subscription
//!
//! One follower (`webhooks`, single across replicas by lease) reads the log once, matches each
//! event against every active subscription (types, tenant, created before the event) and
//! inserts one `webhook_outbox` row per match in the transaction that moves its checkpoint.
//! The dispatcher then attempts only each subscription's first row in log order, one attempt
//! in flight per subscription, on separate tasks. So:
//! - the log is read once, however many subscriptions exist (a follower per subscription would
//!   re-read it N times and need N leases);
//! - a dead endpoint holds back only its own queue, whose first row waits out its back-off,
//!   while other subscriptions' rows are claimed and sent;
//! - the queue is durable: a restart resumes every subscription where it was, and every replica
//!   can dispatch (claims are row leases), not just the lease holder.
//!
//! Secrets are sealed in the secret store, never in the log; `guard` keeps deliveries out of
//! the control plane's own networks.

mod backoff;
mod dispatch;
mod fanout;
mod guard;
pub mod signature;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use vps_commands::{Actor, Ctx};
use vps_domain::network::IpCidr;

pub use backoff::{parse_retry_after, retry_delay};
pub use fanout::{FOLLOWER, LEASE};

/// The actor recorded on events the delivery worker appends.
pub const REACTOR_ACTOR: &str = "reactor:webhooks";

/// How the delivery worker behaves.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// The longest an endpoint may take to answer; a timeout counts as a failed attempt.
    pub request_timeout: Duration,
    /// How much longer than `request_timeout` a subscription's lease lasts; the worker renews
    /// it whenever half of this has passed, before its next POST.
    pub lease_margin: Duration,
    /// Internal networks deliveries may reach (`[webhooks] allow_private`).
    pub allow_private: Vec<IpCidr>,
    /// The wait after the first failed attempt; it doubles per attempt (with jitter).
    pub base_delay: Duration,
    /// The longest wait between attempts, also the cap on `Retry-After`.
    pub max_delay: Duration,
    /// Attempts per event before it is recorded `failed` and the subscription moves on.
    pub max_attempts: u32,
    /// Attempts in flight at once in this process (one per subscription at most).
    pub concurrency: usize,
    /// How often the dispatcher looks for due rows without being woken.
    pub poll_interval: Duration,
    /// Events the fan-out reads per pass.
    pub fanout_batch: i64,
    /// How long a task whose queue runs empty keeps its lease, waiting for the fan-out to queue
    /// more: a steady stream of events then costs no claim, secret lookup and release per
    /// run. The idle time counts from the last run found, so a task woken only by other
    /// subscriptions' rows still hands its slot back.
    pub linger: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            request_timeout: Duration::from_secs(10),
            lease_margin: Duration::from_secs(30),
            allow_private: Vec::new(),
            base_delay: Duration::from_secs(5),
            max_delay: Duration::from_secs(3600),
            max_attempts: 12,
            concurrency: 64,
            poll_interval: Duration::from_secs(1),
            fanout_batch: 500,
            linger: Duration::from_millis(500),
        }
    }
}

/// Runs webhook delivery forever: the fan-out (on the replica holding its lease) and the
/// dispatcher (on every replica), signing with secrets sealed under the context's key, on its
/// clock. Spawn it once per server.
pub async fn run_webhook_delivery(ctx: Ctx, config: WebhookConfig) {
    let ctx = reactor_ctx(ctx);
    let (pool, notifier, secrets) = (&ctx.pool, &ctx.notifier, &ctx.secrets);
    let client = reqwest::Client::builder()
        .timeout(config.request_timeout)
        // A redirect would send the signed body somewhere its owner did not register.
        .redirect(reqwest::redirect::Policy::none())
        // A proxy would be dialled instead of the checked addresses.
        .no_proxy()
        .dns_resolver(Arc::new(guard::GuardedResolver::new(
            config.allow_private.clone(),
        )))
        .user_agent("vps-webhooks")
        .build()
        .expect("the webhook HTTP client builds");
    if let Err(e) = vps_commands::webhooks::seal_plain_secrets(pool, secrets).await {
        tracing::warn!(error = %e, "cannot seal webhook secrets stored in the clear");
    }
    let enqueued = Arc::new(watch::Sender::new(0u64));
    tokio::join!(
        fanout::run(
            pool.clone(),
            notifier.clone(),
            config.clone(),
            enqueued.clone()
        ),
        dispatch::run(ctx.clone(), config, client, enqueued),
    );
}

/// `ctx` acting as the dispatcher, as it does when it disables a subscription; its key opens
/// signing secrets.
fn reactor_ctx(ctx: Ctx) -> Ctx {
    Ctx {
        // Webhook commands never move a node's spec.
        spec_signals: Default::default(),
        actor: Actor {
            identity: REACTOR_ACTOR.to_string(),
            tenant: None,
            operator: true,
        },
        request_id: None,
        ..ctx
    }
}
