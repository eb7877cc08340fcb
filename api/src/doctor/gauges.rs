//! `vps_doctor_findings{check,severity}`: 1 for each check's current severity, 0 for the
//! others, refreshed every 30 s by a background part of `vps serve`.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tracing::Instrument;

use super::{Ctx, Finding, Severity};
use crate::config::Config;

/// How often the gauges are refreshed.
pub const EVERY: Duration = Duration::from_secs(30);
/// The first refresh waits this long, so the parts started beside it hold their leases.
const FIRST: Duration = Duration::from_secs(2);
/// What one refresh may take.
const BUDGET: Duration = Duration::from_secs(10);

/// Refreshes the gauges for as long as the task lives.
pub async fn run(pool: PgPool, config: Arc<Config>) {
    tokio::time::sleep(FIRST).await;
    loop {
        let findings = super::run(Ctx {
            pool: Ok(&pool),
            config: &config,
            budget: BUDGET,
        })
        .instrument(tracing::info_span!("doctor_pass"))
        .await;
        set(&findings);
        tokio::time::sleep(EVERY).await;
    }
}

/// Sets each finding's gauges.
pub fn set(findings: &[Finding]) {
    for f in findings {
        for severity in Severity::ALL {
            metrics::gauge!("vps_doctor_findings", "check" => f.check.clone(), "severity" => severity.as_str())
                .set(if severity == f.severity { 1.0 } else { 0.0 });
        }
    }
}
