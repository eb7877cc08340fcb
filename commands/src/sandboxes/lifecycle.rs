//! `sandboxes.extend`, `sandboxes.delete`, `sandboxes.pause` and `sandboxes.resume`, and the
//! reconciler's per-sandbox work: the expiry warning, the expiry itself (a delete, or a pause
//! with `onTimeout: pause`), an idle sandbox's pause or expiry, and the fallbacks for `ready`,
//! `paused`, `resumed` and `deleted`.

use chrono::{DateTime, TimeDelta, Utc};
use sqlx::PgConnection;
use vps_domain::instance::{InstanceCommand, Requester};
use vps_domain::sandbox::{self as domain, Extension, Sandbox, SandboxEvent, SandboxState};
use vps_domain::state_table::InstanceState;

use super::follow::{instance_changed, Outcome};
use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::facts::lock_instance;
use crate::pipeline::{
    apply_commands, hold_or_conflict, load, load_existing, record_events, record_existing,
    transaction,
};

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
    record_existing(ctx, tx, sandbox_id, Some(&s), events, Some(tenant_id)).await
}

/// Deletes a sandbox: it becomes `deleting` and its instance is deleted (a delete of a deleting
/// or deleted sandbox changes nothing).
pub async fn delete(ctx: &Ctx, tenant_id: &str, sandbox_id: &str) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let events = domain::delete(&s);
        if events.is_empty() {
            return Ok(s);
        }
        end(ctx, tx, &s, events).await?;
        load_existing::<Sandbox>(tx, sandbox_id).await
    })
    .await
}

/// Deletes a sandbox at once (`delete { force: true }`): `deleting`, and its instance is
/// released without waiting for the host (`instance.deleting` with `reason: force`, then
/// `instance.deleted`), so the sandbox is `deleted` in the same transaction. A deleting
/// sandbox is finished the same way; a deleted one changes nothing.
pub async fn force_delete(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        if s.state == SandboxState::Deleted {
            return Ok(s);
        }
        force_end(ctx, tx, &s, "force").await?;
        load_existing::<Sandbox>(tx, sandbox_id).await
    })
    .await
}

/// Ends a sandbox that stood in `deleting` past `deadline` at `now` like a force delete
/// (its instance's deletion carrying `reason: deadline:deleting`). Skips a sandbox another
/// worker holds. Whether it ended one.
pub async fn end_past_deadline(
    ctx: &Ctx,
    sandbox_id: &str,
    now: DateTime<Utc>,
    deadline: TimeDelta,
) -> Result<bool, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let free: Option<String> =
            sqlx::query_scalar("SELECT id FROM sandboxes WHERE id = $1 FOR UPDATE SKIP LOCKED")
                .bind(sandbox_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(s) = free.and(load::<Sandbox>(tx, sandbox_id).await?) else {
            return Ok(false);
        };
        if s.state != SandboxState::Deleting || now - s.in_state_since() < deadline {
            return Ok(false);
        }
        force_end(ctx, tx, &s, "deadline:deleting").await?;
        Ok(true)
    })
    .await
}

/// Records the sandbox's delete (unless it is already deleting) and force-deletes its
/// instance: the instance's `deleted` makes the sandbox follow to `deleted` (a sandbox failed
/// by a deadline, whose end waits for a delete, is ended here).
async fn force_end(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: &Sandbox,
    reason: &str,
) -> Result<(), CommandError> {
    let instance = lock_instance(tx, &s.instance_id).await?;
    let after = record_events(
        ctx,
        tx,
        &s.id,
        Some(s),
        domain::delete(s),
        Some(&s.tenant_id),
    )
    .await?
    .unwrap_or_else(|| s.clone());
    let force = InstanceCommand::ForceDelete {
        requester: Requester::System,
        reason: reason.to_string(),
    };
    let released = match instance {
        Some(inst) => apply_commands(ctx, tx, &inst, &[force], ctx.clock.now()).await?,
        None => None,
    };
    // Its instance was gone already (or deleted before this delete): end the sandbox here.
    if released.is_none() {
        let events = domain::deleted(&after);
        record_events(ctx, tx, &s.id, Some(&after), events, Some(&s.tenant_id)).await?;
    }
    Ok(())
}

