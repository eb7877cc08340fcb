//! `sandboxes.fork`'s record: once every restore of the fork's memory snapshot is admitted,
//! `sandbox.forked` on the source's stream names them. The steps before it are the existing
//! commands, each idempotent by a key derived from the fork's (`vps_domain::sandbox::fork`):
//! [`super::snapshots::take_within`] for the snapshot and [`super::create::create`] for each
//! restore, so a retried fork continues where the last attempt stopped.

use vps_domain::sandbox::fork as domain;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{record_existing, transaction};

/// The id of the snapshot a fork with `key` takes, for `tenant_id` as the caller in `ctx`.
pub fn snapshot_id(ctx: &Ctx, tenant_id: &str, key: &str) -> String {
    vps_domain::ids::snapshot_id(vps_domain::ids::Origin {
        tenant: tenant_id,
        caller: &ctx.actor.identity,
        key: &domain::snapshot_key(key),
    })
}

/// Records that the fork `key` of `source_id` made `sandbox_ids` from `snapshot_id` (nothing
/// when it is recorded already).
pub async fn record(
    ctx: &Ctx,
    tenant_id: &str,
    source_id: &str,
    snapshot_id: &str,
    sandbox_ids: &[String],
    key: &str,
) -> Result<(), CommandError> {
    transaction(ctx, source_id, async |tx| {
        let s = super::visible(tx, tenant_id, source_id).await?;
        let events = domain::forked(&s, snapshot_id, sandbox_ids.to_vec(), key);
        if !events.is_empty() {
            record_existing(ctx, tx, source_id, Some(&s), events, Some(tenant_id)).await?;
        }
        Ok(())
    })
    .await
}
