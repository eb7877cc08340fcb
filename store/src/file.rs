//! The `file` backend: objects under a directory, served by vps at URLs that carry their
//! expiry and an HMAC-SHA256 over (method, key, expiry).
//!
//! An upload is a plain `PUT` (SPEC §3.11: a host sends exactly the presigned headers, which
//! name no digest). The store hashes the body as it arrives and keeps that SHA-256 beside the
//! object (`<name>@sha256`, a name no key can take), so settlement can compare it with the
//! digest the host reports. An uploader that does declare one in [`SHA256_HEADER`] has it
//! checked before anything is stored: a body that does not match is refused and left nowhere.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{check_key, Presigned, StoreError};

/// The header an upload declares its body's SHA-256 (hex) in.
pub const SHA256_HEADER: &str = "x-content-sha256";

/// Objects under a directory, at signed URLs of this server.
#[derive(Clone)]
pub struct FileStore {
    root: PathBuf,
    public_url: String,
    key: Arc<[u8; 32]>,
    /// When signed URLs expire is judged on the server's clock (a test moves it).
    clock: vps_clock::Clock,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("root", &self.root)
            .field("public_url", &self.public_url)
            .finish_non_exhaustive()
    }
}

/// Why an upload was refused.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A SHA-256 was declared, but not as 64 hex digits.
    #[error("the {SHA256_HEADER} header must be 64 hex digits")]
    Malformed,
    /// The body's digest is not the declared one.
    #[error("the body's SHA-256 is {actual}, not the declared {declared}")]
    Mismatch {
        /// What the uploader declared.
        declared: String,
        /// What the body hashed to.
        actual: String,
    },
    /// The body could not be read, or the file written.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl FileStore {
    /// A store under `root`, whose URLs start with `public_url` (this server, as hosts reach
    /// it). The signing key derives from `secret` (the deployment's secrets key), so every
    /// replica signs and checks alike. `clock` says when a URL has expired.
    pub fn new(
        root: impl Into<PathBuf>,
        public_url: &str,
        secret: &[u8],
        clock: vps_clock::Clock,
    ) -> Self {
        let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
        mac.update(b"vps snapshot store urls v1");
        Self {
            root: root.into(),
            public_url: public_url.trim_end_matches('/').to_string(),
            key: Arc::new(mac.finalize().into_bytes().into()),
            clock,
        }
    }

    fn signature(&self, method: &str, key: &str, exp: i64) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(self.key.as_slice()).expect("any length");
        mac.update(format!("{method}\n{key}\n{exp}").as_bytes());
        data_encoding::HEXLOWER.encode(&mac.finalize().into_bytes())
    }

    pub(crate) fn presign(&self, method: &str, key: &str, ttl: Duration) -> Presigned {
        let exp = self.clock.now().timestamp() + ttl.as_secs().max(1) as i64;
        Presigned {
            url: format!(
                "{}/snapshots/{key}?exp={exp}&sig={}",
                self.public_url,
                self.signature(method, key, exp)
            ),
            headers: Default::default(),
        }
    }

    /// Whether `sig` signs (`method`, `key`, `exp`) and `exp` has not passed. Constant time in
    /// the signature.
    pub fn verify(&self, method: &str, key: &str, exp: i64, sig: &str) -> bool {
        if check_key(key).is_err() || exp < self.clock.now().timestamp() {
            return false;
        }
        let expected = self.signature(method, key, exp);
        expected.as_bytes().ct_eq(sig.as_bytes()).into()
    }

    /// The object's path (the key is checked first).
    pub fn path(&self, key: &str) -> Result<PathBuf, StoreError> {
        check_key(key)?;
        Ok(self.root.join(key))
    }

    /// Stores `body` as `key`, with the SHA-256 it hashed to beside it: written beside its
    /// final place and renamed there, so a reader never sees half an object. A `declared`
    /// digest, when given, must match or nothing is stored. Answers the size and the digest.
    pub async fn write<S, E>(
        &self,
        key: &str,
        declared: Option<&str>,
        body: S,
    ) -> Result<Written, WriteError>
    where
        S: Stream<Item = Result<Bytes, E>> + Unpin,
        E: std::error::Error + Send + Sync + 'static,
    {
        let declared = match declared.map(str::to_ascii_lowercase) {
            Some(d) if d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()) => Some(d),
            Some(_) => return Err(WriteError::Malformed),
            None => None,
        };
        let path = self.path(key)?;
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(StoreError::from)?;
        }
        let partial = path.with_extension(format!("partial-{:016x}", rand_suffix()));
        let result = write_hashed(&partial, body).await;
        let (size, actual) = match result {
            Ok(done) => done,
            Err(e) => {
                let _ = tokio::fs::remove_file(&partial).await;
                return Err(e.into());
            }
        };
        if let Some(declared) = declared.filter(|d| *d != actual) {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(WriteError::Mismatch { declared, actual });
        }
        tokio::fs::rename(&partial, &path)
            .await
            .map_err(StoreError::from)?;
        // Written after the object: a digest never names bytes older than it (see `sha256`).
        write_digest(&path, &actual).await?;
        Ok(Written {
            size_bytes: size,
            sha256: actual,
        })
    }

    /// The SHA-256 of the stored object `key`, as the store computed it when the bytes
    /// arrived; `None` when there is no such object. An object older than its digest file
    /// (one stored before digests were kept, or whose digest write was cut short) is hashed
    /// now and its digest kept.
    pub async fn sha256(&self, key: &str) -> Result<Option<String>, StoreError> {
        let path = self.path(key)?;
        let object = match tokio::fs::metadata(&path).await {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let sidecar = digest_path(&path);
        if let Ok(meta) = tokio::fs::metadata(&sidecar).await {
            let fresh = match (meta.modified(), object.modified()) {
                (Ok(digest), Ok(bytes)) => digest >= bytes,
                _ => false,
            };
            let kept = tokio::fs::read_to_string(&sidecar)
                .await
                .unwrap_or_default();
            let kept = kept.trim();
            if fresh && kept.len() == 64 && kept.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Ok(Some(kept.to_string()));
            }
        }
        let actual = hash_file(&path).await?;
        write_digest(&path, &actual).await?;
        Ok(Some(actual))
    }

    pub(crate) async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path(key)?;
        for file in [digest_path(&path), path] {
            match tokio::fs::remove_file(file).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            }
        }
        Ok(())
    }

    pub(crate) async fn exists(&self, key: &str) -> Result<bool, StoreError> {
        Ok(tokio::fs::try_exists(self.path(key)?).await?)
    }
}

