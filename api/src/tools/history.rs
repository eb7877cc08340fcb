//! `vps history <resource id>`: every event of a resource, oldest first, one readable line
//! each: time, type, actor and a short summary of what changed (`--json`: the whole events).

use serde_json::Value;
use sqlx::PgPool;
use vps_events::envelope::cloud_event;
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
            println!("{}", cloud_event(e));
        }
        return Ok(true);
    }
    for e in &events {
        println!("{}", line(&serde_json::to_value(cloud_event(e))?));
    }
    Ok(true)
}

/// One readable line of an event given as its CloudEvent JSON (as `vps history --json` prints
/// it and `instances.history` answers it): time to the millisecond, type, actor and a
/// [`summary`] of its data.
pub fn line(event: &Value) -> String {
    let time = event["time"].as_str().unwrap_or("-");
    let time = chrono::DateTime::parse_from_rfc3339(time).map_or_else(
        |_| time.to_string(),
        |t| {
            t.with_timezone(&chrono::Utc)
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
        },
    );
    format!(
        "{}  {:<28} {:<22} {}",
        time,
        event["type"].as_str().unwrap_or("-"),
        event["actor"].as_str().unwrap_or("-"),
        summary(&event["data"])
    )
}

/// Fields every event of a resource repeats, or that say nothing to a reader.
const QUIET: &[&str] = &[
    "tenantId",
    "poolId",
    "instanceId",
    "sandboxId",
    "templateId",
    "volumeId",
    "ownerIdentityId",
    "idempotencyKey",
    "requestHash",
    "userDataRef",
    "sshKeys",
    "shape",
    "poolKind",
    "common",
];

/// The most a summary shows.
const SUMMARY_CHARS: usize = 100;

/// What an event changed, as `key=value` pairs of its telling fields.
pub fn summary(data: &Value) -> String {
    let Some(fields) = data.as_object() else {
        return String::new();
    };
    let text = fields
        .iter()
        .filter(|(k, v)| !QUIET.contains(&k.as_str()) && !v.is_null())
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s}"),
            Value::Array(items) if items.len() > 3 => format!("{k}=[{} items]", items.len()),
            other => format!("{k}={other}"),
        })
        .collect::<Vec<_>>()
        .join(" ");
    ellipsized(text, SUMMARY_CHARS)
}

/// `text` cut to its first `max_chars` characters, ending in `…` when anything was cut.
pub fn ellipsized(text: String, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_summary_names_what_changed_not_the_ids_every_event_repeats() {
        let data = json!({ "instanceId": "inst_a", "tenantId": "acme", "poolId": "pool_1",
                           "state": "scheduling", "desiredState": "running", "nodeId": "node_1",
                           "requestHash": "abc" });
        assert_eq!(
            summary(&data),
            "state=scheduling desiredState=running nodeId=node_1"
        );
        let long = json!({ "reason": "x".repeat(300) });
        assert!(summary(&long).chars().count() <= SUMMARY_CHARS + 1);
    }

    #[test]
    fn a_line_reads_time_type_actor_and_summary_from_the_cloud_event() {
        let event = json!({ "id": "01", "type": "instance.created", "actor": "id_alice",
                            "time": "2026-01-02T03:04:05.678901Z", "subject": "instance/inst_a",
                            "data": { "instanceId": "inst_a", "state": "scheduling" } });
        assert_eq!(
            line(&event),
            format!(
                "2026-01-02T03:04:05.678Z  {:<28} {:<22} state=scheduling",
                "instance.created", "id_alice"
            )
        );
        let bare = json!({ "type": "pool.created", "time": "soon" });
        assert!(
            line(&bare).starts_with("soon  pool.created"),
            "{}",
            line(&bare)
        );
        assert!(line(&bare).contains(" - "), "{}", line(&bare));
    }
}
