//! Instance deadlines (issue 40): an instance that stands in a transitional state longer than
//! `[timings] deadline_instance_<state>` fails with `reason: deadline:<state>` and is released
//! at once (allocation, address, quota, warm slot, volume writer), as a force delete does; one
//! stuck `deleting` is released without its host. A host that still holds it gets it back as
//! an orphan and lets it go. Instances a sandbox drives are left to the sandbox's own deadlines
//! (`deadline_sandbox_*`), except in `deleting`.
//!
//! A sweep, run by the sandbox reconciler's pass (one replica, woken when the clock moves):
//! the projection names the candidates, and each is decided again on its locked row.

use chrono::{DateTime, TimeDelta, Utc};
use vps_commands::instances::facts::lock_instance;
use vps_commands::pipeline::{apply_commands, transaction};
use vps_commands::sandboxes::lifecycle;
use vps_commands::{CommandError, Ctx};
use vps_domain::instance::InstanceCommand;

use crate::timings::Timings;

/// Most instances released per sweep.
pub const PER_SWEEP: i64 = 100;

/// How long each transitional state may stand.
#[derive(Debug, Clone, Copy)]
pub struct InstanceDeadlines {
    provisioning: TimeDelta,
    starting: TimeDelta,
    stopping: TimeDelta,
    resizing: TimeDelta,
    deleting: TimeDelta,
}

impl InstanceDeadlines {
    /// The deadlines `[timings]` sets.
    pub fn of(timings: &Timings) -> InstanceDeadlines {
        let d = |s: std::time::Duration| TimeDelta::from_std(s).unwrap_or(TimeDelta::MAX);
        InstanceDeadlines {
            provisioning: d(timings.deadline_instance_provisioning()),
            starting: d(timings.deadline_instance_starting()),
            stopping: d(timings.deadline_instance_stopping()),
            resizing: d(timings.deadline_instance_resizing()),
            deleting: d(timings.deadline_instance_deleting()),
        }
    }

    /// The deadline of `state` (one of [`vps_domain::instance::Instance::transitional`]'s).
    pub fn of_state(&self, state: &str) -> Option<TimeDelta> {
        Some(match state {
            "provisioning" => self.provisioning,
            "starting" => self.starting,
            "stopping" => self.stopping,
            "resizing" => self.resizing,
            "deleting" => self.deleting,
            _ => return None,
        })
    }
}

/// Fails and releases the instances past a deadline at `now`, and ends the sandboxes stuck
/// `deleting`. Answers how many instances it released.
pub async fn sweep(
    ctx: &Ctx,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<usize, CommandError> {
    let released = instances(ctx, now, timings).await?;
    sandboxes_deleting(ctx, now, timings).await?;
    Ok(released)
}

/// Ends the sandboxes that stood in `deleting` past `deadline_sandbox_deleting`: their
/// instance is released without its host, and they are `deleted`.
async fn sandboxes_deleting(
    ctx: &Ctx,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<(), CommandError> {
    let deadline =
        TimeDelta::from_std(timings.deadline_sandbox_deleting()).unwrap_or(TimeDelta::MAX);
    let due: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM sandboxes
          WHERE state = 'deleting'
            AND COALESCE((doc->>'stateSince')::timestamptz, created_at) <= $1
          ORDER BY id
          LIMIT $2",
    )
    .bind(now - deadline)
    .bind(PER_SWEEP)
    .fetch_all(&ctx.pool)
    .await?;
    for id in due {
        if lifecycle::end_past_deadline(ctx, &id, now, deadline).await? {
            metrics::counter!("vps_sandbox_deadlines_total").increment(1);
            tracing::warn!(sandbox = %id, "sandbox released past its deleting deadline");
        }
    }
    Ok(())
}

/// The instances part of [`sweep`].
async fn instances(
    ctx: &Ctx,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<usize, CommandError> {
    let d = InstanceDeadlines::of(timings);
    let due: Vec<String> = sqlx::query_scalar(
        "SELECT id FROM instances
          WHERE (state IN ('provisioning', 'starting', 'resizing', 'deleting')
                 OR (state IN ('running', 'paused') AND desired_state = 'stopped'))
            AND (state = 'deleting' OR doc->>'sandboxId' IS NULL)
            -- A provider's machine goes first: those wait for the provider reconciler.
            AND (state <> 'deleting' OR doc->>'poolKind' = 'hosted')
            AND GREATEST(COALESCE((doc->>'stateSince')::timestamptz, created_at),
                         CASE WHEN state IN ('running', 'paused')
                              THEN COALESCE((doc->>'desiredSince')::timestamptz, created_at)
                         END)
                <= CASE state WHEN 'provisioning' THEN $1 WHEN 'starting' THEN $2
                              WHEN 'resizing' THEN $3 WHEN 'deleting' THEN $4 ELSE $5 END
          ORDER BY id
          LIMIT $6",
    )
    .bind(now - d.provisioning)
    .bind(now - d.starting)
    .bind(now - d.resizing)
    .bind(now - d.deleting)
    .bind(now - d.stopping)
    .bind(PER_SWEEP)
    .fetch_all(&ctx.pool)
    .await?;
    let mut released = 0;
    for id in due {
        if let Some(state) = enforce(ctx, &id, now, &d).await? {
            released += 1;
            metrics::counter!("vps_instance_deadlines_total").increment(1);
            tracing::warn!(instance = %id, %state, "instance released past its deadline");
        }
    }
    Ok(released)
}

/// Decides one candidate on its locked row: the state whose deadline passed, if it acted.
async fn enforce(
    ctx: &Ctx,
    id: &str,
    now: DateTime<Utc>,
    d: &InstanceDeadlines,
) -> Result<Option<String>, CommandError> {
    transaction(ctx, id, async |tx| {
        let Some(inst) = lock_instance(tx, id).await? else {
            return Ok(None);
        };
        let Some((state, since)) = inst.transitional() else {
            return Ok(None);
        };
        let past = d.of_state(state).is_some_and(|limit| now - since >= limit);
        let driven = inst.sandbox_id.is_some() && state != "deleting";
        if !past || driven {
            return Ok(None);
        }
        let command = InstanceCommand::PastDeadline {
            state: state.to_string(),
        };
        let after = apply_commands(ctx, tx, &inst, &[command], now).await?;
        Ok(after.map(|_| state.to_string()))
    })
    .await
}
