//! Command handlers: load an aggregate (its projection row is the snapshot, checked by the
//! append's expected version), decide with `vps_domain`, then append the events and apply the
//! inline projections in one PostgreSQL transaction.
//!
//! Modules: `context` (who acts), `error`, `record` (append + project), `operator` (pools,
//! offers, IP ranges, nodes, flavors, images), `instances` (admission, start, stop, resize,
//! delete), `secrets` (sealed user data), `webhooks` (subscriptions and their secrets), `policies` (stored Cedar
//! policies), `identities` (run-time identities, API keys), `tenants` (teardown steps),
//! `volumes` (sandbox volumes, and what templates and sandboxes take from them), `wakeups`
//! (a server's wake-ups of its background loops; the context carries them with its clock).
//!
//! Handlers never call a host or a cloud API and never write a projection table directly: the
//! projectors of `vps_projections` do that, inside the handler's transaction.

pub mod context;
pub mod error;
pub mod hosts;
pub mod identities;
pub mod instances;
pub mod operator;
pub mod pipeline;
pub mod policies;
pub mod provider_accounts;
pub mod record;
pub mod report_entries;
mod report_verdicts;
pub mod report_views;
pub mod sandboxes;
pub mod secrets;
pub mod stream;
pub mod tenants;
pub mod volumes;
pub mod wakeups;
pub mod webhooks;

pub use context::{Actor, Ctx};
pub use error::CommandError;

/// The answer of a delete that leaves nothing to show: what is gone.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Deleted {
    /// The id of what was deleted.
    pub id: String,
    /// Always `true`.
    pub deleted: bool,
}

impl Deleted {
    /// `id` is deleted.
    pub fn of(id: &str) -> Self {
        Deleted {
            id: id.to_string(),
            deleted: true,
        }
    }
}
