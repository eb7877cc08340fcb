//! The sandbox volume aggregate (stream `volume-<id>`): a persistent disk on one node of a
//! hosted pool, which a tenant's sandboxes attach through their template, so what an agent
//! wrote outlives each sandbox (SPEC §3.8). Its `state` moves only along [`TABLE`].
//!
//! A volume books its `diskGiB` on its node (a node allocation, like an instance's) and in the
//! tenant's `diskGiB` quota when it is created, grows both when resized, and releases both
//! only once its host has let it go (`deleted`, after `deleting`).
//!
//! Its events are `sandbox.volume.*` (SPEC §4.2), on the volume's own stream, so their subject
//! is `volume/<id>`, not `sandbox/<id>`: a volume is an aggregate of its own that outlives the
//! sandboxes attaching it, and has no sandbox id to name.

mod event;
mod mounts;
#[cfg(test)]
mod tests;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::instance::{AdmissionPool, PoolKind};
use crate::placement::{check_resize_in_place, fitting, NodeCandidate, PlacementRequest};
use crate::quota::{check, Amounts, Delta};
use crate::resources::{Capacity, QuotaResource, Shape};

pub use event::{VolumeCreated, VolumeEvent, VolumeIds, VolumeLabeled, VolumeResized, VolumeSized};
pub use mounts::{
    attach, check_mount_paths, resolve, Attachment, TemplateVolume, VolumeMount, MAX_MOUNTS,
    SYSTEM_PATHS, SYSTEM_TREES,
};

/// The largest volume, in GiB.
pub const MAX_SIZE_GIB: u32 = 16_384;
/// Longest idempotency key.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;
/// A serial is this prefix and the last 16 characters of the id: 20 characters, what a
/// virtio disk's serial holds.
pub const SERIAL_PREFIX: &str = "vps-";

/// Where a volume is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum VolumeState {
    /// Admitted, its disk not yet booked. A create books synchronously, so `created` leaves a
    /// volume `ready` at once; the state is part of the contract for a create that books later.
    Creating,
    /// Booked on its node; attachable.
    Ready,
    /// Gone from its node's spec; its disk stays booked until the host has let it go.
    Deleting,
    /// Released.
    Deleted,
}

impl VolumeState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeState::Creating => "creating",
            VolumeState::Ready => "ready",
            VolumeState::Deleting => "deleting",
            VolumeState::Deleted => "deleted",
        }
    }
}

/// What moves a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// Its disk is booked on its node.
    Book,
    /// It grows.
    Resize,
    /// Deletion began.
    Delete,
    /// Its host let it go.
    Release,
}

/// Every legal move: (from, verb, to).
pub const TABLE: &[(VolumeState, Verb, VolumeState)] = {
    use VolumeState::*;
    &[
        (Creating, Verb::Book, Ready),
        (Ready, Verb::Resize, Ready),
        (Creating, Verb::Delete, Deleting),
        (Ready, Verb::Delete, Deleting),
        (Deleting, Verb::Release, Deleted),
    ]
};

/// Where `verb` takes a volume in `from`, or `INVALID_STATE`.
pub fn transition(from: VolumeState, verb: Verb) -> Result<VolumeState, DomainError> {
    crate::state_table::step(TABLE, from, verb, || format!("a {} volume", from.as_str()))
}

/// A volume as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    /// `vol_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The hosted pool.
    pub pool_id: String,
    /// Unique among the tenant's volumes that are not deleted.
    pub name: String,
    /// The node its disk is booked on (volumes never move).
    pub node_id: String,
    /// The node allocation that books it.
    pub allocation_id: String,
    /// The disk's serial.
    pub serial: String,
    /// Its size.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
    /// Where it is.
    pub state: VolumeState,
    /// Who made it.
    pub owner_identity_id: String,
    /// The create's key.
    pub idempotency_key: String,
    /// Hash of the create request.
    pub request_hash: String,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// When it was released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deleted_at: Option<DateTime<Utc>>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
    /// Events folded.
    pub version: u64,
}

impl Volume {
    /// The ids every event carries.
    pub fn ids(&self) -> VolumeIds {
        VolumeIds {
            volume_id: self.id.clone(),
            tenant_id: self.tenant_id.clone(),
            pool_id: self.pool_id.clone(),
            node_id: self.node_id.clone(),
        }
    }

