//! The identity aggregate (stream `identity-<id>`): identities an operator creates at run time,
//! the API keys issued to them and their revocation. Keys themselves never enter the log:
//! events name a key by its public id only; the hash lives beside the log.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::DomainError;

/// `identity.created`: `{ id, tenantId?, operator, name }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityCreated {
    /// `id_…`.
    pub id: String,
    /// The tenant it acts for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Operators may do everything.
    pub operator: bool,
    /// For people.
    pub name: String,
}

/// `identity.key.issued`: `{ identityId, keyId }` (the key's public half only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeyIssued {
    /// The identity.
    pub identity_id: String,
    /// The key's public id.
    pub key_id: String,
}

/// `identity.keys.revoked`: `{ identityId, keyIds }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KeysRevoked {
    /// The identity.
    pub identity_id: String,
    /// The keys revoked.
    pub key_ids: Vec<String>,
}

crate::event_enum! {
    /// What happens to an identity.
    pub enum IdentityEvent {
        /// Created.
        Created(IdentityCreated) = "identity.created",
        /// An API key was issued.
        KeyIssued(KeyIssued) = "identity.key.issued",
        /// Its keys were revoked.
        KeysRevoked(KeysRevoked) = "identity.keys.revoked",
    }
}

/// An identity as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// `id_…`.
    pub id: String,
    /// The tenant it acts for.
    pub tenant_id: Option<String>,
    /// Operators may do everything.
    pub operator: bool,
    /// For people.
    pub name: String,
    /// Keys issued and not revoked.
    pub keys: Vec<String>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// Events in its stream.
    pub version: u64,
}

impl Aggregate for Identity {
    type Event = IdentityEvent;
    const CATEGORY: &'static str = "identity";

    fn create(event: &IdentityEvent, at: DateTime<Utc>) -> Option<Self> {
        let IdentityEvent::Created(c) = event else {
            return None;
        };
        Some(Identity {
            id: c.id.clone(),
            tenant_id: c.tenant_id.clone(),
            operator: c.operator,
            name: c.name.clone(),
            keys: Vec::new(),
            created_at: at,
            version: 1,
        })
    }

    fn apply(&mut self, event: &IdentityEvent, _at: DateTime<Utc>) {
        match event {
            IdentityEvent::Created(_) => {}
            IdentityEvent::KeyIssued(k) => self.keys.push(k.key_id.clone()),
            IdentityEvent::KeysRevoked(r) => self.keys.retain(|k| !r.key_ids.contains(k)),
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// Creates an identity with its first key: both events.
pub fn create(
    id: &str,
    tenant_id: Option<String>,
    operator: bool,
    name: &str,
    key_id: &str,
) -> Result<Vec<IdentityEvent>, DomainError> {
    if name.trim().is_empty() || name.len() > 128 {
        return Err(DomainError::invalid_input("name", "1 to 128 characters"));
    }
    match tenant_id.as_deref() {
        Some(t) if t.is_empty() || t.len() > 128 => {
            return Err(DomainError::invalid_input(
                "tenantId",
                "1 to 128 characters",
            ))
        }
        None if !operator => {
            return Err(DomainError::invalid_input(
                "tenantId",
                "a non-operator identity needs a tenant",
            ))
        }
        _ => {}
    }
    Ok(vec![
        IdentityEvent::Created(IdentityCreated {
            id: id.into(),
            tenant_id,
            operator,
            name: name.into(),
        }),
        IdentityEvent::KeyIssued(KeyIssued {
            identity_id: id.into(),
            key_id: key_id.into(),
        }),
    ])
}

/// Revokes every key of the identity (none left: nothing recorded).
pub fn revoke_keys(state: Option<&Identity>) -> Result<Vec<IdentityEvent>, DomainError> {
    let identity = state.ok_or_else(|| DomainError::NotFound {
        what: "identity".into(),
    })?;
    if identity.keys.is_empty() {
        return Ok(vec![]);
    }
    Ok(vec![IdentityEvent::KeysRevoked(KeysRevoked {
        identity_id: identity.id.clone(),
        key_ids: identity.keys.clone(),
    })])
}
