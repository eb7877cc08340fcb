//! Warm pools: a template keeps settled instances ready for sandboxes to claim. A claim takes
//! the oldest settled instance of the template's current instance version that no concurrent
//! claim holds, so concurrent creates never wait on each other and never share an instance. The upkeep
//! (refill, drain) runs in the sandbox reconciler, one template at a time.

use sqlx::PgConnection;
use vps_domain::instance::{Instance, InstanceCommand, Requester};
use vps_domain::state_table::DesiredState;
use vps_domain::template::{warm_plan, Template, WarmMember, WarmPlan, PAUSING_RUNTIMES};
use vps_projections::instances::reads;
use vps_projections::node_specs::Moved;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::{admit_in, facts::lock_instance, Origin};
use crate::pipeline::{apply_commands, transaction};
use crate::record::new_id;

/// At most this many warm instances are made per template per pass.
pub const REFILL_PER_PASS: usize = 4;

/// Claims a settled warm instance of `t` for the sandbox, in the caller's transaction; `None`
/// when none is claimable (the caller creates one cold). The instance's spec entry is written
/// in the same transaction, so its host resumes it without waiting for the NodeSpec follower;
/// the caller announces the moved generation once it commits.
///
/// The oldest settled instance of the current version that no concurrent transaction holds is
/// taken with `FOR UPDATE SKIP LOCKED`: concurrent claims never wait on each other and never
/// share an instance (a host report locks only the instances it changes, and a settled one
/// does not change).
pub async fn claim(
    ctx: &Ctx,
    tx: &mut PgConnection,
    t: &Template,
    sandbox_id: &str,
) -> Result<Option<(Instance, Moved)>, CommandError> {
    let row = reads::lock_warm(tx, &t.id, t.instance_version as i64).await?;
    let Some(instance) = row else {
        return Ok(None);
    };
    if !instance.claimable() || instance.template_version != Some(t.instance_version) {
        return Ok(None);
    }
    let claim = InstanceCommand::Claim {
        sandbox_id: sandbox_id.to_string(),
        owner_identity_id: ctx.actor.identity.clone(),
    };
    let Some(claimed) = apply_commands(ctx, tx, &instance, &[claim], ctx.clock.now()).await? else {
        return Ok(None);
    };
    let moved = vps_projections::node_specs::write_inline(tx, &claimed.id).await?;
    Ok(Some((claimed, moved)))
}

/// One pass over a template's warm pool (`template` gone or deleted: drain it): drains what
/// must go, then makes what is missing. Answers the plan it carried out: `create` counts the
/// instances it made, which a refused refill leaves below the plan's.
pub async fn upkeep(
    ctx: &Ctx,
    template_id: &str,
    template: Option<&Template>,
) -> Result<WarmPlan, CommandError> {
    let members = members(ctx, template_id).await?;
    let mut plan = warm_plan(template, &members, REFILL_PER_PASS);
    for id in &plan.drain {
        drain(ctx, id).await?;
    }
    let mut made = 0;
    if let Some(t) = template {
        while made < plan.create {
            if let Err(e) = refill(ctx, t).await {
                // Best effort: quota, capacity or a vanished flavor stop this template's
                // refill until the next pass.
                tracing::warn!(template = %t.id, error = %e, "warm sandbox instance not created");
                break;
            }
            made += 1;
        }
    }
    plan.create = made;
    Ok(plan)
}

/// The template's warm instances that are not being deleted.
async fn members(ctx: &Ctx, template_id: &str) -> Result<Vec<WarmMember>, CommandError> {
    Ok(reads::warm_members(&ctx.pool, template_id).await?)
}

/// Makes one warm instance of `t`, re-reading the template in the transaction so one deleted
/// or reshaped since the pass began is skipped.
async fn refill(ctx: &Ctx, t: &Template) -> Result<(), CommandError> {
    let key = new_id("warm");
    let id = vps_domain::ids::instance_id(vps_domain::ids::Origin {
        tenant: &t.tenant_id,
        caller: &t.id,
        key: &key,
    });
    transaction(ctx, &id, async |tx| {
        let unchanged =
            vps_projections::sandboxes::template_unchanged(tx, &t.id, t.instance_version as i64)
                .await?;
        if unchanged != Some(true) {
            return Ok(());
        }
        let desired = if PAUSING_RUNTIMES.contains(&t.runtime.as_str()) {
            DesiredState::Paused
        } else {
            DesiredState::Stopped
        };
        let origin = Origin {
            warm: Some((t.id.clone(), t.instance_version)),
            owner_identity_id: Some(t.owner_identity_id.clone()),
            ..super::template_instance::origin(ctx, tx, t).await?
        };
        let input = super::template_instance::instance_input(t, &key, desired);
        let policy = &vps_domain::instance::authorized_before;
        admit_in(ctx, tx, &id, &input, &origin, policy).await?;
        Ok(())
    })
    .await
}

/// Deletes a warm instance (unless a sandbox claimed it meanwhile).
async fn drain(ctx: &Ctx, instance_id: &str) -> Result<(), CommandError> {
    transaction(ctx, instance_id, async |tx| {
        let Some(inst) = lock_instance(tx, instance_id).await? else {
            return Ok(());
        };
        if inst.warm_template_id.is_none() {
            return Ok(());
        }
        let delete = InstanceCommand::Delete {
            requester: Requester::System,
            reason: Some("warm pool drained".into()),
        };
        apply_commands(ctx, tx, &inst, &[delete], ctx.clock.now()).await?;
        Ok(())
    })
    .await
}
