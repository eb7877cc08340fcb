//! A sandbox's snapshots: asked for with `sandboxes.snapshot`, taken by the sandbox's node
//! (a host command in its spec), settled by the node's report or a timeout, restored by
//! `sandboxes.create { fromSnapshot }`, deleted with the sandbox unless kept, and purged from
//! the store once nothing can still need the object. Their events are on the sandbox's stream
//! (subject `sandbox/<id>`), so a kept snapshot outlives its sandbox there too.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::event::{SnapshotFailed, SnapshotReady, SnapshotRef, SnapshotRequested};
use super::{Sandbox, SandboxEvent};
use crate::error::DomainError;
use crate::instance::RestoreFrom;
use crate::operator::RUNTIMES_WITH_SNAPSHOTS;
use crate::state_table::InstanceState;

/// Where a snapshot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotState {
    /// Asked for; the node has not reported it.
    Pending,
    /// Stored, with its digest and size.
    Ready,
    /// The node failed it, or it never settled.
    Failed,
}

/// A snapshot as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    /// `snap_…`.
    pub id: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The sandbox's template: a restore runs under it.
    pub template_id: String,
    /// The sandbox's owner, the only one who may restore it.
    pub owner_identity_id: String,
    /// Where it is.
    pub state: SnapshotState,
    /// With the guest's memory.
    pub include_memory: bool,
    /// Outlives its sandbox.
    pub keep: bool,
    /// The runtime that took it.
    pub runtime: String,
    /// The node that took it.
    pub node_id: String,
    /// The instance it was taken of.
    pub instance_id: String,
    /// The instance whose SSH identity a memory restore resumes with.
    pub principal_instance_id: String,
    /// The stored object's SHA-256 (hex), once ready.
    pub sha256: Option<String>,
    /// Its size, once ready.
    pub size_bytes: Option<u64>,
    /// A memory snapshot: the CPU model it was taken on.
    pub cpu_model: Option<String>,
    /// Why it failed.
    pub reason: Option<String>,
    /// The key its id derives from.
    pub idempotency_key: Option<String>,
    /// Hash of the request.
    pub request_hash: String,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// When it became ready.
    pub ready_at: Option<DateTime<Utc>>,
    /// When it was deleted (hidden from reads and restores).
    pub deleted_at: Option<DateTime<Utc>>,
    /// Its stored object was removed.
    pub purged: bool,
}

impl Snapshot {
    /// Deleted: hidden from reads and restores.
    pub fn is_deleted(&self) -> bool {
        self.deleted_at.is_some()
    }
}

/// The store's key for a snapshot's object: per tenant, so a purge or a listing never
/// crosses tenants.
pub fn object_key(tenant_id: &str, snapshot_id: &str) -> String {
    format!("{tenant_id}/{snapshot_id}")
}

/// Applies a snapshot event to its sandbox.
pub(super) fn evolve(s: &mut Sandbox, event: &SandboxEvent, at: DateTime<Utc>) {
    match event {
        SandboxEvent::SnapshotRequested(r) => {
            s.snapshots.insert(
                r.snapshot_id.clone(),
                Snapshot {
                    id: r.snapshot_id.clone(),
                    sandbox_id: s.id.clone(),
                    tenant_id: s.tenant_id.clone(),
                    template_id: s.template_id.clone(),
                    owner_identity_id: r.owner_identity_id.clone(),
                    state: SnapshotState::Pending,
                    include_memory: r.include_memory,
                    keep: r.keep,
                    runtime: r.runtime.clone(),
                    node_id: r.node_id.clone(),
                    instance_id: r.ids.instance_id.clone(),
                    principal_instance_id: r.principal_instance_id.clone(),
                    sha256: None,
                    size_bytes: None,
                    cpu_model: None,
                    reason: None,
                    idempotency_key: r.idempotency_key.clone(),
                    request_hash: r.request_hash.clone(),
                    created_at: at,
                    ready_at: None,
                    deleted_at: None,
                    purged: false,
                },
            );
        }
        SandboxEvent::SnapshotReady(r) => {
            if let Some(snap) = s.snapshots.get_mut(&r.snapshot_id) {
                snap.state = SnapshotState::Ready;
                snap.sha256 = Some(r.sha256.clone());
                snap.size_bytes = Some(r.size_bytes);
                snap.cpu_model = r.cpu_model.clone();
                snap.ready_at = Some(at);
            }
        }
        SandboxEvent::SnapshotFailed(r) => {
            if let Some(snap) = s.snapshots.get_mut(&r.snapshot_id) {
                snap.state = SnapshotState::Failed;
                snap.reason = Some(r.reason.clone());
            }
        }
        SandboxEvent::SnapshotDeleted(r) => {
            if let Some(snap) = s.snapshots.get_mut(&r.snapshot_id) {
                snap.deleted_at.get_or_insert(at);
            }
        }
        SandboxEvent::SnapshotPurged(r) => {
            if let Some(snap) = s.snapshots.get_mut(&r.snapshot_id) {
                snap.purged = true;
            }
        }
        _ => {}
    }
}

