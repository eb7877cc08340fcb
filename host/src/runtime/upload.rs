//! The snapshot upload (SPEC §3.11): a plain HTTP `PUT` of the archive to the command's
//! `uploadUrl` with exactly its `uploadHeaders`. An S3 presigned PUT is one such upload, the
//! built-in file store's another; neither needs a header of ours. The archive is made as it
//! is sent ([`archive`]): one pass over the snapshot's files, hashed on the way, and nothing
//! written twice on the host.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use tokio::sync::mpsc;

use super::{archive, RuntimeError, SnapshotFiles};

/// How long one upload may take, whatever its size (a stalled store must not hold the
/// command for ever).
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The body's pieces: large, so a 100 MiB archive is a hundred sends, not thousands.
const CHUNK: usize = 1 << 20;

/// `PUT`s the archive of `files` to `url` with `headers` and nothing else of ours (reqwest
/// adds `content-length`, `host` and `accept: */*`), and answers its hex SHA-256. Any
/// answer but 2xx is an error naming the status, which becomes the command's failure reason.
pub async fn upload(
    files: &SnapshotFiles,
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Result<String, RuntimeError> {
    let parsed =
        url::Url::parse(url).map_err(|e| RuntimeError(format!("upload URL is invalid: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(RuntimeError(format!(
            "upload URL scheme {:?} is not http or https",
            parsed.scheme()
        )));
    }
    let length = archive::len(files)?;
    let (tx, rx) = mpsc::channel(4);
    let owned = files.clone();
    let maker = tokio::task::spawn_blocking(move || {
        let mut sender = ChunkSender {
            tx,
            buf: Vec::with_capacity(CHUNK),
        };
        let made = archive::write(&owned, &mut sender);
        if let Err(error) = &made {
            // The request must not end as if the archive were whole.
            let _ = sender
                .tx
                .blocking_send(Err(std::io::Error::other(error.0.clone())));
        }
        (made, sender.tx.is_closed())
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    let mut request = reqwest::Client::new()
        .put(parsed)
        .timeout(UPLOAD_TIMEOUT)
        .header(reqwest::header::CONTENT_LENGTH, length)
        .body(reqwest::Body::wrap_stream(body));
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let sent = request.send().await;
    let (made, hung_up) = maker
        .await
        .map_err(|e| RuntimeError(format!("making the snapshot archive: {e}")))?;
    // A store that hung up or answered early made the archive's sends fail: the store's side
    // is the news. An archive that could not be made ended the request: that is the news.
    let response = match (sent, made) {
        (Err(_), Err(error)) if !hung_up => return Err(error),
        (Err(error), _) => return Err(RuntimeError(format!("upload failed: {error}"))),
        (Ok(response), _) if !response.status().is_success() => response,
        (Ok(_), Err(error)) => return Err(error),
        (Ok(_), Ok((sha256, _))) => return Ok(sha256),
    };
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    let body: String = body.chars().take(200).collect();
    Err(RuntimeError(format!(
        "upload refused ({}): {}",
        status.as_u16(),
        body.trim()
    )))
}

/// Cuts what is written into [`CHUNK`]-sized pieces of the request body.
struct ChunkSender {
    tx: mpsc::Sender<std::io::Result<Vec<u8>>>,
    buf: Vec<u8>,
}

impl ChunkSender {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "upload ended"))
    }
}

impl Write for ChunkSender {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A store that reads the request and answers `status` with a short reason.
    async fn store_answering(status: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/snapshots/acme/snap_1",
            listener.local_addr().unwrap()
        );
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buffer = vec![0; 64 * 1024];
            let _ = stream.read(&mut buffer).await;
            let body = "the bucket refuses";
            let answer = format!(
                "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(answer.as_bytes()).await;
        });
        url
    }

    /// A store that keeps the whole body it is sent and answers 200: the body, once read.
    async fn store_keeping() -> (String, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!(
            "http://{}/snapshots/acme/snap_2",
            listener.local_addr().unwrap()
        );
        let kept = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buffer = vec![0; 1 << 16];
            let head_end = loop {
                let n = stream.read(&mut buffer).await.unwrap();
                request.extend_from_slice(&buffer[..n]);
                if let Some(i) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&request[..head_end]).to_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .and_then(|v| v.trim().parse().ok())
                .expect("a content-length");
            let mut body = request[head_end..].to_vec();
            while body.len() < length {
                let n = stream.read(&mut buffer).await.unwrap();
                assert!(n > 0, "the body ended early");
                body.extend_from_slice(&buffer[..n]);
            }
            let answer = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
            stream.write_all(answer.as_bytes()).await.unwrap();
            body
        });
        (url, kept)
    }

    #[tokio::test]
    async fn an_upload_sends_the_archive_as_long_as_announced_and_answers_its_digest() {
        let dir = std::env::temp_dir().join(format!("vps-upload-ok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // More than one chunk, and not a whole number of blocks.
        std::fs::write(dir.join("memory.state"), vec![3u8; CHUNK * 2 + 1000]).unwrap();
        std::fs::write(dir.join("manifest.json"), b"{}").unwrap();
        let files = SnapshotFiles {
            dir: dir.clone(),
            names: vec!["manifest.json".into(), "memory.state".into()],
            size_bytes: 0,
            include_memory: true,
            cpu_model: None,
            paused_ms: 0,
            qemu_save_ms: None,
        };
        let (url, kept) = store_keeping().await;
        let sha256 = upload(&files, &url, &BTreeMap::new())
            .await
            .expect("upload");
        let body = kept.await.unwrap();
        assert_eq!(body.len() as u64, archive::len(&files).unwrap());
        let mut local = Vec::new();
        let (expected, _) = archive::write(&files, &mut local).unwrap();
        assert_eq!(body, local);
        assert_eq!(sha256, expected);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_store_that_refuses_the_upload_is_a_failure_naming_its_status_and_reason() {
        let dir = std::env::temp_dir().join(format!("vps-upload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.state"), b"snapshot bytes").unwrap();
        let files = SnapshotFiles {
            dir: dir.clone(),
            names: vec!["memory.state".into()],
            size_bytes: 0,
            include_memory: true,
            cpu_model: None,
            paused_ms: 0,
            qemu_save_ms: None,
        };
        let url = store_answering("403 Forbidden").await;
        let error = upload(&files, &url, &BTreeMap::new())
            .await
            .expect_err("a refused upload is an error");
        assert!(
            error.0.contains("403") && error.0.contains("the bucket refuses"),
            "{error}"
        );
        // A port nothing listens on: the connection itself is refused.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gone = format!("http://{}/x", closed.local_addr().unwrap());
        drop(closed);
        let error = upload(&files, &gone, &BTreeMap::new())
            .await
            .expect_err("no store");
        assert!(error.0.starts_with("upload failed"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
