//! `flavors.*`: operators create and archive flavors; tenants list those of pools offered
//! to them.

use serde::Deserialize;
use vps_commands::operator::{self as ops, CreateFlavor};
use vps_projections::operator_views::FlavorView;
use vps_projections::{operator_views, views};

use super::missing;
use crate::error::ApiError;
use crate::registry::{Access, Call, Items, Method};
use vps_domain::ids::PoolId;

/// A flavor by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorRef {
    /// `flv_…`.
    pub flavor_id: String,
}

/// A pool's flavors.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlavorList {
    /// `pool_…`.
    pub pool_id: PoolId,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    use Access::{Operator, Tenant};
    vec![
        Method::new(
            "flavors",
            "create",
            Operator,
            "Creates a flavor in a pool.",
            |c: Call, q: CreateFlavor| async move { Ok(ops::create_flavor(&c.ctx, q).await?) },
        ),
        Method::new(
            "flavors",
            "archive",
            Operator,
            "Archives a flavor: no new instances use it.",
            |c: Call, q: FlavorRef| async move { Ok(ops::archive_flavor(&c.ctx, &q.flavor_id).await?) },
        ),
        Method::new(
            "flavors",
            "list",
            Tenant,
            "A pool's flavors (tenants: offered pools only).",
            list,
        ),
    ]
}

async fn list(c: Call, q: FlavorList) -> Result<Items<FlavorView>, ApiError> {
    if !c.caller.actor.operator {
        let tenant = c.caller.actor.tenant.clone().unwrap_or_default();
        if !views::offered(&c.ctx.pool, &q.pool_id, &tenant).await? {
            return Err(missing("pool", &q.pool_id));
        }
    }
    Ok(operator_views::flavors(&c.ctx.pool, &q.pool_id)
        .await?
        .into())
}
