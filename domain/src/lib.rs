//! The vps domain: ids, the instance state table, aggregates (`decide`/`evolve`), placement,
//! IPAM and quota math, and the error facts they return.
//!
//! This crate is pure. It never does I/O, never reads a clock and never draws random numbers:
//! `now` and fresh ids come in as arguments. Everything that touches the world lives in the
//! crates above it.
