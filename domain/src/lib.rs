//! The vps domain: ids, the instance state table, aggregates (`decide`/`evolve`), placement,
//! IPAM and quota math, and the error facts they return.
//!
//! This crate is pure. It never does I/O, never reads a clock and never draws random numbers:
//! `now` and fresh ids come in as arguments. Everything that touches the world lives in the
//! crates above it.
//!
//! # Layout
//!
//! - [`aggregate`]: the `Event` and `Aggregate` traits every stream's resource implements.
//! - [`ids`]: derived instance and sandbox ids, prefixed ULID ids, NIC MACs, hostnames.
//! - [`state_table`]: instance states, desired states, verbs and the table of legal moves.
//! - [`resources`]: flavor shapes, node capacity, quota resources.
//! - [`condition`]: instance conditions and their message caps.
//! - [`instance`]: the instance aggregate: state, commands, events, `decide` and `evolve`.
//! - [`pool`], [`node`], [`flavor`], [`image`], [`provider_account`]: the operator's
//!   aggregates, each with its typed events and `decide`; their payloads are in [`operator`].
//! - [`placement`]: choosing a node for a hosted instance; in-place resize room.
//! - [`ipam`]: IPv4 ranges and lowest-free-address leasing.
//! - [`quota`]: whether a charge (or a resize delta) fits a tenant's quota.
//! - [`ssh_keys`]: OpenSSH public key validation.
//! - [`cloud_config`]: the default cloud-config user data.
//! - [`template`], [`sandbox`]: sandbox templates and sandboxes (lifetimes, extends, expiry);
//!   [`network_policy`]: what their guests may reach.
//! - [`volume`]: sandbox volumes: the aggregate, its booking and growth, template mounts and
//!   the attachments (one writer) a sandbox's instance gets.
//! - [`webhook`]: the webhook subscription aggregate and its decision.
//! - [`network`]: which addresses are internal, and CIDRs an operator allows.
//! - [`authz`]: the Cedar schema, the baseline policies and decisions; [`policy`] (stored
//!   policies), [`identity`] (run-time identities and API keys), [`tenant`] (teardown).
//! - [`usage`]: usage metering math: meters, epoch-aligned windows, the per-instance ledger
//!   folded from instance events, and the `usage.recorded` records it settles.
//! - [`error`]: [`DomainError`], the refusals decisions return, with the SPEC's codes.

pub mod aggregate;
pub mod attachment;
pub mod authz;
pub mod bounds;
pub mod cloud_config;
pub mod condition;
pub mod error;
pub mod flavor;
pub mod identity;
pub mod ids;
pub mod image;
pub mod instance;
pub mod ipam;
pub mod labels;
pub mod network;
pub mod network_policy;
pub mod node;
pub mod operator;
pub mod placement;
pub mod policy;
pub mod pool;
pub mod provider_account;
pub mod quota;
pub mod resources;
pub mod sandbox;
pub mod ssh_keys;
pub mod state_table;
pub mod template;
pub mod tenant;
pub mod tunnel_url;
pub mod usage;
pub mod volume;
pub mod webhook;

pub use error::{DomainError, ErrorCode};
