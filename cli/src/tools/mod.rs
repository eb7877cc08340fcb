//! Commands beside the generated groups: `vps call` and the `vps tunnel` ProxyCommand that
//! exec and cp run.

pub mod call;
pub mod tunnel;
