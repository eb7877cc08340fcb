//! Webhook subscriptions: `webhooks.create`, `webhooks.delete`, and the delivery worker's
//! `410 Gone`. Each reads the subscription from its stream `webhook-<id>`, decides with
//! [`vps_domain::webhook::decide`] and records through [`pipeline::record_events`], so the
//! `webhooks` projection moves in the same transaction.
//!
//! The signing secret never enters the log, which every auditor reads: it is sealed in the
//! secret store under the deployment key (`secret://<whk id>/signing`), opened by the
//! dispatcher to sign each attempt, and shown to its owner once, in the answer to `create`.
//!
//! A create resolves the URL's host first (no transaction open), so a name that points into
//! the control plane's own networks is refused up front; delivery checks again at connect time.

use std::net::IpAddr;
use std::time::Duration;

use data_encoding::BASE64 as STANDARD;
use rand::RngCore;
use sqlx::PgConnection;
use vps_domain::network::IpCidr;
use vps_domain::webhook::{
    decide, CreateFacts, Webhook, WebhookCommand, WebhookEvent, WebhookState,
};
use vps_domain::DomainError;
use vps_projections::webhooks::Webhook as WebhookView;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline;
use crate::record::new_id;
use crate::secrets::{self, SecretKey};

/// How long a create waits for the URL's host to resolve before leaving the check to delivery.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The prefix Standard Webhooks secrets carry.
pub const SECRET_PREFIX: &str = "whsec_";

/// A signing secret, `whsec_` + base64 of 24 random bytes. Shown to its owner once.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(pub String);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keeps secrets out of logs and panic messages.
        f.write_str("WebhookSecret(…)")
    }
}

/// A fresh secret: `whsec_` + base64 of 24 bytes from the operating system's generator.
pub fn generate_secret() -> WebhookSecret {
    let mut key = [0u8; 24];
    rand::rngs::OsRng.fill_bytes(&mut key);
    WebhookSecret(format!("{SECRET_PREFIX}{}", STANDARD.encode(&key)))
}

/// The input of [`create`].
#[derive(Debug, Clone)]
pub struct NewWebhook {
    /// `http://` or `https://` URL with a host.
    pub url: String,
    /// At least one type pattern.
    pub types: Vec<String>,
    /// The tenant whose events it receives (operators: any or none; tenants: their own).
    pub tenant_id: Option<String>,
    /// The caller's tenant (`None`: an operator).
    pub tenant_scope: Option<String>,
    /// Internal networks the operator lets webhooks reach (`[webhooks] allow_private`).
    pub allow_private: Vec<IpCidr>,
}

/// The secret store's reference of a subscription's signing secret.
pub fn secret_ref(webhook_id: &str) -> String {
    format!("secret://{webhook_id}/signing")
}

/// Opens a subscription's signing secret; `None` when it is gone or does not open under `key`.
pub async fn open_secret(
    conn: &mut PgConnection,
    key: &SecretKey,
    webhook_id: &str,
) -> Result<Option<WebhookSecret>, sqlx::Error> {
    let opened = secrets::open(conn, key, &secret_ref(webhook_id)).await?;
    Ok(opened
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .map(WebhookSecret))
}

/// Creates a subscription and answers it with its secret (shown this once).
pub async fn create(
    ctx: &Ctx,
    new: NewWebhook,
) -> Result<(WebhookView, WebhookSecret), CommandError> {
    // The bound first: nothing below walks more than it.
    vps_domain::webhook::check_types(&new.types)?;
    for pattern in &new.types {
        // The form subscribers are matched with is defined once, in `vps_events::pattern`.
        vps_events::pattern::validate(pattern)
            .map_err(|message| DomainError::invalid_input("types", message))?;
    }
    let secret = generate_secret();
    let resolved = resolve(&new.url).await;
    let hook = pipeline::transaction(ctx, "webhook", async |tx| {
        create_in(ctx, tx, &new, &resolved, &secret).await
    })
    .await?;
    Ok((hook.into(), secret))
}

/// The addresses the URL's host resolves to; none when it is an IP literal, not a URL, or does
/// not resolve in time (delivery checks the addresses it connects to anyway).
async fn resolve(url: &str) -> Vec<IpAddr> {
    let Ok(parsed) = url::Url::parse(url) else {
        return Vec::new();
    };
    let host = match parsed.host() {
        Some(url::Host::Domain(host)) => host.to_string(),
        _ => return Vec::new(),
    };
    let port = parsed.port_or_known_default().unwrap_or(80);
    let lookup = tokio::net::lookup_host((host.as_str(), port));
    let resolved = tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await;
    match resolved {
        Ok(Ok(addresses)) => addresses.map(|a| a.ip()).collect(),
        _ => Vec::new(),
    }
}

