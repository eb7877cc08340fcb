//! The `vps` command line, built under another name for this crate's tests: Cargo builds a
//! package's own binaries before its integration tests (and names them in `CARGO_BIN_EXE_*`),
//! so a test can run the real CLI (e.g. `vps tunnel` as OpenSSH's ProxyCommand) as users do.

#[tokio::main]
async fn main() {
    vps::cli::run_process().await
}
