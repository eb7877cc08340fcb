//! `vps history <resource id>`: every event of a resource, oldest first: time, type, actor,
//! cause and data.

use comfy_table::Table;
use sqlx::PgPool;
use vps_events::read::read_stream;

/// The stream a resource id lives in, from its prefix (`inst_…` → `instance-inst_…`).
pub fn stream_of(id: &str) -> Option<String> {
    let kind = match id.split_once('_')?.0 {
        "inst" => "instance",
        "pool" => "pool",
        "node" => "node",
        "flv" => "flavor",
        "whk" => "webhook",
        "pacct" => "provider_account",
        "sbx" => "sandbox",
        "sbxt" => "template",
        "vol" => "volume",
        _ => "image",
    };
    Some(format!("{kind}-{id}"))
}

/// Prints a resource's history; `Ok(false)` when it has none.
pub async fn print(pool: &PgPool, id: &str, json: bool) -> anyhow::Result<bool> {
    let stream = stream_of(id).ok_or_else(|| {
        anyhow::anyhow!("`{id}` is not a resource id (e.g. inst_…, pool_…, node_…)")
    })?;
    let events = read_stream(pool, &stream).await?;
    if events.is_empty() {
        eprintln!("no events for {id}");
        return Ok(false);
    }
    if json {
        for e in &events {
            println!("{}", vps_events::envelope::cloud_event(e));
        }
        return Ok(true);
    }
    let mut table = Table::new();
    table.set_header(["version", "time", "type", "actor", "cause", "data"]);
    for e in &events {
        let m = &e.metadata;
        table.add_row([
            e.version.to_string(),
            e.recorded_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            e.event_type.clone(),
            m.actor.clone().unwrap_or_default(),
            m.causation_id
                .clone()
                .or(m.request_id.clone())
                .unwrap_or_default(),
            e.data.to_string(),
        ]);
    }
    println!("{table}");
    Ok(true)
}
