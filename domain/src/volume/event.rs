//! Volume events (SPEC §4.2: `sandbox.volume.created|resized|deleting|deleted`). Every one
//! carries the volume's ids and its size, so a reader (the usage meter above all) needs no
//! other event to know what is booked.

use serde::{Deserialize, Serialize};

/// The ids every volume event carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeIds {
    /// `vol_…`.
    pub volume_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The hosted pool.
    pub pool_id: String,
    /// The node its disk is booked on.
    pub node_id: String,
}

/// `sandbox.volume.created`: the disk is booked on its node and charged to quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeCreated {
    /// Ids.
    #[serde(flatten)]
    pub ids: VolumeIds,
    /// Unique among the tenant's volumes that are not deleted.
    pub name: String,
    /// Its size.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
    /// What the guest sees it as (`/dev/disk/by-id/virtio-<serial>`).
    pub serial: String,
    /// The node allocation that books its disk.
    pub allocation_id: String,
    /// Who made it.
    pub owner_identity_id: String,
    /// The create's key.
    pub idempotency_key: String,
    /// Hash of the create request, for replay vs `CONFLICT`.
    pub request_hash: String,
    /// Its labels.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
}

/// `sandbox.volume.labeled`: the volume's labels now (they replace the earlier ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeLabeled {
    /// Ids.
    #[serde(flatten)]
    pub ids: VolumeIds,
    /// The labels.
    pub labels: crate::labels::Labels,
}

/// `sandbox.volume.resized`: it grew, on its node and in the quota.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeResized {
    /// Ids.
    #[serde(flatten)]
    pub ids: VolumeIds,
    /// The new size.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
    /// The size before.
    #[serde(rename = "previousSizeGiB")]
    pub previous_size_gib: u32,
}

/// `sandbox.volume.deleting` and `sandbox.volume.deleted`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSized {
    /// Ids.
    #[serde(flatten)]
    pub ids: VolumeIds,
    /// Its size (still booked while deleting; released by `deleted`).
    #[serde(rename = "sizeGiB")]
    pub size_gib: u32,
}

crate::event_enum! {
    /// What happens to a volume.
    pub enum VolumeEvent {
        /// `sandbox.volume.created`.
        Created(VolumeCreated) = "sandbox.volume.created",
        /// `sandbox.volume.resized`.
        Resized(VolumeResized) = "sandbox.volume.resized",
        /// `sandbox.volume.deleting`: it left its node's spec; its disk stays booked.
        Deleting(VolumeSized) = "sandbox.volume.deleting",
        /// `sandbox.volume.deleted`: its host let it go; booking and quota released.
        Deleted(VolumeSized) = "sandbox.volume.deleted",
        /// `sandbox.volume.labeled`: its labels were replaced.
        Labeled(VolumeLabeled) = "sandbox.volume.labeled",
    }
}
