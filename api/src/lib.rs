//! The edges of vps: the axum HTTP API, configuration, the `vps` binary's commands (serve,
//! dev, events, audit, bench) and the embedded database they open.
//!
//! Modules: `config` (vps.toml + environment), `database` (URL or embedded cluster),
//! `request` (the caller, the parsed body), `registry` (what a method is), `authz` (Cedar decisions, the policies in force), `methods` (one
//! module per group, and the registry of them all), `rpc` (dispatch), `openapi` (the document generated from the registry),
//! `state`, `wait`, `guards` (bounds on open streams and long-polls), `server` (router,
//! background parts), `http` (the accept loop, which closes idle connections), `supervisor` (restarts failed or panicked parts), `health`, `doctor` (operator self-checks), `telemetry`, `tools` (events, audit),
//! `bench`, `dev`, `cli`, `client` (the per-group CLI), `mcp` (`vps mcp`, tools for agents),
//! `console` (the web console's embedded page).
//!
//! This is the only crate that knows HTTP or the command line; nothing imports it.

pub mod authz;
pub mod bench;
pub mod cli;
pub mod client;
pub mod config;
pub mod console;
pub mod database;
pub mod dev;
pub mod doctor;
pub mod error;
pub mod guards;
pub mod health;
pub mod http;
pub mod mcp;
pub mod methods;
pub mod openapi;
pub mod registry;
pub mod request;
pub mod rpc;
pub mod server;
pub mod snapshot_objects;
pub mod state;
pub mod supervisor;
pub mod telemetry;
pub mod tools;
pub mod wait;