    /// What it books on its node (and charges to quota): only disk.
    pub fn booking(&self) -> Shape {
        disk(self.size_gib)
    }
}

/// A disk-only shape: what a volume of `size_gib` books.
pub fn disk(size_gib: u32) -> Shape {
    Shape {
        vcpu: 0,
        memory_gib: 0,
        disk_gib: size_gib,
        gpus: None,
    }
}

/// The serial of volume `id`.
pub fn serial(id: &str) -> String {
    let tail = &id[id.len().saturating_sub(16)..];
    format!("{SERIAL_PREFIX}{tail}")
}

impl Aggregate for Volume {
    type Event = VolumeEvent;
    const CATEGORY: &'static str = "volume";

    fn create(event: &VolumeEvent, at: DateTime<Utc>) -> Option<Self> {
        match event {
            VolumeEvent::Created(c) => Some(from_created(c, at)),
            _ => None,
        }
    }

    fn apply(&mut self, event: &VolumeEvent, at: DateTime<Utc>) {
        match event {
            VolumeEvent::Created(_) => {}
            VolumeEvent::Resized(r) => self.size_gib = r.size_gib,
            VolumeEvent::Labeled(l) => self.labels.clone_from(&l.labels),
            VolumeEvent::Deleting(_) => self.state = VolumeState::Deleting,
            VolumeEvent::Deleted(_) => {
                self.state = VolumeState::Deleted;
                self.deleted_at = Some(at);
            }
        }
        self.updated_at = at;
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

fn from_created(c: &VolumeCreated, at: DateTime<Utc>) -> Volume {
    Volume {
        id: c.ids.volume_id.clone(),
        tenant_id: c.ids.tenant_id.clone(),
        pool_id: c.ids.pool_id.clone(),
        name: c.name.clone(),
        node_id: c.ids.node_id.clone(),
        allocation_id: c.allocation_id.clone(),
        serial: c.serial.clone(),
        size_gib: c.size_gib,
        // Booked in the same event: straight to ready.
        state: VolumeState::Ready,
        owner_identity_id: c.owner_identity_id.clone(),
        idempotency_key: c.idempotency_key.clone(),
        request_hash: c.request_hash.clone(),
        created_at: at,
        updated_at: at,
        deleted_at: None,
        labels: c.labels.clone(),
        version: 1,
    }
}

/// `sandboxVolumes.create`, resolved by the caller.
#[derive(Debug, Clone)]
pub struct CreateVolume {
    /// The derived id ([`crate::ids::volume_id`]).
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// The name.
    pub name: String,
    /// 1 to [`MAX_SIZE_GIB`].
    pub size_gib: u32,
    /// The key.
    pub idempotency_key: String,
    /// Hash of the request.
    pub request_hash: String,
    /// Who asks.
    pub owner_identity_id: String,
    /// The allocation the booking gets.
    pub allocation_id: String,
    /// Its labels.
    pub labels: crate::labels::Labels,
}

/// What a create reads before it decides.
#[derive(Debug, Clone, Default)]
pub struct VolumeFacts {
    /// The pool, when it exists and is offered to the tenant.
    pub pool: Option<AdmissionPool>,
    /// Another volume of the tenant that is not deleted has the name.
    pub name_taken: bool,
    /// The tenant's quota maxima in the pool.
    pub quota_max: Amounts,
    /// The tenant's usage in the pool.
    pub quota_used: Amounts,
    /// The pool's nodes with what is booked on them.
    pub nodes: Vec<NodeCandidate>,
}

/// Answers a create whose key already made `existing`: that volume when the request is the
/// same, `CONFLICT` when it differs.
pub fn replay(existing: &Volume, c: &CreateVolume) -> Result<Volume, DomainError> {
    check_key(c)?;
    if existing.request_hash == c.request_hash {
        return Ok(existing.clone());
    }
    Err(DomainError::conflict(
        format!(
            "idempotency key already used for a different request (volume {})",
            existing.id
        ),
        "volumeId",
        existing.id.clone(),
    ))
}

/// Decides a create that makes a new volume (its key made none yet) on what the pool, quota
/// and nodes say: the `sandbox.volume.created` to record, naming the node it books.
pub fn admit(c: &CreateVolume, facts: &VolumeFacts) -> Result<VolumeCreated, DomainError> {
    check_key(c)?;
    crate::operator::check_name("name", &c.name)?;
    crate::labels::check("labels", &c.labels)?;
    check_size(c.size_gib)?;
    let pool = facts.pool.as_ref().ok_or_else(|| DomainError::NotFound {
        what: format!("pool {}", c.pool_id),
    })?;
    if pool.kind != PoolKind::Hosted {
        return Err(DomainError::invalid_input(
            "poolId",
            "volumes live on hosted pools only",
        ));
    }
    if facts.name_taken {
        return Err(DomainError::conflict(
            format!("the tenant has a volume named {}", c.name),
            "name",
            c.name.clone(),
        ));
    }
    check(&facts.quota_max, &facts.quota_used, &charge(c.size_gib))?;
    let node_id = place(&facts.nodes, &pool.runtime, c.size_gib)?;
    Ok(VolumeCreated {
        ids: VolumeIds {
            volume_id: c.id.clone(),
            tenant_id: c.tenant_id.clone(),
            pool_id: c.pool_id.clone(),
            node_id,
        },
        name: c.name.clone(),
        size_gib: c.size_gib,
        serial: serial(&c.id),
        allocation_id: c.allocation_id.clone(),
        owner_identity_id: c.owner_identity_id.clone(),
        idempotency_key: c.idempotency_key.clone(),
        request_hash: c.request_hash.clone(),
        labels: c.labels.clone(),
    })
}

/// Decides `sandboxVolumes.setLabels`: the labels replace the volume's
/// (`sandbox.volume.labeled`); the same labels decide nothing. A deleted volume is
/// `INVALID_STATE`.
pub fn set_labels(
    v: &Volume,
    labels: crate::labels::Labels,
) -> Result<Vec<VolumeEvent>, DomainError> {
    crate::labels::check("labels", &labels)?;
    if v.state == VolumeState::Deleted {
        return Err(DomainError::invalid_state(format!(
            "volume {} is deleted",
            v.id
        )));
    }
    if v.labels == labels {
        return Ok(Vec::new());
    }
    Ok(vec![VolumeEvent::Labeled(VolumeLabeled {
        ids: v.ids(),
        labels,
    })])
}

fn check_key(c: &CreateVolume) -> Result<(), DomainError> {
    if c.idempotency_key.trim().is_empty() || c.idempotency_key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(DomainError::invalid_input(
            "idempotencyKey",
            format!("1 to {MAX_IDEMPOTENCY_KEY} characters"),
        ));
    }
    Ok(())
}

/// `sizeGiB` is 1 to [`MAX_SIZE_GIB`].
pub fn check_size(size_gib: u32) -> Result<(), DomainError> {
    if size_gib == 0 || size_gib > MAX_SIZE_GIB {
        return Err(DomainError::invalid_input(
            "sizeGiB",
            format!("1 to {MAX_SIZE_GIB}"),
        ));
    }
    Ok(())
}

/// What `size_gib` of volume charges to quota: `diskGiB` only.
pub fn charge(size_gib: u32) -> Delta {
    Delta::from([(QuotaResource::DiskGib, i64::from(size_gib))])
}

/// The node of the pool a volume of `size_gib` is booked on: a ready node that runs the pool's
/// runtime (its sandboxes run there) with room for the disk, the one with the most free disk
/// left (volumes spread), ties by id. None is `CAPACITY_UNAVAILABLE` for `diskGiB`.
pub fn place(nodes: &[NodeCandidate], runtime: &str, size_gib: u32) -> Result<String, DomainError> {
    let shape = disk(size_gib);
    let request = PlacementRequest {
        shape: &shape,
        runtime,
        required_labels: &Default::default(),
        excluded: &Default::default(),
        only_nodes: None,
    };
    let free_disk = |n: &NodeCandidate| n.capacity.disk_gib.saturating_sub(n.allocated.disk_gib);
    fitting(&request, nodes)
        .ok()
        .and_then(|fit| {
            fit.into_iter().max_by(|a, b| {
                free_disk(a)
                    .cmp(&free_disk(b))
                    .then_with(|| b.id.cmp(&a.id))
            })
        })
        .map(|n| n.id.clone())
        .ok_or_else(|| DomainError::CapacityUnavailable {
            resource: QuotaResource::DiskGib.as_str().to_string(),
        })
}

/// Where a resize to `size_gib` would take `v`: `true` when it grows, `false` when it is
/// already that size (nothing to do). Refuses a volume that is not `ready` (`INVALID_STATE`), a
/// size out of bounds or smaller than now (`INVALID_INPUT`: volumes only grow). Decided before
/// authorization, so a policy sees only real growth.
pub fn resize_target(v: &Volume, size_gib: u32) -> Result<bool, DomainError> {
    check_size(size_gib)?;
    transition(v.state, Verb::Resize)?;
    if size_gib < v.size_gib {
        return Err(DomainError::invalid_input(
            "sizeGiB",
            format!(
                "volumes only grow: {size_gib} is smaller than {} GiB",
                v.size_gib
            ),
        ));
    }
    Ok(size_gib > v.size_gib)
}

/// What a resize reads before it decides.
#[derive(Debug, Clone, Default)]
pub struct ResizeFacts {
    /// The tenant's quota maxima in the pool.
    pub quota_max: Amounts,
    /// The tenant's usage in the pool.
    pub quota_used: Amounts,
    /// The volume's node: its capacity and what is booked on it (this volume included);
    /// `None` when the node is gone.
    pub node: Option<(Capacity, Capacity)>,
}

/// Decides a resize: [`resize_target`], then the growth against the quota and the room on
/// the volume's node. Nothing when the size is unchanged.
pub fn resize(
    v: &Volume,
    size_gib: u32,
    facts: &ResizeFacts,
) -> Result<Vec<VolumeEvent>, DomainError> {
    if !resize_target(v, size_gib)? {
        return Ok(Vec::new());
    }
    check(
        &facts.quota_max,
        &facts.quota_used,
        &charge(size_gib - v.size_gib),
    )?;
    let (capacity, allocated) =
        facts
            .node
            .as_ref()
            .ok_or_else(|| DomainError::CapacityUnavailable {
                resource: QuotaResource::DiskGib.as_str().to_string(),
            })?;
    check_resize_in_place(capacity, allocated, &v.booking(), &disk(size_gib))?;
    Ok(vec![VolumeEvent::Resized(VolumeResized {
        ids: v.ids(),
        size_gib,
        previous_size_gib: v.size_gib,
    })])
}

/// What still uses a volume, which a delete must wait for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InUse {
    /// Live instances attaching it.
    pub instances: Vec<String>,
    /// Live templates naming it.
    pub templates: Vec<String>,
}

