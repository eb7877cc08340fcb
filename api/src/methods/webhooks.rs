//! `webhooks.*`: subscriptions to the log delivered as signed POSTs. Tenants manage their
//! own; operators any, or all-tenant ones.

use serde::{Deserialize, Serialize};
use vps_commands::webhooks::{self as commands, NewWebhook};
use vps_commands::Deleted;
use vps_projections::webhooks::{self as views, Delivery, Webhook, MAX_DELIVERIES};

use super::events::scope;
use super::missing;
use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Items, Method, NoParams};
use vps_domain::ids::WebhookId;

/// `webhooks.create`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateWebhook {
    /// Where deliveries are POSTed (http or https).
    url: String,
    /// Type patterns (`instance.*`): at most 64, each at most 128 characters.
    #[serde(deserialize_with = "vps_domain::bounds::strings::<_, 64, 128>")]
    #[schemars(length(max = 64), inner(length(max = 128)))]
    types: Vec<String>,
    /// Operators: one tenant's events only; tenants: their own (the default).
    tenant_id: Option<String>,
}

/// A webhook by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WebhookRef {
    /// `wh_…`.
    webhook_id: WebhookId,
}

/// `webhooks.deliveries`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// `wh_…`.
    webhook_id: WebhookId,
    /// 1 to 1000 (default 100).
    limit: Option<i64>,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "webhooks",
            "create",
            Tenant,
            "Subscribes a URL; answers its secret once.",
            create,
        ),
        Method::new("webhooks", "list", Tenant, "The caller's webhooks.", list),
        Method::new("webhooks", "delete", Tenant, "Deletes a webhook.", delete),
        Method::new(
            "webhooks",
            "deliveries",
            Tenant,
            "A webhook's delivery attempts, newest first.",
            deliveries,
        ),
    ]
}

/// `webhooks.create`'s answer: the subscription and its signing secret, shown once.
#[derive(Serialize, schemars::JsonSchema)]
pub struct CreatedWebhook {
    /// The subscription.
    #[serde(flatten)]
    webhook: Webhook,
    /// The signing secret (`whsec_…`).
    secret: String,
}

async fn create(c: Call, q: CreateWebhook) -> Result<CreatedWebhook, ApiError> {
    let new = NewWebhook {
        url: q.url,
        types: q.types,
        tenant_id: q.tenant_id,
        tenant_scope: scope(&c.caller)?,
        allow_private: c.config.webhooks.allowed_networks(),
    };
    let (hook, secret) = commands::create(&c.ctx, new).await?;
    Ok(CreatedWebhook {
        webhook: hook,
        secret: secret.0,
    })
}

async fn list(c: Call, _: NoParams) -> Result<Items<Webhook>, ApiError> {
    let tenant_scope = scope(&c.caller)?;
    Ok(views::list(&c.ctx.pool, tenant_scope.as_deref())
        .await?
        .into())
}

async fn delete(c: Call, q: WebhookRef) -> Result<Deleted, ApiError> {
    let tenant_scope = scope(&c.caller)?;
    commands::delete(&c.ctx, &q.webhook_id, tenant_scope.as_deref()).await?;
    Ok(Deleted::of(&q.webhook_id))
}

async fn deliveries(c: Call, q: DeliveriesQuery) -> Result<Items<Delivery>, ApiError> {
    let tenant_scope = scope(&c.caller)?;
    views::get(&c.ctx.pool, &q.webhook_id, tenant_scope.as_deref())
        .await?
        .ok_or_else(|| missing("webhook", &q.webhook_id))?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_DELIVERIES).contains(&limit) {
        return Err(ApiError::invalid("limit", "1 to 1000"));
    }
    Ok(views::deliveries(&c.ctx.pool, &q.webhook_id, limit)
        .await?
        .into())
}
