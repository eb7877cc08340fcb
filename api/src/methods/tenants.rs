//! `tenants.delete`: tenant teardown (SPEC §3.10). The call records `tenant.deleting`, runs
//! one teardown pass and wakes the teardown reactor, which passes again until nothing is left.

use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::registry::{Access::Operator, Call, Method};

/// `tenants.delete`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeleteTenant {
    /// The tenant.
    tenant_id: String,
}

/// Where a teardown stands.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Teardown {
    /// The tenant.
    tenant_id: String,
    /// What is left to delete (0: done; call again or poll).
    remaining: u64,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![Method::new(
        "tenants",
        "delete",
        Operator,
        "Tears a tenant down; answers what remains.",
        delete,
    )]
}

async fn delete(c: Call, q: DeleteTenant) -> Result<Teardown, ApiError> {
    vps_commands::tenants::begin(&c.ctx, &q.tenant_id).await?;
    c.authz.refresh(&c.ctx.pool).await?;
    let remaining = vps_commands::tenants::teardown_pass(&c.ctx, &q.tenant_id).await?;
    if remaining > 0 {
        vps_reactors::teardown::wake(&c.ctx, &q.tenant_id).await?;
    }
    Ok(Teardown {
        tenant_id: q.tenant_id,
        remaining,
    })
}
