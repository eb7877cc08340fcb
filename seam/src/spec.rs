//! The payloads of the seam: the NodeSpec a host reads, and the report lines and command
//! results it sends back (SPEC §3.7, §5.1).
//!
//! Every field a host may go without is optional or defaulted, and a `null` reads as absent:
//! an older server omits the newer fields, and the server writes some absent values as `null`.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

/// The node's spec.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeSpec {
    /// Moves whenever the content changes, and only then.
    pub generation: u64,
    /// Every live instance placed on the node.
    #[serde(default, deserialize_with = "nullable")]
    pub instances: Vec<InstanceSpec>,
    /// Host commands (snapshots) to run until their outcome is reported.
    #[serde(default, deserialize_with = "nullable")]
    pub commands: Vec<HostCommand>,
    /// The sandbox volumes the node keeps.
    #[serde(default, deserialize_with = "nullable")]
    pub volumes: Vec<VolumeSpec>,
}

/// A host command of the spec (SPEC §3.7). Kinds a host does not know are its to refuse.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostCommand {
    /// `snap_…`: reported back in `commandResults`.
    pub id: String,
    /// `snapshot`.
    pub kind: String,
    /// The instance it acts on.
    #[serde(default, deserialize_with = "nullable")]
    pub instance_id: String,
    /// Whether to include the guest's memory.
    #[serde(default, deserialize_with = "nullable")]
    pub include_memory: bool,
    /// Where to PUT the snapshot object.
    #[serde(default)]
    pub upload_url: Option<String>,
    /// The headers that upload must carry, exactly.
    #[serde(default, deserialize_with = "nullable")]
    pub upload_headers: BTreeMap<String, String>,
}

/// What a host command ended with (`nodes.report.commandResults`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CommandResult {
    /// The command's id.
    pub id: String,
    /// Whether it succeeded.
    pub ok: bool,
    /// The object's SHA-256 (hex), when it succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The object's size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// A memory snapshot's CPU model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl CommandResult {
    /// A failed command, with why.
    pub fn failed(id: &str, reason: impl Into<String>) -> CommandResult {
        CommandResult {
            id: id.to_owned(),
            ok: false,
            sha256: None,
            size_bytes: None,
            cpu_model: None,
            reason: Some(reason.into()),
        }
    }
}

/// `InstanceSpec.restoreFrom`: boot from this snapshot, once its digest checks out.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreFrom {
    /// `snap_…`.
    pub snapshot_id: String,
    /// A download URL, signed when the spec was served.
    #[serde(default, deserialize_with = "nullable")]
    pub url: String,
    /// The object's SHA-256 (hex).
    #[serde(default, deserialize_with = "nullable")]
    pub sha256: String,
    /// A memory snapshot (the guest resumes where it was, not booted).
    #[serde(default, deserialize_with = "nullable")]
    pub include_memory: bool,
}

/// A volume the node keeps.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeSpec {
    /// `vol_…`.
    pub id: String,
    /// Its size.
    #[serde(rename = "sizeGiB")]
    pub size_gib: u64,
    /// The disk's virtio serial (absent from older servers).
    #[serde(default, deserialize_with = "nullable")]
    pub serial: String,
}

/// A volume an instance attaches (`InstanceSpec.volumes`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VolumeAttachment {
    /// `vol_…`.
    pub volume_id: String,
    /// The disk's virtio serial.
    pub serial: String,
    /// Where the guest mounts it.
    pub mount_path: String,
    /// Mounted read-only.
    #[serde(default)]
    pub read_only: bool,
}

/// A sandbox template's network rule (`InstanceSpec.networkPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkPolicy {
    /// The pool's range and the outside world, but for private and reserved ranges.
    Egress,
    /// Only the pool's own range.
    Private,
    /// Nothing but the host's exec path.
    None,
}

/// One instance as the host must run it.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceSpec {
    /// `inst_…`.
    pub id: String,
    /// What the host should make of it.
    pub desired_state: DesiredState,
    /// The pool's runtime (`qemu`, `libvirt-kvm`, …); empty when the server names none.
    #[serde(default, deserialize_with = "nullable")]
    pub runtime: String,
    /// What it books.
    #[serde(default)]
    pub shape: Option<Shape>,
    /// What it boots.
    #[serde(default)]
    pub image: Option<ImageRef>,
    /// The sealed user data (`secret://…`), read with `nodes.secret`.
    #[serde(default)]
    pub user_data_ref: Option<String>,
    /// Its network interfaces.
    #[serde(default, deserialize_with = "nullable")]
    pub nics: Vec<Nic>,
    /// Boot from this snapshot.
    #[serde(default)]
    pub restore_from: Option<RestoreFrom>,
    /// Who the guest's `sshd` admits (SPEC §3.11; absent from older servers).
    #[serde(default)]
    pub ssh_ca: Option<SshCa>,
    /// A sandbox template's network rule.
    #[serde(default)]
    pub network_policy: Option<NetworkPolicy>,
    /// The allow-list narrowing `egress` (absent from older servers: none).
    #[serde(default, deserialize_with = "nullable")]
    pub network_allow: Vec<String>,
    /// The bandwidth bound in Mbit/s each way (absent: the host's default).
    #[serde(default)]
    pub network_bandwidth_mbit: Option<u32>,
    /// The connection bound (absent: the host's default).
    #[serde(default)]
    pub network_max_connections: Option<u32>,
    /// The volumes it attaches.
    #[serde(default, deserialize_with = "nullable")]
    pub volumes: Vec<VolumeAttachment>,
    /// Moves on every start request (absent from older servers): with it, a start that follows
    /// a stop the host never saw still reads as a new request.
    #[serde(default)]
    pub start_generation: Option<u64>,
}

