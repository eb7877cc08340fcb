//! The `vps` binary's command tree ([`cli`]): it assembles the server (`vps_api`), the client
//! (`vps_cli`), the host agent (`vps_host`) and the developer tools (`vps_devtools`).

pub mod cli;
