//! Snapshots and restores of QEMU guests (the `snapshot` host command, `restoreFrom`).
//!
//! **An archive** is an uncompressed tar of `manifest.json` ([`Manifest`]), `disk.qcow2` (the
//! guest's disk flattened: its overlay and the image's root disk in one qcow2 with no backing
//! file), `config.img` (the source's config drive, whose size a restore keeps) and, for a
//! memory snapshot, `memory.state` (QEMU's migration stream: device state and RAM).
//!
//! **Taking one.** The guest is frozen only while its state is saved:
//! - QMP `stop`: QEMU drains and flushes every disk, so the overlay file is a consistent
//!   qcow2 on the host's disk;
//! - memory snapshots: `migrate` to `exec:cat > memory.state` (QEMU 7.2 has no `file:`
//!   migration URI), bandwidth unthrottled; a paused guest's RAM goes in one pass. When it
//!   completes the disks are inactive and flushed;
//! - the overlay is copied in this process (only what the guest wrote, as the image's root
//!   disk it rests on never changes), then the config drive;
//! - QMP `cont` (only if it ran before), which reactivates the disks.
//!
//! That time is `vps_host_snapshot_pause_seconds`. The copy is then flattened with
//! `qemu-img convert` with the guest running. The guest's own lock is held only while it is
//! frozen. No archive is written here: the agent's upload makes it as it sends it
//! (`runtime::archive`), and the files then become this host's restore cache entry for the
//! archive's digest.
//!
//! **Restoring one.** The archive is downloaded once per digest and checked (the image
//! cache's code), unless this host took it; the new guest's disk is a qcow2 overlay on the unpacked `disk.qcow2`, so
//! a fork of N shares one copy. A disk-only snapshot boots from that disk. A memory snapshot
//! starts QEMU with the same machine, CPU model, memory, vCPUs and devices plus `-incoming
//! defer`, loads the state with `migrate-incoming exec:cat memory.state`, and is resumed with
//! `cont`: its processes, uptime and boot id go on.
//!
//! **Identity.** A restored guest is a new instance: its config drive names the new
//! instance, its address and MAC, and carries identity generation `source + 1` with a
//! [`FreshIdentity`] the host made (machine id, SSH host keys, random seed): a clone of a
//! memory snapshot shares its source's random state, so keys it made itself at once could
//! equal a sibling's. A disk-only restore boots, and its `/init` takes that identity. A memory
//! restore does not boot: it is resumed with its NICs' links down (`set_link`), the minimal
//! guest's watcher (`/etc/vps-restore-watch`) sees the carrier drop, remounts the config
//! drive and takes the new instance, address and identity, restarts `sshd`, and prints
//! `restored: identity N` on the console; then the links come up. No packet leaves the
//! clone under its source's MAC or address. The restore runs (and is reported `RUNNING`) from
//! its resume; the identity is taken beside it, and only once the guest said so does the
//! agent report `identityRebound`. A guest that never says so (an image without the watcher)
//! gets its links back after `identity_timeout` and keeps its source's identity, unreported.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::process::Command;

use super::config_drive::FreshIdentity;
use super::qmp::Qmp;
use crate::runtime::RuntimeError;

/// The archive's manifest.
pub const MANIFEST: &str = "manifest.json";
/// The archive format this runtime writes and reads.
const FORMAT: u32 = 1;

/// What a snapshot was taken of: what a restore must match to load it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The guest it was taken of (`inst_…`).
    pub source: String,
    pub include_memory: bool,
    /// `Runtime::cpu_model` of the host it was taken on (`tcg:max`, `kvm:<model>`).
    pub cpu_model: String,
    /// `microvm` (bundles) or `q35` (disk images).
    pub machine: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub disk_gib: u64,
    /// The image it ran (a memory restore boots the same kernel and devices).
    pub image_sha256: String,
    pub image_format: String,
    /// The source's identity generation: a restore runs with the next one.
    pub identity_generation: u64,
    /// `qemu-system-x86_64 --version`'s first line, for whoever reads a failed load.
    pub qemu_version: String,
}

