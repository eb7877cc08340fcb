//! The `webhooks` table as a projection of the `webhook-<id>` streams, and the reads behind
//! `webhooks.list` and `webhooks.deliveries`. The projector is deterministic: it reads only the
//! event (time included), so replaying the log rebuilds the table exactly.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection, PgExecutor, Row};
use vps_domain::aggregate::Event;
use vps_domain::webhook::{self as domain, WebhookEvent, WebhookState};
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Most deliveries one [`deliveries`] call returns.
pub const MAX_DELIVERIES: i64 = 1000;

/// Applies one `webhook.*` event to the projection.
pub async fn apply(conn: &mut PgConnection, event: &RecordedEvent) -> Result<(), ProjectionError> {
    let typed = WebhookEvent::from_parts(&event.event_type, event.data.clone()).map_err(|e| {
        ProjectionError::Malformed {
            event_id: event.id.clone(),
            event_type: event.event_type.clone(),
            message: e.to_string(),
        }
    })?;
    let state = match &typed {
        WebhookEvent::Created(created) => return insert(conn, event, created).await,
        WebhookEvent::Deleted(_) => WebhookState::Deleted,
        WebhookEvent::Disabled(_) => WebhookState::Disabled,
    };
    // A deleted subscription stays deleted, whatever arrives after.
    sqlx::query(
        "UPDATE webhooks SET state = $2, updated_at = $3
          WHERE id = $1 AND state <> 'deleted'",
    )
    .bind(typed.webhook_id())
    .bind(state.as_str())
    .bind(event.recorded_at)
    .execute(conn)
    .await?;
    Ok(())
}

async fn insert(
    conn: &mut PgConnection,
    event: &RecordedEvent,
    created: &domain::Created,
) -> Result<(), ProjectionError> {
    // The creating event's log position orders `webhooks.list`.
    sqlx::query(
        "INSERT INTO webhooks (id, url, types, tenant_id, state, created_transaction_id,
                               created_position, created_at, updated_at)
         VALUES ($1, $2, $3, $4, 'active', $5::text::xid8, $6, $7, $7)
         ON CONFLICT (id) DO NOTHING",
    )
    .bind(&created.id)
    .bind(&created.url)
    .bind(&created.types)
    .bind(&created.tenant_id)
    .bind(event.transaction_id.to_string())
    .bind(event.position)
    .bind(event.recorded_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// A subscription as callers see it. The secret is shown once, by the create command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Webhook {
    /// `whk_` + lowercase ULID.
    pub id: String,
    /// Where deliveries are POSTed.
    pub url: String,
    /// Type patterns (`instance.*`, `sandbox.ready`, `*`).
    pub types: Vec<String>,
    /// When set, only this tenant's events are delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Whether deliveries are still made.
    pub state: WebhookState,
    /// When it was created (its `webhook.created` event's time).
    pub created_at: DateTime<Utc>,
}

impl From<domain::Webhook> for Webhook {
    fn from(w: domain::Webhook) -> Self {
        Webhook {
            id: w.id,
            url: w.url,
            types: w.types,
            tenant_id: w.tenant_id,
            state: w.state,
            created_at: w.created_at,
        }
    }
}

/// One delivery attempt, as `webhooks.deliveries` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Delivery {
    /// The event delivered (also the `webhook-id` header).
    pub event_id: String,
    /// 1 for the first attempt of this event.
    pub attempt: i32,
    /// The delivery's state after this attempt.
    #[sqlx(try_from = "String")]
    pub status: DeliveryStatus,
    /// The HTTP status, when the endpoint answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_code: Option<i32>,
    /// Why the attempt failed without an answer (timeout, connection refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// When the attempt ended.
    pub at: DateTime<Utc>,
}

/// A delivery's state after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeliveryStatus {
    /// The endpoint answered 2xx.
    Delivered,
    /// The attempt failed and another one is scheduled.
    Pending,
    /// The attempt failed and none follows (attempts exhausted, `410 Gone`).
    Failed,
}

impl DeliveryStatus {
    /// The form stored in `webhook_deliveries.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryStatus::Delivered => "delivered",
            DeliveryStatus::Pending => "pending",
            DeliveryStatus::Failed => "failed",
        }
    }
}

/// The stored form read back; anything but `delivered` and `pending` reads as failed.
impl From<String> for DeliveryStatus {
    fn from(s: String) -> DeliveryStatus {
        match s.as_str() {
            "delivered" => DeliveryStatus::Delivered,
            "pending" => DeliveryStatus::Pending,
            _ => DeliveryStatus::Failed,
        }
    }
}

