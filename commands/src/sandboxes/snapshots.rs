//! Snapshots: `sandboxes.snapshot` asks the sandbox's node for one (the host command rides in
//! its spec), the node's report settles it, the reconciler times out the ones that never
//! settle and purges deleted ones from the store, and `sandboxSnapshots.delete` hides one at
//! once. Restores read a snapshot here too (see [`restore_from`]).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use vps_domain::instance::RestoreFrom;
use vps_domain::sandbox::snapshot::{
    self as domain, CommandResult, InstanceFacts, Take, TakeSnapshot,
};
use vps_domain::sandbox::{Sandbox, Snapshot};
use vps_domain::DomainError;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::transaction;
use crate::record::new_id;
use crate::stream::{change, load, record_existing};
use vps_domain::ids::SandboxId;

/// `sandboxes.snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotInput {
    /// The tenant.
    pub tenant_id: String,
    /// `sbx_…`.
    pub sandbox_id: SandboxId,
    /// With the guest's memory (default true).
    pub include_memory: Option<bool>,
    /// Outlives the sandbox (default false: deleted with it).
    pub keep: Option<bool>,
    /// With a key, the id derives from it and a retry answers the same snapshot.
    pub idempotency_key: Option<String>,
}

/// What one tenant may keep: snapshots taken with `keep` and not deleted, and the GiB of
/// those stored (`[limits] snapshots_per_tenant`, `snapshot_gib_per_tenant`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeptLimits {
    /// Kept snapshots.
    pub count: u64,
    /// GiB of kept snapshots (their stored size, rounded up).
    pub gib: u64,
}

impl Default for KeptLimits {
    fn default() -> Self {
        KeptLimits {
            count: 100,
            gib: 1000,
        }
    }
}

/// Takes a snapshot of a sandbox (or answers the one its key already took), within the
/// default [`KeptLimits`].
pub async fn take(ctx: &Ctx, input: SnapshotInput) -> Result<Snapshot, CommandError> {
    take_within(ctx, input, KeptLimits::default()).await
}

/// Refuses a kept snapshot past the tenant's allowance (`QUOTA_EXCEEDED`, as for instances):
/// counted under a per-tenant lock, so concurrent takes cannot both pass.
async fn check_kept(
    tx: &mut PgConnection,
    tenant_id: &str,
    limits: KeptLimits,
) -> Result<(), CommandError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('kept-snapshots:' || $1, 0))")
        .bind(tenant_id)
        .execute(&mut *tx)
        .await?;
    let kept = vps_projections::sandboxes::kept_snapshots(&mut *tx, tenant_id).await?;
    let (count, bytes) = (kept.count, kept.bytes);
    let count = u64::try_from(count).unwrap_or(0);
    let gib = u64::try_from(bytes).unwrap_or(0).div_ceil(1 << 30);
    if count + 1 > limits.count {
        return Err(DomainError::TenantQuotaExceeded {
            resource: "snapshots",
            requested: 1,
            max: limits.count,
            used: count,
        }
        .into());
    }
    if gib >= limits.gib {
        return Err(DomainError::TenantQuotaExceeded {
            resource: "snapshotGiB",
            requested: 0,
            max: limits.gib,
            used: gib,
        }
        .into());
    }
    Ok(())
}

/// [`take`] within `limits`.
pub async fn take_within(
    ctx: &Ctx,
    input: SnapshotInput,
    limits: KeptLimits,
) -> Result<Snapshot, CommandError> {
    let key = input.idempotency_key.as_deref();
    if key.is_some_and(|k| k.trim().is_empty() || k.len() > 256) {
        return Err(DomainError::invalid_input("idempotencyKey", "1 to 256 characters").into());
    }
    let id = match key {
        Some(k) => vps_domain::ids::snapshot_id(vps_domain::ids::Origin {
            tenant: &input.tenant_id,
            caller: &ctx.actor.identity,
            key: k,
        }),
        None => new_id(vps_domain::ids::prefix::SNAPSHOT),
    };
    let request = TakeSnapshot {
        snapshot_id: id.clone(),
        include_memory: input.include_memory.unwrap_or(true),
        keep: input.keep.unwrap_or(false),
        idempotency_key: input.idempotency_key.clone(),
        request_hash: data_encoding::HEXLOWER.encode(&Sha256::digest(
            format!(
                "{}\n{}\n{}",
                input.sandbox_id,
                input.include_memory.unwrap_or(true),
                input.keep.unwrap_or(false)
            )
            .as_bytes(),
        )),
    };
    transaction(ctx, &id, async |tx| {
        // A key already used on another sandbox is a conflict, whatever that sandbox is now.
        if let Some(other) = sandbox_of(tx, &id).await? {
            if other != input.sandbox_id.as_str() {
                return Err(domain::key_conflict(&id).into());
            }
        }
        let s = super::visible(tx, &input.tenant_id, &input.sandbox_id).await?;
        let facts = instance_facts(tx, &s.instance_id).await?;
        let events = match domain::take(&s, &facts, &request)? {
            Take::Replay(snap) => return Ok(*snap),
            Take::New(events) => events,
        };
        if request.keep {
            check_kept(tx, &s.tenant_id, limits).await?;
        }
        let after = record_existing(ctx, tx, &s.id, Some(&s), events, Some(&s.tenant_id)).await?;
        taken(&after, &id)
    })
    .await
}

