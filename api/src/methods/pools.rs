//! `pools.*` (operators): create, read, update, offer to tenants, set the IP range, and read
//! quota usage and address leases.

use serde::Deserialize;
use vps_commands::operator::{self as ops, CreatePool, OfferPool, SetIpPool, UpdatePool};
use vps_projections::operator_views::{self as pools, PoolView};
use vps_projections::views::{self, Lease, QuotaUsage};

use super::missing;
use crate::error::ApiError;
use crate::registry::{Access::Operator, Call, Items, Method, NoParams};
use vps_domain::ids::PoolId;

/// A pool by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolRef {
    /// `pool_…`.
    pub pool_id: PoolId,
}

/// `pools.usage`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UsageQuery {
    /// `pool_…`.
    pub pool_id: PoolId,
    /// Only this tenant's quotas.
    pub tenant_id: Option<String>,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "pools",
            "create",
            Operator,
            "Creates a hosted or provider pool.",
            |c: Call, q: CreatePool| async move { Ok(ops::create_pool(&c.ctx, q).await?) },
        ),
        Method::new("pools", "get", Operator, "One pool.", get),
        Method::new("pools", "list", Operator, "Every pool, by name.", list),
        Method::new(
            "pools",
            "update",
            Operator,
            "Renames a pool or changes its policy.",
            |c: Call, q: UpdatePool| async move { Ok(ops::update_pool(&c.ctx, q).await?) },
        ),
        Method::new(
            "pools",
            "offer",
            Operator,
            "Offers a pool to a tenant with quota maxima.",
            |c: Call, q: OfferPool| async move { Ok(ops::offer_pool(&c.ctx, q).await?) },
        ),
        Method::new(
            "pools",
            "setIpPool",
            Operator,
            "Sets a hosted pool's IPv4 range.",
            |c: Call, q: SetIpPool| async move { Ok(ops::set_ip_pool(&c.ctx, q).await?) },
        ),
        Method::new(
            "pools",
            "usage",
            Operator,
            "Quota maxima and usage per tenant.",
            usage,
        ),
        Method::new(
            "pools",
            "leases",
            Operator,
            "The pool's address leases.",
            leases,
        ),
    ]
}

/// The pool's view, or `NOT_FOUND`.
pub async fn existing(c: &Call, pool_id: &str) -> Result<PoolView, ApiError> {
    pools::pool(&c.ctx.pool, pool_id)
        .await?
        .ok_or_else(|| missing("pool", pool_id))
}

async fn get(c: Call, q: PoolRef) -> Result<PoolView, ApiError> {
    existing(&c, &q.pool_id).await
}

async fn list(c: Call, _: NoParams) -> Result<Items<PoolView>, ApiError> {
    Ok(pools::pools(&c.ctx.pool).await?.into())
}

async fn usage(c: Call, q: UsageQuery) -> Result<Items<QuotaUsage>, ApiError> {
    existing(&c, &q.pool_id).await?;
    Ok(
        views::quota_usage(&c.ctx.pool, &q.pool_id, q.tenant_id.as_deref())
            .await?
            .into(),
    )
}

async fn leases(c: Call, q: PoolRef) -> Result<Items<Lease>, ApiError> {
    existing(&c, &q.pool_id).await?;
    Ok(views::leases(&c.ctx.pool, &q.pool_id).await?.into())
}
