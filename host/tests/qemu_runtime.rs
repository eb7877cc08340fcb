//! The `qemu` runtime against real QEMU processes under TCG, booting a real Debian cloud kernel
//! with a tiny busybox initramfs built here (see `guest_bundle`).
//!
//! Every test runs inside a network namespace of its own (`in_netns`): a thread that
//! `unshare(CLONE_NEWNET)`s itself, brings `lo` up and runs a tokio runtime; every `ip` and QEMU
//! it starts inherits that namespace, so bridges, taps and addresses never touch the machine's.
//! After each test no QEMU of the test's state directory and no tap may remain.
//!
//! Needs `qemu-system-x86_64`, `qemu-img`, `ip`, `setsid`, a kernel (`VPS_TEST_KERNEL`, else the
//! newest `/boot/vmlinuz-*`) and `busybox` (`VPS_TEST_BUSYBOX`, else `/bin/busybox`; Debian's
//! `busybox-static`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use vps_host::runtime::qemu::{accel, Accel, Chosen, Qemu};
use vps_host::runtime::{GuestSpec, GuestState, ImageRef, NicSpec, Observed, Runtime};

/// A guest that prints its boot id, then a tick a second, for ever.
const TICKER: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
echo "vps-test boot-id $(cat /proc/sys/kernel/random/boot_id)"
i=0
while true; do i=$((i+1)); echo "tick $i"; sleep 1; done
"#;

/// A guest that powers itself off once it has said hello.
const POWEROFF: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
echo "vps-test powering off"
poweroff -f
"#;

/// A guest that never prints anything itself (its kernel may still warn on the console).
const SILENT: &str = r#"#!/bin/busybox sh
while true; do /bin/busybox sleep 60; done
"#;

#[test]
fn a_guest_boots_pauses_resumes_without_reboot_stops_and_runs_again_on_the_same_disk() {
    in_netns(|| async {
        let env = TestEnv::new("life");
        let runtime = env.runtime();
        let mut spec = env.spec("inst_lifecycle0000000000000000", TICKER);
        spec.nics = vec![NicSpec {
            bridge: "vpsbr0".into(),
            mac: "02:00:00:00:00:01".into(),
            address: "10.77.0.2/24".into(),
            gateway: Some("10.77.0.1".into()),
        }];

        let booted = Instant::now();
        runtime.run(&spec).await.expect("run boots");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
        let console = env.wait_console(&spec.id, "tick 1").await;
        println!("boot to init: {:?}", booted.elapsed());
        let first_boot = boot_id(&console);
        let pid = env.pid(&spec.id);

        // The bridge was made with the gateway; the tap hangs on it.
        let bridge = ip(&["-br", "addr", "show", "dev", "vpsbr0"]);
        assert!(bridge.contains("10.77.0.1/24"), "{bridge}");
        let taps = env.taps();
        assert_eq!(taps.len(), 1, "{taps:?}");
        assert_tap_up_on_bridge(&taps[0]);
        let observed = runtime.observe().await;
        assert_eq!(observed[0].addresses, vec!["10.77.0.2/24".to_owned()]);
        assert_eq!(
            runtime.ssh_address(&spec.id),
            Some(("10.77.0.2".parse().unwrap(), 22))
        );

        // Pause: QMP says paused, and the guest's clock of ticks stands still.
        runtime.pause(&spec).await.expect("pause");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Paused);
        let ticks = env.ticks(&spec.id);
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(env.ticks(&spec.id), ticks, "a paused guest must not run");
        runtime.pause(&spec).await.expect("pause is idempotent");

        // Resume: the same process and the same boot, ticking on.
        runtime.run(&spec).await.expect("resume");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
        env.wait_console(&spec.id, &format!("tick {}", ticks + 2))
            .await;
        assert_eq!(env.pid(&spec.id), pid, "resume must not start a new QEMU");
        let console = env.console(&spec.id);
        assert_eq!(
            console.matches("boot-id").count(),
            1,
            "resume must not reboot:\n{console}"
        );
        runtime
            .run(&spec)
            .await
            .expect("run on a running guest changes nothing");
        assert_eq!(env.pid(&spec.id), pid);

        // Stop: no QEMU remains; the disk stays.
        let disk = env.guest_dir(&spec.id).join("disk.qcow2");
        let disk_inode = inode(&disk);
        runtime.stop(&spec.id).await.expect("stop");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Stopped);
        assert!(env.qemu_pids().is_empty(), "no QEMU may remain after stop");
        runtime.stop(&spec.id).await.expect("stop is idempotent");

        // Run again: a new boot on the same overlay.
        runtime.run(&spec).await.expect("run after stop");
        let console = env.wait_console(&spec.id, "tick 1").await;
        assert_ne!(
            boot_id(&console),
            first_boot,
            "a stopped guest boots afresh"
        );
        assert_eq!(inode(&disk), disk_inode, "the guest keeps its disk");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
        // Its tap outlived the stop: it is taken again, still on the bridge and up.
        assert_eq!(env.taps(), taps);
        assert_tap_up_on_bridge(&taps[0]);

        // Delete: process, tap and directory are gone.
        runtime.delete(&spec.id).await.expect("delete");
        assert!(!env.guest_dir(&spec.id).exists());
        assert!(runtime.observe().await.is_empty());
        runtime
            .delete(&spec.id)
            .await
            .expect("delete is idempotent");
        env.assert_clean();
    });
}

