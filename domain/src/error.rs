//! The facts a decision can refuse with.
//!
//! These are domain facts only: storage, network and serialisation failures belong to the crates
//! above. Each variant maps to one of the SPEC's error codes (`code()`), and `details()` gives the
//! structured part of the API's error body, so the edges never have to re-derive it.

use serde_json::{json, Value};

use crate::resources::QuotaResource;

/// Why a decision refused. Every variant is one of the SPEC's error codes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DomainError {
    /// A field of the request fails validation (`INVALID_INPUT`).
    #[error("invalid {field}: {message}")]
    InvalidInput {
        /// The request field at fault, in its wire spelling (e.g. `sshKeys`, `cidr`).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The thing asked for does not exist, or is not visible to the caller (`NOT_FOUND`).
    #[error("{what} not found")]
    NotFound {
        /// What was looked for, e.g. `instance inst_…` or `flavor g1.small`.
        what: String,
    },
    /// The move is not legal from where the aggregate stands (`INVALID_STATE`).
    #[error("{message}")]
    InvalidState {
        /// Names the current state and what was asked.
        message: String,
        /// The `details` object (`{ "reason": … }` when a client should tell refusals apart).
        details: Value,
    },
    /// The idempotency key was already used for a different request (`CONFLICT`).
    #[error("idempotency key already used for a different request (instance {instance_id})")]
    Conflict {
        /// The instance the key already belongs to.
        instance_id: String,
    },
    /// Another conflict (`CONFLICT`): a sandbox's idempotency key, an extend in flight. The
    /// detail names what it conflicts with (`sandboxId`, `reason`).
    #[error("{message}")]
    ConflictOn {
        /// What happened.
        message: String,
        /// The `details` key (`sandboxId`, `reason`).
        key: &'static str,
        /// Its value.
        value: String,
    },
    /// The charge does not fit the tenant's quota in the pool (`QUOTA_EXCEEDED`).
    #[error("quota exceeded for {resource}: requested {requested}, max {max}, used {used}")]
    QuotaExceeded {
        /// The first resource that does not fit.
        resource: QuotaResource,
        /// How much of it the charge asks for.
        requested: u64,
        /// The quota row (0 when the pool offers none).
        max: u64,
        /// What the tenant already uses.
        used: u64,
    },
    /// A tenant-wide allowance (not a pool's quota row) would be exceeded (`QUOTA_EXCEEDED`):
    /// kept snapshots, their GiB.
    #[error("quota exceeded for {resource}: requested {requested}, max {max}, used {used}")]
    TenantQuotaExceeded {
        /// `snapshots`, `snapshotGiB`.
        resource: &'static str,
        /// How much the request asks for.
        requested: u64,
        /// The allowance.
        max: u64,
        /// What the tenant already uses.
        used: u64,
    },
    /// A node, or the pool's IP range, has no room (`CAPACITY_UNAVAILABLE`).
    #[error("capacity unavailable: {resource}")]
    CapacityUnavailable {
        /// What ran out: `vcpu`, `memoryGiB`, `diskGiB`, `gpu` or `ipv4`.
        resource: String,
    },
    /// A policy refuses the caller this action on this resource (`ACCESS_DENIED`); the
    /// details name the action and the deciding `policyIds`.
    #[error("{message}")]
    AccessDenied {
        /// What was refused.
        message: String,
        /// `{ "action": …, "policyIds": […] }`.
        details: Value,
    },
    /// The request is understood but this product cannot do it (`UNSUPPORTED`).
    #[error("{message}")]
    Unsupported {
        /// Why it cannot be done.
        message: String,
    },
}

