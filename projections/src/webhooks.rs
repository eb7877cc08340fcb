//! The `webhooks` table as a projection of the `webhook-<id>` streams. Deterministic: it reads
//! only the event (time included), so replaying the log rebuilds the table exactly.

use serde::Deserialize;
use sqlx::PgConnection;
use vps_events::RecordedEvent;

/// Subscription created: `{ id, url, types, tenantId? }` (the secret is not in the log).
pub const CREATED: &str = "webhook.created";
/// Subscription removed by its owner: `{ id }`.
pub const DELETED: &str = "webhook.deleted";
/// The endpoint answered `410 Gone`: `{ id, reason, responseCode }`.
pub const DISABLED: &str = "webhook.disabled";

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Created {
    id: String,
    url: String,
    types: Vec<String>,
    #[serde(default)]
    tenant_id: Option<String>,
}

#[derive(Deserialize)]
struct Changed {
    id: String,
}

/// Applies one event to the projection; other types are ignored.
pub async fn apply(conn: &mut PgConnection, event: &RecordedEvent) -> Result<(), sqlx::Error> {
    let decode = |e: serde_json::Error| sqlx::Error::Decode(Box::new(e));
    match event.event_type.as_str() {
        CREATED => {
            let created: Created = serde_json::from_value(event.data.clone()).map_err(decode)?;
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
        }
        DISABLED | DELETED => {
            let changed: Changed = serde_json::from_value(event.data.clone()).map_err(decode)?;
            let state = if event.event_type == DELETED {
                "deleted"
            } else {
                "disabled"
            };
            // A deleted subscription stays deleted, whatever arrives after.
            sqlx::query(
                "UPDATE webhooks SET state = $2, updated_at = $3
                  WHERE id = $1 AND state <> 'deleted'",
            )
            .bind(&changed.id)
            .bind(state)
            .bind(event.recorded_at)
            .execute(conn)
            .await?;
        }
        _ => {}
    }
    Ok(())
}
