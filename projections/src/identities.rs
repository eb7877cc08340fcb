//! The `identities` table, from the `identity-<id>` streams, and the read behind
//! `identities.list`. Key hashes are not here (they are not in the log): see `api_keys`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgExecutor};
use vps_domain::identity::IdentityEvent;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one `identity.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let (id, keys_delta) = match crate::typed::<IdentityEvent>(e)? {
        IdentityEvent::Created(c) => {
            sqlx::query(
                "INSERT INTO identities (id, tenant_id, operator, name, keys, created_at, version)
                 VALUES ($1, $2, $3, $4, 0, $5, $6)",
            )
            .bind(&c.id)
            .bind(&c.tenant_id)
            .bind(c.operator)
            .bind(&c.name)
            .bind(e.recorded_at)
            .bind(e.version)
            .execute(conn)
            .await?;
            return Ok(());
        }
        IdentityEvent::KeyIssued(k) => (k.identity_id, 1),
        IdentityEvent::KeysRevoked(r) => (r.identity_id, -(r.key_ids.len() as i32)),
    };
    sqlx::query("UPDATE identities SET keys = keys + $2, version = $3 WHERE id = $1")
        .bind(&id)
        .bind(keys_delta)
        .bind(e.version)
        .execute(conn)
        .await?;
    Ok(())
}

/// An identity as `identities.*` answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdentityView {
    /// `id_…`.
    pub id: String,
    /// The tenant it acts for.
    pub tenant_id: Option<String>,
    /// Operators may do everything.
    pub operator: bool,
    /// For people.
    pub name: String,
    /// API keys issued and not revoked.
    pub keys: i32,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// Every identity created at run time, oldest first.
pub async fn list<'e>(db: impl PgExecutor<'e>) -> Result<Vec<IdentityView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, tenant_id, operator, name, keys, created_at FROM identities
          ORDER BY created_at, id",
    )
    .fetch_all(db)
    .await
}

/// An API key's stored hash and what its identity may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHolderRow {
    /// The identity the key belongs to.
    pub identity_id: String,
    /// The key secret's SHA-256 (from `api_keys`).
    pub hash: Vec<u8>,
    /// The tenant the identity acts for.
    pub tenant_id: Option<String>,
    /// Whether it is an operator.
    pub operator: bool,
}

/// The key `key_id` (its hash, from `api_keys`) joined with its identity, if both exist.
pub async fn key_holder<'e>(
    db: impl PgExecutor<'e>,
    key_id: &str,
) -> Result<Option<KeyHolderRow>, sqlx::Error> {
    let row: Option<(String, Vec<u8>, Option<String>, bool)> = sqlx::query_as(
        "SELECT k.identity_id, k.hash, i.tenant_id, i.operator
           FROM api_keys k JOIN identities i ON i.id = k.identity_id
          WHERE k.key_id = $1",
    )
    .bind(key_id)
    .fetch_optional(db)
    .await?;
    Ok(
        row.map(|(identity_id, hash, tenant_id, operator)| KeyHolderRow {
            identity_id,
            hash,
            tenant_id,
            operator,
        }),
    )
}
