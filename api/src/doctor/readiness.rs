//! The cached readiness answer anonymous `/readyz` probes share.

use std::time::Duration;

use chrono::{DateTime, Utc};

use sqlx::PgPool;
use tokio::sync::Mutex;

/// How long an anonymous readiness answer is reused.
pub const READINESS_TTL: Duration = Duration::from_secs(1);

/// The last readiness result and when it was taken. One check runs at a time: probes that
/// arrive meanwhile wait for it and share its answer.
#[derive(Debug, Default)]
pub struct Readiness {
    last: Mutex<Option<(DateTime<Utc>, bool)>>,
}

impl Readiness {
    /// Whether the database answers and every migration is applied, as of at most
    /// [`READINESS_TTL`] ago on `clock`.
    pub async fn ready(&self, pool: &PgPool, clock: &vps_clock::Clock) -> bool {
        let mut last = self.last.lock().await;
        let now = clock.now();
        if let Some((at, ready)) = *last {
            if (now - at).to_std().is_ok_and(|age| age < READINESS_TTL) {
                return ready;
            }
        }
        let ready = super::ready(pool).await;
        *last = Some((now, ready));
        ready
    }
}
