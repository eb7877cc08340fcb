//! What the real-guest tests of the `qemu` runtime share: the minimal guest bundle, a network
//! namespace per test, an SSH CA and certificates per guest, and the cleanup of stray QEMUs.
//! (`qemu_snapshots.rs` predates it and keeps its own copy.)

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use vps_host::runtime::qemu::{Accel, Qemu};
use vps_host::runtime::{GuestSpec, GuestState, ImageRef, NicSpec, Runtime, SshCa};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// One test's state directory, CA and guests' addresses.
pub struct Env {
    pub root: PathBuf,
    pub state: PathBuf,
    pub images: PathBuf,
    pub bundle: PathBuf,
    pub ca_public: String,
    /// The pool's /24 is `10.<net>.0.0/24`, its gateway `.1`.
    pub net: u8,
    addresses: Mutex<HashMap<String, String>>,
}

impl Env {
    /// Call [`minimal_bundle`] before entering the test's network namespace: building it
    /// downloads packages.
    pub fn new(name: &str, net: u8) -> Env {
        let bundle = minimal_bundle();
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let root = std::env::temp_dir().join(format!("vqt-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        for (file, comment) in [("ca", "ca"), ("user", "user")] {
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
        }
        let ca_public = std::fs::read_to_string(root.join("ca.pub")).unwrap();
        Env {
            state: root.join("s"),
            images: root.join("i"),
            bundle,
            ca_public,
            root,
            net,
            addresses: Mutex::default(),
        }
    }

    pub fn runtime(&self) -> Qemu {
        let mut runtime = Qemu::new(&self.state, &self.images, Accel::Tcg).expect("runtime");
        runtime.stop_timeout = Duration::from_secs(30);
        runtime.boot_deadline = Duration::from_secs(120);
        runtime
    }

    /// The minimal guest `id` at `10.<net>.0.<host>/24`, admitting its own principal (a
    /// certificate for it is made here).
    pub fn spec(&self, id: &str, host: u8) -> GuestSpec {
        let address = format!("10.{}.0.{host}", self.net);
        self.addresses
            .lock()
            .unwrap()
            .insert(id.to_owned(), address.clone());
        let cert = self.root.join(format!("{id}-cert.pub"));
        if !cert.exists() {
            run(&[
                "ssh-keygen",
                "-q",
                "-s",
                self.root.join("ca").to_str().unwrap(),
                "-I",
                id,
                "-n",
                id,
                "-V",
                "-5m:+1h",
                self.root.join("user.pub").to_str().unwrap(),
            ]);
            std::fs::rename(self.root.join("user-cert.pub"), &cert).unwrap();
        }
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
                mac: format!("52:54:00:{:02x}:00:{host:02x}", self.net),
                address: format!("{address}/24"),
                gateway: Some(format!("10.{}.0.1", self.net)),
            }],
            user_data: None,
            ssh_ca: Some(SshCa {
                public_key: self.ca_public.trim().to_owned(),
                principal: id.into(),
            }),
            ..Default::default()
        }
    }

    pub fn console(&self, id: &str) -> String {
        std::fs::read_to_string(self.state.join("guests").join(id).join("console.log"))
            .unwrap_or_default()
    }

    /// The `ssh` command into guest `id` (its certificate names `id`), without the remote
    /// command.
    pub fn ssh_command(&self, id: &str) -> Command {
        let address = self
            .addresses
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .expect("a guest made with spec()");
        let mut ssh = Command::new("ssh");
        ssh.args(["-F", "/dev/null", "-i"])
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
            .args(["-o", "LogLevel=ERROR", &format!("sandbox@{address}")]);
        ssh
    }

    /// Runs `command` in guest `id`: its standard output, or the status and standard error.
    pub fn ssh(&self, id: &str, command: &str) -> Result<String, String> {
        let output = self
            .ssh_command(id)
            .arg(command)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("ssh runs");
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(format!(
                "{}: {}{}",
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    /// [`Env::ssh`] once the guest's sshd answers (up to 4 minutes under TCG).
    pub fn ssh_until_up(&self, id: &str, command: &str) -> String {
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

    pub fn assert_no_qemu(&self) {
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

pub fn qemu_pids(state: &Path) -> Vec<i32> {
    let needle = state.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
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
        .collect()
}

pub async fn state_of(runtime: &Qemu, id: &str) -> GuestState {
    runtime
        .observe()
        .await
        .into_iter()
        .find(|o| o.id == id)
        .map(|o| o.state)
        .expect("the guest is observed")
}

/// Runs `test` on a thread of its own inside a fresh network namespace: every `ip`, `nft`,
/// `tc` and QEMU it starts inherits it, so nothing touches the machine's own network.
pub fn in_netns<F, Fut>(test: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) changes only this thread's network namespace.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "unshare: {}", std::io::Error::last_os_error());
        run(&["ip", "link", "set", "lo", "up"]);
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(test());
    });
    if let Err(panic) = thread.join() {
        std::panic::resume_unwind(panic);
    }
}

pub fn run(args: &[&str]) -> String {
    let output = Command::new(args[0])
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

pub fn sha256_file(path: &Path) -> String {
    use sha2::Digest;
    data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

pub fn bundle_digest(bundle: &Path) -> String {
    static DIGEST: OnceLock<String> = OnceLock::new();
    DIGEST.get_or_init(|| sha256_file(bundle)).clone()
}

/// The minimal guest: `VPS_GUEST_IMAGE`, or the bundle cached under the target directory for
/// the current guest sources, built if absent (as `vps-guest-image`'s boot test names it).
pub fn minimal_bundle() -> PathBuf {
    static BUNDLE: OnceLock<PathBuf> = OnceLock::new();
    BUNDLE
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("VPS_GUEST_IMAGE") {
                return PathBuf::from(path);
            }
            let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vps-guest-image");
            let out = cache.join(format!("minimal-{:016x}.tar", guest_sources_fingerprint()));
            if !out.exists() {
                std::fs::create_dir_all(&cache).unwrap();
                let work = cache.join(format!("work-common-{}", std::process::id()));
                let built = vps_guest_image::build_minimal(&out, &work, |step| {
                    eprintln!("build_minimal: {step}")
                });
                let _ = std::fs::remove_dir_all(&work);
                built.unwrap_or_else(|err| panic!("building the minimal guest: {err}"));
            }
            out
        })
        .clone()
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../guest")
        .canonicalize()
        .unwrap();
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

/// A process a test started, killed when dropped.
pub struct Owned(pub Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A second network namespace that plays "the internet": a process holding it, a veth pair
/// (`vinet` here with `here` addresses, `vpeer` there with `there` addresses) and `python3
/// script` (written to `root/name`) serving there.
pub fn the_internet(
    root: &Path,
    name: &str,
    script: &str,
    here: &[&str],
    there: &[&str],
) -> (Owned, Owned) {
    let path = root.join(name);
    std::fs::write(&path, script).unwrap();
    let holder = Owned(
        Command::new("unshare")
            .args(["-n", "--", "sleep", "3600"])
            .spawn()
            .expect("unshare"),
    );
    let pid = holder.0.id().to_string();
    // Wait until the holder runs in its own namespace.
    for _ in 0..100 {
        let ours = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
        if std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|ns| ns != ours) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    run(&[
        "ip", "link", "add", "vinet", "type", "veth", "peer", "name", "vpeer",
    ]);
    run(&["ip", "link", "set", "vpeer", "netns", &pid]);
    for address in here {
        run(&["ip", "addr", "add", address, "dev", "vinet"]);
    }
    run(&["ip", "link", "set", "vinet", "up"]);
    let inside = |args: &[&str]| {
        let mut all = vec!["nsenter", "-t", &pid, "-n"];
        all.extend_from_slice(args);
        run(&all);
    };
    inside(&["ip", "link", "set", "lo", "up"]);
    for address in there {
        inside(&["ip", "addr", "add", address, "dev", "vpeer"]);
    }
    inside(&["ip", "link", "set", "vpeer", "up"]);
    let servers = Owned(
        Command::new("nsenter")
            .args(["-t", &pid, "-n", "python3"])
            .arg(&path)
            .stdout(Stdio::null())
            .spawn()
            .expect("python3"),
    );
    (holder, servers)
}
