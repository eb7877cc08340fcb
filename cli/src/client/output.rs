//! Answers for people: a list as a table of its most telling columns, one resource as a table
//! of its fields; `--json` prints the answer as it came.

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ContentArrangement, Table};
use serde_json::Value;
use vps_api::tools::history::{ellipsized, line};

/// The columns a list shows, in this order, when its items have them.
const COLUMNS: &[&str] = &[
    "id",
    "name",
    "state",
    "desiredState",
    "tenantId",
    "poolId",
    "nodeId",
    "flavor",
    "templateId",
    "instanceId",
    "sandboxId",
    "class",
    "runtime",
    "sizeGiB",
    "includeMemory",
    "keep",
    "meter",
    "quantity",
    "unit",
    "windowStart",
    "url",
    "expiresAt",
    "createdAt",
];

/// Most columns a list shows.
const MAX_COLUMNS: usize = 7;

/// The widest a cell gets.
const MAX_CELL: usize = 60;

/// Prints `answer`: JSON, or a table. A closed pipe (`| head`) ends the output quietly.
pub fn print(answer: &Value, json: bool) {
    use std::io::Write;
    let text = match json {
        true => serde_json::to_string_pretty(answer).unwrap_or_default(),
        false => render(answer),
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}");
    if let (false, Some(cursor)) = (json, answer.get("cursor").and_then(Value::as_str)) {
        let _ = writeln!(out, "more: --cursor {cursor}");
    }
}

/// A resource's events (a `*.history` answer), one readable line each as `vps history` prints
/// them: time, type, actor and a summary. A closed pipe ends the output quietly.
pub fn print_events(answer: &Value) {
    use std::io::Write;
    let events = answer["items"].as_array().map_or(&[][..], Vec::as_slice);
    let mut out = std::io::stdout().lock();
    if events.is_empty() {
        let _ = writeln!(out, "(none)");
    }
    for event in events {
        if writeln!(out, "{}", line(event)).is_err() {
            return;
        }
    }
}

/// The field of `answer` at a dotted `path` (`state`, `shape.vcpu`, `items.0.id`): text as it
/// is, anything else as JSON; `null` when there is none.
pub fn print_field(answer: &Value, path: &str) {
    use std::io::Write;
    let text = match field(answer, path) {
        Value::String(s) => s.clone(),
        other => serde_json::to_string_pretty(other).unwrap_or_default(),
    };
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

fn field<'a>(answer: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .filter(|step| !step.is_empty())
        .fold(answer, |v, step| match step.parse::<usize>() {
            Ok(i) if v.is_array() => &v[i],
            _ => &v[step],
        })
}

/// The table for `answer`.
pub fn render(answer: &Value) -> String {
    match answer.get("items").and_then(Value::as_array) {
        Some(items) => list(items),
        None => fields(answer),
    }
}

fn table() -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled);
    t
}

fn list(items: &[Value]) -> String {
    if items.is_empty() {
        return "(none)".into();
    }
    let present = |key: &str| {
        items
            .iter()
            .any(|i| i.get(key).is_some_and(|v| !v.is_null()))
    };
    let mut columns: Vec<&str> = COLUMNS.iter().copied().filter(|c| present(c)).collect();
    if columns.is_empty() {
        // Items of another shape: their own scalar keys.
        if let Some(first) = items[0].as_object() {
            columns = first
                .iter()
                .filter(|(_, v)| !v.is_object() && !v.is_array())
                .map(|(k, _)| k.as_str())
                .collect();
        }
    }
    columns.truncate(MAX_COLUMNS);
    let mut t = table();
    t.set_header(columns.iter().map(|c| c.to_string()));
    for item in items {
        t.add_row(columns.iter().map(|c| cell(&item[*c])));
    }
    t.to_string()
}

fn fields(answer: &Value) -> String {
    let Some(object) = answer.as_object() else {
        return cell(answer);
    };
    let mut t = table();
    t.set_header(["field", "value"]);
    for (key, value) in object {
        if !value.is_null() {
            t.add_row([key.clone(), cell(value)]);
        }
    }
    t.to_string()
}

/// A value in one cell: text as it is, anything else as compact JSON, cut at [`MAX_CELL`].
fn cell(v: &Value) -> String {
    let text = match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    ellipsized(text, MAX_CELL)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_list_shows_its_telling_columns() {
        let answer = json!({ "items": [
            { "id": "inst_a", "state": "running", "poolId": "pool_1", "shape": { "vcpu": 2 } },
            { "id": "inst_b", "state": "deleted", "poolId": "pool_1", "shape": { "vcpu": 2 } },
        ]});
        let out = render(&answer);
        assert!(out.contains("inst_a") && out.contains("running") && out.contains("poolId"));
        assert!(
            !out.contains("vcpu"),
            "nested fields stay out of lists: {out}"
        );
    }

    #[test]
    fn tables_look_like_this() {
        let list = json!({ "items": [
            { "id": "sbx_a", "state": "ready", "templateId": "sbxt_1", "instanceId": "inst_a",
              "expiresAt": "2026-12-01T12:00:00Z", "createdAt": "2026-12-01T11:00:00Z", "warm": true },
            { "id": "sbx_b", "state": "starting", "templateId": "sbxt_1", "instanceId": "inst_b",
              "expiresAt": "2026-12-01T12:30:00Z", "createdAt": "2026-12-01T11:30:00Z", "warm": false },
        ], "cursor": "sbx_b" });
        insta::assert_snapshot!("sandbox_list", render(&list));
        let one = json!({ "id": "vol_a", "name": "notes", "sizeGiB": 10, "state": "ready",
                          "nodeId": "node_1", "attachedTo": null });
        insta::assert_snapshot!("volume", render(&one));
    }

    #[test]
    fn a_query_picks_one_field() {
        let answer = json!({ "state": "running", "shape": { "vcpu": 2 },
                             "items": [{ "id": "inst_a" }] });
        assert_eq!(field(&answer, "state"), "running");
        assert_eq!(field(&answer, "shape.vcpu"), 2);
        assert_eq!(field(&answer, "items.0.id"), "inst_a");
        assert!(field(&answer, "nothing.here").is_null());
    }

    #[test]
    fn one_resource_is_a_table_of_fields() {
        let out = render(&json!({ "id": "pool_1", "name": "hosted", "policy": { "a": 1 } }));
        assert!(out.contains("name") && out.contains("hosted") && out.contains("{\"a\":1}"));
    }
}
