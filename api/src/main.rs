//! The `vps` binary.

#[tokio::main]
async fn main() {
    let matches = vps::cli::command().get_matches();
    match vps::cli::run_matches(matches).await {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
