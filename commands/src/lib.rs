//! Command handlers: load an aggregate by folding its stream, decide with `vps_domain`, then
//! append the events and apply the inline projections in one PostgreSQL transaction.
//!
//! Handlers never call a host or a cloud API and never write a projection table directly: the
//! inline projectors of `vps_projections` do that, inside the handler's transaction.
