//! Tenant teardown (SPEC §3.10): `tenants.delete` records `tenant.deleting` (from then on the
//! API refuses the tenant new work), and passes of [`teardown_pass`] run every [`STEPS`] entry
//! until none has anything left, then record `tenant.deleted`. Usage events stay: they are
//! bills.
//!
//! Each step does a bounded share of work per pass and answers what remains, so a pass is
//! short and safe to repeat (every step is idempotent). Its identities' API keys are revoked
//! first (each revoke in the log), templates are deleted, open sandboxes
//! marked deleting (their instances with them), every snapshot deleted (kept ones too; the
//! sandbox reconciler purges their objects), volumes deleted once no instance attaches them
//! (after the instances).

use std::future::Future;

use futures::future::BoxFuture;
use futures::FutureExt;
use vps_domain::tenant::{begin_teardown, finish_teardown, Tenant};
use vps_domain::DomainError;
use vps_projections::tenants::{self, Leftovers};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::{self, Change};
use crate::pipeline::{change, transaction};

/// The reason `instance.deleting` carries for a teardown.
pub const REASON: &str = "tenant deleted";
/// The most instances one pass asks to delete.
pub const INSTANCES_PER_PASS: i64 = 100;

/// One step of a teardown: does its share of work for the tenant, answers what remains.
pub struct Step {
    /// For logs.
    pub name: &'static str,
    /// The work.
    pub run: for<'a> fn(&'a Ctx, &'a str) -> StepFuture<'a>,
}

/// Every step, in order.
pub const STEPS: &[Step] = &[
    Step {
        name: "keys",
        run: revoke_keys,
    },
    Step {
        name: "templates",
        run: delete_templates,
    },
    Step {
        name: "sandboxes",
        run: delete_sandboxes,
    },
    Step {
        name: "snapshots",
        run: delete_snapshots,
    },
    Step {
        name: "webhooks",
        run: remove_webhooks,
    },
    Step {
        name: "instances",
        run: delete_instances,
    },
    Step {
        name: "volumes",
        run: delete_volumes,
    },
];

/// Records `tenant.deleting` (once).
pub async fn begin(ctx: &Ctx, tenant_id: &str) -> Result<(), CommandError> {
    transaction(ctx, tenant_id, async |tx| {
        change::<Tenant>(ctx, tx, tenant_id, Some(tenant_id), |t| {
            begin_teardown(t, tenant_id)
        })
        .await?;
        Ok(())
    })
    .await
}

/// Runs every step once; when nothing remains, records `tenant.deleted`. Answers what remains.
pub async fn teardown_pass(ctx: &Ctx, tenant_id: &str) -> Result<u64, CommandError> {
    let mut remaining = 0;
    for step in STEPS {
        let left = (step.run)(ctx, tenant_id).await?;
        tracing::debug!(tenant = tenant_id, step = step.name, left, "teardown step");
        remaining += left;
    }
    if remaining == 0 {
        transaction(ctx, tenant_id, async |tx| {
            change::<Tenant>(ctx, tx, tenant_id, Some(tenant_id), |t| {
                Ok(finish_teardown(t, 0))
            })
            .await?;
            Ok(())
        })
        .await?;
    }
    Ok(remaining)
}

/// Revokes every API key of the tenant's identities, each revoke an `identity.keys.revoked`
/// in the log (configured `[[identities]]` have no keys to revoke: the edge refuses them every
/// change of a deleted tenant).
fn revoke_keys<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(
        ctx,
        tenant_id,
        &tenants::IDENTITIES_WITH_KEYS,
        move |id| async move { ignore_gone(crate::identities::revoke_keys(ctx, &id).await.map(|_| ())) },
    )
}

/// Deletes the tenant's webhooks.
fn remove_webhooks<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::WEBHOOKS, move |id| async move {
        ignore_gone(crate::webhooks::delete(ctx, &id, None).await)
    })
}

/// Deletes every live template (the sandbox reconciler then drains their warm pools).
fn delete_templates<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::TEMPLATES, move |id| async move {
        let deleted = crate::sandboxes::templates::delete(ctx, tenant_id, &id).await;
        ignore_gone(deleted.map(|_| ()))
    })
}

/// Marks open sandboxes deleting (their instances go with them); answers those not yet gone.
fn delete_sandboxes<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::SANDBOXES, move |id| async move {
        let deleted = crate::sandboxes::lifecycle::delete(ctx, tenant_id, &id).await;
        ignore_gone(deleted.map(|_| ()))
    })
}

/// Deletes every live snapshot, kept ones included.
fn delete_snapshots<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::SNAPSHOTS, move |id| async move {
        let deleted = crate::sandboxes::snapshots::delete(ctx, tenant_id, &id).await;
        ignore_gone(deleted.map(|_| ()))
    })
}

/// Asks every instance not yet asked to be deleted; answers those not yet gone.
fn delete_instances<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::INSTANCES, move |id| async move {
        let delete = Change::DeleteBecause(REASON.into());
        let deleted = instances::change(ctx, tenant_id, &id, delete).await;
        ignore_gone(deleted.map(|_| ()))
    })
}

/// Deletes volumes no live instance attaches any more (the others wait for their instances);
/// answers those not yet released (their host lets them go, then the sandbox reconciler).
fn delete_volumes<'a>(ctx: &'a Ctx, tenant_id: &'a str) -> StepFuture<'a> {
    sweep(ctx, tenant_id, &tenants::VOLUMES, move |id| async move {
        match crate::volumes::delete(ctx, tenant_id, &id).await {
            // Still attached: its instances are being deleted; a later pass retries.
            Err(CommandError::Domain(DomainError::ConflictOn { .. })) => Ok(()),
            other => ignore_gone(other.map(|_| ())),
        }
    })
}

/// What a step's work answers: how many remain.
type StepFuture<'a> = BoxFuture<'a, Result<u64, CommandError>>;

/// A step's pass: `act` on each id the step's [`Leftovers`] has due (at most a pass's share),
/// then count what remains (only once `act` is done).
fn sweep<'a, F, Fut>(
    ctx: &'a Ctx,
    tenant_id: &'a str,
    leftovers: &'static Leftovers,
    act: F,
) -> StepFuture<'a>
where
    F: Fn(String) -> Fut + Send + 'a,
    Fut: Future<Output = Result<(), CommandError>> + Send + 'a,
{
    async move {
        for id in leftovers
            .due(&ctx.pool, tenant_id, INSTANCES_PER_PASS)
            .await?
        {
            act(id).await?;
        }
        Ok(leftovers.left(&ctx.pool, tenant_id).await? as u64)
    }
    .boxed()
}

/// A resource that went away meanwhile is done.
fn ignore_gone(result: Result<(), CommandError>) -> Result<(), CommandError> {
    match result {
        Err(CommandError::Domain(DomainError::NotFound { .. })) => Ok(()),
        other => other,
    }
}
