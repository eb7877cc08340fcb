//! The `vps` binary.

// glibc's allocator took about a third of the server's CPU in `bench converge` (malloc, free
// and consolidation under many threads' short-lived JSON buffers); mimalloc is made for that.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
