//! The minimal guest booted for real: QEMU's microvm under TCG, in a network namespace this
//! test makes (a bridge with the gateway's address and a tap on it), reached with OpenSSH and
//! certificates from a test CA.
//!
//! The bundle is built once per version of this crate's sources and cached under the target
//! directory (`VPS_GUEST_IMAGE` names a prebuilt one instead). Building it needs `apt-get` with
//! current package lists; it runs outside any namespace. Booting needs root (namespaces, taps),
//! `qemu-system-x86_64`, `qemu-img`, `ssh`, `ssh-keygen`, `unshare`, `nsenter` and `ip`.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use vps_guest_image::config_drive::{self, ConfigDrive};
use vps_guest_image::KERNEL_CMDLINE;

const GUEST_ADDRESS: &str = "10.77.0.2";
const GATEWAY: &str = "10.77.0.1";
const MAC: &str = "52:54:00:77:00:02";
const PRINCIPAL: &str = "inst_01JBOOTTEST";
/// Boot to a working SSH login, under TCG on a busy two-core machine.
const BOOT_DEADLINE: Duration = Duration::from_secs(240);
/// A clean shutdown: acpid, busybox init's shutdown, the kernel's power off.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(60);
/// The user-data script: it appends, so a second run would show as a second line.
const USER_DATA: &str = "#!/bin/sh\necho \"user-data ran as $(id -u)\" >> /data/marker\n";

#[test]
fn a_minimal_guest_boots_its_own_kernel_leases_its_address_and_runs_its_user_data() {
    let lab = Lab::new("first");
    let mut guest = lab.boot(1);
    let booted = guest.started;
    let out = lab.ssh_until_up(
        &guest,
        "uname -r; cat /data/marker; cat /proc/cmdline; hostname; ip route show default; ip -br addr",
    );
    eprintln!(
        "boot to first ssh login: {:.1} s",
        booted.elapsed().as_secs_f64()
    );
    eprintln!("{out}\nconsole:\n{}", guest.console());

    let lines: Vec<&str> = out.lines().collect();
    let host_release = String::from_utf8(cmd("uname", &["-r"]).stdout).unwrap();
    assert_eq!(lines[0], lab.kernel_release, "{out}");
    assert_ne!(
        lines[0],
        host_release.trim(),
        "the guest runs the host's kernel: {out}"
    );
    assert_eq!(lines[1], "user-data ran as 0", "{out}");
    assert!(lines[2].starts_with(KERNEL_CMDLINE), "{out}");
    assert_eq!(lines[3], "boot-test", "{out}");
    assert!(
        lines[4].starts_with(&format!("default via {GATEWAY} dev eth0")),
        "{out}"
    );
    let nic = lines
        .iter()
        .find(|l| l.starts_with("eth0"))
        .unwrap_or_else(|| panic!("no eth0 in {out}"));
    assert!(nic.contains(&format!("{GUEST_ADDRESS}/24")), "{out}");
    assert!(nic.contains("UP"), "{out}");
    guest.kill();
}

#[test]
fn sshd_admits_only_the_instances_principal_and_the_acpi_power_button_stops_the_guest() {
    let lab = Lab::new("refuse");
    let mut guest = lab.boot(1);
    assert_eq!(lab.ssh_until_up(&guest, "echo in").trim(), "in");

    let refused = lab.ssh_with(&lab.other_cert, "echo in");
    assert_eq!(refused.status.code(), Some(255), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("Permission denied"), "{stderr}");
    assert!(refused.stdout.is_empty());

    // QMP `system_powerdown` is the ACPI power button: acpid runs poweroff, and with
    // -no-reboot the guest's power off ends QEMU.
    guest.qmp("system_powerdown");
    guest.wait_exit(SHUTDOWN_DEADLINE);
}

