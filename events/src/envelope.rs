//! The CloudEvents 1.0 structured JSON envelope every reader outside the log sees (NATS,
//! webhooks, the events API, history).

use serde_json::{json, Value};

use crate::model::RecordedEvent;

/// The `source` attribute of every event this deployment emits.
pub const SOURCE: &str = "/vps";

/// The subject of a stream: `instance-inst_…` → `instance/inst_…`.
pub fn subject(stream: &str) -> String {
    match stream.split_once('-') {
        Some((kind, id)) => format!("{kind}/{id}"),
        None => stream.to_string(),
    }
}

/// The stream of a subject (the inverse of [`subject`]).
pub fn stream_of(subject: &str) -> String {
    subject.replacen('/', "-", 1)
}

/// The event as a CloudEvent. `sequence` is the read-order cursor, so resuming from it never
/// skips or repeats; `tenantid` is present when the event belongs to a tenant.
pub fn cloud_event(event: &RecordedEvent) -> Value {
    let mut ce = json!({
        "specversion": "1.0",
        "id": event.id,
        "source": SOURCE,
        "type": event.event_type,
        "subject": subject(&event.stream),
        "time": event.recorded_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "datacontenttype": "application/json",
        "sequence": event.cursor().to_string(),
        "data": event.data,
    });
    if let Some(tenant) = &event.metadata.tenant_id {
        ce["tenantid"] = json!(tenant);
    }
    if let Some(actor) = &event.metadata.actor {
        ce["actor"] = json!(actor);
    }
    ce
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_and_its_subject_convert_both_ways() {
        assert_eq!(subject("instance-inst_abc"), "instance/inst_abc");
        assert_eq!(stream_of("instance/inst_abc"), "instance-inst_abc");
        assert_eq!(subject("node-node_01-x"), "node/node_01-x");
    }
}
