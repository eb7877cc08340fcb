//! The webhook commands the API calls: each appends to `webhook-<id>` and applies the
//! projection in one transaction, and the reads behind `webhooks.list` / `.deliveries`.

use serde_json::json;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use vps_events::pattern;
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier};

use super::model::{
    DeleteWebhook, Delivery, DeliveryStatus, NewWebhook, Webhook, WebhookError, WebhookSecret,
    WebhookState,
};
use super::signature::generate_secret;
use vps_projections::webhooks::{self as projection, CREATED, DELETED, DISABLED};

/// The actor recorded on events the delivery worker appends.
pub const REACTOR_ACTOR: &str = "reactor:webhooks";

/// Most deliveries one `list_deliveries` call returns.
pub const MAX_DELIVERIES: i64 = 1000;

/// Creates a subscription and returns it with its secret (shown this once).
///
/// The secret goes to `webhook_secrets`, never into the log that every auditor reads.
pub async fn create_webhook(
    pool: &PgPool,
    notifier: &Notifier,
    new: NewWebhook,
) -> Result<(Webhook, WebhookSecret), WebhookError> {
    validate_url(&new.url)?;
    let types = validate_types(new.types)?;
    let id = format!("whk_{}", ulid::Ulid::generate().to_string().to_lowercase());
    let secret = generate_secret();
    let mut data = json!({ "id": id, "url": new.url, "types": types });
    if let Some(tenant) = &new.tenant_id {
        data["tenantId"] = json!(tenant);
    }
    let event = new_event(CREATED, data, new.tenant_id.clone(), new.actor);

    let mut tx = pool.begin().await?;
    let recorded = append(&mut tx, &stream(&id), ExpectedVersion::NoStream, &[event]).await?;
    for e in &recorded {
        projection::apply(&mut tx, e).await?;
    }
    sqlx::query("INSERT INTO webhook_secrets (webhook_id, secret) VALUES ($1, $2)")
        .bind(&id)
        .bind(&secret.0)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    notifier.committed();

    let webhook = get_webhook(pool, &id, None)
        .await?
        .ok_or_else(|| WebhookError::NotFound(id.clone()))?;
    Ok((webhook, secret))
}

/// Deletes a subscription; its undelivered events are dropped. A tenant caller may delete
/// only its own subscriptions (another's is `NotFound`).
pub async fn delete_webhook(
    pool: &PgPool,
    notifier: &Notifier,
    delete: DeleteWebhook,
) -> Result<(), WebhookError> {
    let mut tx = pool.begin().await?;
    let row = sqlx::query("SELECT tenant_id, state FROM webhooks WHERE id = $1 FOR UPDATE")
        .bind(&delete.id)
        .fetch_optional(&mut *tx)
        .await?;
    let tenant: Option<String> = match row {
        Some(row) if row.get::<String, _>(1) != "deleted" => row.get(0),
        _ => return Err(WebhookError::NotFound(delete.id)),
    };
    if delete.tenant_scope.is_some() && delete.tenant_scope != tenant {
        return Err(WebhookError::NotFound(delete.id));
    }
    let event = new_event(DELETED, json!({ "id": delete.id }), tenant, delete.actor);
    // The row lock above orders commands on this subscription, so any version will do.
    let recorded = append(&mut tx, &stream(&delete.id), ExpectedVersion::Any, &[event]).await?;
    for e in &recorded {
        projection::apply(&mut tx, e).await?;
    }
    drop_queue(&mut tx, &delete.id).await?;
    sqlx::query("DELETE FROM webhook_secrets WHERE webhook_id = $1")
        .bind(&delete.id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    notifier.committed();
    Ok(())
}

/// One subscription, if it exists, is not deleted, and is visible to `tenant_scope`
/// (`None` = operator, sees all).
pub async fn get_webhook(
    pool: &PgPool,
    id: &str,
    tenant_scope: Option<&str>,
) -> Result<Option<Webhook>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, url, types, tenant_id, state, created_at FROM webhooks
          WHERE id = $1 AND state <> 'deleted'
            AND ($2::text IS NULL OR tenant_id = $2)",
    )
    .bind(id)
    .bind(tenant_scope)
    .fetch_optional(pool)
    .await?;
    row.as_ref().map(decode_webhook).transpose()
}

/// The subscriptions visible to `tenant_scope` (`None` = every one), oldest first.
pub async fn list_webhooks(
    pool: &PgPool,
    tenant_scope: Option<&str>,
) -> Result<Vec<Webhook>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, url, types, tenant_id, state, created_at FROM webhooks
          WHERE state <> 'deleted' AND ($1::text IS NULL OR tenant_id = $1)
          ORDER BY created_transaction_id, created_position",
    )
    .bind(tenant_scope)
    .fetch_all(pool)
    .await?;
    rows.iter().map(decode_webhook).collect()
}

