//! HTTP emulators of the provider APIs vps drives (Hetzner Cloud, Proxmox VE), for tests and
//! dev.
//!
//! Layout:
//! - `hetzner`, `proxmox`: one emulator each, an axum server on `127.0.0.1:0` that answers the
//!   routes, status codes, JSON shapes and authentication of the real API closely enough for
//!   vps's clients, with state in memory and transitions that complete after a short delay;
//! - `faults`: the failures tests inject (throttling, server errors, lost answers);
//! - `provider`: the state a provider emulator's routes share (world, faults, credential);
//! - `server`: binding and stopping an emulator's server.
//!
//! Start one with `hetzner::Emulator::start().await`, which answers the API's base URL and a
//! handle; dropping the handle stops the server. Emulators never reach beyond 127.0.0.1.

mod faults;
pub mod hetzner;
pub mod host;
mod provider;
pub mod proxmox;
mod server;

pub use faults::Fault;
