//! Node liveness: a node silent for longer than its pool's `lostAfterSeconds` becomes `lost`,
//! and so do its instances. A report brings both back (`nodes.report`).
//!
//! Silence is counted from the later of the node's last report and the moment this checker
//! last resumed: after the control plane's own outage (every replica down, the database
//! unreachable, this process stalled) hosts could not report, so each node gets a fresh
//! `lostAfterSeconds` to report again before it is judged.
//!
//! Silence is measured on the context's clock, which stamps the reports; a stall of this
//! checker on the process's own monotonic time, which no moved clock is mistaken for.
//!
//! The same loop prunes, every [`PRUNE_MARKS_EVERY`], the `instance_marks` of instances no
//! longer on their node (they would otherwise grow with every instance ever placed).

use std::time::Duration;

use chrono::{DateTime, Utc};
use vps_commands::Ctx;

use crate::timings::Timings;
use crate::work_queue;

/// The lease that keeps liveness checks on one replica.
pub const LEASE: &str = "node-liveness";

/// How often the marks of instances gone from their node are pruned.
pub const PRUNE_MARKS_EVERY: Duration = Duration::from_secs(600);

/// Checks liveness every `timings.liveness_check()`, for as long as the task lives.
pub async fn run(ctx: Ctx, timings: Timings) -> Result<(), sqlx::Error> {
    let _lease = vps_events::lease::Lease::acquire(&ctx.pool, LEASE, Duration::from_secs(2)).await;
    let mut resumed = ctx.clock.now();
    let mut last_check = tokio::time::Instant::now();
    let mut pruned_at: Option<DateTime<Utc>> = None;
    loop {
        let now = ctx.clock.now();
        if pruned_at.is_none_or(|at| {
            (now - at)
                .to_std()
                .is_ok_and(|since| since >= PRUNE_MARKS_EVERY)
        }) {
            prune_marks(&ctx, now).await;
            pruned_at = Some(now);
        }
        let gap = last_check.elapsed();
        if stalled(gap, &timings) {
            tracing::info!(
                gap_seconds = gap.as_secs_f64(),
                "liveness checks stalled; every node gets a fresh grace period"
            );
            resumed = now;
        }
        last_check = tokio::time::Instant::now();
        for node in silent_nodes(&ctx, resumed, now).await? {
            match vps_commands::hosts::mark_node_lost(&ctx, &node).await {
                Ok(changed) => {
                    tracing::info!(node = %node, instances = changed.len(), "node lost");
                    work_queue::wake_all(
                        &ctx.pool,
                        crate::instances::KIND,
                        &changed,
                        ctx.clock.now(),
                    )
                    .await?;
                    work_queue::announce(&ctx, crate::instances::KIND);
                }
                Err(e) => tracing::warn!(node = %node, error = %e, "cannot mark node lost"),
            }
        }
        // A moved clock may have made nodes silent long enough: look at once.
        tokio::select! {
            () = tokio::time::sleep(timings.liveness_check()) => {}
            () = ctx.clock.moved() => {}
        }
    }
}

/// Whether the gap since the last check is so long that this checker was not really
/// running (the process stalled): longer than three check intervals plus a second.
fn stalled(gap: Duration, timings: &Timings) -> bool {
    gap > timings.liveness_check() * 3 + Duration::from_secs(1)
}

/// The nodes of pools with `lostAfterSeconds` that have been silent that long, counting from
/// their last report (or registration), but never from before `resumed`, as of `now`.
async fn silent_nodes(
    ctx: &Ctx,
    resumed: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Result<Vec<String>, sqlx::Error> {
    vps_projections::nodes::silent(&ctx.pool, resumed, now).await
}

/// Prunes the marks of instances gone from their node that moved more than `MARKS_KEPT` ago;
/// a failure is logged and left for the next pass.
async fn prune_marks(ctx: &Ctx, now: DateTime<Utc>) {
    use vps_projections::instances::reads;
    let Some(before) = chrono::TimeDelta::from_std(reads::MARKS_KEPT)
        .ok()
        .and_then(|kept| now.checked_sub_signed(kept))
    else {
        return;
    };
    let pruned = match ctx.pool.acquire().await {
        Ok(mut conn) => reads::prune_marks(&mut conn, before).await,
        Err(e) => Err(e),
    };
    match pruned {
        Ok(0) => {}
        Ok(n) => tracing::debug!(
            marks = n,
            "pruned the marks of instances gone from their node"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot prune instance marks"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_of_several_intervals_counts_as_a_stall() {
        let timings = Timings {
            liveness_check: 5.0,
            ..Timings::default()
        };
        assert!(!stalled(Duration::from_secs(6), &timings));
        assert!(stalled(Duration::from_secs(17), &timings));
    }
}
