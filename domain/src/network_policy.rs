//! What a sandbox's guest may reach: a template's `network`, carried by its instances and
//! their NodeSpec entries (`networkPolicy`). Its own module because both the template and the
//! instance aggregates name it.

use serde::{Deserialize, Serialize};

/// What a sandbox's guest may reach (`InstanceSpec.networkPolicy`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// Whatever the pool's network allows.
    #[default]
    Egress,
    /// Only its own subnet and the host.
    Private,
    /// Only the host.
    None,
}

impl Network {
    /// Whether the rules are written on the NICs' addresses (the pool needs an IP range).
    pub fn needs_ip_range(self) -> bool {
        !matches!(self, Network::Egress)
    }
}
