//! The QEMU process of one guest: started detached, found again by its pid file, ended by
//! signal; and what its leftovers say about how it ended.
//!
//! QEMU is not the agent's child: `setsid -f` starts `run.sh` in a session of its own, and that
//! shell runs QEMU and writes its exit status to `exit-status` when it ends. So a guest outlives
//! the agent (even its `kill -9`), and the agent never needs `waitpid`: a process is alive while
//! its pid names a QEMU whose command line holds the guest's directory.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;

use super::accel::last_lines;
use super::qmp::Qmp;
use crate::runtime::{GuestState, RuntimeError};

/// The longest path a unix socket can have (`sun_path`, with its NUL).
const MAX_SOCKET_PATH: usize = 107;
/// Where QMP sockets go when the guest's directory is too deep for one.
pub const SHORT_SOCKET_DIR: &str = "/run/vps-host";

/// A guest's files under `<state_dir>/guests/<id>/`.
#[derive(Clone, Debug)]
pub struct GuestDir(pub PathBuf);

impl GuestDir {
    pub fn record(&self) -> PathBuf {
        self.0.join("spec.json")
    }
    /// The QMP socket: beside the guest's other files, unless that path is too long for a
    /// unix socket (a deep state directory); then under [`SHORT_SOCKET_DIR`], named by the
    /// digest of the guest's directory, so a restarted agent finds it the same way.
    pub fn qmp(&self) -> PathBuf {
        use sha2::{Digest, Sha256};
        use std::os::unix::ffi::OsStrExt;
        let beside = self.0.join("qmp.sock");
        if beside.as_os_str().len() <= MAX_SOCKET_PATH {
            return beside;
        }
        let digest = Sha256::digest(self.0.as_os_str().as_bytes());
        Path::new(SHORT_SOCKET_DIR).join(format!(
            "{}.sock",
            data_encoding::HEXLOWER.encode(&digest[..12])
        ))
    }
    pub fn console(&self) -> PathBuf {
        self.0.join("console.log")
    }
    /// QEMU's own standard error.
    pub fn qemu_log(&self) -> PathBuf {
        self.0.join("qemu.log")
    }
    pub fn pid(&self) -> PathBuf {
        self.0.join("qemu.pid")
    }
    pub fn disk(&self) -> PathBuf {
        self.0.join("disk.qcow2")
    }
    pub fn config_drive(&self) -> PathBuf {
        self.0.join("config.img")
    }
    pub fn script(&self) -> PathBuf {
        self.0.join("run.sh")
    }
    /// Written by `run.sh` when QEMU ends.
    pub fn exit_status(&self) -> PathBuf {
        self.0.join("exit-status")
    }
    /// The data of QEMU's `SHUTDOWN` event, written by the QMP reader.
    pub fn shutdown_event(&self) -> PathBuf {
        self.0.join("shutdown.json")
    }
    /// Present when the runtime itself ended the guest (stop, delete): its exit is expected.
    pub fn stop_requested(&self) -> PathBuf {
        self.0.join("stop-requested")
    }
    /// Why the runtime gave up on the guest (a boot with no sign of life, a failed start).
    pub fn error(&self) -> PathBuf {
        self.0.join("error")
    }
    /// The pid of `run.sh`, the shell that waits for QEMU.
    pub fn wrapper_pid(&self) -> PathBuf {
        self.0.join("wrapper.pid")
    }
    /// Present while the QEMU runs a guest resumed from a memory snapshot (no boot to watch).
    pub fn memory_restored(&self) -> PathBuf {
        self.0.join("memory-restored")
    }
    /// Present from a memory restore's resume until its guest has taken its new identity:
    /// until then it still answers to its source's SSH identity and machine id.
    pub fn identity_pending(&self) -> PathBuf {
        self.0.join("identity-pending")
    }
    /// Unix milliseconds of the last start, for the boot deadline across agent restarts.
    pub fn started_at(&self) -> PathBuf {
        self.0.join("started-at")
    }
    /// Present when the running QEMU was started in another directory (a warm restore slot,
    /// renamed to this one since): that directory's path, which its command line names.
    pub fn started_in(&self) -> PathBuf {
        self.0.join("started-in")
    }
    /// The directory the running QEMU was started in: this one, unless `started-in` says.
    pub fn origin(&self) -> GuestDir {
        match std::fs::read_to_string(self.started_in()) {
            Ok(path) if !path.trim().is_empty() => GuestDir(PathBuf::from(path.trim())),
            _ => self.clone(),
        }
    }
}

