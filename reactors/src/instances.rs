//! The instance reconciler (hosted path): one work item per instance, woken by a change to it
//! that leaves a pass something to do ([`wants_pass`]); each pass reads the instance, decides
//! what the situation calls for and returns when to look again (SPEC §3.6).
//!
//! A pass reads the instance and the facts it needs (`step::HostedFacts`) without locks and lets
//! the pure `step::step` decide; only when it calls for a command does the pass lock the
//! instance's row, read and decide again, and record the command in that transaction. A
//! scheduling instance goes to the locked pass at once. Provider instances go to
//! [`crate::provider_instances`].

mod step;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use sqlx::PgConnection;
use tracing::Instrument;
use vps_commands::instances::facts::lock_instance;
use vps_commands::instances::{confirm_placement, placement};
use vps_commands::pipeline::{apply_commands, transaction};
use vps_commands::{CommandError, Ctx};
use vps_domain::instance::{Instance, InstanceCommand, PoolKind};
use vps_domain::state_table::InstanceState;
use vps_domain::DomainError;

use step::{standing_refusal, step, HostedFacts, Placement};

use crate::timings::Timings;
use crate::work_queue::{self, Next, Pass, Taken};

/// The work-queue kind of instance items.
pub const KIND: &str = "instance";

/// How long a taken batch is leased; [`work_queue::holding`] renews it while the batch works.
const LEASE: Duration = Duration::from_secs(60);

/// Whether a change to `inst` should wake its item: a provider instance's always (its pass
/// drives the provider's API), a hosted one's only when a pass could do something
/// ([`step::wants_pass`]). A placed instance on its way or settled has nothing a pass could
/// do: its next change comes from its host and wakes it then.
pub fn wants_pass(inst: &Instance, now: DateTime<Utc>, timings: &Timings) -> bool {
    inst.pool_kind == PoolKind::Provider || step::wants_pass(inst, now, timings)
}

/// One reconcile pass over an instance, from a fresh look.
pub async fn reconcile(ctx: &Ctx, timings: &Timings, item: &Taken) -> Result<Pass, CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    let looked = vps_projections::instances::load(&mut conn, &item.key).await?;
    drop(conn);
    pass(ctx, timings, item, looked.as_ref()).await
}

/// [`reconcile`] on a look already taken: a batch looks at all its instances with one read.
/// A pass that records a command and loses a race to another writer decides again on the
/// fresh locked row ([`act`]).
///
/// The look is read without locks: most passes find an instance that needs nothing, and a row
/// lock is written to the WAL, so even a pass that records nothing would wait on a flush at its
/// commit (one per instance event). A change after the look wakes the item again, and a pass
/// that records a command decides again on the locked row.
pub async fn reconcile_looked(
    ctx: &Ctx,
    timings: &Timings,
    item: &Taken,
    looked: Option<&Instance>,
) -> Result<Pass, CommandError> {
    pass(ctx, timings, item, looked).await
}

async fn pass(
    ctx: &Ctx,
    timings: &Timings,
    item: &Taken,
    looked: Option<&Instance>,
) -> Result<Pass, CommandError> {
    let now = ctx.clock.now();
    let Some(inst) = looked else {
        return Ok(Next::WhenWoken.into());
    };
    if inst.pool_kind == PoolKind::Provider {
        return crate::provider_instances::reconcile(ctx, timings, inst.clone(), item.retry_at)
            .await;
    }
    // Placing is the one look that is never cheap, and it claims a free address: only the
    // transaction that records the placement reads it.
    if inst.state == InstanceState::Scheduling {
        return act(ctx, timings, item).await;
    }
    let mut conn = ctx.pool.acquire().await?;
    let facts = hosted_facts(&mut conn, inst, now, timings).await?;
    match step(inst, facts, now, timings) {
        (None, next) => Ok(next.into()),
        (Some(_), _) => {
            drop(conn);
            act(ctx, timings, item).await
        }
    }
}

/// A pass that records a command: decided again on the instance's locked row, and again
/// after a lost race.
async fn act(ctx: &Ctx, timings: &Timings, item: &Taken) -> Result<Pass, CommandError> {
    transaction(ctx, &item.key, async |tx| {
        let now = ctx.clock.now();
        // Rows before streams, like host reports: the two never wait for each other in a
        // circle.
        let Some(inst) = lock_instance(tx, &item.key).await? else {
            return Ok(Next::WhenWoken.into());
        };
        let facts = hosted_facts(tx, &inst, now, timings).await?;
        let (command, next) = step(&inst, facts, now, timings);
        if let Some(command) = command {
            let placing = matches!(command, InstanceCommand::Place(_));
            let after = apply_commands(ctx, tx, &inst, &[command], now).await?;
            if let Some(placed) = after.filter(|_| placing) {
                confirm_placement(tx, &placed).await?;
            }
        }
        Ok(next.into())
    })
    .await
}

