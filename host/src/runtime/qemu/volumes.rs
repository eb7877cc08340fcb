//! The volume store: one sparse qcow2 per node volume, `<state_dir>/volumes/<vol_…>.qcow2`,
//! attached to the guests that name it as a virtio-blk disk with the volume's serial
//! (read-only when asked). A new volume is blank: the minimal guest formats it ext4 the first
//! time it mounts it read-write (docs/guest-contract.md). A volume only grows: `qemu-img
//! resize` when no guest runs with it, QMP `block_resize` when one does (QEMU holds the file's
//! lock). Its file outlives every guest: deleting a guest never touches it.

use std::path::{Path, PathBuf};

use tokio::process::Command;

use crate::runtime::{RuntimeError, VolumeAttachment, VolumeSpec};

pub const GIB: u64 = 1 << 30;

/// The store's directory and the paths in it.
#[derive(Clone, Debug)]
pub struct VolumeStore(pub PathBuf);

impl VolumeStore {
    pub fn path(&self, id: &str) -> PathBuf {
        self.0.join(format!("{id}.qcow2"))
    }

    /// The ids of the volumes in the store, sorted.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = std::fs::read_dir(&self.0)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(".qcow2")
                    .map(str::to_owned)
            })
            .filter(|id| validate_id(id).is_ok())
            .collect();
        ids.sort();
        ids
    }
}

/// A volume id names a file: letters, digits, `_` and `-`, starting with a letter (it is also
/// a QEMU drive id).
pub fn validate_id(id: &str) -> Result<(), RuntimeError> {
    if id.starts_with(|c: char| c.is_ascii_alphabetic()) && vps_guest_image::is_plain_name(id, 64) {
        Ok(())
    } else {
        Err(RuntimeError(format!("volume id {id:?} is not valid")))
    }
}

/// A virtio-blk serial: at most 20 bytes (`VIRTIO_BLK_ID_BYTES`), nothing QEMU's option
/// parser or the guest's shell would read as syntax.
pub fn validate_serial(serial: &str) -> Result<(), RuntimeError> {
    if vps_guest_image::is_plain_name(serial, 20) && !serial.starts_with("vps-") {
        Ok(())
    } else {
        Err(RuntimeError(format!(
            "volume serial {serial:?} is not valid (1 to 20 of A-Z a-z 0-9 _ -, not vps-…)"
        )))
    }
}

/// Checks what a guest attaches: known ids and serials, absolute mount paths the guest can
/// take as they are, no serial or path twice.
pub fn validate_attachments(volumes: &[VolumeAttachment]) -> Result<(), RuntimeError> {
    for (i, v) in volumes.iter().enumerate() {
        validate_id(&v.volume_id)?;
        validate_serial(&v.serial)?;
        vps_guest_image::config_drive::check_mount_path(&v.mount_path)
            .map_err(|e| RuntimeError(format!("volume {}: {e}", v.volume_id)))?;
        let twice = volumes[..i].iter().any(|o| {
            o.volume_id == v.volume_id || o.serial == v.serial || o.mount_path == v.mount_path
        });
        if twice {
            return Err(RuntimeError(format!(
                "volume {} is attached twice (by id, serial or mount path)",
                v.volume_id
            )));
        }
    }
    Ok(())
}

/// Creates the volume's file when missing: a blank qcow2 of `size_gib` (at least 1).
/// Answers whether it made it.
pub async fn create_if_missing(
    store: &VolumeStore,
    volume: &VolumeSpec,
) -> Result<bool, RuntimeError> {
    let path = store.path(&volume.id);
    if path.exists() {
        return Ok(false);
    }
    std::fs::create_dir_all(&store.0)
        .map_err(|e| RuntimeError(format!("cannot make {}: {e}", store.0.display())))?;
    // Made under a temporary name, so a crash never leaves a half-made volume under its own.
    let partial = store.0.join(format!(".{}.partial", volume.id));
    let size = volume.size_gib.max(1).saturating_mul(GIB);
    let mut create = Command::new("qemu-img");
    create
        .args(["create", "-q", "-f", "qcow2", "-o", "lazy_refcounts=on"])
        .arg(&partial)
        .arg(size.to_string());
    if let Err(error) =
        super::tool::run(&mut create, &format!("creating volume {}", volume.id)).await
    {
        let _ = std::fs::remove_file(&partial);
        return Err(error);
    }
    std::fs::rename(&partial, &path)
        .map_err(|e| RuntimeError(format!("creating volume {}: {e}", volume.id)))?;
    Ok(true)
}

/// The volume's virtual size in bytes.
pub async fn virtual_size(path: &Path) -> Result<u64, RuntimeError> {
    let what = format!("qemu-img info {}", path.display());
    let mut command = Command::new("qemu-img");
    command.args(["info", "-U", "--output=json"]).arg(path);
    let stdout = super::tool::run(&mut command, &what).await?;
    let info: serde_json::Value = serde_json::from_slice(&stdout)
        .map_err(|e| RuntimeError(format!("qemu-img info {}: {e}", path.display())))?;
    info["virtual-size"]
        .as_u64()
        .ok_or_else(|| RuntimeError(format!("qemu-img info {}: no virtual-size", path.display())))
}

/// Grows a volume no QEMU has open to `bytes`.
pub async fn resize_offline(path: &Path, bytes: u64) -> Result<(), RuntimeError> {
    let mut resize = Command::new("qemu-img");
    resize
        .args(["resize", "-q", "-f", "qcow2"])
        .arg(path)
        .arg(bytes.to_string());
    super::tool::run(&mut resize, &format!("growing {}", path.display())).await?;
    Ok(())
}

/// What the file takes on the host's disk (it is sparse).
pub fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// The QEMU arguments attaching `volumes` (`blk`: the machine's virtio-blk device).
pub fn qemu_args(store: &VolumeStore, volumes: &[VolumeAttachment], blk: &str) -> Vec<String> {
    let mut args = Vec::new();
    for v in volumes {
        let readonly = if v.read_only { ",readonly=on" } else { "" };
        args.extend([
            "-drive".to_owned(),
            format!(
                "file={},if=none,id={},format=qcow2,discard=unmap{readonly}",
                store.path(&v.volume_id).to_string_lossy(),
                v.volume_id
            ),
            "-device".to_owned(),
            format!("{blk},drive={},serial={}", v.volume_id, v.serial),
        ]);
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attach(id: &str, serial: &str, path: &str) -> VolumeAttachment {
        VolumeAttachment {
            volume_id: id.into(),
            serial: serial.into(),
            mount_path: path.into(),
            read_only: false,
        }
    }

    #[test]
    fn ids_serials_and_paths_are_checked() {
        assert!(validate_id("vol_01JB").is_ok());
        assert!(validate_id("../x").is_err());
        assert!(validate_id("1vol").is_err());
        assert!(validate_serial("vol-0123456789abcdef").is_ok());
        assert!(validate_serial("vol-0123456789abcdefg").is_err());
        assert!(validate_serial("a,b").is_err());
        assert!(validate_serial("vps-root").is_err());
        assert!(validate_attachments(&[attach("vol_a", "sa", "/srv/a")]).is_ok());
        assert!(validate_attachments(&[attach("vol_a", "sa", "mnt")]).is_err());
        assert!(validate_attachments(&[
            attach("vol_a", "sa", "/srv/a"),
            attach("vol_b", "sb", "/srv/a")
        ])
        .is_err());
    }
}
