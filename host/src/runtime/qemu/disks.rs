//! Guest disks with `qemu-img`: a qcow2 overlay on a cached base, or a blank qcow2 (copied
//! from one made once per size: a `qemu-img` process costs a cold boot about 10 ms).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use serde::Deserialize;
use tokio::process::Command;

use crate::runtime::RuntimeError;

const GIB: u64 = 1 << 30;

#[derive(Deserialize)]
struct Info {
    format: String,
    #[serde(rename = "virtual-size")]
    virtual_size: u64,
    #[serde(rename = "backing-filename")]
    backing_filename: Option<String>,
}

/// Creates `disk` as a qcow2 overlay on `base` (a checked cached image), at least `disk_gib`
/// large. A base that itself names a backing file is refused: an image from a URL must never
/// make QEMU open a host path.
pub async fn overlay(base: &Path, disk: &Path, disk_gib: u64) -> Result<(), RuntimeError> {
    let virtual_size = checked_base(base).await?;
    let size = virtual_size.max(disk_gib.saturating_mul(GIB));
    let mut command = Command::new("qemu-img");
    command
        .args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(disk)
        .arg(size.to_string());
    qemu_img(command, disk).await
}

/// The virtual size of `base` once `qemu-img info` has found it a qcow2 with no backing file.
/// Bases are cache entries named by their digest, never changed in place: each is asked once
/// (a `qemu-img` process costs a restore about 10 ms), again only if its file's length or
/// modification time changed.
async fn checked_base(base: &Path) -> Result<u64, RuntimeError> {
    type Checked = HashMap<PathBuf, (u64, Option<SystemTime>, u64)>;
    static CHECKED: Mutex<Option<Checked>> = Mutex::new(None);
    let stamp = |m: std::fs::Metadata| (m.len(), m.modified().ok());
    let before = std::fs::metadata(base).ok().map(stamp);
    let known = CHECKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(base)
        .copied();
    if let (Some((len, modified, size)), Some(now)) = (known, before) {
        if (len, modified) == now {
            return Ok(size);
        }
    }
    let info = info(base).await?;
    if info.format != "qcow2" {
        return Err(RuntimeError(format!(
            "image {} is {}, not qcow2",
            base.display(),
            info.format
        )));
    }
    if let Some(backing) = info.backing_filename {
        return Err(RuntimeError(format!(
            "image {} refers to a backing file ({backing})",
            base.display()
        )));
    }
    // Remembered only if the file did not change while it was read.
    if let Some((len, modified)) =
        before.filter(|b| std::fs::metadata(base).ok().map(stamp) == Some(*b))
    {
        CHECKED
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(base.to_owned(), (len, modified, info.virtual_size));
    }
    Ok(info.virtual_size)
}

/// Creates `disk` as an empty qcow2 of `disk_gib` GiB (at least 1): a copy of the blank of
/// that size kept in `blanks`, made there first if it is missing.
pub async fn blank(disk: &Path, disk_gib: u64, blanks: &Path) -> Result<(), RuntimeError> {
    let gib = disk_gib.max(1);
    let template = blanks.join(format!("blank-{gib}g.qcow2"));
    if !template.exists() {
        make_blank(&template, gib, blanks).await?;
    }
    if let Err(e) = tokio::fs::copy(&template, disk).await {
        // Nothing half-made is left under the disk's name.
        let _ = tokio::fs::remove_file(disk).await;
        return Err(RuntimeError(format!(
            "creating disk {} from {}: {e}",
            disk.display(),
            template.display()
        )));
    }
    Ok(())
}

/// Makes the blank `template` under a name of its own, then renames it: a blank exists under
/// its name only once whole, whoever else makes it at the same time.
async fn make_blank(template: &Path, gib: u64, blanks: &Path) -> Result<(), RuntimeError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    tokio::fs::create_dir_all(blanks)
        .await
        .map_err(|e| RuntimeError(format!("cannot make {}: {e}", blanks.display())))?;
    let staging = blanks.join(format!(
        ".blank-{gib}g.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut command = Command::new("qemu-img");
    command
        .args(["create", "-q", "-f", "qcow2"])
        .arg(&staging)
        .arg(gib.saturating_mul(GIB).to_string());
    qemu_img(command, &staging).await?;
    if let Err(e) = tokio::fs::rename(&staging, template).await {
        let _ = tokio::fs::remove_file(&staging).await;
        return Err(RuntimeError(format!("{}: {e}", template.display())));
    }
    Ok(())
}

async fn info(image: &Path) -> Result<Info, RuntimeError> {
    let mut command = Command::new("qemu-img");
    command.args(["info", "--output=json"]).arg(image);
    let stdout =
        super::tool::run(&mut command, &format!("qemu-img info {}", image.display())).await?;
    serde_json::from_slice(&stdout)
        .map_err(|e| RuntimeError(format!("qemu-img info {}: {e}", image.display())))
}

async fn qemu_img(mut command: Command, disk: &Path) -> Result<(), RuntimeError> {
    let what = format!("creating disk {}", disk.display());
    if let Err(error) = super::tool::run(&mut command, &what).await {
        // Nothing half-made is left under the disk's name.
        let _ = tokio::fs::remove_file(disk).await;
        return Err(error);
    }
    Ok(())
}
