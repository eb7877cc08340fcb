//! The initramfs: a tree of directories, files and symbolic links held in memory, written as
//! a gzip'd newc cpio archive. Entries are written sorted, owned by root and dated 0, so the
//! same inputs make the same bytes.

use std::collections::BTreeMap;
use std::io::{self, Write};

use flate2::write::GzEncoder;
use flate2::Compression;

/// One entry of the tree.
#[derive(Debug, Clone)]
enum Node {
    Dir { mode: u32 },
    File { mode: u32, data: Vec<u8> },
    Symlink { target: String },
}

/// The initramfs's tree; paths are absolute (`/bin/busybox`).
#[derive(Debug, Default)]
pub struct Tree {
    nodes: BTreeMap<String, Node>,
}

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;

impl Tree {
    /// Adds a directory (and its parents).
    pub fn dir(&mut self, path: &str, mode: u32) {
        self.parents(path);
        self.nodes.insert(key(path), Node::Dir { mode });
    }

    /// Adds a file (and its parents' directories), replacing what was at `path`.
    pub fn file(&mut self, path: &str, mode: u32, data: Vec<u8>) {
        self.parents(path);
        self.nodes.insert(key(path), Node::File { mode, data });
    }

    /// Adds a symbolic link (and its parents' directories).
    pub fn symlink(&mut self, path: &str, target: &str) {
        self.parents(path);
        self.nodes.insert(
            key(path),
            Node::Symlink {
                target: target.to_string(),
            },
        );
    }

    /// Whether something is at `path`.
    pub fn contains(&self, path: &str) -> bool {
        self.nodes.contains_key(&key(path))
    }

    /// Writes the tree as a gzip'd newc cpio archive.
    pub fn write_gz<W: Write>(&self, out: W) -> io::Result<W> {
        let mut gz = GzEncoder::new(out, Compression::best());
        for (ino, (path, node)) in self.nodes.iter().enumerate() {
            let (mode, data) = match node {
                Node::Dir { mode } => (S_IFDIR | mode, &[][..]),
                Node::File { mode, data } => (S_IFREG | mode, data.as_slice()),
                Node::Symlink { target } => (S_IFLNK | 0o777, target.as_bytes()),
            };
            let size = u32::try_from(data.len()).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{path} is over 4 GiB"))
            })?;
            let mut writer = cpio::newc::Builder::new(path)
                .ino(ino as u32 + 1)
                .mode(mode)
                .nlink(if matches!(node, Node::Dir { .. }) {
                    2
                } else {
                    1
                })
                .write(gz, size);
            writer.write_all(data)?;
            gz = writer.finish()?;
        }
        gz = cpio::newc::trailer(gz)?;
        gz.finish()
    }

    fn parents(&mut self, path: &str) {
        let mut parent = std::path::Path::new(path).parent();
        while let Some(dir) = parent {
            let dir_key = key(&dir.to_string_lossy());
            if dir_key.is_empty() {
                break;
            }
            self.nodes
                .entry(dir_key)
                .or_insert(Node::Dir { mode: 0o755 });
            parent = dir.parent();
        }
    }
}

/// Archive names are relative (`bin/busybox`), as the kernel's unpacker and `cpio -i` expect.
fn key(path: &str) -> String {
    path.trim_start_matches('/').to_string()
}
