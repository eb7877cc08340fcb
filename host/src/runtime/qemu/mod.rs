//! The `qemu` runtime: one QEMU process per guest, driven over QMP, with no daemon between.
//!
//! Each guest lives in `<state_dir>/guests/<id>/`: its record (`spec.json`), QMP socket,
//! console log, pid file, overlay disk, config drive and the exit records of `process`. That
//! directory is the whole truth, so a new [`Qemu`] (after an agent restart, even a `kill -9`)
//! re-adopts running guests by pid file and QMP socket without touching them.
//!
//! Layout: `qmp` (the QMP client), `process` (start, find, end a QEMU; how it ended),
//! `command_line` (what a QEMU is started with),
//! `images` (the image and snapshot cache), `disks` (qemu-img), `net` (bridge and taps),
//! `accel` (the KVM probe), `config_drive` (the NoCloud drive, written by `vps-guest-image`),
//! `snapshots` (snapshot archives and restores: read its docs for the design), `policy` (a
//! guest's network policy in nftables and tc), `allow` (which allow-list entries are names),
//! `dns` (the resolver for the domains of a policy's allow-list), `volumes` (the volume
//! store), `warm` (QEMUs started ahead of memory restores).

pub mod accel;
pub mod allow;
mod command_line;
mod config_drive;
mod disks;
pub mod dns;
mod images;
mod net;
pub mod policy;
mod process;
mod qmp;
mod snapshots;
mod tool;
mod volumes;
mod warm;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::Instrument;

pub use accel::{Accel, Chosen};
use images::{Cached, ImageCache, Pin};
use process::GuestDir;
use qmp::Qmp;

use super::{
    GuestSpec, GuestState, NetworkPolicy, Observed, RestoreSource, Runtime, RuntimeError,
    SnapshotFiles, VolumeAttachment, VolumeObserved, VolumeSpec,
};
use snapshots::Manifest;
use volumes::VolumeStore;

/// The `qemu` runtime. Cheap to share behind an `Arc`; calls for different guests run
/// concurrently, calls for one guest are serialised.
pub struct Qemu {
    state_dir: PathBuf,
    image_dir: PathBuf,
    images: ImageCache,
    accel: Accel,
    chosen: tokio::sync::OnceCell<Chosen>,
    /// `qemu_binary --version`, asked once: each snapshot's manifest names it.
    qemu_version: tokio::sync::OnceCell<String>,
    guests: Mutex<HashMap<String, Arc<Slot>>>,
    volume_store: VolumeStore,
    /// Serialises volume creation, growth and removal.
    volume_lock: tokio::sync::Mutex<()>,
    /// Answers the DNS of guests whose allow-list names domains.
    resolver: dns::Resolver,
    /// Where the resolver asks for allowed names (`dns_upstream`); `None`: the first
    /// `nameserver` of /etc/resolv.conf.
    pub dns_upstream: Option<SocketAddr>,
    /// The QEMU binary (`qemu-system-x86_64`).
    pub qemu_binary: PathBuf,
    /// How long `stop` waits for the guest to power off before it `quit`s QEMU.
    pub stop_timeout: Duration,
    /// How long a boot may show nothing on its console before it is killed and reported.
    pub boot_deadline: Duration,
    /// How long a new QEMU may take to answer on its QMP socket.
    pub start_timeout: Duration,
    /// How long `accel = "auto"` waits for its KVM probe boot.
    pub kvm_probe_timeout: Duration,
    /// How long saving or loading a memory snapshot may take.
    pub migration_timeout: Duration,
    /// How long a memory-restored guest has to take its new identity (`restored: identity N`
    /// on its console) before its links come up anyway.
    pub identity_timeout: Duration,
    /// The image cache's budget (`image_cache_max_bytes`): past it, entries no guest here
    /// needs go, least recently used first.
    pub image_cache_max_bytes: u64,
    /// How many QEMUs wait started for a memory restore (`restore_slots`; see `warm`).
    pub restore_slots: usize,
    warm: Arc<warm::WarmSlots>,
}

/// One guest: its directory, the lock that serialises operations on it, and what is known
/// without taking that lock.
struct Slot {
    dir: GuestDir,
    live: tokio::sync::Mutex<Live>,
    record: Mutex<Option<GuestRecord>>,
    last: Mutex<GuestState>,
}

/// The guest's running process, when there is one.
#[derive(Default)]
struct Live {
    qmp: Option<Qmp>,
    pid: Option<i32>,
}

impl Live {
    /// Forgets a QEMU that has ended, once its QMP reader has recorded how it ended.
    async fn forget_ended(&mut self) {
        self.pid = None;
        if let Some(qmp) = self.qmp.take() {
            // The socket closed with the process, so the reader ends at once.
            qmp.finish(Duration::from_secs(1)).await;
        }
    }
}

/// What the runtime keeps of a guest's spec in `spec.json`: enough to report it, to find its
/// taps and to answer `ssh_address` after a restart. User data is not kept here.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct GuestRecord {
    id: String,
    hostname: String,
    vcpus: u32,
    memory_mib: u64,
    disk_gib: u64,
    image_sha256: String,
    image_format: String,
    nics: Vec<NicRecord>,
    /// The identity generation its config drive carries (0 until a restore bumps it).
    #[serde(default)]
    identity_generation: u64,
    /// The digest of the snapshot archive it was restored from.
    #[serde(default)]
    restored_from: Option<String>,
    /// The network policy its taps carry.
    #[serde(default)]
    network: Option<NetworkPolicy>,
    /// The volumes it attaches.
    #[serde(default)]
    volumes: Vec<VolumeAttachment>,
}

/// A restore in progress: the unpacked, checked snapshot (kept in the cache while this
/// lives) and its manifest.
struct Restoring {
    dir: PathBuf,
    manifest: Manifest,
    sha256: String,
    _pin: Pin,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct NicRecord {
    bridge: String,
    mac: String,
    address: String,
    tap: String,
    /// The pool's gateway (the resolver listens there); absent from older records.
    #[serde(default)]
    gateway: Option<String>,
}

/// How long a QEMU whose QMP socket is gone may take to exit before it counts as broken.
const EXIT_GRACE: Duration = Duration::from_secs(3);

impl Qemu {
    /// A runtime keeping guests under `state_dir/guests` and images under `image_dir`. Nothing
    /// is probed or adopted yet: see [`Qemu::chosen_accel`] and [`Runtime::adopt`].
    pub fn new(
        state_dir: impl Into<PathBuf>,
        image_dir: impl Into<PathBuf>,
        accel: Accel,
    ) -> Result<Qemu, RuntimeError> {
        let state_dir = state_dir.into();
        let image_dir = image_dir.into();
        for dir in [state_dir.join("guests"), image_dir.clone()] {
            std::fs::create_dir_all(&dir)
                .map_err(|e| RuntimeError(format!("cannot make {}: {e}", dir.display())))?;
        }
        let chosen = match accel {
            Accel::Kvm => tokio::sync::OnceCell::new_with(Some(Chosen::Kvm)),
            Accel::Tcg => tokio::sync::OnceCell::new_with(Some(Chosen::Tcg)),
            // A probe made since the host booted still holds.
            Accel::Auto => tokio::sync::OnceCell::new_with(remembered_accel(&state_dir)),
        };
        let image_cache_max_bytes = images::default_budget(&image_dir);
        let warm = Arc::new(warm::WarmSlots::new(state_dir.join("warm")));
        Ok(Qemu {
            volume_store: VolumeStore(state_dir.join("volumes")),
            volume_lock: tokio::sync::Mutex::new(()),
            resolver: dns::Resolver::default(),
            dns_upstream: None,
            images: ImageCache::new(image_dir.clone()),
            state_dir,
            image_dir,
            accel,
            chosen,
            qemu_version: tokio::sync::OnceCell::new(),
            guests: Mutex::default(),
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            stop_timeout: Duration::from_secs(30),
            boot_deadline: Duration::from_secs(60),
            start_timeout: Duration::from_secs(10),
            kvm_probe_timeout: Duration::from_secs(10),
            migration_timeout: Duration::from_secs(300),
            identity_timeout: Duration::from_secs(60),
            image_cache_max_bytes,
            restore_slots: 1,
            warm,
        })
    }

