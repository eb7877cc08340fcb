//! `vps replay --verify`: rebuild every projection from the log and compare, row for row.

use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;

/// Runs the comparison; `Ok(false)` when a projection differs (the binary exits non-zero).
pub async fn verify(pool: &PgPool) -> anyhow::Result<bool> {
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("replaying {bar:40} {pos}/{len} events ({per_sec})")
            .expect("static template"),
    );
    let report = vps_projections::replay::verify(pool, |done| bar.set_position(done)).await?;
    bar.finish_and_clear();
    for table in &report.skipped {
        eprintln!("note: {table} not compared: its projector has not caught up with the log yet (run again)");
    }
    if report.diffs.is_empty() {
        println!(
            "projections equal the log: {} events replayed",
            report.events
        );
        return Ok(true);
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
