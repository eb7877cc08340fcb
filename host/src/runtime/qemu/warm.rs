//! Warm restore slots: QEMUs started ahead of a memory restore, so that a restore does not
//! wait for one to start (about 40 ms under TCG, a fifth of loading a small guest).
//!
//! A memory restore needs a QEMU with its snapshot's machine, CPU model, memory, vCPUs and
//! devices, waiting with `-incoming defer`. Of what it is started with, only the files under
//! its disks, its taps and its directory belong to the guest it becomes, so a slot is started
//! with stand-ins for those:
//! - its disks are `raw` nodes over empty `null-co` nodes. A restore starts loading the state
//!   at once, makes the guest's overlay and config drive meanwhile, then opens them
//!   (`blockdev-add`) and puts them under those nodes (`blockdev-reopen`) before the guest runs;
//! - QEMU makes its taps under slot names (down, on no bridge, gone when it ends); a restore
//!   renames them to the guest's and attaches them as a boot does;
//! - its directory `<state_dir>/warm/<name>` is renamed to the guest's: QEMU keeps its console
//!   log, QMP socket and pid file open across that, and `started-in` names the directory its
//!   command line holds, which is how `process` knows the process is the guest's.
//!
//! A slot is started for the shape of each memory snapshot taken here, while its archive
//! uploads (a restore or a fork is likely next), and for the shape of each memory restore a
//! second after it runs (a fork makes several; the second leaves the CPU to its report).
//! `restore_slots` bounds how many wait; past it the oldest goes. A waiting slot is an idle
//! QEMU whose guest never ran. Slots are not guests: they end with the runtime, and a new
//! runtime ends any left over. A restore with volumes starts its QEMU itself.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};

use super::accel::Chosen;
use super::command_line;
use super::images::Cached;
use super::process::{self, GuestDir};
use super::qmp::Qmp;
use crate::runtime::{GuestSpec, RuntimeError};

/// What a memory restore needs of its QEMU, and all a slot is started from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shape {
    image_sha256: String,
    image_format: String,
    vcpus: u32,
    memory_mib: u64,
    nics: usize,
    accel: Chosen,
}

impl Shape {
    /// The one place a shape is made, so a snapshot's and its restore's compare equal (the
    /// digest's case, a vCPU count of 0 as 1).
    pub fn new(
        image: (&str, &str),
        vcpus: u32,
        memory_mib: u64,
        nics: usize,
        accel: Chosen,
    ) -> Shape {
        let (sha256, format) = image;
        Shape {
            image_sha256: sha256.to_ascii_lowercase(),
            image_format: format.to_owned(),
            vcpus: vcpus.max(1),
            memory_mib,
            nics,
            accel,
        }
    }

    /// The shape a restore of `spec` needs; none when a slot cannot serve it (volumes).
    pub fn of(spec: &GuestSpec, accel: Chosen) -> Option<Shape> {
        let image = (spec.image.sha256.as_str(), spec.image.format.as_str());
        spec.volumes
            .is_empty()
            .then(|| Shape::new(image, spec.vcpus, spec.memory_mib, spec.nics.len(), accel))
    }
}

/// A started slot: its QEMU waits in `dir` for a state to load. Dropped before it runs a
/// guest (evicted, its runtime gone, its restore failed), it ends that QEMU.
pub struct WarmQemu {
    dir: GuestDir,
    /// 0 once the QEMU is a guest's.
    pid: i32,
    /// The taps QEMU made, NIC by NIC.
    pub taps: Vec<String>,
    shape: Shape,
    /// Moved to a guest's directory, which is not the slot's to remove.
    taken: bool,
}

impl Drop for WarmQemu {
    fn drop(&mut self) {
        if self.pid != 0 {
            process::signal(self.pid, &self.dir, libc::SIGKILL);
            metrics::counter!("vps_host_warm_restore_slots_ended_total").increment(1);
        }
        if !self.taken {
            let _ = std::fs::remove_dir_all(&self.dir.0);
        }
    }
}

/// The slots waiting, under `<state_dir>/warm`.
pub struct WarmSlots {
    root: PathBuf,
    waiting: Mutex<Vec<WarmQemu>>,
    /// Shapes whose slot is starting now: a second start of one makes none.
    starting: Mutex<Vec<Shape>>,
}

