//! Reading projections as the API shows them (camelCase JSON).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;
use vps_domain::condition::Condition;
use vps_domain::instance::Instance;
use vps_domain::state_table::{DesiredState, InstanceState};

/// The public view of an instance (SPEC §3.2).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InstanceView {
    /// `inst_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// Where it is.
    pub state: InstanceState,
    /// What it should become.
    pub desired_state: DesiredState,
    /// The flavor's name.
    pub flavor: String,
    /// The image.
    pub image_id: String,
    /// OpenSSH public keys.
    pub ssh_keys: Vec<String>,
    /// The leased address first, then reported ones.
    pub addresses: Vec<String>,
    /// Why it is not where it should be.
    pub conditions: Vec<Condition>,
    /// Hosted: its node.
    pub node_id: Option<String>,
    /// Hosted: its allocation.
    pub allocation_id: Option<String>,
    /// Provider: the machine id.
    pub external_id: Option<String>,
    /// The project.
    pub project_id: Option<String>,
    /// Who created it.
    pub owner_identity_id: String,
    /// The create's idempotency key.
    pub idempotency_key: String,
    /// The sandbox that drives it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// The template it is a warm instance of.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warm_template_id: Option<String>,
    /// When a sandbox claimed it from a warm pool.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claimed_at: Option<DateTime<Utc>>,
    /// A memory restore: whether its host gave it an SSH identity of its own (until then exec
    /// is refused while its source or a sibling restore lives).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_rebound: Option<bool>,
    /// Its labels.
    pub labels: vps_domain::labels::Labels,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Its stream version.
    pub version: u64,
}

impl From<&Instance> for InstanceView {
    fn from(i: &Instance) -> Self {
        InstanceView {
            id: i.id.clone(),
            tenant_id: i.tenant_id.clone(),
            pool_id: i.pool_id.clone(),
            state: i.state,
            desired_state: i.desired_state,
            flavor: i.flavor.clone(),
            image_id: i.image_id.clone(),
            ssh_keys: i.ssh_keys.clone(),
            addresses: i.addresses.clone(),
            conditions: i.conditions.clone(),
            node_id: i.node_id.clone(),
            allocation_id: i.allocation_id.clone(),
            external_id: i.external_id.clone(),
            project_id: i.project_id.clone(),
            owner_identity_id: i.owner_identity_id.clone(),
            idempotency_key: i.idempotency_key.clone(),
            sandbox_id: i.sandbox_id.clone(),
            warm_template_id: i.warm_template_id.clone(),
            claimed_at: i.claimed_at,
            identity_rebound: i
                .restore_from
                .as_ref()
                .filter(|r| r.include_memory)
                .map(|r| r.principal_instance_id.is_none()),
            labels: i.labels.clone(),
            created_at: i.created_at,
            updated_at: i.updated_at,
            version: i.version,
        }
    }
}

/// One tenant's quota of one resource in a pool.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuotaUsage {
    /// The tenant.
    pub tenant_id: String,
    /// `vcpu`, `memoryGiB`, …
    pub resource: String,
    /// The maximum.
    pub max: i64,
    /// What is charged.
    pub used: i64,
}

/// A pool's quotas, optionally of one tenant.
pub async fn quota_usage<'e>(
    db: impl PgExecutor<'e>,
    pool_id: &str,
    tenant_id: Option<&str>,
) -> Result<Vec<QuotaUsage>, sqlx::Error> {
    sqlx::query_as(
        "SELECT tenant_id, resource, max, used FROM quotas
          WHERE pool_id = $1 AND ($2::text IS NULL OR tenant_id = $2) ORDER BY tenant_id, resource",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .fetch_all(db)
    .await
}

/// An address leased to an instance.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    /// The IPv4 address.
    pub address: String,
    /// Who holds it.
    pub instance_id: String,
}

/// A pool's leases, by address.
pub async fn leases<'e>(db: impl PgExecutor<'e>, pool_id: &str) -> Result<Vec<Lease>, sqlx::Error> {
    sqlx::query_as(
        "SELECT address, instance_id FROM ip_leases WHERE pool_id = $1 ORDER BY inet(address)",
    )
    .bind(pool_id)
    .fetch_all(db)
    .await
}