    /// The acceleration guests run with, if already decided.
    pub fn accel(&self) -> Option<Chosen> {
        self.chosen.get().copied()
    }

    /// The acceleration guests run with, deciding it now if needed (`auto`: a probe boot of
    /// at most `kvm_probe_timeout`; the answer is remembered until the host reboots).
    pub async fn chosen_accel(&self) -> Chosen {
        *self
            .chosen
            .get_or_init(|| async {
                let kernels = accel::probe_kernels(&self.image_dir);
                let chosen = accel::choose(
                    &self.qemu_binary,
                    self.accel,
                    &kernels,
                    self.kvm_probe_timeout,
                )
                .await;
                remember_accel(&self.state_dir, chosen);
                chosen
            })
            .await
    }

    fn slot(&self, id: &str) -> Arc<Slot> {
        let mut guests = lock(&self.guests);
        guests
            .entry(id.to_owned())
            .or_insert_with(|| {
                Arc::new(Slot {
                    dir: GuestDir(self.state_dir.join("guests").join(id)),
                    live: tokio::sync::Mutex::default(),
                    record: Mutex::new(None),
                    last: Mutex::new(GuestState::Stopped),
                })
            })
            .clone()
    }

    fn existing_slot(&self, id: &str) -> Option<Arc<Slot>> {
        lock(&self.guests).get(id).cloned()
    }

    /// Every volume `volumes` names is in the store, and none is written by one guest while
    /// another runs with it (one writer, or any number of readers).
    fn check_volumes(&self, id: &str, volumes: &[VolumeAttachment]) -> Result<(), RuntimeError> {
        for v in volumes {
            if !self.volume_store.path(&v.volume_id).is_file() {
                return Err(RuntimeError(format!(
                    "volume {} is not on this host (ensure_volume makes it)",
                    v.volume_id
                )));
            }
            for (other, other_volume) in self.attachers(&v.volume_id) {
                if other == id
                    || !matches!(other_volume.1, GuestState::Running | GuestState::Paused)
                {
                    continue;
                }
                if !v.read_only || !other_volume.0 {
                    return Err(RuntimeError(format!(
                        "volume {} is attached to {other}, which runs with it{}: one writer at a time",
                        v.volume_id,
                        if other_volume.0 { " read-only" } else { " read-write" }
                    )));
                }
            }
        }
        Ok(())
    }

    /// The guests whose record attaches volume `volume_id`: (id, (read-only, last state)).
    fn attachers(&self, volume_id: &str) -> Vec<(String, (bool, GuestState))> {
        let slots: Vec<(String, Arc<Slot>)> = lock(&self.guests)
            .iter()
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect();
        slots
            .into_iter()
            .filter_map(|(id, slot)| {
                let read_only = lock(&slot.record)
                    .as_ref()?
                    .volumes
                    .iter()
                    .find(|a| a.volume_id == volume_id)?
                    .read_only;
                let state = lock(&slot.last).clone();
                Some((id, (read_only, state)))
            })
            .collect()
    }

    /// A running or paused guest whose spec names another network policy takes it at once.
    async fn update_network(&self, spec: &GuestSpec, slot: &Slot) -> Result<(), RuntimeError> {
        let Some(mut record) = lock(&slot.record).clone() else {
            return Ok(());
        };
        if record.network == spec.network {
            return Ok(());
        }
        record.network = spec.network.clone();
        self.apply_network(&record, &slot.dir).await?;
        let json = serde_json::to_vec_pretty(&record)
            .map_err(|e| RuntimeError(format!("guest record: {e}")))?;
        std::fs::write(slot.dir.record(), json)
            .map_err(|e| RuntimeError(format!("writing {}: {e}", slot.dir.record().display())))?;
        *lock(&slot.record) = Some(record);
        Ok(())
    }

    /// Applies the record's network policy to its taps, and has the resolver answer its
    /// domains; a guest with none has no tables (one that had a policy before loses it). A
    /// marker in the guest's directory says tables were made, so a guest that never had a
    /// policy costs no `nft` call on its boots.
    async fn apply_network(
        &self,
        record: &GuestRecord,
        dir: &GuestDir,
    ) -> Result<(), RuntimeError> {
        let marker = dir.0.join("network.applied");
        let Some(network) = &record.network else {
            self.resolver.forget(&record.id);
            if marker.exists() {
                policy::remove(&record.id).await?;
                let _ = std::fs::remove_file(&marker);
            }
            return Ok(());
        };
        let nics = policy_nics(record)?;
        // Marked first: tables half made by a failed apply are still removed later.
        std::fs::write(&marker, b"")
            .map_err(|e| RuntimeError(format!("cannot write {}: {e}", marker.display())))?;
        policy::apply(&record.id, &nics, network).await?;
        self.serve_dns(record)
    }

    /// Has the resolver answer guest `record`'s DNS by its allow-list, or not at all when the
    /// list names no domain.
    fn serve_dns(&self, record: &GuestRecord) -> Result<(), RuntimeError> {
        let Some(network) = record.network.as_ref().filter(|n| policy::resolving(n)) else {
            self.resolver.forget(&record.id);
            return Ok(());
        };
        let nics = policy_nics(record)?
            .into_iter()
            .filter_map(|n| Some((n.address, n.gateway?)))
            .collect();
        self.resolver.register(dns::Registration {
            id: &record.id,
            table: policy::table_name(&record.id),
            nics,
            patterns: allow::domains(&network.allow),
            upstream: self.dns_upstream,
        })
    }

    async fn ensure_volume_inner(
        &self,
        volume: &VolumeSpec,
    ) -> Result<VolumeObserved, RuntimeError> {
        volumes::validate_id(&volume.id)?;
        volumes::validate_serial(&volume.serial)?;
        let _held = self.volume_lock.lock().await;
        let path = self.volume_store.path(&volume.id);
        if !volumes::create_if_missing(&self.volume_store, volume).await? {
            let wanted = volume.size_gib.max(1).saturating_mul(volumes::GIB);
            let size = volumes::virtual_size(&path).await?;
            if size < wanted {
                self.grow(&volume.id, &path, wanted).await?;
            }
        }
        self.volume_observed(&volume.id).await
    }

    /// Grows a volume: through the QEMU of each guest running with it (QMP `block_resize`),
    /// else with `qemu-img resize`.
    async fn grow(&self, id: &str, path: &Path, bytes: u64) -> Result<(), RuntimeError> {
        let mut resized = false;
        for (guest, _) in self.attachers(id) {
            let Some(slot) = self.existing_slot(&guest) else {
                continue;
            };
            let mut live = slot.live.lock().await;
            if !matches!(
                self.refresh(&slot, &mut live).await,
                GuestState::Running | GuestState::Paused
            ) {
                continue;
            }
            let Some(qmp) = live.qmp.as_ref() else {
                continue;
            };
            qmp.execute(
                "block_resize",
                Some(serde_json::json!({ "device": id, "size": bytes })),
            )
            .await
            .map_err(|e| RuntimeError(format!("growing volume {id} in {guest}: {e}")))?;
            tracing::info!(volume = %id, %guest, bytes, "volume grown in a running guest");
            resized = true;
            // One QEMU writes it; a reader sees the new size at its next boot.
            break;
        }
        if !resized {
            volumes::resize_offline(path, bytes).await?;
            tracing::info!(volume = %id, bytes, "volume grown");
        }
        Ok(())
    }

    async fn volume_observed(&self, id: &str) -> Result<VolumeObserved, RuntimeError> {
        let path = self.volume_store.path(id);
        let size = volumes::virtual_size(&path).await?;
        Ok(VolumeObserved {
            id: id.to_owned(),
            size_gib: size.div_ceil(volumes::GIB),
            allocated_bytes: volumes::allocated_bytes(&path),
            attached_to: self
                .attachers(id)
                .into_iter()
                .map(|(guest, _)| guest)
                .collect(),
        })
    }

    async fn delete_volume_inner(&self, id: &str) -> Result<(), RuntimeError> {
        volumes::validate_id(id)?;
        let _held = self.volume_lock.lock().await;
        let attachers = self.attachers(id);
        if !attachers.is_empty() {
            let names: Vec<String> = attachers.into_iter().map(|(g, _)| g).collect();
            return Err(RuntimeError(format!(
                "volume {id} is attached to {}: delete those guests first",
                names.join(", ")
            )));
        }
        match tokio::fs::remove_file(self.volume_store.path(id)).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(RuntimeError(format!("removing volume {id}: {e}"))),
        }
    }

