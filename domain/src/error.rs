//! The facts a decision can refuse with.
//!
//! These are domain facts only: storage, network and serialisation failures belong to the crates
//! above. Each variant maps to one of the SPEC's error codes (`code()`), and `details()` gives the
//! structured part of the API's error body, so the edges never have to re-derive it.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::resources::QuotaResource;

/// Every code an error answer can carry (SPEC §5), serialized in its SPEC spelling
/// (`INVALID_INPUT`, …). The API derives its HTTP status and OpenAPI error schema from it and
/// the CLI its exit code, so a new code is one variant here plus the matches that must decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ErrorCode {
    /// A field of the request fails validation.
    InvalidInput,
    /// No token, or a token nobody holds.
    Unauthenticated,
    /// A policy refuses the caller.
    AccessDenied,
    /// The thing asked for does not exist or is not visible.
    NotFound,
    /// An idempotency key used for another request, or a change in flight.
    Conflict,
    /// The move is not legal from the current state.
    InvalidState,
    /// A quota would be exceeded.
    QuotaExceeded,
    /// No node or address has room.
    CapacityUnavailable,
    /// Understood, but this product cannot do it.
    Unsupported,
    /// Too many requests from this tenant.
    RateLimited,
    /// Something failed on the server; the log has the chain.
    Internal,
}

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 11] = [
        ErrorCode::InvalidInput,
        ErrorCode::Unauthenticated,
        ErrorCode::AccessDenied,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::InvalidState,
        ErrorCode::QuotaExceeded,
        ErrorCode::CapacityUnavailable,
        ErrorCode::Unsupported,
        ErrorCode::RateLimited,
        ErrorCode::Internal,
    ];

    /// The SPEC's spelling, as serialized.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidInput => "INVALID_INPUT",
            ErrorCode::Unauthenticated => "UNAUTHENTICATED",
            ErrorCode::AccessDenied => "ACCESS_DENIED",
            ErrorCode::NotFound => "NOT_FOUND",
            ErrorCode::Conflict => "CONFLICT",
            ErrorCode::InvalidState => "INVALID_STATE",
            ErrorCode::QuotaExceeded => "QUOTA_EXCEEDED",
            ErrorCode::CapacityUnavailable => "CAPACITY_UNAVAILABLE",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::RateLimited => "RATE_LIMITED",
            ErrorCode::Internal => "INTERNAL",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A code string that is none of the SPEC's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown error code {0:?}")]
pub struct UnknownErrorCode(pub String);

impl FromStr for ErrorCode {
    type Err = UnknownErrorCode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ErrorCode::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownErrorCode(s.to_owned()))
    }
}

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
    pub fn code(&self) -> ErrorCode {
        match self {
            DomainError::InvalidInput { .. } => ErrorCode::InvalidInput,
            DomainError::NotFound { .. } => ErrorCode::NotFound,
            DomainError::InvalidState { .. } => ErrorCode::InvalidState,
            DomainError::Conflict { .. } | DomainError::ConflictOn { .. } => ErrorCode::Conflict,
            DomainError::QuotaExceeded { .. } | DomainError::TenantQuotaExceeded { .. } => {
                ErrorCode::QuotaExceeded
            }
            DomainError::CapacityUnavailable { .. } => ErrorCode::CapacityUnavailable,
            DomainError::AccessDenied { .. } => ErrorCode::AccessDenied,
            DomainError::Unsupported { .. } => ErrorCode::Unsupported,
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
    fn every_code_is_listed_once_in_all_and_round_trips_through_its_spelling() {
        // The exhaustive match makes a new variant fail to compile until it is placed in ALL.
        fn position(code: ErrorCode) -> usize {
            match code {
                ErrorCode::InvalidInput => 0,
                ErrorCode::Unauthenticated => 1,
                ErrorCode::AccessDenied => 2,
                ErrorCode::NotFound => 3,
                ErrorCode::Conflict => 4,
                ErrorCode::InvalidState => 5,
                ErrorCode::QuotaExceeded => 6,
                ErrorCode::CapacityUnavailable => 7,
                ErrorCode::Unsupported => 8,
                ErrorCode::RateLimited => 9,
                ErrorCode::Internal => 10,
            }
        }
        for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(position(code), i, "{code}");
            assert_eq!(serde_json::to_value(code).unwrap(), json!(code.as_str()));
            assert_eq!(code.as_str().parse::<ErrorCode>(), Ok(code));
        }
        assert!("SPEND_LIMIT_REACHED".parse::<ErrorCode>().is_err());
    }

    #[test]
    fn every_variant_maps_to_its_spec_code() {
        let cases = [
            (
                DomainError::invalid_input("cidr", "bad"),
                ErrorCode::InvalidInput,
            ),
            (
                DomainError::NotFound {
                    what: "flavor x".into(),
                },
                ErrorCode::NotFound,
            ),
            (DomainError::invalid_state("no"), ErrorCode::InvalidState),
            (
                DomainError::Conflict {
                    instance_id: "inst_x".into(),
                },
                ErrorCode::Conflict,
            ),
            (
                DomainError::QuotaExceeded {
                    resource: QuotaResource::Vcpu,
                    requested: 4,
                    max: 2,
                    used: 0,
                },
                ErrorCode::QuotaExceeded,
            ),
            (
                DomainError::CapacityUnavailable {
                    resource: "ipv4".into(),
                },
                ErrorCode::CapacityUnavailable,
            ),
            (DomainError::unsupported("no"), ErrorCode::Unsupported),
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
