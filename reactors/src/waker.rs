//! Turns the log into reconciler work: an instance event wakes its instance when a pass could
//! do something for it (`instances::wants_pass`, read on the instance as it is now), and this
//! process's sandbox reconciler when a pass could do something for the instance's sandbox
//! (`sandboxes::wants_pass`); every event that frees or adds capacity in a pool wakes the
//! pool's unschedulable instances at once.
//!
//! An instance left alone is one whose next change wakes it: the waker reads every later event,
//! and the instance it reads is at least as new as the event that named it.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use vps_commands::Ctx;
use vps_domain::instance::Instance;
use vps_events::{Cursor, Follower, RecordedEvent};
use vps_projections::ProjectionError;

use crate::timings::Timings;
use crate::work_queue;

/// The follower's (and lease's) name.
pub const NAME: &str = "instance-waker";

/// Events after which something may fit where nothing did.
const FREES_CAPACITY: &[&str] = &[
    "instance.deleted",
    "instance.recreating",
    "instance.resized",
    "node.registered",
    "node.uncordoned",
    "node.recovered",
    "pool.ip_range.set",
];

/// The least time between two reads of the log when woken: in a busy moment one pass wakes
/// the instances of several commits, so the reconciler takes them in one batch.
const PACE: std::time::Duration = std::time::Duration::from_millis(10);

/// Follows the log for as long as the task lives.
pub async fn run(ctx: Ctx, timings: Timings) -> Result<(), ProjectionError> {
    let _lease =
        vps_events::lease::Lease::acquire(&ctx.pool, NAME, std::time::Duration::from_secs(2)).await;
    let mut follower = Follower::load(ctx.pool.clone(), NAME, &ctx.notifier)
        .await?
        .paced(PACE);
    loop {
        let batch = follower.next_batch(1000).await?;
        let Some(last) = batch.last().map(RecordedEvent::cursor) else {
            follower.report_lag().await?;
            follower.wait().await;
            continue;
        };
        wake(&ctx, &timings, &mut follower, &batch, last).await?;
        follower.wait_unless_full().await;
    }
}

/// Wakes the instances `batch` names and those it may let fit, and moves the checkpoint to
/// `last`.
async fn wake(
    ctx: &Ctx,
    timings: &Timings,
    follower: &mut Follower,
    batch: &[RecordedEvent],
    last: Cursor,
) -> Result<(), ProjectionError> {
    let named: Vec<String> = batch
        .iter()
        .filter(|e| e.event_type.starts_with("instance.") && e.event_type != "instance.orphaned")
        .filter_map(|e| e.data["instanceId"].as_str().map(str::to_string))
        .collect();
    let looked = look_at(&ctx.pool, &named).await?;
    let now = ctx.clock.now();
    wake_sandboxes(ctx, &looked, now, timings).await?;
    let mut instances: Vec<String> = named
        .into_iter()
        .filter(|id| {
            looked
                .get(id)
                .is_some_and(|inst| crate::instances::wants_pass(inst, now, timings))
        })
        .collect();
    if instances.is_empty() && !batch.iter().any(frees_capacity) {
        // Nothing to wake: no commit, which would hold back every follower's reads.
        return Ok(follower.pass_over(last).await?);
    }
    let mut tx = ctx.pool.begin().await?;
    for pool_id in freed_pools(&mut tx, batch).await? {
        let waiting = vps_projections::instances::reads::scheduling(&mut tx, &pool_id).await?;
        instances.extend(waiting);
    }
    instances.sort();
    instances.dedup();
    work_queue::wake_all(&mut *tx, crate::instances::KIND, &instances, now).await?;
    vps_events::follower::save_checkpoint(&mut *tx, NAME, last).await?;
    tx.commit().await?;
    follower.advance(last);
    // The followers' reads stop at the oldest open transaction, so this commit (which
    // appends nothing) may free events they were held back from; the reconcilers wake on
    // the work signal.
    ctx.notifier.committed();
    if !instances.is_empty() {
        work_queue::announce(ctx, crate::instances::KIND);
    }
    Ok(())
}

/// The instances `ids` name, as they are now.
async fn look_at(
    pool: &PgPool,
    ids: &[String],
) -> Result<HashMap<String, Instance>, ProjectionError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let mut conn = pool.acquire().await?;
    vps_projections::instances::load_many(&mut conn, ids).await
}

/// Wakes this server's sandbox reconciler when the sandbox an instance of `looked` drives, as
/// it is now, gives a pass something to do (the instance path's own stamps missed it). A
/// reconciler on another replica finds it on its next periodic pass.
async fn wake_sandboxes(
    ctx: &Ctx,
    looked: &HashMap<String, Instance>,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<(), ProjectionError> {
    let ids: Vec<&str> = looked
        .values()
        .filter_map(|inst| inst.sandbox_id.as_deref())
        .collect();
    if ids.is_empty() {
        return Ok(());
    }
    let sandboxes = vps_projections::sandboxes::load_sandboxes(&ctx.pool, &ids).await?;
    let wanted = sandboxes.into_iter().any(|sandbox| {
        let instance = looked.get(&sandbox.instance_id).map(|inst| inst.state);
        crate::sandboxes::wants_pass(&crate::sandboxes::Look { sandbox, instance }, now, timings)
    });
    if wanted {
        crate::sandboxes::wake(ctx);
    }
    Ok(())
}

fn frees_capacity(event: &RecordedEvent) -> bool {
    FREES_CAPACITY.contains(&event.event_type.as_str())
}

async fn freed_pools(
    tx: &mut sqlx::PgConnection,
    batch: &[RecordedEvent],
) -> Result<Vec<String>, sqlx::Error> {
    let mut pools = Vec::new();
    for e in batch.iter().filter(|e| frees_capacity(e)) {
        if let Some(p) = e.data["poolId"].as_str() {
            pools.push(p.to_string());
        } else if let Some(node) = e.data["nodeId"].as_str() {
            let p = vps_projections::nodes::pool_id(tx, node).await?;
            pools.extend(p);
        }
    }
    pools.sort();
    pools.dedup();
    Ok(pools)
}