impl Manifest {
    /// Reads and checks the manifest of an unpacked snapshot.
    pub fn read(dir: &Path) -> Result<Manifest, RuntimeError> {
        let path = dir.join(MANIFEST);
        let bytes = std::fs::read(&path)
            .map_err(|e| RuntimeError(format!("snapshot manifest {}: {e}", path.display())))?;
        let manifest: Manifest = serde_json::from_slice(&bytes)
            .map_err(|e| RuntimeError(format!("snapshot manifest is not valid: {e}")))?;
        if manifest.format != FORMAT {
            return Err(RuntimeError(format!(
                "snapshot archive format {} is not {FORMAT}",
                manifest.format
            )));
        }
        if manifest.include_memory && !dir.join("memory.state").is_file() {
            return Err(RuntimeError(
                "memory snapshot archive has no memory.state".into(),
            ));
        }
        Ok(manifest)
    }
}

/// Saves the VM's device state and RAM to `path` over QMP (the VM is stopped first by the
/// caller). Answers QEMU's own save time.
pub async fn save_memory(
    qmp: &Qmp,
    path: &Path,
    timeout: Duration,
) -> Result<Duration, RuntimeError> {
    let qmp_error = |e: super::qmp::QmpError| RuntimeError(format!("saving memory: {e}"));
    // QEMU 7.2 throttles migration to 32 MiB/s by default; to a local file that is pure delay.
    qmp.execute(
        "migrate-set-parameters",
        Some(json!({ "max-bandwidth": 1u64 << 40 })),
    )
    .await
    .map_err(qmp_error)?;
    let uri = format!("exec:cat > {}", shell_quote(&path.to_string_lossy()));
    qmp.execute("migrate", Some(json!({ "uri": uri })))
        .await
        .map_err(qmp_error)?;
    let info = wait_migration(qmp, timeout, "saving memory").await?;
    let total = info
        .get("total-time")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    Ok(Duration::from_millis(total))
}

/// Loads the state saved by [`save_memory`] into a QEMU started with `-incoming defer`.
/// Answers how long QEMU took.
pub async fn load_memory(
    qmp: &Qmp,
    path: &Path,
    timeout: Duration,
) -> Result<Duration, RuntimeError> {
    let started = Instant::now();
    let uri = format!("exec:cat {}", shell_quote(&path.to_string_lossy()));
    qmp.execute("migrate-incoming", Some(json!({ "uri": uri })))
        .await
        .map_err(|e| RuntimeError(format!("loading memory: {e}")))?;
    wait_migration(qmp, timeout, "loading memory").await?;
    Ok(started.elapsed())
}

