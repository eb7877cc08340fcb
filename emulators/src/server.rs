//! Running an emulator's axum server on a free local port.

use std::net::SocketAddr;

use axum::Router;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A running server; dropping it stops the server.
pub(crate) struct Running(JoinHandle<()>);

/// Serves `router` on `127.0.0.1` at a port the OS picks.
pub(crate) async fn serve(router: Router) -> (SocketAddr, Running) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("an emulator can bind a local port");
    let address = listener
        .local_addr()
        .expect("a bound listener has an address");
    let task = tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, router).await {
            tracing::warn!(%error, "emulator server stopped");
        }
    });
    (address, Running(task))
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.abort();
    }
}