#[test]
fn a_restarted_agent_adopts_the_running_guest_without_rebooting_it() {
    in_netns(|| async {
        let env = TestEnv::new("adopt");
        let spec = env.spec("inst_adopt0000000000000000000", TICKER);
        {
            let runtime = env.runtime();
            runtime.run(&spec).await.expect("run");
            env.wait_console(&spec.id, "tick 1").await;
        }
        // The first runtime is gone, as after a `kill -9` of the agent: QEMU runs on.
        let pid = env.pid(&spec.id);
        assert_eq!(env.qemu_pids(), vec![pid]);

        let runtime = env.runtime();
        let adopted = runtime.adopt().await;
        assert_eq!(adopted.len(), 1, "{adopted:?}");
        assert_eq!(adopted[0].state, GuestState::Running);
        assert_eq!(env.qemu_pids(), vec![pid], "adopting starts no QEMU");

        // The adopted guest is fully driven: pause and resume over its QMP socket.
        runtime.pause(&spec).await.expect("pause an adopted guest");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Paused);
        runtime.run(&spec).await.expect("resume an adopted guest");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
        assert_eq!(env.pid(&spec.id), pid);
        assert_eq!(env.console(&spec.id).matches("boot-id").count(), 1);

        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn a_qemu_killed_from_outside_is_an_error_with_its_exit_and_console() {
    in_netns(|| async {
        let env = TestEnv::new("kill");
        let runtime = env.runtime();
        let spec = env.spec("inst_killed000000000000000000", TICKER);
        runtime.run(&spec).await.expect("run");
        env.wait_console(&spec.id, "tick 1").await;
        let pid = env.pid(&spec.id);
        // SAFETY: kill(2) on the QEMU this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };

        let state = wait_state(&runtime, &spec.id, |s| matches!(s, GuestState::Error(_))).await;
        let GuestState::Error(message) = state else {
            unreachable!()
        };
        assert!(message.contains("killed by signal 9"), "{message}");
        assert!(
            message.contains("tick"),
            "the console tail is in the message: {message}"
        );

        // The same message after an agent restart.
        drop(runtime);
        let runtime = env.runtime();
        let adopted = runtime.adopt().await;
        assert_eq!(adopted[0].state, GuestState::Error(message.clone()));
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn a_guest_that_powers_itself_off_is_stopped() {
    in_netns(|| async {
        let env = TestEnv::new("poff");
        let runtime = env.runtime();
        let spec = env.spec("inst_poweroff00000000000000000", POWEROFF);
        runtime.run(&spec).await.expect("run");
        let state = wait_state(&runtime, &spec.id, |s| *s != GuestState::Running).await;
        assert_eq!(
            state,
            GuestState::Stopped,
            "console: {}",
            env.console(&spec.id)
        );
        assert!(env.console(&spec.id).contains("powering off"));
        assert!(env.qemu_pids().is_empty());
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn a_boot_with_no_sign_of_life_is_killed_and_reported() {
    in_netns(|| async {
        let env = TestEnv::new("mute");
        let mut runtime = env.runtime();
        // Under TCG the kernel's first console line comes seconds after QEMU starts.
        runtime.boot_deadline = Duration::from_millis(300);
        let spec = env.spec("inst_silent000000000000000000", SILENT);
        runtime.run(&spec).await.expect("run starts QEMU");
        let state = wait_state(&runtime, &spec.id, |s| matches!(s, GuestState::Error(_))).await;
        let GuestState::Error(message) = state else {
            unreachable!()
        };
        assert!(message.contains("no sign of life"), "{message}");
        assert!(env.qemu_pids().is_empty());
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn a_wrong_digest_is_an_error_naming_both_digests_and_nothing_boots() {
    in_netns(|| async {
        let env = TestEnv::new("digest");
        let runtime = env.runtime();
        let mut spec = env.spec("inst_digest000000000000000000", TICKER);
        let actual = spec.image.sha256.clone();
        spec.image.sha256 = "ab".repeat(32);
        let error = runtime
            .run(&spec)
            .await
            .expect_err("a wrong digest must not boot");
        assert!(
            error.0.contains(&actual) && error.0.contains(&spec.image.sha256),
            "{error}"
        );
        let state = state_of(&runtime, &spec.id).await;
        assert_eq!(state, GuestState::Error(error.0.clone()));
        assert!(env.qemu_pids().is_empty());
        assert!(!env.guest_dir(&spec.id).join("disk.qcow2").exists());
        assert!(
            !env.images.join(&spec.image.sha256).exists(),
            "nothing is cached"
        );
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn bad_input_is_an_error_with_a_message_and_never_a_panic() {
    in_netns(|| async {
        let env = TestEnv::new("bad");
        let runtime = env.runtime();

        let mut huge = env.spec("inst_huge00000000000000000000", TICKER);
        huge.vcpus = 4096;
        let error = runtime.run(&huge).await.expect_err("too large");
        assert!(error.0.contains("larger than this host"), "{error}");

        let mut unreachable = env.spec("inst_nourl00000000000000000000", TICKER);
        unreachable.image.url = "http://127.0.0.1:9/bundle.tar".into();
        unreachable.image.sha256 = "cd".repeat(32);
        let error = runtime.run(&unreachable).await.expect_err("no image");
        assert!(error.0.contains("does not answer"), "{error}");

        let mut bridge = env.spec("inst_bridge0000000000000000000", TICKER);
        bridge.nics = vec![NicSpec {
            bridge: "a-bridge-name-far-too-long".into(),
            mac: "02:00:00:00:00:02".into(),
            address: "10.78.0.2/24".into(),
            gateway: Some("10.78.0.1".into()),
        }];
        let error = runtime.run(&bridge).await.expect_err("no bridge");
        assert!(error.0.contains("bridge"), "{error}");

        for spec in [&huge, &unreachable, &bridge] {
            assert!(matches!(
                state_of(&runtime, &spec.id).await,
                GuestState::Error(_)
            ));
            runtime.delete(&spec.id).await.expect("delete");
        }
        env.assert_clean();
    });
}

#[test]
fn the_minimal_guest_takes_its_address_answers_on_ssh_and_powers_off_on_stop() {
    let bundle = minimal_bundle();
    in_netns(move || async move {
        let env = TestEnv::new("minimal");
        let mut runtime = env.runtime();
        // The minimal guest handles the power button: stop must not need `quit`.
        runtime.stop_timeout = Duration::from_secs(120);
        let mut spec = env.spec("inst_minimal0000000000000000", TICKER);
        spec.image = ImageRef {
            url: format!("file://{}", bundle.display()),
            sha256: sha256_file(&bundle),
            format: "bundle".into(),
        };
        spec.nics = vec![NicSpec {
            bridge: "vpsbr0".into(),
            mac: "52:54:00:77:00:02".into(),
            address: "10.77.0.2/24".into(),
            gateway: Some("10.77.0.1".into()),
        }];
        let started = Instant::now();
        runtime.run(&spec).await.expect("run");
        let ssh = runtime.ssh_address(&spec.id).expect("an ssh address");
        let banner = wait_ssh_banner(ssh, Duration::from_secs(240)).await;
        println!("boot to sshd: {:?}", started.elapsed());
        assert!(banner.starts_with("SSH-2.0-"), "{banner}");

        // Paused, the guest answers nothing; resumed, the same sshd answers again.
        let pid = env.pid(&spec.id);
        runtime.pause(&spec).await.expect("pause");
        let connect = tokio::net::TcpStream::connect(ssh);
        let paused = tokio::time::timeout(Duration::from_secs(2), async {
            let mut stream = connect.await.ok()?;
            read_line(&mut stream).await
        });
        assert!(
            matches!(paused.await, Err(_) | Ok(None)),
            "a paused guest answered"
        );
        runtime.run(&spec).await.expect("resume");
        wait_ssh_banner(ssh, Duration::from_secs(30)).await;
        assert_eq!(env.pid(&spec.id), pid, "resume must not start a new QEMU");

        let stopping = Instant::now();
        runtime.stop(&spec.id).await.expect("stop");
        println!("clean power-off: {:?}", stopping.elapsed());
        let shutdown = std::fs::read_to_string(env.guest_dir(&spec.id).join("shutdown.json"))
            .expect("QEMU's SHUTDOWN event was recorded");
        assert!(
            shutdown.contains("guest-shutdown"),
            "not a guest power-off: {shutdown}"
        );
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Stopped);
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn auto_acceleration_trusts_kvm_only_when_a_probe_boot_proves_it() {
    in_netns(|| async {
        let env = TestEnv::new("accel");
        let mut runtime = Qemu::new(&env.state, &env.images, Accel::Auto).expect("runtime");
        runtime.kvm_probe_timeout = Duration::from_secs(10);
        // A machine with no kernel in /boot probes with the test kernel, as a cached bundle.
        if let Some(kernel) = std::env::var_os("VPS_TEST_KERNEL") {
            let entry = env.images.join("test-kernel");
            std::fs::create_dir_all(&entry).unwrap();
            std::os::unix::fs::symlink(kernel, entry.join("vmlinuz")).unwrap();
        }
        let kernels = accel::probe_kernels(&env.images);
        let kernel = kernels.first().expect("a kernel to probe with").clone();
        let probe = accel::probe_kvm(
            Path::new("qemu-system-x86_64"),
            &kernel,
            Duration::from_secs(10),
        )
        .await;
        println!("KVM probe: {probe:?}");

        let started = Instant::now();
        let chosen = runtime.chosen_accel().await;
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the probe is bounded"
        );
        assert_eq!(chosen == Chosen::Kvm, probe.is_ok(), "{probe:?}");
        assert_eq!(runtime.accel(), Some(chosen));
        assert!(runtime.cpu_model().starts_with(chosen.as_str()));
        // Remembered until the host reboots: a restarted agent does not probe again.
        let again = Qemu::new(&env.state, &env.images, Accel::Auto).expect("runtime");
        assert_eq!(again.accel(), Some(chosen));
        assert!(env.qemu_pids().is_empty());
    });
}

#[test]
fn an_image_over_http_is_fetched_once_for_two_guests() {
    in_netns(|| async {
        let env = TestEnv::new("http");
        let runtime = env.runtime();
        let local = env.spec("inst_http0000000000000000000a", TICKER);
        let bundle = std::fs::read(local.image.url.trim_start_matches("file://")).unwrap();
        let (url, requests) = serve_once_per_request(bundle).await;
        let mut specs = Vec::new();
        for id in [
            "inst_http0000000000000000000a",
            "inst_http0000000000000000000b",
        ] {
            let mut spec = env.spec(id, TICKER);
            spec.image.url = url.clone();
            specs.push(spec);
        }
        let (a, b) = tokio::join!(runtime.run(&specs[0]), runtime.run(&specs[1]));
        a.expect("first guest");
        b.expect("second guest");
        assert_eq!(
            requests.load(Ordering::SeqCst),
            1,
            "one download per digest"
        );
        for spec in &specs {
            assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
            runtime.delete(&spec.id).await.expect("delete");
        }
        env.assert_clean();
    });
}

#[test]
fn a_bundle_root_disk_is_layered_under_the_guest_and_a_backing_file_is_refused() {
    in_netns(|| async {
        let env = TestEnv::new("rootfs");
        let runtime = env.runtime();
        let rootfs = env.root.join("rootfs.qcow2");
        run(&[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            rootfs.to_str().unwrap(),
            "64M",
        ]);
        let mut spec = env.spec("inst_rootfs00000000000000000", TICKER);
        spec.image = bundle_with_rootfs(&env, &spec, &rootfs);
        runtime.run(&spec).await.expect("run");
        let disk = env.guest_dir(&spec.id).join("disk.qcow2");
        let info = run(&[
            "qemu-img",
            "info",
            "-U",
            "--output=json",
            disk.to_str().unwrap(),
        ]);
        let cached = env.images.join(&spec.image.sha256).join("rootfs.qcow2");
        assert!(
            info.contains(cached.to_str().unwrap()),
            "the overlay's backing file: {info}"
        );
        assert!(
            info.contains(&format!("{}", 1u64 << 30)),
            "the flavor's disk size: {info}"
        );
        runtime.delete(&spec.id).await.expect("delete");

        // A root disk that names a backing file would make QEMU open a host path.
        let hostile = env.root.join("hostile.qcow2");
        run(&[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            rootfs.to_str().unwrap(),
            hostile.to_str().unwrap(),
        ]);
        let mut spec = env.spec("inst_hostile0000000000000000", TICKER);
        spec.image = bundle_with_rootfs(&env, &spec, &hostile);
        let error = runtime
            .run(&spec)
            .await
            .expect_err("a backing file is refused");
        assert!(error.0.contains("backing file"), "{error}");
        assert!(env.qemu_pids().is_empty());
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

#[test]
fn a_qcow2_image_runs_on_q35_with_pci_devices() {
    in_netns(|| async {
        let env = TestEnv::new("q35");
        let runtime = env.runtime();
        // An empty disk: the firmware finds nothing to boot, but QEMU and its devices run.
        let image = env.root.join("image.qcow2");
        run(&[
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            image.to_str().unwrap(),
            "64M",
        ]);
        let mut spec = env.spec("inst_qcow2000000000000000000", TICKER);
        spec.image = ImageRef {
            url: format!("file://{}", image.display()),
            sha256: sha256_file(&image),
            format: "qcow2".into(),
        };
        runtime.run(&spec).await.expect("run");
        assert_eq!(state_of(&runtime, &spec.id).await, GuestState::Running);
        let cmdline = std::fs::read_to_string(env.guest_dir(&spec.id).join("run.sh")).unwrap();
        assert!(
            cmdline.contains("'q35'") && cmdline.contains("virtio-blk-pci"),
            "{cmdline}"
        );
        runtime.delete(&spec.id).await.expect("delete");
        env.assert_clean();
    });
}

// ---- harness ----------------------------------------------------------------------------

/// Runs `test` on a thread of its own inside a fresh network namespace, on a current-thread
/// tokio runtime, so every process it starts inherits the namespace.
fn in_netns<F, Fut>(test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) changes only this thread's network namespace.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        );
        ip(&["link", "set", "lo", "up"]);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(test());
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

struct TestEnv {
    root: PathBuf,
    state: PathBuf,
    images: PathBuf,
}

impl TestEnv {
    fn new(name: &str) -> TestEnv {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let root = std::env::temp_dir().join(format!("vq-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let env = TestEnv {
            state: root.join("s"),
            images: root.join("i"),
            root,
        };
        std::fs::create_dir_all(&env.root).unwrap();
        env
    }

    fn runtime(&self) -> Qemu {
        let mut runtime = Qemu::new(&self.state, &self.images, Accel::Tcg).expect("runtime");
        // The test guests ignore the ACPI power button: do not wait long for it.
        runtime.stop_timeout = Duration::from_secs(1);
        runtime
    }

    /// A spec booting a bundle whose `/init` is `init`.
    fn spec(&self, id: &str, init: &str) -> GuestSpec {
        let bundle = guest_bundle(&self.root, init);
        GuestSpec {
            id: id.into(),
            hostname: "test".into(),
            vcpus: 1,
            memory_mib: 256,
            disk_gib: 1,
            image: ImageRef {
                url: format!("file://{}", bundle.display()),
                sha256: sha256_file(&bundle),
                format: "bundle".into(),
            },
            nics: vec![],
            user_data: Some(b"#!/bin/sh\necho hello\n".to_vec()),
            ssh_ca: None,
            ..Default::default()
        }
    }

    fn guest_dir(&self, id: &str) -> PathBuf {
        self.state.join("guests").join(id)
    }

    fn console(&self, id: &str) -> String {
        std::fs::read_to_string(self.guest_dir(id).join("console.log")).unwrap_or_default()
    }

    async fn wait_console(&self, id: &str, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let console = self.console(id);
            if console.contains(needle) {
                return console;
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} on the console:\n{console}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn ticks(&self, id: &str) -> u64 {
        self.console(id)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("tick ")?.parse().ok())
            .max()
            .unwrap_or(0)
    }

    fn pid(&self, id: &str) -> i32 {
        let pid = std::fs::read_to_string(self.guest_dir(id).join("qemu.pid")).expect("pid file");
        pid.trim().parse().expect("a pid")
    }

    /// The live QEMU processes of this test's state directory.
    fn qemu_pids(&self) -> Vec<i32> {
        let needle = self.state.to_string_lossy().into_owned();
        let mut pids: Vec<i32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .filter(|pid: &i32| {
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmdline = String::from_utf8_lossy(&cmdline);
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                let zombie = stat
                    .rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
                cmdline.starts_with("qemu-system") && cmdline.contains(&needle) && !zombie
            })
            .collect();
        pids.sort();
        pids
    }

    /// The taps in this namespace (the runtime names them `vps…`; the bridges are `vpsbr…`).
    fn taps(&self) -> Vec<String> {
        ip(&["-o", "link", "show"])
            .lines()
            .filter_map(|l| l.split(": ").nth(1))
            .map(|name| name.split('@').next().unwrap_or(name).to_owned())
            .filter(|name| name.starts_with("vps") && !name.starts_with("vpsbr"))
            .collect()
    }

    fn assert_clean(&self) {
        assert!(
            self.qemu_pids().is_empty(),
            "stray QEMU: {:?}",
            self.qemu_pids()
        );
        assert!(self.taps().is_empty(), "stray taps: {:?}", self.taps());
        let left: Vec<_> = std::fs::read_dir(self.state.join("guests"))
            .unwrap()
            .flatten()
            .collect();
        assert!(left.is_empty(), "stray guest directories: {left:?}");
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // A failed test must not leave QEMUs behind either.
        for pid in self.qemu_pids() {
            // SAFETY: kill(2) on a QEMU of this test's own state directory.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

async fn state_of(runtime: &Qemu, id: &str) -> GuestState {
    let observed: Vec<Observed> = runtime.observe().await;
    observed
        .into_iter()
        .find(|o| o.id == id)
        .map(|o| o.state)
        .expect("the guest is observed")
}

async fn wait_state(runtime: &Qemu, id: &str, done: impl Fn(&GuestState) -> bool) -> GuestState {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = state_of(runtime, id).await;
        if done(&state) {
            return state;
        }
        assert!(Instant::now() < deadline, "still {state:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn boot_id(console: &str) -> String {
    console
        .lines()
        .find_map(|l| l.trim().strip_prefix("vps-test boot-id "))
        .expect("a boot id on the console")
        .to_owned()
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).expect("disk").ino()
}

/// A persistent tap, enslaved to `vpsbr0`, administratively up.
fn assert_tap_up_on_bridge(tap: &str) {
    let link = ip(&["-d", "link", "show", "dev", tap]);
    assert!(link.contains("master vpsbr0"), "not on the bridge: {link}");
    assert!(
        link.contains(",UP") || link.contains("<UP"),
        "not up: {link}"
    );
    assert!(link.contains("persist on"), "not persistent: {link}");
}

fn ip(args: &[&str]) -> String {
    let output = std::process::Command::new("ip")
        .args(args)
        .output()
        .expect("ip");
    assert!(
        output.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn sha256_file(path: &Path) -> String {
    use sha2::Digest;
    data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

/// A bundle (`vmlinuz`, `initrd`) with the machine's kernel and a busybox initramfs whose
/// `/init` is `init`, written under `dir`.
fn guest_bundle(dir: &Path, init: &str) -> PathBuf {
    let name = format!("bundle-{}.tar", &sha256_bytes(init.as_bytes())[..12]);
    let path = dir.join(name);
    if path.exists() {
        return path;
    }
    let kernel = std::env::var_os("VPS_TEST_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let mut kernels: Vec<PathBuf> = std::fs::read_dir("/boot")
                .expect("/boot")
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_string_lossy()
                        .starts_with("vmlinuz-")
                })
                .collect();
            kernels.sort();
            kernels
                .pop()
                .expect("a kernel in /boot (apt-get install linux-image-cloud-amd64)")
        });
    let busybox = std::env::var_os("VPS_TEST_BUSYBOX")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/bin/busybox".into());
    let busybox = std::fs::read(&busybox).expect("busybox (apt-get install busybox-static)");

    let mut cpio = Vec::new();
    for d in ["bin", "dev", "proc", "sys"] {
        newc(&mut cpio, d, 0o040755, b"", (0, 0));
    }
    newc(&mut cpio, "dev/console", 0o020600, b"", (5, 1));
    newc(&mut cpio, "bin/busybox", 0o100755, &busybox, (0, 0));
    newc(&mut cpio, "init", 0o100755, init.as_bytes(), (0, 0));
    newc(&mut cpio, "TRAILER!!!", 0, b"", (0, 0));

    let tmp = path.with_extension("tmp");
    let mut tar = tar::Builder::new(std::fs::File::create(&tmp).unwrap());
    tar.append_path_with_name(&kernel, "vmlinuz")
        .expect("kernel readable");
    let mut header = tar::Header::new_gnu();
    header.set_size(cpio.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    tar.append_data(&mut header, "initrd", cpio.as_slice())
        .unwrap();
    tar.finish().unwrap();
    drop(tar);
    std::fs::rename(&tmp, &path).unwrap();
    path
}

/// One entry of an uncompressed newc cpio archive (the kernel unpacks these as initramfs).
fn newc(out: &mut Vec<u8>, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
    static INO: AtomicUsize = AtomicUsize::new(1);
    let ino = INO.fetch_add(1, Ordering::SeqCst) as u32;
    let fields = [
        ino,
        mode,
        0,
        0,
        1,
        0,
        data.len() as u32,
        0,
        0,
        rdev.0,
        rdev.1,
        name.len() as u32 + 1,
        0,
    ];
    out.extend_from_slice(b"070701");
    for field in fields {
        out.extend_from_slice(format!("{field:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
    out.extend_from_slice(data);
    pad4(out);
}

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn sha256_bytes(bytes: &[u8]) -> String {
    use sha2::Digest;
    data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(bytes))
}

/// The minimal guest of `vps-guest-image`: `VPS_GUEST_IMAGE`, or the bundle that crate's own
/// boot test caches under the target directory (same name, same fingerprint), built if absent.
fn minimal_bundle() -> PathBuf {
    if let Some(path) = std::env::var_os("VPS_GUEST_IMAGE") {
        return PathBuf::from(path);
    }
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vps-guest-image");
    let out = cache.join(format!("minimal-{:016x}.tar", guest_sources_fingerprint()));
    if !out.exists() {
        std::fs::create_dir_all(&cache).unwrap();
        let work = cache.join(format!("work-{}", std::process::id()));
        let built =
            vps_guest_image::build_minimal(&out, &work, |step| eprintln!("build_minimal: {step}"));
        let _ = std::fs::remove_dir_all(&work);
        built.unwrap_or_else(|err| panic!("building the minimal guest: {err}"));
    }
    out
}

/// FNV-1a over the guest crate's `src/` and `assets/`, as its boot test names its cache.
fn guest_sources_fingerprint() -> u64 {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else {
                files.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest");
    let root = root.canonicalize().unwrap();
    let mut files = Vec::new();
    walk(&root.join("src"), &mut files);
    walk(&root.join("assets"), &mut files);
    files.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for file in files {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        for byte in name.bytes().chain(std::fs::read(&file).unwrap()) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Waits until `sshd` at `address` sends its version line.
async fn wait_ssh_banner(address: (std::net::IpAddr, u16), within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let attempt = tokio::time::timeout(Duration::from_secs(3), async {
            let mut stream = tokio::net::TcpStream::connect(address).await.ok()?;
            read_line(&mut stream).await
        });
        if let Ok(Some(line)) = attempt.await {
            return line;
        }
        assert!(
            Instant::now() < deadline,
            "no sshd at {address:?} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn read_line(stream: &mut tokio::net::TcpStream) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 256];
    let n = stream.read(&mut buf).await.ok()?;
    (n > 0).then(|| String::from_utf8_lossy(&buf[..n]).trim().to_owned())
}

/// A bundle of the test kernel and init plus `rootfs` as its `rootfs.qcow2`.
fn bundle_with_rootfs(env: &TestEnv, spec: &GuestSpec, rootfs: &Path) -> ImageRef {
    let base = PathBuf::from(spec.image.url.trim_start_matches("file://"));
    let out = env.root.join(format!(
        "with-{}.tar",
        rootfs.file_stem().unwrap().to_string_lossy()
    ));
    let mut tar = tar::Builder::new(std::fs::File::create(&out).unwrap());
    let mut archive = tar::Archive::new(std::fs::File::open(&base).unwrap());
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let mut header = entry.header().clone();
        let path = entry.path().unwrap().into_owned();
        tar.append_data(&mut header, path, &mut entry).unwrap();
    }
    tar.append_path_with_name(rootfs, "rootfs.qcow2").unwrap();
    tar.finish().unwrap();
    drop(tar);
    ImageRef {
        url: format!("file://{}", out.display()),
        sha256: sha256_file(&out),
        format: "bundle".into(),
    }
}

/// Serves `body` over HTTP on the namespace's loopback; counts the requests.
async fn serve_once_per_request(body: Vec<u8>) -> (String, std::sync::Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let requests = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = requests.clone();
    let body = std::sync::Arc::new(body);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = vec![0u8; 4096];
                let _ = stream.read(&mut request).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(&body).await;
            });
        }
    });
    (format!("http://{address}/bundle.tar"), requests)
}

fn run(args: &[&str]) -> String {
    let output = std::process::Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect(args[0]);
    assert!(
        output.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}
