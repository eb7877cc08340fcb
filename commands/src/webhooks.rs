//! Webhook subscriptions: `webhooks.create`, `webhooks.delete`, and the delivery worker's
//! `410 Gone`. Each reads the subscription from its stream `webhook-<id>`, decides with
//! [`vps_domain::webhook::decide`] and records through [`pipeline::record_events`], so the
//! `webhooks` projection moves in the same transaction.
//!
//! The signing secret never enters the log, which every auditor reads: it is kept in
//! `webhook_secrets` (in the clear, since the dispatcher signs every attempt with it) and shown
//! to its owner once, in the answer to `create`.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use rand::RngCore;
use sqlx::PgConnection;
use vps_domain::webhook::{decide, Webhook, WebhookCommand, WebhookEvent, WebhookState};
use vps_domain::DomainError;
use vps_projections::webhooks::Webhook as WebhookView;

use crate::context::Ctx;
use crate::error::{retrying, CommandError};
use crate::pipeline::{self, commit};
use crate::record::new_id;

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
    WebhookSecret(format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
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
}

/// Creates a subscription and answers it with its secret (shown this once).
pub async fn create(
    ctx: &Ctx,
    new: NewWebhook,
) -> Result<(WebhookView, WebhookSecret), CommandError> {
    for pattern in &new.types {
        // The form subscribers are matched with is defined once, in `vps_events::pattern`.
        vps_events::pattern::validate(pattern)
            .map_err(|message| DomainError::invalid_input("types", message))?;
    }
    let secret = generate_secret();
    let hook = retrying("webhook", || create_once(ctx, &new, &secret)).await?;
    Ok((hook.into(), secret))
}

async fn create_once(
    ctx: &Ctx,
    new: &NewWebhook,
    secret: &WebhookSecret,
) -> Result<Webhook, CommandError> {
    let id = new_id("whk");
    let events = decide(
        None,
        WebhookCommand::Create {
            id: id.clone(),
            url: new.url.clone(),
            types: new.types.clone(),
            tenant_id: new.tenant_id.clone(),
            tenant_scope: new.tenant_scope.clone(),
        },
    )?;
    let tenant = match events.first() {
        Some(WebhookEvent::Created(created)) => created.tenant_id.clone(),
        _ => None,
    };
    let mut tx = ctx.pool.begin().await?;
    let hook = pipeline::record_events(ctx, &mut tx, &id, None, events, tenant.as_deref())
        .await?
        .ok_or_else(|| DomainError::invalid_state("webhook.created recorded nothing"))?;
    sqlx::query("INSERT INTO webhook_secrets (webhook_id, secret) VALUES ($1, $2)")
        .bind(&id)
        .bind(&secret.0)
        .execute(&mut *tx)
        .await?;
    commit(ctx, tx).await?;
    Ok(hook)
}

/// Deletes a subscription; its undelivered events are dropped. A tenant may delete only its
/// own (another's is `NOT_FOUND`); `tenant_scope` is `None` for operators.
pub async fn delete(ctx: &Ctx, id: &str, tenant_scope: Option<&str>) -> Result<(), CommandError> {
    retrying(id, || async move {
        let mut tx = ctx.pool.begin().await?;
        let command = WebhookCommand::Delete {
            id: id.to_string(),
            tenant_scope: tenant_scope.map(str::to_string),
        };
        change(ctx, &mut tx, id, command).await?;
        commit(ctx, tx).await
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
            .decode(a.0.strip_prefix(SECRET_PREFIX).unwrap())
            .unwrap();
        assert_eq!(key.len(), 24);
        assert_eq!(format!("{a:?}"), "WebhookSecret(…)");
    }
}
