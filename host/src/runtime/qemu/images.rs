//! The image cache: each image is downloaded once per digest into `<image_dir>/<sha256>/`,
//! hashed while it streams to a temporary file, and moved into place only when its digest
//! matches. A bundle (an uncompressed tar) is unpacked there once; a qcow2 image is kept as
//! `image.qcow2`. Anything in a digest's directory has therefore been checked.
//!
//! Snapshot archives (restores) are kept the same way under `<image_dir>/snapshots/<sha256>/`,
//! unpacked as they stream in (the archive itself is never written) and used only once the
//! digest of everything received matches: each restore of one snapshot layers its disk on the
//! same checked copy. The host that took a snapshot puts its files there itself.
//!
//! The cache is bounded ([`ImageCache::prune`]): over its byte budget, the entries used least
//! recently go first, but never one a guest of this host still needs (its record names the
//! image or the snapshot its overlay is layered on), one a boot is using ([`Pin`]) or one
//! being filled (its digest's lock is held). Sizes and the order of use are kept in memory,
//! read once from the directory at start; a use also moves the entry directory's mtime, so
//! that order survives a restart.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::runtime::{ImageRef, RestoreSource, RuntimeError};

mod budget;
pub use budget::{default_budget, Entry, Pin};
use budget::{is_digest, load, Index};

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
    index: Mutex<Index>,
    pins: Arc<Mutex<HashMap<Entry, usize>>>,
}

const BUNDLE_FILES: [&str; 3] = ["vmlinuz", "initrd", "rootfs.qcow2"];

/// What a snapshot archive may hold (`snapshots::MANIFEST` and the files it names).
pub const SNAPSHOT_FILES: [&str; 4] = ["manifest.json", "disk.qcow2", "config.img", "memory.state"];

impl ImageCache {
    /// The cache in `dir`, whose entries (and their sizes) are read once here.
    pub fn new(dir: PathBuf) -> ImageCache {
        let index = load(&dir);
        metrics::gauge!("vps_host_image_cache_bytes").set(index.bytes() as f64);
        ImageCache {
            dir,
            locks: Mutex::default(),
            http: reqwest::Client::new(),
            index: Mutex::new(index),
            pins: Arc::default(),
        }
    }

    /// The lock of one cache entry.
    fn lock(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.entry(key.to_owned()).or_default().clone()
    }

