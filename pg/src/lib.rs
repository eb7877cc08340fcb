//! PostgreSQL server plumbing that sits below every layer: the embedded cluster `vps` runs when
//! no database URL is configured, and fresh throw-away databases for tests.
//!
//! Modules: `connect` (pools with the session settings every connection needs), `copy`
//! (rows written with a binary `COPY`), `embedded`
//! (initdb + pg_ctl from the binaries on the machine, as a non-root user), `testing` (one
//! database per test on a shared server; the `testing` feature, for tests and benches only). This crate knows nothing of events or the schema:
//! a fresh test pool is migrated with the migrator its caller hands in.

pub mod connect;
pub mod copy;
pub mod embedded;
#[cfg(feature = "testing")]
pub mod testing;

pub use embedded::{EmbeddedCluster, EmbeddedError, EmbeddedOptions};
