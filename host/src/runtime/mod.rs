//! The runtime seam: what the agent asks of whatever runs guests. `qemu` is the one runtime
//! today; cloud-hypervisor or Firecracker would be a second implementation of [`Runtime`].
//!
//! The agent owns the loop (spec in, report out) and decides *what* should happen; a runtime
//! only does it and tells what it sees. Every method is idempotent: asking for a state the
//! guest is already in succeeds and changes nothing.

use std::future::Future;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

pub mod archive;
pub mod qemu;
mod upload;

pub use upload::upload;

/// What a guest must be, as the agent reads it from an `InstanceSpec`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestSpec {
    /// `inst_…`: also the guest's directory name under the state directory.
    pub id: String,
    pub hostname: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    pub image: ImageRef,
    pub nics: Vec<NicSpec>,
    /// The user data, already unsealed (`nodes.secret`).
    pub user_data: Option<Vec<u8>>,
    /// Who `sshd` admits: the sandbox CA and the instance's principal.
    pub ssh_ca: Option<SshCa>,
    /// The host's own public key (`crate::guest_key`), which `sshd` also admits for
    /// `sandbox`: the tunnel logs in with it once it has checked the client's certificate.
    pub host_ssh_key: Option<String>,
    /// What the guest may reach (`InstanceSpec.networkPolicy`); `None`: no rules of the
    /// runtime's own (a hosted instance: the pool's network decides).
    pub network: Option<NetworkPolicy>,
    /// The node volumes it attaches (`InstanceSpec.volumes`), each made first with
    /// [`Runtime::ensure_volume`].
    pub volumes: Vec<VolumeAttachment>,
}

/// `InstanceSpec.networkPolicy` and its bounds, enforced on the host on each of the guest's
/// taps (see `qemu::policy`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetworkPolicy {
    pub mode: NetworkMode,
    /// Narrows [`NetworkMode::Egress`] to these destinations (`10.1.2.0/24`, `203.0.113.7`),
    /// the pool's own range aside. Empty: everything but private and reserved ranges.
    pub allow: Vec<String>,
    /// The most the guest may send, and the most it is sent, in Mbit/s each way.
    pub bandwidth_mbit: u32,
    /// The most connections (tracked flows) the guest may have open through the host.
    pub max_connections: u32,
}

/// The bandwidth bound of a policy that names none: Mbit/s each way.
pub const DEFAULT_BANDWIDTH_MBIT: u32 = 100;
/// The connection bound of a policy that names none.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 512;

impl NetworkPolicy {
    /// `mode` with no allow-list and the default bounds.
    pub fn new(mode: NetworkMode) -> NetworkPolicy {
        NetworkPolicy {
            mode,
            allow: Vec::new(),
            bandwidth_mbit: DEFAULT_BANDWIDTH_MBIT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// `egress | private | none` (`vps_domain::network_policy::Network`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    /// The pool's range, and the outside world through the host (NAT) but for private and
    /// reserved ranges (unless allowed).
    Egress,
    /// Only the pool's own range (the other guests and the gateway).
    Private,
    /// Nothing, but the host's own SSH connections to the guest's `sshd` (exec).
    None,
}

impl NetworkMode {
    /// `egress`, `private` or `none`.
    pub fn parse(mode: &str) -> Option<NetworkMode> {
        match mode {
            "egress" => Some(NetworkMode::Egress),
            "private" => Some(NetworkMode::Private),
            "none" => Some(NetworkMode::None),
            _ => None,
        }
    }
}

/// A node volume (`NodeSpec.volumes[]`): the host keeps it, whether or not a guest attaches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeSpec {
    /// `vol_…`: also its file's name in the volume store.
    pub id: String,
    /// Its size: a volume only grows.
    pub size_gib: u64,
    /// The disk's virtio serial (at most 20 bytes).
    pub serial: String,
}

/// A volume as a guest attaches it (`InstanceSpec.volumes[]`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct VolumeAttachment {
    /// `vol_…`.
    pub volume_id: String,
    /// The disk's virtio serial: the guest finds the disk by it.
    pub serial: String,
    /// Where the guest mounts it (an absolute path).
    pub mount_path: String,
    pub read_only: bool,
}

/// A volume as the runtime holds it (for the node's report of volume storage).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeObserved {
    pub id: String,
    /// Its virtual size.
    pub size_gib: u64,
    /// What its file takes on the host's disk.
    pub allocated_bytes: u64,
    /// The guests attaching it now.
    pub attached_to: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageRef {
    pub url: String,
    /// Hex SHA-256 of the downloaded file; checked before anything boots from it.
    pub sha256: String,
    /// `bundle` or `qcow2`.
    pub format: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicSpec {
    pub bridge: String,
    pub mac: String,
    /// The leased address, CIDR form (`10.0.0.2/24`).
    pub address: String,
    /// The pool's gateway: the bridge's own address when the agent creates the bridge.
    pub gateway: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SshCa {
    /// OpenSSH public key line of the sandbox CA.
    pub public_key: String,
    /// The one principal the guest's `sshd` admits (`inst_…`).
    pub principal: String,
}

/// A snapshot to make a new guest from (`InstanceSpec.restoreFrom`): an archive that
/// [`Runtime::snapshot`] made on some host and the agent uploaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreSource {
    /// `snap_…`, for messages.
    pub snapshot_id: String,
    /// Where the archive is: a presigned `https://`/`http://` GET, or `file://`.
    pub url: String,
    /// Hex SHA-256 of the archive; checked before anything in it is used.
    pub sha256: String,
}

/// What [`Runtime::snapshot`] made: the snapshot's files in one directory, which [`upload`]
/// streams as one archive ([`archive`]). The caller removes the directory once uploaded, or
/// hands it to [`Runtime::keep_snapshot`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotFiles {
    /// Under the `out_dir` the caller gave.
    pub dir: PathBuf,
    /// The files of `dir` in archive order.
    pub names: Vec<String>,
    /// The archive's exact length: the `sizeBytes` of the command's result.
    pub size_bytes: u64,
    /// Whether it holds the guest's memory and device state.
    pub include_memory: bool,
    /// The CPU model the guest ran with (memory snapshots only): the `cpuModel` of the result.
    pub cpu_model: Option<String>,
    /// How long the guest was frozen for it (also `vps_host_snapshot_pause_seconds`).
    pub paused_ms: u64,
    /// QEMU's own time to save the memory and device state (memory snapshots only).
    pub qemu_save_ms: Option<u64>,
}

