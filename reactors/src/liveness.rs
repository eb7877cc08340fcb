//! Node liveness: a node silent for longer than its pool's `lostAfterSeconds` becomes `lost`,
//! and so do its instances. A report brings both back (`nodes.report`).

use std::time::Duration;

use vps_commands::Ctx;

use crate::timings::Timings;
use crate::work_queue;

/// Checks liveness every `timings.liveness_check`, for as long as the task lives.
pub async fn run(ctx: Ctx, timings: Timings) -> Result<(), sqlx::Error> {
    let _lease =
        vps_events::lease::Lease::acquire(&ctx.pool, "node-liveness", Duration::from_secs(2)).await;
    loop {
        let silent: Vec<String> = sqlx::query_scalar(
            "SELECT n.id FROM nodes n
               JOIN pools p ON p.id = n.pool_id
               LEFT JOIN node_heartbeats h ON h.node_id = n.id
              WHERE n.state IN ('ready', 'cordoned', 'unreachable')
                AND p.policy->>'lostAfterSeconds' IS NOT NULL
                AND coalesce(h.last_report_at, n.created_at)
                    < now() - make_interval(secs => (p.policy->>'lostAfterSeconds')::float8)",
        )
        .fetch_all(&ctx.pool)
        .await?;
        for node in silent {
            match vps_commands::hosts::mark_node_lost(&ctx, &node).await {
                Ok(changed) => {
                    tracing::info!(node = %node, instances = changed.len(), "node lost");
                    work_queue::wake_all(&ctx.pool, crate::instances::KIND, &changed).await?;
                }
                Err(e) => tracing::warn!(node = %node, error = %e, "cannot mark node lost"),
            }
        }
        tokio::time::sleep(timings.liveness_check).await;
    }
}