    /// Boots the guest: image, disk, config drive, taps, then QEMU. Any failure is also
    /// written to the guest's `error` file, so `observe` reports the same message.
    async fn boot(
        &self,
        spec: &GuestSpec,
        slot: &Slot,
        live: &mut Live,
        restore: Option<&Restoring>,
    ) -> Result<(), RuntimeError> {
        let result = self.boot_inner(spec, slot, live, restore).await;
        if let Err(error) = &result {
            if slot.dir.0.exists() {
                let _ = std::fs::write(slot.dir.error(), &error.0);
            }
            *lock(&slot.last) = GuestState::Error(error.0.clone());
        }
        result
    }

    async fn boot_inner(
        &self,
        spec: &GuestSpec,
        slot: &Slot,
        live: &mut Live,
        restore: Option<&Restoring>,
    ) -> Result<(), RuntimeError> {
        validate_id(&spec.id)?;
        volumes::validate_attachments(&spec.volumes)?;
        self.check_volumes(&spec.id, &spec.volumes)?;
        let preparing = Instant::now();
        let dir = &slot.dir;
        std::fs::create_dir_all(&dir.0)
            .map_err(|e| RuntimeError(format!("cannot make {}: {e}", dir.0.display())))?;
        check_fits_host(spec)?;
        if let Some(sockets) = dir.qmp().parent().filter(|p| *p != dir.0) {
            std::fs::create_dir_all(sockets)
                .map_err(|e| RuntimeError(format!("cannot make {}: {e}", sockets.display())))?;
        }
        let memory = restore.filter(|r| r.manifest.include_memory);
        let chosen = self.chosen_accel().await;
        // A memory restore takes a QEMU started ahead when one of its shape waits: it moves
        // into the (empty) directory now, and ends if this boot fails before it is attached.
        let shape = memory.and(warm::Shape::of(spec, chosen));
        let warm = shape.as_ref().and_then(|s| self.warm.take(s, dir));
        let warm_taps = warm.as_ref().map(|w| w.taps.clone()).unwrap_or_default();
        let previous = lock(&slot.record).clone().or_else(|| read_record(dir));
        let record = GuestRecord {
            identity_generation: match restore {
                Some(r) => r.manifest.identity_generation + 1,
                None => previous.as_ref().map_or(0, |p| p.identity_generation),
            },
            restored_from: match restore {
                Some(r) => Some(r.sha256.clone()),
                None => previous.and_then(|p| p.restored_from),
            },
            id: spec.id.clone(),
            hostname: spec.hostname.clone(),
            vcpus: spec.vcpus,
            memory_mib: spec.memory_mib,
            disk_gib: spec.disk_gib,
            image_sha256: spec.image.sha256.clone(),
            image_format: spec.image.format.clone(),
            nics: spec
                .nics
                .iter()
                .enumerate()
                .map(|(i, nic)| NicRecord {
                    bridge: nic.bridge.clone(),
                    mac: nic.mac.clone(),
                    address: nic.address.clone(),
                    tap: net::tap_name(&spec.id, i),
                    gateway: nic.gateway.clone(),
                })
                .collect(),
            network: spec.network.clone(),
            volumes: spec.volumes.clone(),
        };
        let json = serde_json::to_vec_pretty(&record)
            .map_err(|e| RuntimeError(format!("guest record: {e}")))?;
        std::fs::write(dir.record(), json)
            .map_err(|e| RuntimeError(format!("writing {}: {e}", dir.record().display())))?;
        *lock(&slot.record) = Some(record.clone());

        // Pinned until QEMU has opened it; the record written above keeps it from then on.
        let (image, _pin) = self.images.get(&spec.image).await?;
        self.prune_cache().await;
        if chosen == Chosen::Kvm {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/kvm")
                .map_err(|e| RuntimeError(format!("accel kvm: /dev/kvm: {e}")))?;
        }

        if let Some(memory) = memory {
            check_loadable(spec, &image, &memory.manifest, &self.cpu_model())?;
        }
        // The disk, the config drive and the taps are independent: they are made at the same
        // time, and each runs to its end (nothing is left half-made) before a failure counts.
        let disk = async {
            if let Some(restore) = restore {
                // A restore always starts from the snapshot's disk; a failed one leaves no disk.
                let _ = std::fs::remove_file(dir.disk());
                let base = restore.dir.join("disk.qcow2");
                disks::overlay_from_template(&base, &dir.disk(), spec.disk_gib).await
            } else if dir.disk().exists() {
                Ok(())
            } else {
                match &image {
                    Cached::Bundle {
                        rootfs: Some(base), ..
                    }
                    | Cached::Qcow2 { disk: base } => {
                        disks::overlay(base, &dir.disk(), spec.disk_gib).await
                    }
                    Cached::Bundle { rootfs: None, .. } => {
                        let blanks = self.state_dir.join("blanks");
                        disks::blank(&dir.disk(), spec.disk_gib, &blanks).await
                    }
                }
            }
        };
        let drive = dir.config_drive();
        let spec_copy = spec.clone();
        let generation = record.identity_generation;
        let fresh = match restore {
            Some(_) => Some(snapshots::fresh_identity(&spec.hostname)?),
            None => None,
        };
        let source_drive = restore.map(|r| r.dir.join("config.img"));
        let gateway = spec
            .nics
            .first()
            .and_then(|n| n.gateway.as_deref())
            .and_then(|g| g.split('/').next()?.parse().ok());
        let upstream = self.dns_upstream.or_else(dns::system_upstream);
        let nameserver = dns::guest_nameserver(spec.network.as_ref(), gateway, upstream);
        let drive = async move {
            tokio::task::spawn_blocking(move || {
                config_drive::write(&spec_copy, &drive, generation, fresh, nameserver)?;
                match source_drive.and_then(|d| std::fs::metadata(d).ok()) {
                    Some(source) => snapshots::pad_to(&drive, source.len()),
                    None => Ok(()),
                }
            })
            .await
            .map_err(|e| RuntimeError(format!("config drive: {e}")))?
        };
        let taps = async {
            for (i, (nic, nic_record)) in spec.nics.iter().zip(&record.nics).enumerate() {
                if let Some(made) = warm_taps.get(i) {
                    net::rename_tap(made, &nic_record.tap).await?;
                }
                net::ensure_tap(&nic_record.tap, nic).await?;
            }
            Ok::<(), RuntimeError>(())
        };
        // A QEMU started ahead loads the state meanwhile: its disks take the guest's files
        // only once they are made, before it runs. A failure below drops it, which ends it.
        let warmed = warm.is_some();
        let loading = async {
            let (Some(slot), Some(memory)) = (warm, memory) else {
                return Ok(None);
            };
            let qmp = warm::connect(&slot).await?;
            let state = memory.dir.join("memory.state");
            let loaded = snapshots::load_memory(&qmp, &state, self.migration_timeout).await?;
            Ok::<_, RuntimeError>(Some((qmp, slot, loaded)))
        };
        let made = async {
            let (disk, drive, taps) = tokio::join!(disk, drive, taps);
            disk?;
            drive?;
            taps?;
            let made_ms = preparing.elapsed().as_millis() as u64;
            // Its rules are made while it loads, too (see `network` below for why that holds).
            let network = match warmed {
                true => Some(self.apply_network(&record, dir).await),
                false => None,
            };
            Ok::<_, RuntimeError>((made_ms, network))
        };
        let (loaded, made) = tokio::join!(loading, made);
        let (made_ms, network_applied) = made?;
        let loaded = match loaded {
            Ok(loaded) => loaded,
            Err(error) => {
                let _ = std::fs::remove_file(dir.disk());
                return Err(error);
            }
        };

        let mut args = qemu_args(spec, &record, &image, chosen, dir, &self.volume_store);
        if memory.is_some() {
            args.extend(["-incoming".into(), "defer".into()]);
        }
        let _ = std::fs::remove_file(dir.memory_restored());
        // A boot takes the config drive's identity in its `/init`.
        let _ = std::fs::remove_file(dir.identity_pending());
        let started = Instant::now();
        let spawn = async {
            let (qmp, pid, loaded) = match loaded {
                Some((qmp, slot, loaded)) => {
                    warm::attach_disks(&qmp, dir).await?;
                    (qmp, slot.into_guest(), Some(loaded))
                }
                None => {
                    let (qmp, pid) =
                        process::spawn(&self.qemu_binary, &args, dir, self.start_timeout).await?;
                    (qmp, pid, None)
                }
            };
            tracing::info!(pid, accel = %chosen, restore = restore.is_some(), warmed, "guest started");
            if let Some(memory) = memory {
                let resumed = self.resume_restored(&qmp, &record, memory, dir, loaded);
                if let Err(error) = resumed.await {
                    drop(qmp);
                    process::kill(pid, dir).await;
                    return Err(error);
                }
            }
            Ok((qmp, pid))
        };
        let network = async {
            let applied = match network_applied {
                Some(applied) => applied,
                None => self.apply_network(&record, dir).await,
            };
            tracing::info!(
                made_ms,
                prepared_ms = preparing.elapsed().as_millis() as u64,
                "guest prepared (disk, config drive and taps made; network applied)"
            );
            applied
        };
        let (network, spawned) = if memory.is_some() {
            // Its QEMU loads the state, and the guest then runs with its links down until it
            // has its identity, which waits for this boot to end: nothing of it reaches its
            // taps before the rules do, and they are made while it loads.
            let (network, spawned) = tokio::join!(network, spawn);
            (network, Some(spawned))
        } else {
            // Before QEMU opens the taps: no packet leaves the guest unfiltered.
            let network = network.await;
            let spawned = match network {
                Ok(()) => Some(spawn.await),
                Err(_) => None,
            };
            (network, spawned)
        };
        let (qmp, pid) = match (network, spawned) {
            (Ok(()), Some(Ok(spawned))) => spawned,
            (network, spawned) => {
                let spawn_error = match spawned {
                    Some(Ok((qmp, pid))) => {
                        drop(qmp);
                        process::kill(pid, dir).await;
                        None
                    }
                    Some(Err(error)) => Some(error),
                    None => None,
                };
                if restore.is_some() {
                    let _ = std::fs::remove_file(dir.disk());
                }
                return Err(match network {
                    Err(error) => error,
                    Ok(()) => {
                        spawn_error.unwrap_or_else(|| RuntimeError("QEMU did not start".into()))
                    }
                });
            }
        };
        live.qmp = Some(qmp);
        live.pid = Some(pid);
        *lock(&slot.last) = GuestState::Running;
        if memory.is_none() {
            tokio::spawn(watch_boot(dir.clone(), pid, started, self.boot_deadline));
        }
        if memory.is_some() {
            let how = if warmed { "warm" } else { "started" };
            metrics::counter!("vps_host_memory_restores_total", "qemu" => how).increment(1);
        }
        if let Some(shape) = shape {
            // Another restore of this shape (the rest of a fork) is likely: one waits for it,
            // started once this one's report and its guest's first moments have had the CPU.
            self.fill_warm(shape, image, Duration::from_secs(1));
        }
        Ok(())
    }

