//! Snapshots and restores of the `qemu` runtime against real QEMU under TCG, with the minimal
//! guest (`vps-guest-image`): a disk-only snapshot keeps a file, a memory snapshot keeps the
//! running processes and boot, and every restore has an identity of its own. Each test runs in
//! a network namespace of its own (`in_netns`, as in `qemu_runtime.rs`); guests are reached over
//! SSH with certificates from a CA made here.
//!
//! Needs `qemu-system-x86_64`, `qemu-img`, `ip`, `setsid`, `ssh`, `ssh-keygen`, and the minimal
//! guest (`VPS_GUEST_IMAGE`, else built once under the target directory with `apt-get
//! download`).

mod common;
use common::{bundle_digest, in_netns, minimal_bundle, qemu_pids, run, sha256_file, state_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use vps_host::runtime::qemu::{Accel, Qemu};
use vps_host::runtime::{
    GuestSpec, GuestState, ImageRef, NicSpec, RestoreSource, Runtime, SnapshotFiles, SshCa,
};

const SOURCE: &str = "inst_snapsource000000000000";
const CLONE: &str = "inst_snapclone0000000000000";

#[test]
fn a_disk_snapshot_of_a_running_guest_restores_its_files_under_a_new_identity() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("disk", &bundle);
        let runtime = env.runtime();
        let source = env.spec(SOURCE, 2);
        runtime.run(&source).await.expect("run");
        let before = env.ssh_until_up(
            SOURCE,
            "echo kept > /data/file && sync && cat /etc/ssh/ssh_host_ed25519_key.pub /etc/machine-id",
        );

        let files = runtime
            .snapshot(SOURCE, false, &env.out)
            .await
            .expect("snapshot");
        assert!(!files.include_memory && files.cpu_model.is_none());
        check_archive(&files);
        assert_eq!(
            state_of(&runtime, SOURCE).await,
            GuestState::Running,
            "the source runs on"
        );

        let clone = env.spec(CLONE, 3);
        runtime
            .restore(&clone, &env.source(&files))
            .await
            .expect("restore");
        let after = env.ssh_until_up(
            CLONE,
            "cat /data/file /etc/ssh/ssh_host_ed25519_key.pub /etc/machine-id; hostname",
        );
        let after: Vec<&str> = after.lines().collect();
        let before: Vec<&str> = before.lines().collect();
        assert_eq!(after[0], "kept", "the file survives: {after:?}");
        assert_ne!(after[1], before[0], "the clone has its own SSH host key");
        assert_ne!(after[2], before[1], "the clone has its own machine id");
        assert_eq!(after[3], clone.hostname);
        // Both answer, each at its own address.
        env.ssh(SOURCE, "true").expect("the source still answers");

        for id in [SOURCE, CLONE] {
            runtime.delete(id).await.expect("delete");
        }
        env.assert_no_qemu();
    });
}

#[test]
fn a_memory_snapshot_restores_a_guest_that_goes_on_without_a_reboot_under_a_new_identity() {
    memory_restore("memory", Restore::StartsItsQemu);
}

#[test]
fn a_memory_restore_into_a_warm_qemu_goes_on_the_same_way_on_its_own_disk_taps_and_directory() {
    memory_restore("warm", Restore::TakesAWarmQemu);
}

/// How the restore of `memory_restore` gets its QEMU.
#[derive(Clone, Copy, PartialEq)]
enum Restore {
    /// No slot waits (`restore_slots = 0`): the restore starts QEMU itself.
    StartsItsQemu,
    /// The snapshot starts a QEMU of its shape, which the restore takes once it waits (the
    /// snapshot is kept here too, as the agent does after its upload).
    TakesAWarmQemu,
}

