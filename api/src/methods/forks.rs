//! `sandboxes.fork`: one memory snapshot of a ready sandbox, then `count` restores of it, each
//! a sandbox of its own (address, identity, lifetime). Every step is an existing command made
//! idempotent by a key derived from the fork's, so a retry with the same key answers the same
//! sandboxes, or continues a fork an earlier attempt left half done.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use vps_commands::sandboxes::create::CreateSandboxInput;
use vps_commands::sandboxes::snapshots::{self, SnapshotInput};
use vps_commands::sandboxes::{self, fork as commands};
use vps_commands::CommandError;
use vps_domain::authz::Resource;
use vps_domain::ids::{SandboxId, TemplateId};
use vps_domain::sandbox::fork;
use vps_domain::sandbox::SnapshotState;
use vps_domain::DomainError;
use vps_projections::views::SandboxView;

use crate::error::ApiError;
use crate::registry::{Access, Call, Method};

/// How long a fork waits for its snapshot to settle before it answers that it is still
/// pending (a retry with the same key goes on from there).
const SNAPSHOT_WAIT: Duration = Duration::from_secs(30);
/// How often the snapshot is looked at meanwhile.
const SNAPSHOT_POLL: Duration = Duration::from_millis(100);

/// `sandboxes.fork`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForkBody {
    /// The tenant.
    tenant_id: String,
    /// `sbx_…`: the source, which must be ready.
    sandbox_id: SandboxId,
    /// How many sandboxes: 1 to 10.
    count: u64,
    /// Makes the fork idempotent: the same key answers the same sandboxes.
    idempotency_key: String,
    /// Each fork's lifetime: 1 to the template's `maxTtlSeconds` (default: its
    /// `defaultTtlSeconds`).
    ttl_seconds: Option<u64>,
}

/// What a fork made.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Forked {
    /// The source.
    source_sandbox_id: String,
    /// The memory snapshot every fork restored (deleted with the source).
    snapshot_id: String,
    /// The new sandboxes, in order (`starting` until their guests run).
    sandboxes: Vec<SandboxView>,
}

/// The methods.
pub fn methods() -> Vec<Method> {
    vec![Method::new(
        "sandboxes",
        "fork",
        Access::Tenant,
        "Forks a ready sandbox: one memory snapshot, restored into 1 to 10 new sandboxes.",
        fork,
    )]
}

async fn fork(c: Call, q: ForkBody) -> Result<Forked, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let count = fork::check(q.count, &q.idempotency_key).map_err(CommandError::from)?;
    let (s, _, shape) = sandboxes::decision_facts(&c.ctx, &tenant, &q.sandbox_id).await?;
    let draft = s.draft(shape.as_ref(), s.lifetime().num_seconds());
    c.authorize(&Resource::sandbox_draft(&s.id, &tenant, &draft))?;
    let key = q.idempotency_key.as_str();
    let snapshot_id = commands::snapshot_id(&c.ctx, &tenant, key);
    if let Some(ids) = fork::start(&s, count, key).map_err(CommandError::from)? {
        return answer(&c, &s.id, snapshot_id, &ids).await;
    }
    let input = SnapshotInput {
        tenant_id: tenant.clone(),
        sandbox_id: q.sandbox_id.clone(),
        include_memory: Some(true),
        keep: Some(false),
        idempotency_key: Some(fork::snapshot_key(key)),
    };
    let limits = snapshots::KeptLimits {
        count: c.config.limits.snapshots_per_tenant as u64,
        gib: c.config.limits.snapshot_gib_per_tenant,
    };
    let snap = snapshots::take_within(&c.ctx, input, limits).await?;
    settled(&c, &tenant, &snap.id).await?;
    let template_id = TemplateId::parse(&s.template_id)
        .map_err(|_| DomainError::invalid_state(format!("sandbox {} has no template", s.id)))
        .map_err(CommandError::from)?;
    let policy = |id: &str, draft: &vps_domain::authz::SandboxDraft| {
        c.guard.refusal(
            &c.guard.action,
            &Resource::sandbox_draft(id, &tenant, draft),
        )
    };
    let mut ids = Vec::with_capacity(count);
    for index in 0..count {
        let input = CreateSandboxInput {
            tenant_id: tenant.clone(),
            template_id: template_id.clone(),
            ttl_seconds: q.ttl_seconds,
            idempotency_key: fork::restore_key(key, index),
            from_snapshot: Some(snap.id.clone()),
            on_timeout: Some(s.on_timeout),
            labels: (!s.labels.is_empty()).then(|| s.labels.clone()),
        };
        let created = sandboxes::create::create(&c.ctx, input, &policy).await?;
        ids.push(created.sandbox.id);
    }
    vps_reactors::sandboxes::wake(&c.ctx);
    commands::record(&c.ctx, &tenant, &s.id, &snap.id, &ids, key).await?;
    answer(&c, &s.id, snap.id, &ids).await
}

/// Waits for the fork's snapshot to be ready: a failed one is `INVALID_STATE` (its reason in
/// `details`), one still pending after [`SNAPSHOT_WAIT`] a `CONFLICT` to retry with the key.
async fn settled(c: &Call, tenant: &str, snapshot_id: &str) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + SNAPSHOT_WAIT;
    loop {
        let snap = {
            let mut conn = c.ctx.pool.acquire().await?;
            snapshots::visible(&mut conn, tenant, snapshot_id).await?.1
        };
        match snap.state {
            SnapshotState::Ready => return Ok(()),
            SnapshotState::Failed => {
                let reason = snap.reason.unwrap_or_default();
                return Err(CommandError::from(DomainError::InvalidState {
                    message: format!("the fork's snapshot {snapshot_id} failed: {reason}"),
                    details: serde_json::json!({
                        "reason": "snapshot-failed",
                        "snapshotId": snapshot_id,
                    }),
                })
                .into());
            }
            SnapshotState::Pending if tokio::time::Instant::now() >= deadline => {
                return Err(CommandError::from(DomainError::conflict(
                    format!(
                        "the fork's snapshot {snapshot_id} is still pending; call again with the \
                         same idempotencyKey"
                    ),
                    "snapshotId",
                    snapshot_id.to_string(),
                ))
                .into());
            }
            SnapshotState::Pending => tokio::time::sleep(SNAPSHOT_POLL).await,
        }
    }
}

/// The answer: the new sandboxes as they are now.
async fn answer(
    c: &Call,
    source: &str,
    snapshot_id: String,
    ids: &[String],
) -> Result<Forked, ApiError> {
    let mut conn = c.ctx.pool.acquire().await?;
    let mut sandboxes = Vec::with_capacity(ids.len());
    for id in ids {
        let s = vps_projections::sandboxes::load_sandbox(&mut conn, id)
            .await
            .map_err(CommandError::from)?
            .ok_or_else(|| crate::methods::missing("sandbox", id))?;
        sandboxes.push(SandboxView::from(&s));
    }
    Ok(Forked {
        source_sandbox_id: source.to_string(),
        snapshot_id,
        sandboxes,
    })
}
