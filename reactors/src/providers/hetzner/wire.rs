//! The JSON shapes of the Hetzner Cloud API that the client reads and writes, and how they
//! map onto machines and error codes.

use std::collections::BTreeMap;
use std::net::Ipv6Addr;

use serde::{Deserialize, Serialize};

use crate::providers::error::ProviderErrorCode;
use crate::providers::machine::{Machine, MachineState};

/// `POST /servers` body.
#[derive(Debug, Serialize)]
pub(super) struct CreateServer<'a> {
    pub name: &'a str,
    pub server_type: &'a str,
    pub image: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_data: Option<&'a str>,
    pub labels: BTreeMap<&'static str, String>,
    pub start_after_create: bool,
}

/// `{ "server": … }`, the answer of `GET /servers/{id}` and `POST /servers`.
#[derive(Debug, Deserialize)]
pub(super) struct ServerEnvelope {
    pub server: Server,
}

/// `{ "servers": [ … ] }`, the answer of `GET /servers`.
#[derive(Debug, Deserialize)]
pub(super) struct ServerList {
    pub servers: Vec<Server>,
}

/// The fields of a server the client needs.
#[derive(Debug, Deserialize)]
pub(super) struct Server {
    pub id: u64,
    pub status: String,
    #[serde(default)]
    pub public_net: Option<PublicNet>,
    #[serde(default)]
    pub private_net: Vec<PrivateNet>,
}

#[derive(Debug, Deserialize)]
pub(super) struct PublicNet {
    #[serde(default)]
    pub ipv4: Option<Address>,
    #[serde(default)]
    pub ipv6: Option<Address>,
}

#[derive(Debug, Deserialize)]
pub(super) struct Address {
    pub ip: String,
}

#[derive(Debug, Deserialize)]
pub(super) struct PrivateNet {
    pub ip: String,
}

/// `{ "error": { "code", "message" } }`, every error answer.
#[derive(Debug, Deserialize)]
pub(super) struct ErrorEnvelope {
    pub error: ApiError,
}

#[derive(Debug, Deserialize)]
pub(super) struct ApiError {
    pub code: String,
    pub message: String,
}

impl Server {
    /// The machine this server is: public IPv4, then the IPv6 host address, then private IPs.
    pub fn into_machine(self) -> Machine {
        let mut addresses = Vec::new();
        if let Some(public) = self.public_net {
            addresses.extend(public.ipv4.map(|a| a.ip));
            addresses.extend(public.ipv6.and_then(|a| ipv6_host(&a.ip)));
        }
        addresses.extend(self.private_net.into_iter().map(|n| n.ip));
        Machine {
            id: self.id.to_string(),
            state: machine_state(&self.status),
            addresses,
        }
    }
}

/// Hetzner's server status as a machine state.
pub(super) fn machine_state(status: &str) -> MachineState {
    match status {
        "running" => MachineState::Running,
        // Still up until the guest has actually powered off.
        "stopping" => MachineState::Running,
        "initializing" | "starting" | "rebuilding" | "migrating" => MachineState::Starting,
        // A deleting server no longer serves; the reconciler only asks while deleting anyway.
        "off" | "deleting" => MachineState::Stopped,
        _ => MachineState::Error,
    }
}

/// Hetzner assigns each server an IPv6 /64 (`2001:db8:1::/64`) and configures its `::1`, the
/// address people connect to.
fn ipv6_host(network: &str) -> Option<String> {
    let prefix = network.split('/').next()?;
    let address: Ipv6Addr = prefix.parse().ok()?;
    Some(Ipv6Addr::from(u128::from(address) | 1).to_string())
}

/// The provider error code for a Hetzner error `code` (or, for an unknown code, the status).
pub(super) fn error_code(status: u16, code: &str) -> ProviderErrorCode {
    match code {
        "not_found" => ProviderErrorCode::NotFound,
        "rate_limit_exceeded" => ProviderErrorCode::RateLimited,
        "unauthorized" | "forbidden" | "token_readonly" | "invalid_input" | "json_error" => {
            ProviderErrorCode::InvalidConfig
        }
        "conflict" | "locked" | "uniqueness_error" | "protected" => ProviderErrorCode::InvalidState,
        "deprecated_api_endpoint" | "unsupported_error" => ProviderErrorCode::Unsupported,
        _ => match status {
            404 => ProviderErrorCode::NotFound,
            429 => ProviderErrorCode::RateLimited,
            400 | 401 | 403 | 422 => ProviderErrorCode::InvalidConfig,
            409 | 423 => ProviderErrorCode::InvalidState,
            501 => ProviderErrorCode::Unsupported,
            _ => ProviderErrorCode::ProviderError,
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_server_reports_ipv4_the_ipv6_host_and_private_addresses() {
        let server: Server = serde_json::from_value(json!({
            "id": 42,
            "status": "running",
            "public_net": {
                "ipv4": { "ip": "203.0.113.7" },
                "ipv6": { "ip": "2001:db8:1::/64" }
            },
            "private_net": [{ "ip": "10.0.0.2" }]
        }))
        .unwrap();
        let machine = server.into_machine();
        assert_eq!(machine.id, "42");
        assert_eq!(machine.state, MachineState::Running);
        assert_eq!(
            machine.addresses,
            ["203.0.113.7", "2001:db8:1::1", "10.0.0.2"]
        );
    }

    #[test]
    fn a_server_without_public_network_has_no_public_address() {
        let server: Server = serde_json::from_value(json!({
            "id": 1, "status": "initializing", "public_net": { "ipv4": null, "ipv6": null }
        }))
        .unwrap();
        let machine = server.into_machine();
        assert_eq!(machine.state, MachineState::Starting);
        assert!(machine.addresses.is_empty());
    }

    #[test]
    fn statuses_map_to_machine_states() {
        assert_eq!(machine_state("off"), MachineState::Stopped);
        assert_eq!(machine_state("starting"), MachineState::Starting);
        assert_eq!(machine_state("unknown"), MachineState::Error);
    }

    #[test]
    fn error_codes_map_to_provider_codes() {
        assert_eq!(
            error_code(401, "unauthorized"),
            ProviderErrorCode::InvalidConfig
        );
        assert_eq!(error_code(423, "locked"), ProviderErrorCode::InvalidState);
        assert_eq!(
            error_code(503, "unavailable"),
            ProviderErrorCode::ProviderError
        );
        assert_eq!(error_code(429, "whatever"), ProviderErrorCode::RateLimited);
    }
}