/// Starts QEMU with `args` for the guest in `dir`, detached, and returns its negotiated QMP
/// connection and pid once the socket answers (within `timeout`).
pub async fn spawn(
    qemu: &Path,
    args: &[String],
    dir: &GuestDir,
    timeout: Duration,
) -> Result<(Qmp, i32), RuntimeError> {
    for stale in [
        dir.exit_status(),
        dir.shutdown_event(),
        dir.stop_requested(),
        dir.error(),
        dir.pid(),
        dir.wrapper_pid(),
        dir.qmp(),
        dir.started_in(),
    ] {
        let _ = std::fs::remove_file(stale);
    }
    // The previous boot's logs stay for one boot, for whoever reads a failure.
    for log in [dir.console(), dir.qemu_log()] {
        let _ = std::fs::rename(&log, log.with_extension("log.1"));
    }
    let mut script = String::from(
        "#!/bin/sh\n# A guest's QEMU, as `vps host` started it; this shell records how QEMU ends.\n",
    );
    script.push_str(&format!(
        "cd {} || exit 1\n",
        quote(&dir.0.to_string_lossy())
    ));
    script.push_str("echo $$ >wrapper.pid\n");
    script.push_str(&quote(&qemu.to_string_lossy()));
    for arg in args {
        script.push_str(" \\\n  ");
        script.push_str(&quote(arg));
    }
    script.push_str(
        " </dev/null >>qemu.log 2>&1\necho $? >exit-status.new && mv exit-status.new exit-status\n",
    );
    let write = |path: PathBuf, data: String| {
        std::fs::write(&path, data)
            .map_err(|e| RuntimeError(format!("writing {}: {e}", path.display())))
    };
    write(dir.script(), script)?;
    write(dir.started_at(), unix_ms().to_string())?;

    let status = Command::new("setsid")
        .arg("-f")
        .arg("sh")
        .arg(dir.script())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .map_err(|e| RuntimeError(format!("cannot start QEMU (setsid): {e}")))?;
    if !status.success() {
        return Err(RuntimeError(format!("cannot start QEMU: setsid {status}")));
    }

    let deadline = Instant::now() + timeout;
    loop {
        if dir.exit_status().exists() {
            return Err(RuntimeError(format!(
                "QEMU failed to start: {}",
                qemu_log_tail(dir)
            )));
        }
        if dir.qmp().exists() {
            if let Ok(qmp) = Qmp::connect(&dir.qmp(), dir.shutdown_event()).await {
                // QEMU writes its pid file before it serves QMP.
                if let Some(pid) = read_pid(dir) {
                    return Ok((qmp, pid));
                }
            }
        }
        if Instant::now() > deadline {
            if let Some(pid) = read_pid(dir) {
                kill(pid, dir).await;
            }
            return Err(RuntimeError(format!(
                "QEMU did not answer on QMP within {timeout:?}: {}",
                qemu_log_tail(dir)
            )));
        }
        // QEMU answers about 20 ms after its start: a coarser poll would add to every boot.
        tokio::time::sleep(Duration::from_millis(4)).await;
    }
}

/// The pid in the guest's pid file, if it names a live QEMU of this guest.
pub fn live_pid(dir: &GuestDir) -> Option<i32> {
    read_pid(dir).filter(|&pid| is_alive(pid, dir))
}

fn read_pid(dir: &GuestDir) -> Option<i32> {
    std::fs::read_to_string(dir.pid()).ok()?.trim().parse().ok()
}

/// Whether `pid` is a running (not zombie) process whose command line names the guest's
/// directory (the one it was started in): a recycled pid never passes.
pub fn is_alive(pid: i32, dir: &GuestDir) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state follows the parenthesised command name, which may itself hold spaces.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    if matches!(state, Some("Z") | Some("X") | None) {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = dir.origin().qmp();
    let needle = needle.to_string_lossy();
    String::from_utf8_lossy(&cmdline).contains(needle.as_ref())
}

/// The CPU seconds (user and system) the guest's live QEMU has used, from
/// `/proc/<pid>/stat`'s `utime` and `stime` in clock ticks.
pub fn cpu_seconds(dir: &GuestDir) -> Option<f64> {
    let pid = live_pid(dir)?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    ticks_to_seconds(&stat, clock_ticks()?)
}

/// `utime + stime` of a `/proc/<pid>/stat` line in seconds. The fields after the
/// parenthesised command name (which may hold spaces) start at the state, field 3; `utime`
/// and `stime` are fields 14 and 15.
fn ticks_to_seconds(stat: &str, ticks_per_second: f64) -> Option<f64> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / ticks_per_second)
}

fn clock_ticks() -> Option<f64> {
    // SAFETY: sysconf(3) reads a constant of the system; it has no memory effects.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (ticks > 0).then_some(ticks as f64)
}

