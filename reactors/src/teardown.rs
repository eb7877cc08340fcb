//! The tenant teardown reactor (SPEC §3.10): one work item per tenant being deleted, taken
//! with `SKIP LOCKED` so one replica works on it at a time. Each pass runs every teardown step
//! once (`vps_commands::tenants::teardown_pass`, at most 100 instances asked to delete) and
//! looks again until nothing remains; then `tenant.deleted` is recorded and the item rests.

use std::time::Duration;

use tracing::Instrument;
use vps_commands::Ctx;

use crate::timings::Timings;
use crate::work_queue::{self, Next, Taken};

/// The work-queue kind of teardown items.
pub const KIND: &str = "tenant-teardown";

const LEASE: Duration = Duration::from_secs(60);

/// Makes a tenant's teardown due now.
pub async fn wake(ctx: &Ctx, tenant_id: &str) -> Result<(), sqlx::Error> {
    work_queue::wake(&ctx.pool, KIND, tenant_id, ctx.clock.now()).await?;
    work_queue::announce(ctx, KIND);
    Ok(())
}

/// Runs teardown passes of due tenants until the process stops.
pub async fn run(ctx: Ctx, timings: Timings) -> Result<(), sqlx::Error> {
    let mut wake = work_queue::subscribe(&ctx, KIND);
    loop {
        wake.borrow_and_update();
        let items = work_queue::take(&ctx.pool, KIND, 8, LEASE, ctx.clock.now()).await?;
        if items.is_empty() {
            work_queue::idle(&ctx, KIND, &mut wake).await;
            continue;
        }
        for item in &items {
            let span = tracing::info_span!("teardown", tenant = %item.key);
            work_on(&ctx, &timings, item).instrument(span).await;
        }
    }
}

async fn work_on(ctx: &Ctx, timings: &Timings, item: &Taken) {
    let done = match vps_commands::tenants::teardown_pass(ctx, &item.key).await {
        Ok(remaining) => {
            let next = match remaining {
                0 => Next::WhenWoken,
                _ => Next::After(timings.transitional_look().min(Duration::from_secs(5))),
            };
            work_queue::complete(&ctx.pool, KIND, item, next.into(), ctx.clock.now()).await
        }
        Err(e) => {
            tracing::warn!(error = %e, "teardown pass failed");
            work_queue::fail(&ctx.pool, KIND, item, &e.to_string(), ctx.clock.now()).await
        }
    };
    if let Err(e) = done {
        tracing::warn!(error = %e, "cannot record a teardown pass; its lease will expire");
    }
}