impl WarmSlots {
    pub fn new(root: PathBuf) -> WarmSlots {
        WarmSlots {
            root,
            waiting: Mutex::default(),
            starting: Mutex::default(),
        }
    }

    /// The waiting slot of `shape`, moved to the guest directory `dir` (empty, and holding its
    /// QMP socket itself); none if there is none or it cannot move.
    pub fn take(&self, shape: &Shape, dir: &GuestDir) -> Option<WarmQemu> {
        if !dir.qmp().starts_with(&dir.0) {
            return None;
        }
        let mut slot = {
            let mut waiting = lock(&self.waiting);
            // Its socket moves with it only when it lies in the slot's directory.
            let at = waiting
                .iter()
                .position(|s| &s.shape == shape && s.dir.qmp().starts_with(&s.dir.0))?;
            let slot = waiting.remove(at);
            publish(&waiting);
            slot
        };
        if !process::is_alive(slot.pid, &slot.dir) {
            tracing::warn!(slot = %slot.dir.0.display(), "a warm restore slot had ended");
            return None;
        }
        if let Err(error) = std::fs::rename(&slot.dir.0, &dir.0) {
            // A leftover of an earlier attempt: the slot waits on for another restore.
            tracing::debug!(%error, dir = %dir.0.display(), "the warm slot cannot move there");
            let mut waiting = lock(&self.waiting);
            waiting.push(slot);
            publish(&waiting);
            return None;
        }
        slot.dir = dir.clone();
        slot.taken = true;
        Some(slot)
    }

    /// Starts a slot of `shape`, `after` from now, unless one waits or starts already; ends
    /// the oldest past `max`. Failures are logged: a restore without a slot starts its own QEMU.
    pub async fn fill(
        &self,
        qemu: &Path,
        shape: Shape,
        image: Cached,
        max: usize,
        after: Duration,
        timeout: Duration,
    ) {
        if max == 0 || lock(&self.waiting).iter().any(|s| s.shape == shape) {
            return;
        }
        {
            let mut starting = lock(&self.starting);
            if starting.contains(&shape) {
                return;
            }
            starting.push(shape.clone());
        }
        tokio::time::sleep(after).await;
        let started = self.start(qemu, &shape, &image, timeout).await;
        lock(&self.starting).retain(|s| s != &shape);
        let slot = match started {
            Ok(slot) => slot,
            Err(error) => {
                tracing::warn!(error = %error.0, "no warm restore slot");
                return;
            }
        };
        tracing::info!(slot = %slot.dir.0.display(), pid = slot.pid, "warm restore slot waiting");
        let mut waiting = lock(&self.waiting);
        waiting.push(slot);
        // Past `max`, the oldest go (their QEMUs end as they drop).
        let over = waiting.len().saturating_sub(max);
        waiting.drain(..over);
        publish(&waiting);
    }

    async fn start(
        &self,
        qemu: &Path,
        shape: &Shape,
        image: &Cached,
        timeout: Duration,
    ) -> Result<WarmQemu, RuntimeError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "{}-{}-{}",
            process::unix_ms(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = GuestDir(self.root.join(&name));
        std::fs::create_dir_all(&dir.0)
            .map_err(|e| RuntimeError(format!("cannot make {}: {e}", dir.0.display())))?;
        let digest = data_encoding::HEXLOWER.encode(&Sha256::digest(name.as_bytes()));
        let taps: Vec<String> = (0..shape.nics)
            .map(|i| format!("vpsw{}{}", i % 10, &digest[..10]))
            .collect();
        let args = qemu_args(shape, image, &dir, &taps);
        match process::spawn(qemu, &args, &dir, timeout).await {
            // The restore connects again, from the guest's directory.
            Ok((qmp, pid)) => {
                drop(qmp);
                let slot = WarmQemu {
                    dir,
                    pid,
                    taps,
                    shape: shape.clone(),
                    taken: false,
                };
                // Moved to a guest's directory, it says where its command line points.
                let path = slot.dir.0.to_string_lossy().into_owned();
                std::fs::write(slot.dir.started_in(), path).map_err(|e| {
                    RuntimeError(format!("{}: {e}", slot.dir.started_in().display()))
                })?;
                Ok(slot)
            }
            Err(error) => {
                let _ = std::fs::remove_dir_all(&dir.0);
                Err(error)
            }
        }
    }

    /// How many slots wait.
    pub fn waiting(&self) -> usize {
        lock(&self.waiting).len()
    }