/// Whether a pool is offered to a tenant.
pub async fn offered<'e>(
    db: impl PgExecutor<'e>,
    pool_id: &str,
    tenant_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM quotas WHERE pool_id = $1 AND tenant_id = $2 AND offered)",
    )
    .bind(pool_id)
    .bind(tenant_id)
    .fetch_one(db)
    .await
}

/// Whether a node exists.
pub async fn node_exists<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM nodes WHERE id = $1)")
        .bind(id)
        .fetch_one(db)
        .await
}

/// The node whose token hashes to `token_hash`.
pub async fn node_by_token_hash<'e>(
    db: impl PgExecutor<'e>,
    token_hash: &str,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT node_id FROM node_tokens WHERE token_hash = $1")
        .bind(token_hash)
        .fetch_optional(db)
        .await
}

/// The public view of a sandbox template (SPEC §5.1): user data and secret values never show.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateView {
    /// `sbxt_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Its name.
    pub name: String,
    /// The hosted pool.
    pub pool_id: String,
    /// The flavor's name.
    pub flavor: String,
    /// The image.
    pub image_id: String,
    /// The pool's runtime.
    pub runtime: String,
    /// `egress`, `private` or `none`.
    pub network: vps_domain::template::Network,
    /// The allow-list narrowing `egress` (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_allow: Option<Vec<String>>,
    /// The guest's bandwidth bound in Mbit/s each way (absent: the host's default, 100).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_bandwidth_mbit: Option<u32>,
    /// The guest's connection bound (absent: the host's default, 512).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_max_connections: Option<u32>,
    /// The names of the environment variables (their values are secret references).
    pub env: std::collections::BTreeMap<String, String>,
    /// Whether the template has user data.
    pub has_user_data: bool,
    /// A sandbox's lifetime when the create names none.
    pub default_ttl_seconds: u64,
    /// The longest lifetime.
    pub max_ttl_seconds: u64,
    /// The warm pool.
    pub warm: Option<vps_domain::template::Warm>,
    /// The volumes its sandboxes attach.
    pub volumes: Vec<vps_domain::volume::TemplateVolume>,
    /// Its labels.
    pub labels: vps_domain::labels::Labels,
    /// How long a paused sandbox is kept.
    pub paused_ttl_seconds: u64,
    /// What the end of a sandbox's lifetime does: `delete` or `pause`.
    pub on_timeout: vps_domain::sandbox::OnTimeout,
    /// `exec` and `snapshot` on a paused sandbox resume it first.
    pub auto_resume: bool,
    /// How long a ready sandbox may stay idle before it is paused or expired.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// Below this share of one vCPU, in percent, its guest counts as idle.
    pub idle_cpu_percent: f64,
    /// Rises with every update.
    pub version: u64,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl From<&vps_domain::template::Template> for TemplateView {
    fn from(t: &vps_domain::template::Template) -> Self {
        TemplateView {
            id: t.id.clone(),
            tenant_id: t.tenant_id.clone(),
            name: t.name.clone(),
            pool_id: t.pool_id.clone(),
            flavor: t.spec.flavor.clone(),
            image_id: t.spec.image_id.clone(),
            runtime: t.runtime.clone(),
            network: t.spec.network,
            network_allow: Some(t.spec.network_rules.allow.clone()).filter(|a| !a.is_empty()),
            network_bandwidth_mbit: t.spec.network_rules.bandwidth_mbit,
            network_max_connections: t.spec.network_rules.max_connections,
            env: t.spec.env.clone(),
            has_user_data: t.spec.user_data_ref.is_some(),
            default_ttl_seconds: t.spec.default_ttl_seconds,
            max_ttl_seconds: t.spec.max_ttl_seconds,
            warm: t.spec.warm,
            volumes: t.spec.volumes.clone(),
            labels: t.labels.clone(),
            paused_ttl_seconds: t.spec.paused_ttl_seconds,
            on_timeout: t.spec.on_timeout,
            auto_resume: t.spec.auto_resume,
            idle_timeout_seconds: t.spec.idle_timeout_seconds,
            idle_cpu_percent: t.spec.idle_cpu_percent.0,
            version: t.version,
            created_at: t.created_at,
            updated_at: t.updated_at,
        }
    }
}