/// Reads what [`step`] needs to decide about a hosted instance, and only that: the pool's
/// policy for a lost instance, placement for a scheduling one, and the tenant's presence on a
/// node whose refusal stands. A settled instance (most passes) costs no read.
async fn hosted_facts(
    tx: &mut PgConnection,
    inst: &Instance,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<HostedFacts, CommandError> {
    let recreate_on_host_loss = if inst.state == InstanceState::Lost {
        let policy = vps_projections::pools::policy(tx, &inst.pool_id).await?;
        policy["recreateOnHostLoss"].as_bool() == Some(true)
    } else {
        false
    };
    let placement = if inst.state == InstanceState::Scheduling {
        Some(match placement(tx, inst, now).await {
            Ok(cmd) => Placement::Decided(cmd),
            Err(CommandError::Domain(DomainError::CapacityUnavailable { .. })) => {
                Placement::NoAddress
            }
            Err(e) => return Err(e),
        })
    } else {
        None
    };
    let tenant_runs_there = match standing_refusal(inst, now, timings) {
        Some(node) => tenant_runs_on(tx, inst, node).await?,
        None => false,
    };
    Ok(HostedFacts {
        recreate_on_host_loss,
        placement,
        tenant_runs_there,
    })
}

/// Whether the instance's tenant has another running instance on `node`.
async fn tenant_runs_on(
    tx: &mut PgConnection,
    inst: &Instance,
    node: &str,
) -> Result<bool, CommandError> {
    Ok(
        vps_projections::instances::reads::tenant_runs_on(tx, node, &inst.tenant_id, &inst.id)
            .await?,
    )
}

/// The most items one take leases.
const BATCH: i64 = 64;

/// Runs the reconciler: takes due items and reconciles up to `parallel` at once, keeping the
/// batch's leases alive while it works.
pub async fn run(ctx: Ctx, timings: Timings, parallel: usize) -> Result<(), sqlx::Error> {
    let mut wake = work_queue::subscribe(&ctx, KIND);
    loop {
        wake.borrow_and_update();
        let items = work_queue::take(&ctx.pool, KIND, BATCH, LEASE, ctx.clock.now()).await?;
        if items.is_empty() {
            work_queue::idle(&ctx, KIND, &mut wake).await;
            continue;
        }
        let short = items.len() < BATCH as usize;
        let looked = look(&ctx, &items).await;
        let batch = futures::stream::iter(&items)
            .map(|item| {
                let span = tracing::debug_span!("reconcile", instance = %item.key);
                work_on(&ctx, &timings, item, looked.as_ref()).instrument(span)
            })
            .buffer_unordered(parallel)
            .collect::<Vec<_>>();
        // Boxed: the batch's type is too intricate for the compiler to prove it `Send`.
        let batch: BoxFuture<'_, Vec<_>> = batch.boxed();
        let passes = work_queue::holding(&ctx.pool, KIND, &items, LEASE, batch).await;
        record_passes(&ctx, passes).await;
        if short {
            // The take found every due item: the next is due no sooner than `idle` reads (or
            // a wake-up came meanwhile, and `idle` returns at once). A take here would find
            // nothing: one statement per create at one client.
            work_queue::idle(&ctx, KIND, &mut wake).await;
        }
    }
}

/// The batch's instances, read at once; `None` if that read failed (each pass then reads its
/// own, and fails on its own).
async fn look(ctx: &Ctx, items: &[Taken]) -> Option<HashMap<String, Instance>> {
    let keys: Vec<String> = items.iter().map(|i| i.key.clone()).collect();
    let looked = async {
        let mut conn = ctx.pool.acquire().await?;
        vps_projections::instances::load_many(&mut conn, &keys).await
    };
    looked
        .await
        .inspect_err(|e| tracing::debug!(error = %e, "cannot look at a batch; each pass looks"))
        .ok()
}

/// One pass over a taken item: how it ended (the error, for a failed one). A pass that
/// panics counts as a failed one: the item backs off, the reconciler goes on.
async fn work_on<'a>(
    ctx: &Ctx,
    timings: &Timings,
    item: &'a Taken,
    looked: Option<&HashMap<String, Instance>>,
) -> (&'a Taken, Result<Pass, String>) {
    let pass = match looked {
        Some(batch) => reconcile_looked(ctx, timings, item, batch.get(&item.key)).boxed(),
        None => reconcile(ctx, timings, item).boxed(),
    };
    let result = AssertUnwindSafe(pass).catch_unwind().await;
    metrics::counter!("vps_reconcile_passes_total", "kind" => KIND).increment(1);
    let ended = match result {
        Ok(Ok(pass)) => Ok(pass),
        Ok(Err(e)) => {
            tracing::warn!(instance = %item.key, error = %e, "reconcile failed");
            Err(e.to_string())
        }
        Err(_) => {
            metrics::counter!("vps_task_panics_total", "part" => "instance-reconcile").increment(1);
            tracing::error!(instance = %item.key, "a reconcile pass panicked");
            Err("the reconcile pass panicked".to_string())
        }
    };
    (item, ended)
}

/// Records a batch's passes on their items (unless a lease was lost meanwhile): the completed
/// ones with one statement, each failed one with its backoff.
async fn record_passes(ctx: &Ctx, passes: Vec<(&Taken, Result<Pass, String>)>) {
    let mut done = Vec::with_capacity(passes.len());
    let mut lost = Vec::new();
    for (item, ended) in passes {
        match ended {
            Ok(pass) => done.push((item, pass)),
            Err(error) => {
                metrics::counter!("vps_reconcile_failures_total", "kind" => KIND).increment(1);
                match work_queue::fail(&ctx.pool, KIND, item, &error, ctx.clock.now()).await {
                    Ok(true) => {}
                    Ok(false) => lost.push(item.key.clone()),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot record a failed pass; its lease will expire")
                    }
                }
            }
        }
    }
    match work_queue::complete_all(&ctx.pool, KIND, &done, ctx.clock.now()).await {
        Ok(keys) => lost.extend(keys),
        Err(e) => {
            tracing::warn!(error = %e, "cannot record reconcile passes; their leases will expire")
        }
    }
    for key in lost {
        tracing::warn!(
            instance = %key,
            "the item's lease was lost to another holder; this pass is not recorded on it"
        );
    }
}