#[test]
fn the_root_disk_keeps_data_and_identity_across_boots_until_the_identity_generation_changes() {
    let lab = Lab::new("persist");
    let mut first = lab.boot(1);
    let key1 = lab.ssh_until_up(
        &first,
        "cat /etc/ssh/ssh_host_ed25519_key.pub; cat /etc/machine-id",
    );
    // `poweroff` in the guest ends QEMU (it runs with -no-reboot).
    let _ = lab.ssh("poweroff");
    first.wait_exit(SHUTDOWN_DEADLINE);

    let mut second = lab.boot(1);
    let out = lab.ssh_until_up(
        &second,
        "cat /etc/ssh/ssh_host_ed25519_key.pub; cat /etc/machine-id; cat /data/marker",
    );
    assert_eq!(
        out,
        format!("{key1}user-data ran as 0\n"),
        "user data ran twice or keys changed"
    );
    second.kill();

    let mut third = lab.boot(2);
    let out = lab.ssh_until_up(
        &third,
        "cat /etc/ssh/ssh_host_ed25519_key.pub; cat /etc/machine-id; cat /data/marker",
    );
    let old: Vec<&str> = key1.lines().collect();
    let new: Vec<&str> = out.lines().collect();
    assert_ne!(new[0], old[0], "same host key after an identity change");
    assert_ne!(new[1], old[1], "same machine id after an identity change");
    assert_eq!(new[2], "user-data ran as 0", "{out}");
    third.kill();
}

/// One test's world: a network namespace with a bridge and a tap, a root disk, keys and
/// certificates. Dropping it ends the namespace.
struct Lab {
    dir: tempfile::TempDir,
    kernel_release: String,
    netns: Child,
    cert: PathBuf,
    other_cert: PathBuf,
}

/// A running QEMU; dropping it kills it.
struct Guest {
    qemu: Child,
    dir: PathBuf,
    started: Instant,
}

