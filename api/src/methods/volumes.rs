//! `sandboxVolumes.*`: a tenant's persistent sandbox disks (SPEC §3.8). Another tenant's
//! volume is `NOT_FOUND`. Create and resize are decided on the volume with the size it would
//! have (`resource.sizeGiB`), so a policy can cap how big a volume gets.

use serde::Deserialize;
use vps_commands::volumes::{self, CreateVolumeInput};
use vps_commands::CommandError;
use vps_domain::authz::Resource;
use vps_domain::volume::{self as domain, Volume};
use vps_projections::volumes::{VolumeFilter, VolumeView};

use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Items, Method};
use vps_domain::ids::{PoolId, VolumeId};

/// The most volumes a list answers.
pub const LIST_LIMIT: i64 = 500;

/// A volume by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeRef {
    /// The tenant.
    tenant_id: String,
    /// `vol_…`.
    volume_id: VolumeId,
}

/// `sandboxVolumes.resize`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResizeBody {
    /// The tenant.
    tenant_id: String,
    /// `vol_…`.
    volume_id: VolumeId,
    /// The new size: at least the current one (volumes only grow), at most 16384.
    #[serde(rename = "sizeGiB")]
    size_gib: u32,
}

/// `sandboxVolumes.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListBody {
    /// The tenant.
    tenant_id: String,
    /// Only in this pool.
    pool_id: Option<PoolId>,
    /// `mine` (default: the volumes the caller created) or `all`.
    scope: Option<String>,
    /// Deleted ones too.
    include_deleted: Option<bool>,
    /// Only volumes carrying every one of these labels (at most 32 pairs).
    labels: Option<vps_domain::labels::Labels>,
}

/// `sandboxVolumes.setLabels`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetLabelsBody {
    /// The tenant.
    tenant_id: String,
    /// `vol_…`.
    volume_id: VolumeId,
    /// The labels (they replace the volume's): at most 32, Kubernetes label syntax.
    labels: vps_domain::labels::Labels,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "sandboxVolumes",
            "create",
            Tenant,
            "Creates a volume on a node of a hosted pool (idempotent by key).",
            create,
        ),
        Method::new("sandboxVolumes", "get", Tenant, "One volume.", get),
        Method::new(
            "sandboxVolumes",
            "list",
            Tenant,
            "The tenant's volumes, oldest first (at most 500).",
            list,
        ),
        Method::new(
            "sandboxVolumes",
            "resize",
            Tenant,
            "Grows a volume (never shrinks it).",
            resize,
        ),
        Method::new(
            "sandboxVolumes",
            "setLabels",
            Tenant,
            "Replaces a volume's labels.",
            set_labels,
        ),
        Method::new(
            "sandboxVolumes",
            "delete",
            Tenant,
            "Deletes a volume no sandbox attaches and no template names.",
            delete,
        ),
    ]
}

async fn create(c: Call, mut q: CreateVolumeInput) -> Result<VolumeView, ApiError> {
    q.tenant_id = c.caller.tenant(&q.tenant_id)?;
    if c.guard.snapshot.closed_tenants.contains(&q.tenant_id) {
        return Err(vps_domain::tenant::refuse_new_work(&q.tenant_id).into());
    }
    let id = volumes::volume_id(&c.ctx, &q);
    // A key already used is answered by the create itself (a replay or a conflict), without a
    // new decision; a new volume is decided with the size it would have.
    if volumes::stored(&c.ctx, &id).await?.is_none() {
        let labels = q.labels.clone().unwrap_or_default();
        c.authorize(&Resource::volume(&id, &q.tenant_id, q.size_gib.into()).labeled(&labels))?;
    }
    let created = volumes::create(&c.ctx, q).await?;
    view(&c, &created.volume).await
}

async fn get(c: Call, q: VolumeRef) -> Result<VolumeView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let v = visible(&c, &tenant, &q.volume_id).await?;
    view(&c, &v).await
}

async fn list(c: Call, q: ListBody) -> Result<Items<VolumeView>, ApiError> {
    let tenant_id = c.caller.tenant(&q.tenant_id)?;
    let owner = super::scope_owner(&c, q.scope.as_deref(), super::Scope::Mine)?;
    let filter = VolumeFilter {
        tenant_id,
        owner,
        pool_id: q.pool_id.map(String::from),
        include_deleted: q.include_deleted.unwrap_or(false),
        limit: LIST_LIMIT,
        labels: super::common::label_filter(q.labels)?,
    };
    let mut conn = c.ctx.pool.acquire().await?;
    let items = vps_projections::volumes::list(&mut conn, &filter)
        .await
        .map_err(CommandError::from)?;
    Ok(items.into())
}

async fn resize(c: Call, q: ResizeBody) -> Result<VolumeView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let v = visible(&c, &tenant, &q.volume_id).await?;
    // Refusals first (not ready, a shrink), and the current size answers it unchanged; then
    // the growth is decided with the new size, as the volume would be.
    if !domain::resize_target(&v, q.size_gib).map_err(CommandError::from)? {
        return view(&c, &v).await;
    }
    c.authorize(&Resource::volume(&v.id, &tenant, q.size_gib.into()).labeled(&v.labels))?;
    let v = volumes::resize(&c.ctx, &tenant, &q.volume_id, q.size_gib).await?;
    view(&c, &v).await
}

async fn set_labels(c: Call, q: SetLabelsBody) -> Result<VolumeView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let v = visible(&c, &tenant, &q.volume_id).await?;
    // Decided on the labels the volume would carry.
    c.authorize(&Resource::volume(&v.id, &tenant, v.size_gib.into()).labeled(&q.labels))?;
    let v = volumes::set_labels(&c.ctx, &tenant, &q.volume_id, q.labels).await?;
    view(&c, &v).await
}

async fn delete(c: Call, q: VolumeRef) -> Result<VolumeView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let v = volumes::delete(&c.ctx, &tenant, &q.volume_id).await?;
    // The sandbox reconciler releases it once its host let it go.
    vps_reactors::sandboxes::wake(&c.ctx);
    view(&c, &v).await
}

/// The stored volume the tenant may see.
async fn visible(c: &Call, tenant: &str, id: &str) -> Result<Volume, ApiError> {
    let stored = volumes::stored(&c.ctx, id).await?;
    Ok(domain::visible(stored.as_ref(), tenant, id)
        .map_err(CommandError::from)?
        .clone())
}

async fn view(c: &Call, v: &Volume) -> Result<VolumeView, ApiError> {
    let mut conn = c.ctx.pool.acquire().await?;
    Ok(vps_projections::volumes::view(&mut conn, v)
        .await
        .map_err(CommandError::from)?)
}
