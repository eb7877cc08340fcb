//! What the webhook commands take and answer.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use vps_events::AppendError;

/// A subscription as callers see it. The secret is shown once, by `create_webhook`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// The life of a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookState {
    /// Deliveries are made.
    Active,
    /// The endpoint answered `410 Gone`; nothing more is delivered.
    Disabled,
    /// Deleted by its owner.
    Deleted,
}

impl WebhookState {
    /// The form stored in `webhooks.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookState::Active => "active",
            WebhookState::Disabled => "disabled",
            WebhookState::Deleted => "deleted",
        }
    }

    pub(crate) fn parse(s: &str) -> WebhookState {
        match s {
            "active" => WebhookState::Active,
            "disabled" => WebhookState::Disabled,
            _ => WebhookState::Deleted,
        }
    }
}

/// The input of [`create_webhook`](super::create_webhook).
#[derive(Debug, Clone)]
pub struct NewWebhook {
    /// `http://` or `https://` URL with a host.
    pub url: String,
    /// At least one type pattern.
    pub types: Vec<String>,
    /// Scope the subscription to one tenant (the API sets it for tenant callers).
    pub tenant_id: Option<String>,
    /// Who asks (`id_…`), recorded in the event's metadata.
    pub actor: String,
}

/// The input of [`delete_webhook`](super::delete_webhook).
#[derive(Debug, Clone)]
pub struct DeleteWebhook {
    /// The subscription.
    pub id: String,
    /// The caller's tenant: a tenant may delete only its own subscriptions (`None` = operator).
    pub tenant_scope: Option<String>,
    /// Who asks, recorded in the event's metadata.
    pub actor: String,
}

/// A signing secret, `whsec_` + base64 of 24 random bytes. Shown to its owner once.
#[derive(Clone, PartialEq, Eq)]
pub struct WebhookSecret(pub String);

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Keeps secrets out of logs and panic messages.
        f.write_str("WebhookSecret(…)")
    }
}

/// One delivery attempt, as `webhooks.deliveries` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Delivery {
    /// The event delivered (also the `webhook-id` header).
    pub event_id: String,
    /// 1 for the first attempt of this event.
    pub attempt: i32,
    /// The delivery's state after this attempt.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

    pub(crate) fn parse(s: &str) -> DeliveryStatus {
        match s {
            "delivered" => DeliveryStatus::Delivered,
            "pending" => DeliveryStatus::Pending,
            _ => DeliveryStatus::Failed,
        }
    }
}

/// Why a webhook command failed.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The input is not acceptable (`INVALID_INPUT`).
    #[error("{field}: {message}")]
    Invalid {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// No such subscription, or not the caller's (`NOT_FOUND`).
    #[error("webhook {0} not found")]
    NotFound(String),
    /// The log refused the append.
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}
