//! The host seam (SPEC §3.7) as a host agent speaks it. The emulated hosts (`vps-emulators`)
//! and the real host (`vps-host`) both use this crate, so the two cannot drift apart.
//!
//! Modules:
//! - [`spec`]: the payloads (NodeSpec in, status report and command results out);
//! - [`client`]: [`NodeApi`], the node calls (`nodes.spec`, `nodes.report`, `nodes.secret`,
//!   `nodes.redeemTicket`) authenticated with a node token;
//! - [`pacing`]: when an agent reports and how it backs off after a failed call;
//! - [`tunnel`]: the first line of an exec tunnel (the ticket) and how a refusal is answered;
//! - [`exec_auth`]: the certificate an exec session must present once its ticket is redeemed;
//! - [`host_name`]: what a domain entry of a network allow-list (`networkAllow`) is, for the
//!   control plane that validates it and the host that serves it.
//!
//! This crate knows nothing of the server's internals: only the JSON a host reads and sends.
//! Unknown fields are ignored, so a newer server may add some.

pub mod client;
pub mod exec_auth;
pub mod host_name;
pub mod pacing;
pub mod spec;
pub mod tunnel;

pub use client::{CallError, HostFacts, NodeApi, NodeApiOptions, Redeemed, ReportAnswer};
pub use pacing::ReportPacer;
pub use spec::{
    CommandResult, DesiredState, HostCommand, ImageRef, InstanceSpec, NetworkPolicy, Nic, NodeSpec,
    ReportEntry, ReportState, RestoreFrom, Shape, SshCa, VolumeAttachment, VolumeSpec,
};
