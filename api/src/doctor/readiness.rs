//! The cached readiness answer anonymous `/readyz` probes share.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Mutex;

/// How long an anonymous readiness answer is reused.
pub const READINESS_TTL: Duration = Duration::from_secs(1);

/// The last readiness result and when it was taken. One check runs at a time: probes that
/// arrive meanwhile wait for it and share its answer.
#[derive(Debug, Default)]
pub struct Readiness {
    last: Mutex<Option<(Instant, bool)>>,
}

impl Readiness {
    /// Whether the database answers and every migration is applied, as of at most
    /// [`READINESS_TTL`] ago.
    pub async fn ready(&self, pool: &PgPool) -> bool {
        let mut last = self.last.lock().await;
        if let Some((at, ready)) = *last {
            if at.elapsed() < READINESS_TTL {
                return ready;
            }
        }
        let ready = super::ready(pool).await;
        *last = Some((Instant::now(), ready));
        ready
    }
}