/// Records `events` (a delete or an expiry) and deletes the sandbox's instance.
async fn end(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: &Sandbox,
    events: Vec<SandboxEvent>,
) -> Result<(), CommandError> {
    end_for(ctx, tx, s, events, None).await
}

/// [`end`], the instance's deletion carrying `reason`.
async fn end_for(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: &Sandbox,
    events: Vec<SandboxEvent>,
    reason: Option<String>,
) -> Result<(), CommandError> {
    // The instance's row first: a host report holds it while it appends to the sandbox.
    let instance = lock_instance(tx, &s.instance_id).await?;
    record_events(ctx, tx, &s.id, Some(s), events, Some(&s.tenant_id)).await?;
    if let Some(inst) = instance {
        let delete = InstanceCommand::Delete {
            requester: Requester::System,
            reason,
        };
        apply_commands(ctx, tx, &inst, &[delete], ctx.clock.now()).await?;
    }
    Ok(())
}

/// Pauses a sandbox: it becomes `pausing`, its lifetime clock stops, and its instance is
/// wanted `paused` (the host keeps its memory); `paused` once the host reports it. A pausing
/// or paused sandbox changes nothing; a runtime that cannot pause is `UNSUPPORTED`.
pub async fn pause(ctx: &Ctx, tenant_id: &str, sandbox_id: &str) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let t = super::template(tx, &s.template_id).await?;
        let (can_pause, paused_ttl) = pause_terms(t.as_ref());
        let events = domain::pause(&s, can_pause, paused_ttl, ctx.clock.now())?;
        let pause = InstanceCommand::Pause {
            requester: Requester::System,
        };
        drive_and_reload(ctx, tx, s, events, pause).await
    })
    .await
}

/// Resumes a paused (or pausing) sandbox with a fresh lifetime: `ttl_seconds`, else the
/// template's default, within its `maxTtlSeconds`. It is `resuming` until its instance runs
/// again, then `ready`. A ready or resuming sandbox changes nothing; a deleted one is
/// `INVALID_STATE`.
pub async fn resume(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
    ttl_seconds: Option<u64>,
) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let t = super::template(tx, &s.template_id).await?;
        let (default_ttl, max_ttl) = t.as_ref().map_or(
            (
                vps_domain::template::DEFAULT_TTL_SECONDS,
                vps_domain::template::DEFAULT_MAX_TTL_SECONDS,
            ),
            |t| (t.spec.default_ttl_seconds, t.spec.max_ttl_seconds),
        );
        let ttl = domain::resume_ttl(ttl_seconds, default_ttl, max_ttl)?;
        let events = domain::resume(&s, ttl, ctx.clock.now())?;
        let start = InstanceCommand::Start {
            requester: Requester::System,
        };
        drive_and_reload(ctx, tx, s, events, start).await
    })
    .await
}

/// Replaces a sandbox's labels (`sandbox.labeled`); the same labels change nothing.
pub async fn set_labels(
    ctx: &Ctx,
    tenant_id: &str,
    sandbox_id: &str,
    labels: vps_domain::labels::Labels,
) -> Result<Sandbox, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let s = super::visible(tx, tenant_id, sandbox_id).await?;
        let events = domain::set_labels(&s, labels.clone())?;
        if events.is_empty() {
            return Ok(s);
        }
        // The instance's row first, as everywhere; it carries its sandbox's labels, so its
        // usage records do.
        let instance = lock_instance(tx, &s.instance_id).await?;
        let after = record_existing(ctx, tx, sandbox_id, Some(&s), events, Some(tenant_id)).await?;
        if let Some(inst) = instance {
            let label = InstanceCommand::SetLabels(labels.clone());
            apply_commands(ctx, tx, &inst, &[label], ctx.clock.now()).await?;
        }
        Ok(after)
    })
    .await
}