/// `sandboxes.snapshot` as the decision sees it.
#[derive(Debug, Clone)]
pub struct TakeSnapshot {
    /// The id: derived from the key, or fresh.
    pub snapshot_id: String,
    /// With the guest's memory (default true).
    pub include_memory: bool,
    /// Outlives the sandbox (default false).
    pub keep: bool,
    /// The key, when given.
    pub idempotency_key: Option<String>,
    /// Hash of the request (sandbox, memory, keep).
    pub request_hash: String,
}

/// What a snapshot decision reads about the sandbox's instance.
#[derive(Debug, Clone)]
pub struct InstanceFacts {
    /// Its state.
    pub state: InstanceState,
    /// Its node.
    pub node_id: Option<String>,
    /// The pool's runtime.
    pub runtime: String,
    /// It has passthrough GPUs.
    pub gpus: bool,
    /// It attaches a volume read-write.
    pub writes_volume: bool,
    /// The instance whose SSH identity its guest answers to (itself, unless it is a memory
    /// restore).
    pub principal_instance_id: String,
}

/// What a snapshot request decided.
#[derive(Debug)]
pub enum Take {
    /// The key already took this snapshot: answer it.
    Replay(Box<Snapshot>),
    /// Record these events.
    New(Vec<SandboxEvent>),
}

/// Decides `sandboxes.snapshot`: a replay of the key's snapshot, or the request, refused
/// before anything reaches a host when the sandbox cannot be snapshotted.
pub fn take(s: &Sandbox, i: &InstanceFacts, t: &TakeSnapshot) -> Result<Take, DomainError> {
    if let Some(existing) = s.snapshots.get(&t.snapshot_id) {
        if existing.request_hash == t.request_hash {
            return Ok(Take::Replay(Box::new(existing.clone())));
        }
        return Err(key_conflict(&t.snapshot_id));
    }
    if !s.state.is_open() {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is {}",
            s.id,
            s.state.as_str()
        )));
    }
    // One in flight per sandbox: a host takes one at a time, and each request costs a store
    // upload; a second waits for the first to settle.
    if let Some(pending) = s
        .snapshots
        .values()
        .find(|x| x.state == SnapshotState::Pending && !x.is_deleted())
    {
        return Err(DomainError::conflict(
            format!(
                "snapshot {} of sandbox {} is still pending; take another once it settles",
                pending.id, s.id
            ),
            "snapshotId",
            pending.id.clone(),
        ));
    }
    let node_id = match (&i.node_id, i.state) {
        (Some(node), InstanceState::Running | InstanceState::Paused) => node.clone(),
        _ => {
            return Err(DomainError::invalid_state(format!(
                "sandbox {}'s instance is {}, not running or paused on a node",
                s.id,
                i.state.as_str()
            )))
        }
    };
    if !RUNTIMES_WITH_SNAPSHOTS.contains(&i.runtime.as_str()) {
        return Err(DomainError::unsupported(format!(
            "runtime {} takes no snapshots",
            i.runtime
        )));
    }
    if t.include_memory && i.gpus {
        return Err(DomainError::invalid_state_because(
            "a memory snapshot cannot hold passthrough GPUs' state; take one with includeMemory: false",
            "memory-snapshot-with-gpus",
        ));
    }
    if t.include_memory && i.writes_volume {
        return Err(DomainError::invalid_state_because(
            "a memory snapshot would not match a volume attached read-write; take one with includeMemory: false",
            "memory-snapshot-with-volumes",
        ));
    }
    Ok(Take::New(vec![SandboxEvent::SnapshotRequested(
        SnapshotRequested {
            ids: s.lifecycle(),
            snapshot_id: t.snapshot_id.clone(),
            include_memory: t.include_memory,
            keep: t.keep,
            runtime: i.runtime.clone(),
            node_id,
            owner_identity_id: s.owner_identity_id.clone(),
            principal_instance_id: i.principal_instance_id.clone(),
            idempotency_key: t.idempotency_key.clone(),
            request_hash: t.request_hash.clone(),
        },
    )]))
}

/// The key's snapshot is another request (another sandbox, memory or keep).
pub fn key_conflict(snapshot_id: &str) -> DomainError {
    DomainError::conflict(
        format!("idempotency key already used for a different snapshot ({snapshot_id})"),
        "snapshotId",
        snapshot_id.to_string(),
    )
}

/// What a node reported for a snapshot command (`commandResults` of `nodes.report`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CommandResult {
    /// The command's id (the snapshot's).
    pub id: String,
    /// It succeeded.
    pub ok: bool,
    /// The uploaded object's SHA-256 (hex).
    #[serde(default)]
    pub sha256: Option<String>,
    /// Its size.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// The node's CPU model (memory snapshots).
    #[serde(default)]
    pub cpu_model: Option<String>,
    /// Why it failed.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Settles a pending snapshot with its node's result (nothing once settled). A success
