//! Sandbox events (SPEC §4.2): subject `sandbox/<id>`; the lifecycle ones carry the template,
//! instance and pool.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// The ids every lifecycle event carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    /// The sandbox (also the subject).
    pub sandbox_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Its template.
    pub template_id: String,
    /// The instance it drives.
    pub instance_id: String,
    /// The instance's pool.
    pub pool_id: String,
}

/// `sandbox.created`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxCreated {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// A warm instance was claimed.
    pub warm: bool,
    /// The lifetime asked for.
    pub ttl_seconds: u64,
    /// Admission time plus the lifetime.
    pub expires_at: DateTime<Utc>,
    /// Who made it.
    pub owner_identity_id: String,
    /// The create's key.
    pub idempotency_key: String,
    /// Hash of the create request.
    pub request_hash: String,
    /// A restore: the snapshot it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// What the end of its lifetime does.
    #[serde(default, skip_serializing_if = "super::OnTimeout::is_delete")]
    pub on_timeout: super::OnTimeout,
    /// Its labels.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
}

/// `sandbox.labeled`: the sandbox's labels now (they replace the earlier ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxLabeled {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The labels.
    pub labels: crate::labels::Labels,
}

/// `sandbox.ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxReady {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// A warm instance was claimed.
    pub warm: bool,
}

/// `sandbox.failed`: its instance failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxFailed {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The instance's failure reason.
    pub reason: String,
}

/// `sandbox.extended`, `sandbox.expiring`, `sandbox.expired`, and the pause and resume
/// events (`sandbox.pausing`, `.paused`: `expiresAt` is when the paused sandbox ends;
/// `sandbox.resuming`, `.resumed`: the fresh lifetime's end).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxExpiry {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The expiry (after an extend: the new one).
    pub expires_at: DateTime<Utc>,
    /// `sandbox.expired`: what the expiry does (`deleted`, or `paused` with `onTimeout:
    /// pause`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ExpiryAction>,
    /// `sandbox.expired`: which clock ran out (`ttl`, `paused-ttl`, `idle`);
    /// `sandbox.pausing` and `sandbox.paused`: `idle` when idleness paused it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl SandboxExpiry {
    /// The plain form: ids and a time.
    pub fn new(ids: Lifecycle, expires_at: DateTime<Utc>) -> Self {
        SandboxExpiry {
            ids,
            expires_at,
            action: None,
            reason: None,
        }
    }
}

/// What an expiry does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpiryAction {
    /// Deletion began.
    Deleted,
    /// The sandbox is being paused (`onTimeout: pause`).
    Paused,
}

/// `sandbox.deleted`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDeleted {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// Its lifetime ended it.
    pub expired: bool,
    /// Why, when not a plain delete (`ttl`, `paused-ttl`, `deadline:<state>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `sandbox.snapshot.requested`: a snapshot was asked for; its host command is in the node's
/// spec until the node reports the outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRequested {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// `snap_…`.
    pub snapshot_id: String,
    /// With the guest's memory.
    pub include_memory: bool,
    /// Outlives its sandbox.
    pub keep: bool,
    /// The runtime that takes it.
    pub runtime: String,
    /// The node that takes it.
    pub node_id: String,
    /// The sandbox's owner: the only one who may restore it.
    pub owner_identity_id: String,
    /// The instance whose SSH identity a memory restore of it resumes with.
    pub principal_instance_id: String,
    /// The key the id derives from, when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Hash of the request, for replay vs `CONFLICT`.
    pub request_hash: String,
}

/// `sandbox.snapshot.ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotReady {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// `snap_…`.
    pub snapshot_id: String,
    /// With the guest's memory.
    pub include_memory: bool,
    /// The stored object's SHA-256 (hex).
    pub sha256: String,
    /// Its size.
    pub size_bytes: u64,
    /// A memory snapshot: the CPU model it was taken on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
}

/// `sandbox.snapshot.failed`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotFailed {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// `snap_…`.
    pub snapshot_id: String,
    /// With the guest's memory.
    pub include_memory: bool,
    /// The host's reason, `timeout`, or `bad-result`.
    pub reason: String,
}

/// `sandbox.snapshot.deleted` (hidden at once) and `sandbox.snapshot.purged` (its stored
/// object removed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotRef {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// `snap_…`.
    pub snapshot_id: String,
}

