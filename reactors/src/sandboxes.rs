//! The sandbox reconciler (SPEC §3.8): one worker across replicas, a pass every `sandbox_pass`
//! and when woken. A pass warns sandboxes about to expire (once per expiry), expires at most
//! [`EXPIRE_PER_PASS`] whose time has come (`SKIP LOCKED`), fails those past a transitional
//! state's deadline, pauses or expires idle sandboxes (`idleTimeoutSeconds`), settles
//! `ready`, `paused` and `deleted` where the instance path's own stamps did not, releases
//! deleted volumes whose host let them go ([`crate::volumes`]), keeps every template's warm
//! pool, fails snapshots whose host command never settled (`snapshot_timeout`), and removes
//! deleted snapshots' objects from the store once nothing can still need them.
//!
//! The per-sandbox work has the instance reconciler's shape: the pass reads the candidate
//! sandboxes with their instances' states ([`Look`]), the pure [`step`] decides what each is
//! due, and the `lifecycle` commands record it, each deciding again on the locked row. The
//! instance waker asks [`wants_pass`] whether a sandbox's instance change gives a pass work.

mod step;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::watch;
use tracing::Instrument;
use vps_commands::sandboxes::{activity, lifecycle, snapshots, warm};
use vps_commands::{CommandError, Ctx};
use vps_domain::sandbox::Sandbox;
use vps_store::SnapshotStore;

use self::step::{deadlines, delta, expiry_leads};
pub use self::step::{step, wants_pass, Action, Look};
use crate::timings::Timings;

/// The lease that keeps the reconciler on one replica.
pub const LEASE: &str = "sandboxes";

/// Most expiries per pass.
pub const EXPIRE_PER_PASS: i64 = 100;

/// The context's wake-up that asks for a pass now.
const WAKE: &str = "sandboxes.pass";

/// The context's wake-up that says a warm instance was claimed.
const CLAIMED: &str = "sandboxes.claimed";

/// Asks this server's reconciler for a pass now (a template changed, a delete).
pub fn wake(ctx: &Ctx) {
    ctx.wakeups.wake(WAKE);
}

/// How long after a warm claim the refill pass starts.
pub const REFILL_SETTLE: Duration = Duration::from_millis(100);

/// The longest claims in a row hold a refill back.
pub const REFILL_MAX_DEFER: Duration = Duration::from_secs(1);

/// After a warm claim: a refill pass once claims have paused for [`REFILL_SETTLE`] (at most
/// [`REFILL_MAX_DEFER`] after the first), not at once, so the claims of a busy moment share
/// one pass (and one spec change per node), and the refill's creates, boots and reports do
/// not run beside the claimed instances' resumes on the same cores.
pub fn claimed(ctx: &Ctx) {
    ctx.wakeups.wake(CLAIMED);
}

/// The reconciler's wake-ups: a pass asked for, a claim.
struct Woken {
    pass: watch::Receiver<u64>,
    claimed: watch::Receiver<u64>,
}

impl Woken {
    fn new(ctx: &Ctx) -> Woken {
        Woken {
            pass: ctx.wakeups.subscribe(WAKE),
            claimed: ctx.wakeups.subscribe(CLAIMED),
        }
    }

    /// Waits until claims have paused for [`REFILL_SETTLE`], [`REFILL_MAX_DEFER`] has passed,
    /// or a pass is asked for.
    async fn claims_paused(&mut self) {
        let deadline = tokio::time::Instant::now() + REFILL_MAX_DEFER;
        loop {
            tokio::select! {
                () = tokio::time::sleep(REFILL_SETTLE) => return,
                () = tokio::time::sleep_until(deadline) => return,
                _ = self.pass.changed() => return,
                _ = self.claimed.changed() => {}
            }
        }
    }
}

/// Passes for as long as the task lives. A moved clock asks for a pass too: what it made due
/// (expiries, deadlines, timeouts) need not wait for `sandbox_pass`.
pub async fn run(ctx: Ctx, timings: Timings, store: SnapshotStore) -> Result<(), CommandError> {
    let _lease = vps_events::lease::Lease::acquire(&ctx.pool, LEASE, Duration::from_secs(2)).await;
    let mut woken = Woken::new(&ctx);
    let seen = WarmSeries::default();
    loop {
        woken.pass.borrow_and_update();
        woken.claimed.borrow_and_update();
        let span = tracing::info_span!("sandbox_pass");
        let more = pass_seen(&ctx, &timings, &store, &seen)
            .instrument(span)
            .await?;
        // A pass that refilled or drained a warm pool looks again soon (a pool fills
        // `REFILL_PER_PASS` at a time), not a whole `sandbox_pass` later: once claims pause.
        if more {
            woken.claims_paused().await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(timings.sandbox_pass()) => {}
            _ = woken.pass.changed() => {}
            _ = woken.claimed.changed() => woken.claims_paused().await,
            () = ctx.clock.moved() => {}
        }
    }
}