/// What a snapshot decision reads about the sandbox's instance.
async fn instance_facts(
    tx: &mut PgConnection,
    instance_id: &str,
) -> Result<InstanceFacts, CommandError> {
    let inst = vps_projections::instances::load(tx, instance_id)
        .await?
        .ok_or_else(|| DomainError::invalid_state(format!("instance {instance_id} is gone")))?;
    let runtime = vps_projections::pools::runtime(tx, &inst.pool_id).await?;
    Ok(InstanceFacts {
        state: inst.state,
        node_id: inst.node_id.clone(),
        runtime: runtime.unwrap_or_else(|| "libvirt-kvm".into()),
        gpus: inst.shape.gpus.as_ref().is_some_and(|g| g.count > 0),
        writes_volume: inst.writes_volume(),
        principal_instance_id: inst
            .restore_from
            .as_ref()
            .and_then(|r| r.principal_instance_id.clone())
            .unwrap_or_else(|| inst.id.clone()),
    })
}

/// The sandbox a snapshot id belongs to, from the snapshots' projection.
async fn sandbox_of(
    tx: &mut PgConnection,
    snapshot_id: &str,
) -> Result<Option<String>, CommandError> {
    Ok(vps_projections::sandboxes::sandbox_of_snapshot(&mut *tx, snapshot_id).await?)
}

/// A snapshot the tenant may see: deleted, unknown or another tenant's is `NOT_FOUND`.
pub async fn visible(
    tx: &mut PgConnection,
    tenant_id: &str,
    snapshot_id: &str,
) -> Result<(Sandbox, Snapshot), CommandError> {
    let not_found = || DomainError::NotFound {
        what: format!("snapshot {snapshot_id}"),
    };
    let sandbox_id = sandbox_of(tx, snapshot_id).await?.ok_or_else(not_found)?;
    let s = load::<Sandbox>(tx, &sandbox_id)
        .await?
        .ok_or_else(not_found)?;
    match s.snapshots.get(snapshot_id) {
        Some(snap) if snap.tenant_id == tenant_id && !snap.is_deleted() => {
            let snap = snap.clone();
            Ok((s, snap))
        }
        _ => Err(not_found().into()),
    }
}

/// `sandboxSnapshots.delete`: hides the snapshot at once (idempotent: deleting it again, or
/// a deleted one, answers `NOT_FOUND` only when it never was the tenant's). The reconciler
/// removes the stored object later, so no network call runs here.
pub async fn delete(
    ctx: &Ctx,
    tenant_id: &str,
    snapshot_id: &str,
) -> Result<Snapshot, CommandError> {
    transaction(ctx, snapshot_id, async |tx| {
        let (s, _) = visible(tx, tenant_id, snapshot_id).await?;
        let events = domain::delete(&s, snapshot_id);
        let after = record_existing(ctx, tx, &s.id, Some(&s), events, Some(tenant_id)).await?;
        taken(&after, snapshot_id)
    })
    .await
}

/// Snapshot `snapshot_id` as sandbox `s` keeps it.
fn taken(s: &Sandbox, snapshot_id: &str) -> Result<Snapshot, CommandError> {
    s.snapshots
        .get(snapshot_id)
        .cloned()
        .ok_or_else(|| CommandError::not_found(format!("snapshot {snapshot_id}")))
}

/// What the snapshot store holds for an uploaded object, as the server read it before the
/// report's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredObject {
    /// The SHA-256 (hex) the store computed from the bytes it received.
    Sha256(String),
    /// The store holds no such object.
    Absent,
}

/// A success whose stored object disagrees with it becomes a failure: `digest-mismatch`
/// when the store hashed other bytes than the host reports, `upload-missing` when the
/// store holds nothing.
fn checked(result: &CommandResult, stored: Option<&StoredObject>) -> CommandResult {
    let reported = result.sha256.as_deref().map(str::to_ascii_lowercase);
    let reason = match (result.ok, stored) {
        (true, Some(StoredObject::Sha256(actual))) if reported.as_deref() != Some(actual) => {
            tracing::warn!(snapshot = %result.id, reported = ?result.sha256, stored = %actual,
                "a host reported a digest that is not the stored object's");
            "digest-mismatch"
        }
        (true, Some(StoredObject::Absent)) => "upload-missing",
        _ => return result.clone(),
    };
    CommandResult {
        id: result.id.clone(),
        ok: false,
        reason: Some(reason.to_string()),
        ..CommandResult::default()
    }
}

