//! Identities and API keys created at run time: `identities.create` and `apiKeys.revoke`.
//!
//! A key is `vpk_<keyId>_<secret>`: the key id finds its row, and the secret's SHA-256 is
//! compared in constant time. Only the hash is stored (in `api_keys`, beside the log, like
//! webhook secrets); events name the key id only. A revoke deletes the rows in the transaction
//! that records it, so every replica refuses the key from its commit on.

use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use vps_domain::identity::{self as domain, Identity};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change, record_existing, transaction};
use crate::record::new_id;

/// The prefix of API keys.
pub const KEY_PREFIX: &str = "vpk_";

/// An API key, shown once.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// `identities.create`, the input of [`create`].
#[derive(Debug, Clone, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(rename = "CreateIdentity")]
pub struct NewIdentity {
    /// The tenant it acts for (required unless `operator`).
    pub tenant_id: Option<String>,
    /// Operators may do everything (default false).
    #[serde(default)]
    pub operator: bool,
    /// For people, 1 to 128 characters.
    pub name: String,
}

/// Creates an identity with its first API key; answers both (the key this once).
pub async fn create(ctx: &Ctx, new: NewIdentity) -> Result<(Identity, ApiKey), CommandError> {
    let id = new_id("id");
    let key_id = data_encoding::HEXLOWER.encode(&rand::random::<[u8; 8]>());
    let mut secret = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut secret);
    let secret = data_encoding::HEXLOWER.encode(&secret);
    let events = domain::create(&id, new.tenant_id, new.operator, &new.name, &key_id)?;
    let identity = transaction(ctx, &id, async |tx| {
        let tenant = new_tenant(&events);
        let identity =
            record_existing::<Identity>(ctx, tx, &id, None, events.clone(), tenant).await?;
        sqlx::query("INSERT INTO api_keys (key_id, identity_id, hash) VALUES ($1, $2, $3)")
            .bind(&key_id)
            .bind(&id)
            .bind(Sha256::digest(secret.as_bytes()).to_vec())
            .execute(&mut *tx)
            .await?;
        Ok(identity)
    })
    .await?;
    Ok((identity, ApiKey(format!("{KEY_PREFIX}{key_id}_{secret}"))))
}

fn new_tenant(events: &[domain::IdentityEvent]) -> Option<&str> {
    match events.first() {
        Some(domain::IdentityEvent::Created(c)) => c.tenant_id.as_deref(),
        _ => None,
    }
}

/// Revokes every key of an identity; answers how many were revoked.
pub async fn revoke_keys(ctx: &Ctx, identity_id: &str) -> Result<usize, CommandError> {
    transaction(ctx, identity_id, async |tx| {
        let before = crate::pipeline::load::<Identity>(tx, identity_id).await?;
        let revoked = before.as_ref().map_or(0, |i| i.keys.len());
        let tenant = before.as_ref().and_then(|i| i.tenant_id.clone());
        change::<Identity>(ctx, tx, identity_id, tenant.as_deref(), domain::revoke_keys).await?;
        sqlx::query("DELETE FROM api_keys WHERE identity_id = $1")
            .bind(identity_id)
            .execute(&mut *tx)
            .await?;
        Ok(revoked)
    })
    .await
}

/// Who an API key authenticates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyHolder {
    /// `id_…`.
    pub identity_id: String,
    /// The tenant it acts for.
    pub tenant_id: Option<String>,
    /// Operators may do everything.
    pub operator: bool,
}

/// The identity an API key belongs to, when the key is current. The secret's hash is compared
/// in constant time.
pub async fn authenticate(
    pool: &sqlx::PgPool,
    key: &str,
) -> Result<Option<KeyHolder>, CommandError> {
    let Some((key_id, secret)) = key.strip_prefix(KEY_PREFIX).and_then(|k| k.split_once('_'))
    else {
        return Ok(None);
    };
    let Some(row) = vps_projections::identities::key_holder(pool, key_id).await? else {
        return Ok(None);
    };
    let presented = Sha256::digest(secret.as_bytes());
    if !bool::from(presented.as_slice().ct_eq(&row.hash)) {
        return Ok(None);
    }
    Ok(Some(KeyHolder {
        identity_id: row.identity_id,
        tenant_id: row.tenant_id,
        operator: row.operator,
    }))
}
