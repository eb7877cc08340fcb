//! Handlers per API group.

pub mod events;
pub mod hosts;
pub mod instances;
pub mod operator;
pub mod provider_accounts;
