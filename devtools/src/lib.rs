//! The tools a developer runs, not an operator: `vps dev` (the server with emulated or real
//! hosts and a demo pool) and `vps bench <name>` (each capability's speed beside its
//! baseline). This is the one part of the binary that depends on the emulators.

pub mod bench;
pub mod dev;