    /// How many QEMUs wait started for a memory restore (see `warm`).
    pub fn warm_restore_slots(&self) -> usize {
        self.warm.waiting()
    }

    /// Ends the QEMUs waiting for a memory restore, and those starting once started: they
    /// would otherwise run until this runtime is dropped.
    pub async fn end_warm_restore_slots(&self) {
        self.warm.clear(self.start_timeout).await;
    }

    /// Starts a warm restore slot of `shape` in the background, `after` from now (see `warm`).
    fn fill_warm(&self, shape: warm::Shape, image: Cached, after: Duration) {
        let (slots, qemu) = (self.warm.clone(), self.qemu_binary.clone());
        let (max, timeout) = (self.restore_slots, self.start_timeout);
        tokio::spawn(async move { slots.fill(&qemu, shape, image, max, after, timeout).await });
    }

    /// Loads a memory snapshot into a QEMU started with `-incoming defer`, and resumes it
    /// with its links down until it has taken its new identity (see `snapshots`).
    async fn resume_restored(
        &self,
        qmp: &Qmp,
        record: &GuestRecord,
        restore: &Restoring,
        dir: &GuestDir,
        loaded: Option<Duration>,
    ) -> Result<(), RuntimeError> {
        let loaded = match loaded {
            Some(loaded) => loaded,
            None => {
                let state = restore.dir.join("memory.state");
                snapshots::load_memory(qmp, &state, self.migration_timeout).await?
            }
        };
        metrics::histogram!("vps_host_restore_load_seconds").record(loaded.as_secs_f64());
        // The guest was saved paused, so it stays paused once loaded.
        let qmp_error = |e: qmp::QmpError| RuntimeError(format!("resuming the restore: {e}"));
        let links: Vec<String> = (0..record.nics.len()).map(|i| format!("net{i}")).collect();
        for link in &links {
            qmp.execute(
                "set_link",
                Some(serde_json::json!({ "name": link, "up": false })),
            )
            .await
            .map_err(qmp_error)?;
        }
        // From here the guest lives: never kill a boot that merely prints nothing.
        let _ = std::fs::write(dir.memory_restored(), restore.sha256.as_bytes());
        if !links.is_empty() {
            std::fs::write(dir.identity_pending(), b"")
                .map_err(|e| RuntimeError(format!("{}: {e}", dir.identity_pending().display())))?;
        }
        qmp.execute("cont", None).await.map_err(qmp_error)?;
        tracing::info!(load_ms = loaded.as_millis() as u64, "restore loaded");
        Ok(())
    }

    async fn snapshot_inner(
        &self,
        id: &str,
        include_memory: bool,
        out_dir: &Path,
    ) -> Result<SnapshotFiles, RuntimeError> {
        validate_id(id)?;
        let slot = self
            .existing_slot(id)
            .ok_or_else(|| RuntimeError(format!("no guest {id} on this host")))?;
        std::fs::create_dir_all(out_dir)
            .map_err(|e| RuntimeError(format!("cannot make {}: {e}", out_dir.display())))?;
        let work = snapshots::work_dir(out_dir, id);
        std::fs::create_dir_all(&work)
            .map_err(|e| RuntimeError(format!("cannot make {}: {e}", work.display())))?;
        let result = self.snapshot_into(&slot, include_memory, &work).await;
        // Measured before the partial files go: a snapshot that filled the disk says so.
        let result = result.map_err(|e| RuntimeError(crate::disk::explain_full(e.0, out_dir)));
        if result.is_err() {
            let _ = tokio::fs::remove_dir_all(&work).await;
        }
        result
    }

