//! `vps replay --verify [--from POSITION]`: rebuild the projections from the log and compare
//! them with the live tables, while the hash chain is verified beside it; a run that finds
//! both intact records its checkpoint in the log (`audit.verified`).

use serde_json::json;
use sqlx::PgPool;
use vps_events::{append, Cursor, ExpectedVersion, Metadata, NewEvent};

/// The stream the checkpoints are appended to.
pub const CHECKPOINTS: &str = "audit-replay";
/// A checkpoint's event type.
pub const VERIFIED: &str = "audit.verified";

/// Runs the comparison and the chain check side by side (from the checkpoint at `from`, when
/// given); `Ok(false)` when a projection differs or the chain is broken (the binary exits
/// non-zero). The log and the live tables are read from `pool`, which may be a read replica
/// when `scratch` (where the rebuild is written) is another database; the checkpoint is then
/// not recorded, as a replica takes no append.
pub async fn verify(pool: &PgPool, scratch: &PgPool, from: Option<i64>) -> anyhow::Result<bool> {
    let checkpoint = match from {
        Some(position) => Some(checkpoint(pool, position).await?),
        None => None,
    };
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    let bar = super::audit::events_bar("replaying", total as u64);
    let progress = |done| bar.set_position(done);
    let (report, chain) = match checkpoint {
        None => tokio::join!(
            vps_projections::replay::verify_across(pool, scratch, None, progress),
            vps_events::chain::verify(pool, |_, _| {}),
        ),
        Some((after, previous)) => tokio::join!(
            vps_projections::replay::verify_across(pool, scratch, Some(after), progress),
            vps_events::chain::verify_from(pool, after, previous, |_, _| {}),
        ),
    };
    let (report, chain) = (report?, chain?);
    bar.finish_and_clear();
    let chain_intact = super::audit::print_chain(&chain);
    for table in &report.skipped {
        eprintln!("note: {table} not compared: its projector has not caught up with the log yet (run again)");
    }
    if !report.unscoped.is_empty() {
        println!(
            "--from: compared the rows of the {} streams' events since the checkpoint; not compared: {}",
            report.events,
            report.unscoped.join(", ")
        );
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
    if !report.diffs.is_empty() {
        return Ok(false);
    }
    println!(
        "projections equal the log: {} events replayed ({})",
        report.events, report.timings
    );
    if chain_intact && report.skipped.is_empty() {
        record(pool, &report, from).await?;
    }
    Ok(chain_intact)
}

/// The checkpoint a run verified at `position`: its cursor and the chain's link there.
async fn checkpoint(pool: &PgPool, position: i64) -> anyhow::Result<(Cursor, [u8; 32])> {
    let txid: Option<String> = sqlx::query_scalar(
        "SELECT data->>'transactionId' FROM events
          WHERE stream = $1 AND type = $2 AND (data->>'position')::bigint = $3
          ORDER BY version DESC LIMIT 1",
    )
    .bind(CHECKPOINTS)
    .bind(VERIFIED)
    .bind(position)
    .fetch_optional(pool)
    .await?;
    let Some(txid) = txid else {
        anyhow::bail!(
            "no verified checkpoint at position {position}: a run of `vps replay --verify` records \
             one (`vps events list --type audit.verified`)"
        );
    };
    let after = Cursor {
        transaction_id: txid.parse()?,
        position,
    };
    let Some(previous) = vps_events::chain::stored_hash(pool, after).await? else {
        anyhow::bail!("the checkpoint at position {position} is not chained: the log was altered");
    };
    Ok((after, previous))
}

/// Appends the checkpoint: the last position verified, and the hash of each table compared.
async fn record(
    pool: &PgPool,
    report: &vps_projections::replay::ReplayReport,
    from: Option<i64>,
) -> anyhow::Result<()> {
    let event = NewEvent {
        id: vps_commands::record::event_id(),
        event_type: VERIFIED.into(),
        data: json!({
            "position": report.last.position,
            "transactionId": report.last.transaction_id.to_string(),
            "from": from,
            "events": report.events,
            "tables": report.hashes,
        }),
        metadata: Metadata {
            actor: Some("vps-replay".into()),
            ..Metadata::default()
        },
    };
    let mut conn = pool.acquire().await?;
    match append(&mut conn, CHECKPOINTS, ExpectedVersion::Any, &[event]).await {
        Ok(_) => println!(
            "checkpoint recorded: position {} (`vps replay --verify --from {}` checks what changes after it)",
            report.last.position, report.last.position
        ),
        // A read replica takes no append: the check stands, unrecorded.
        Err(e) => eprintln!("note: the checkpoint was not recorded: {e}"),
    }
    Ok(())
}
