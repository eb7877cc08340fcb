//! `vps replay --verify`: rebuild every projection from the log and compare it with the live
//! tables, while the hash chain is verified beside it.

use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;

/// The progress bar of a pass over `total` events: events done, events/s, ETA.
pub fn events_bar(verb: &str, total: u64) -> ProgressBar {
    let template =
        format!("{verb} {{bar:40}} {{human_pos}}/{{human_len}} events ({{per_sec}}, ETA {{eta}})");
    ProgressBar::new(total).with_style(
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    )
}

/// Runs the comparison and the chain check side by side; `Ok(false)` when a projection
/// differs or the chain is broken (the binary exits non-zero).
pub async fn verify(pool: &PgPool) -> anyhow::Result<bool> {
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    let bar = events_bar("replaying", total as u64);
    let (report, chain) = tokio::join!(
        vps_projections::replay::verify(pool, |done| bar.set_position(done)),
        vps_events::chain::verify(pool, |_, _| {}),
    );
    let (report, chain) = (report?, chain?);
    bar.finish_and_clear();
    let chain_intact = super::audit::print_chain(&chain);
    for table in &report.skipped {
        eprintln!("note: {table} not compared: its projector has not caught up with the log yet (run again)");
    }
    if report.diffs.is_empty() {
        println!(
            "projections equal the log: {} events replayed ({})",
            report.events, report.timings
        );
        return Ok(chain_intact);
    }
    for diff in &report.diffs {
        eprintln!("table {} differs:", diff.table);
        for row in &diff.only_live {
            eprintln!("  only live:    {row}");
        }
        for row in &diff.only_rebuilt {
            eprintln!("  only rebuilt: {row}");
        }
    }
    Ok(false)
}