/// Polls `query-migrate` until the migration completes; its last answer. Every 2 ms: the
/// guest is frozen until then, and a QMP round trip costs QEMU's main loop far less.
async fn wait_migration(
    qmp: &Qmp,
    timeout: Duration,
    what: &str,
) -> Result<serde_json::Value, RuntimeError> {
    let deadline = Instant::now() + timeout;
    loop {
        let info = qmp
            .execute("query-migrate", None)
            .await
            .map_err(|e| RuntimeError(format!("{what}: {e}")))?;
        match info.get("status").and_then(serde_json::Value::as_str) {
            Some("completed") => return Ok(info),
            Some(status @ ("failed" | "cancelled")) => {
                let why = info
                    .get("error-desc")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or("no reason given");
                return Err(RuntimeError(format!("{what}: migration {status}: {why}")));
            }
            _ => {}
        }
        if Instant::now() > deadline {
            let _ = qmp.execute("migrate_cancel", None).await;
            return Err(RuntimeError(format!("{what}: not done within {timeout:?}")));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Copies a file in this process (the kernel's `copy_file_range`): the guest is frozen while
/// its overlay and config drive are copied, and a `cp` would cost a process start each.
pub async fn copy(from: &Path, to: &Path) -> Result<(), RuntimeError> {
    tokio::fs::copy(from, to)
        .await
        .map_err(|e| RuntimeError(format!("copying {}: {e}", from.display())))?;
    Ok(())
}

/// Flattens `overlay` (and whatever it rests on) into one qcow2 at `out`, with no backing file.
pub async fn flatten(overlay: &Path, out: &Path) -> Result<(), RuntimeError> {
    let mut convert = Command::new("qemu-img");
    convert
        .args(["convert", "-q", "-O", "qcow2"])
        .arg(overlay)
        .arg(out);
    super::tool::run(&mut convert, "flattening the disk").await?;
    Ok(())
}

/// The files of a snapshot, in archive order: the manifest first, so a reader knows what
/// it holds before the large files.
pub fn archive_names(include_memory: bool) -> Vec<String> {
    let mut names = vec![MANIFEST, "disk.qcow2", "config.img"];
    if include_memory {
        names.push("memory.state");
    }
    names.into_iter().map(String::from).collect()
}

/// Writes `manifest` beside the files it describes.
pub fn write_manifest(work: &Path, manifest: &Manifest) -> Result<(), RuntimeError> {
    let json = serde_json::to_vec_pretty(manifest)
        .map_err(|e| RuntimeError(format!("snapshot manifest: {e}")))?;
    std::fs::write(work.join(MANIFEST), json)
        .map_err(|e| RuntimeError(format!("writing the snapshot manifest: {e}")))
}

/// A new identity from this host's CSPRNG: machine id, random seed, ed25519 and ECDSA P-256
/// SSH host keys.
pub fn fresh_identity(hostname: &str) -> Result<FreshIdentity, RuntimeError> {
    use ssh_key::getrandom::SysRng;
    use ssh_key::rand_core::UnwrapErr;
    use ssh_key::{Algorithm, EcdsaCurve, LineEnding, PrivateKey};

    let mut random = [0u8; 48];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
        .map_err(|e| RuntimeError(format!("reading /dev/urandom: {e}")))?;
    let mut ssh_host_keys = Vec::new();
    for (kind, algorithm) in [
        ("ed25519", Algorithm::Ed25519),
        (
            "ecdsa",
            Algorithm::Ecdsa {
                curve: EcdsaCurve::NistP256,
            },
        ),
    ] {
        let failed = |e: ssh_key::Error| RuntimeError(format!("making a {kind} host key: {e}"));
        let mut key = PrivateKey::random(&mut UnwrapErr(SysRng), algorithm).map_err(failed)?;
        key.set_comment(hostname);
        let private = key.to_openssh(LineEnding::LF).map_err(failed)?;
        let public = key.public_key().to_openssh().map_err(failed)?;
        ssh_host_keys.push((kind.to_owned(), private.to_string(), public));
    }
    Ok(FreshIdentity {
        machine_id: data_encoding::HEXLOWER.encode(&random[..16]),
        seed: data_encoding::HEXLOWER.encode(&random[16..]),
        ssh_host_keys,
    })
}

/// The first line of `qemu --version`.
pub async fn qemu_version(qemu: &Path) -> String {
    Command::new(qemu)
        .arg("--version")
        .output()
        .await
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// Waits until the console (`console`) shows the guest's `restored: identity N` line, or
/// `timeout` passes or the console is gone with its guest (false).
pub async fn wait_reidentified(console: &Path, generation: u64, timeout: Duration) -> bool {
    let needle = format!("restored: identity {generation},");
    let deadline = Instant::now() + timeout;
    loop {
        match std::fs::read_to_string(console) {
            Ok(text) if text.contains(&needle) => return true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            _ => {}
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Makes `path` at least `len` bytes long (a restored guest's config drive keeps the size of
/// the one its kernel already knows).
pub fn pad_to(path: &Path, len: u64) -> Result<(), RuntimeError> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| RuntimeError(format!("{}: {e}", path.display())))?;
    let now = file
        .metadata()
        .map_err(|e| RuntimeError(format!("{}: {e}", path.display())))?
        .len();
    if now < len {
        file.set_len(len)
            .map_err(|e| RuntimeError(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

/// Single-quotes `s` for `sh` (QEMU runs an `exec:` migration URI with `/bin/sh -c`).
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Where a snapshot is assembled before it is archived.
pub fn work_dir(out_dir: &Path, id: &str) -> PathBuf {
    out_dir.join(format!(".{id}-{}.work", super::process::unix_ms()))
}