/// Sends `signal` to the guest's QEMU if it is still that process.
pub fn signal(pid: i32, dir: &GuestDir, signal: i32) {
    if is_alive(pid, dir) {
        // SAFETY: kill(2) has no memory effects; the pid was just checked to be this guest's.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// Kills the guest's QEMU and waits (a few seconds at most) until it is gone.
pub async fn kill(pid: i32, dir: &GuestDir) {
    signal(pid, dir, libc::SIGKILL);
    wait_gone(pid, dir, Duration::from_secs(5)).await;
}

/// Waits until the process is gone; false when it still runs after `timeout`.
pub async fn wait_gone(pid: i32, dir: &GuestDir, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while is_alive(pid, dir) {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    true
}

/// What a guest whose QEMU just ended is, once `run.sh` has had its moment to record how.
pub async fn ended(dir: &GuestDir) -> GuestState {
    settle(dir).await;
    exit_state(dir)
}

/// Waits (briefly) for `run.sh` to record the exit status of a QEMU that just ended.
pub async fn settle(dir: &GuestDir) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while !dir.exit_status().exists() && wrapper_alive(dir) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn wrapper_alive(dir: &GuestDir) -> bool {
    let Some(pid) = std::fs::read_to_string(dir.wrapper_pid())
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
    else {
        return false;
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rsplit_once(')')
        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
    let script = dir.origin().script();
    !zombie && String::from_utf8_lossy(&cmdline).contains(script.to_string_lossy().as_ref())
}

/// What a guest with no live QEMU is: `Stopped` when it was never started, when the runtime
/// stopped it, or when the guest powered itself off; `Error` otherwise, with the exit status
/// and the last lines of the console.
pub fn exit_state(dir: &GuestDir) -> GuestState {
    if let Ok(message) = std::fs::read_to_string(dir.error()) {
        return GuestState::Error(message.trim().to_owned());
    }
    if dir.stop_requested().exists() || !dir.script().exists() {
        return GuestState::Stopped;
    }
    let console = std::fs::read_to_string(dir.console()).unwrap_or_default();
    let panicked = console.contains("Kernel panic");
    let shutdown: Option<serde_json::Value> = std::fs::read_to_string(dir.shutdown_event())
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok());
    let reason = shutdown
        .as_ref()
        .and_then(|s| s.get("reason"))
        .and_then(|r| r.as_str())
        .map(str::to_owned);
    let status: Option<i32> = std::fs::read_to_string(dir.exit_status())
        .ok()
        .and_then(|s| s.trim().parse().ok());
    let qemu_log = std::fs::read_to_string(dir.qemu_log()).unwrap_or_default();
    let signalled = qemu_log
        .lines()
        .find(|l| l.contains("terminating on signal"));

    let why = match (status, reason.as_deref()) {
        (_, _) if panicked => "the guest kernel panicked".to_owned(),
        (Some(0), Some("guest-shutdown" | "guest-reset")) | (Some(0), None)
            if signalled.is_none() =>
        {
            // The guest powered off (or rebooted, which `-no-reboot` turns into an exit).
            return GuestState::Stopped;
        }
        (Some(status), _) if status > 128 => {
            format!(
                "QEMU was killed by signal {} (exit status {status})",
                status - 128
            )
        }
        (Some(status), reason) => match (signalled, reason) {
            (Some(line), _) => format!("QEMU exited with status {status}: {}", line.trim()),
            (None, Some(reason)) => format!("QEMU exited with status {status} ({reason})"),
            (None, None) => format!(
                "QEMU exited with status {status}: {}",
                last_lines(&qemu_log, 2)
            ),
        },
        (None, _) => {
            "QEMU is gone and its exit status is unknown (killed with its supervisor?)".to_owned()
        }
    };
    GuestState::Error(with_console(why, &console))
}

/// `why`, then the console's last lines.
pub fn with_console(why: String, console: &str) -> String {
    let tail = last_lines(console, 5);
    if tail.is_empty() {
        format!("{why}; the console is empty")
    } else {
        format!("{why}; console: {tail}")
    }
}

/// The end of QEMU's standard error, for a start that failed.
pub fn qemu_log_tail(dir: &GuestDir) -> String {
    let log = std::fs::read_to_string(dir.qemu_log()).unwrap_or_default();
    let tail = last_lines(&log, 3);
    if tail.is_empty() {
        "no output".to_owned()
    } else {
        tail
    }
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Single-quotes `s` for `sh`.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_survives_single_quotes() {
        assert_eq!(quote("a'b"), r"'a'\''b'");
    }

    #[test]
    fn cpu_seconds_are_utime_and_stime_over_the_tick_rate_whatever_the_name_holds() {
        let stat = "4242 (qemu (a) b) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 3";
        assert_eq!(ticks_to_seconds(stat, 100.0), Some(4.0));
        assert_eq!(ticks_to_seconds("4242 (qemu) S 1", 100.0), None);
    }
}