async fn create_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    new: &NewWebhook,
    resolved: &[IpAddr],
    secret: &WebhookSecret,
) -> Result<Webhook, CommandError> {
    let id = new_id("whk");
    // The tenant the subscription would belong to (a tenant naming another is refused below).
    let owner = new.tenant_scope.clone().or_else(|| new.tenant_id.clone());
    let existing = count_for_owner(tx, owner.as_deref()).await?;
    let facts = CreateFacts {
        resolved: resolved.to_vec(),
        allow_private: new.allow_private.clone(),
        existing,
    };
    let events = decide(
        None,
        WebhookCommand::Create {
            id: id.clone(),
            url: new.url.clone(),
            types: new.types.clone(),
            tenant_id: new.tenant_id.clone(),
            tenant_scope: new.tenant_scope.clone(),
            facts,
        },
    )?;
    let tenant = match events.first() {
        Some(WebhookEvent::Created(created)) => created.tenant_id.clone(),
        _ => None,
    };
    let hook = pipeline::record_existing(ctx, tx, &id, None, events, tenant.as_deref()).await?;
    secrets::seal(tx, &ctx.secrets, &secret_ref(&id), &id, secret.0.as_bytes()).await?;
    Ok(hook)
}

/// The subscriptions (not deleted) of `owner` (`None`: operators' all-tenant ones), counted
/// under a lock on that owner held to commit, so concurrent creates cannot pass the cap
/// together.
async fn count_for_owner(tx: &mut PgConnection, owner: Option<&str>) -> Result<usize, sqlx::Error> {
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('webhooks:' || coalesce($1, ''), 0))",
    )
    .bind(owner)
    .execute(&mut *tx)
    .await?;
    let count = vps_projections::webhooks::count_of_owner(&mut *tx, owner).await?;
    Ok(count as usize)
}

/// Seals the signing secrets stored in the clear by earlier versions (`webhook_secrets`) and
/// drops the clear copies. Returns how many it sealed.
pub async fn seal_plain_secrets(
    pool: &sqlx::PgPool,
    key: &SecretKey,
) -> Result<usize, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let plain: Vec<(String, String)> =
        sqlx::query_as("SELECT webhook_id, secret FROM webhook_secrets FOR UPDATE")
            .fetch_all(&mut *tx)
            .await?;
    for (id, secret) in &plain {
        secrets::seal(&mut tx, key, &secret_ref(id), id, secret.as_bytes()).await?;
    }
    sqlx::query("DELETE FROM webhook_secrets")
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(plain.len())
}

/// Deletes a subscription; its undelivered events are dropped. A tenant may delete only its
/// own (another's is `NOT_FOUND`); `tenant_scope` is `None` for operators.
pub async fn delete(ctx: &Ctx, id: &str, tenant_scope: Option<&str>) -> Result<(), CommandError> {
    pipeline::transaction(ctx, id, async |tx| {
        let command = WebhookCommand::Delete {
            id: id.to_string(),
            tenant_scope: tenant_scope.map(str::to_string),
        };
        change(ctx, tx, id, command).await?;
        Ok(())
    })
    .await
}

/// Disables an active subscription whose endpoint answered `response_code` (410 Gone), in the
/// caller's transaction so the attempt that saw it is recorded with it. Whether it was active.
pub async fn disable_gone(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    response_code: u16,
) -> Result<bool, CommandError> {
    let command = WebhookCommand::Disable {
        id: id.to_string(),
        response_code,
    };
    change(ctx, tx, id, command).await
}

/// Decides `command` on the stored subscription and records what it decided. A subscription
/// that stops delivering loses its queue, and a deleted one its secret too. Whether anything
/// was recorded.
async fn change(
    ctx: &Ctx,
    tx: &mut PgConnection,
    id: &str,
    command: WebhookCommand,
) -> Result<bool, CommandError> {
    let before = pipeline::load::<Webhook>(tx, id).await?;
    let events = decide(before.as_ref(), command)?;
    if events.is_empty() {
        return Ok(false);
    }
    let tenant = before.as_ref().and_then(|b| b.tenant_id.clone());
    let after =
        pipeline::record_events(ctx, tx, id, before.as_ref(), events, tenant.as_deref()).await?;
    sqlx::query("DELETE FROM webhook_outbox WHERE webhook_id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await?;
    if after.is_some_and(|a| a.state == WebhookState::Deleted) {
        secrets::forget(tx, id).await?;
        // Secrets stored before they were sealed.
        sqlx::query("DELETE FROM webhook_secrets WHERE webhook_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_carry_24_random_bytes() {
        let a = generate_secret();
        let b = generate_secret();
        assert_ne!(a, b);
        let key = STANDARD
            .decode(a.0.strip_prefix(SECRET_PREFIX).unwrap().as_ref())
            .unwrap();
        assert_eq!(key.len(), 24);
        assert_eq!(format!("{a:?}"), "WebhookSecret(…)");
    }
}