/// The latest `limit` attempts (at most [`MAX_DELIVERIES`]) of a subscription, newest first.
/// The caller checks that the subscription is visible to it ([`get_webhook`]).
pub async fn list_deliveries(
    pool: &PgPool,
    webhook_id: &str,
    limit: i64,
) -> Result<Vec<Delivery>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT event_id, attempt, status, response_code, error, at FROM webhook_deliveries
          WHERE webhook_id = $1 ORDER BY id DESC LIMIT $2",
    )
    .bind(webhook_id)
    .bind(limit.clamp(1, MAX_DELIVERIES))
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            Ok(Delivery {
                event_id: row.try_get(0)?,
                attempt: row.try_get(1)?,
                status: DeliveryStatus::parse(row.try_get(2)?),
                response_code: row.try_get(3)?,
                error: row.try_get(4)?,
                at: row.try_get(5)?,
            })
        })
        .collect()
}

/// Disables an active subscription whose endpoint answered `410 Gone`, in the caller's
/// transaction: appends `webhook.disabled` and drops its queue. Returns whether it was active.
pub(crate) async fn disable_gone(
    tx: &mut PgConnection,
    webhook_id: &str,
    response_code: u16,
) -> Result<bool, WebhookError> {
    let row = sqlx::query("SELECT tenant_id, state FROM webhooks WHERE id = $1 FOR UPDATE")
        .bind(webhook_id)
        .fetch_optional(&mut *tx)
        .await?;
    let tenant: Option<String> = match row {
        Some(row) if row.get::<String, _>(1) == "active" => row.get(0),
        _ => return Ok(false),
    };
    let data = json!({
        "id": webhook_id,
        "reason": "the endpoint answered 410 Gone",
        "responseCode": response_code,
    });
    let event = new_event(DISABLED, data, tenant, REACTOR_ACTOR.into());
    let recorded = append(tx, &stream(webhook_id), ExpectedVersion::Any, &[event]).await?;
    for e in &recorded {
        projection::apply(tx, e).await?;
    }
    drop_queue(tx, webhook_id).await?;
    Ok(true)
}

fn stream(id: &str) -> String {
    format!("webhook-{id}")
}

fn new_event(
    event_type: &str,
    data: serde_json::Value,
    tenant_id: Option<String>,
    actor: String,
) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: event_type.into(),
        data,
        metadata: Metadata {
            tenant_id,
            actor: Some(actor),
            ..Metadata::default()
        },
    }
}

/// Undelivered events of a subscription that will never be delivered.
async fn drop_queue(tx: &mut PgConnection, webhook_id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM webhook_outbox WHERE webhook_id = $1")
        .bind(webhook_id)
        .execute(tx)
        .await?;
    Ok(())
}

fn decode_webhook(row: &PgRow) -> Result<Webhook, sqlx::Error> {
    Ok(Webhook {
        id: row.try_get(0)?,
        url: row.try_get(1)?,
        types: row.try_get(2)?,
        tenant_id: row.try_get(3)?,
        state: WebhookState::parse(row.try_get(4)?),
        created_at: row.try_get(5)?,
    })
}

fn validate_url(url: &str) -> Result<(), WebhookError> {
    let invalid = |message: &str| WebhookError::Invalid {
        field: "url",
        message: message.into(),
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| invalid(&format!("not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid("must be an http:// or https:// URL"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("must name a host"));
    }
    Ok(())
}

/// Validated patterns, duplicates removed, order kept.
fn validate_types(types: Vec<String>) -> Result<Vec<String>, WebhookError> {
    if types.is_empty() {
        return Err(WebhookError::Invalid {
            field: "types",
            message: "at least one event type pattern is required (e.g. `instance.*`)".into(),
        });
    }
    let mut kept: Vec<String> = Vec::with_capacity(types.len());
    for t in types {
        pattern::validate(&t).map_err(|message| WebhookError::Invalid {
            field: "types",
            message,
        })?;
        if !kept.contains(&t) {
            kept.push(t);
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_http_and_https_urls_with_a_host_are_accepted() {
        for good in ["http://127.0.0.1:8080/hook", "https://example.com/x?y=1"] {
            assert!(validate_url(good).is_ok(), "{good}");
        }
        for bad in ["ftp://example.com/", "mailto:a@b.c", "not a url", "http://"] {
            assert!(validate_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn type_patterns_are_validated_and_deduplicated() {
        let kept = validate_types(vec!["instance.*".into(), "instance.*".into(), "*".into()]);
        assert_eq!(kept.unwrap(), vec!["instance.*", "*"]);
        assert!(validate_types(vec![]).is_err());
        assert!(validate_types(vec!["Instance.*".into()]).is_err());
    }
}
