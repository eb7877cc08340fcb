//! The secret store: user data sealed with AES-256-GCM under the deployment key, referenced as
//! `secret://<instance id>`. Plaintext never reaches the log, a view or a log line.

use std::sync::Arc;

use aes_gcm::aead::{Aead, KeyInit};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use sqlx::{PgConnection, Row};

/// The deployment's sealing key.
#[derive(Clone)]
pub struct SecretKey(Arc<[u8; 32]>);

impl SecretKey {
    /// Wraps 32 key bytes.
    pub fn new(bytes: [u8; 32]) -> SecretKey {
        SecretKey(Arc::new(bytes))
    }

    /// A keyed digest of `message` under a key derived from this one for `purpose`, so a
    /// digest made for one purpose says nothing about another and none reveals the key:
    /// HMAC-SHA256(HMAC-SHA256(key, purpose), message), hex.
    pub fn digest(&self, purpose: &str, message: &[u8]) -> String {
        let derived = hmac_sha256(self.0.as_slice(), purpose.as_bytes());
        data_encoding::HEXLOWER.encode(&hmac_sha256(&derived, message))
    }

    fn cipher(&self) -> Aes256Gcm {
        Aes256Gcm::new(Key::<Aes256Gcm>::from_slice(self.0.as_slice()))
    }
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(***)")
    }
}

fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::{Hmac, Mac};
    let mut mac =
        <Hmac<sha2::Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

/// The reference of an instance's user data.
pub fn user_data_ref(instance_id: &str) -> String {
    format!("secret://{instance_id}")
}

/// Seals `plaintext` and stores it under `reference` (kept if it exists: a replayed create).
pub async fn seal(
    conn: &mut PgConnection,
    key: &SecretKey,
    reference: &str,
    instance_id: &str,
    plaintext: &[u8],
) -> Result<(), sqlx::Error> {
    seal_many(conn, key, &[(reference, instance_id, plaintext)]).await
}

/// Seals many secrets, each `(reference, instance id, plaintext)`, in one statement.
pub async fn seal_many(
    conn: &mut PgConnection,
    key: &SecretKey,
    secrets: &[(&str, &str, &[u8])],
) -> Result<(), sqlx::Error> {
    let cipher = key.cipher();
    let (mut nonces, mut sealed) = (Vec::new(), Vec::new());
    for (_, _, plaintext) in secrets {
        let nonce: [u8; 12] = rand::random();
        let ciphertext = cipher
            .encrypt(Nonce::from_slice(&nonce), *plaintext)
            .expect("AES-GCM encryption of an in-memory buffer cannot fail");
        nonces.push(nonce.to_vec());
        sealed.push(ciphertext);
    }
    sqlx::query(
        "INSERT INTO sealed_secrets (ref, instance_id, nonce, ciphertext)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[])
         ON CONFLICT (ref) DO NOTHING",
    )
    .bind(secrets.iter().map(|s| s.0).collect::<Vec<_>>())
    .bind(secrets.iter().map(|s| s.1).collect::<Vec<_>>())
    .bind(nonces)
    .bind(sealed)
    .execute(conn)
    .await?;
    Ok(())
}

/// Opens a sealed secret; `None` when it does not exist or does not open under this key.
pub async fn open(
    conn: &mut PgConnection,
    key: &SecretKey,
    reference: &str,
) -> Result<Option<Vec<u8>>, sqlx::Error> {
    let row = sqlx::query("SELECT nonce, ciphertext FROM sealed_secrets WHERE ref = $1")
        .bind(reference)
        .fetch_optional(conn)
        .await?;
    Ok(row.and_then(|r| {
        let nonce: Vec<u8> = r.get(0);
        let ciphertext: Vec<u8> = r.get(1);
        key.cipher()
            .decrypt(Nonce::from_slice(&nonce), ciphertext.as_slice())
            .ok()
    }))
}

/// Drops an instance's sealed secrets (its deletion completed).
pub async fn forget(conn: &mut PgConnection, instance_id: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM sealed_secrets WHERE instance_id = $1")
        .bind(instance_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// The reference of a tenant's own secret `name`: `secret://<tenant>/<name>`.
pub fn tenant_secret_ref(tenant_id: &str, name: &str) -> String {
    format!("secret://{tenant_id}/{name}")
}

/// The owner column of a tenant's secrets (instances' own secrets carry their instance id).
fn tenant_owner(tenant_id: &str) -> String {
    format!("tenant:{tenant_id}")
}

/// Seals a tenant's secret under its reference, replacing an earlier value (a rotation).
pub async fn put_tenant(
    conn: &mut PgConnection,
    key: &SecretKey,
    tenant_id: &str,
    name: &str,
    value: &[u8],
) -> Result<String, sqlx::Error> {
    let reference = tenant_secret_ref(tenant_id, name);
    let nonce: [u8; 12] = rand::random();
    let ciphertext = key
        .cipher()
        .encrypt(Nonce::from_slice(&nonce), value)
        .expect("AES-GCM encryption of an in-memory buffer cannot fail");
    sqlx::query(
        "INSERT INTO sealed_secrets (ref, instance_id, nonce, ciphertext) VALUES ($1, $2, $3, $4)
         ON CONFLICT (ref) DO UPDATE SET nonce = excluded.nonce, ciphertext = excluded.ciphertext",
    )
    .bind(&reference)
    .bind(tenant_owner(tenant_id))
    .bind(nonce.to_vec())
    .bind(ciphertext)
    .execute(conn)
    .await?;
    Ok(reference)
}

/// The references among `refs` that name no secret the tenant wrote itself (a platform-made
/// secret, another tenant's, or none at all).
pub async fn foreign_refs(
    conn: &mut PgConnection,
    tenant_id: &str,
    refs: &[&str],
) -> Result<Vec<String>, sqlx::Error> {
    let found: Vec<String> = sqlx::query_scalar(
        "SELECT ref FROM sealed_secrets WHERE ref = ANY($1) AND instance_id = $2",
    )
    .bind(refs)
    .bind(tenant_owner(tenant_id))
    .fetch_all(conn)
    .await?;
    Ok(refs
        .iter()
        .filter(|r| !found.iter().any(|f| f == *r))
        .map(|r| r.to_string())
        .collect())
}
