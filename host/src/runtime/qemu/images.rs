//! The image cache: each image is downloaded once per digest into `<image_dir>/<sha256>/`,
//! hashed while it streams to a temporary file, and moved into place only when its digest
//! matches. A bundle (an uncompressed tar) is unpacked there once; a qcow2 image is kept as
//! `image.qcow2`. Anything in a digest's directory has therefore been checked.
//!
//! Snapshot archives (restores) are kept the same way under `<image_dir>/snapshots/<sha256>/`,
//! unpacked: each restore of one snapshot layers its disk on the same checked copy.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::runtime::{ImageRef, RestoreSource, RuntimeError};

/// A checked image in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cached {
    /// Direct boot: a kernel, an initrd, and maybe a root disk to layer the guest's on.
    Bundle {
        kernel: PathBuf,
        initrd: PathBuf,
        rootfs: Option<PathBuf>,
    },
    /// A bootable disk image.
    Qcow2 { disk: PathBuf },
}

/// The cache directory and one lock per digest, so two guests of one image fetch it once.
pub struct ImageCache {
    dir: PathBuf,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    http: reqwest::Client,
}

const BUNDLE_FILES: [&str; 3] = ["vmlinuz", "initrd", "rootfs.qcow2"];

/// What a snapshot archive may hold (`snapshots::MANIFEST` and the files it names).
pub const SNAPSHOT_FILES: [&str; 4] = ["manifest.json", "disk.qcow2", "config.img", "memory.state"];

impl ImageCache {
    pub fn new(dir: PathBuf) -> ImageCache {
        ImageCache {
            dir,
            locks: Mutex::default(),
            http: reqwest::Client::new(),
        }
    }

