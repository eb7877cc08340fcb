//! Instance conditions (SPEC §3.2): why an instance is not where it should be.

use std::fmt;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The kinds of condition an instance can carry; at most one of each at a time.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum ConditionType {
    /// No node fits (reason `NoFit`) or a requirement no node meets (reason names it).
    Unschedulable,
    /// The host's runtime reported an error.
    RuntimeError,
    /// A provider call failed (reason = the provider's error code).
    ProviderError,
    /// The host refused to start it for lack of resources (reason = the node id).
    HostResourcesExhausted,
    /// Every host that refused it, comma-separated in `message`, oldest first.
    ExhaustedHosts,
}

/// Whether the condition holds. Conditions are removed when they stop holding, so the ones on an
/// instance are `True`; the field exists for the wire shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ConditionStatus {
    /// It holds.
    True,
    /// It does not hold.
    False,
}

/// One condition of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// The kind.
    #[serde(rename = "type")]
    pub condition_type: ConditionType,
    /// Whether it holds.
    pub status: ConditionStatus,
    /// A short machine-readable cause (`NoFit`, an error code, a node id).
    pub reason: String,
    /// Human-readable detail, capped per type ([`ConditionType::message_cap`]).
    pub message: String,
    /// When it started to hold. Re-asserting the same reason keeps the original time, so
    /// "has stood for 60 s" can be read from it.
    pub since: DateTime<Utc>,
}

impl ConditionType {
    /// The longest message this type keeps, in characters. The caps for `ProviderError` (500) and
    /// `HostResourcesExhausted` (512) are the SPEC's; the others get the larger of the two so no
    /// message can grow a view without bound. `ExhaustedHosts` lists node ids and is uncapped;
    /// the list is bounded by the re-placement cap.
    pub fn message_cap(self) -> usize {
        match self {
            ConditionType::ProviderError => 500,
            ConditionType::ExhaustedHosts => usize::MAX,
            ConditionType::Unschedulable
            | ConditionType::RuntimeError
            | ConditionType::HostResourcesExhausted => 512,
        }
    }

    /// The wire name (the variant name).
    pub fn as_str(self) -> &'static str {
        match self {
            ConditionType::Unschedulable => "Unschedulable",
            ConditionType::RuntimeError => "RuntimeError",
            ConditionType::ProviderError => "ProviderError",
            ConditionType::HostResourcesExhausted => "HostResourcesExhausted",
            ConditionType::ExhaustedHosts => "ExhaustedHosts",
        }
    }
}

impl Condition {
    /// A holding condition of `condition_type` since `since`, its message cut to the type's cap.
    pub fn new(
        condition_type: ConditionType,
        reason: impl Into<String>,
        message: &str,
        since: DateTime<Utc>,
    ) -> Condition {
        Condition {
            condition_type,
            status: ConditionStatus::True,
            reason: reason.into(),
            message: truncate_chars(message, condition_type.message_cap()),
            since,
        }
    }
}

impl fmt::Display for ConditionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `s` cut to at most `max` characters (never inside a character).
pub fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((cut, _)) => s[..cut].to_owned(),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde_json::json;

    use super::*;

    #[test]
    fn a_provider_error_message_is_cut_to_500_characters() {
        let since = Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap();
        let c = Condition::new(
            ConditionType::ProviderError,
            "RATE_LIMITED",
            &"é".repeat(600),
            since,
        );
        assert_eq!(c.message.chars().count(), 500);
    }

    #[test]
    fn a_condition_serialises_with_type_status_reason_message_since() {
        let since = Utc.with_ymd_and_hms(2025, 1, 1, 0, 0, 0).unwrap();
        let c = Condition::new(ConditionType::Unschedulable, "NoFit", "no node fits", since);
        assert_eq!(
            serde_json::to_value(c).unwrap(),
            json!({
                "type": "Unschedulable",
                "status": "True",
                "reason": "NoFit",
                "message": "no node fits",
                "since": "2025-01-01T00:00:00Z"
            })
        );
    }
}
