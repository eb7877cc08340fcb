//! `vps audit verify`: recompute the hash chain and name the first event that no longer
//! matches.

use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;
use vps_events::chain::VerifyReport;

/// Verifies the chain; `Ok(false)` when it is broken (the binary exits non-zero).
pub async fn verify(pool: &PgPool) -> anyhow::Result<bool> {
    let bar = events_bar("verifying", 0);
    let report = vps_events::chain::verify(pool, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .await?;
    bar.finish_and_clear();
    Ok(print_chain(&report))
}

/// Prints what a chain check found; whether the chain is intact.
pub fn print_chain(report: &VerifyReport) -> bool {
    match &report.first_break {
        None => {
            println!(
                "chain intact: {} events verified, {} not chained yet",
                report.verified, report.unchained
            );
            true
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
            false
        }
    }
}

/// The progress bar of a pass over `total` events: events done, events/s, ETA.
pub fn events_bar(verb: &str, total: u64) -> ProgressBar {
    let template =
        format!("{verb} {{bar:40}} {{human_pos}}/{{human_len}} events ({{per_sec}}, ETA {{eta}})");
    ProgressBar::new(total).with_style(
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    )
}