/// What an upload stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The body's length.
    pub size_bytes: u64,
    /// The body's SHA-256 (hex), computed as it arrived.
    pub sha256: String,
}

/// Where the digest of the object at `path` is kept: `<name>@sha256`. `@` is in no key, so
/// no object can be stored, read or deleted under that name.
fn digest_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push("@sha256");
    path.with_file_name(name)
}

async fn write_digest(path: &Path, sha256: &str) -> Result<(), StoreError> {
    let sidecar = digest_path(path);
    let partial = sidecar.with_extension(format!("partial-{:016x}", rand_suffix()));
    tokio::fs::write(&partial, format!("{sha256}\n")).await?;
    if let Err(e) = tokio::fs::rename(&partial, &sidecar).await {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(e.into());
    }
    Ok(())
}

async fn hash_file(path: &Path) -> Result<String, StoreError> {
    use tokio::io::AsyncReadExt;
    let mut file = tokio::fs::File::open(path).await?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        let n = file.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(data_encoding::HEXLOWER.encode(&hasher.finalize()))
}

/// A suffix that keeps concurrent uploads of one key apart.
fn rand_suffix() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (std::process::id() as u64).rotate_left(32)
}

/// What the writer thread is handed at a time: one `write` per MiB rather than a blocking-pool
/// task per network chunk (tokio's file does one per `write`).
const PIECE: usize = 1 << 20;
/// Pieces on their way to the writer: the body is read, and hashed, while it writes.
const PIECES_IN_FLIGHT: usize = 4;
/// Written bytes between two `fdatasync`s: the disk takes them while the body still arrives, so
/// the final sync waits for the last few only.
const SYNC_EVERY: u64 = 32 << 20;

