//! Provider clients: how the instance reconciler creates, inspects, powers and deletes machines
//! on an external cloud (SPEC §8).
//!
//! Layout:
//! - [`Provider`], the one trait every implementation answers to;
//! - `machine`: what is asked for ([`CreateMachine`], [`Power`]) and what comes back ([`Machine`]);
//! - `error`: [`ProviderError`] and its [`ProviderErrorCode`]s, which drive the reconciler's
//!   retry-or-fail decision;
//! - `config`: [`ProviderConfig`], parsed and validated from a provider account's JSON;
//! - `hetzner`, `proxmox`: HTTP clients of those APIs; `emulator`: an in-process cloud for
//!   `vps dev` and tests;
//! - `naming`, `transport`: the provider-side machine name and the shared HTTP plumbing.
//!
//! A provider never touches the database: the reconciler plans in a transaction, calls a
//! provider with none open, then applies the answer.

mod config;
mod emulator;
mod error;
mod hetzner;
mod machine;
mod naming;
mod proxmox;
mod transport;

use std::sync::Arc;

use async_trait::async_trait;

pub use config::{ConfigError, EmulatorConfig, HetznerConfig, ProviderConfig, ProxmoxConfig};
pub use emulator::{EmulatorFault, EmulatorProvider};
pub use error::{ProviderError, ProviderErrorCode, MAX_MESSAGE_CHARS, MAX_RETRY_AFTER};
pub use hetzner::HetznerProvider;
pub use machine::{CreateMachine, Machine, MachineState, Power};
pub use naming::machine_name;
pub use proxmox::ProxmoxProvider;

/// A cloud that runs machines for provider pools.
///
/// Every call is safe to repeat: `create` is idempotent by [`CreateMachine::idempotency_key`]
/// (a create retried after a lost answer finds the first machine), `power` towards the state a
/// machine is already in succeeds, and `delete` of a machine that is gone answers
/// [`ProviderErrorCode::NotFound`], which the reconciler counts as done.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Creates the machine for `request.idempotency_key`, or returns the one already created
    /// for it.
    async fn create(&self, request: CreateMachine) -> Result<Machine, ProviderError>;

    /// Reads a machine by its provider id; a machine that no longer exists is `NotFound`.
    async fn get(&self, id: &str) -> Result<Machine, ProviderError>;

    /// Asks a machine to power on or to shut down gracefully; the next `get` shows the outcome.
    async fn power(&self, id: &str, power: Power) -> Result<(), ProviderError>;

    /// Deletes a machine; a machine that is already gone is `NotFound`.
    async fn delete(&self, id: &str) -> Result<(), ProviderError>;
}

/// Builds the provider an account's configuration describes.
///
/// Building is cheap and does no I/O, so a reconciler may build per pass. Every `emulator`
/// account shares one in-process cloud, so rebuilding loses no machines.
pub fn build(config: ProviderConfig) -> Arc<dyn Provider> {
    match config {
        ProviderConfig::HetznerCloud(config) => Arc::new(HetznerProvider::new(config)),
        ProviderConfig::Proxmox(config) => Arc::new(ProxmoxProvider::new(config)),
        ProviderConfig::Emulator(config) => Arc::new(EmulatorProvider::shared(config)),
    }
}
