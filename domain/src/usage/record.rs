//! A `usage.recorded` record (SPEC §4.2) and its deterministic event id.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The wire type of a usage record.
pub const EVENT_TYPE: &str = "usage.recorded";
/// The stream category usage records are appended to: `tenant-<id>`, subject `tenant/<id>`.
pub const STREAM_CATEGORY: &str = "tenant";

/// What one resource accrued on one meter over one window, or the part of it where the
/// resource was allocated with one shape for one payer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageRecord {
    /// The meter (`vps.vcpu.hours`).
    pub meter: String,
    /// Exact decimal quantity in `unit`s (serialised as a string).
    pub quantity: Decimal,
    /// `vcpu-hour`, `gib-hour`, `gpu-hour`.
    pub unit: String,
    /// Where the covered span starts (the window's start, or later when the resource started
    /// accruing, or changed shape or payer, inside the window).
    pub window_start: DateTime<Utc>,
    /// Where it ends (the window's end, or earlier when accrual stopped or changed).
    pub window_end: DateTime<Utc>,
    /// Who pays.
    pub tenant_id: String,
    /// The identity that owns the resource (absent for warm instances).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_id: Option<String>,
    /// The metered resource (`inst_…`).
    pub resource_id: String,
    /// Its pool.
    pub pool_id: String,
    /// The resource's labels while it accrued this.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
}

impl UsageRecord {
    /// The event id: the same (meter, resource, window start) always gives the same id, so a
    /// second append of a record is a no-op.
    pub fn event_id(&self) -> String {
        record_id(&self.meter, &self.resource_id, self.window_start)
    }

    /// The stream it is appended to: `tenant-<tenantId>`.
    pub fn stream(&self) -> String {
        format!("{STREAM_CATEGORY}-{}", self.tenant_id)
    }

    /// The event's `data`.
    pub fn data(&self) -> Value {
        serde_json::to_value(self).expect("a usage record serialises")
    }

    /// Reads a stored event's `data`.
    pub fn from_data(data: &Value) -> Result<UsageRecord, serde_json::Error> {
        UsageRecord::deserialize(data)
    }
}

/// `evt_` + a ULID-shaped body: the window start's milliseconds as the ULID time (so ids sort
/// roughly by window), then 80 bits of SHA-256 over (meter, resource, window start in µs).
pub fn record_id(meter: &str, resource_id: &str, window_start: DateTime<Utc>) -> String {
    let mut hasher = Sha256::new();
    for field in [
        meter,
        resource_id,
        &window_start.timestamp_micros().to_string(),
    ] {
        hasher.update((field.len() as u64).to_be_bytes());
        hasher.update(field.as_bytes());
    }
    let digest = hasher.finalize();
    let millis = window_start.timestamp_millis().clamp(0, (1 << 48) - 1) as u128;
    let random = digest[..10]
        .iter()
        .fold(0u128, |acc, b| (acc << 8) | u128::from(*b));
    format!("evt_{}", crockford(millis << 80 | random))
}

/// The 26-character lowercase Crockford base32 form of a 128-bit value (a ULID's).
fn crockford(value: u128) -> String {
    const ALPHABET: &[u8; 32] = b"0123456789abcdefghjkmnpqrstvwxyz";
    (0..26)
        .rev()
        .map(|i| ALPHABET[((value >> (5 * i)) & 31) as usize] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::is_valid_id;

    #[test]
    fn a_record_id_is_a_valid_event_id_that_depends_on_meter_resource_and_window_start() {
        let t = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let id = record_id("vps.vcpu.hours", "inst_a", t);
        assert!(is_valid_id("evt", &id), "{id}");
        assert_eq!(id, record_id("vps.vcpu.hours", "inst_a", t));
        assert_ne!(id, record_id("vps.memory.gib.hours", "inst_a", t));
        assert_ne!(id, record_id("vps.vcpu.hours", "inst_b", t));
        let later = t + chrono::Duration::microseconds(1);
        assert_ne!(id, record_id("vps.vcpu.hours", "inst_a", later));
    }

    #[test]
    fn a_record_round_trips_through_its_data_with_the_quantity_as_a_string() {
        let record = UsageRecord {
            meter: "vps.vcpu.hours".into(),
            quantity: "0.166666666667".parse().unwrap(),
            unit: "vcpu-hour".into(),
            window_start: DateTime::from_timestamp(1_800_000_000, 0).unwrap(),
            window_end: DateTime::from_timestamp(1_800_000_300, 0).unwrap(),
            tenant_id: "acme".into(),
            identity_id: None,
            resource_id: "inst_a".into(),
            pool_id: "pool_a".into(),
            labels: Default::default(),
        };
        let data = record.data();
        assert_eq!(data["quantity"], "0.166666666667");
        assert!(data.get("identityId").is_none());
        assert_eq!(UsageRecord::from_data(&data).unwrap(), record);
    }
}