const WEBHOOK_SELECT: &str = "SELECT id, url, types, tenant_id, state, created_at FROM webhooks";

/// One subscription, if it exists, is not deleted, and is visible to `tenant_scope`
/// (`None` = operator, sees all).
pub async fn get<'e>(
    db: impl PgExecutor<'e>,
    id: &str,
    tenant_scope: Option<&str>,
) -> Result<Option<Webhook>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{WEBHOOK_SELECT} WHERE id = $1 AND state <> 'deleted'
            AND ($2::text IS NULL OR tenant_id = $2)"
    ))
    .bind(id)
    .bind(tenant_scope)
    .fetch_optional(db)
    .await
}

/// The subscriptions visible to `tenant_scope` (`None` = every one), oldest first.
pub async fn list<'e>(
    db: impl PgExecutor<'e>,
    tenant_scope: Option<&str>,
) -> Result<Vec<Webhook>, sqlx::Error> {
    sqlx::query_as(&format!(
        "{WEBHOOK_SELECT} WHERE state <> 'deleted' AND ($1::text IS NULL OR tenant_id = $1)
          ORDER BY created_transaction_id, created_position"
    ))
    .bind(tenant_scope)
    .fetch_all(db)
    .await
}

/// The latest `limit` attempts (at most [`MAX_DELIVERIES`]) of a subscription, newest first.
/// The caller checks that the subscription is visible to it ([`get`]).
pub async fn deliveries<'e>(
    db: impl PgExecutor<'e>,
    webhook_id: &str,
    limit: i64,
) -> Result<Vec<Delivery>, sqlx::Error> {
    sqlx::query_as(
        "SELECT event_id, attempt, status, response_code, error, at FROM webhook_deliveries
          WHERE webhook_id = $1 ORDER BY id DESC LIMIT $2",
    )
    .bind(webhook_id)
    .bind(limit.clamp(1, MAX_DELIVERIES))
    .fetch_all(db)
    .await
}

/// The subscription's state is stored as text (the domain's form).
impl FromRow<'_, PgRow> for Webhook {
    fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        Ok(Webhook {
            id: row.try_get("id")?,
            url: row.try_get("url")?,
            types: row.try_get("types")?,
            tenant_id: row.try_get("tenant_id")?,
            state: WebhookState::parse(row.try_get("state")?),
            created_at: row.try_get("created_at")?,
        })
    }
}

/// An active subscription as the fan-out matches events against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveWebhook {
    /// `whk_…`.
    pub id: String,
    /// Type patterns.
    pub types: Vec<String>,
    /// When set, only this tenant's events.
    pub tenant_id: Option<String>,
    /// Its `webhook.created` event's place in the log: only later events are delivered.
    pub created: vps_events::Cursor,
}

/// Every active subscription.
pub async fn active<'e>(db: impl PgExecutor<'e>) -> Result<Vec<ActiveWebhook>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, types, tenant_id, created_transaction_id::text, created_position
           FROM webhooks WHERE state = 'active'",
    )
    .fetch_all(db)
    .await?;
    rows.iter()
        .map(|row| {
            let txid: String = row.try_get(3)?;
            Ok(ActiveWebhook {
                id: row.try_get(0)?,
                types: row.try_get(1)?,
                tenant_id: row.try_get(2)?,
                created: vps_events::Cursor {
                    transaction_id: txid.parse().map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
                    position: row.try_get(4)?,
                },
            })
        })
        .collect()
}

/// How many subscriptions (not deleted) `owner` has (`None`: operators' all-tenant ones).
pub async fn count_of_owner<'e>(
    db: impl PgExecutor<'e>,
    owner: Option<&str>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM webhooks WHERE tenant_id IS NOT DISTINCT FROM $1 AND state <> 'deleted'",
    )
    .bind(owner)
    .fetch_one(db)
    .await
}

/// The disabled subscriptions (`doctor`'s check).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disabled {
    /// How many.
    pub count: i64,
    /// The five most recently disabled, each `id (tenant or operator)`.
    pub some: Vec<String>,
}

/// How many subscriptions are disabled, and the latest few.
pub async fn disabled<'e>(db: impl PgExecutor<'e>) -> Result<Disabled, sqlx::Error> {
    let (count, some): (i64, Vec<String>) = sqlx::query_as(
        "SELECT count(*),
                coalesce((array_agg(id || ' (' || coalesce(tenant_id, 'operator') || ')'
                                    ORDER BY updated_at DESC))[1:5], '{}'::text[])
           FROM webhooks WHERE state = 'disabled'",
    )
    .fetch_one(db)
    .await?;
    Ok(Disabled { count, some })
}