/// The `vps_sandbox_warm_instances` series one reconciler has set, so it can zero those that
/// empty.
#[derive(Default)]
struct WarmSeries(Arc<Mutex<BTreeSet<(String, String)>>>);

/// One pass. Answers whether it changed a warm pool, so another pass soon may have more to do.
pub async fn pass(
    ctx: &Ctx,
    timings: &Timings,
    store: &SnapshotStore,
) -> Result<bool, CommandError> {
    pass_seen(ctx, timings, store, &WarmSeries::default()).await
}

/// [`pass`], zeroing the warm series that emptied since `seen` was last set.
async fn pass_seen(
    ctx: &Ctx,
    timings: &Timings,
    store: &SnapshotStore,
    seen: &WarmSeries,
) -> Result<bool, CommandError> {
    let now = ctx.clock.now();
    let looks = looks(ctx, now, timings).await?;
    let mut due: Vec<(Action, &Sandbox)> = looks
        .iter()
        .flat_map(|look| {
            let s = &look.sandbox;
            step(look, now, timings).into_iter().map(move |a| (a, s))
        })
        .collect();
    // The expiries first, the most overdue of them first; then deadlines; then fallbacks.
    due.sort_by(|(a, s), (b, t)| (a, s.expires_at).cmp(&(b, t.expires_at)));
    for (action, s) in due {
        act(ctx, action, &s.id, now, timings).await?;
    }
    idle(ctx, now).await?;
    crate::deadlines::sweep(ctx, now, timings).await?;
    crate::volumes::release_deleted(ctx).await?;
    let changed = warm_pools(ctx, seen).await?;
    snapshot_timeouts(ctx, now, timings).await?;
    purges(ctx, store).await?;
    Ok(changed)
}

/// Pauses or expires the sandboxes whose activity says they are idle (at most
/// [`EXPIRE_PER_PASS`]), after dropping the activity of those no longer ready. Idleness is
/// judged from `sandbox_activity`, which host reports, exec sessions and preview requests
/// keep beside the log (see `vps_commands::sandboxes::activity` for why); only the pause or
/// expiry it leads to is an event.
async fn idle(ctx: &Ctx, now: DateTime<Utc>) -> Result<(), CommandError> {
    activity::prune(&ctx.pool).await?;
    let due = activity::idle_sandboxes(&ctx.pool, EXPIRE_PER_PASS).await?;
    for id in due {
        if let Some(end) = lifecycle::idle_out(ctx, &id, now).await? {
            metrics::counter!("vps_sandbox_idle_total").increment(1);
            tracing::info!(sandbox = %id, ?end, "idle sandbox ended");
        }
    }
    Ok(())
}

/// Most snapshots timed out, and most objects purged, per pass.
const SNAPSHOTS_PER_PASS: i64 = 100;

