//! The snapshot store (SPEC §6 `[snapshots]`): hosts upload snapshots to it and restoring
//! hosts download them, each through a short-lived presigned URL, so no snapshot byte passes
//! through a command. Two backends:
//!
//! - [`FileStore`] (the default): objects under the data directory, served by vps itself at
//!   `PUT`/`GET /snapshots/<key>?exp=…&sig=…` with an HMAC signature.
//! - [`S3Store`]: an S3 bucket, with URLs presigned by `object_store`.
//!
//! Object keys are `<tenant>/<snapshot id>`: letters, digits, `_`, `-` and `.` segments.

mod file;
mod s3;

use std::collections::BTreeMap;
use std::time::Duration;

pub use file::{FileStore, WriteError, Written, SHA256_HEADER};
pub use s3::{S3Config, S3Store};

/// A presigned request: where to send it, and the headers to send with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presigned {
    /// The URL, signature included.
    pub url: String,
    /// Headers the request must carry.
    pub headers: BTreeMap<String, String>,
}

/// What the store knows of an object's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// The SHA-256 (hex) of the stored bytes, computed by the store.
    Sha256(String),
    /// No such object.
    Absent,
    /// The backend keeps no digest it computed itself.
    Unchecked,
}

/// The store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A key that is not `<segment>/<segment>…` of safe characters.
    #[error("invalid object key {0:?}")]
    InvalidKey(String),
    /// The filesystem failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The S3 API failed.
    #[error(transparent)]
    S3(#[from] object_store::Error),
}

/// Where snapshots are kept.
#[derive(Debug, Clone)]
pub enum SnapshotStore {
    /// Under a local directory, served by vps.
    File(FileStore),
    /// In an S3 bucket.
    S3(S3Store),
}

impl SnapshotStore {
    /// The backend's name, as configured (`file` or `s3`).
    pub fn kind(&self) -> &'static str {
        match self {
            SnapshotStore::File(_) => "file",
            SnapshotStore::S3(_) => "s3",
        }
    }

    /// A URL a host may `PUT` the object `key` to for `ttl`, with the headers to send.
    pub async fn upload(&self, key: &str, ttl: Duration) -> Result<Presigned, StoreError> {
        check_key(key)?;
        match self {
            SnapshotStore::File(f) => Ok(f.presign("PUT", key, ttl)),
            SnapshotStore::S3(s) => s.presign(http::Method::PUT, key, ttl).await,
        }
    }

    /// A URL a host may `GET` the object `key` from for `ttl`. Never shown to tenants.
    pub async fn download(&self, key: &str, ttl: Duration) -> Result<String, StoreError> {
        check_key(key)?;
        match self {
            SnapshotStore::File(f) => Ok(f.presign("GET", key, ttl).url),
            SnapshotStore::S3(s) => Ok(s.presign(http::Method::GET, key, ttl).await?.url),
        }
    }

    /// Removes the object `key` (one already gone is fine).
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        check_key(key)?;
        match self {
            SnapshotStore::File(f) => f.delete(key).await,
            SnapshotStore::S3(s) => s.delete(key).await,
        }
    }

    /// The SHA-256 the store itself computed for the object `key`: `Stored::Sha256` from the
    /// `file` store (which hashes every upload as it arrives), `Stored::Absent` when it holds
    /// no such object. S3 answers `Stored::Unchecked`: a presigned PUT there carries no
    /// SHA-256 the bucket would record, so settlement trusts the host's digest, and a
    /// restoring host checks the bytes against it before use.
    pub async fn stored_sha256(&self, key: &str) -> Result<Stored, StoreError> {
        check_key(key)?;
        match self {
            SnapshotStore::File(f) => Ok(match f.sha256(key).await? {
                Some(digest) => Stored::Sha256(digest),
                None => Stored::Absent,
            }),
            SnapshotStore::S3(_) => Ok(Stored::Unchecked),
        }
    }

    /// Whether the object `key` exists.
    pub async fn exists(&self, key: &str) -> Result<bool, StoreError> {
        check_key(key)?;
        match self {
            SnapshotStore::File(f) => f.exists(key).await,
            SnapshotStore::S3(s) => s.exists(key).await,
        }
    }
}

/// Refuses a key that could leave the store's namespace: every `/`-separated segment is
/// 1 to 128 of `A-Z a-z 0-9 _ - .`, and not `.` or `..`.
pub fn check_key(key: &str) -> Result<(), StoreError> {
    let ok = !key.is_empty()
        && key.len() <= 512
        && key.split('/').all(|seg| {
            !seg.is_empty()
                && seg.len() <= 128
                && seg != "."
                && seg != ".."
                && seg
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        });
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidKey(key.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_stay_inside_the_store() {
        assert!(check_key("acme/snap_01").is_ok());
        for bad in [
            "", "/a", "a/", "a//b", "../x", "a/../b", "a/./b", "a b", "a\\b", "a%2f",
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }
}
