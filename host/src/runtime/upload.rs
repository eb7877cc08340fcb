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
