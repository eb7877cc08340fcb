//! Provider accounts: the `provider_account.*` events' payloads, their projector, and the
//! account as the API shows it. Neither the events nor the table hold a secret: credentials
//! are sealed in the secret store and only their reference is kept.

use chrono::{DateTime, Utc};

use serde::Serialize;
use serde_json::{json, Value};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use vps_events::RecordedEvent;

use vps_domain::provider_account::ProviderAccountEvent;

use crate::ProjectionError;

/// Applies one `provider_account.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    match crate::typed::<ProviderAccountEvent>(e)? {
        ProviderAccountEvent::Created(d) => {
            sqlx::query(
                "INSERT INTO provider_accounts (id, name, provider, config, secret_ref, last_error,
                                                created_at, updated_at, version)
                 VALUES ($1, $2, $3, $4, $5, NULL, $6, $6, $7)",
            )
            .bind(&d.account_id)
            .bind(&d.name)
            .bind(&d.provider)
            .bind(Json(&d.config))
            .bind(&d.secret_ref)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        ProviderAccountEvent::ErrorRecorded(d) => {
            let error = json!({ "code": d.code, "message": d.message, "at": at });
            sqlx::query(
                "UPDATE provider_accounts SET last_error = $2, updated_at = $3, version = $4 WHERE id = $1",
            )
            .bind(&d.account_id)
            .bind(Json(error))
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
        ProviderAccountEvent::ErrorCleared(d) => {
            sqlx::query(
                "UPDATE provider_accounts SET last_error = NULL, updated_at = $2, version = $3 WHERE id = $1",
            )
            .bind(&d.account_id)
            .bind(at)
            .bind(e.version)
            .execute(conn)
            .await?;
        }
    }
    Ok(())
}

const SELECT: &str = "SELECT id, name, provider, config, secret_ref, last_error, created_at, updated_at, version FROM provider_accounts";

/// A provider account as the API shows it and the reconciler reads it: never a secret.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProviderAccountView {
    /// `pacct_…`.
    pub id: String,
    /// Unique name.
    pub name: String,
    /// `hetzner-cloud`, `proxmox` or `emulator`.
    pub provider: String,
    /// The configuration without its secret fields.
    pub config: Value,
    /// Where the secret fields are sealed.
    pub secret_ref: Option<String>,
    /// The last credential error, if it still stands: `{ code, message, at }`.
    pub last_error: Option<Value>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Its stream version.
    pub version: i64,
}

/// An account, or `None`.
pub async fn load<'e>(
    db: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<ProviderAccountView>, sqlx::Error> {
    crate::operator_views::one(db, &format!("{SELECT} WHERE id = $1"), id).await
}

/// Every account, by name.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<ProviderAccountView>, sqlx::Error> {
    let sql = format!("{SELECT} ORDER BY name, id");
    crate::operator_views::all(db, &sql, &[]).await
}