/// without a well-formed digest and size fails as `bad-result`. A memory snapshot records
/// the reported CPU model, or the node's registered one.
pub fn settle(s: &Sandbox, r: &CommandResult, node_cpu_model: Option<&str>) -> Vec<SandboxEvent> {
    let Some(snap) = s.snapshots.get(&r.id) else {
        return Vec::new();
    };
    if snap.state != SnapshotState::Pending {
        return Vec::new();
    }
    let digest = r
        .sha256
        .as_deref()
        .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()));
    match (r.ok, digest, r.size_bytes) {
        (true, Some(sha256), Some(size_bytes)) => {
            vec![SandboxEvent::SnapshotReady(SnapshotReady {
                ids: s.lifecycle(),
                snapshot_id: snap.id.clone(),
                include_memory: snap.include_memory,
                sha256: sha256.to_ascii_lowercase(),
                size_bytes,
                cpu_model: snap
                    .include_memory
                    .then(|| {
                        r.cpu_model
                            .as_deref()
                            .or(node_cpu_model)
                            .map(str::to_string)
                    })
                    .flatten(),
            })]
        }
        (true, _, _) => fail(s, snap, "bad-result"),
        (false, _, _) => fail(s, snap, r.reason.as_deref().unwrap_or("failed")),
    }
}

/// Fails a snapshot still pending when its command timed out.
pub fn time_out(s: &Sandbox, snapshot_id: &str) -> Vec<SandboxEvent> {
    match s.snapshots.get(snapshot_id) {
        Some(snap) if snap.state == SnapshotState::Pending => fail(s, snap, "timeout"),
        _ => Vec::new(),
    }
}

fn fail(s: &Sandbox, snap: &Snapshot, reason: &str) -> Vec<SandboxEvent> {
    vec![SandboxEvent::SnapshotFailed(SnapshotFailed {
        ids: s.lifecycle(),
        snapshot_id: snap.id.clone(),
        include_memory: snap.include_memory,
        reason: reason.chars().take(500).collect(),
    })]
}

/// Deletes a snapshot (idempotent: nothing for one already deleted).
pub fn delete(s: &Sandbox, snapshot_id: &str) -> Vec<SandboxEvent> {
    match s.snapshots.get(snapshot_id) {
        Some(snap) if !snap.is_deleted() => vec![SandboxEvent::SnapshotDeleted(SnapshotRef {
            ids: s.lifecycle(),
            snapshot_id: snapshot_id.to_string(),
        })],
        _ => Vec::new(),
    }
}

/// The snapshots that go with their sandbox: every one not kept and not yet deleted.
pub fn delete_unkept(s: &Sandbox) -> Vec<SandboxEvent> {
    s.snapshots
        .values()
        .filter(|snap| !snap.keep)
        .flat_map(|snap| delete(s, &snap.id))
        .collect()
}

/// Records that a snapshot's object was removed.
pub fn purged(s: &Sandbox, snapshot_id: &str) -> Vec<SandboxEvent> {
    match s.snapshots.get(snapshot_id) {
        Some(snap) if snap.is_deleted() && !snap.purged => {
            vec![SandboxEvent::SnapshotPurged(SnapshotRef {
                ids: s.lifecycle(),
                snapshot_id: snapshot_id.to_string(),
            })]
        }
        _ => Vec::new(),
    }
}

/// Checks a restore of `snap` by `caller` of `tenant_id` under template `template_id`
/// (whose pool runs `runtime`), and answers what the new instance boots from. Another
/// owner's, another tenant's or a deleted snapshot is `NOT_FOUND`, as if it did not exist.
pub fn restore(
    snap: Option<&Snapshot>,
    snapshot_id: &str,
    tenant_id: &str,
    caller: &str,
    template_id: &str,
    runtime: &str,
) -> Result<RestoreFrom, DomainError> {
    let snap = snap
        .filter(|s| s.tenant_id == tenant_id && s.owner_identity_id == caller && !s.is_deleted())
        .ok_or_else(|| DomainError::NotFound {
            what: format!("snapshot {snapshot_id}"),
        })?;
    if snap.state != SnapshotState::Ready {
        return Err(DomainError::invalid_state(format!(
            "snapshot {snapshot_id} is {}",
            match snap.state {
                SnapshotState::Pending => "pending",
                SnapshotState::Failed => "failed",
                SnapshotState::Ready => "ready",
            }
        )));
    }
    if snap.template_id != template_id {
        return Err(DomainError::invalid_input(
            "templateId",
            format!(
                "snapshot {snapshot_id} restores only under its own template {}",
                snap.template_id
            ),
        ));
    }
    if snap.runtime != runtime {
        return Err(DomainError::invalid_input(
            "fromSnapshot",
            format!(
                "snapshot {snapshot_id} was taken on runtime {}, the template runs {runtime}",
                snap.runtime
            ),
        ));
    }
    Ok(RestoreFrom {
        snapshot_id: snap.id.clone(),
        sha256: snap.sha256.clone().unwrap_or_default(),
        include_memory: snap.include_memory,
        cpu_model: snap.cpu_model.clone().filter(|_| snap.include_memory),
        principal_instance_id: snap
            .include_memory
            .then(|| snap.principal_instance_id.clone()),
    })
}
