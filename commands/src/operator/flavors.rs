//! `flavors.create` and `flavors.archive`.

use serde::Deserialize;
use vps_domain::flavor::{self, Flavor};
use vps_domain::pool::Pool;
use vps_domain::resources::{Gpus, Shape};
use vps_projections::operator_views::{self as views, FlavorView};

use super::name_taken;
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change, load, transaction};
use crate::record::new_id;
use vps_domain::ids::PoolId;

/// `flavors.create`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateFlavor {
    /// The pool.
    pub pool_id: PoolId,
    /// Unique in the pool.
    pub name: String,
    /// vCPUs.
    pub vcpu: u32,
    /// Memory.
    #[serde(rename = "memoryGiB")]
    pub memory_gib: u32,
    /// Disk.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u32,
    /// Whole GPUs of one model.
    pub gpus: Option<Gpus>,
    /// Provider pools: the provider's offer.
    pub offer_id: Option<String>,
}

/// Creates a flavor.
pub async fn create_flavor(ctx: &Ctx, input: CreateFlavor) -> Result<FlavorView, CommandError> {
    let id = new_id("flv");
    transaction(ctx, &id, async |tx| {
        let pool = load::<Pool>(tx, &input.pool_id).await?;
        let create = flavor::CreateFlavor {
            id: id.clone(),
            pool_id: input.pool_id.to_string(),
            name: input.name.clone(),
            shape: Shape {
                vcpu: input.vcpu,
                memory_gib: input.memory_gib,
                disk_gib: input.disk_gib,
                gpus: input.gpus.clone(),
            },
            offer_id: input.offer_id.clone(),
            pool_class: pool.map(|p| p.class),
            name_taken: name_taken(tx, "flavors", Some(&input.pool_id), &input.name, None).await?,
        };
        change::<Flavor>(ctx, tx, &id, None, |_| flavor::create(&create)).await?;
        let answer = view(tx, &id).await?;
        Ok(answer)
    })
    .await
}

/// Archives a flavor: no new instances of it.
pub async fn archive_flavor(ctx: &Ctx, flavor_id: &str) -> Result<FlavorView, CommandError> {
    transaction(ctx, flavor_id, async |tx| {
        change::<Flavor>(ctx, tx, flavor_id, None, |f| flavor::archive(f, flavor_id)).await?;
        let answer = view(tx, flavor_id).await?;
        Ok(answer)
    })
    .await
}

async fn view(tx: &mut sqlx::PgConnection, id: &str) -> Result<FlavorView, CommandError> {
    views::flavor(&mut *tx, id)
        .await?
        .ok_or_else(|| CommandError::not_found(format!("flavor {id}")))
}
