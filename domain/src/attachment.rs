//! What an instance attaches: a sandbox volume on its node. Its own module, so instances and
//! volumes both name it without importing each other.

use serde::{Deserialize, Serialize};

/// A volume an instance attaches (`InstanceSpec.volumes`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    /// `vol_…`.
    pub volume_id: String,
    /// The volume's node: the instance is placed there and nowhere else.
    pub node_id: String,
    /// The disk's serial (`/dev/disk/by-id/virtio-<serial>`).
    pub serial: String,
    /// Where the guest mounts it.
    pub mount_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}