/// Streams `body` to a new file at `path`, hashed as it arrives, written by a thread of its own
/// and synced to the disk before it answers: the size and the digest.
async fn write_hashed<S, E>(path: &Path, mut body: S) -> Result<(u64, String), StoreError>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    let file = tokio::fs::File::create(path).await?.into_std().await;
    let (pieces, mut to_write) = tokio::sync::mpsc::channel::<Bytes>(PIECES_IN_FLIGHT);
    let writer = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        use std::io::Write;
        let mut file = file;
        let mut unsynced = 0u64;
        while let Some(piece) = to_write.blocking_recv() {
            file.write_all(&piece)?;
            unsynced += piece.len() as u64;
            if unsynced >= SYNC_EVERY {
                file.sync_data()?;
                unsynced = 0;
            }
        }
        file.sync_all()
    });
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    let mut piece = bytes::BytesMut::with_capacity(PIECE);
    let read = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(std::io::Error::other)?;
            hasher.update(&chunk);
            size += chunk.len() as u64;
            piece.extend_from_slice(&chunk);
            if piece.len() >= PIECE && pieces.send(piece.split().freeze()).await.is_err() {
                // The writer stopped: its error is the answer.
                return Ok(());
            }
        }
        if !piece.is_empty() {
            let _ = pieces.send(piece.split().freeze()).await;
        }
        Ok::<(), std::io::Error>(())
    }
    .await;
    drop(pieces);
    let written = writer.await.map_err(std::io::Error::other)?;
    read?;
    written?;
    Ok((size, data_encoding::HEXLOWER.encode(&hasher.finalize())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(data: &'static [u8]) -> impl Stream<Item = Result<Bytes, std::io::Error>> + Unpin {
        futures::stream::iter(vec![Ok(Bytes::from_static(data))])
    }

    #[test]
    fn signatures_bind_method_key_and_expiry() {
        let store = FileStore::new(
            "/tmp/x",
            "http://h:1/",
            b"secret",
            vps_clock::Clock::system(),
        );
        let p = store.presign("PUT", "t/snap_a", Duration::from_secs(60));
        let url = url::Url::parse(&p.url).unwrap();
        assert_eq!(url.path(), "/snapshots/t/snap_a");
        let q: std::collections::HashMap<_, _> = url.query_pairs().into_owned().collect();
        let exp: i64 = q["exp"].parse().unwrap();
        assert!(store.verify("PUT", "t/snap_a", exp, &q["sig"]));
        assert!(!store.verify("GET", "t/snap_a", exp, &q["sig"]));
        assert!(!store.verify("PUT", "t/snap_b", exp, &q["sig"]));
        assert!(!store.verify("PUT", "t/snap_a", exp + 1, &q["sig"]));
        let other = FileStore::new("/tmp/x", "http://h:1", b"other", vps_clock::Clock::system());
        assert!(!other.verify("PUT", "t/snap_a", exp, &q["sig"]));
        let past = vps_clock::Clock::system().now().timestamp() - 1;
        let sig = store.signature("PUT", "t/snap_a", past);
        assert!(!store.verify("PUT", "t/snap_a", past, &sig));
    }

    #[tokio::test]
    async fn a_body_must_match_its_declared_digest() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path(), "http://h", b"k", vps_clock::Clock::system());
        let good = data_encoding::HEXLOWER.encode(&Sha256::digest(b"hello"));
        let written = store
            .write("t/s", Some(&good), body(b"hello"))
            .await
            .unwrap();
        assert_eq!(written.size_bytes, 5);
        assert_eq!(written.sha256, good);
        assert!(store.exists("t/s").await.unwrap());
        let wrong = store.write("t/w", Some(&good), body(b"other")).await;
        assert!(matches!(wrong, Err(WriteError::Mismatch { .. })));
        assert!(!store.exists("t/w").await.unwrap());
        assert!(matches!(
            store.write("t/u", Some("abc"), body(b"x")).await,
            Err(WriteError::Malformed)
        ));
        assert!(!store.exists("t/u").await.unwrap());
        // Nothing half-written is left beside the objects; each has its digest.
        let mut names: Vec<_> = std::fs::read_dir(dir.path().join("t"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, vec!["s".to_string(), "s@sha256".to_string()]);
        store.delete("t/s").await.unwrap();
        store.delete("t/s").await.unwrap();
        assert!(!store.exists("t/s").await.unwrap());
        assert_eq!(store.sha256("t/s").await.unwrap(), None);
        assert!(std::fs::read_dir(dir.path().join("t"))
            .unwrap()
            .next()
            .is_none());
    }

    #[tokio::test]
    async fn a_plain_upload_is_stored_with_the_digest_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path(), "http://h", b"k", vps_clock::Clock::system());
        let written = store.write("t/p", None, body(b"plain")).await.unwrap();
        let digest = data_encoding::HEXLOWER.encode(&Sha256::digest(b"plain"));
        assert_eq!(written.sha256, digest);
        assert_eq!(store.sha256("t/p").await.unwrap(), Some(digest));
        // Bytes changed behind the store's back, after its digest: hashed again.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(dir.path().join("t/p"), b"tampered").unwrap();
        let tampered = data_encoding::HEXLOWER.encode(&Sha256::digest(b"tampered"));
        assert_eq!(store.sha256("t/p").await.unwrap(), Some(tampered));
        // The digest's name is no key: it can be neither read nor written as an object.
        assert!(store.path("t/p@sha256").is_err());
    }

    #[tokio::test]
    async fn a_body_of_many_chunks_is_stored_whole_across_pieces_and_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let store = FileStore::new(dir.path(), "http://h", b"k", vps_clock::Clock::system());
        // Uneven chunks: pieces end inside chunks, and the body passes one periodic sync.
        let data: Vec<u8> = (0..SYNC_EVERY as usize + 3 * PIECE + 12_345)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let chunks: Vec<Result<Bytes, std::io::Error>> = data
            .chunks(65_521)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let written = store
            .write("t/big", None, futures::stream::iter(chunks))
            .await
            .unwrap();
        assert_eq!(written.size_bytes, data.len() as u64);
        assert_eq!(
            written.sha256,
            data_encoding::HEXLOWER.encode(&Sha256::digest(&data))
        );
        assert!(std::fs::read(dir.path().join("t/big")).unwrap() == data);

        // A body that breaks off stores nothing, whatever was written of it.
        let broken: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from(vec![7u8; 3 * PIECE])),
            Err(std::io::Error::other("the host hung up")),
        ];
        let failed = store
            .write("t/broken", None, futures::stream::iter(broken))
            .await;
        assert!(failed.is_err());
        let left: Vec<_> = std::fs::read_dir(dir.path().join("t"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(
            left.iter().all(|n| n.to_string_lossy().starts_with("big")),
            "{left:?}"
        );
    }
}
