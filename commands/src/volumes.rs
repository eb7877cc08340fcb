//! Sandbox volumes (`sandboxVolumes.create/resize/delete`), the release of a deleted volume's
//! booking once its host let it go, and what templates and sandboxes take from volumes
//! ([`mounts`]: a template's mounts resolved, a sandbox's attachments under one writer).
//!
//! A create books the volume's disk on a node of the pool and in the tenant's `diskGiB` quota
//! exactly as instance admission does (facts read, a pure decision, the node locked before the
//! append, the node's bookings and the quota confirmed under their locks before commit). The
//! booking itself is the volume projector's, inside the same transaction.

pub mod mounts;

use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use tracing::Instrument;
use vps_domain::volume::{
    self as domain, charge, CreateVolume, ResizeFacts, Volume, VolumeEvent, VolumeFacts,
};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::facts;
use crate::pipeline::{hold_or_conflict, load, record_events, record_existing, transaction};
use crate::record::new_id;
use vps_domain::ids::PoolId;

pub use mounts::{attach, resolve_mounts};

/// `sandboxVolumes.create`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolumeInput {
    /// The tenant.
    pub tenant_id: String,
    /// A hosted pool offered to the tenant.
    pub pool_id: PoolId,
    /// Unique among the tenant's volumes that are not deleted.
    pub name: String,
    /// 1 to 16384.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
    /// Makes the create idempotent (the id derives from it).
    pub idempotency_key: String,
    /// Its labels: at most 32, Kubernetes label syntax.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<vps_domain::labels::Labels>,
}

/// What a create decided.
#[derive(Debug, Clone)]
pub struct Created {
    /// The volume.
    pub volume: Volume,
    /// Whether this call made it (false: a replay).
    pub new: bool,
}

/// The id a create derives from (tenant, caller, idempotency key).
pub fn volume_id(ctx: &Ctx, input: &CreateVolumeInput) -> String {
    vps_domain::ids::volume_id(vps_domain::ids::Origin {
        tenant: &input.tenant_id,
        caller: &ctx.actor.identity,
        key: &input.idempotency_key,
    })
}

/// A volume as stored (any tenant's), for deciding before anything is written.
pub async fn stored(ctx: &Ctx, id: &str) -> Result<Option<Volume>, CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    load::<Volume>(&mut conn, id).await
}

/// Creates a volume, or answers the one this idempotency key already made.
pub async fn create(ctx: &Ctx, input: CreateVolumeInput) -> Result<Created, CommandError> {
    let id = volume_id(ctx, &input);
    let request = CreateVolume {
        id: id.clone(),
        tenant_id: input.tenant_id.clone(),
        pool_id: input.pool_id.to_string(),
        name: input.name.clone(),
        size_gib: input.size_gib,
        idempotency_key: input.idempotency_key.clone(),
        request_hash: crate::record::request_hash(&input),
        owner_identity_id: ctx.actor.identity.clone(),
        allocation_id: String::new(),
        labels: input.labels.clone().unwrap_or_default(),
    };
    transaction(ctx, &id, async |tx| {
        let c = CreateVolume {
            allocation_id: new_id("alloc"),
            ..request.clone()
        };
        create_in(ctx, tx, &c).await
    })
    .instrument(tracing::info_span!("volume_create", volume = %id))
    .await
}

async fn create_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    c: &CreateVolume,
) -> Result<Created, CommandError> {
    if let Some(existing) = load::<Volume>(tx, &c.id).await? {
        let volume = domain::replay(&existing, c)?;
        return Ok(Created { volume, new: false });
    }
    let facts = create_facts(tx, c).await?;
    let created = domain::admit(c, &facts)?;
    // The node before the quota rows, the order instance admission takes them in: locked and
    // checked with the volume's booking on top before it is written.
    let booking = domain::disk(c.size_gib);
    let node = created.ids.node_id.clone();
    let bookings = std::collections::BTreeMap::from([(node, vec![&booking])]);
    facts::confirm_bookings(tx, &bookings).await?;
    let events = vec![VolumeEvent::Created(created)];
    let volume =
        record_existing::<Volume>(ctx, tx, &c.id, None, events, Some(&c.tenant_id)).await?;
    facts::confirm_quota(tx, &c.pool_id, &c.tenant_id, &charge(c.size_gib)).await?;
    Ok(Created { volume, new: true })
}

/// What a create reads: the pool (when offered to the tenant), whether the name is taken, the
/// tenant's quota and the pool's nodes with their bookings.
async fn create_facts(
    tx: &mut PgConnection,
    c: &CreateVolume,
) -> Result<VolumeFacts, CommandError> {
    let Some(pool) =
        vps_projections::instances::admission::offered_pool(tx, &c.pool_id, &c.tenant_id).await?
    else {
        return Ok(VolumeFacts::default());
    };
    let name_taken = vps_projections::volumes::name_taken(&mut *tx, &c.tenant_id, &c.name).await?;
    let (quota_max, quota_used) = facts::quota(tx, &c.pool_id, &c.tenant_id).await?;
    Ok(VolumeFacts {
        pool: Some(pool),
        name_taken,
        quota_max,
        quota_used,
        nodes: vps_projections::instances::admission::candidates(tx, &c.pool_id, None).await?,
    })
}

