//! Handlers per API group.

pub mod instances;
pub mod operator;