    /// Ends every slot: those starting (once started, within `timeout`), those waiting, and
    /// any an earlier runtime left in `<state_dir>/warm`.
    pub async fn clear(&self, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        while !lock(&self.starting).is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let waiting: Vec<WarmQemu> = {
            let mut waiting = lock(&self.waiting);
            let all = waiting.drain(..).collect();
            publish(&waiting);
            all
        };
        for slot in &waiting {
            process::kill(slot.pid, &slot.dir).await;
        }
        drop(waiting);
        let leftovers = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten();
        for item in leftovers {
            let dir = GuestDir(item.path());
            if let Some(pid) = process::live_pid(&dir) {
                process::kill(pid, &dir).await;
            }
            let _ = std::fs::remove_dir_all(&dir.0);
        }
    }
}

/// A slot's command line: a boot's, with stand-ins for its disks and its own taps (any MAC
/// does: the guest takes its own from the config drive with its new identity).
fn qemu_args(shape: &Shape, image: &Cached, dir: &GuestDir, taps: &[String]) -> Vec<String> {
    let name = dir.0.file_name().unwrap_or_default().to_string_lossy();
    let blk = command_line::devices(image).1;
    let mut args = command_line::machine_args(
        &format!("warm-{name}"),
        shape.vcpus,
        shape.memory_mib,
        image,
        shape.accel,
        dir,
    );
    for (node, serial, read_only) in [("root", "vps-root", "off"), ("config", "vps-config", "on")] {
        args.extend([
            "-blockdev".into(),
            format!("driver=null-co,node-name={node}-empty,size=1048576,read-only={read_only}"),
            "-blockdev".into(),
            format!("driver=raw,node-name={node},file={node}-empty,read-only={read_only}"),
            "-device".into(),
            format!("{blk},drive={node},serial={serial}"),
        ]);
    }
    let macs: Vec<String> = (0..taps.len())
        .map(|i| format!("52:54:00:00:00:{:02x}", i % 256))
        .collect();
    let nics = taps
        .iter()
        .map(String::as_str)
        .zip(macs.iter().map(String::as_str));
    args.extend(command_line::nic_args(image, nics));
    args.extend(["-incoming".into(), "defer".into()]);
    args
}

impl WarmQemu {
    /// The QEMU's pid, now the guest's: dropping the slot no longer ends it.
    pub fn into_guest(mut self) -> i32 {
        std::mem::take(&mut self.pid)
    }
}

/// Connects to the QMP socket of a slot taken into a guest's directory.
pub async fn connect(slot: &WarmQemu) -> Result<Qmp, RuntimeError> {
    Qmp::connect(&slot.dir.qmp(), slot.dir.shutdown_event())
        .await
        .map_err(|e| RuntimeError(format!("the warm slot's QMP: {e}")))
}

/// Puts the guest's overlay and config drive (in `dir`, where the slot now is) under the
/// slot's disk nodes, in place of its stand-ins.
pub async fn attach_disks(qmp: &Qmp, dir: &GuestDir) -> Result<(), RuntimeError> {
    let file = |path: PathBuf, read_only: bool| {
        json!({ "driver": "file", "filename": path.to_string_lossy(),
                "read-only": read_only, "discard": "unmap" })
    };
    let root = json!({ "driver": "qcow2", "node-name": "root-image", "discard": "unmap",
                       "file": file(dir.disk(), false) });
    let mut config = file(dir.config_drive(), true);
    config["node-name"] = "config-image".into();
    let steps = [
        ("blockdev-add", root),
        ("blockdev-add", config),
        (
            "blockdev-reopen",
            json!({ "options": [
                { "driver": "raw", "node-name": "root", "file": "root-image",
                  "discard": "unmap" },
                { "driver": "raw", "node-name": "config", "file": "config-image",
                  "read-only": true },
            ] }),
        ),
        ("blockdev-del", json!({ "node-name": "root-empty" })),
        ("blockdev-del", json!({ "node-name": "config-empty" })),
    ];
    for (command, arguments) in steps {
        qmp.execute(command, Some(arguments))
            .await
            .map_err(|e| RuntimeError(format!("the warm slot's {command}: {e}")))?;
    }
    Ok(())
}

/// The gauge of slots waiting, from the list itself.
fn publish(waiting: &[WarmQemu]) {
    metrics::gauge!("vps_host_warm_restore_slots").set(waiting.len() as f64);
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
