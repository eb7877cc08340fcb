//! The CloudEvents 1.0 structured JSON envelope every reader outside the log sees (NATS,
//! webhooks, the events API, history).

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// A CloudEvents 1.0 event in structured JSON mode, with this deployment's extensions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CloudEvent {
    /// Always `1.0`.
    pub specversion: String,
    /// The event's id in the log.
    pub id: String,
    /// Always `/vps`.
    pub source: String,
    /// The event type (`instance.created`, …).
    #[serde(rename = "type")]
    pub event_type: String,
    /// The stream as `kind/id` (`instance/inst_…`).
    pub subject: String,
    /// When it was recorded (RFC 3339, microseconds, UTC).
    pub time: String,
    /// Always `application/json`.
    pub datacontenttype: String,
    /// The read-order cursor: resuming after it never skips or repeats.
    pub sequence: String,
    /// The event's payload (SPEC §4.2).
    pub data: Value,
    /// The tenant the event belongs to, when it belongs to one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenantid: Option<String>,
    /// Who caused it, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

impl std::fmt::Display for CloudEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

/// The event as a CloudEvent. `sequence` is the read-order cursor, so resuming from it never
/// skips or repeats; `tenantid` is present when the event belongs to a tenant.
pub fn cloud_event(event: &RecordedEvent) -> CloudEvent {
    CloudEvent {
        specversion: "1.0".into(),
        id: event.id.clone(),
        source: SOURCE.into(),
        event_type: event.event_type.clone(),
        subject: subject(&event.stream),
        time: event
            .recorded_at
            .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        datacontenttype: "application/json".into(),
        sequence: event.cursor().to_string(),
        data: event.data.clone(),
        tenantid: event.metadata.tenant_id.clone(),
        actor: event.metadata.actor.clone(),
    }
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
