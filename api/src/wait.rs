//! Waiting for the projections to reach a condition: `wait` on creates is woken by every commit
//! the notifier hears of (this process's, or another replica's via `pg_notify`), a spec
//! long-poll by its node's generation signal; never by a fixed polling interval.

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::PgConnection;
use tokio::sync::watch;
use vps_commands::{CommandError, Ctx};
use vps_events::Notifier;
use vps_projections::ProjectionError;

use crate::error::ApiError;

/// The longest a missed wake-up can delay an answer.
const RECHECK: Duration = Duration::from_millis(500);

/// Runs `probe` until it reports done or `deadline` passes, and answers its last value.
pub async fn until<T, F, Fut>(
    notifier: &Notifier,
    deadline: Instant,
    probe: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(bool, T), ApiError>>,
{
    woken_by(notifier.subscribe(), RECHECK, deadline, probe).await
}

/// A create's `wait`: answers `created` at once when `settled` holds for it or `wait` is zero;
/// otherwise re-reads it (`load` of `id`) until `settled` holds or `wait` passes, and answers
/// the last copy read (`created` while `load` finds none).
pub async fn settled<T: Clone>(
    ctx: &Ctx,
    wait: Duration,
    created: T,
    id: &str,
    settled: impl Fn(&T) -> bool,
    load: impl AsyncFn(&mut PgConnection, &str) -> Result<Option<T>, ProjectionError>,
) -> Result<T, ApiError> {
    if settled(&created) || wait.is_zero() {
        return Ok(created);
    }
    until(&ctx.notifier, Instant::now() + wait, || async {
        let mut conn = ctx.pool.acquire().await?;
        let now = load(&mut conn, id)
            .await
            .map_err(CommandError::from)?
            .unwrap_or_else(|| created.clone());
        Ok((settled(&now), now))
    })
    .await
}

/// Like [`until`], woken by `wake` (a narrower signal than every commit) and at least every
/// `recheck`, in case a wake-up was lost.
pub async fn woken_by<W, T, F, Fut>(
    mut wake: watch::Receiver<W>,
    recheck: Duration,
    deadline: Instant,
    mut probe: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(bool, T), ApiError>>,
{
    loop {
        wake.borrow_and_update();
        let (done, value) = probe().await?;
        let now = Instant::now();
        if done || now >= deadline {
            return Ok(value);
        }
        let _ = tokio::time::timeout((deadline - now).min(recheck), wake.changed()).await;
    }
}