/// Settles the snapshot commands a node reported, in the report's transaction. A result for
/// a command that is not this node's, or not pending, changes nothing. `stored` holds what
/// the store computed for the uploaded objects, by command id (see [`checked`]).
pub async fn settle(
    ctx: &Ctx,
    tx: &mut PgConnection,
    node_id: &str,
    results: &[CommandResult],
    stored: &std::collections::BTreeMap<String, StoredObject>,
) -> Result<(), CommandError> {
    if results.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = results.iter().map(|r| r.id.as_str()).collect();
    let owned = vps_projections::sandboxes::pending_on_node(&mut *tx, &ids, node_id).await?;
    let cpu_model = vps_projections::nodes::cpu_model(tx, node_id).await?;
    for snap in owned {
        let Some(result) = results.iter().find(|r| r.id == snap.id) else {
            continue;
        };
        let result = checked(result, stored.get(&snap.id));
        change::<Sandbox>(ctx, tx, &snap.sandbox_id, Some(&snap.tenant_id), |s| {
            Ok(s.map(|s| domain::settle(s, &result, cpu_model.as_deref()))
                .unwrap_or_default())
        })
        .await?;
    }
    Ok(())
}

/// A snapshot as the reconciler finds it: its id, its sandbox's and its tenant.
#[derive(Debug, Clone)]
pub struct Found {
    /// `snap_…`.
    pub id: String,
    /// Its sandbox.
    pub sandbox_id: String,
    /// The tenant.
    pub tenant_id: String,
}

impl From<vps_projections::sandboxes::SnapshotRef> for Found {
    fn from(r: vps_projections::sandboxes::SnapshotRef) -> Found {
        Found {
            id: r.id,
            sandbox_id: r.sandbox_id,
            tenant_id: r.tenant_id,
        }
    }
}

impl Found {
    /// The store's key for its object.
    pub fn object_key(&self) -> String {
        domain::object_key(&self.tenant_id, &self.id)
    }

    /// Records on its sandbox's stream what `decide` makes of it.
    async fn record(
        &self,
        ctx: &Ctx,
        decide: impl Fn(&Sandbox, &str) -> Vec<vps_domain::sandbox::SandboxEvent>,
    ) -> Result<(), CommandError> {
        transaction(ctx, &self.id, async |tx| {
            change::<Sandbox>(ctx, tx, &self.sandbox_id, Some(&self.tenant_id), |s| {
                Ok(s.map(|s| decide(s, &self.id)).unwrap_or_default())
            })
            .await?;
            Ok(())
        })
        .await
    }
}

/// Fails one pending snapshot whose command never settled (the reconciler's timeout).
pub async fn time_out(ctx: &Ctx, snap: &Found) -> Result<(), CommandError> {
    snap.record(ctx, domain::time_out).await
}

/// Records that a snapshot's object was removed from the store.
pub async fn mark_purged(ctx: &Ctx, snap: &Found) -> Result<(), CommandError> {
    snap.record(ctx, domain::purged).await
}

/// Deleted snapshots whose object may go (their upload settled, no live instance restores
/// from them), up to `limit`.
pub async fn purgeable(tx: &mut PgConnection, limit: i64) -> Result<Vec<Found>, CommandError> {
    let found = vps_projections::sandboxes::purgeable(&mut *tx, limit).await?;
    Ok(found.into_iter().map(Found::from).collect())
}

/// Pending snapshots asked for before `before`, up to `limit`.
pub async fn overdue(
    tx: &mut PgConnection,
    before: chrono::DateTime<chrono::Utc>,
    limit: i64,
) -> Result<Vec<Found>, CommandError> {
    let found = vps_projections::sandboxes::overdue_snapshots(&mut *tx, before, limit).await?;
    Ok(found.into_iter().map(Found::from).collect())
}

/// What a restore boots from: the caller's own `ready` snapshot, read `FOR SHARE` so a
/// concurrent delete (and so a purge) waits for this transaction.
pub async fn restore_from(
    ctx: &Ctx,
    tx: &mut PgConnection,
    tenant_id: &str,
    snapshot_id: &str,
    template_id: &str,
    runtime: &str,
) -> Result<RestoreFrom, CommandError> {
    let sandbox_id =
        vps_projections::sandboxes::sandbox_of_snapshot_for_share(tx, snapshot_id).await?;
    let source = match sandbox_id {
        Some(id) => load::<Sandbox>(tx, &id).await?,
        None => None,
    };
    let snap = source.as_ref().and_then(|s| s.snapshots.get(snapshot_id));
    Ok(domain::restore(
        snap,
        snapshot_id,
        tenant_id,
        &ctx.actor.identity,
        template_id,
        runtime,
    )?)
}

/// Whether another live guest answers to the same SSH identity as `instance`: a memory
/// restore resumes its source's sshd, so the source, its memory restores and their restores
/// all share one principal. Exec into any of them is refused while another is live, since a
/// certificate for one would open the others.
pub async fn shares_identity(
    tx: &mut PgConnection,
    instance: &vps_domain::instance::Instance,
) -> Result<bool, CommandError> {
    let principal = instance
        .restore_from
        .as_ref()
        .and_then(|r| r.principal_instance_id.clone())
        .unwrap_or_else(|| instance.id.clone());
    Ok(vps_projections::instances::reads::shares_principal(
        tx,
        &instance.id,
        &principal,
        &instance.tenant_id,
    )
    .await?)
}