/// A memory snapshot of a guest with a counter running, restored as `CLONE`: the counter goes
/// on, the boot is the same, the identity is the clone's own.
fn memory_restore(name: &'static str, how: Restore) {
    let bundle = minimal_bundle();
    let pauses = pause_histogram();
    in_netns(move || async move {
        let env = Env::new(name, &bundle);
        let mut runtime = env.runtime();
        if how == Restore::StartsItsQemu {
            runtime.restore_slots = 0;
        }
        let source = env.spec(SOURCE, 2);
        runtime.run(&source).await.expect("run");
        // A counter kept by a shell loop: it lives only in the guest's memory and processes.
        let before = env.ssh_until_up(
            SOURCE,
            "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /run/counter; sleep 1; done' \
               </dev/null >/dev/null 2>&1 & echo $!; echo kept > /data/kept && sync; \
             cat /proc/sys/kernel/random/boot_id /etc/ssh/ssh_host_ed25519_key.pub /etc/machine-id",
        );
        let before: Vec<String> = before.lines().map(str::to_owned).collect();
        let counter_pid = before[0].trim().to_owned();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let counted = env.ssh(SOURCE, "cat /run/counter").expect("counter");
        let counted: u64 = counted.trim().parse().expect("a count");

        let recorded = lock(&pauses).len();
        let files = runtime
            .snapshot(SOURCE, true, &env.out)
            .await
            .expect("snapshot");
        println!(
            "memory snapshot: {} bytes, paused {} ms, QEMU's save {:?} ms",
            files.size_bytes, files.paused_ms, files.qemu_save_ms
        );
        check_archive(&files);
        assert_eq!(files.cpu_model.as_deref(), Some("tcg:max"));
        assert!(files.qemu_save_ms.is_some());
        assert!(files.paused_ms >= files.qemu_save_ms.unwrap_or(0));
        // The recorder is the process's: the other tests' snapshots, running beside this one,
        // record theirs in it too. This snapshot's pause is among those recorded meanwhile.
        let pauses_now = lock(&pauses).clone();
        let since = &pauses_now[recorded..];
        assert!(
            since
                .iter()
                .any(|pause| (pause * 1000.0 - files.paused_ms as f64).abs() < 2.0),
            "{} ms reported, recorded meanwhile (s): {since:?}",
            files.paused_ms
        );
        // The source was frozen only while saving: it runs on, its counter too.
        assert_eq!(state_of(&runtime, SOURCE).await, GuestState::Running);
        let alive = env
            .ssh(SOURCE, &format!("kill -0 {counter_pid} && echo alive"))
            .expect("the source answers after the snapshot");
        assert_eq!(alive.trim(), "alive");

        let clone = env.spec(CLONE, 3);
        let from = env.source(&files);
        if how == Restore::TakesAWarmQemu {
            runtime.keep_snapshot(&files, &from.sha256).await;
            let deadline = Instant::now() + Duration::from_secs(60);
            while runtime.warm_restore_slots() == 0 {
                assert!(Instant::now() < deadline, "no warm QEMU started");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(qemu_pids(&env.state).len(), 2, "the source and the slot");
        }
        runtime.restore(&clone, &from).await.expect("restore");
        let clone_dir = env.state.join("guests").join(CLONE);
        assert_eq!(
            clone_dir.join("started-in").exists(),
            how == Restore::TakesAWarmQemu,
            "whether the restore's QEMU was started ahead"
        );
        // It runs from its resume; its identity is taken beside it, its links down till then.
        assert_eq!(state_of(&runtime, CLONE).await, GuestState::Running);
        let deadline = Instant::now() + Duration::from_secs(120);
        while runtime.identity_pending(CLONE) {
            assert!(Instant::now() < deadline, "no identity of its own");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let after = env.ssh_until_up(
            CLONE,
            &format!(
                "kill -0 {counter_pid} && echo alive; cat /run/counter \
                 /proc/sys/kernel/random/boot_id /etc/ssh/ssh_host_ed25519_key.pub /etc/machine-id; \
                 hostname; ip -br addr show"
            ),
        );
        let after: Vec<&str> = after.lines().collect();
        assert_eq!(
            after[0], "alive",
            "the process started before goes on: {after:?}"
        );
        let count: u64 = after[1].trim().parse().expect("a count");
        assert!(
            count >= counted,
            "the counter goes on from {counted}, not from zero: {count}"
        );
        assert_eq!(after[2], before[1], "the same boot: no reboot");
        assert_ne!(after[3], before[2], "the clone has its own SSH host key");
        assert_ne!(after[4], before[3], "the clone has its own machine id");
        assert_eq!(after[5], clone.hostname);
        assert!(after[6..].join("\n").contains("10.79.0.3/24"), "{after:?}");
        let console = env.console(CLONE);
        assert!(
            !console.contains("vps-init: [") || !console.contains("] started"),
            "a memory restore does not boot:\n{console}"
        );
        assert!(console.contains("restored: identity 1,"), "{console}");
        env.ssh(SOURCE, "true")
            .expect("the source still answers at its own address");
        if how == Restore::TakesAWarmQemu {
            warm_restore_checks(&env, &runtime, &clone).await;
        }

        for id in [SOURCE, CLONE] {
            runtime.delete(id).await.expect("delete");
        }
        runtime.end_warm_restore_slots().await;
        env.assert_no_qemu();
        assert_eq!(
            std::fs::read_dir(env.state.join("warm")).map_or(0, |d| d.count()),
            0,
            "no slot's directory is left"
        );
    });
}

/// What a restore into a warm QEMU must have besides its memory: its disk and config drive
/// under the slot's disks, its taps under its own names on the bridge, a QEMU found as its own,
/// and another slot waiting for the next restore of its shape; a new runtime ends that slot.
async fn warm_restore_checks(env: &Env, runtime: &Qemu, clone: &GuestSpec) {
    // Its disk is its own overlay on the snapshot's: it reads the source's file, and what it
    // writes lands in its overlay and reads back from the disk.
    let overlay = env.state.join("guests").join(CLONE).join("disk.qcow2");
    let size = || std::fs::metadata(&overlay).unwrap().len();
    let before = size();
    let out = env
        .ssh(
            CLONE,
            "cat /data/kept && head -c 8388608 /dev/urandom > /data/new && sync && \
             md5sum < /data/new && echo 3 > /proc/sys/vm/drop_caches && md5sum < /data/new",
        )
        .expect("the clone's disk");
    let out: Vec<&str> = out.lines().collect();
    assert_eq!(out.len(), 3, "{out:?}");
    assert_eq!(out[0], "kept", "the source's file");
    assert_eq!(out[1], out[2], "read back from the disk");
    assert!(
        size() >= before + (8 << 20),
        "8 MiB written into the clone's overlay: {before} → {} bytes",
        size()
    );
    // Its tap has the name a boot of it would give it (`vps0…`), on the bridge, up; a slot's
    // (`vpsw…`) is on none.
    let on_bridge = run(&["ip", "-o", "link", "show", "master", &clone.nics[0].bridge]);
    assert_eq!(
        on_bridge.matches(",UP").count(),
        2,
        "the source's and the clone's taps on the bridge, up: {on_bridge}"
    );
    assert!(!on_bridge.contains("vpsw"), "{on_bridge}");
    // Found as the clone's own QEMU.
    assert!(
        runtime.cpu_seconds(CLONE).is_some(),
        "the clone's QEMU is found"
    );
    // The next restore of this shape finds a QEMU waiting.
    let deadline = Instant::now() + Duration::from_secs(60);
    while runtime.warm_restore_slots() == 0 {
        assert!(
            Instant::now() < deadline,
            "no slot started after the restore"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new runtime (an agent restarted) ends the slot the old one left, and adopts the rest.
    assert_eq!(
        qemu_pids(&env.state).len(),
        3,
        "the source, the clone and the slot"
    );
    let restarted = env.runtime();
    let adopted = restarted.adopt().await;
    assert_eq!(adopted.len(), 2, "{adopted:?}");
    assert_eq!(qemu_pids(&env.state).len(), 2, "the slot ended");
    assert!(
        restarted.cpu_seconds(CLONE).is_some(),
        "the clone is adopted as running"
    );
}

#[test]
fn under_a_tiny_cache_budget_a_second_snapshot_evicts_the_first_while_its_restore_runs() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("cache", &bundle);
        let mut runtime = env.runtime();
        let source = env.spec(SOURCE, 2);
        runtime.run(&source).await.expect("run");
        env.ssh_until_up(SOURCE, "echo one > /data/file && sync");
        let first = runtime
            .snapshot(SOURCE, false, &env.out)
            .await
            .expect("first snapshot");
        let first_from = env.source(&first);
        // Kept by the host that took it, as the agent does once it is uploaded.
        runtime.keep_snapshot(&first, &first_from.sha256).await;
        let cached = |sha256: &str| env.images.join("snapshots").join(sha256);
        assert!(cached(&first_from.sha256).join("disk.qcow2").is_file());

        runtime.image_cache_max_bytes = 1;
        env.ssh(SOURCE, "echo two > /data/file && sync")
            .expect("write");
        let second = runtime
            .snapshot(SOURCE, false, &env.out)
            .await
            .expect("second snapshot");
        let second_from = env.source(&second);
        let clone = env.spec(CLONE, 3);
        runtime
            .restore(&clone, &second_from)
            .await
            .expect("restore of the second");
        let second_sha256 = second_from.sha256;
        assert!(
            !cached(&first_from.sha256).exists(),
            "the first snapshot, needed by no guest, is evicted"
        );
        assert!(
            cached(&second_sha256).join("disk.qcow2").is_file(),
            "the second stays: the clone's disk is layered on it"
        );
        let image = env.images.join(bundle_digest(&env.bundle));
        assert!(image.join("vmlinuz").is_file(), "the guests' image stays");
        let after = env.ssh_until_up(CLONE, "cat /data/file");
        assert_eq!(after.trim(), "two");
        env.ssh(SOURCE, "true").expect("the source runs on");

        // What only a deleted guest needed goes with it.
        runtime.delete(CLONE).await.expect("delete");
        assert!(!cached(&second_sha256).exists());
        assert!(image.join("vmlinuz").is_file(), "the source still needs it");
        runtime.delete(SOURCE).await.expect("delete");
        assert!(!image.exists(), "no guest needs the image");
        env.assert_no_qemu();
    });
}

#[test]
fn a_restore_whose_archive_is_not_its_digest_is_an_error_naming_both_and_nothing_boots() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("digest", &bundle);
        let runtime = env.runtime();
        let archive = env.root.join("not-a-snapshot.tar");
        std::fs::write(&archive, b"some other bytes").unwrap();
        let actual = sha256_file(&archive);
        let claimed = "ab".repeat(32);
        let from = RestoreSource {
            snapshot_id: "snap_x".into(),
            url: format!("file://{}", archive.display()),
            sha256: claimed.clone(),
        };
        let error = runtime
            .restore(&env.spec(CLONE, 3), &from)
            .await
            .expect_err("a wrong digest must not restore");
        assert!(
            error.0.contains(&actual) && error.0.contains(&claimed),
            "{error}"
        );
        assert!(matches!(
            state_of(&runtime, CLONE).await,
            GuestState::Error(_)
        ));
        env.assert_no_qemu();
        runtime.delete(CLONE).await.expect("delete");
    });
}

