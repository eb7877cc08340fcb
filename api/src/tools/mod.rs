//! Operator tools that read the database directly: `vps events`, `vps history`, `vps audit`,
//! `vps replay`, `vps usage export|verify`.

pub mod audit;
pub mod events;
pub mod history;
pub mod replay;
pub mod usage;
