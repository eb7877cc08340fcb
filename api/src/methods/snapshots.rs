//! `sandboxes.snapshot` and `sandboxSnapshots.*`. A snapshot belongs to its sandbox's owner;
//! another tenant's, or a deleted one, is `NOT_FOUND`. Views never carry the object's URL.

use serde::{Deserialize, Serialize};
use vps_commands::sandboxes::snapshots::{self, SnapshotInput};
use vps_projections::sandboxes::SnapshotFilter;
use vps_projections::views::SnapshotView;

use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Method};
use vps_domain::ids::{SandboxId, SnapshotId};

/// `sandboxes.snapshot`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TakeBody {
    #[serde(flatten)]
    input: SnapshotInput,
    /// With a template's `autoResume`: how long to wait for a paused sandbox to resume.
    wait: Option<crate::methods::common::Wait>,
}

/// A snapshot by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotRef {
    /// The tenant.
    tenant_id: String,
    /// `snap_…`.
    snapshot_id: SnapshotId,
}

/// `sandboxSnapshots.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListBody {
    /// The tenant.
    tenant_id: String,
    /// Only this sandbox's.
    sandbox_id: Option<SandboxId>,
    /// `mine` (default: the ones you own) or `all`.
    scope: Option<String>,
    /// 1 to 200 (default 50).
    limit: Option<i64>,
    /// The previous page's cursor (opaque).
    cursor: Option<String>,
}

/// A page of snapshots, newest first.
#[derive(Serialize, schemars::JsonSchema)]
pub struct SnapshotPage {
    /// The snapshots.
    items: Vec<SnapshotView>,
    /// Present when there are more.
    cursor: Option<String>,
}

/// The methods.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "sandboxes",
            "snapshot",
            Tenant,
            "Takes a snapshot of a sandbox (pending until its node uploads it).",
            take,
        ),
        Method::new(
            "sandboxSnapshots",
            "list",
            Tenant,
            "The tenant's live snapshots, newest first.",
            list,
        ),
        Method::new("sandboxSnapshots", "get", Tenant, "One live snapshot.", get),
        Method::new(
            "sandboxSnapshots",
            "delete",
            Tenant,
            "Deletes a snapshot at once; its stored object is purged later.",
            delete,
        ),
    ]
}

async fn take(c: Call, body: TakeBody) -> Result<SnapshotView, ApiError> {
    let mut q = body.input;
    q.tenant_id = c.caller.tenant(&q.tenant_id)?;
    let wait = body
        .wait
        .as_ref()
        .map_or(Ok(std::time::Duration::ZERO), |w| w.duration())?;
    super::sandboxes::unpaused(&c, &q.tenant_id, &q.sandbox_id, "a snapshot", wait).await?;
    let limits = snapshots::KeptLimits {
        count: c.config.limits.snapshots_per_tenant as u64,
        gib: c.config.limits.snapshot_gib_per_tenant,
    };
    let snap = snapshots::take_within(&c.ctx, q, limits).await?;
    Ok(SnapshotView::from(&snap))
}

async fn list(c: Call, q: ListBody) -> Result<SnapshotPage, ApiError> {
    let tenant_id = c.caller.tenant(&q.tenant_id)?;
    let limit = super::page_limit(q.limit)?;
    let owner = super::scope_owner(&c, q.scope.as_deref(), super::Scope::Mine)?;
    let filter = SnapshotFilter {
        owner,
        sandbox_id: q.sandbox_id.map(String::from),
        limit: limit + 1,
        cursor: q
            .cursor
            .as_deref()
            .map(|cursor| super::open_cursor(&c, "sandboxSnapshots", &tenant_id, cursor))
            .transpose()?,
        tenant_id,
    };
    let mut conn = c.ctx.pool.acquire().await?;
    let items = vps_projections::sandboxes::snapshot_page(&mut conn, &filter)
        .await
        .map_err(vps_commands::CommandError::from)?;
    let (items, cursor) = super::split_page(items, limit, |s| {
        super::sign_cursor(&c, "sandboxSnapshots", &filter.tenant_id, &s.id)
    });
    Ok(SnapshotPage {
        items: items.iter().map(SnapshotView::from).collect(),
        cursor,
    })
}

async fn get(c: Call, q: SnapshotRef) -> Result<SnapshotView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let mut conn = c.ctx.pool.acquire().await?;
    let (_, snap) = snapshots::visible(&mut conn, &tenant, &q.snapshot_id).await?;
    Ok(SnapshotView::from(&snap))
}

async fn delete(c: Call, q: SnapshotRef) -> Result<SnapshotView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let snap = snapshots::delete(&c.ctx, &tenant, &q.snapshot_id).await?;
    vps_reactors::sandboxes::wake(&c.ctx);
    Ok(SnapshotView::from(&snap))
}
