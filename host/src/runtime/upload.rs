//! The snapshot upload (SPEC §3.11): a plain HTTP `PUT` of the archive to the command's
//! `uploadUrl` with exactly its `uploadHeaders`. An S3 presigned PUT is one such upload, the
//! built-in file store's another; neither needs a header of ours.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use super::RuntimeError;

/// How long one upload may take, whatever its size (a stalled store must not hold the
/// command for ever).
const UPLOAD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// `PUT`s the file at `archive` to `url` with `headers` and nothing else of ours (reqwest
/// adds `content-length`, `host` and `accept: */*`). Any answer but 2xx is an error naming
/// the status, which becomes the command's failure reason.
pub async fn upload(
    archive: &Path,
    url: &str,
    headers: &BTreeMap<String, String>,
) -> Result<(), RuntimeError> {
    let parsed =
        url::Url::parse(url).map_err(|e| RuntimeError(format!("upload URL is invalid: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(RuntimeError(format!(
            "upload URL scheme {:?} is not http or https",
            parsed.scheme()
        )));
    }
    let file = tokio::fs::File::open(archive)
        .await
        .map_err(|e| RuntimeError(format!("snapshot archive {}: {e}", archive.display())))?;
    let length = file
        .metadata()
        .await
        .map_err(|e| RuntimeError(format!("snapshot archive {}: {e}", archive.display())))?
        .len();
    let mut request = reqwest::Client::new()
        .put(parsed)
        .timeout(UPLOAD_TIMEOUT)
        .header(reqwest::header::CONTENT_LENGTH, length)
        .body(reqwest::Body::from(file));
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let response = request
        .send()
        .await
        .map_err(|e| RuntimeError(format!("upload failed: {e}")))?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let body = response.text().await.unwrap_or_default();
    let body: String = body.chars().take(200).collect();
    Err(RuntimeError(format!(
        "upload refused ({}): {}",
        status.as_u16(),
        body.trim()
    )))
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

    #[tokio::test]
    async fn a_store_that_refuses_the_upload_is_a_failure_naming_its_status_and_reason() {
        let dir = std::env::temp_dir().join(format!("vps-upload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let archive = dir.join("archive.tar");
        std::fs::write(&archive, b"snapshot bytes").unwrap();
        let url = store_answering("403 Forbidden").await;
        let error = upload(&archive, &url, &BTreeMap::new())
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
        let error = upload(&archive, &gone, &BTreeMap::new())
            .await
            .expect_err("no store");
        assert!(error.0.starts_with("upload failed"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
