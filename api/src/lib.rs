//! The server of vps: the axum HTTP API, configuration, the method registry, the console,
//! doctor, the operator tools that read the database, and the embedded database they open.
//!
//! Modules: `config` (vps.toml + environment), `database` (URL or embedded cluster),
//! `request` (the caller, the parsed body), `registry` (what a method is), `authz` (Cedar decisions, the policies in force), `methods` (one
//! module per group, and the registry of them all), `rpc` (dispatch), `openapi` (the document generated from the registry),
//! `state`, `wait`, `guards` (bounds on open streams and long-polls), `server` (router,
//! background parts), `http` (the accept loop, which closes idle connections), `supervisor` (restarts failed or panicked parts), `health`, `doctor` (operator self-checks), `telemetry`, `tools` (events, history, audit,
//! replay, usage), `console` (the web console's embedded page), `preview` (preview URLs' tokens
//! and the proxy to a guest's port).
//!
//! The client (`vps-cli`), the developer tools (`vps-devtools`) and the binary (`vps`) sit
//! above it; it ships no emulator and no test helper.

pub mod authz;
pub mod config;
pub mod console;
pub mod database;
pub mod doctor;
pub mod error;
pub mod guards;
pub mod health;
pub mod http;
pub mod methods;
pub mod openapi;
pub mod preview;
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
