//! The sandbox's side of an instance change, recorded in the same transaction: the sandbox is
//! `ready` the moment its instance first runs, `failed` when it fails, and `deleted` once it
//! is gone (so nobody waits for the reconciler's next pass).

use sqlx::PgConnection;
use vps_domain::instance::{Instance, InstanceEvent};
use vps_domain::sandbox::{self as domain, Sandbox, SandboxEvent};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::stream::change;

/// What an instance's new events mean for the sandbox driving it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// It ran.
    Ran,
    /// It paused.
    Paused,
    /// It failed.
    Failed,
    /// It is gone.
    Gone,
}

/// The outcome of `events` for a sandbox, if any (the last one counts).
pub fn outcome(events: &[InstanceEvent]) -> Option<Outcome> {
    events.iter().rev().find_map(|e| match e {
        InstanceEvent::Running(_) => Some(Outcome::Ran),
        InstanceEvent::Paused(_) => Some(Outcome::Paused),
        InstanceEvent::Failed(_) => Some(Outcome::Failed),
        InstanceEvent::Deleted(_) => Some(Outcome::Gone),
        _ => None,
    })
}

/// Records the sandbox's events for `outcome` of its instance `after`.
pub async fn instance_changed(
    ctx: &Ctx,
    tx: &mut PgConnection,
    after: &Instance,
    outcome: Outcome,
) -> Result<(), CommandError> {
    let Some(sandbox_id) = &after.sandbox_id else {
        return Ok(());
    };
    let reason = after
        .conditions
        .last()
        .map_or_else(|| "instance failed".to_string(), |c| c.reason.clone());
    let mut decided = Vec::new();
    let sandbox = change::<Sandbox>(ctx, tx, sandbox_id, Some(&after.tenant_id), |s| {
        let Some(s) = s else { return Ok(Vec::new()) };
        decided = match outcome {
            Outcome::Ran => domain::ready(s),
            Outcome::Paused => domain::paused(s),
            Outcome::Failed => domain::fail(s, &reason),
            Outcome::Gone => domain::deleted(s),
        };
        Ok(decided.clone())
    })
    .await?;
    let ran = |e: &SandboxEvent| matches!(e, SandboxEvent::Ready(_) | SandboxEvent::Resumed(_));
    if let (Some(s), true) = (&sandbox, decided.iter().any(ran)) {
        // Its idle clock starts now (the sandbox's row is locked already: the lock order).
        super::activity::arm(tx, s, ctx.clock.now()).await?;
    }
    if let (Some(s), true) = (
        sandbox,
        decided.iter().any(|e| matches!(e, SandboxEvent::Ready(_))),
    ) {
        record_ready(&s);
    }
    Ok(())
}

/// `vps_sandbox_ready_seconds{source}`: admission to ready.
fn record_ready(s: &Sandbox) {
    if let Some(ready_at) = s.ready_at {
        let seconds = (ready_at - s.created_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        let source = if s.warm { "warm" } else { "cold" };
        metrics::histogram!("vps_sandbox_ready_seconds", "source" => source).record(seconds);
    }
}