/// Fails the snapshots whose host command has run longer than `snapshot_timeout`.
async fn snapshot_timeouts(
    ctx: &Ctx,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<(), CommandError> {
    let before = now - delta(timings.snapshot_timeout());
    let mut conn = ctx.pool.acquire().await?;
    let overdue = snapshots::overdue(&mut conn, before, SNAPSHOTS_PER_PASS).await?;
    drop(conn);
    for snap in overdue {
        snapshots::time_out(ctx, &snap).await?;
        tracing::info!(snapshot = %snap.id, "snapshot timed out");
    }
    Ok(())
}

/// Removes deleted snapshots' objects (their upload settled, nothing restores from them) and
/// records each purge. A store that fails is tried again next pass; the network call runs
/// outside any transaction.
async fn purges(ctx: &Ctx, store: &SnapshotStore) -> Result<(), CommandError> {
    let mut conn = ctx.pool.acquire().await?;
    let due = snapshots::purgeable(&mut conn, SNAPSHOTS_PER_PASS).await?;
    drop(conn);
    for snap in due {
        match store.delete(&snap.object_key()).await {
            Ok(()) => {
                snapshots::mark_purged(ctx, &snap).await?;
                metrics::counter!("vps_snapshot_purges_total").increment(1);
            }
            Err(e) => {
                tracing::warn!(snapshot = %snap.id, error = %e, "snapshot purge failed; next pass retries")
            }
        }
    }
    Ok(())
}

/// Records one sandbox's due `action` at `now`.
async fn act(
    ctx: &Ctx,
    action: Action,
    id: &str,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<(), CommandError> {
    match action {
        Action::Expire => {
            let (lead, min_lead) = expiry_leads(timings);
            let expiry = lifecycle::ExpiryTimings { lead, min_lead };
            if let Some(lag) = lifecycle::expire(ctx, id, now, expiry).await? {
                let seconds = lag.num_milliseconds() as f64 / 1e3;
                metrics::histogram!("vps_sandbox_expiry_lag_seconds").record(seconds);
                tracing::info!(sandbox = %id, lag_seconds = seconds, "sandbox expired");
            }
        }
        Action::FailPastDeadline => {
            let d = deadlines(timings);
            if let Some(reason) = lifecycle::enforce_deadline(ctx, id, now, d).await? {
                metrics::counter!("vps_sandbox_deadlines_total").increment(1);
                tracing::warn!(sandbox = %id, %reason, "sandbox failed past its deadline");
            }
        }
        Action::Settle => lifecycle::settle(ctx, id).await?,
    }
    Ok(())
}

/// The sandboxes a pass at `now` may have work for, with their instances' states: those past
/// their expiry (at most [`EXPIRE_PER_PASS`], the most overdue first) or within the longest
/// warning lead and not warned, those in `starting`, `pausing` or `resuming` past its deadline
/// (at most [`EXPIRE_PER_PASS`]), and those whose instance moved where they did not follow
/// (at most 100). The bounds only narrow the read: [`step`] decides.
async fn looks(
    ctx: &Ctx,
    now: DateTime<Utc>,
    timings: &Timings,
) -> Result<Vec<Look>, CommandError> {
    let (lead, min_lead) = expiry_leads(timings);
    let horizon = now + lead.max(min_lead);
    let d = deadlines(timings);
    let bounds = vps_projections::sandboxes::LookBounds {
        now,
        horizon,
        limit: EXPIRE_PER_PASS,
        starting_before: now - d.starting,
        pausing_before: now - d.pausing,
        resuming_before: now - d.resuming,
    };
    let rows = vps_projections::sandboxes::looks(&ctx.pool, &bounds).await?;
    Ok(rows
        .into_iter()
        .map(|row| Look {
            sandbox: row.sandbox,
            instance: row.instance_state,
        })
        .collect())
}

/// Every template with a warm pool, and every template (deleted ones too) that still has warm
/// instances to drain. Answers whether any pool was refilled or drained. A template of a
/// tenant being deleted counts as deleted: its pool is drained, never refilled, even if one
/// slipped past teardown's template step.
async fn warm_pools(ctx: &Ctx, seen: &WarmSeries) -> Result<bool, CommandError> {
    let templates = vps_projections::sandboxes::warm_templates(&ctx.pool).await?;
    let mut changed = false;
    let (mut drained, mut refilled) = (0, 0);
    for w in templates {
        let plan = warm::upkeep(ctx, &w.id, w.template.as_ref()).await?;
        changed |= plan.create > 0 || !plan.drain.is_empty();
        drained += plan.drain.len();
        refilled += plan.create;
    }
    // Totals, never per template: a label must not carry a tenant's resource id.
    metrics::gauge!("vps_sandbox_warm_drained").set(drained as f64);
    metrics::gauge!("vps_sandbox_warm_refilled").set(refilled as f64);
    warm_gauges(ctx, seen).await?;
    Ok(changed)
}

/// `vps_sandbox_warm_instances{pool, state}`: how many warm instances each hosted pool holds,
/// summed over its templates. Pools are the operator's, so the series are bounded by the
/// fleet (pools × instance states), not by what tenants create; a series that empties is set
/// to 0 rather than left at its last value.
async fn warm_gauges(ctx: &Ctx, seen: &WarmSeries) -> Result<(), CommandError> {
    let counts = vps_projections::instances::reads::warm_counts(&ctx.pool).await?;
    let now: BTreeSet<(String, String)> = counts
        .iter()
        .map(|(p, s, _)| (p.clone(), s.clone()))
        .collect();
    let gone: Vec<(String, String)> = match seen.0.lock() {
        Ok(mut seen) => {
            let gone = seen.difference(&now).cloned().collect();
            *seen = now;
            gone
        }
        Err(_) => Vec::new(),
    };
    for (pool, state) in gone {
        metrics::gauge!("vps_sandbox_warm_instances", "pool" => pool, "state" => state).set(0.0);
    }
    for (pool, state, n) in counts {
        metrics::gauge!("vps_sandbox_warm_instances", "pool" => pool, "state" => state)
            .set(n as f64);
    }
    Ok(())
}
