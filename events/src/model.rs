//! What the log stores and how readers address it.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// An event about to be appended. The id is chosen by the caller so that a retried append is
/// recognised and answered with the stored event.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// `evt_` + lowercase ULID, unique across the log.
    pub id: String,
    /// Wire type, e.g. `instance.created`.
    pub event_type: String,
    /// The payload.
    pub data: Value,
    /// Who and why.
    pub metadata: Metadata,
}

/// Who caused an event and in answer to what.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Metadata {
    /// The tenant the event belongs to, if any (operators' events have none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    /// The identity that acted (`id_…`), or a reactor's name (`reactor:instances`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// The HTTP request that caused it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// Ties together every event of one user intent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    /// The event that directly caused this one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<String>,
}

/// An event as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    /// Global position (from a sequence; unique, not commit-ordered).
    pub position: i64,
    /// The appending transaction's id; with `position` it is the read order.
    pub transaction_id: u64,
    /// The stream, e.g. `instance-inst_…`.
    pub stream: String,
    /// 1, 2, … within the stream.
    pub version: i64,
    /// `evt_…`.
    pub id: String,
    /// Wire type.
    pub event_type: String,
    /// Payload.
    pub data: Value,
    /// Who and why.
    pub metadata: Metadata,
    /// When its transaction started.
    pub recorded_at: DateTime<Utc>,
}

impl RecordedEvent {
    /// The category of its stream (`instance` of `instance-inst_…`): it names the aggregate.
    pub fn category(&self) -> &str {
        self.stream
            .split_once('-')
            .map_or("", |(category, _)| category)
    }

    /// This event's place in the read order.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            transaction_id: self.transaction_id,
            position: self.position,
        }
    }
}

/// A point in the one read order every follower agrees on: `(transaction_id, position)`.
/// Reading "after a cursor" never returns an event before one already read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cursor {
    /// Transaction id (xid8).
    pub transaction_id: u64,
    /// Global position.
    pub position: i64,
}

impl Cursor {
    /// Before every event.
    pub const START: Cursor = Cursor {
        transaction_id: 0,
        position: 0,
    };
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.transaction_id, self.position)
    }
}

/// A string that is not `<transaction id>-<position>`.
#[derive(Debug, thiserror::Error)]
#[error("invalid cursor {0:?}: expected <transaction id>-<position>")]
pub struct InvalidCursor(pub String);

impl FromStr for Cursor {
    type Err = InvalidCursor;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidCursor(s.to_string());
        let (t, p) = s.split_once('-').ok_or_else(bad)?;
        Ok(Cursor {
            transaction_id: t.parse().map_err(|_| bad())?,
            position: p.parse().map_err(|_| bad())?,
        })
    }
}

/// What the appender believes the stream's version is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpectedVersion {
    /// Append whatever the version is.
    Any,
    /// The stream must not exist yet.
    NoStream,
    /// The stream's last event must have exactly this version.
    Exact(i64),
}

impl ExpectedVersion {
    /// The SQL parameter: NULL for any, 0 for no stream, else the version.
    pub(crate) fn as_param(self) -> Option<i64> {
        match self {
            ExpectedVersion::Any => None,
            ExpectedVersion::NoStream => Some(0),
            ExpectedVersion::Exact(v) => Some(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_round_trips_through_its_string_form() {
        let c = Cursor {
            transaction_id: 7_000_001,
            position: 42,
        };
        assert_eq!(c.to_string().parse::<Cursor>().unwrap(), c);
        assert!("42".parse::<Cursor>().is_err());
        assert!("a-b".parse::<Cursor>().is_err());
    }

    #[test]
    fn cursors_order_by_transaction_then_position() {
        let a = Cursor {
            transaction_id: 1,
            position: 9,
        };
        let b = Cursor {
            transaction_id: 2,
            position: 3,
        };
        assert!(a < b);
    }
}
