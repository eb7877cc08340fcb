//! Everything that follows the log and acts on the world: the work queue, reconcilers, node
//! liveness, publishers and provider clients.
//!
//! A reactor pass is idempotent under at-least-once delivery and records what it did as
//! commands; it never holds a database transaction open across a network call.
pub mod deadlines;
#[cfg(test)]
mod fixtures;
pub mod instances;
pub mod liveness;
pub mod nats;
pub mod provider_instances;
pub mod providers;
pub mod sandboxes;
pub mod teardown;
pub mod timings;
pub mod usage;
pub mod volumes;
pub mod waker;
pub mod webhooks;
pub mod work_queue;