impl DomainError {
    /// The SPEC's error code for this refusal (`INVALID_INPUT`, `NOT_FOUND`, …).
    pub fn code(&self) -> &'static str {
        match self {
            DomainError::InvalidInput { .. } => "INVALID_INPUT",
            DomainError::NotFound { .. } => "NOT_FOUND",
            DomainError::InvalidState { .. } => "INVALID_STATE",
            DomainError::Conflict { .. } | DomainError::ConflictOn { .. } => "CONFLICT",
            DomainError::QuotaExceeded { .. } | DomainError::TenantQuotaExceeded { .. } => {
                "QUOTA_EXCEEDED"
            }
            DomainError::CapacityUnavailable { .. } => "CAPACITY_UNAVAILABLE",
            DomainError::AccessDenied { .. } => "ACCESS_DENIED",
            DomainError::Unsupported { .. } => "UNSUPPORTED",
        }
    }

    /// The `details` object of the API error body (camelCase keys); `{}` when there are none.
    pub fn details(&self) -> Value {
        match self {
            DomainError::InvalidInput { field, .. } => json!({ "field": field }),
            DomainError::Conflict { instance_id } => json!({ "instanceId": instance_id }),
            DomainError::ConflictOn { key, value, .. } => json!({ *key: value }),
            DomainError::QuotaExceeded {
                resource,
                requested,
                max,
                used,
            } => json!({
                "resource": resource.as_str(),
                "requested": requested,
                "max": max,
                "used": used,
            }),
            DomainError::TenantQuotaExceeded {
                resource,
                requested,
                max,
                used,
            } => json!({
                "resource": resource,
                "requested": requested,
                "max": max,
                "used": used,
            }),
            DomainError::CapacityUnavailable { resource } => json!({ "resource": resource }),
            DomainError::InvalidState { details, .. }
            | DomainError::AccessDenied { details, .. } => details.clone(),
            DomainError::NotFound { .. } | DomainError::Unsupported { .. } => json!({}),
        }
    }

    /// Shorthand for an [`DomainError::InvalidInput`] on `field`.
    pub fn invalid_input(field: impl Into<String>, message: impl Into<String>) -> Self {
        DomainError::InvalidInput {
            field: field.into(),
            message: message.into(),
        }
    }

    /// Shorthand for an [`DomainError::InvalidState`].
    pub fn invalid_state(message: impl Into<String>) -> Self {
        DomainError::InvalidState {
            message: message.into(),
            details: json!({}),
        }
    }

    /// An [`DomainError::InvalidState`] a client tells apart by `details.reason`.
    pub fn invalid_state_because(message: impl Into<String>, reason: &str) -> Self {
        DomainError::InvalidState {
            message: message.into(),
            details: json!({ "reason": reason }),
        }
    }

    /// Shorthand for an [`DomainError::ConflictOn`].
    pub fn conflict(
        message: impl Into<String>,
        key: &'static str,
        value: impl Into<String>,
    ) -> Self {
        DomainError::ConflictOn {
            message: message.into(),
            key,
            value: value.into(),
        }
    }

    /// Shorthand for an [`DomainError::Unsupported`].
    pub fn unsupported(message: impl Into<String>) -> Self {
        DomainError::Unsupported {
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_maps_to_its_spec_code() {
        let cases = [
            (DomainError::invalid_input("cidr", "bad"), "INVALID_INPUT"),
            (
                DomainError::NotFound {
                    what: "flavor x".into(),
                },
                "NOT_FOUND",
            ),
            (DomainError::invalid_state("no"), "INVALID_STATE"),
            (
                DomainError::Conflict {
                    instance_id: "inst_x".into(),
                },
                "CONFLICT",
            ),
            (
                DomainError::QuotaExceeded {
                    resource: QuotaResource::Vcpu,
                    requested: 4,
                    max: 2,
                    used: 0,
                },
                "QUOTA_EXCEEDED",
            ),
            (
                DomainError::CapacityUnavailable {
                    resource: "ipv4".into(),
                },
                "CAPACITY_UNAVAILABLE",
            ),
            (DomainError::unsupported("no"), "UNSUPPORTED"),
        ];
        for (error, code) in cases {
            assert_eq!(error.code(), code, "{error}");
        }
    }

    #[test]
    fn quota_exceeded_details_name_resource_requested_max_and_used() {
        let error = DomainError::QuotaExceeded {
            resource: QuotaResource::MemoryGib,
            requested: 8,
            max: 16,
            used: 12,
        };
        assert_eq!(
            error.details(),
            json!({ "resource": "memoryGiB", "requested": 8, "max": 16, "used": 12 })
        );
    }

    #[test]
    fn conflict_details_carry_the_instance_id() {
        let error = DomainError::Conflict {
            instance_id: "inst_abc".into(),
        };
        assert_eq!(error.details(), json!({ "instanceId": "inst_abc" }));
    }
}
