//! The integration tests, one module per area, linked into one binary: one link of the whole
//! service instead of one per file keeps the build small and fast. `hardening` stays a binary
//! of its own because it reads process-wide gauges that the other tests would move.

mod api_registry;
mod chaos;
mod churn;
mod cli;
mod console;
mod deadlines;
mod doctor;
mod events;
mod exec;
mod files;
mod fork;
mod hosts;
mod identities;
mod idle;
mod instances;
mod isolation;
mod labels;
mod lease_property;
mod lifecycle;
mod mcp;
mod network;
mod policies;
mod preview;
mod provider_pools;
mod replay_property;
mod replay_tools;
mod sandbox_property;
mod sandboxes;
mod security;
mod snapshots;
mod teardown;
mod usage;
mod volumes;
