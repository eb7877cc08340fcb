//! `policies.*`: Cedar policies operators add to the baseline (SPEC §9). Each change is an
//! event (`policy.put`, `policy.deleted`); this replica rebuilds its policy set at once, the
//! others on the log's wake-up.

use serde::Deserialize;
use vps_domain::policy::{PolicyPut, StoredPolicy};
use vps_projections::policies::PolicyView;

use crate::error::ApiError;
use crate::registry::{Access::Operator, Call, Items, Method, NoParams};

/// `policies.put`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PutPolicy {
    /// 1 to 128 of `A-Z a-z 0-9 _ - . :`.
    id: String,
    /// When set, the policy applies only within this tenant.
    tenant_id: Option<String>,
    /// One or more Cedar policies.
    text: String,
}

/// A policy by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicyRef {
    /// The policy's id.
    id: String,
}

/// A stored policy.
#[derive(serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Policy {
    /// Its id.
    id: String,
    /// When set, it applies only within this tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant_id: Option<String>,
    /// Cedar text.
    text: String,
    /// Raised by every change.
    version: u64,
}

impl From<StoredPolicy> for Policy {
    fn from(p: StoredPolicy) -> Self {
        Policy {
            id: p.id,
            tenant_id: p.tenant_id,
            text: p.text,
            version: p.version,
        }
    }
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "policies",
            "put",
            Operator,
            "Creates or replaces a Cedar policy (validated against the schema).",
            put,
        ),
        Method::new(
            "policies",
            "list",
            Operator,
            "Stored policies, by id.",
            list,
        ),
        Method::new(
            "policies",
            "delete",
            Operator,
            "Deletes a stored policy.",
            delete,
        ),
    ]
}

async fn put(c: Call, q: PutPolicy) -> Result<Policy, ApiError> {
    let put = PolicyPut {
        id: q.id,
        tenant_id: q.tenant_id,
        text: q.text,
    };
    let policy = vps_commands::policies::put(&c.ctx, c.authz.schema(), put).await?;
    c.authz.refresh(&c.ctx.pool).await?;
    Ok(policy.into())
}

async fn list(c: Call, _: NoParams) -> Result<Items<PolicyView>, ApiError> {
    Ok(vps_projections::policies::list(&c.ctx.pool).await?.into())
}

async fn delete(c: Call, q: PolicyRef) -> Result<Policy, ApiError> {
    let policy = vps_commands::policies::delete(&c.ctx, c.authz.schema(), &q.id).await?;
    c.authz.refresh(&c.ctx.pool).await?;
    Ok(policy.into())
}
