//! The stored Cedar policy aggregate (stream `policy-<id>`): `policies.put` and
//! `policies.delete`. Every change is an event, so a policy's history is in the log.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::authz::{check_policy_id, AuthzSchema};
use crate::DomainError;

/// `policy.put`: `{ id, tenantId?, text }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyPut {
    /// The policy's id.
    pub id: String,
    /// When set, it applies only within this tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// Cedar text.
    pub text: String,
}

/// `policy.deleted`: `{ id }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyDeleted {
    /// The policy's id.
    pub id: String,
}

crate::event_enum! {
    /// What happens to a stored policy.
    pub enum PolicyEvent {
        /// Created or replaced.
        Put(PolicyPut) = "policy.put",
        /// Removed.
        Deleted(PolicyDeleted) = "policy.deleted",
    }
}

/// A stored policy as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredPolicy {
    /// Its id.
    pub id: String,
    /// The tenant it is scoped to.
    pub tenant_id: Option<String>,
    /// Cedar text.
    pub text: String,
    /// Deleted (a later put brings it back).
    pub deleted: bool,
    /// Events in its stream.
    pub version: u64,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl Aggregate for StoredPolicy {
    type Event = PolicyEvent;
    const CATEGORY: &'static str = "policy";

    // A put replaces the whole policy.
    const RECREATABLE: bool = true;

    fn create(event: &PolicyEvent, at: DateTime<Utc>) -> Option<Self> {
        let PolicyEvent::Put(p) = event else {
            return None;
        };
        Some(StoredPolicy {
            id: p.id.clone(),
            tenant_id: p.tenant_id.clone(),
            text: p.text.clone(),
            deleted: false,
            version: 1,
            updated_at: at,
        })
    }

    fn apply(&mut self, event: &PolicyEvent, at: DateTime<Utc>) {
        if let PolicyEvent::Deleted(_) = event {
            self.deleted = true;
        }
        self.updated_at = at;
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// What may be asked of a stored policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyCommand {
    /// Create or replace it; the text must pass the schema.
    Put(PolicyPut),
    /// Remove it.
    Delete,
}

/// Decides `command` on the policy as it stands. Putting the same text again records nothing.
pub fn decide(
    state: Option<&StoredPolicy>,
    command: PolicyCommand,
    schema: &AuthzSchema,
) -> Result<Vec<PolicyEvent>, DomainError> {
    match (command, state) {
        (PolicyCommand::Put(put), _) => {
            check_policy_id(&put.id)?;
            if put.tenant_id.as_deref() == Some("") {
                return Err(DomainError::invalid_input("tenantId", "must not be empty"));
            }
            schema.parse(&put.id, &put.text)?;
            let unchanged = state
                .is_some_and(|s| !s.deleted && s.text == put.text && s.tenant_id == put.tenant_id);
            Ok(if unchanged {
                vec![]
            } else {
                vec![PolicyEvent::Put(put)]
            })
        }
        (PolicyCommand::Delete, Some(s)) if !s.deleted => {
            Ok(vec![PolicyEvent::Deleted(PolicyDeleted {
                id: s.id.clone(),
            })])
        }
        (PolicyCommand::Delete, _) => Err(DomainError::NotFound {
            what: "policy".into(),
        }),
    }
}
