//! `sandboxes.extend` and `sandboxes.delete`, and the reconciler's per-sandbox work: the
//! expiry warning, the expiry itself, and the fallbacks for `ready` and `deleted`.

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgConnection;
use vps_domain::instance::{InstanceCommand, Requester};
use vps_domain::sandbox::{self as domain, Extension, Sandbox, SandboxEvent};
use vps_domain::state_table::InstanceState;

use super::follow::{instance_changed, Outcome};
use crate::context::Ctx;
use crate::error::{retrying, CommandError};
use crate::instances::facts::lock_instance;
use crate::pipeline::{apply_commands, commit, hold_or_conflict, load, record_events, transaction};

/// Moves a sandbox's expiry (the API passes the absolute expiry it authorized, so a retry
/// never adds a `by` twice). One extend holds a sandbox at a time: a concurrent one is
/// `CONFLICT` (`extend-in-flight`), so two extends never both apply beyond what one decision
/// covered.
pub async fn extend(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
    extension: Extension,
) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        extend_in(ctx, tx, tenant_id, sandbox_id, extension).await
    })
    .await
}

async fn extend_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    tenant_id: &str,
    sandbox_id: &str,
    extension: Extension,
) -> Result<Sandbox, CommandError> {
    let key = format!("sandbox-extend:{sandbox_id}");
    let what = format!("extend of sandbox {sandbox_id}");
    hold_or_conflict(tx, &key, &what, "extend-in-flight").await?;
    let s = super::visible(tx, tenant_id, sandbox_id).await?;
    // A template deleted since still bounds its sandboxes' lifetime.
    let max_ttl = super::template(tx, &s.template_id)
        .await?
        .map_or(0, |t| t.spec.max_ttl_seconds);
    let Some(until) = domain::extended_expiry(&s, extension, max_ttl)? else {
        return Ok(s);
    };
    let events = domain::extend(&s, until);
    let after = record_events(ctx, tx, sandbox_id, Some(&s), events, Some(tenant_id)).await?;
    Ok(after.expect("an extended sandbox"))
}

/// Deletes a sandbox: it becomes `deleting` and its instance is deleted (a delete of a deleting
/// or deleted sandbox changes nothing).
pub async fn delete(ctx: &Ctx, tenant_id: &str, sandbox_id: &str) -> Result<Sandbox, CommandError> {
    retrying(sandbox_id, || async {
        let mut tx = ctx.pool.begin().await?;
        let s = super::visible(&mut tx, tenant_id, sandbox_id).await?;
        let events = domain::delete(&s);
        if events.is_empty() {
            return Ok(s);
        }
        end(ctx, &mut tx, &s, events).await?;
        let after = load::<Sandbox>(&mut tx, sandbox_id).await?.expect("exists");
        commit(ctx, tx).await?;
        Ok(after)
    })
    .await
}

/// Records `events` (a delete or an expiry) and deletes the sandbox's instance.
async fn end(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: &Sandbox,
    events: Vec<SandboxEvent>,
) -> Result<(), CommandError> {
    // The instance's row first: a host report holds it while it appends to the sandbox.
    let instance = lock_instance(tx, &s.instance_id).await?;
    record_events(ctx, tx, &s.id, Some(s), events, Some(&s.tenant_id)).await?;
    if let Some(inst) = instance {
        let delete = InstanceCommand::Delete {
            requester: Requester::System,
            reason: None,
        };
        apply_commands(ctx, tx, &inst, &[delete], Utc::now()).await?;
    }
    Ok(())
}

/// The expiry timings: the warning's lead and its floor.
#[derive(Debug, Clone, Copy)]
pub struct ExpiryTimings {
    /// `sandbox_expiring_lead`.
    pub lead: TimeDelta,
    /// `sandbox_expiring_min_lead`.
    pub min_lead: TimeDelta,
}

/// The expiry work due on one sandbox at `now`: `sandbox.expiring` once, or `sandbox.expired`
/// and the deletion of its instance. Skips a sandbox another worker holds. Answers how late
/// an expiry came, when it expired one.
pub async fn expire(
    ctx: &Ctx,
    sandbox_id: &str,
    now: DateTime<Utc>,
    timings: ExpiryTimings,
) -> Result<Option<TimeDelta>, CommandError> {
    retrying(sandbox_id, || async {
        let mut tx = ctx.pool.begin().await?;
        let free: Option<String> =
            sqlx::query_scalar("SELECT id FROM sandboxes WHERE id = $1 FOR UPDATE SKIP LOCKED")
                .bind(sandbox_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(s) = free.and(load::<Sandbox>(&mut tx, sandbox_id).await?) else {
            return Ok(None);
        };
        let events = domain::expiry(&s, now, timings.lead, timings.min_lead);
        let expired = events.iter().any(|e| matches!(e, SandboxEvent::Expired(_)));
        if expired {
            end(ctx, &mut tx, &s, events).await?;
        } else {
            record_events(
                ctx,
                &mut tx,
                sandbox_id,
                Some(&s),
                events,
                Some(&s.tenant_id),
            )
            .await?;
        }
        commit(ctx, tx).await?;
        Ok(expired.then(|| now - s.expires_at))
    })
    .await
}

/// The fallback for the instance path's own stamps: a sandbox whose instance runs becomes
/// `ready`, one whose instance is gone becomes `deleted`.
pub async fn settle(ctx: &Ctx, sandbox_id: &str) -> Result<(), CommandError> {
    retrying(sandbox_id, || async {
        let mut tx = ctx.pool.begin().await?;
        let Some(s) = load::<Sandbox>(&mut tx, sandbox_id).await? else {
            return Ok(());
        };
        let inst = vps_projections::instances::load(&mut tx, &s.instance_id).await?;
        let outcome = match inst.as_ref().map(|i| i.state) {
            None | Some(InstanceState::Deleted) => Outcome::Gone,
            Some(InstanceState::Running) => Outcome::Ran,
            Some(_) => return Ok(()),
        };
        match inst {
            Some(i) => instance_changed(ctx, &mut tx, &i, outcome).await?,
            None => {
                record_events(
                    ctx,
                    &mut tx,
                    sandbox_id,
                    Some(&s),
                    domain::deleted(&s),
                    Some(&s.tenant_id),
                )
                .await?;
            }
        }
        commit(ctx, tx).await
    })
    .await
}