    /// The checked image, downloading and unpacking it first if needed, pinned until the
    /// [`Pin`] is dropped.
    pub async fn get(&self, image: &ImageRef) -> Result<(Cached, Pin), RuntimeError> {
        let digest = image.sha256.to_ascii_lowercase();
        if !is_digest(&digest) {
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
        let entry = Entry::Image(digest.clone());
        let lock = self.lock(&entry.lock_key());
        let _guard = lock.lock().await;
        let dir = entry.dir(&self.dir);
        if let Some(cached) = cached(&dir, &image.format) {
            metrics::counter!("vps_host_image_cache_hits_total").increment(1);
            self.touch(&entry, false);
            return Ok((cached, self.pin(&entry)));
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
        let cached = cached(&dir, &image.format).ok_or_else(|| {
            RuntimeError(format!(
                "image {digest}: the cache entry is incomplete after download"
            ))
        })?;
        self.touch(&entry, true);
        Ok((cached, self.pin(&entry)))
    }

    /// The image of digest `sha256` if the cache holds it, without fetching or pinning it: for
    /// a QEMU that reads its files only as it starts (a warm restore slot).
    pub fn cached_image(&self, sha256: &str, format: &str) -> Option<Cached> {
        let digest = sha256.to_ascii_lowercase();
        if !is_digest(&digest) {
            return None;
        }
        cached(&Entry::Image(digest).dir(&self.dir), format)
    }

    /// The checked, unpacked snapshot archive of `from`, downloading it first if needed,
    /// pinned until the [`Pin`] is dropped.
    pub async fn snapshot(&self, from: &RestoreSource) -> Result<(PathBuf, Pin), RuntimeError> {
        let digest = from.sha256.to_ascii_lowercase();
        if !is_digest(&digest) {
            return Err(RuntimeError(format!(
                "snapshot {} digest {:?} is not a hex SHA-256",
                from.snapshot_id, from.sha256
            )));
        }
        let entry = Entry::Snapshot(digest.clone());
        let lock = self.lock(&entry.lock_key());
        let _guard = lock.lock().await;
        let dir = entry.dir(&self.dir);
        let root = self.dir.join("snapshots");
        if snapshot_complete(&dir) {
            self.touch(&entry, false);
            return Ok((dir, self.pin(&entry)));
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
            // Unpacked as it streams in; nothing of it is used unless the digest matches.
            let out = staging.clone();
            let (actual, unpacked) = self
                .fetch(&from.url, move |body| unpack_snapshot(body, &out))
                .await?;
            if actual != digest {
                return Err(RuntimeError(format!(
                    "snapshot {} digest mismatch: expected sha256 {digest}, got {actual}",
                    from.snapshot_id
                )));
            }
            unpacked?;
            tokio::fs::rename(&staging, &dir)
                .await
                .map_err(|e| RuntimeError(format!("snapshot cache {}: {e}", dir.display())))
        }
        .instrument(span)
        .await;
        let _ = tokio::fs::remove_dir_all(&staging).await;
        result?;
        self.touch(&entry, true);
        Ok((dir, self.pin(&entry)))
    }

    /// Makes the snapshot files in `files` (a snapshot this host took and uploaded, whose
    /// archive is `sha256`) the cache's entry for that digest, by moving them: a restore here
    /// then starts from them with no download. Nothing moves if the entry exists already or
    /// the files are on another file system. Answers the entry's directory when the cache
    /// holds it.
    pub async fn adopt_snapshot(&self, files: &Path, sha256: &str) -> Option<PathBuf> {
        let digest = sha256.to_ascii_lowercase();
        if !is_digest(&digest) {
            return None;
        }
        let entry = Entry::Snapshot(digest.clone());
        let lock = self.lock(&entry.lock_key());
        let _guard = lock.lock().await;
        let dir = entry.dir(&self.dir);
        if snapshot_complete(&dir) {
            return Some(dir);
        }
        tokio::fs::create_dir_all(self.dir.join("snapshots"))
            .await
            .ok()?;
        match tokio::fs::rename(files, &dir).await {
            Ok(()) => {
                self.touch(&entry, true);
                tracing::debug!(sha256 = %digest, "snapshot kept for restores here");
                Some(dir)
            }
            Err(error) => {
                tracing::debug!(%error, "snapshot not kept for restores here");
                None
            }
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

    /// Streams `url` to `to` (fsynced) and returns the hex SHA-256 of what it wrote.
    async fn download(&self, url: &str, to: &Path) -> Result<String, RuntimeError> {
        let to = to.to_owned();
        let (digest, written) = self
            .fetch(url, move |body| {
                let error =
                    |e: std::io::Error| RuntimeError(format!("writing {}: {e}", to.display()));
                let mut file = std::fs::File::create(&to).map_err(error)?;
                std::io::copy(body, &mut file).map_err(error)?;
                file.sync_all().map_err(error)
            })
            .await?;
        written.map(|()| digest)
    }

    /// Streams `url` (`http(s)://` or `file://`) through `sink` on a blocking thread, hashing
    /// every byte, what `sink` left unread included: the hex SHA-256 of the whole body, and
    /// what `sink` answered (whose work is to be trusted only when the digest is the one
    /// expected).
    async fn fetch<T: Send + 'static>(
        &self,
        url: &str,
        sink: impl FnOnce(&mut dyn Read) -> Result<T, RuntimeError> + Send + 'static,
    ) -> Result<(String, Result<T, RuntimeError>), RuntimeError> {
        let parsed = url::Url::parse(url).map_err(|e| RuntimeError(format!("URL {url:?}: {e}")))?;
        let joined = |e: tokio::task::JoinError| RuntimeError(format!("reading {url}: {e}"));
        match parsed.scheme() {
            "file" => {
                let path = parsed
                    .to_file_path()
                    .map_err(|()| RuntimeError(format!("URL {url:?} is not a local path")))?;
                let file = std::fs::File::open(&path)
                    .map_err(|e| RuntimeError(format!("{}: {e}", path.display())))?;
                tokio::task::spawn_blocking(move || through(file, sink))
                    .await
                    .map_err(joined)?
            }
            "http" | "https" => {
                let mut response = self
                    .http
                    .get(parsed)
                    .send()
                    .await
                    .and_then(|r| r.error_for_status())
                    .map_err(|e| RuntimeError(format!("URL {url} does not answer: {e}")))?;
                let (tx, rx) = tokio::sync::mpsc::channel(8);
                let reader = ChannelReader {
                    rx,
                    chunk: Vec::new(),
                    at: 0,
                };
                let consumer = tokio::task::spawn_blocking(move || through(reader, sink));
                let mut broken = None;
                loop {
                    let chunk = match response.chunk().await {
                        Ok(Some(chunk)) => Ok(chunk.to_vec()),
                        Ok(None) => break,
                        Err(error) => {
                            let message = format!("downloading {url}: {error}");
                            broken = Some(message.clone());
                            Err(std::io::Error::other(message))
                        }
                    };
                    // A consumer that is gone has failed: its error is the news.
                    if tx.send(chunk).await.is_err() || broken.is_some() {
                        break;
                    }
                }
                drop(tx);
                let consumed = consumer.await.map_err(joined)?;
                // A body cut short would only show as a wrong digest: say what happened.
                match broken {
                    Some(message) => Err(RuntimeError(message)),
                    None => consumed,
                }
            }
            other => Err(RuntimeError(format!(
                "URL scheme {other:?} is not supported"
            ))),
        }
    }
}

/// Runs `sink` over `body`, then reads what it left, hashing it all.
fn through<T>(
    body: impl Read,
    sink: impl FnOnce(&mut dyn Read) -> Result<T, RuntimeError>,
) -> Result<(String, Result<T, RuntimeError>), RuntimeError> {
    let mut hashing = HashingReader {
        inner: body,
        hasher: Sha256::new(),
    };
    let done = sink(&mut hashing);
    std::io::copy(&mut hashing, &mut std::io::sink())
        .map_err(|e| RuntimeError(format!("reading: {e}")))?;
    Ok((
        data_encoding::HEXLOWER.encode(&hashing.hasher.finalize()),
        done,
    ))
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// A response body's chunks, read on a blocking thread.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>,
    chunk: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.rx.blocking_recv() {
                Some(chunk) => (self.chunk, self.at) = (chunk?, 0),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.at);
        buf[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Whether an unpacked snapshot has what every snapshot has.
fn snapshot_complete(dir: &Path) -> bool {
    ["manifest.json", "disk.qcow2", "config.img"]
        .iter()
        .all(|f| dir.join(f).is_file())
}

/// Unpacks the snapshot archive's known regular files into `out`.
fn unpack_snapshot(body: impl Read, out: &Path) -> Result<(), RuntimeError> {
    let required = ["manifest.json", "disk.qcow2", "config.img"];
    unpack_known(body, out, "snapshot archive", &SNAPSHOT_FILES, &required)
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
    let file = std::fs::File::open(tar)
        .map_err(|e| RuntimeError(format!("image bundle {}: {e}", tar.display())))?;
    unpack_known(
        file,
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
    body: impl Read,
    out: &Path,
    what: &str,
    known: &[&str],
    required: &[&str],
) -> Result<(), RuntimeError> {
    let bad = |e: std::io::Error| RuntimeError(format!("{what} is not a readable tar: {e}"));
    let mut archive = tar::Archive::new(body);
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::budget::entry_bytes;
    use super::*;
    use std::collections::HashSet;

    /// A snapshot archive of small files, and its digest.
    fn archive() -> (Vec<u8>, String) {
        let mut tar = tar::Builder::new(Vec::new());
        for (name, data) in [
            ("manifest.json", b"{}".to_vec()),
            ("disk.qcow2", vec![1; 3000]),
            ("config.img", vec![2; 512]),
            ("memory.state", vec![3; 200_000]),
            ("extra.bin", vec![4; 10]),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, data.as_slice()).unwrap();
        }
        let bytes = tar.into_inner().unwrap();
        let digest = data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes));
        (bytes, digest)
    }

    /// Serves `body` to one GET, in pieces.
    async fn serve(body: Vec<u8>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/snap", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut request = vec![0; 4096];
            let _ = stream.read(&mut request).await;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            for piece in body.chunks(7_000) {
                stream.write_all(piece).await.unwrap();
            }
        });
        url
    }

    fn source(url: String, sha256: &str) -> RestoreSource {
        RestoreSource {
            snapshot_id: "snap_t".into(),
            url,
            sha256: sha256.into(),
        }
    }

    #[tokio::test]
    async fn a_snapshot_is_unpacked_as_it_streams_in_and_kept_under_its_digest() {
        let root = std::env::temp_dir().join(format!("vps-images-ok-{}", std::process::id()));
        let cache = ImageCache::new(root.clone());
        let (bytes, digest) = archive();
        let (dir, _pin) = cache
            .snapshot(&source(serve(bytes).await, &digest))
            .await
            .expect("restored");
        assert_eq!(dir, root.join("snapshots").join(&digest));
        assert_eq!(
            std::fs::read(dir.join("memory.state")).unwrap(),
            vec![3; 200_000]
        );
        assert_eq!(
            std::fs::read(dir.join("disk.qcow2")).unwrap(),
            vec![1; 3000]
        );
        assert!(
            !dir.join("extra.bin").exists(),
            "only the files a snapshot has"
        );
        // Cached: no second download (nothing serves it now).
        let (again, _pin) = cache
            .snapshot(&source("http://127.0.0.1:9/gone".into(), &digest))
            .await
            .expect("cached");
        assert_eq!(again, dir);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[tokio::test]
    async fn a_snapshot_this_host_took_is_restored_from_its_own_files_without_a_download() {
        let root = std::env::temp_dir().join(format!("vps-images-own-{}", std::process::id()));
        let taken = root.join("taken");
        std::fs::create_dir_all(&taken).unwrap();
        for name in ["manifest.json", "disk.qcow2", "config.img", "memory.state"] {
            std::fs::write(taken.join(name), name).unwrap();
        }
        let cache = ImageCache::new(root.join("images"));
        let digest = "cd".repeat(32);
        cache.adopt_snapshot(&taken, &digest).await;
        assert!(!taken.exists(), "the files moved");
        // Nothing serves the archive: only the kept files can answer.
        let (dir, _pin) = cache
            .snapshot(&source("http://127.0.0.1:9/gone".into(), &digest))
            .await
            .expect("restored from the kept files");
        assert_eq!(
            std::fs::read(dir.join("memory.state")).unwrap(),
            b"memory.state"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    /// Snapshot files as the host that took them would adopt, under digest `n` repeated.
    async fn adopted(cache: &ImageCache, root: &Path, n: u8) -> String {
        let digest = format!("{n:02x}").repeat(32);
        let taken = root.join(format!("taken-{n}"));
        std::fs::create_dir_all(&taken).unwrap();
        for (name, len) in [
            ("manifest.json", 2),
            ("disk.qcow2", 64 << 10),
            ("config.img", 512),
        ] {
            std::fs::write(taken.join(name), vec![n; len]).unwrap();
        }
        cache.adopt_snapshot(&taken, &digest).await;
        digest
    }

    fn kept(root: &Path, digest: &str) -> bool {
        snapshot_complete(&root.join("snapshots").join(digest))
    }

    #[tokio::test]
    async fn over_its_budget_the_cache_evicts_the_least_recently_used_first_even_after_a_restart() {
        let root = std::env::temp_dir().join(format!("vps-images-lru-{}", std::process::id()));
        let images = root.join("images");
        let cache = ImageCache::new(images.clone());
        let a = adopted(&cache, &root, 0xa1).await;
        let b = adopted(&cache, &root, 0xb2).await;
        let c = adopted(&cache, &root, 0xc3).await;
        // A restore of the oldest makes it the most recently used.
        drop(
            cache
                .snapshot(&source("http://127.0.0.1:9/gone".into(), &a))
                .await,
        );
        let total = cache.bytes();
        assert!(total >= 3 * (64 << 10), "sizes are counted: {total}");
        cache.prune(total, HashSet::new).await;
        assert!(
            [&a, &b, &c].iter().all(|d| kept(&images, d)),
            "within budget"
        );

        cache.prune(total - 1, HashSet::new).await;
        assert!(!kept(&images, &b), "the least recently used goes");
        assert!(kept(&images, &a) && kept(&images, &c));
        assert!(!images.join("snapshots").join(&b).exists());
        let left = cache.bytes();
        assert!(left < total);

        // A restarted agent reads the same sizes and the same order from the directory.
        let again = ImageCache::new(images.clone());
        assert_eq!(again.bytes(), left);
        again.prune(left - 1, HashSet::new).await;
        assert!(
            !kept(&images, &c) && kept(&images, &a),
            "c was used before a"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[tokio::test]
    async fn a_budget_of_zero_keeps_only_what_is_in_use_pinned_or_being_filled() {
        let root = std::env::temp_dir().join(format!("vps-images-use-{}", std::process::id()));
        let images = root.join("images");
        let cache = ImageCache::new(images.clone());
        let pinned = adopted(&cache, &root, 0x11).await;
        let needed = adopted(&cache, &root, 0x22).await;
        let filling = adopted(&cache, &root, 0x33).await;
        let unused = adopted(&cache, &root, 0x44).await;
        // An image (a qcow2 disk from a file) is an entry too.
        let disk = root.join("disk.qcow2");
        std::fs::write(&disk, vec![7; 32 << 10]).unwrap();
        let image = ImageRef {
            url: format!("file://{}", disk.display()),
            sha256: data_encoding::HEXLOWER.encode(&Sha256::digest(vec![7; 32 << 10])),
            format: "qcow2".into(),
        };
        let (cached, image_pin) = cache.get(&image).await.expect("image");
        assert!(matches!(cached, Cached::Qcow2 { .. }));
        drop(image_pin);

        let (_, pin) = cache
            .snapshot(&source("http://127.0.0.1:9/gone".into(), &pinned))
            .await
            .expect("cached");
        let lock = cache.lock(&format!("snapshot:{filling}"));
        let fill = lock.lock().await;
        let in_use = || HashSet::from([Entry::Snapshot(needed.clone())]);
        cache.prune(0, in_use).await;
        assert!(!kept(&images, &unused), "nothing needs it");
        assert!(!images.join(&image.sha256).exists(), "nor the image");
        for digest in [&pinned, &needed, &filling] {
            assert!(kept(&images, digest), "{digest} stays");
        }

        drop((pin, fill));
        cache.prune(0, in_use).await;
        assert!(kept(&images, &needed), "a guest's overlay is layered on it");
        assert!(!kept(&images, &pinned) && !kept(&images, &filling));
        assert_eq!(
            cache.bytes(),
            entry_bytes(&images.join("snapshots").join(&needed))
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[tokio::test]
    async fn a_snapshot_whose_bytes_are_not_its_digest_leaves_nothing_and_names_both() {
        let root = std::env::temp_dir().join(format!("vps-images-bad-{}", std::process::id()));
        let cache = ImageCache::new(root.clone());
        let (bytes, actual) = archive();
        let claimed = "ab".repeat(32);
        let error = cache
            .snapshot(&source(serve(bytes).await, &claimed))
            .await
            .expect_err("a wrong digest");
        assert!(
            error.0.contains(&claimed) && error.0.contains(&actual),
            "{error}"
        );
        let left: Vec<_> = std::fs::read_dir(root.join("snapshots")).unwrap().collect();
        assert!(left.is_empty(), "nothing kept: {left:?}");
        // Not a tar at all: the digest is still what is reported.
        let garbage = b"some other bytes".to_vec();
        let actual = data_encoding::HEXLOWER.encode(&Sha256::digest(&garbage));
        let error = cache
            .snapshot(&source(serve(garbage).await, &claimed))
            .await
            .expect_err("not a snapshot");
        assert!(error.0.contains(&actual), "{error}");
        let _ = std::fs::remove_dir_all(&root);
    }
}
