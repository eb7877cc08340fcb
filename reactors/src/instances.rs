//! The instance reconciler (hosted path): one work item per instance, woken by every change
//! to it; each pass reads the instance, decides what the situation calls for and returns when
//! to look again (SPEC §3.6).

use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use sqlx::Row;
use tracing::Instrument;
use vps_commands::hosts::apply_all;
use vps_commands::instances::placement;
use vps_commands::{CommandError, Ctx};
use vps_domain::condition::ConditionType;
use vps_domain::instance::{Instance, InstanceCommand, PoolKind, RecreateCause};
use vps_domain::state_table::InstanceState;
use vps_domain::DomainError;
use vps_projections::instances::load;

use crate::timings::Timings;
use crate::work_queue::{self, Next};

/// The work-queue kind of instance items.
pub const KIND: &str = "instance";

/// One reconcile pass over an instance (decided again if another writer got there first).
pub async fn reconcile(ctx: &Ctx, timings: &Timings, id: &str) -> Result<Next, CommandError> {
    vps_commands::error::retrying(id, || pass(ctx, timings, id)).await
}

async fn pass(ctx: &Ctx, timings: &Timings, id: &str) -> Result<Next, CommandError> {
    let now = Utc::now();
    let mut tx = ctx.pool.begin().await?;
    let Some(inst) = load(&mut tx, id).await? else {
        return Ok(Next::WhenWoken);
    };
    if inst.pool_kind == PoolKind::Provider {
        drop(tx);
        return crate::provider_instances::reconcile(ctx, timings, inst).await;
    }
    let pool = sqlx::query("SELECT runtime, ip_cidr, ip_gateway, policy FROM pools WHERE id = $1")
        .bind(&inst.pool_id)
        .fetch_one(&mut *tx)
        .await?;
    let (next, command) = match inst.state {
        InstanceState::Scheduling => {
            let range = pool
                .get::<Option<String>, _>(1)
                .zip(pool.get::<Option<String>, _>(2));
            let runtime: Option<String> = pool.get(0);
            match placement(
                &mut tx,
                &inst,
                runtime.as_deref().unwrap_or("libvirt-kvm"),
                range,
            )
            .await
            {
                Ok(cmd @ InstanceCommand::Place(_)) => (Next::WhenWoken, Some(cmd)),
                Ok(cmd) => (Next::After(timings.unschedulable_retry), Some(cmd)),
                // No free address: wait for one like for capacity.
                Err(CommandError::Domain(DomainError::CapacityUnavailable { .. })) => {
                    (Next::After(timings.unschedulable_retry), None)
                }
                Err(e) => return Err(e),
            }
        }
        InstanceState::Lost => {
            let policy: serde_json::Value = pool.get(3);
            if policy["recreateOnHostLoss"].as_bool() == Some(true)
                && inst.desired_state.as_state() != InstanceState::Deleted
            {
                (
                    Next::After(Duration::ZERO),
                    Some(InstanceCommand::Recreate(RecreateCause::HostLost)),
                )
            } else {
                (Next::After(timings.lost_look), None)
            }
        }
        InstanceState::Deleted | InstanceState::Error => (Next::WhenWoken, None),
        _ => exhausted_or_settled(&mut tx, timings, &inst, now).await?,
    };
    if let Some(command) = command {
        let placing = matches!(command, InstanceCommand::Place(_));
        apply_all(ctx, &mut tx, &inst, &[command], now).await?;
        if placing {
            let placed = load(&mut tx, id).await?.expect("just recorded");
            vps_commands::instances::confirm_placement(&mut tx, &placed).await?;
        }
    }
    tx.commit().await?;
    ctx.notifier.committed();
    Ok(next)
}

/// A placed instance: re-place it away from a host that keeps refusing it, or look again
/// while it is still on its way.
async fn exhausted_or_settled(
    tx: &mut sqlx::PgConnection,
    timings: &Timings,
    inst: &Instance,
    now: chrono::DateTime<Utc>,
) -> Result<(Next, Option<InstanceCommand>), CommandError> {
    let wait =
        chrono::TimeDelta::from_std(timings.replacement_wait).unwrap_or(chrono::TimeDelta::MAX);
    if let Some(condition) = inst.condition(ConditionType::HostResourcesExhausted) {
        let standing = inst.refusal_standing(now, wait).map(str::to_string);
        let Some(node) = standing else {
            let remaining = (condition.since + wait - now)
                .to_std()
                .unwrap_or(Duration::ZERO);
            return Ok((Next::After(remaining), None));
        };
        // A tenant's running instance on that node means the refusal is the tenant's own
        // doing (its neighbours), not the host's: leave it there.
        let tenant_runs_there: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM instances WHERE node_id = $1 AND tenant_id = $2 AND id <> $3 AND state = 'running')",
        )
        .bind(&node)
        .bind(&inst.tenant_id)
        .bind(&inst.id)
        .fetch_one(&mut *tx)
        .await?;
        if !tenant_runs_there {
            let exclude_until = now
                + chrono::TimeDelta::from_std(timings.refusing_node_exclusion)
                    .unwrap_or(chrono::TimeDelta::MAX);
            return Ok((
                Next::After(Duration::ZERO),
                Some(InstanceCommand::Recreate(
                    RecreateCause::ResourcesExhausted { exclude_until },
                )),
            ));
        }
        return Ok((Next::After(timings.transitional_look), None));
    }
    let settled = inst.state == inst.desired_state.as_state();
    Ok(if settled {
        (Next::WhenWoken, None)
    } else {
        (Next::After(timings.transitional_look), None)
    })
}

/// Runs the reconciler: takes due items and reconciles up to `parallel` at once.
pub async fn run(ctx: Ctx, timings: Timings, parallel: usize) -> Result<(), sqlx::Error> {
    let mut wake = ctx.notifier.subscribe();
    loop {
        let items = work_queue::take(&ctx.pool, KIND, 64, Duration::from_secs(60)).await?;
        if items.is_empty() {
            let _ = tokio::time::timeout(Duration::from_millis(100), wake.changed()).await;
            continue;
        }
        futures::stream::iter(items)
            .for_each_concurrent(parallel, |item| {
                let (ctx, timings) = (&ctx, &timings);
                let span = tracing::debug_span!("reconcile", instance = %item.key);
                async move {
                    let result = reconcile(ctx, timings, &item.key).await;
                    metrics::counter!("vps_reconcile_passes_total", "kind" => KIND).increment(1);
                    let done = match result {
                        Ok(next) => work_queue::complete(&ctx.pool, KIND, &item, next).await,
                        Err(e) => {
                            tracing::warn!(instance = %item.key, error = %e, "reconcile failed");
                            metrics::counter!("vps_reconcile_failures_total", "kind" => KIND).increment(1);
                            work_queue::fail(&ctx.pool, KIND, &item, &e.to_string()).await
                        }
                    };
                    if let Err(e) = done {
                        tracing::warn!(error = %e, "cannot record a reconcile pass; its lease will expire");
                    }
                }
                .instrument(span)
            })
            .await;
    }
}
