//! Operator tools that read the database directly: `vps events`, `vps audit`.

pub mod audit;
pub mod call;
pub mod events;
pub mod history;
pub mod replay;
pub mod tunnel;
pub mod usage;
