//! The client side of `vps`: the per-group commands generated from the server's method
//! registry (`client`), exec and cp over the tunnel, `vps mcp` (tools for agents) and the
//! operator tools that only print (`tools`). It reaches the server over HTTP alone; from
//! `vps_api` it reads the registry and the request types, never the database or a handler.

pub mod client;
pub mod mcp;
pub mod tools;
