//! The tenant aggregate (stream `tenant-<id>`): teardown (SPEC §3.10). A tenant exists
//! implicitly (offers and identities name it); its stream begins when an operator deletes it.
//! `tenant.deleting` refuses new work from that moment; `tenant.deleted` is recorded once the
//! teardown steps find nothing left.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::DomainError;

/// `tenant.deleting` / `tenant.deleted`: `{ tenantId }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantChanged {
    /// The tenant.
    pub tenant_id: String,
}

crate::event_enum! {
    /// What happens to a tenant.
    pub enum TenantEvent {
        /// Teardown began: no new work is accepted.
        Deleting(TenantChanged) = "tenant.deleting",
        /// Nothing of it is left.
        Deleted(TenantChanged) = "tenant.deleted",
    }
}

/// Where a tenant's teardown stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantState {
    /// Teardown is under way.
    Deleting,
    /// Done.
    Deleted,
}

impl TenantState {
    /// The projection's `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            TenantState::Deleting => "deleting",
            TenantState::Deleted => "deleted",
        }
    }
}

/// A tenant as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// The tenant id.
    pub id: String,
    /// Where teardown stands.
    pub state: TenantState,
    /// Events in its stream.
    pub version: u64,
}

impl Aggregate for Tenant {
    type Event = TenantEvent;
    // Not `tenant`: usage records live in `tenant-<id>` (their subject is `tenant/<id>`), and a
    // fold of the tenant must not meet them.
    const CATEGORY: &'static str = "tenancy";

    // Each event states the whole tenant, so each one replaces it.
    const RECREATABLE: bool = true;

    fn create(event: &TenantEvent, _at: DateTime<Utc>) -> Option<Self> {
        let (id, state) = match event {
            TenantEvent::Deleting(e) => (&e.tenant_id, TenantState::Deleting),
            TenantEvent::Deleted(e) => (&e.tenant_id, TenantState::Deleted),
        };
        Some(Tenant {
            id: id.clone(),
            state,
            version: 1,
        })
    }

    // Never called: every tenant event creates (and replaces) the tenant.
    fn apply(&mut self, _event: &TenantEvent, _at: DateTime<Utc>) {}

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// Begins teardown; a tenant already being deleted (or deleted) records nothing.
pub fn begin_teardown(
    state: Option<&Tenant>,
    tenant_id: &str,
) -> Result<Vec<TenantEvent>, DomainError> {
    if tenant_id.is_empty() || tenant_id.len() > 128 {
        return Err(DomainError::invalid_input(
            "tenantId",
            "1 to 128 characters",
        ));
    }
    Ok(match state {
        Some(_) => vec![],
        None => vec![TenantEvent::Deleting(TenantChanged {
            tenant_id: tenant_id.into(),
        })],
    })
}

/// Finishes teardown once `remaining` is 0 (only once).
pub fn finish_teardown(state: Option<&Tenant>, remaining: u64) -> Vec<TenantEvent> {
    match state {
        Some(t) if t.state == TenantState::Deleting && remaining == 0 => {
            vec![TenantEvent::Deleted(TenantChanged {
                tenant_id: t.id.clone(),
            })]
        }
        _ => vec![],
    }
}

/// The refusal of new work for a tenant being deleted.
pub fn refuse_new_work(tenant_id: &str) -> DomainError {
    DomainError::invalid_state_because(
        format!("tenant {tenant_id} is deleted; it can change nothing any more"),
        REFUSED,
    )
}

/// `details.reason` of every call refused for a deleted tenant.
pub const REFUSED: &str = "tenant-deleted";