    async fn snapshot_into(
        &self,
        slot: &Slot,
        include_memory: bool,
        work: &Path,
    ) -> Result<SnapshotFiles, RuntimeError> {
        let dir = &slot.dir;
        let overlay = work.join("overlay.qcow2");
        let (record, paused, qemu_save) = {
            let mut live = slot.live.lock().await;
            let state = self.refresh(slot, &mut live).await;
            let record = lock(&slot.record)
                .clone()
                .or_else(|| read_record(dir))
                .ok_or_else(|| RuntimeError("the guest has no record".into()))?;
            let running = match (&state, include_memory) {
                (GuestState::Running, _) => true,
                (GuestState::Paused, _) => false,
                // Nothing writes the disk of a stopped guest: copy it as it is.
                (GuestState::Stopped, false) => false,
                (GuestState::Stopped, true) => {
                    return Err(RuntimeError(
                        "a stopped guest has no memory to snapshot".into(),
                    ))
                }
                (GuestState::Error(why), _) => {
                    return Err(RuntimeError(format!("the guest is in error: {why}")))
                }
            };
            let frozen_at = Instant::now();
            if running {
                execute(&live, "stop").await?;
            }
            let frozen = async {
                let mut qemu_save = None;
                if include_memory {
                    let qmp = live
                        .qmp
                        .as_ref()
                        .ok_or_else(|| RuntimeError("QMP: not connected".into()))?;
                    let memory = work.join("memory.state");
                    qemu_save =
                        Some(snapshots::save_memory(qmp, &memory, self.migration_timeout).await?);
                }
                snapshots::copy(&dir.disk(), &overlay).await?;
                // The last file made before `cont`: `bench snapshot` reads its time as the
                // moment the snapshot was taken.
                snapshots::copy(&dir.config_drive(), &work.join("config.img")).await?;
                Ok::<_, RuntimeError>(qemu_save)
            }
            .await;
            // What ran before runs again, even when the save failed.
            let resumed = match running {
                true => execute(&live, "cont").await,
                false => Ok(()),
            };
            let paused = frozen_at.elapsed();
            if running {
                metrics::histogram!("vps_host_snapshot_pause_seconds").record(paused.as_secs_f64());
            }
            let qemu_save = match (frozen, resumed) {
                (Ok(save), Ok(())) => save,
                (Err(error), _) => {
                    // A guest that died mid-save is an error of the snapshot and the guest.
                    self.refresh(slot, &mut live).await;
                    return Err(error);
                }
                (Ok(_), Err(error)) => {
                    return Err(RuntimeError(format!(
                        "the snapshot was taken but the guest did not resume: {error}"
                    )))
                }
            };
            (
                record,
                if running { paused } else { Duration::ZERO },
                qemu_save,
            )
        };
        let flattening = Instant::now();
        snapshots::flatten(&overlay, &work.join("disk.qcow2")).await?;
        let _ = tokio::fs::remove_file(&overlay).await;
        let flattened = flattening.elapsed();
        let cpu_model = self.cpu_model();
        let manifest = Manifest {
            format: 1,
            source: record.id.clone(),
            include_memory,
            cpu_model: cpu_model.clone(),
            machine: machine_of(&record.image_format).to_owned(),
            vcpus: record.vcpus,
            memory_mib: record.memory_mib,
            disk_gib: record.disk_gib,
            image_sha256: record.image_sha256.clone(),
            image_format: record.image_format.clone(),
            identity_generation: record.identity_generation,
            qemu_version: self
                .qemu_version
                .get_or_init(|| snapshots::qemu_version(&self.qemu_binary))
                .await
                .clone(),
        };
        snapshots::write_manifest(work, &manifest)?;
        // A restore of it (or a fork) is likely next: a QEMU of its shape starts while the
        // archive uploads.
        if let Some((shape, image)) = self.shape_of_source(&manifest) {
            self.fill_warm(shape, image, Duration::ZERO);
        }
        let mut files = SnapshotFiles {
            dir: work.to_owned(),
            names: snapshots::archive_names(include_memory),
            size_bytes: 0,
            include_memory,
            cpu_model: include_memory.then_some(cpu_model),
            paused_ms: paused.as_millis() as u64,
            qemu_save_ms: qemu_save.map(|d| d.as_millis() as u64),
        };
        files.size_bytes = crate::runtime::archive::len(&files)?;
        tracing::info!(paused_ms = files.paused_ms, qemu_save_ms = ?files.qemu_save_ms,
            flatten_ms = flattened.as_millis() as u64, size_bytes = files.size_bytes,
            "snapshot taken");
        Ok(files)
    }

    async fn restore_inner(
        &self,
        spec: &GuestSpec,
        from: &RestoreSource,
    ) -> Result<(), RuntimeError> {
        validate_id(&spec.id)?;
        let slot = self.slot(&spec.id);
        let mut live = slot.live.lock().await;
        // Made already (restored before, then stopped or paused): an ordinary guest now.
        if slot.dir.disk().exists() {
            return self.run_locked(spec, &slot, &mut live).await;
        }
        let fetching = Instant::now();
        let fetched = async {
            let (dir, pin) = self.images.snapshot(from).await?;
            let manifest = Manifest::read(&dir)?;
            if manifest.include_memory {
                // Before anything boots: a state saved under another CPU model cannot load.
                let here = {
                    self.chosen_accel().await;
                    self.cpu_model()
                };
                if manifest.cpu_model != here {
                    return Err(RuntimeError(format!(
                        "memory snapshot {} was taken on CPU model {:?}; this host runs {here:?}",
                        from.snapshot_id, manifest.cpu_model
                    )));
                }
            }
            Ok(Restoring {
                dir,
                manifest,
                sha256: from.sha256.to_ascii_lowercase(),
                _pin: pin,
            })
        }
        .await;
        self.prune_cache().await;
        let restoring = match fetched {
            Ok(restoring) => restoring,
            Err(error) => {
                if slot.dir.0.exists() || std::fs::create_dir_all(&slot.dir.0).is_ok() {
                    let _ = std::fs::write(slot.dir.error(), &error.0);
                }
                *lock(&slot.last) = GuestState::Error(error.0.clone());
                return Err(error);
            }
        };
        end_broken(&slot.dir, &mut live).await?;
        let fetched_ms = fetching.elapsed().as_millis() as u64;
        let booting = Instant::now();
        let booted = self.boot(spec, &slot, &mut live, Some(&restoring)).await;
        tracing::info!(
            fetched_ms,
            boot_ms = booting.elapsed().as_millis() as u64,
            "restore done"
        );
        drop(live);
        if booted.is_ok() {
            self.await_identity(&slot);
        }
        booted
    }

    /// For a memory restore resumed with its links down (see `snapshots`): waits beside it
    /// for its guest to take its new identity, then brings its links up and drops the pending
    /// mark. The guest runs, and is reported, meanwhile; `identityRebound` once the mark is
    /// gone (never, for a guest that did not take it).
    fn await_identity(&self, slot: &Arc<Slot>) {
        if !slot.dir.identity_pending().exists() {
            return;
        }
        let Some(record) = lock(&slot.record).clone() else {
            return;
        };
        let slot = slot.clone();
        let timeout = self.identity_timeout;
        tokio::spawn(async move {
            let waiting = Instant::now();
            let generation = record.identity_generation;
            let taken =
                snapshots::wait_reidentified(&slot.dir.console(), generation, timeout).await;
            if !taken && slot.dir.0.exists() {
                tracing::warn!(guest = %record.id, generation, ?timeout,
                    "the restored guest did not take its new identity; its links come up anyway");
            }
            let live = slot.live.lock().await;
            // Gone or stopped meanwhile: its next boot has its links up.
            let Some(qmp) = live.qmp.as_ref() else { return };
            for i in 0..record.nics.len() {
                let up = serde_json::json!({ "name": format!("net{i}"), "up": true });
                if let Err(e) = qmp.execute("set_link", Some(up)).await {
                    tracing::warn!(guest = %record.id, error = %e, "the restore's links stay down");
                    return;
                }
            }
            // Reported from here on: reachable, under its own identity.
            if taken {
                let _ = std::fs::remove_file(slot.dir.identity_pending());
            }
            tracing::info!(guest = %record.id, taken,
                identity_ms = waiting.elapsed().as_millis() as u64, "restore reidentified");
        });
    }

    /// The guest's state now, reconnecting to a live QEMU if needed. Takes the guest's lock.
    async fn refresh(&self, slot: &Slot, live: &mut Live) -> GuestState {
        let state = self.refresh_inner(slot, live).await;
        *lock(&slot.last) = state.clone();
        state
    }

    async fn refresh_inner(&self, slot: &Slot, live: &mut Live) -> GuestState {
        let dir = &slot.dir;
        let pid = live
            .pid
            .filter(|&pid| process::is_alive(pid, dir))
            .or_else(|| process::live_pid(dir));
        let Some(pid) = pid else {
            live.forget_ended().await;
            return process::ended(dir).await;
        };
        live.pid = Some(pid);
        if live.qmp.as_ref().is_none_or(Qmp::is_closed) {
            match Qmp::connect(&dir.qmp(), dir.shutdown_event()).await {
                Ok(qmp) => live.qmp = Some(qmp),
                Err(error) => {
                    metrics::counter!("vps_host_qmp_errors_total").increment(1);
                    live.qmp = None;
                    // It may be exiting: QEMU removes its socket before the process ends
                    // (a guest that powered itself off), so give it a moment to go.
                    if process::wait_gone(pid, dir, EXIT_GRACE).await {
                        return process::ended(dir).await;
                    }
                    return GuestState::Error(format!(
                        "QEMU (pid {pid}) runs but its QMP socket fails: {error}"
                    ));
                }
            }
        }
        let Some(qmp) = live.qmp.as_ref() else {
            return GuestState::Error("no QMP connection".into());
        };
        match qmp.query_status().await {
            Ok(status) => match status.status.as_str() {
                "running" => GuestState::Running,
                // `postmigrate`: a paused guest whose memory snapshot was taken.
                "paused" | "prelaunch" | "suspended" | "postmigrate" | "inmigrate" => {
                    GuestState::Paused
                }
                other if status.running => {
                    tracing::debug!(status = other, "QEMU reports a running state");
                    GuestState::Running
                }
                // The guest powered itself off (or reset, which `-no-reboot` makes an exit):
                // QEMU is on its way out. How it ended is read from its exit records once it
                // has gone; asked a moment earlier, it is not an error.
                "shutdown" if process::wait_gone(pid, dir, EXIT_GRACE).await => {
                    live.forget_ended().await;
                    process::ended(dir).await
                }
                other => {
                    let console = std::fs::read_to_string(dir.console()).unwrap_or_default();
                    GuestState::Error(process::with_console(
                        format!("QEMU reports the VM {other}"),
                        &console,
                    ))
                }
            },
            Err(error) => {
                if process::wait_gone(pid, dir, Duration::from_millis(500)).await {
                    live.forget_ended().await;
                    return process::ended(dir).await;
                }
                live.qmp = None;
                GuestState::Error(format!("QEMU (pid {pid}) does not answer on QMP: {error}"))
            }
        }
    }

