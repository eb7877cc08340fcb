//! The `vps` binary.

// glibc's allocator took about a third of the server's CPU in `bench converge` (malloc, free
// and consolidation under many threads' short-lived JSON buffers); mimalloc is made for that.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() {
    vps::cli::run_process().await
}
