//! A snapshot's archive: an uncompressed tar of the files [`Runtime::snapshot`] left in one
//! directory, in the order it names them. It is never written on the host: the upload
//! streams it as it is made and hashes it on the way, which is why its exact length is known
//! first (a presigned PUT needs a `content-length`). A tar of regular files with short names
//! is a 512-byte header per file, the file padded to whole 512-byte blocks, and two zero
//! blocks at the end (holes included: no sparse entries); [`write`] checks that what it wrote
//! is that long.
//!
//! [`Runtime::snapshot`]: super::Runtime::snapshot

use std::io::Write;

use sha2::{Digest, Sha256};

use super::{RuntimeError, SnapshotFiles};

const BLOCK: u64 = 512;

/// The archive's length in bytes.
pub fn len(files: &SnapshotFiles) -> Result<u64, RuntimeError> {
    let mut total = 2 * BLOCK;
    for name in &files.names {
        let path = files.dir.join(name);
        let size = std::fs::metadata(&path)
            .map_err(|e| RuntimeError(format!("snapshot file {}: {e}", path.display())))?
            .len();
        total += BLOCK + size.div_ceil(BLOCK) * BLOCK;
    }
    Ok(total)
}

/// How much of a snapshot file is read at once.
const READ_SIZE: usize = 1 << 20;

/// Writes the archive to `out`: its hex SHA-256 and length.
pub fn write<W: Write>(files: &SnapshotFiles, out: W) -> Result<(String, u64), RuntimeError> {
    let io = |e: std::io::Error| RuntimeError(format!("writing the snapshot archive: {e}"));
    let expected = len(files)?;
    let mut builder = tar::Builder::new(Hashing {
        inner: out,
        hasher: Sha256::new(),
        written: 0,
    });
    // A sparse file's holes go in as zeros: GNU sparse entries would make the length depend
    // on where the file system keeps holes.
    builder.sparse(false);
    for name in &files.names {
        if name.len() >= 100 {
            return Err(RuntimeError(format!(
                "snapshot file name {name:?} is too long"
            )));
        }
        let path = files.dir.join(name);
        let file = std::fs::File::open(&path).map_err(io)?;
        let mut header = tar::Header::new_gnu();
        header.set_metadata_in_mode(&file.metadata().map_err(io)?, tar::HeaderMode::Complete);
        // Read a MiB at a time (tar's own copy reads 8 KiB): a snapshot is a hundred reads.
        let data = std::io::BufReader::with_capacity(READ_SIZE, file);
        builder.append_data(&mut header, name, data).map_err(io)?;
    }
    let mut hashing = builder.into_inner().map_err(io)?;
    hashing.flush().map_err(io)?;
    if hashing.written != expected {
        // A file changed while it was archived: the declared length would be a lie.
        return Err(RuntimeError(format!(
            "the snapshot archive is {} bytes, not the {expected} announced",
            hashing.written
        )));
    }
    Ok((
        data_encoding::HEXLOWER.encode(&hashing.hasher.finalize()),
        hashing.written,
    ))
}

struct Hashing<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_announced_length_is_what_is_written_and_the_digest_is_the_bytes() {
        let dir = std::env::temp_dir().join(format!("vps-archive-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, size) in [
            ("a.json", 17usize),
            ("b.img", 512),
            ("c.state", 1025),
            ("d", 0),
        ] {
            std::fs::write(dir.join(name), vec![7u8; size]).unwrap();
        }
        // A file that is mostly a hole, as a config drive or a copied overlay is.
        let sparse = std::fs::File::create(dir.join("d")).unwrap();
        sparse.set_len(4 << 20).unwrap();
        std::io::Write::write_all(&mut &sparse, b"end").unwrap();
        let files = SnapshotFiles {
            dir: dir.clone(),
            names: ["a.json", "b.img", "c.state", "d"]
                .map(String::from)
                .to_vec(),
            size_bytes: 0,
            include_memory: false,
            cpu_model: None,
            paused_ms: 0,
            qemu_save_ms: None,
        };
        let mut bytes = Vec::new();
        let (sha256, written) = write(&files, &mut bytes).unwrap();
        assert_eq!(written, bytes.len() as u64);
        assert_eq!(written, len(&files).unwrap());
        assert_eq!(
            sha256,
            data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes))
        );
        let mut archive = tar::Archive::new(bytes.as_slice());
        let names: Vec<String> = archive
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(names, ["a.json", "b.img", "c.state", "d"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
