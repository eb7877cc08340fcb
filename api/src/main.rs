//! The `vps` binary.

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
