//! What the reconciler asks a provider for and what a provider reports back.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A request to create one machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateMachine {
    /// The instance id: repeating a create with the same key yields the same machine.
    pub idempotency_key: String,
    /// The instance's display name, recorded at the provider for people to recognise.
    pub name: String,
    /// The flavor's `offerId`: a Hetzner server type, a Proxmox template vmid.
    pub offer_id: String,
    /// The image to boot: a Hetzner image name or id; Proxmox templates carry their own disk.
    pub image_id: String,
    /// Rendered cloud-init user data, if any.
    pub user_data: Option<String>,
}

/// A machine as the provider reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Machine {
    /// The provider's id of the machine (becomes the instance's `externalId`).
    pub id: String,
    /// Where the machine is.
    pub state: MachineState,
    /// IP addresses the provider reports, public first; empty while unknown.
    pub addresses: Vec<String>,
}

/// Where a machine is, reduced to what the reconciler distinguishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MachineState {
    /// Being created or booting: not usable yet, not failed either.
    Starting,
    /// Powered on.
    Running,
    /// Powered off.
    Stopped,
    /// The provider reports a failure or a state we cannot interpret.
    Error,
}

/// A power change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Power {
    /// Power the machine on.
    On,
    /// Ask the guest to shut down (ACPI), as a person pressing the power button would.
    GracefulOff,
}

impl MachineState {
    /// The wire name: `starting`, `running`, `stopped` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            MachineState::Starting => "starting",
            MachineState::Running => "running",
            MachineState::Stopped => "stopped",
            MachineState::Error => "error",
        }
    }
}

impl fmt::Display for MachineState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Power {
    /// The reference's name of the change: `on` or `graceful-off`.
    pub fn as_str(self) -> &'static str {
        match self {
            Power::On => "on",
            Power::GracefulOff => "graceful-off",
        }
    }
}

impl fmt::Display for Power {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