/// [`drive`]s a pause's or resume's `events` (none: the sandbox as it is) and answers the
/// sandbox as they left it.
async fn drive_and_reload(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: Sandbox,
    events: Vec<SandboxEvent>,
    command: InstanceCommand,
) -> Result<Sandbox, CommandError> {
    if events.is_empty() {
        return Ok(s);
    }
    drive(ctx, tx, &s, events, command).await?;
    Ok(load::<Sandbox>(tx, &s.id).await?.unwrap_or(s))
}

/// Whether a template's runtime can pause, and its `pausedTtlSeconds` (a template gone from
/// the log entirely: the defaults).
fn pause_terms(t: Option<&vps_domain::template::Template>) -> (bool, u64) {
    t.map_or((true, domain::DEFAULT_PAUSED_TTL_SECONDS), |t| {
        (
            vps_domain::template::can_pause(&t.runtime),
            t.spec.paused_ttl_seconds,
        )
    })
}

/// Records a pause's or resume's `events` and asks its instance for `command`. When the
/// instance already is where the sandbox is going (a pause that never reached the host, say),
/// the sandbox settles at once: nobody would report a change.
async fn drive(
    ctx: &Ctx,
    tx: &mut PgConnection,
    s: &Sandbox,
    events: Vec<SandboxEvent>,
    command: InstanceCommand,
) -> Result<(), CommandError> {
    // The instance's row first: a host report holds it while it appends to the sandbox.
    let instance = lock_instance(tx, &s.instance_id).await?;
    let after = record_existing(ctx, tx, &s.id, Some(s), events, Some(&s.tenant_id)).await?;
    let Some(inst) = instance else {
        return Ok(());
    };
    let inst = apply_commands(ctx, tx, &inst, &[command], ctx.clock.now())
        .await?
        .unwrap_or(inst);
    let outcome = match (after.state, inst.state) {
        (SandboxState::Pausing, InstanceState::Paused) => Some(Outcome::Paused),
        (SandboxState::Resuming, InstanceState::Running) => Some(Outcome::Ran),
        _ => None,
    };
    if let Some(outcome) = outcome {
        instance_changed(ctx, tx, &inst, outcome).await?;
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
    transaction(ctx, sandbox_id, async |tx| {
        let Some(s) = lock_free(tx, sandbox_id).await? else {
            return Ok(None);
        };
        let t = super::template(tx, &s.template_id).await?;
        let (can_pause, paused_ttl) = pause_terms(t.as_ref());
        let paused_ttl = can_pause.then(|| TimeDelta::seconds(paused_ttl as i64));
        let events = domain::expiry(&s, now, timings.lead, timings.min_lead, paused_ttl);
        let expired = events.iter().any(|e| matches!(e, SandboxEvent::Expired(_)));
        let pauses = events.iter().any(|e| matches!(e, SandboxEvent::Pausing(_)));
        if pauses {
            let pause = InstanceCommand::Pause {
                requester: Requester::System,
            };
            drive(ctx, tx, &s, events, pause).await?;
        } else if expired {
            end(ctx, tx, &s, events).await?;
        } else {
            record_events(ctx, tx, sandbox_id, Some(&s), events, Some(&s.tenant_id)).await?;
        }
        Ok(expired.then(|| now - s.expires_at))
    })
    .await
}

/// What an idle sandbox's end was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleEnd {
    /// Paused (`onTimeout: pause`): `sandbox.pausing`, `reason: idle`.
    Paused,
    /// Expired: `sandbox.expired`, `reason: idle`, and its instance deleted.
    Expired,
}

