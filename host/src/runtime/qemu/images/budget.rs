//! The cache's byte budget: each entry's size and last use, kept in memory (read from the
//! directory once at start), the pins that keep an entry a boot is using, and the pruning that
//! evicts the least recently used entries over the budget.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::ImageCache;
/// One entry of the cache: an image's directory or an unpacked snapshot's, by digest.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `<image_dir>/<sha256>/`.
    Image(String),
    /// `<image_dir>/snapshots/<sha256>/`.
    Snapshot(String),
}

/// Keeps an entry from eviction while held: a boot holds its image's (and a restore its
/// snapshot's) until the guest is started, by when the guest's record names the entry.
#[derive(Debug)]
pub struct Pin {
    entry: Entry,
    pins: Arc<Mutex<HashMap<Entry, usize>>>,
}

/// What the cache holds: each entry's size and when it was last used (a tick of this index).
#[derive(Default)]
pub(super) struct Index {
    entries: HashMap<Entry, Use>,
    tick: u64,
}

#[derive(Clone, Copy)]
struct Use {
    bytes: u64,
    tick: u64,
}

/// The prefix of an entry directory on its way out (renamed first, so it never looks cached).
const EVICTING: &str = ".evicting-";

impl Entry {
    fn kind(&self) -> &'static str {
        match self {
            Entry::Image(_) => "image",
            Entry::Snapshot(_) => "snapshot",
        }
    }

    fn digest(&self) -> &str {
        match self {
            Entry::Image(digest) | Entry::Snapshot(digest) => digest,
        }
    }

    /// Its directory under the cache's `root`.
    pub(super) fn dir(&self, root: &Path) -> PathBuf {
        match self {
            Entry::Image(digest) => root.join(digest),
            Entry::Snapshot(digest) => root.join("snapshots").join(digest),
        }
    }

    /// The name of the lock that fills it.
    pub(super) fn lock_key(&self) -> String {
        match self {
            Entry::Image(digest) => digest.clone(),
            Entry::Snapshot(digest) => format!("snapshot:{digest}"),
        }
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = pins.get_mut(&self.entry) {
            *count -= 1;
            if *count == 0 {
                pins.remove(&self.entry);
            }
        }
    }
}

impl ImageCache {
    /// The bytes the cache's entries take on disk.
    pub fn bytes(&self) -> u64 {
        self.index().bytes()
    }

    pub(super) fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `entry` from eviction until the pin is dropped. Taken under the entry's lock, so
    /// a prune (which looks at pins under that lock too) sees it.
    pub(super) fn pin(&self, entry: &Entry) -> Pin {
        let mut pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        *pins.entry(entry.clone()).or_default() += 1;
        Pin {
            entry: entry.clone(),
            pins: self.pins.clone(),
        }
    }

    fn pinned(&self, entry: &Entry) -> bool {
        let pins = self.pins.lock().unwrap_or_else(|p| p.into_inner());
        pins.contains_key(entry)
    }

    /// Marks `entry` used now; `fresh` (just filled) measures it again. Called under its lock.
    pub(super) fn touch(&self, entry: &Entry, fresh: bool) {
        let dir = entry.dir(&self.dir);
        // The order of use outlives the agent as the directory's mtime (best effort).
        let _ = std::fs::File::open(&dir).and_then(|f| f.set_modified(SystemTime::now()));
        // Measured outside the index's lock (a directory walk); the entry's own lock is held.
        let known = self.index().entries.get(entry).map(|u| u.bytes);
        let bytes = match known {
            Some(bytes) if !fresh => bytes,
            _ => entry_bytes(&dir),
        };
        let mut index = self.index();
        index.tick += 1;
        let tick = index.tick;
        index.entries.insert(entry.clone(), Use { bytes, tick });
        metrics::gauge!("vps_host_image_cache_bytes").set(index.bytes() as f64);
    }

