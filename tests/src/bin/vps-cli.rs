//! The `vps` command line, built under another name for this crate's tests: Cargo builds a
//! package's own binaries before its integration tests (and names them in `CARGO_BIN_EXE_*`),
//! so a test can run the real CLI (e.g. `vps tunnel` as OpenSSH's ProxyCommand) as users do.

use clap::Parser;

#[tokio::main]
async fn main() {
    let cli = vps::cli::Cli::parse();
    match vps::cli::run(cli).await {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