/// Ends a ready sandbox whose activity row says it is idle (see [`super::activity`]): paused
/// when its lifetime ends in a pause and its runtime can pause, else expired. Decided again
/// on the locked rows, so an exec session or a busy sample that came since keeps it; skips a
/// sandbox another worker holds.
pub async fn idle_out(
    ctx: &Ctx,
    sandbox_id: &str,
    now: DateTime<Utc>,
) -> Result<Option<IdleEnd>, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let Some(s) = lock_free(tx, sandbox_id).await? else {
            return Ok(None);
        };
        if !super::activity::take_idle(tx, &s.instance_id).await? {
            return Ok(None);
        }
        let t = super::template(tx, &s.template_id).await?;
        let (can_pause, paused_ttl) = pause_terms(t.as_ref());
        let paused_ttl = can_pause.then(|| TimeDelta::seconds(paused_ttl as i64));
        let events = domain::idle(&s, now, paused_ttl);
        if events.is_empty() {
            return Ok(None);
        }
        if events.iter().any(|e| matches!(e, SandboxEvent::Pausing(_))) {
            let pause = InstanceCommand::Pause {
                requester: Requester::System,
            };
            drive(ctx, tx, &s, events, pause).await?;
            return Ok(Some(IdleEnd::Paused));
        }
        end(ctx, tx, &s, events).await?;
        Ok(Some(IdleEnd::Expired))
    })
    .await
}

/// Fails a sandbox that stood in `starting`, `pausing` or `resuming` past its deadline
/// (`sandbox.failed`, `reason: deadline:<state>`) and releases what it held: its instance is
/// deleted (allocation, address, quota). Skips a sandbox another worker holds. Answers the
/// reason when it failed one.
pub async fn enforce_deadline(
    ctx: &Ctx,
    sandbox_id: &str,
    now: DateTime<Utc>,
    deadlines: domain::Deadlines,
) -> Result<Option<String>, CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let Some(s) = lock_free(tx, sandbox_id).await? else {
            return Ok(None);
        };
        let events = domain::deadline(&s, now, &deadlines);
        let reason = events.iter().find_map(|e| match e {
            SandboxEvent::Failed(f) => Some(f.reason.clone()),
            _ => None,
        });
        if reason.is_none() {
            return Ok(None);
        }
        end_for(ctx, tx, &s, events, reason.clone()).await?;
        Ok(reason)
    })
    .await
}

/// The sandbox, its row locked to this transaction's end; `None` when another worker holds it
/// (or there is none).
async fn lock_free(
    tx: &mut PgConnection,
    sandbox_id: &str,
) -> Result<Option<Sandbox>, CommandError> {
    match vps_projections::sandboxes::lock_unless_held(tx, sandbox_id).await? {
        true => load::<Sandbox>(tx, sandbox_id).await,
        false => Ok(None),
    }
}

/// The fallback for the instance path's own stamps: a sandbox whose instance runs becomes
/// `ready`, one whose instance is gone becomes `deleted`.
pub async fn settle(ctx: &Ctx, sandbox_id: &str) -> Result<(), CommandError> {
    transaction(ctx, sandbox_id, async |tx| {
        let Some(s) = load::<Sandbox>(tx, sandbox_id).await? else {
            return Ok(());
        };
        let inst = vps_projections::instances::load(tx, &s.instance_id).await?;
        let outcome = match inst.as_ref().map(|i| i.state) {
            None | Some(InstanceState::Deleted) => Outcome::Gone,
            Some(InstanceState::Running) => Outcome::Ran,
            Some(InstanceState::Paused) if s.state == SandboxState::Pausing => Outcome::Paused,
            Some(_) => return Ok(()),
        };
        match inst {
            Some(i) => instance_changed(ctx, tx, &i, outcome).await?,
            None => {
                let events = domain::deleted(&s);
                record_events(ctx, tx, sandbox_id, Some(&s), events, Some(&s.tenant_id)).await?;
            }
        }
        Ok(())
    })
    .await
}