    /// Evicts entries, least recently used first, until the cache takes at most `max_bytes`.
    /// An entry being filled (its lock is held), pinned by a boot, or in `in_use` (asked only
    /// when something is to go, once the candidates' locks are held, so a guest whose boot
    /// has let go of its pin is seen by its record) stays. Costs nothing under the budget.
    pub async fn prune(&self, max_bytes: u64, in_use: impl FnOnce() -> HashSet<Entry>) {
        let mut candidates: Vec<(Entry, Use)> = {
            let index = self.index();
            if index.bytes() <= max_bytes {
                return;
            }
            index.entries.iter().map(|(e, u)| (e.clone(), *u)).collect()
        };
        candidates.sort_by_key(|(_, u)| u.tick);
        // Each candidate's lock is held from here until it is gone or kept: no fill, no use.
        let mut held = Vec::new();
        for (entry, used) in candidates {
            let Ok(guard) = self.lock(&entry.lock_key()).try_lock_owned() else {
                continue;
            };
            if !self.pinned(&entry) {
                held.push((entry, used, guard));
            }
        }
        if held.is_empty() {
            return;
        }
        let in_use = in_use();
        for (entry, used, _guard) in held {
            if self.bytes() <= max_bytes {
                break;
            }
            if in_use.contains(&entry) {
                continue;
            }
            self.evict(&entry, used).await;
        }
        let left = self.bytes();
        if left > max_bytes {
            tracing::info!(
                bytes = left,
                max_bytes,
                "the image cache is over its budget with entries in use"
            );
        }
    }

    /// Removes `entry` (its lock held): renamed aside first, so a crash midway leaves nothing
    /// that looks cached.
    async fn evict(&self, entry: &Entry, used: Use) {
        let dir = entry.dir(&self.dir);
        let Some(parent) = dir.parent() else {
            return;
        };
        let aside = parent.join(format!("{EVICTING}{}", entry.digest()));
        let renamed = tokio::fs::rename(&dir, &aside).await;
        let gone = |index: &mut Index| {
            index.entries.remove(entry);
            index.bytes()
        };
        match renamed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // Removed by someone else: only the index still had it.
                let total = gone(&mut self.index());
                metrics::gauge!("vps_host_image_cache_bytes").set(total as f64);
                return;
            }
            Err(error) => {
                tracing::warn!(kind = entry.kind(), sha256 = entry.digest(), %error,
                    "cannot evict a cache entry");
                return;
            }
        }
        if let Err(error) = tokio::fs::remove_dir_all(&aside).await {
            tracing::warn!(path = %aside.display(), %error, "an evicted cache entry stays on disk");
        }
        let total = gone(&mut self.index());
        metrics::gauge!("vps_host_image_cache_bytes").set(total as f64);
        metrics::counter!("vps_host_image_cache_evictions_total", "kind" => entry.kind())
            .increment(1);
        tracing::info!(
            kind = entry.kind(),
            sha256 = entry.digest(),
            bytes = used.bytes,
            cache_bytes = total,
            "cache entry evicted (least recently used)"
        );
    }
}

/// The budget when `image_cache_max_bytes` is not set: half the file system holding `dir`
/// (guests' overlays often share it), or 20 GiB when that cannot be read.
pub fn default_budget(dir: &Path) -> u64 {
    crate::disk::total_bytes(dir).map_or(20 << 30, |total| total / 2)
}

impl Index {
    pub(super) fn bytes(&self) -> u64 {
        self.entries.values().map(|u| u.bytes).sum()
    }
}

/// The entries under `dir`, ordered by their directories' mtimes (the last use of a previous
/// run); what an interrupted eviction left is removed.
pub(super) fn load(dir: &Path) -> Index {
    let mut found: Vec<(SystemTime, Entry, u64)> = Vec::new();
    for (root, snapshots) in [(dir.to_owned(), false), (dir.join("snapshots"), true)] {
        for item in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            let name = item.file_name().to_string_lossy().into_owned();
            let path = item.path();
            if name.starts_with(EVICTING) {
                let _ = std::fs::remove_dir_all(&path);
                continue;
            }
            let Ok(meta) = item.metadata() else {
                continue;
            };
            if !meta.is_dir() || !is_digest(&name) {
                continue;
            }
            let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            let entry = match snapshots {
                true => Entry::Snapshot(name),
                false => Entry::Image(name),
            };
            found.push((used, entry, entry_bytes(&path)));
        }
    }
    found.sort_by_key(|(used, _, _)| *used);
    let mut index = Index::default();
    for (_, entry, bytes) in found {
        index.tick += 1;
        let tick = index.tick;
        index.entries.insert(entry, Use { bytes, tick });
    }
    index
}

/// The disk space of the files in an entry's directory (allocated blocks: disks are sparse).
pub(super) fn entry_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|item| item.metadata().ok())
        .filter(|meta| meta.is_file())
        .map(|meta| meta.blocks() * 512)
        .sum()
}

/// A lowercase hex SHA-256, as entries are named.
pub(super) fn is_digest(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}