#[test]
fn a_memory_snapshot_from_another_cpu_model_is_refused_before_boot() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("cpu", &bundle);
        let runtime = env.runtime();
        let manifest = serde_json::json!({
            "format": 1, "source": SOURCE, "include_memory": true, "cpu_model": "kvm:Other CPU",
            "machine": "microvm", "vcpus": 1, "memory_mib": 256, "disk_gib": 1,
            "image_sha256": "00", "image_format": "bundle", "identity_generation": 0,
            "qemu_version": "QEMU"
        });
        let archive = env.root.join("other-cpu.tar");
        let mut tar = tar::Builder::new(std::fs::File::create(&archive).unwrap());
        for (name, data) in [
            ("manifest.json", manifest.to_string().into_bytes()),
            ("disk.qcow2", vec![0; 512]),
            ("config.img", vec![0; 512]),
            ("memory.state", vec![0; 512]),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(&mut header, name, data.as_slice()).unwrap();
        }
        tar.finish().unwrap();
        drop(tar);
        let from = RestoreSource {
            snapshot_id: "snap_cpu".into(),
            url: format!("file://{}", archive.display()),
            sha256: sha256_file(&archive),
        };
        let error = runtime
            .restore(&env.spec(CLONE, 3), &from)
            .await
            .expect_err("another CPU model");
        assert!(
            error.0.contains("kvm:Other CPU") && error.0.contains("tcg:max"),
            "{error}"
        );
        env.assert_no_qemu();
        runtime.delete(CLONE).await.expect("delete");
    });
}