/// Decides a delete: `CONFLICT` while a live instance attaches it or a live template names it
/// (`details.reason`: `volume-attached`, `volume-in-template`); a deleting or deleted volume
/// is left as it is.
pub fn delete(v: &Volume, in_use: &InUse) -> Result<Vec<VolumeEvent>, DomainError> {
    if transition(v.state, Verb::Delete).is_err() {
        return Ok(Vec::new());
    }
    if let Some(instance) = in_use.instances.first() {
        return Err(DomainError::conflict(
            format!("volume {} is attached to instance {instance}", v.id),
            "reason",
            "volume-attached",
        ));
    }
    if let Some(template) = in_use.templates.first() {
        return Err(DomainError::conflict(
            format!("template {template} names volume {}", v.id),
            "reason",
            "volume-in-template",
        ));
    }
    Ok(vec![VolumeEvent::Deleting(VolumeSized {
        ids: v.ids(),
        size_gib: v.size_gib,
    })])
}

/// Decides the end of a deleting volume, once its host let it go: booking and quota are
/// released with `deleted`.
pub fn release(v: &Volume) -> Vec<VolumeEvent> {
    match transition(v.state, Verb::Release) {
        Ok(_) => vec![VolumeEvent::Deleted(VolumeSized {
            ids: v.ids(),
            size_gib: v.size_gib,
        })],
        Err(_) => Vec::new(),
    }
}

/// The tenant's volume, or `NOT_FOUND` (another tenant's too).
pub fn visible<'a>(
    state: Option<&'a Volume>,
    tenant_id: &str,
    id: &str,
) -> Result<&'a Volume, DomainError> {
    state
        .filter(|v| v.tenant_id == tenant_id)
        .ok_or_else(|| DomainError::NotFound {
            what: format!("volume {id}"),
        })
}
