//! The NodeSpec as hosts read it (SPEC §3.7): typed, so the stored entries and the served
//! spec have one definition and the API documents its shape. Stored entries name snapshot
//! objects by `objectKey`; the API swaps each key for a URL signed when it serves the spec.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use vps_domain::network_policy::Network;
use vps_domain::resources::{Gpus, Shape};
use vps_domain::state_table::DesiredState;

/// A node's spec: every live instance placed on it, the volumes it keeps, and the host
/// commands it has yet to report on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// `node_…`.
    pub node_id: String,
    /// Moves whenever the content changes, and only then.
    pub generation: i64,
    /// What the host must run.
    pub instances: Vec<InstanceSpec>,
    /// The volumes the host keeps.
    pub volumes: Vec<NodeVolume>,
    /// Host commands (snapshots) to run until their outcome is reported.
    pub commands: Vec<HostCommand>,
}

/// One instance as the host must run it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceSpec {
    /// `inst_…`.
    pub id: String,
    /// What the host should make of it (`deleted`: tear it down).
    pub desired_state: DesiredState,
    /// The pool's runtime.
    pub runtime: Option<String>,
    /// What it books.
    pub shape: Shape,
    /// What it boots.
    pub image: ImageRef,
    /// The sealed user data (`secret://…`), read with `nodes.secret`.
    pub user_data_ref: Option<String>,
    /// Its capacity allocation.
    pub allocation_id: Option<String>,
    /// Whole GPUs per model.
    pub gpus: Vec<Gpus>,
    /// Its network interfaces.
    pub nics: Vec<Nic>,
    /// A sandbox template's network rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<Network>,
    /// A sandbox template's allow-list narrowing `egress`: IPv4 addresses, CIDRs, domains
    /// (`*.example.com`). Absent: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub network_allow: Vec<String>,
    /// The guest's bandwidth bound, Mbit/s each way. Absent: the host's default (100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_bandwidth_mbit: Option<u32>,
    /// The guest's connection bound. Absent: the host's default (512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_max_connections: Option<u32>,
    /// Sandbox and warm instances: SSH only from the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_from_host_only: Option<bool>,
    /// Boot from this snapshot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<SpecRestore>,
    /// The volumes it attaches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<VolumeAttachment>,
    /// Moves on every start request (absent before the first): a guest that powered itself
    /// off is booted again when this moves, not when the entry only looks as it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_generation: Option<u64>,
    /// Served specs only, for sandbox and warm instances of a deployment with a sandbox CA:
    /// whom the guest's `sshd` admits (SPEC §3.11).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_ca: Option<SshCa>,
}

/// `InstanceSpec.sshCa`: the guest's `sshd` trusts `publicKey` (`TrustedUserCAKeys`) and
/// admits only `principal`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SshCa {
    /// The deployment's sandbox CA, an OpenSSH public key line.
    pub public_key: String,
    /// The one principal exec certificates for this instance name (its id).
    pub principal: String,
}

/// The image an instance boots.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ImageRef {
    /// Where to fetch it.
    pub url: Option<String>,
    /// Its SHA-256 (hex): checked before use.
    pub sha256: Option<String>,
    /// `qcow2`, `raw`, …
    pub format: Option<String>,
}

/// A network interface.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Nic {
    /// The host bridge it attaches to.
    pub bridge: String,
    /// Stable, locally administered, derived from the instance id.
    pub mac: String,
    /// The leased address in CIDR form (`10.0.0.2/24`).
    pub address: String,
    /// The pool's gateway: the guest's default route, and the bridge's own address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// `InstanceSpec.restoreFrom`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpecRestore {
    /// `snap_…`.
    pub snapshot_id: String,
    /// The object's SHA-256 (hex).
    pub sha256: String,
    /// Whether it holds the guest's memory.
    pub include_memory: bool,
    /// Stored entries only: the object's key in the snapshot store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_key: Option<String>,
    /// Served specs only: a download URL signed when served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

/// A volume as the instance attaching it sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachment {
    /// `vol_…`.
    pub volume_id: String,
    /// The disk's serial (`/dev/disk/by-id/virtio-<serial>`).
    pub serial: String,
    /// Where the guest mounts it.
    pub mount_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// A volume the node keeps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct NodeVolume {
    /// `vol_…`.
    pub id: String,
    /// Its size (grow only).
    #[serde(rename = "sizeGiB")]
    pub size_gib: i64,
    /// The disk's serial.
    pub serial: String,
}

/// A host command (SPEC §3.7).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostCommand {
    /// `snap_…`: reported back in `commandResults`.
    pub id: String,
    /// `snapshot`.
    pub kind: String,
    /// The instance it acts on.
    pub instance_id: String,
    /// Whether to include the guest's memory.
    pub include_memory: bool,
    /// Stored form only: the object's key in the snapshot store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_key: Option<String>,
    /// Served specs only: where to PUT the snapshot, signed when served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_url: Option<String>,
    /// Served specs only: the headers the upload must carry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_headers: Option<BTreeMap<String, String>>,
}