#[test]
fn a_snapshot_that_fills_the_disk_fails_with_a_reason_and_the_source_runs_on() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("full", &bundle);
        // The snapshot directory on a 4 MiB file system, in this thread's own mount namespace.
        let _disk = SmallDisk::mount(&env.out, "4m");
        let runtime = env.runtime();
        runtime.run(&env.spec(SOURCE, 2)).await.expect("run");
        // 8 MiB of data on the disk: a flattened copy cannot fit either.
        env.ssh_until_up(
            SOURCE,
            "dd if=/dev/urandom of=/data/big bs=1M count=8 2>/dev/null && sync",
        );
        for include_memory in [true, false] {
            let error = runtime
                .snapshot(SOURCE, include_memory, &env.out)
                .await
                .expect_err("the disk is full");
            println!("memory {include_memory}: {error}");
            assert!(error.0.contains("free"), "{error}");
            assert_eq!(
                state_of(&runtime, SOURCE).await,
                GuestState::Running,
                "the source runs on after a failed snapshot"
            );
        }
        env.ssh(SOURCE, "true").expect("the source still answers");
        runtime.delete(SOURCE).await.expect("delete");
        env.assert_no_qemu();
    });
}

#[test]
fn a_guest_that_dies_while_its_memory_is_saved_fails_the_snapshot_with_a_reason() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = Env::new("dies", &bundle);
        let runtime = env.runtime();
        runtime.run(&env.spec(SOURCE, 2)).await.expect("run");
        env.ssh_until_up(SOURCE, "true");
        let pid = qemu_pids(&env.state)[0];
        // Kill the guest's QEMU the moment its memory starts going to the state file.
        let out = env.out.clone();
        let killer = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            while Instant::now() < deadline {
                if find_file(&out, "memory.state").is_some() {
                    // SAFETY: kill(2) on this test's own QEMU.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    return true;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            false
        });
        let error = runtime
            .snapshot(SOURCE, true, &env.out)
            .await
            .expect_err("the guest died mid-save");
        println!("{error}");
        assert!(killer.join().unwrap(), "the save never began");
        assert!(!error.0.is_empty());
        assert!(
            matches!(state_of(&runtime, SOURCE).await, GuestState::Error(_)),
            "a QEMU that died is an error"
        );
        assert!(
            find_file(&env.out, "memory.state").is_none(),
            "no half-saved state is left behind"
        );
        runtime.delete(SOURCE).await.expect("delete");
        env.assert_no_qemu();
    });
}