/// The public view of a sandbox (SPEC §5.1).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SandboxView {
    /// `sbx_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Its template.
    pub template_id: String,
    /// The instance it drives.
    pub instance_id: String,
    /// `starting`, `ready`, `failed`, `pausing`, `paused`, `resuming`, `deleting` or
    /// `deleted`.
    pub state: vps_domain::sandbox::SandboxState,
    /// Whether a warm instance was claimed for it.
    pub warm: bool,
    /// Who made it.
    pub owner_identity_id: String,
    /// When it was admitted.
    pub created_at: DateTime<Utc>,
    /// When its instance first ran.
    pub ready_at: Option<DateTime<Utc>>,
    /// When it ends.
    pub expires_at: DateTime<Utc>,
    /// When it was deleted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// Whether its lifetime ended it.
    pub expired: bool,
    /// What the end of its lifetime does: `delete` or `pause`.
    pub on_timeout: vps_domain::sandbox::OnTimeout,
    /// Its labels.
    pub labels: vps_domain::labels::Labels,
    /// While pausing or paused: when the pause was asked for (`expiresAt` is then when the
    /// paused sandbox is deleted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<DateTime<Utc>>,
    /// Why it ended, when not a plain delete (`ttl`, `paused-ttl`, `deadline:<state>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A restore: the snapshot it was made from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Its live snapshots, oldest first (`sandboxes.get` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshots: Option<Vec<SnapshotView>>,
    /// Its stream version.
    pub version: u64,
}

impl SandboxView {
    /// The view with its live snapshots (what `sandboxes.get` answers).
    pub fn with_snapshots(s: &vps_domain::sandbox::Sandbox) -> Self {
        let mut snapshots: Vec<SnapshotView> = s
            .snapshots
            .values()
            .filter(|snap| !snap.is_deleted())
            .map(SnapshotView::from)
            .collect();
        snapshots.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        SandboxView {
            snapshots: Some(snapshots),
            ..SandboxView::from(s)
        }
    }
}

/// The public view of a snapshot (SPEC §5.1). Its download URL is never shown.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotView {
    /// `snap_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// That sandbox's template (a restore runs under it).
    pub template_id: String,
    /// The only identity that may restore it.
    pub owner_identity_id: String,
    /// `pending`, `ready` or `failed`.
    pub state: vps_domain::sandbox::SnapshotState,
    /// With the guest's memory.
    pub include_memory: bool,
    /// Outlives its sandbox.
    pub keep: bool,
    /// The runtime that took it.
    pub runtime: String,
    /// The stored object's SHA-256.
    pub sha256: Option<String>,
    /// Its size.
    pub size_bytes: Option<u64>,
    /// A memory snapshot: the CPU model it restores on.
    pub cpu_model: Option<String>,
    /// Why it failed.
    pub reason: Option<String>,
    /// When it was asked for.
    pub created_at: DateTime<Utc>,
    /// When it became ready.
    pub ready_at: Option<DateTime<Utc>>,
}

impl From<&vps_domain::sandbox::Snapshot> for SnapshotView {
    fn from(s: &vps_domain::sandbox::Snapshot) -> Self {
        SnapshotView {
            id: s.id.clone(),
            tenant_id: s.tenant_id.clone(),
            sandbox_id: s.sandbox_id.clone(),
            template_id: s.template_id.clone(),
            owner_identity_id: s.owner_identity_id.clone(),
            state: s.state,
            include_memory: s.include_memory,
            keep: s.keep,
            runtime: s.runtime.clone(),
            sha256: s.sha256.clone(),
            size_bytes: s.size_bytes,
            cpu_model: s.cpu_model.clone(),
            reason: s.reason.clone(),
            created_at: s.created_at,
            ready_at: s.ready_at,
        }
    }
}

impl From<&vps_domain::sandbox::Sandbox> for SandboxView {
    fn from(s: &vps_domain::sandbox::Sandbox) -> Self {
        SandboxView {
            id: s.id.clone(),
            tenant_id: s.tenant_id.clone(),
            template_id: s.template_id.clone(),
            instance_id: s.instance_id.clone(),
            state: s.state,
            warm: s.warm,
            owner_identity_id: s.owner_identity_id.clone(),
            created_at: s.created_at,
            ready_at: s.ready_at,
            expires_at: s.expires_at,
            deleted_at: s.deleted_at,
            expired: s.expired,
            on_timeout: s.on_timeout,
            labels: s.labels.clone(),
            paused_at: s.paused_at.filter(|_| s.state.is_paused()),
            reason: s.reason.clone(),
            from_snapshot: s.from_snapshot.clone(),
            snapshots: None,
            version: s.version,
        }
    }
}
