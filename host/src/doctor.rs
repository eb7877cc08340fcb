//! `vps doctor --config host.toml` on a host: what the agent needs from the machine, each
//! check with what was seen and, when something is wrong, what to do.

use std::path::Path;
use std::time::Duration;

use crate::config::HostConfig;
use crate::runtime::qemu::accel::{self, Accel, Chosen};

/// How bad a finding is (the server's doctor uses the same three words).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Ok,
    Warning,
    Error,
}

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// `vps.host.<name>`.
    pub check: &'static str,
    pub severity: Severity,
    pub message: String,
    /// What to do, when not ok.
    pub fix: Option<String>,
}

impl Finding {
    fn ok(check: &'static str, message: impl Into<String>) -> Finding {
        Finding {
            check,
            severity: Severity::Ok,
            message: message.into(),
            fix: None,
        }
    }

    fn bad(
        check: &'static str,
        severity: Severity,
        message: impl Into<String>,
        fix: &str,
    ) -> Finding {
        Finding {
            check,
            severity,
            message: message.into(),
            fix: Some(fix.into()),
        }
    }
}

/// Free space below which a directory is a warning, and an error.
const LOW_SPACE: u64 = 5 << 30;
const NO_SPACE: u64 = 1 << 30;
/// How long the KVM probe boot may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Every check, in order: QEMU, acceleration, bridge, free space.
pub async fn run(config: &HostConfig) -> Vec<Finding> {
    let qemu = Path::new("qemu-system-x86_64");
    let mut findings = vec![
        binary("vps.host.qemu", qemu).await,
        binary("vps.host.qemu_img", Path::new("qemu-img")).await,
    ];
    findings.push(acceleration(qemu, config).await);
    findings.push(bridge(config.bridge.as_deref()).await);
    for (check, dir) in [
        ("vps.host.state_dir_space", &config.state_dir),
        ("vps.host.image_dir_space", &config.image_dir),
    ] {
        findings.push(space(check, dir));
    }
    findings
}

async fn binary(check: &'static str, binary: &Path) -> Finding {
    let out = tokio::process::Command::new(binary)
        .arg("--version")
        .output()
        .await;
    match out {
        Ok(out) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            Finding::ok(check, text.lines().next().unwrap_or("").trim().to_string())
        }
        Ok(out) => Finding::bad(
            check,
            Severity::Error,
            format!("{} --version failed ({})", binary.display(), out.status),
            "reinstall qemu-system-x86 and qemu-utils",
        ),
        Err(e) => Finding::bad(
            check,
            Severity::Error,
            format!("{} not found: {e}", binary.display()),
            "apt-get install qemu-system-x86 qemu-utils",
        ),
    }
}

/// `kvm` or `auto`: a probe boot says whether KVM works; `tcg` is taken as configured.
async fn acceleration(qemu: &Path, config: &HostConfig) -> Finding {
    const CHECK: &str = "vps.host.accel";
    if config.accel == Accel::Tcg {
        return Finding::ok(
            CHECK,
            format!(
                "TCG, as configured (slow: no hardware virtualization); {}",
                register_as(Chosen::Tcg)
            ),
        );
    }
    let kernels = accel::probe_kernels(&config.image_dir);
    let Some(kernel) = kernels.iter().find(|k| k.is_file()) else {
        return Finding::bad(
            CHECK,
            Severity::Warning,
            "no kernel to prove KVM with yet (none cached, none in /boot)",
            "run a guest once, or install a kernel in /boot, then run doctor again",
        );
    };
    match accel::probe_kvm(qemu, kernel, PROBE_TIMEOUT).await {
        Ok(()) => Finding::ok(
            CHECK,
            format!(
                "KVM works (a probe boot reached the kernel); {}",
                register_as(Chosen::Kvm)
            ),
        ),
        Err(why) if config.accel == Accel::Auto => Finding::bad(
            CHECK,
            Severity::Warning,
            format!("TCG will be used: {why}; {}", register_as(Chosen::Tcg)),
            "enable (nested) virtualization for this machine for KVM's speed",
        ),
        Err(why) => Finding::bad(
            CHECK,
            Severity::Error,
            format!("accel = \"kvm\" but KVM does not work: {why}"),
            "set accel = \"auto\" or \"tcg\", or enable virtualization",
        ),
    }
}

/// The `cpuModel` to register the node with, so memory snapshots taken here restore here.
fn register_as(chosen: Chosen) -> String {
    format!(
        "guests' CPU model {:?}: register the node with that cpuModel",
        crate::runtime::qemu::cpu_model_of(chosen)
    )
}

/// The bridge taps attach to: there already, or one the agent can make (root, `/dev/net/tun`).
async fn bridge(bridge: Option<&str>) -> Finding {
    const CHECK: &str = "vps.host.bridge";
    if !Path::new("/dev/net/tun").exists() {
        return Finding::bad(
            CHECK,
            Severity::Error,
            "/dev/net/tun is missing: no tap can be made",
            "load the tun module (modprobe tun)",
        );
    }
    let Some(bridge) = bridge else {
        return Finding::ok(
            CHECK,
            "taps attach to the bridge each NIC of the spec names",
        );
    };
    let shown = tokio::process::Command::new("ip")
        .args(["-br", "link", "show", "dev", bridge])
        .output()
        .await;
    match shown {
        Ok(out) if out.status.success() => Finding::ok(
            CHECK,
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
        ),
        Ok(_) if is_root() => Finding::ok(
            CHECK,
            format!("{bridge} does not exist yet; the agent makes it with the pool's gateway"),
        ),
        Ok(_) => Finding::bad(
            CHECK,
            Severity::Error,
            format!("{bridge} does not exist, and this user cannot make it"),
            "run the agent as root (or with CAP_NET_ADMIN), or make the bridge",
        ),
        Err(e) => Finding::bad(
            CHECK,
            Severity::Error,
            format!("cannot run ip: {e}"),
            "apt-get install iproute2",
        ),
    }
}

/// Free space where guests' disks or images go.
fn space(check: &'static str, dir: &Path) -> Finding {
    // The directory may not exist yet: measure the nearest one that does.
    let existing = dir
        .ancestors()
        .find(|d| d.exists())
        .unwrap_or(Path::new("/"));
    let Some(free) = crate::disk::free_bytes(existing) else {
        return Finding::bad(
            check,
            Severity::Warning,
            format!("cannot measure free space in {}", existing.display()),
            "check the path and its permissions",
        );
    };
    let gib = free as f64 / f64::from(1u32 << 30);
    let message = format!("{gib:.1} GiB free in {}", existing.display());
    if free < NO_SPACE {
        Finding::bad(
            check,
            Severity::Error,
            message,
            "free space: guests' disks cannot grow",
        )
    } else if free < LOW_SPACE {
        Finding::bad(
            check,
            Severity::Warning,
            message,
            "free space before guests fill it",
        )
    } else {
        Finding::ok(check, message)
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_space_is_measured_on_the_nearest_existing_directory() {
        let f = space(
            "vps.host.state_dir_space",
            Path::new("/tmp/does/not/exist/yet"),
        );
        assert!(f.message.contains("GiB free in /tmp"), "{f:?}");
    }

    #[tokio::test]
    async fn a_missing_binary_is_an_error_with_a_fix() {
        let f = binary("vps.host.qemu", Path::new("/nonexistent/qemu")).await;
        assert_eq!(f.severity, Severity::Error);
        assert!(f.fix.is_some());
    }
}
