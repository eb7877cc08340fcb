//! The API's methods, one module per group; each module declares its methods once
//! ([`crate::registry::Method`]) and the registry collects them here.

pub mod events;
pub mod flavors;
pub mod identities;
pub mod images;
pub mod instances;
pub mod nodes;
pub mod policies;
pub mod pools;
pub mod provider_accounts;
pub mod sandbox_exec;
pub mod sandboxes;
pub mod snapshots;
pub mod tenants;
pub mod usage;
pub mod volumes;
pub mod webhooks;

use crate::error::ApiError;
use std::sync::LazyLock;

use crate::registry::{Method, Registry};

/// Every method of the API, group by group.
pub fn all() -> Vec<Method> {
    [
        pools::methods(),
        nodes::methods(),
        flavors::methods(),
        images::methods(),
        instances::methods(),
        sandboxes::methods(),
        snapshots::methods(),
        sandbox_exec::methods(),
        volumes::methods(),
        provider_accounts::methods(),
        webhooks::methods(),
        events::methods(),
        policies::methods(),
        identities::methods(),
        tenants::methods(),
        usage::methods(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The registry of this build's API.
pub fn registry() -> &'static Registry {
    static REGISTRY: LazyLock<Registry> = LazyLock::new(|| Registry::new(all()));
    &REGISTRY
}

/// `NOT_FOUND` for a named resource.
pub fn missing(what: &str, id: &str) -> ApiError {
    ApiError::new("NOT_FOUND", format!("{what} {id} not found"))
}