/// `sandbox.exec.issued`: a short OpenSSH user certificate was signed for the sandbox's
/// instance. The certificate itself is never recorded; its serial and key id name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxExecIssued {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The certificate's serial.
    pub serial: u64,
    /// The certificate's key id (`vps:<tenant>:<sandbox>:<serial>`).
    pub key_id: String,
    /// The principal it is valid for (the instance the guest's sshd answers as).
    pub principal: String,
    /// When it stops being valid.
    pub valid_before: DateTime<Utc>,
}

/// `sandbox.exposed`: a port of the sandbox's guest is reachable at a preview URL until
/// `expiresAt`. The URL's token is never recorded; the port and the expiry name it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxExposed {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The guest's port.
    pub port: u16,
    /// When the preview URL stops answering.
    pub expires_at: DateTime<Utc>,
}

/// `sandbox.unexposed`: the port's preview URL was revoked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxUnexposed {
    /// Ids.
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The guest's port.
    pub port: u16,
}

/// `sandbox.forked` (on the source's stream): one memory snapshot of the source was restored
/// into `sandboxIds`, each a sandbox of its own (address, identity, lifetime).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxForked {
    /// Ids (of the source).
    #[serde(flatten)]
    pub ids: Lifecycle,
    /// The source, named again for readers of the new sandboxes' side.
    pub source_sandbox_id: String,
    /// The memory snapshot every fork restored.
    pub snapshot_id: String,
    /// The new sandboxes, in order.
    pub sandbox_ids: Vec<String>,
    /// The fork's idempotency key.
    pub idempotency_key: String,
}

crate::event_enum! {
    /// What happens to a sandbox.
    pub enum SandboxEvent {
        /// `sandbox.created`.
        Created(SandboxCreated) = "sandbox.created",
        /// `sandbox.ready`.
        Ready(SandboxReady) = "sandbox.ready",
        /// `sandbox.failed`.
        Failed(SandboxFailed) = "sandbox.failed",
        /// `sandbox.extended`.
        Extended(SandboxExpiry) = "sandbox.extended",
        /// `sandbox.expiring`.
        Expiring(SandboxExpiry) = "sandbox.expiring",
        /// `sandbox.expired`: the lifetime ended (deletion began, or with `action: paused`
        /// a pause).
        Expired(SandboxExpiry) = "sandbox.expired",
        /// `sandbox.pausing`: a pause was asked for.
        Pausing(SandboxExpiry) = "sandbox.pausing",
        /// `sandbox.paused`: its instance paused.
        Paused(SandboxExpiry) = "sandbox.paused",
        /// `sandbox.resuming`: a resume was asked for.
        Resuming(SandboxExpiry) = "sandbox.resuming",
        /// `sandbox.resumed`: its instance runs again.
        Resumed(SandboxExpiry) = "sandbox.resumed",
        /// `sandbox.labeled`: its labels were replaced.
        Labeled(SandboxLabeled) = "sandbox.labeled",
        /// `sandbox.deleting`: a delete began.
        Deleting(Lifecycle) = "sandbox.deleting",
        /// `sandbox.deleted`.
        Deleted(SandboxDeleted) = "sandbox.deleted",
        /// `sandbox.snapshot.requested`.
        SnapshotRequested(SnapshotRequested) = "sandbox.snapshot.requested",
        /// `sandbox.snapshot.ready`.
        SnapshotReady(SnapshotReady) = "sandbox.snapshot.ready",
        /// `sandbox.snapshot.failed`.
        SnapshotFailed(SnapshotFailed) = "sandbox.snapshot.failed",
        /// `sandbox.snapshot.deleted`.
        SnapshotDeleted(SnapshotRef) = "sandbox.snapshot.deleted",
        /// `sandbox.snapshot.purged`.
        SnapshotPurged(SnapshotRef) = "sandbox.snapshot.purged",
        /// `sandbox.exec.issued`.
        ExecIssued(SandboxExecIssued) = "sandbox.exec.issued",
        /// `sandbox.exposed`.
        Exposed(SandboxExposed) = "sandbox.exposed",
        /// `sandbox.unexposed`.
        Unexposed(SandboxUnexposed) = "sandbox.unexposed",
        /// `sandbox.forked`.
        Forked(SandboxForked) = "sandbox.forked",
    }
}