impl Lab {
    fn new(name: &str) -> Lab {
        let bundle = bundle();
        let dir = tempfile::Builder::new()
            .prefix(&format!("vps-guest-{name}-"))
            .tempdir()
            .unwrap();
        let mut archive = tar::Archive::new(fs::File::open(bundle).unwrap());
        archive.unpack(dir.path()).unwrap();
        let kernel_release = kernel_release(&fs::read(dir.path().join("vmlinuz")).unwrap());

        let path = |name: &str| dir.path().join(name);
        run(
            "qemu-img",
            &["create", "-q", "-f", "qcow2", s(&path("root.qcow2")), "1G"],
        );
        run(
            "ssh-keygen",
            &[
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "ca",
                "-f",
                s(&path("ca")),
            ],
        );
        run(
            "ssh-keygen",
            &[
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "user",
                "-f",
                s(&path("user")),
            ],
        );
        for (principal, id) in [(PRINCIPAL, "cert"), ("inst_someoneelse", "other")] {
            run(
                "ssh-keygen",
                &[
                    "-q",
                    "-s",
                    s(&path("ca")),
                    "-I",
                    id,
                    "-n",
                    principal,
                    "-V",
                    "-5m:+1h",
                    s(&path("user.pub")),
                ],
            );
            fs::rename(path("user-cert.pub"), path(&format!("{id}-cert.pub"))).unwrap();
        }

        // The namespace lives as long as this shell; everything else enters it with nsenter.
        let script = format!(
            "set -e; ip link set lo up; \
             ip link add br0 type bridge; ip addr add {GATEWAY}/24 dev br0; ip link set br0 up; \
             ip tuntap add dev tap0 mode tap; ip link set tap0 master br0; ip link set tap0 up; \
             echo ready; exec sleep 3600"
        );
        let mut netns = Command::new("unshare")
            .args(["--net", "--", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare runs (util-linux, as root)");
        let mut ready = String::new();
        BufReader::new(netns.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(
            ready.trim(),
            "ready",
            "the test namespace could not be set up"
        );

        Lab {
            cert: path("cert-cert.pub"),
            other_cert: path("other-cert.pub"),
            kernel_release,
            netns,
            dir,
        }
    }

    fn boot(&self, identity_generation: u64) -> Guest {
        let dir = self.dir.path();
        let ca = fs::read_to_string(dir.join("ca.pub")).unwrap();
        config_drive::write(
            &dir.join("config.img"),
            &ConfigDrive {
                instance_id: PRINCIPAL.into(),
                hostname: "boot-test".into(),
                user_data: Some(USER_DATA.as_bytes().to_vec()),
                address: Some(format!("{GUEST_ADDRESS}/24")),
                gateway: Some(GATEWAY.into()),
                mac: Some(MAC.into()),
                nameserver: None,
                principal: Some(PRINCIPAL.into()),
                ssh_ca_public_key: Some(ca),
                host_ssh_public_key: None,
                identity_generation,
                fresh_identity: None,
                volumes: Vec::new(),
            },
        )
        .unwrap();
        let _ = fs::remove_file(dir.join("qmp.sock"));
        let p = |name: &str| dir.join(name).display().to_string();
        let qemu = Command::new("nsenter")
            .arg(format!("--net=/proc/{}/ns/net", self.netns.id()))
            .args([
                "--",
                "qemu-system-x86_64",
                "-M",
                "microvm",
                "-accel",
                "tcg",
                "-cpu",
                "max",
            ])
            .args([
                "-m",
                "256",
                "-smp",
                "1",
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
            ])
            .args([
                "-no-reboot",
                "-kernel",
                &p("vmlinuz"),
                "-initrd",
                &p("initrd"),
            ])
            .args(["-append", KERNEL_CMDLINE])
            .args(["-serial", &format!("file:{}", p("console.log"))])
            .args([
                "-qmp",
                &format!("unix:{},server=on,wait=off", p("qmp.sock")),
            ])
            .args([
                "-drive",
                &format!("id=root,file={},format=qcow2,if=none", p("root.qcow2")),
            ])
            .args(["-device", "virtio-blk-device,drive=root,serial=vps-root"])
            .args([
                "-drive",
                &format!(
                    "id=config,file={},format=raw,if=none,readonly=on",
                    p("config.img")
                ),
            ])
            .args([
                "-device",
                "virtio-blk-device,drive=config,serial=vps-config",
            ])
            .args(["-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no"])
            .args([
                "-device",
                &format!("virtio-net-device,netdev=net0,mac={MAC}"),
            ])
            .stderr(Stdio::piped())
            .spawn()
            .expect("qemu-system-x86_64 runs");
        Guest {
            qemu,
            dir: dir.to_path_buf(),
            started: Instant::now(),
        }
    }

    /// Runs `command` over SSH once the guest answers, and returns its output; panics with the
    /// guest's console when the deadline passes or QEMU dies first.
    fn ssh_until_up(&self, guest: &Guest, command: &str) -> String {
        let deadline = Instant::now() + BOOT_DEADLINE;
        loop {
            let out = self.ssh(command);
            if out.status.success() {
                return String::from_utf8(out.stdout).unwrap();
            }
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            let retry = out.status.code() == Some(255)
                && !stderr.contains("Permission denied")
                && Instant::now() < deadline;
            if !retry {
                panic!(
                    "ssh {command:?}: {:?} {stderr}\nconsole:\n{}",
                    out.status,
                    guest.console()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn ssh(&self, command: &str) -> Output {
        self.ssh_with(&self.cert, command)
    }

    fn ssh_with(&self, cert: &Path, command: &str) -> Output {
        Command::new("nsenter")
            .arg(format!("--net=/proc/{}/ns/net", self.netns.id()))
            .args(["--", "ssh", "-F", "/dev/null", "-i"])
            .arg(self.dir.path().join("user"))
            .arg("-o")
            .arg(format!("CertificateFile={}", cert.display()))
            .args([
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=5",
            ])
            // A guest that powers off mid-session must not leave ssh waiting on TCP.
            .args(["-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"])
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .args([
                "-o",
                "LogLevel=ERROR",
                &format!("sandbox@{GUEST_ADDRESS}"),
                command,
            ])
            .stdin(Stdio::null())
            .output()
            .expect("ssh runs")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = self.netns.kill();
        let _ = self.netns.wait();
    }
}

impl Guest {
    fn console(&self) -> String {
        fs::read_to_string(self.dir.join("console.log")).unwrap_or_default()
    }

    /// Sends one QMP command and waits for its answer.
    fn qmp(&self, command: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match UnixStream::connect(self.dir.join("qmp.sock")) {
                Ok(stream) => break stream,
                Err(err) if Instant::now() > deadline => panic!("QMP socket: {err}"),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut writer = stream.try_clone().unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap(); // the greeting
        for execute in ["qmp_capabilities", command] {
            writeln!(writer, "{{\"execute\":\"{execute}\"}}").unwrap();
            loop {
                line.clear();
                reader.read_line(&mut line).unwrap();
                if line.contains("\"return\"") {
                    break;
                }
                assert!(!line.contains("\"error\""), "QMP {execute}: {line}");
                assert!(!line.is_empty(), "QMP closed before answering {execute}");
            }
        }
    }

    /// Waits for QEMU to exit by itself; panics with the console if it does not in time.
    fn wait_exit(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.qemu.try_wait().unwrap() {
                let mut stderr = String::new();
                if let Some(mut pipe) = self.qemu.stderr.take() {
                    let _ = pipe.read_to_string(&mut stderr);
                }
                assert!(status.success(), "QEMU exited {status}: {stderr}");
                eprintln!(
                    "QEMU exited {:.1} s after the power-off request",
                    (Instant::now() + within - deadline).as_secs_f64()
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "QEMU still runs {} s after the guest was told to power off; console:\n{}",
            within.as_secs(),
            self.console()
        );
    }

    fn kill(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The bundle under test: `VPS_GUEST_IMAGE`, or one built from Debian's packages once per
/// version of this crate's sources and kept under the target directory.
fn bundle() -> &'static Path {
    static BUNDLE: OnceLock<PathBuf> = OnceLock::new();
    BUNDLE.get_or_init(|| {
        if let Some(path) = std::env::var_os("VPS_GUEST_IMAGE") {
            return PathBuf::from(path);
        }
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vps-guest-image");
        let out = cache.join(format!("minimal-{:016x}.tar", sources_fingerprint()));
        if !out.exists() {
            fs::create_dir_all(&cache).unwrap();
            // Bundles of older sources are of no further use; each is some 20 MB.
            for old in fs::read_dir(&cache).unwrap().flatten() {
                let name = old.file_name().to_string_lossy().into_owned();
                if name.starts_with("minimal-") && name.ends_with(".tar") {
                    let _ = fs::remove_file(old.path());
                }
            }
            let started = Instant::now();
            // A work directory of this process's own: another test binary may build too.
            let work = cache.join(format!("work-{}", std::process::id()));
            let built = vps_guest_image::build_minimal(&out, &work, |step| {
                eprintln!("build_minimal: {step}")
            });
            let _ = fs::remove_dir_all(&work);
            built.unwrap_or_else(|err| panic!("building the minimal guest: {err}"));
            eprintln!(
                "built {} in {:.1} s",
                out.display(),
                started.elapsed().as_secs_f64()
            );
        }
        out
    })
}

/// FNV-1a over this crate's `src/` and `assets/`: a new build whenever either changes.
fn sources_fingerprint() -> u64 {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else {
                files.push(path);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    walk(&root.join("src"), &mut files);
    walk(&root.join("assets"), &mut files);
    files.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for file in files {
        let name = file.strip_prefix(root).unwrap().display().to_string();
        for byte in name.bytes().chain(fs::read(&file).unwrap()) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The release a bzImage announces (`6.1.0-57-cloud-amd64`): the first word of the string
/// its setup header's `kernel_version` field points at.
fn kernel_release(bzimage: &[u8]) -> String {
    assert_eq!(&bzimage[0x202..0x206], b"HdrS", "vmlinuz is not a bzImage");
    let offset = u16::from_le_bytes([bzimage[0x20e], bzimage[0x20f]]) as usize + 0x200;
    let text = &bzimage[offset..offset + 256];
    let end = text.iter().position(|&b| b == 0 || b == b' ').unwrap();
    String::from_utf8(text[..end].to_vec()).unwrap()
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

fn cmd(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|err| panic!("{program} could not run: {err}"))
}

fn run(program: &str, args: &[&str]) {
    let out = cmd(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
