//! The API's HTTP/1.1 accept loop. It is axum's `serve` with one addition: a connection that
//! sends no request head for [`IDLE_CONNECTION`] is closed. axum's `serve` starts no timer, so
//! an idle keep-alive connection (a host's spare, a client that stalls mid-head) would hold
//! its task and buffers on the server for as long as the peer keeps it open. Connections
//! may be upgraded (a preview URL's WebSocket), so the graceful stop is kept here: hyper-util's
//! `GracefulShutdown` watches no upgradeable HTTP/1 connection.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// How long a connection may wait for its next request head: longer than any client's pause
/// between calls that keep it busy (a host reports every second or so), short enough that
/// spares do not pile up. Also bounds a slow client's time to send one head.
pub const IDLE_CONNECTION: Duration = Duration::from_secs(60);

/// How long a stop waits for requests in flight (a held `nodes.spec` poll answers within 30 s).
const DRAIN: Duration = Duration::from_secs(35);

/// Serves `router` on `listener` until `shutdown` resolves, then lets the requests in flight
/// finish (up to [`DRAIN`]). Connections waiting `idle` for a request head are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    idle: Duration,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(idle);
    // Every connection holds a receiver: a stop is sent on it, and the drain ends when the
    // last one is dropped.
    let (stop, stopping) = watch::channel(false);
    let open = metrics::gauge!("vps_http_connections_open");
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, mostly: wait rather than spin.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // The router takes hyper's body as it is (any body of `Bytes`).
        let service = TowerToHyperService::new(router.clone());
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades();
        let open = open.clone();
        let mut stopping = stopping.clone();
        open.increment(1.0);
        tokio::spawn(async move {
            tokio::pin!(connection);
            let ended = tokio::select! {
                ended = connection.as_mut() => ended,
                _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = ended {
                // A timed-out head, a peer gone mid-request: the peer's business.
                tracing::trace!(error = %e, "connection ended");
            }
            open.decrement(1.0);
            drop(stopping);
        });
    }
    drop(listener);
    drop(stopping);
    let _ = stop.send(true);
    if tokio::time::timeout(DRAIN, stop.closed()).await.is_err() {
        tracing::warn!("requests still in flight at the end of the drain; dropping them");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    const IDLE: Duration = Duration::from_millis(300);

    /// Serves a router answering `GET /` with `ok`, closing connections idle for [`IDLE`].
    async fn start() -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", get(|| async { "ok" }));
        tokio::spawn(serve(listener, router, IDLE, std::future::pending()));
        addr
    }

    /// Sends one keep-alive request and reads its whole answer.
    async fn request(stream: &mut TcpStream) -> String {
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: vps\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !answer.ends_with(b"ok") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "the connection closed before the answer");
            answer.extend_from_slice(&buf[..n]);
        }
        String::from_utf8(answer).unwrap()
    }

    /// Waits for the server to close the connection; answers how long that took.
    async fn closed(stream: &mut TcpStream) -> Duration {
        let started = Instant::now();
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf)).await;
        // A reset counts as closed too.
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "the server kept the connection: {read:?}"
        );
        started.elapsed()
    }

    #[tokio::test]
    async fn a_connection_idle_after_its_answer_is_closed_once_the_idle_time_passes() {
        let mut stream = TcpStream::connect(start().await).await.unwrap();
        assert!(request(&mut stream).await.starts_with("HTTP/1.1 200"));
        let waited = closed(&mut stream).await;
        assert!(
            waited >= IDLE / 2,
            "closed after {waited:?}, before the idle time"
        );
    }

    #[tokio::test]
    async fn a_connection_that_never_sends_a_request_is_closed() {
        let mut stream = TcpStream::connect(start().await).await.unwrap();
        closed(&mut stream).await;
    }

    #[tokio::test]
    async fn a_connection_in_use_more_often_than_the_idle_time_stays_open() {
        let mut stream = TcpStream::connect(start().await).await.unwrap();
        // Five requests 150 ms apart span 600 ms, twice the idle time, on one connection.
        for _ in 0..5 {
            assert!(request(&mut stream).await.starts_with("HTTP/1.1 200"));
            tokio::time::sleep(IDLE / 2).await;
        }
    }
}
