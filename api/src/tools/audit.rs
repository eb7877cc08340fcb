//! `vps audit verify`: recompute the hash chain and name the first event that no longer
//! matches.

use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;

/// Verifies the chain; `Ok(false)` when it is broken (the binary exits non-zero).
pub async fn verify(pool: &PgPool) -> anyhow::Result<bool> {
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("verifying {bar:40} {pos}/{len} events ({per_sec})")
            .expect("static template"),
    );
    let report = vps_events::chain::verify(pool, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .await?;
    bar.finish_and_clear();
    match report.first_break {
        None => {
            println!(
                "chain intact: {} events verified, {} not chained yet",
                report.verified, report.unchained
            );
            Ok(true)
        }
        Some(b) => {
            eprintln!(
                "chain BROKEN at position {} (event {}, stream {}): {}; {} events before it verified",
                b.position,
                b.event_id.as_deref().unwrap_or("-"),
                b.stream.as_deref().unwrap_or("-"),
                b.reason,
                report.verified
            );
            Ok(false)
        }
    }
}
