//! Guest disks with `qemu-img`: a qcow2 overlay on a cached base, or a blank qcow2 (copied
//! from one made once per size: a `qemu-img` process costs a cold boot about 10 ms).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};
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
        .args(["create", "-q", "-f", "qcow2"])
        .args(backed_by(base))
        .arg(disk)
        .arg(size.to_string());
    qemu_img(command, disk).await
}

/// `qemu-img create`'s options for an overlay on the qcow2 `base`.
fn backed_by(base: &Path) -> [&OsStr; 4] {
    [
        "-F".as_ref(),
        "qcow2".as_ref(),
        "-b".as_ref(),
        base.as_os_str(),
    ]
}

/// The virtual size of `base` once `qemu-img info` has found it a qcow2 with no backing file.
/// Bases are cache entries named by their digest, never changed in place: each is asked once
/// (a `qemu-img` process costs a restore about 10 ms), again only if its file's length or
/// modification time changed. The stamp is taken before the file is read, so a file replaced
/// meanwhile carries another and is asked again.
async fn checked_base(base: &Path) -> Result<u64, RuntimeError> {
    type Stamp = (u64, Option<SystemTime>);
    static CHECKED: LazyLock<Mutex<HashMap<PathBuf, (Stamp, u64)>>> = LazyLock::new(Mutex::default);
    let checked = || CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    // No stamp (no file): `qemu-img info` says what is wrong.
    let stamp = std::fs::metadata(base)
        .ok()
        .map(|m| (m.len(), m.modified().ok()));
    if let (Some(stamp), Some((known, size))) = (stamp, checked().get(base)) {
        if *known == stamp {
            return Ok(*size);
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
    if let Some(stamp) = stamp {
        checked().insert(base.to_owned(), (stamp, info.virtual_size));
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
    copy_template(&template, disk).await
}

/// Creates `disk` as a copy of `template`.
async fn copy_template(template: &Path, disk: &Path) -> Result<(), RuntimeError> {
    if let Err(e) = tokio::fs::copy(template, disk).await {
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

/// Makes the blank `template`.
async fn make_blank(template: &Path, gib: u64, blanks: &Path) -> Result<(), RuntimeError> {
    tokio::fs::create_dir_all(blanks)
        .await
        .map_err(|e| RuntimeError(format!("cannot make {}: {e}", blanks.display())))?;
    create_once(template, &[], gib.saturating_mul(GIB)).await
}

/// Creates `disk` as a qcow2 overlay on the snapshot disk `base` (a checked cache entry), at
/// least `disk_gib` large, as a copy of the overlay of that size kept beside `base`: a restore,
/// and each restore of a fork, costs a file copy instead of a `qemu-img` process.
pub async fn overlay_from_template(
    base: &Path,
    disk: &Path,
    disk_gib: u64,
) -> Result<(), RuntimeError> {
    let template = overlay_template(base, disk_gib).await?;
    copy_template(&template, disk).await
}

/// The overlay on `base` at least `disk_gib` large kept beside it, made first if missing. It
/// names `base` by its absolute path, so a copy of it anywhere rests on the same file.
pub async fn overlay_template(base: &Path, disk_gib: u64) -> Result<PathBuf, RuntimeError> {
    let size = checked_base(base).await?.max(disk_gib.saturating_mul(GIB));
    let base = std::fs::canonicalize(base)
        .map_err(|e| RuntimeError(format!("{}: {e}", base.display())))?;
    let template = base.with_file_name(format!("overlay-{size}.qcow2"));
    if !template.is_file() {
        create_once(&template, &backed_by(&base), size).await?;
    }
    Ok(template)
}

/// Makes the qcow2 `template` of `size` bytes (`qemu-img create` with `options`) under a name of
/// its own, then renames it: a template exists under its name only once whole, whoever else
/// makes it at the same time.
async fn create_once(template: &Path, options: &[&OsStr], size: u64) -> Result<(), RuntimeError> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = template.file_name().unwrap_or_default().to_string_lossy();
    let staging = template.with_file_name(format!(
        ".{name}.{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut command = Command::new("qemu-img");
    command
        .args(["create", "-q", "-f", "qcow2"])
        .args(options)
        .arg(&staging)
        .arg(size.to_string());
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
