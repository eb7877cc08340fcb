//! `PUT`/`GET /snapshots/<key>?exp=…&sig=…`: the `file` snapshot store's objects, served by
//! vps itself. Hosts reach them only through URLs the server signed (upload URLs in a node's
//! spec commands, download URLs in a restore's `restoreFrom`); a bad or expired signature is
//! 403. An upload is a plain `PUT` with exactly the presigned headers (SPEC §3.11): the store
//! hashes the body as it arrives and keeps the digest for settlement to compare with the
//! host's report. An uploader that declares its SHA-256 in `X-Content-SHA256` has it checked
//! first: a body that does not match is refused (400) and stored nowhere.

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde::Deserialize;
use serde_json::json;
use vps_domain::ErrorCode;
use vps_store::{SnapshotStore, WriteError, SHA256_HEADER};

use crate::error::ApiError;
use crate::state::AppState;

/// The signature a URL carries.
#[derive(Deserialize)]
pub struct Signed {
    exp: i64,
    sig: String,
}

/// The `file` store, when the URL's signature for `method` holds.
fn store<'a>(
    state: &'a AppState,
    method: &str,
    key: &str,
    signed: &Result<Query<Signed>, QueryRejection>,
) -> Result<&'a vps_store::FileStore, ApiError> {
    let SnapshotStore::File(store) = &state.snapshots else {
        let message = "this deployment keeps snapshots in S3";
        return Err(ApiError::new(ErrorCode::NotFound, message));
    };
    match signed {
        Ok(Query(s)) if store.verify(method, key, s.exp, &s.sig) => Ok(store),
        _ => {
            let message = "the URL's signature is missing, wrong or expired";
            Err(ApiError::new(ErrorCode::AccessDenied, message))
        }
    }
}

/// `PUT /snapshots/<key>`: stores an upload (whose digest matches the declared one, if any).
pub async fn put(
    State(state): State<AppState>,
    Path(key): Path<String>,
    signed: Result<Query<Signed>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let store = store(&state, "PUT", &key, &signed)?;
    let declared = headers.get(SHA256_HEADER).and_then(|v| v.to_str().ok());
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    match store.write(&key, declared, Box::pin(stream)).await {
        Ok(written) => {
            metrics::counter!("vps_snapshot_store_bytes_in_total").increment(written.size_bytes);
            let body = json!({ "sizeBytes": written.size_bytes, "sha256": written.sha256 });
            Ok((StatusCode::OK, axum::Json(body)).into_response())
        }
        Err(e @ (WriteError::Malformed | WriteError::Mismatch { .. })) => {
            Err(ApiError::new(ErrorCode::InvalidInput, e.to_string()))
        }
        Err(WriteError::Store(e)) => {
            tracing::warn!(%key, error = %e, "snapshot upload failed");
            let message = "the upload could not be stored";
            Err(ApiError::new(ErrorCode::Internal, message))
        }
    }
}

/// `GET /snapshots/<key>`: streams a stored object.
pub async fn get(
    State(state): State<AppState>,
    Path(key): Path<String>,
    signed: Result<Query<Signed>, QueryRejection>,
) -> Result<Response, ApiError> {
    let store = store(&state, "GET", &key, &signed)?;
    let path = store
        .path(&key)
        .map_err(|e| ApiError::new(ErrorCode::InvalidInput, e.to_string()))?;
    let Ok(file) = tokio::fs::File::open(path).await else {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no object {key}"),
        ));
    };
    let length = file.metadata().await.map(|m| m.len()).unwrap_or(0);
    let stream = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024);
    let headers = [
        ("content-type", "application/octet-stream".to_string()),
        ("content-length", length.to_string()),
    ];
    Ok((headers, Body::from_stream(stream)).into_response())
}