/// Grows a volume to `size_gib` (the API passes the size it authorized). One resize holds a
/// volume at a time: a concurrent one is `CONFLICT` (`resize-in-flight`), so two resizes never
/// both apply beyond what one decision covered.
pub async fn resize(
    ctx: &Ctx,
    tenant_id: &str,
    volume_id: &str,
    size_gib: u32,
) -> Result<Volume, CommandError> {
    transaction(ctx, volume_id, async |tx| {
        resize_in(ctx, tx, tenant_id, volume_id, size_gib).await
    })
    .instrument(tracing::info_span!("volume_resize", volume = %volume_id, size_gib))
    .await
}

/// The advisory lock that holds one resize of a volume at a time.
pub const RESIZE_HOLD: &str = "volume-resize:";

async fn resize_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    tenant_id: &str,
    volume_id: &str,
    size_gib: u32,
) -> Result<Volume, CommandError> {
    let key = format!("{RESIZE_HOLD}{volume_id}");
    let what = format!("resize of volume {volume_id}");
    hold_or_conflict(tx, &key, &what, "resize-in-flight").await?;
    let before = load::<Volume>(tx, volume_id).await?;
    let v = domain::visible(before.as_ref(), tenant_id, volume_id)?;
    if !domain::resize_target(v, size_gib)? {
        return Ok(v.clone());
    }
    // The node's row is locked (and read) before the quota rows, as admission does.
    let node = vps_projections::instances::admission::candidates(tx, &v.pool_id, Some(&v.node_id))
        .await?
        .into_iter()
        .next()
        .map(|n| (n.capacity, n.allocated));
    let (quota_max, quota_used) = facts::quota(tx, &v.pool_id, &v.tenant_id).await?;
    let resize_facts = ResizeFacts {
        quota_max,
        quota_used,
        node,
    };
    let events = domain::resize(v, size_gib, &resize_facts)?;
    let growth = charge(size_gib - v.size_gib);
    let after = record_existing(ctx, tx, volume_id, Some(v), events, Some(tenant_id)).await?;
    facts::confirm_quota(tx, &v.pool_id, &v.tenant_id, &growth).await?;
    Ok(after)
}

/// Replaces a volume's labels (`sandbox.volume.labeled`); the same labels change nothing.
pub async fn set_labels(
    ctx: &Ctx,
    tenant_id: &str,
    volume_id: &str,
    labels: vps_domain::labels::Labels,
) -> Result<Volume, CommandError> {
    transaction(ctx, volume_id, async |tx| {
        let before = load::<Volume>(tx, volume_id).await?;
        let v = domain::visible(before.as_ref(), tenant_id, volume_id)?;
        let events = domain::set_labels(v, labels.clone())?;
        record_existing(ctx, tx, volume_id, Some(v), events, Some(tenant_id)).await
    })
    .await
}

/// Deletes a volume: `deleting` at once (it leaves its node's spec); the booking and quota are
/// released by [`release`] once its host let it go. Refused while a live instance attaches it
/// or a live template names it; a deleting or deleted volume is answered as it is.
pub async fn delete(ctx: &Ctx, tenant_id: &str, volume_id: &str) -> Result<Volume, CommandError> {
    transaction(ctx, volume_id, async |tx| {
        // Sandbox creates and template writes lock the row too: none can start using the
        // volume between the check and the append.
        lock(tx, volume_id).await?;
        let before = load::<Volume>(tx, volume_id).await?;
        let v = domain::visible(before.as_ref(), tenant_id, volume_id)?;
        let in_use = vps_projections::volumes::in_use(tx, volume_id).await?;
        let events = domain::delete(v, &in_use)?;
        record_existing(ctx, tx, volume_id, Some(v), events, Some(tenant_id)).await
    })
    .instrument(tracing::info_span!("volume_delete", volume = %volume_id))
    .await
}

/// Ends a deleting volume whose host let it go: `sandbox.volume.deleted` releases its booking
/// and quota. Skips a volume another worker holds. Whether it released one.
pub async fn release(ctx: &Ctx, volume_id: &str) -> Result<bool, CommandError> {
    transaction(ctx, volume_id, async |tx| {
        let free = vps_projections::volumes::lock_deleting_unless_held(tx, volume_id).await?;
        let Some(v) = free.then_some(()).and(load::<Volume>(tx, volume_id).await?) else {
            return Ok(false);
        };
        let events = domain::release(&v);
        let released = !events.is_empty();
        record_events(ctx, tx, volume_id, Some(&v), events, Some(&v.tenant_id)).await?;
        Ok(released)
    })
    .instrument(tracing::info_span!("volume_release", volume = %volume_id))
    .await
}

/// Locks a volume's row to this transaction's end.
async fn lock(tx: &mut PgConnection, volume_id: &str) -> Result<(), CommandError> {
    Ok(vps_projections::volumes::lock(tx, volume_id).await?)
}