    /// The lock of one cache entry.
    fn lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(key.to_owned()).or_default().clone()
    }

    /// The checked image, downloading and unpacking it first if needed.
    pub async fn get(&self, image: &ImageRef) -> Result<Cached, RuntimeError> {
        let digest = image.sha256.to_ascii_lowercase();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(RuntimeError(format!(
                "image digest {:?} is not a hex SHA-256",
                image.sha256
            )));
        }
        if image.format != "bundle" && image.format != "qcow2" {
            return Err(RuntimeError(format!(
                "image format {:?} is not supported (bundle or qcow2)",
                image.format
            )));
        }
        let lock = self.lock(&digest);
        let _guard = lock.lock().await;
        let dir = self.dir.join(&digest);
        if let Some(cached) = cached(&dir, &image.format) {
            metrics::counter!("vps_host_image_cache_hits_total").increment(1);
            return Ok(cached);
        }
        metrics::counter!("vps_host_image_cache_misses_total").increment(1);
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(|e| RuntimeError(format!("image cache {}: {e}", self.dir.display())))?;

        let staging = self.dir.join(format!(".{digest}.{}", std::process::id()));
        let _ = tokio::fs::remove_dir_all(&staging).await;
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| RuntimeError(format!("image cache {}: {e}", staging.display())))?;
        let span = tracing::info_span!("image.fetch", url = %image.url, sha256 = %digest);
        let result = self
            .fill(image, &digest, &staging, &dir)
            .instrument(span)
            .await;
        let _ = tokio::fs::remove_dir_all(&staging).await;
        result?;
        cached(&dir, &image.format).ok_or_else(|| {
            RuntimeError(format!(
                "image {digest}: the cache entry is incomplete after download"
            ))
        })
    }

    /// The checked, unpacked snapshot archive of `from`, downloading it first if needed.
    pub async fn snapshot(&self, from: &RestoreSource) -> Result<PathBuf, RuntimeError> {
        let digest = from.sha256.to_ascii_lowercase();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(RuntimeError(format!(
                "snapshot {} digest {:?} is not a hex SHA-256",
                from.snapshot_id, from.sha256
            )));
        }
        let lock = self.lock(&format!("snapshot:{digest}"));
        let _guard = lock.lock().await;
        let root = self.dir.join("snapshots");
        let dir = root.join(&digest);
        if snapshot_complete(&dir) {
            return Ok(dir);
        }
        tokio::fs::create_dir_all(&root)
            .await
            .map_err(|e| RuntimeError(format!("snapshot cache {}: {e}", root.display())))?;
        let staging = root.join(format!(".{digest}.{}", std::process::id()));
        let _ = tokio::fs::remove_dir_all(&staging).await;
        tokio::fs::create_dir_all(&staging)
            .await
            .map_err(|e| RuntimeError(format!("snapshot cache {}: {e}", staging.display())))?;
        let span =
            tracing::info_span!("snapshot.fetch", snapshot = %from.snapshot_id, sha256 = %digest);
        let result = async {
            let download = staging.join("download");
            let actual = self.download(&from.url, &download).await?;
            if actual != digest {
                return Err(RuntimeError(format!(
                    "snapshot {} digest mismatch: expected sha256 {digest}, got {actual}",
                    from.snapshot_id
                )));
            }
            let (tar, out) = (download.clone(), staging.clone());
            tokio::task::spawn_blocking(move || unpack_snapshot(&tar, &out))
                .await
                .map_err(|e| RuntimeError(format!("unpacking snapshot: {e}")))??;
            let _ = tokio::fs::remove_file(&download).await;
            tokio::fs::rename(&staging, &dir)
                .await
                .map_err(|e| RuntimeError(format!("snapshot cache {}: {e}", dir.display())))
        }
        .instrument(span)
        .await;
        let _ = tokio::fs::remove_dir_all(&staging).await;
        result?;
        Ok(dir)
    }

    /// Makes the snapshot files in `files` (a snapshot this host took and uploaded, whose
    /// archive is `sha256`) the cache's entry for that digest, by moving them: a restore here
    /// then starts from them with no download. Nothing moves if the entry exists already or
    /// the files are on another file system.
    pub async fn adopt_snapshot(&self, files: &Path, sha256: &str) {
        let digest = sha256.to_ascii_lowercase();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return;
        }
        let lock = self.lock(&format!("snapshot:{digest}"));
        let _guard = lock.lock().await;
        let root = self.dir.join("snapshots");
        let dir = root.join(&digest);
        if snapshot_complete(&dir) || tokio::fs::create_dir_all(&root).await.is_err() {
            return;
        }
        match tokio::fs::rename(files, &dir).await {
            Ok(()) => tracing::debug!(sha256 = %digest, "snapshot kept for restores here"),
            Err(error) => tracing::debug!(%error, "snapshot not kept for restores here"),
        }
    }

    async fn fill(
        &self,
        image: &ImageRef,
        digest: &str,
        staging: &Path,
        dir: &Path,
    ) -> Result<(), RuntimeError> {
        let download = staging.join("download");
        let actual = self.download(&image.url, &download).await?;
        if actual != digest {
            return Err(RuntimeError(format!(
                "image digest mismatch for {}: expected sha256 {digest}, got {actual}",
                image.url
            )));
        }
        if image.format == "bundle" {
            let tar = download.clone();
            let out = staging.to_owned();
            tokio::task::spawn_blocking(move || unpack_bundle(&tar, &out))
                .await
                .map_err(|e| RuntimeError(format!("unpacking bundle: {e}")))??;
            let _ = tokio::fs::remove_file(&download).await;
        } else {
            tokio::fs::rename(&download, staging.join("image.qcow2"))
                .await
                .map_err(|e| RuntimeError(format!("image cache: {e}")))?;
        }
        // The rename is the commit: a digest's directory exists only once complete.
        tokio::fs::rename(staging, dir)
            .await
            .map_err(|e| RuntimeError(format!("image cache {}: {e}", dir.display())))
    }

    /// Streams `url` to `to` and returns the hex SHA-256 of what it wrote.
    async fn download(&self, url: &str, to: &Path) -> Result<String, RuntimeError> {
        let parsed =
            url::Url::parse(url).map_err(|e| RuntimeError(format!("image URL {url:?}: {e}")))?;
        let write_error =
            |e: std::io::Error| RuntimeError(format!("writing {}: {e}", to.display()));
        let mut file = std::fs::File::create(to).map_err(write_error)?;
        let mut hasher = Sha256::new();
        match parsed.scheme() {
            "file" => {
                let path = parsed
                    .to_file_path()
                    .map_err(|()| RuntimeError(format!("image URL {url:?} is not a local path")))?;
                let to = to.to_owned();
                let digest =
                    tokio::task::spawn_blocking(move || -> Result<String, RuntimeError> {
                        let mut src = std::fs::File::open(&path)
                            .map_err(|e| RuntimeError(format!("image {}: {e}", path.display())))?;
                        let mut buf = vec![0u8; 1 << 20];
                        loop {
                            let n = std::io::Read::read(&mut src, &mut buf).map_err(|e| {
                                RuntimeError(format!("reading image {}: {e}", path.display()))
                            })?;
                            if n == 0 {
                                break;
                            }
                            hasher.update(&buf[..n]);
                            file.write_all(&buf[..n]).map_err(|e| {
                                RuntimeError(format!("writing {}: {e}", to.display()))
                            })?;
                        }
                        file.sync_all()
                            .map_err(|e| RuntimeError(format!("writing {}: {e}", to.display())))?;
                        Ok(data_encoding::HEXLOWER.encode(&hasher.finalize()))
                    })
                    .await
                    .map_err(|e| RuntimeError(format!("image copy: {e}")))??;
                Ok(digest)
            }
            "http" | "https" => {
                let mut response = self
                    .http
                    .get(parsed)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status())
                    .map_err(|e| RuntimeError(format!("image URL {url} does not answer: {e}")))?;
                while let Some(chunk) = response
                    .chunk()
                    .await
                    .map_err(|e| RuntimeError(format!("downloading image {url}: {e}")))?
                {
                    hasher.update(&chunk);
                    file.write_all(&chunk).map_err(write_error)?;
                }
                file.sync_all().map_err(write_error)?;
                Ok(data_encoding::HEXLOWER.encode(&hasher.finalize()))
            }
            other => Err(RuntimeError(format!(
                "image URL scheme {other:?} is not supported"
            ))),
        }
    }
}