/// A guest as the runtime sees it right now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuestState {
    Running,
    Paused,
    /// Shut down cleanly (by the agent, or by the guest itself): no process left.
    Stopped,
    /// The process died or never came up; the message says why (exit status, console tail).
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub id: String,
    pub state: GuestState,
    /// The guest's addresses (CIDR form), as the spec leased them.
    pub addresses: Vec<String>,
}

/// Why a runtime call failed: the agent reports the guest `ERROR` with this message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeError(pub String);

/// Runs guests. Calls for one guest are never made concurrently by the agent; calls for
/// different guests may be.
pub trait Runtime: Send + Sync + 'static {
    /// `qemu`, as pools and nodes name it.
    fn name(&self) -> &'static str;

    /// The CPU model guests run with (reported with memory snapshots).
    fn cpu_model(&self) -> String;

    /// The guests already in the state directory, re-adopted without touching them (after an
    /// agent restart a running guest keeps running).
    fn adopt(&self) -> impl Future<Output = Vec<Observed>> + Send;

    /// Makes the guest run: creates its disk, config drive and tap on first use (fetching and
    /// checking the image), boots it, or `cont`s it when paused. Never reboots a running guest.
    fn run(&self, spec: &GuestSpec) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Clean shutdown (ACPI power-down, then quit after a timeout); the disk stays.
    fn stop(&self, id: &str) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Freezes the guest with its memory kept (QMP `stop`), booting it first if needed.
    fn pause(&self, spec: &GuestSpec) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Kills the guest and removes everything it had: process, overlay, tap, config drive.
    fn delete(&self, id: &str) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Every guest the runtime holds, with its state now.
    fn observe(&self) -> impl Future<Output = Vec<Observed>> + Send;

    /// Where the guest's `sshd` listens, for the tunnel endpoint.
    fn ssh_address(&self, id: &str) -> Option<(IpAddr, u16)>;

    /// CPU seconds the guest has used since its process started, when the runtime can tell
    /// (`cpuSeconds` in reports; idle pause reads them).
    fn cpu_seconds(&self, _id: &str) -> Option<f64> {
        None
    }

    /// Whether the guest is a memory restore that still answers to its source's SSH identity
    /// (its new one not taken yet): its `identityRebound` waits.
    fn identity_pending(&self, _id: &str) -> bool {
        false
    }

    /// Whether the guest is down because it powered itself off: not stopped by the runtime,
    /// not failed. A restarted agent keeps such a guest down, as the agent before it did.
    fn powered_itself_off(&self, _id: &str) -> bool {
        false
    }

    /// Takes a snapshot of the guest into a directory under `out_dir` (the `snapshot` host
    /// command). The guest keeps the state it had (running or paused); it is frozen only
    /// while its state is saved. Disk-only snapshots also work on a stopped guest. Upload it
    /// with [`upload`], then remove it or give it to [`Runtime::keep_snapshot`].
    fn snapshot(
        &self,
        id: &str,
        include_memory: bool,
        out_dir: &Path,
    ) -> impl Future<Output = Result<SnapshotFiles, RuntimeError>> + Send;

    /// Keeps an uploaded snapshot's files as the restore cache's entry for its archive digest
    /// `sha256`, so a restore on this host needs no download (the files move; a runtime
    /// that cannot keep them leaves them for the caller to remove).
    fn keep_snapshot(&self, files: &SnapshotFiles, sha256: &str)
        -> impl Future<Output = ()> + Send;

    /// [`Runtime::run`] for a spec with `restoreFrom`: a guest that does not exist yet is
    /// made from the snapshot (downloaded once per digest and checked), with an identity of
    /// its own; from then on it is an ordinary guest, and this is `run`.
    fn restore(
        &self,
        spec: &GuestSpec,
        from: &RestoreSource,
    ) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Makes node volume `volume` exist at least `size_gib` large: a new one is blank (the
    /// guest that first mounts it formats it), a smaller one grows (and a running guest
    /// attaching it is told, QMP `block_resize`); a volume never shrinks. Call it for every
    /// `NodeSpec.volumes[]` entry before running a guest that attaches it.
    fn ensure_volume(
        &self,
        volume: &VolumeSpec,
    ) -> impl Future<Output = Result<VolumeObserved, RuntimeError>> + Send;

    /// Removes a volume no `NodeSpec.volumes[]` lists any more. A volume a guest attaches is
    /// refused; one that does not exist is not an error.
    fn delete_volume(&self, id: &str) -> impl Future<Output = Result<(), RuntimeError>> + Send;

    /// Every volume in the volume store.
    fn volumes(&self) -> impl Future<Output = Vec<VolumeObserved>> + Send;
}