    fn observed(&self, id: &str, slot: &Slot, state: GuestState) -> Observed {
        let addresses = lock(&slot.record)
            .as_ref()
            .map(|r| r.nics.iter().map(|n| n.address.clone()).collect())
            .unwrap_or_default();
        Observed {
            id: id.to_owned(),
            state,
            addresses,
        }
    }

    /// Waits until the guest shows a sign of life on its console (or `boot_deadline`).
    async fn wait_for_life(&self, slot: &Slot, pid: i32) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.boot_deadline;
        loop {
            if has_life(&slot.dir) {
                return Ok(());
            }
            if !process::is_alive(pid, &slot.dir) {
                let why = match process::exit_state(&slot.dir) {
                    GuestState::Error(message) => message,
                    _ => "the guest ended while booting".to_owned(),
                };
                return Err(RuntimeError(why));
            }
            if Instant::now() > deadline {
                return Err(RuntimeError(format!(
                    "the guest showed no sign of life within {:?}",
                    self.boot_deadline
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the guest accepts a connection on `address` (its sshd), or `boot_deadline`
    /// passes: then it goes on with a warning, as an image may run no sshd at all.
    async fn wait_for_service(
        &self,
        slot: &Slot,
        pid: i32,
        address: (IpAddr, u16),
    ) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.boot_deadline;
        let target = std::net::SocketAddr::from(address);
        loop {
            let attempt = Duration::from_millis(500);
            if let Ok(Ok(_)) =
                tokio::time::timeout(attempt, tokio::net::TcpStream::connect(target)).await
            {
                return Ok(());
            }
            if !process::is_alive(pid, &slot.dir) {
                return Err(RuntimeError("the guest ended while booting".into()));
            }
            if Instant::now() > deadline {
                tracing::warn!(%target, "the guest's sshd did not answer while booting; pausing it anyway");
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn run_inner(&self, spec: &GuestSpec) -> Result<(), RuntimeError> {
        let slot = self.slot(&spec.id);
        let mut live = slot.live.lock().await;
        self.run_locked(spec, &slot, &mut live).await
    }

    async fn run_locked(
        &self,
        spec: &GuestSpec,
        slot: &Slot,
        live: &mut Live,
    ) -> Result<(), RuntimeError> {
        match self.refresh(slot, live).await {
            GuestState::Running => self.update_network(spec, slot).await,
            GuestState::Paused => {
                self.update_network(spec, slot).await?;
                execute(live, "cont").await?;
                *lock(&slot.last) = GuestState::Running;
                Ok(())
            }
            GuestState::Stopped | GuestState::Error(_) => {
                end_broken(&slot.dir, live).await?;
                self.boot(spec, slot, live, None).await
            }
        }
    }

    async fn pause_inner(&self, spec: &GuestSpec) -> Result<(), RuntimeError> {
        let slot = self.slot(&spec.id);
        let mut live = slot.live.lock().await;
        match self.refresh(&slot, &mut live).await {
            GuestState::Paused => return Ok(()),
            GuestState::Running => {}
            GuestState::Stopped | GuestState::Error(_) => {
                end_broken(&slot.dir, &mut live).await?;
                self.boot(spec, &slot, &mut live, None).await?;
                // Freeze a guest that is booting, not one that has not begun.
                let pid = live
                    .pid
                    .ok_or_else(|| RuntimeError("the guest has no process".into()))?;
                self.wait_for_life(&slot, pid).await?;
                // A guest paused before its sshd listens would make a warm claim wait for the
                // rest of its boot: freeze it once it serves.
                if let Some(address) = self.ssh_address(&spec.id) {
                    self.wait_for_service(&slot, pid, address).await?;
                }
            }
        }
        execute(&live, "stop").await?;
        *lock(&slot.last) = GuestState::Paused;
        Ok(())
    }

    async fn stop_inner(&self, id: &str) -> Result<(), RuntimeError> {
        let Some(slot) = self.existing_slot(id) else {
            return Ok(());
        };
        let mut live = slot.live.lock().await;
        let dir = slot.dir.clone();
        let state = self.refresh(&slot, &mut live).await;
        if dir.0.exists() {
            let _ = std::fs::write(dir.stop_requested(), b"");
            let _ = std::fs::remove_file(dir.error());
        }
        let Some(pid) = live.pid else {
            *lock(&slot.last) = GuestState::Stopped;
            return Ok(());
        };
        // A paused guest cannot see the power button.
        if state == GuestState::Paused {
            let _ = execute(&live, "cont").await;
        }
        let mut gone = false;
        if execute(&live, "system_powerdown").await.is_ok() {
            gone = process::wait_gone(pid, &dir, self.stop_timeout).await;
        }
        if !gone {
            tracing::info!(timeout = ?self.stop_timeout, "no power-off in time; quitting QEMU");
            let _ = execute(&live, "quit").await;
            gone = process::wait_gone(pid, &dir, Duration::from_secs(3)).await;
        }
        if !gone {
            process::kill(pid, &dir).await;
        }
        live.forget_ended().await;
        if process::is_alive(pid, &dir) {
            return Err(RuntimeError(format!("QEMU (pid {pid}) does not end")));
        }
        *lock(&slot.last) = GuestState::Stopped;
        Ok(())
    }

    async fn delete_inner(&self, id: &str) -> Result<(), RuntimeError> {
        validate_id(id)?;
        let slot = self.slot(id);
        let mut live = slot.live.lock().await;
        let dir = slot.dir.clone();
        if dir.0.exists() {
            let _ = std::fs::write(dir.stop_requested(), b"");
        }
        live.qmp = None;
        let pid = live.pid.take().or_else(|| process::live_pid(&dir));
        if let Some(pid) = pid {
            process::kill(pid, &dir).await;
            if process::is_alive(pid, &dir) {
                return Err(RuntimeError(format!("QEMU (pid {pid}) does not end")));
            }
        }
        let record = lock(&slot.record).clone().or_else(|| read_record(&dir));
        let taps: Vec<String> = match record {
            Some(record) => record.nics.into_iter().map(|n| n.tap).collect(),
            // Tap names are derived from the id: without a record, try the first few.
            None => (0..4).map(|i| net::tap_name(id, i)).collect(),
        };
        for tap in taps {
            net::remove_tap(&tap).await?;
        }
        policy::remove(id).await?;
        self.resolver.forget(id);
        // A socket kept outside the directory (a deep state directory) goes too.
        let _ = tokio::fs::remove_file(dir.qmp()).await;
        match tokio::fs::remove_dir_all(&dir.0).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(RuntimeError(format!("removing {}: {e}", dir.0.display()))),
        }
        drop(live);
        lock(&self.guests).remove(id);
        // What only this guest needed may go now.
        self.prune_cache().await;
        Ok(())
    }

    /// The shape of a restore of the memory snapshot `manifest` describes, taken of a guest
    /// here, and its image; none when the image is not cached or the source is gone.
    fn shape_of_source(&self, manifest: &Manifest) -> Option<(warm::Shape, Cached)> {
        if !manifest.include_memory {
            return None;
        }
        let source = self.existing_slot(&manifest.source)?;
        let nics = lock(&source.record).as_ref()?.nics.len();
        let image = self
            .images
            .cached_image(&manifest.image_sha256, &manifest.image_format)?;
        let shape = warm::Shape::new(
            (&manifest.image_sha256, &manifest.image_format),
            manifest.vcpus,
            manifest.memory_mib,
            nics,
            self.accel()?,
        );
        Some((shape, image))
    }

    /// Bounds the image cache to `image_cache_max_bytes`, keeping what guests here need.
    async fn prune_cache(&self) {
        self.images
            .prune(self.image_cache_max_bytes, || self.cache_in_use())
            .await;
    }

    /// The cache entries a guest of this host needs: its image (a bundle's kernel, the base of
    /// its overlay) and the snapshot it was restored from (the base of a restore's overlay),
    /// as the records on disk say, so a stopped guest keeps them too.
    fn cache_in_use(&self) -> HashSet<images::Entry> {
        let mut in_use = HashSet::new();
        let guests = std::fs::read_dir(self.state_dir.join("guests"));
        for item in guests.into_iter().flatten().flatten() {
            let Some(record) = read_record(&GuestDir(item.path())) else {
                continue;
            };
            in_use.insert(images::Entry::Image(
                record.image_sha256.to_ascii_lowercase(),
            ));
            if let Some(sha256) = record.restored_from {
                in_use.insert(images::Entry::Snapshot(sha256.to_ascii_lowercase()));
            }
        }
        in_use
    }
}

impl Runtime for Qemu {
    fn name(&self) -> &'static str {
        "qemu"
    }

    fn cpu_model(&self) -> String {
        self.accel()
            .map_or_else(|| "unknown".to_owned(), cpu_model_of)
    }

    async fn adopt(&self) -> Vec<Observed> {
        // Slots an earlier runtime left: their QEMUs never ran a guest.
        self.warm.clear(Duration::ZERO).await;
        let guests_dir = self.state_dir.join("guests");
        let mut ids: Vec<String> = std::fs::read_dir(&guests_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        ids.sort();
        let mut observed = Vec::new();
        for id in ids {
            let dir = GuestDir(guests_dir.join(&id));
            let Some(record) = read_record(&dir) else {
                // A directory with no record never got past its first step: nothing runs there.
                tracing::warn!(dir = %dir.0.display(), "removing a guest directory with no record");
                let _ = self.delete_inner(&id).await;
                continue;
            };
            let slot = self.slot(&id);
            // Its tables are still there; the resolver its list needs starts again.
            if let Err(e) = self.serve_dns(&record) {
                tracing::warn!(guest = %id, error = %e.0, "the guest's names cannot be resolved");
            }
            *lock(&slot.record) = Some(record);
            let mut live = slot.live.lock().await;
            let state = self.refresh(&slot, &mut live).await;
            if let Some(pid) = live.pid {
                tracing::info!(guest = %id, pid, ?state, "adopted a running guest");
                if !has_life(&dir) {
                    let started = started_at(&dir);
                    tokio::spawn(watch_boot(dir.clone(), pid, started, self.boot_deadline));
                }
            }
            drop(live);
            // A restore whose identity was awaited by the agent before this one.
            self.await_identity(&slot);
            observed.push(self.observed(&id, &slot, state));
        }
        // At start: a cache over its budget (a lower one configured) shrinks now.
        self.prune_cache().await;
        observed
    }

    async fn run(&self, spec: &GuestSpec) -> Result<(), RuntimeError> {
        let span = tracing::info_span!("guest.run", guest = %spec.id);
        self.run_inner(spec).instrument(span).await
    }

    async fn stop(&self, id: &str) -> Result<(), RuntimeError> {
        let span = tracing::info_span!("guest.stop", guest = %id);
        self.stop_inner(id).instrument(span).await
    }

    async fn pause(&self, spec: &GuestSpec) -> Result<(), RuntimeError> {
        let span = tracing::info_span!("guest.pause", guest = %spec.id);
        self.pause_inner(spec).instrument(span).await
    }

    async fn delete(&self, id: &str) -> Result<(), RuntimeError> {
        let span = tracing::info_span!("guest.delete", guest = %id);
        self.delete_inner(id).instrument(span).await
    }

    async fn observe(&self) -> Vec<Observed> {
        let slots: Vec<(String, Arc<Slot>)> = lock(&self.guests)
            .iter()
            .map(|(id, slot)| (id.clone(), slot.clone()))
            .collect();
        // Each guest's QMP round trip at once: a look at many guests costs about one.
        let mut observed = futures::future::join_all(slots.iter().map(|(id, slot)| async move {
            // A guest busy with an operation (a download, a stop) reports what it last was.
            let state = match slot.live.try_lock() {
                Ok(mut live) => self.refresh(slot, &mut live).await,
                Err(_) => lock(&slot.last).clone(),
            };
            self.observed(id, slot, state)
        }))
        .await;
        observed.sort_by(|a, b| a.id.cmp(&b.id));
        observed
    }

    async fn ensure_volume(&self, volume: &VolumeSpec) -> Result<VolumeObserved, RuntimeError> {
        let span = tracing::info_span!("volume.ensure", volume = %volume.id);
        self.ensure_volume_inner(volume).instrument(span).await
    }

    async fn delete_volume(&self, id: &str) -> Result<(), RuntimeError> {
        let span = tracing::info_span!("volume.delete", volume = %id);
        self.delete_volume_inner(id).instrument(span).await
    }

    async fn volumes(&self) -> Vec<VolumeObserved> {
        let mut observed = Vec::new();
        for id in self.volume_store.ids() {
            match self.volume_observed(&id).await {
                Ok(volume) => observed.push(volume),
                Err(error) => tracing::warn!(volume = %id, %error, "cannot read a volume"),
            }
        }
        observed
    }

    fn powered_itself_off(&self, id: &str) -> bool {
        let Some(slot) = self.existing_slot(id) else {
            return false;
        };
        let dir = &slot.dir;
        // `exit_state` reads a stop the runtime asked for as stopped too: that is not this.
        process::live_pid(dir).is_none()
            && !dir.stop_requested().exists()
            && process::exit_state(dir) == GuestState::Stopped
    }

    fn identity_pending(&self, id: &str) -> bool {
        self.existing_slot(id)
            .is_some_and(|slot| slot.dir.identity_pending().exists())
    }

    fn cpu_seconds(&self, id: &str) -> Option<f64> {
        process::cpu_seconds(&self.existing_slot(id)?.dir)
    }

    fn ssh_address(&self, id: &str) -> Option<(IpAddr, u16)> {
        let slot = self.existing_slot(id)?;
        let record = lock(&slot.record);
        let address = &record.as_ref()?.nics.first()?.address;
        let ip = address.split('/').next()?.parse().ok()?;
        Some((ip, 22))
    }

    async fn snapshot(
        &self,
        id: &str,
        include_memory: bool,
        out_dir: &Path,
    ) -> Result<SnapshotFiles, RuntimeError> {
        let span = tracing::info_span!("guest.snapshot", guest = %id, include_memory);
        self.snapshot_inner(id, include_memory, out_dir)
            .instrument(span)
            .await
    }

    async fn keep_snapshot(&self, files: &SnapshotFiles, sha256: &str) {
        let kept = self.images.adopt_snapshot(&files.dir, sha256).await;
        self.prune_cache().await;
        // A restore here is likely next: its disk's overlay is made ready meanwhile.
        let Some(entry) = kept else { return };
        if let Ok(manifest) = Manifest::read(&entry) {
            tokio::spawn(async move {
                let base = entry.join("disk.qcow2");
                if let Err(e) = disks::overlay_template(&base, manifest.disk_gib).await {
                    tracing::debug!(error = %e.0, "no overlay made ahead for the snapshot");
                }
            });
        }
    }

    async fn restore(&self, spec: &GuestSpec, from: &RestoreSource) -> Result<(), RuntimeError> {
        let span =
            tracing::info_span!("guest.restore", guest = %spec.id, snapshot = %from.snapshot_id);
        self.restore_inner(spec, from).instrument(span).await
    }
}

/// The record's NICs as the policy sees them.
fn policy_nics(record: &GuestRecord) -> Result<Vec<policy::PolicyNic>, RuntimeError> {
    record
        .nics
        .iter()
        .map(|n| {
            policy::PolicyNic::new(&n.tap, &n.mac, &n.address)?.with_gateway(n.gateway.as_deref())
        })
        .collect()
}

/// The machine a guest of `image_format` runs on (see [`qemu_args`]).
fn machine_of(image_format: &str) -> &'static str {
    match image_format {
        "bundle" => "microvm",
        _ => "q35",
    }
}

/// Whether a memory snapshot can load into a guest of `spec` here: QEMU needs the same
/// machine, memory and vCPUs (the CPU model is checked before the download is used).
fn check_loadable(
    spec: &GuestSpec,
    image: &Cached,
    manifest: &Manifest,
    cpu_model: &str,
) -> Result<(), RuntimeError> {
    let machine = match image {
        Cached::Bundle { .. } => "microvm",
        Cached::Qcow2 { .. } => "q35",
    };
    let mut differences = Vec::new();
    if manifest.cpu_model != cpu_model {
        differences.push(format!(
            "CPU model {:?}, not {cpu_model:?}",
            manifest.cpu_model
        ));
    }
    if manifest.machine != machine {
        differences.push(format!("machine {}, not {machine}", manifest.machine));
    }
    if manifest.memory_mib != spec.memory_mib {
        differences.push(format!(
            "{} MiB, not {}",
            manifest.memory_mib, spec.memory_mib
        ));
    }
    if manifest.vcpus.max(1) != spec.vcpus.max(1) {
        differences.push(format!(
            "{} vCPUs, not {}",
            manifest.vcpus,
            spec.vcpus.max(1)
        ));
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(RuntimeError(format!(
        "memory snapshot of {} cannot load here: it has {}",
        manifest.source,
        differences.join(", ")
    )))
}

/// The QEMU command line (after the binary) for one boot.
fn qemu_args(
    spec: &GuestSpec,
    record: &GuestRecord,
    image: &Cached,
    accel: Chosen,
    dir: &GuestDir,
    volume_store: &VolumeStore,
) -> Vec<String> {
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let (_, blk, _) = command_line::devices(image);
    let mut args =
        command_line::machine_args(&spec.id, spec.vcpus, spec.memory_mib, image, accel, dir);
    args.extend([
        "-drive".into(),
        format!(
            "file={},if=none,id=root,format=qcow2,discard=unmap",
            path(dir.disk())
        ),
        "-device".into(),
        format!("{blk},drive=root,serial=vps-root"),
        "-drive".into(),
        format!(
            "file={},if=none,id=config,format=raw,readonly=on",
            path(dir.config_drive())
        ),
        "-device".into(),
        format!("{blk},drive=config,serial=vps-config"),
    ]);
    args.extend(volumes::qemu_args(volume_store, &record.volumes, blk));
    let nics = record.nics.iter().map(|n| (n.tap.as_str(), n.mac.as_str()));
    args.extend(command_line::nic_args(image, nics));
    args
}

/// Kills a boot that shows no sign of life by `deadline` after `started`, writing why first;
/// records the boot time of one that does.
async fn watch_boot(dir: GuestDir, pid: i32, started: Instant, deadline: Duration) {
    loop {
        if !process::is_alive(pid, &dir) || dir.stop_requested().exists() {
            return;
        }
        if has_life(&dir) {
            metrics::histogram!("vps_host_boot_seconds").record(started.elapsed().as_secs_f64());
            return;
        }
        if started.elapsed() > deadline {
            let console = std::fs::read_to_string(dir.console()).unwrap_or_default();
            let why =
                format!("the guest showed no sign of life within {deadline:?} and was killed");
            let _ = std::fs::write(dir.error(), process::with_console(why, &console));
            process::kill(pid, &dir).await;
            tracing::warn!(dir = %dir.0.display(), "killed a boot with no sign of life");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the console shows more than the firmware's or boot loader's first words. A guest
/// resumed from a memory snapshot lives already, whatever its console says.
fn has_life(dir: &GuestDir) -> bool {
    if dir.memory_restored().exists() {
        return true;
    }
    let Ok(console) = std::fs::read(dir.console()) else {
        return false;
    };
    // A kernel stuck right after its real-mode setup prints only this (seen under nested KVM).
    String::from_utf8_lossy(&console)
        .lines()
        .any(|line| !line.trim().is_empty() && !line.starts_with("Probing EDD"))
}

/// When the guest's QEMU was last started, as an `Instant` (now, if unknown).
fn started_at(dir: &GuestDir) -> Instant {
    let started_ms: Option<u64> = std::fs::read_to_string(dir.started_at())
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let age = started_ms.map(|ms| Duration::from_millis(process::unix_ms().saturating_sub(ms)));
    age.and_then(|age| Instant::now().checked_sub(age))
        .unwrap_or_else(Instant::now)
}

/// Before a fresh boot: ends a QEMU whose VM QMP reports broken (panicked, internal error).
/// One that runs but cannot be reached over QMP is left alone, never rebooted blindly.
async fn end_broken(dir: &GuestDir, live: &mut Live) -> Result<(), RuntimeError> {
    let Some(pid) = live.pid else {
        return Ok(());
    };
    if live.qmp.is_none() {
        return Err(RuntimeError(format!(
            "QEMU (pid {pid}) runs but does not answer on QMP; it is left running"
        )));
    }
    live.qmp = None;
    live.pid = None;
    process::kill(pid, dir).await;
    Ok(())
}

async fn execute(live: &Live, command: &str) -> Result<(), RuntimeError> {
    let qmp = live
        .qmp
        .as_ref()
        .ok_or_else(|| RuntimeError(format!("QMP {command}: not connected")))?;
    qmp.execute(command, None)
        .await
        .map(|_| ())
        .map_err(|e| RuntimeError(e.to_string()))
}

fn read_record(dir: &GuestDir) -> Option<GuestRecord> {
    serde_json::from_slice(&std::fs::read(dir.record()).ok()?).ok()
}

/// An id names a directory: it must not climb out of the state directory.
fn validate_id(id: &str) -> Result<(), RuntimeError> {
    if vps_guest_image::is_plain_name(id, 64) {
        Ok(())
    } else {
        Err(RuntimeError(format!(
            "guest id {id:?} is not a valid instance id"
        )))
    }
}

/// A flavor larger than the whole host can never boot: say so instead of letting QEMU fail.
fn check_fits_host(spec: &GuestSpec) -> Result<(), RuntimeError> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let memory_mib = host_memory_mib();
    if spec.vcpus > cpus || memory_mib.is_some_and(|m| spec.memory_mib > m) {
        return Err(RuntimeError(format!(
            "flavor of {} vCPUs and {} MiB is larger than this host ({} CPUs, {} MiB)",
            spec.vcpus,
            spec.memory_mib,
            cpus,
            memory_mib
                .map(|m| m.to_string())
                .unwrap_or_else(|| "?".into())
        )));
    }
    if spec.memory_mib == 0 {
        return Err(RuntimeError("flavor has no memory".into()));
    }
    Ok(())
}

fn host_memory_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The CPU model guests run with under `chosen`, as the agent reports it and as a node should
/// be registered with (`cpuModel`): a memory snapshot restores only onto a node of its model.
pub fn cpu_model_of(chosen: Chosen) -> String {
    match chosen {
        Chosen::Kvm => format!("kvm:{}", host_cpu_model()),
        Chosen::Tcg => "tcg:max".to_owned(),
    }
}

fn host_cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, model)| model.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The probe's answer, kept in `<state_dir>/accel` with the host's boot id.
fn remembered_accel(state_dir: &Path) -> Option<Chosen> {
    let saved = std::fs::read_to_string(state_dir.join("accel")).ok()?;
    let (boot_id, chosen) = saved.trim().split_once(' ')?;
    if boot_id != host_boot_id()? {
        return None;
    }
    match chosen {
        "kvm" => Some(Chosen::Kvm),
        "tcg" => Some(Chosen::Tcg),
        _ => None,
    }
}

fn remember_accel(state_dir: &Path, chosen: Chosen) {
    if let Some(boot_id) = host_boot_id() {
        let _ = std::fs::write(state_dir.join("accel"), format!("{boot_id} {chosen}\n"));
    }
}

fn host_boot_id() -> Option<String> {
    Some(
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()?
            .trim()
            .to_owned(),
    )
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
