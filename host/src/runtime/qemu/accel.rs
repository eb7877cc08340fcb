//! Acceleration: KVM when it is proven to work, TCG otherwise.
//!
//! On some machines `/dev/kvm` opens and a VM is created, yet the guest hangs early in its
//! boot (nested virtualization). So `auto` never trusts the device: it boots a real kernel
//! under KVM with no root file system and expects the kernel's own panic, which ends QEMU
//! (`-no-reboot`), within a timeout.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::process::Command;

/// What the configuration asks for (`accel = "kvm" | "tcg" | "auto"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
    /// KVM if a probe boot proves it works, else TCG with a warning.
    Auto,
}

/// The acceleration guests actually run with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chosen {
    Kvm,
    Tcg,
}

impl From<Chosen> for Accel {
    fn from(chosen: Chosen) -> Accel {
        match chosen {
            Chosen::Kvm => Accel::Kvm,
            Chosen::Tcg => Accel::Tcg,
        }
    }
}

impl FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            "auto" => Ok(Accel::Auto),
            other => Err(format!("accel must be kvm, tcg or auto, not {other:?}")),
        }
    }
}

impl Chosen {
    /// `kvm` or `tcg`, as reports and `vps doctor` show it.
    pub fn as_str(self) -> &'static str {
        match self {
            Chosen::Kvm => "kvm",
            Chosen::Tcg => "tcg",
        }
    }

    /// The `-accel` and `-cpu` arguments. Under TCG `max` gives the guest every emulated
    /// feature; under KVM the host's CPU.
    pub fn args(self) -> [&'static str; 4] {
        match self {
            Chosen::Kvm => ["-accel", "kvm", "-cpu", "host"],
            Chosen::Tcg => ["-accel", "tcg", "-cpu", "max"],
        }
    }
}

impl fmt::Display for Chosen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Decides the acceleration: `kvm` and `tcg` are taken as asked; `auto` probes KVM with
/// `kernel` (the first readable one of `kernels`) and falls back to TCG with a warning.
pub async fn choose(qemu: &Path, accel: Accel, kernels: &[PathBuf], timeout: Duration) -> Chosen {
    match accel {
        Accel::Kvm => Chosen::Kvm,
        Accel::Tcg => Chosen::Tcg,
        Accel::Auto => {
            let Some(kernel) = kernels.iter().find(|k| k.is_file()) else {
                tracing::warn!("accel auto: no kernel to prove KVM with; using TCG");
                return Chosen::Tcg;
            };
            match probe_kvm(qemu, kernel, timeout).await {
                Ok(()) => {
                    tracing::info!(kernel = %kernel.display(), "accel auto: KVM works");
                    Chosen::Kvm
                }
                Err(why) => {
                    tracing::warn!(%why, "accel auto: KVM does not work here; using TCG");
                    Chosen::Tcg
                }
            }
        }
    }
}

/// Boots `kernel` under KVM with no root file system: a working KVM reaches the kernel's
/// "VFS: Unable to mount root fs" panic and QEMU exits (`panic=-1`, `-no-reboot`).
pub async fn probe_kvm(qemu: &Path, kernel: &Path, timeout: Duration) -> Result<(), String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .map_err(|e| format!("/dev/kvm: {e}"))?;
    let mut child = Command::new(qemu)
        .args(["-M", "microvm"])
        .args(Chosen::Kvm.args())
        .args([
            "-m",
            "256",
            "-smp",
            "1",
            "-nodefaults",
            "-no-user-config",
            "-no-reboot",
        ])
        .args(["-display", "none", "-serial", "stdio"])
        .arg("-kernel")
        .arg(kernel)
        .args(["-append", "console=ttyS0 panic=-1 quiet loglevel=1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", qemu.display()))?;
    let mut stdout = child.stdout.take();
    let mut stderr = child.stderr.take();
    let output = async {
        let mut out = String::new();
        let mut err = String::new();
        if let Some(s) = stdout.as_mut() {
            let _ = s.read_to_string(&mut out).await;
        }
        if let Some(s) = stderr.as_mut() {
            let _ = s.read_to_string(&mut err).await;
        }
        (out, err, child.wait().await)
    };
    match tokio::time::timeout(timeout, output).await {
        Err(_) => Err(format!(
            "a probe boot under KVM showed no kernel panic within {timeout:?}"
        )),
        Ok((out, err, status)) => {
            if out.contains("Kernel panic") || out.contains("VFS:") {
                Ok(())
            } else {
                let status = status
                    .map(|s| s.to_string())
                    .unwrap_or_else(|e| e.to_string());
                Err(format!(
                    "a probe boot under KVM ended ({status}) before the kernel ran: {}",
                    last_lines(&format!("{out}{err}"), 3)
                ))
            }
        }
    }
}

/// Kernels to probe with, best first: the cached bundles' kernels, then the host's own.
pub fn probe_kernels(image_dir: &Path) -> Vec<PathBuf> {
    let mut kernels: Vec<PathBuf> = std::fs::read_dir(image_dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("vmlinuz"))
        .filter(|path| path.is_file())
        .collect();
    let mut boot: Vec<PathBuf> = std::fs::read_dir("/boot")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("vmlinuz"))
        })
        .collect();
    boot.sort();
    boot.reverse();
    kernels.extend(boot);
    kernels
}

/// The last `n` non-empty lines of `text`, joined with ` | ` for a one-line message.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}