/// Whether an unpacked snapshot has what every snapshot has.
fn snapshot_complete(dir: &Path) -> bool {
    ["manifest.json", "disk.qcow2", "config.img"]
        .iter()
        .all(|f| dir.join(f).is_file())
}

/// Unpacks the snapshot archive's known regular files into `out`.
fn unpack_snapshot(tar: &Path, out: &Path) -> Result<(), RuntimeError> {
    let required = ["manifest.json", "disk.qcow2", "config.img"];
    unpack_known(tar, out, "snapshot archive", &SNAPSHOT_FILES, &required)
}

/// What a complete cache directory holds, if it is complete.
fn cached(dir: &Path, format: &str) -> Option<Cached> {
    if format == "qcow2" {
        let disk = dir.join("image.qcow2");
        return disk.is_file().then_some(Cached::Qcow2 { disk });
    }
    let kernel = dir.join("vmlinuz");
    let initrd = dir.join("initrd");
    let rootfs = dir.join("rootfs.qcow2");
    (kernel.is_file() && initrd.is_file()).then(|| Cached::Bundle {
        kernel,
        initrd,
        rootfs: rootfs.is_file().then_some(rootfs),
    })
}

/// Unpacks the bundle's known regular files into `out`.
fn unpack_bundle(tar: &Path, out: &Path) -> Result<(), RuntimeError> {
    unpack_known(
        tar,
        out,
        "image bundle",
        &BUNDLE_FILES,
        &["vmlinuz", "initrd"],
    )
}

/// Unpacks the regular files of the tar named in `known` into `out` (a leading `./` dropped);
/// anything else in the tar is ignored, so a hostile member name can never write outside
/// `out`. Each of `required` must be there; `what` names the archive in errors.
fn unpack_known(
    tar: &Path,
    out: &Path,
    what: &str,
    known: &[&str],
    required: &[&str],
) -> Result<(), RuntimeError> {
    let bad = |e: std::io::Error| RuntimeError(format!("{what} is not a readable tar: {e}"));
    let file = std::fs::File::open(tar).map_err(bad)?;
    let mut archive = tar::Archive::new(file);
    let mut found = Vec::new();
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        // The tar crate writes files with holes (a snapshot's disk) as GNU sparse entries.
        let kind = entry.header().entry_type();
        if !kind.is_file() && !kind.is_gnu_sparse() {
            continue;
        }
        let path = entry.path().map_err(bad)?.into_owned();
        let name = path
            .strip_prefix("./")
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        if !known.contains(&name.as_str()) || found.contains(&name) {
            continue;
        }
        let target = out.join(&name);
        let mut dst = std::fs::File::create(&target)
            .map_err(|e| RuntimeError(format!("writing {}: {e}", target.display())))?;
        std::io::copy(&mut entry, &mut dst)
            .and_then(|_| dst.sync_all())
            .map_err(|e| RuntimeError(format!("writing {}: {e}", target.display())))?;
        found.push(name);
    }
    match required.iter().find(|r| !found.iter().any(|f| f == *r)) {
        Some(missing) => Err(RuntimeError(format!("{what} has no {missing}"))),
        None => Ok(()),
    }
}
