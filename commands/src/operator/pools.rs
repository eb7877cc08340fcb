//! `pools.*` commands.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vps_domain::operator::PoolPolicy;
use vps_domain::pool::{decide, Pool, PoolCommand};
use vps_domain::resources::QuotaResource;
use vps_projections::operator_views::{self as views, PoolView};

use super::name_taken;
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change, transaction};
use crate::record::new_id;
use vps_domain::ids::PoolId;

/// `pools.create`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreatePool {
    /// Unique name.
    pub name: String,
    /// `vps-host` or `provider`.
    pub class: String,
    /// Hosted pools' runtime (default `libvirt-kvm`).
    pub runtime: Option<String>,
    /// Provider pools' account.
    pub provider_account_id: Option<String>,
    /// Host-loss policy.
    #[serde(default)]
    pub policy: PoolPolicy,
}

/// `pools.update`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdatePool {
    /// The pool.
    pub pool_id: PoolId,
    /// A new name.
    pub name: Option<String>,
    /// A new policy.
    pub policy: Option<PoolPolicy>,
}

/// `pools.offer`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OfferPool {
    /// The pool.
    pub pool_id: PoolId,
    /// The tenant it becomes visible to.
    pub tenant_id: String,
    /// Maxima per resource; a missing one is 0 (at most 16 entries).
    #[serde(default, deserialize_with = "vps_domain::bounds::map::<_, u64, 16>")]
    #[schemars(extend("maxProperties" = 16))]
    pub quota: BTreeMap<String, u64>,
}

/// `pools.offer`'s answer: every quota maximum, a missing one as 0.
#[derive(Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Offer {
    /// The pool.
    pub pool_id: String,
    /// The tenant it is offered to.
    pub tenant_id: String,
    /// Maxima per resource (`vcpu`, `memoryGiB`, `diskGiB`, `gpu`).
    pub quota: BTreeMap<String, u64>,
}

/// `pools.setIpPool`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetIpPool {
    /// The pool.
    pub pool_id: PoolId,
    /// IPv4 CIDR.
    pub cidr: String,
    /// Default: the first host address.
    pub gateway: Option<String>,
}

/// Creates a pool.
pub async fn create_pool(ctx: &Ctx, input: CreatePool) -> Result<PoolView, CommandError> {
    let id = new_id("pool");
    transaction(ctx, &id, async |tx| {
        let command = PoolCommand::Create {
            id: id.clone(),
            name: input.name.clone(),
            class: input.class.clone(),
            runtime: input.runtime.clone(),
            provider_account_id: input.provider_account_id.clone(),
            policy: input.policy.clone(),
            name_taken: name_taken(tx, "pools", None, &input.name, None).await?,
        };
        change::<Pool>(ctx, tx, &id, None, |pool| decide(pool, &command)).await?;
        let answer = view(tx, &id).await?;
        Ok(answer)
    })
    .await
}

/// Renames a pool or changes its policy.
pub async fn update_pool(ctx: &Ctx, input: UpdatePool) -> Result<PoolView, CommandError> {
    transaction(ctx, &input.pool_id, async |tx| {
        let name_taken = match &input.name {
            Some(name) => name_taken(tx, "pools", None, name, Some(&input.pool_id)).await?,
            None => false,
        };
        let command = PoolCommand::Update {
            name: input.name.clone(),
            policy: input.policy.clone(),
            name_taken,
        };
        change::<Pool>(ctx, tx, &input.pool_id, None, |p| decide(p, &command)).await?;
        let answer = view(tx, &input.pool_id).await?;
        Ok(answer)
    })
    .await
}

/// Offers a pool to a tenant with quota maxima.
pub async fn offer_pool(ctx: &Ctx, input: OfferPool) -> Result<Offer, CommandError> {
    transaction(ctx, &input.pool_id, async |tx| {
        let command = PoolCommand::Offer {
            tenant_id: input.tenant_id.clone(),
            quota: input.quota.clone(),
        };
        let tenant = Some(input.tenant_id.as_str());
        change::<Pool>(ctx, tx, &input.pool_id, tenant, |p| decide(p, &command)).await?;
        Ok(())
    })
    .await?;
    let quota = QuotaResource::ALL
        .into_iter()
        .map(|r| {
            let max = input.quota.get(r.as_str()).copied().unwrap_or(0);
            (r.as_str().to_string(), max)
        })
        .collect();
    Ok(Offer {
        pool_id: input.pool_id.into(),
        tenant_id: input.tenant_id,
        quota,
    })
}

/// Sets a hosted pool's IPv4 range.
pub async fn set_ip_pool(ctx: &Ctx, input: SetIpPool) -> Result<PoolView, CommandError> {
    transaction(ctx, &input.pool_id, async |tx| {
        let leased = vps_projections::instances::reads::leased(tx, &input.pool_id).await?;
        let command = PoolCommand::SetIpRange {
            cidr: input.cidr.clone(),
            gateway: input.gateway.clone(),
            leased: leased as u64,
        };
        change::<Pool>(ctx, tx, &input.pool_id, None, |p| decide(p, &command)).await?;
        let answer = view(tx, &input.pool_id).await?;
        Ok(answer)
    })
    .await
}

async fn view(tx: &mut sqlx::PgConnection, pool_id: &str) -> Result<PoolView, CommandError> {
    views::pool(&mut *tx, pool_id)
        .await?
        .ok_or_else(|| CommandError::not_found(format!("pool {pool_id}")))
}
