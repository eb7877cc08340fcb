//! The edges of vps: the axum HTTP API, configuration, and the `vps` binary's commands.
//!
//! This is the only crate that knows HTTP or the command line; nothing imports it.
