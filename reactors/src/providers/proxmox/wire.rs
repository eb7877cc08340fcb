//! The JSON shapes of the Proxmox VE API the client reads, and how they map onto machine
//! states and error codes.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};
use serde_json::Value;

use crate::providers::error::ProviderErrorCode;
use crate::providers::machine::MachineState;

/// Every answer is wrapped: `{ "data": … }`.
#[derive(Debug, Deserialize)]
pub(super) struct Envelope<T> {
    pub data: T,
}

/// An error answer: `{ "data": null, "message": "…\n", "errors": { "param": "…" } }`
/// (older releases put the message only in the HTTP reason phrase).
#[derive(Debug, Default, Deserialize)]
pub(super) struct ErrorBody {
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub errors: Option<BTreeMap<String, String>>,
}

/// One entry of `GET /nodes/{node}/qemu`.
#[derive(Debug, Deserialize)]
pub(super) struct VmEntry {
    #[serde(deserialize_with = "vmid")]
    pub vmid: u32,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub template: Option<Value>,
}

/// `GET /nodes/{node}/qemu/{vmid}/status/current`.
#[derive(Debug, Deserialize)]
pub(super) struct VmStatus {
    pub status: String,
    #[serde(default)]
    pub qmpstatus: Option<String>,
    #[serde(default)]
    pub lock: Option<String>,
}

/// `GET /nodes/{node}/tasks/{upid}/status`.
#[derive(Debug, Deserialize)]
pub(super) struct TaskStatus {
    pub status: String,
    #[serde(default)]
    pub exitstatus: Option<String>,
}

/// `GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces`.
#[derive(Debug, Deserialize)]
pub(super) struct AgentInterfaces {
    #[serde(default)]
    pub result: Vec<AgentInterface>,
}

#[derive(Debug, Deserialize)]
pub(super) struct AgentInterface {
    #[serde(default)]
    pub name: String,
    #[serde(default, rename = "ip-addresses")]
    pub ip_addresses: Vec<AgentAddress>,
}

#[derive(Debug, Deserialize)]
pub(super) struct AgentAddress {
    #[serde(rename = "ip-address")]
    pub address: String,
}

/// A vmid, which the API sends as a number in lists and as a string from `cluster/nextid`.
pub(super) fn vmid<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    match Value::deserialize(deserializer)? {
        Value::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| serde::de::Error::custom("vmid out of range")),
        Value::String(s) => s.parse().map_err(serde::de::Error::custom),
        _ => Err(serde::de::Error::custom("vmid must be a number")),
    }
}

impl VmEntry {
    /// Templates are VMs too in the list, but never ours.
    pub fn is_template(&self) -> bool {
        match &self.template {
            Some(Value::Number(n)) => n.as_u64() == Some(1),
            Some(Value::Bool(b)) => *b,
            Some(Value::String(s)) => s == "1",
            _ => false,
        }
    }
}

impl VmStatus {
    /// The VM's state: a clone in progress is `starting`; a running VM is refined by QEMU's
    /// own status.
    pub fn machine_state(&self) -> MachineState {
        if matches!(self.lock.as_deref(), Some("clone" | "create")) {
            return MachineState::Starting;
        }
        match (self.status.as_str(), self.qmpstatus.as_deref()) {
            ("running", Some("prelaunch" | "inmigrate")) => MachineState::Starting,
            ("running", Some("paused" | "suspended" | "postmigrate")) => MachineState::Stopped,
            ("running", Some("internal-error" | "io-error" | "guest-panicked")) => {
                MachineState::Error
            }
            ("running", _) => MachineState::Running,
            ("stopped", _) => MachineState::Stopped,
            _ => MachineState::Error,
        }
    }
}

/// Addresses worth reporting: not loopback, not link-local.
pub(super) fn usable_addresses(interfaces: AgentInterfaces) -> Vec<String> {
    interfaces
        .result
        .into_iter()
        .filter(|interface| interface.name != "lo")
        .flat_map(|interface| interface.ip_addresses)
        .map(|address| address.address)
        .filter(|address| {
            !(address.starts_with("127.") || address == "::1" || address.starts_with("fe80:"))
        })
        .collect()
}

/// The provider error code for an HTTP status and the API's message.
pub(super) fn error_code(status: u16, message: &str) -> ProviderErrorCode {
    match status {
        401 | 403 | 400 => ProviderErrorCode::InvalidConfig,
        404 => ProviderErrorCode::NotFound,
        429 => ProviderErrorCode::RateLimited,
        501 => ProviderErrorCode::Unsupported,
        // The API answers a missing VM with a 500 naming its missing config file.
        500 if message.contains("does not exist") => ProviderErrorCode::NotFound,
        500 if message.contains("is locked") => ProviderErrorCode::InvalidState,
        _ => ProviderErrorCode::ProviderError,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_vm_being_cloned_is_starting() {
        let status: VmStatus =
            serde_json::from_value(json!({ "status": "stopped", "lock": "clone" })).unwrap();
        assert_eq!(status.machine_state(), MachineState::Starting);
    }

    #[test]
    fn a_paused_vm_is_not_running() {
        let status: VmStatus =
            serde_json::from_value(json!({ "status": "running", "qmpstatus": "paused" })).unwrap();
        assert_eq!(status.machine_state(), MachineState::Stopped);
    }

    #[test]
    fn loopback_and_link_local_addresses_are_left_out() {
        let interfaces: AgentInterfaces = serde_json::from_value(json!({ "result": [
            { "name": "lo", "ip-addresses": [{ "ip-address": "127.0.0.1" }] },
            { "name": "eth0", "ip-addresses": [
                { "ip-address": "192.0.2.5" }, { "ip-address": "fe80::1" }
            ]}
        ]}))
        .unwrap();
        assert_eq!(usable_addresses(interfaces), ["192.0.2.5"]);
    }

    #[test]
    fn a_missing_config_file_is_not_found() {
        let message = "Configuration file 'nodes/pve/qemu-server/105.conf' does not exist";
        assert_eq!(error_code(500, message), ProviderErrorCode::NotFound);
        assert_eq!(
            error_code(500, "got timeout"),
            ProviderErrorCode::ProviderError
        );
    }

    #[test]
    fn vmids_come_as_numbers_or_strings() {
        let entry: VmEntry = serde_json::from_value(json!({ "vmid": "101" })).unwrap();
        assert_eq!(entry.vmid, 101);
    }
}