// ---- harness ----------------------------------------------------------------------------

/// Writes the archive the agent would upload beside the snapshot's files (once), checks it is
/// as long as announced and hashed as answered: its path and digest.
fn check_archive(files: &SnapshotFiles) -> (PathBuf, String) {
    let path = files.dir.with_extension("tar");
    let file = std::fs::File::create(&path).unwrap();
    let (sha256, written) = vps_host::runtime::archive::write(files, file).expect("archive");
    assert_eq!(sha256_file(&path), sha256);
    assert_eq!(written, files.size_bytes);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), files.size_bytes);
    (path, sha256)
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

struct Env {
    root: PathBuf,
    state: PathBuf,
    images: PathBuf,
    out: PathBuf,
    bundle: PathBuf,
    ca_public: String,
}

impl Env {
    fn new(name: &str, bundle: &Path) -> Env {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let root = std::env::temp_dir().join(format!("vqs-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let key = |file: &str, comment: &str| {
            run(&[
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                comment,
                "-f",
                root.join(file).to_str().unwrap(),
            ]);
        };
        key("ca", "ca");
        key("user", "user");
        for principal in [SOURCE, CLONE] {
            run(&[
                "ssh-keygen",
                "-q",
                "-s",
                root.join("ca").to_str().unwrap(),
                "-I",
                principal,
                "-n",
                principal,
                "-V",
                "-5m:+1h",
                root.join("user.pub").to_str().unwrap(),
            ]);
            std::fs::rename(
                root.join("user-cert.pub"),
                root.join(format!("{principal}-cert.pub")),
            )
            .unwrap();
        }
        let ca_public = std::fs::read_to_string(root.join("ca.pub")).unwrap();
        Env {
            state: root.join("s"),
            images: root.join("i"),
            out: root.join("out"),
            bundle: bundle.to_owned(),
            ca_public,
            root,
        }
    }

    fn runtime(&self) -> Qemu {
        let mut runtime = Qemu::new(&self.state, &self.images, Accel::Tcg).expect("runtime");
        runtime.stop_timeout = Duration::from_secs(30);
        runtime.boot_deadline = Duration::from_secs(120);
        runtime
    }

    /// The minimal guest `id` at `10.79.0.<host>`, admitting its own principal.
    fn spec(&self, id: &str, host: u8) -> GuestSpec {
        GuestSpec {
            id: id.into(),
            hostname: id.replace('_', "-"),
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            image: ImageRef {
                url: format!("file://{}", self.bundle.display()),
                sha256: bundle_digest(&self.bundle),
                format: "bundle".into(),
            },
            nics: vec![NicSpec {
                bridge: "vpsbr0".into(),
                mac: format!("52:54:00:79:00:{host:02x}"),
                address: format!("10.79.0.{host}/24"),
                gateway: Some("10.79.0.1".into()),
            }],
            user_data: None,
            ssh_ca: Some(SshCa {
                public_key: self.ca_public.trim().to_owned(),
                principal: id.into(),
            }),
            ..Default::default()
        }
    }

    fn source(&self, files: &SnapshotFiles) -> RestoreSource {
        let (archive, sha256) = check_archive(files);
        RestoreSource {
            snapshot_id: "snap_test".into(),
            url: format!("file://{}", archive.display()),
            sha256,
        }
    }

    fn console(&self, id: &str) -> String {
        std::fs::read_to_string(self.state.join("guests").join(id).join("console.log"))
            .unwrap_or_default()
    }

    /// Runs `command` in guest `id` over SSH (its certificate names `id`).
    fn ssh(&self, id: &str, command: &str) -> Result<String, String> {
        let address = if id == SOURCE {
            "10.79.0.2"
        } else {
            "10.79.0.3"
        };
        let output = Command::new("ssh")
            .args(["-F", "/dev/null", "-i"])
            .arg(self.root.join("user"))
            .arg("-o")
            .arg(format!(
                "CertificateFile={}",
                self.root.join(format!("{id}-cert.pub")).display()
            ))
            .args(["-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes"])
            .args(["-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=2"])
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .args([
                "-o",
                "LogLevel=ERROR",
                &format!("sandbox@{address}"),
                command,
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("ssh runs");
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    fn ssh_until_up(&self, id: &str, command: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            match self.ssh(id, command) {
                Ok(out) => return out,
                Err(error) if Instant::now() > deadline => {
                    panic!("ssh {id}: {error}\nconsole:\n{}", self.console(id))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(500)),
            }
        }
    }

    fn assert_no_qemu(&self) {
        assert!(qemu_pids(&self.state).is_empty(), "stray QEMU");
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        for pid in qemu_pids(&self.state) {
            // SAFETY: kill(2) on a QEMU of this test's own state directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The values recorded in `vps_host_snapshot_pause_seconds`, through a recorder installed
/// for this test process.
fn pause_histogram() -> Arc<Mutex<Vec<f64>>> {
    static VALUES: OnceLock<Arc<Mutex<Vec<f64>>>> = OnceLock::new();
    VALUES
        .get_or_init(|| {
            let values = Arc::new(Mutex::new(Vec::new()));
            let recorder = Pauses(values.clone());
            metrics::set_global_recorder(recorder).expect("no other recorder");
            values
        })
        .clone()
}

struct Pauses(Arc<Mutex<Vec<f64>>>);
struct PauseFn(Arc<Mutex<Vec<f64>>>);

impl metrics::HistogramFn for PauseFn {
    fn record(&self, value: f64) {
        lock(&self.0).push(value);
    }
}

impl metrics::Recorder for Pauses {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::noop()
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        key: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        if key.name() == "vps_host_snapshot_pause_seconds" {
            metrics::Histogram::from_arc(Arc::new(PauseFn(self.0.clone())))
        } else {
            metrics::Histogram::noop()
        }
    }
}

/// A small tmpfs at `dir`, mounted in a mount namespace of the calling thread's own (the
/// machine's mounts are never touched), unmounted when dropped.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        // SAFETY: unshare(2) with CLONE_NEWNS gives this thread, and what it starts from now on,
        // a mount namespace of its own.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNS) };
        assert_eq!(rc, 0, "unshare: {}", std::io::Error::last_os_error());
        run(&["mount", "--make-rprivate", "/"]);
        std::fs::create_dir_all(dir).unwrap();
        let options = format!("size={size}");
        run(&[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            &options,
            "tmpfs",
            dir.to_str().unwrap(),
        ]);
        SmallDisk(dir.to_owned())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// The first file named `name` under `dir`.
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if entry.file_name() == name {
            return Some(path);
        }
    }
    None
}
