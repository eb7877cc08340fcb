//! `PUT`/`GET /snapshots/<key>?exp=…&sig=…`: the `file` snapshot store's objects, served by
//! vps itself. Hosts reach them only through URLs the server signed (upload URLs in a node's
//! spec commands, download URLs in a restore's `restoreFrom`); a bad or expired signature is
//! 403. An upload declares its SHA-256 in `X-Content-SHA256`, and a body that does not match
//! it is refused (400) and stored nowhere.

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde::Deserialize;
use serde_json::json;
use vps_store::{SnapshotStore, WriteError, SHA256_HEADER};

use crate::state::AppState;

/// The signature a URL carries.
#[derive(Deserialize)]
pub struct Signed {
    exp: i64,
    sig: String,
}

fn refuse(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = json!({ "code": code, "message": message.into(), "details": {} });
    (status, axum::Json(body)).into_response()
}

/// The `file` store, when the URL's signature for `method` holds.
fn store<'a>(
    state: &'a AppState,
    method: &str,
    key: &str,
    signed: &Result<Query<Signed>, QueryRejection>,
) -> Result<&'a vps_store::FileStore, (StatusCode, &'static str, &'static str)> {
    let SnapshotStore::File(store) = &state.snapshots else {
        return Err((
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            "this deployment keeps snapshots in S3",
        ));
    };
    match signed {
        Ok(Query(s)) if store.verify(method, key, s.exp, &s.sig) => Ok(store),
        _ => Err((
            StatusCode::FORBIDDEN,
            "ACCESS_DENIED",
            "the URL's signature is missing, wrong or expired",
        )),
    }
}

/// `PUT /snapshots/<key>`: stores an upload whose digest matches the declared one.
pub async fn put(
    State(state): State<AppState>,
    Path(key): Path<String>,
    signed: Result<Query<Signed>, QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let store = match store(&state, "PUT", &key, &signed) {
        Ok(store) => store,
        Err((status, code, message)) => return refuse(status, code, message),
    };
    let declared = headers.get(SHA256_HEADER).and_then(|v| v.to_str().ok());
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    match store.write(&key, declared, Box::pin(stream)).await {
        Ok(size) => {
            metrics::counter!("vps_snapshot_store_bytes_in_total").increment(size);
            (StatusCode::OK, axum::Json(json!({ "sizeBytes": size }))).into_response()
        }
        Err(e @ (WriteError::Undeclared | WriteError::Mismatch { .. })) => {
            refuse(StatusCode::BAD_REQUEST, "INVALID_INPUT", e.to_string())
        }
        Err(WriteError::Store(e)) => {
            tracing::warn!(%key, error = %e, "snapshot upload failed");
            refuse(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL",
                "the upload could not be stored",
            )
        }
    }
}

/// `GET /snapshots/<key>`: streams a stored object.
pub async fn get(
    State(state): State<AppState>,
    Path(key): Path<String>,
    signed: Result<Query<Signed>, QueryRejection>,
) -> Response {
    let store = match store(&state, "GET", &key, &signed) {
        Ok(store) => store,
        Err((status, code, message)) => return refuse(status, code, message),
    };
    let file = match store.path(&key) {
        Ok(path) => tokio::fs::File::open(path).await,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, "INVALID_INPUT", e.to_string()),
    };
    match file {
        Ok(file) => {
            let length = file.metadata().await.map(|m| m.len()).unwrap_or(0);
            let stream = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024);
            (
                [
                    ("content-type", "application/octet-stream".to_string()),
                    ("content-length", length.to_string()),
                ],
                Body::from_stream(stream),
            )
                .into_response()
        }
        Err(_) => refuse(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no object {key}"),
        ),
    }
}