/// The flavor's shape, as the server sends it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct Shape {
    /// Virtual CPUs.
    pub vcpu: u32,
    /// Memory in GiB.
    #[serde(rename = "memoryGiB")]
    pub memory_gib: u32,
    /// Disk in GiB.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u32,
}

/// The image an instance boots. Each part may be missing (an image registered without it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct ImageRef {
    /// Where to fetch it.
    #[serde(default)]
    pub url: Option<String>,
    /// Its SHA-256 (hex), checked before use.
    #[serde(default)]
    pub sha256: Option<String>,
    /// `bundle`, `qcow2`, …
    #[serde(default)]
    pub format: Option<String>,
}

/// What the instance's guest admits over SSH.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SshCa {
    /// The deployment's sandbox CA, an OpenSSH public key line.
    pub public_key: String,
    /// The one principal the guest admits (`inst_…`).
    pub principal: String,
}

/// What the host should make of an instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DesiredState {
    /// Boot it, or resume it.
    Running,
    /// Shut it down; its disk stays.
    Stopped,
    /// Freeze it with its memory.
    Paused,
    /// Tear it down.
    Deleted,
    /// A state a newer server may send: the host leaves such an instance as it is.
    #[serde(other)]
    Unknown,
}

/// A network interface.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Nic {
    /// The host bridge its tap attaches to.
    #[serde(default, deserialize_with = "nullable")]
    pub bridge: String,
    /// Stable, locally administered.
    #[serde(default, deserialize_with = "nullable")]
    pub mac: String,
    /// The leased address, CIDR form (`10.0.0.2/24`).
    #[serde(default)]
    pub address: Option<String>,
    /// The pool's gateway address (absent from older servers).
    #[serde(default)]
    pub gateway: Option<String>,
}

/// A host-side instance state, as reports name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum ReportState {
    /// Up.
    Running,
    /// Shut down (or refused: `ResourcesExhausted: …`).
    Stopped,
    /// Frozen with its memory.
    Paused,
    /// Failed; the message says why.
    Error,
    /// Not known yet (booting): the server skips it.
    Unspecified,
}

/// One line of a status report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReportEntry {
    /// `inst_…`.
    pub id: String,
    /// Its state.
    pub state: ReportState,
    /// Why (errors, refusals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The guest's addresses.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// A memory restore this host gave an SSH identity of its own. Sent only when true: a
    /// server from before it refuses unknown fields.
    #[serde(rename = "identityRebound", skip_serializing_if = "Option::is_none")]
    pub identity_rebound: Option<bool>,
    /// CPU seconds the guest has used since it started (idle pause reads them); absent when
    /// the host cannot tell.
    #[serde(rename = "cpuSeconds", skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<f64>,
}

impl ReportEntry {
    /// Whether `other` says the same about the guest, its CPU seconds aside: they move while
    /// a guest runs, and a report is not due for that alone.
    pub fn same_but_cpu(&self, other: &ReportEntry) -> bool {
        self.id == other.id
            && self.state == other.state
            && self.message == other.message
            && self.addresses == other.addresses
            && self.identity_rebound == other.identity_rebound
    }
}

/// `null` read as the type's default, as a missing field is.
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_instance_spec_reads_every_field_the_server_sends_and_the_new_optional_ones() {
        let spec: NodeSpec = serde_json::from_value(json!({
            "nodeId": "node_a", "generation": 7, "volumes": [], "commands": [],
            "instances": [{
                "id": "inst_a", "desiredState": "running", "runtime": "qemu",
                "shape": { "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 },
                "image": { "url": "http://x/img.tar", "sha256": "ab", "format": "bundle" },
                "userDataRef": "secret://ud/1", "allocationId": null, "gpus": [],
                "nics": [{ "bridge": "vpsbr0", "mac": "02:00:00:00:00:01",
                           "address": "10.0.0.2/24", "gateway": "10.0.0.1" }],
                "sshCa": { "publicKey": "ssh-ed25519 AAAA ca", "principal": "inst_a" }
            }, {
                "id": "inst_b", "desiredState": "hibernated", "runtime": null,
                "shape": { "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 },
                "image": { "url": null, "sha256": null, "format": null },
                "userDataRef": null, "allocationId": null, "gpus": [],
                "nics": [{ "bridge": "b", "mac": "m", "address": "10.0.0.3/24" }]
            }]
        }))
        .unwrap();
        assert_eq!(spec.generation, 7);
        let a = &spec.instances[0];
        assert_eq!(a.desired_state, DesiredState::Running);
        assert_eq!(
            a.shape,
            Some(Shape {
                vcpu: 2,
                memory_gib: 4,
                disk_gib: 20
            })
        );
        let image = a.image.clone().unwrap();
        assert_eq!(image.format.as_deref(), Some("bundle"));
        assert_eq!(a.nics[0].gateway.as_deref(), Some("10.0.0.1"));
        assert_eq!(a.ssh_ca.as_ref().unwrap().principal, "inst_a");
        let b = &spec.instances[1];
        assert_eq!(b.desired_state, DesiredState::Unknown);
        assert_eq!(b.runtime, "");
        assert_eq!(b.nics[0].gateway, None);
        assert_eq!(b.ssh_ca, None);
    }

    #[test]
    fn a_report_line_names_its_state_in_capitals_and_leaves_out_what_it_lacks() {
        let entry = ReportEntry {
            id: "inst_a".into(),
            state: ReportState::Error,
            message: Some("boom".into()),
            addresses: vec![],
            identity_rebound: None,
            cpu_seconds: None,
        };
        assert_eq!(
            serde_json::to_value(&entry).unwrap(),
            json!({ "id": "inst_a", "state": "ERROR", "message": "boom" })
        );
    }
}
