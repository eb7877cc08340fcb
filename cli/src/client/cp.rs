//! `vps sandboxes cp LOCAL sbx_…:PATH` and `vps sandboxes cp sbx_…:PATH LOCAL` (`-r` for a
//! directory): files over the exec path. One `sandboxes.exec` session (an ephemeral key, a
//! short certificate, a single-use tunnel ticket, see [`super::exec::session`]) runs one
//! command in the sandbox through the system's `ssh`: `cat` for a file, `tar` for a directory,
//! the bytes on ssh's standard input or output. The guest's own errors (a path the account
//! may not write, one that does not exist) reach standard error as the guest said them, and
//! the command exits 1.
//!
//! The remote command holds only the user's own paths, each quoted for `sh`; nothing the
//! server answered reaches a shell. A download is written to a temporary file beside its
//! target and renamed once complete; a directory is unpacked by the machine's GNU tar, which
//! keeps members inside the target (no absolute names, no `..`, symlinks placed last).

use std::path::{Path, PathBuf};
use std::process::{Command as Process, Stdio};

use clap::{Arg, ArgAction, ArgMatches, Command};

use super::exec::session_or_exit;
use super::Client;

/// The command's arguments.
pub fn command() -> Command {
    Command::new("cp")
        .about(
            "Copies a file (or with -r a directory) into or out of a sandbox over SSH \
             (needs the system's ssh; tar for -r).",
        )
        .arg(
            Arg::new("source")
                .required(true)
                .help("LOCAL, or sbx_…:PATH (a relative PATH is under the account's home)"),
        )
        .arg(
            Arg::new("target")
                .required(true)
                .help("sbx_…:PATH, or LOCAL"),
        )
        .arg(
            Arg::new("recursive")
                .short('r')
                .long("recursive")
                .action(ArgAction::SetTrue)
                .help("Copy a directory and everything in it"),
        )
        .arg(super::exec::tenant_arg())
}

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Local(PathBuf),
    Remote { sandbox: String, path: String },
}

/// `sbx_…:PATH` is the sandbox's; anything else is a local path (`./sbx_x:y` names a local
/// file whose name looks like one).
pub fn endpoint(text: &str) -> Endpoint {
    if let Some((sandbox, path)) = text.split_once(':') {
        if vps_domain::ids::is_valid_id("sbx", sandbox) {
            return Endpoint::Remote {
                sandbox: sandbox.to_owned(),
                path: path.to_owned(),
            };
        }
    }
    Endpoint::Local(PathBuf::from(text))
}

/// What to run, once the sides are known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// A local file to the sandbox's `path` (into it, when it is a directory).
    UploadFile { local: PathBuf, path: String },
    /// A local directory to the sandbox's `path` (into it, when it exists).
    UploadDir { local: PathBuf, path: String },
    /// The sandbox's file `path` to `local` (into it, when it is a directory).
    DownloadFile { path: String, local: PathBuf },
    /// The sandbox's directory `path` to `local` (into it, when it exists).
    DownloadDir { path: String, local: PathBuf },
}

/// The plan for `source` → `target`, or a usage error.
pub fn plan(source: &str, target: &str, recursive: bool) -> Result<(String, Plan), String> {
    match (endpoint(source), endpoint(target)) {
        (Endpoint::Local(local), Endpoint::Remote { sandbox, path }) => {
            let path = nonempty(path)?;
            let is_dir = local.is_dir();
            if is_dir && !recursive {
                return Err(format!(
                    "{} is a directory (copy it with -r)",
                    local.display()
                ));
            }
            if !is_dir && !local.is_file() {
                return Err(format!("{}: no such file or directory", local.display()));
            }
            let plan = match is_dir {
                true => Plan::UploadDir { local, path },
                false => Plan::UploadFile { local, path },
            };
            Ok((sandbox, plan))
        }
        (Endpoint::Remote { sandbox, path }, Endpoint::Local(local)) => {
            let path = nonempty(path)?;
            let plan = match recursive {
                true => Plan::DownloadDir { path, local },
                false => Plan::DownloadFile { path, local },
            };
            Ok((sandbox, plan))
        }
        (Endpoint::Remote { .. }, Endpoint::Remote { .. }) => {
            Err("both sides are in a sandbox: copy through a local file".into())
        }
        (Endpoint::Local(_), Endpoint::Local(_)) => {
            Err("neither side is in a sandbox (write one as sbx_…:PATH)".into())
        }
    }
}

fn nonempty(path: String) -> Result<String, String> {
    if path.is_empty() || path.contains('\0') {
        return Err("the sandbox path is empty (write sbx_…:PATH)".into());
    }
    Ok(path)
}

/// `text` quoted for the guest's `sh`.
fn quote(text: &str) -> Result<String, String> {
    shlex::try_quote(text)
        .map(|q| q.into_owned())
        .map_err(|_| format!("{text:?} cannot be quoted for a shell"))
}

/// The last component of a path as `cp` would name the copy (`.` and `/` have none).
fn base_name(path: &str) -> Option<String> {
    let name = path.trim_end_matches('/').rsplit('/').next()?;
    (!name.is_empty() && name != "." && name != "..").then(|| name.to_owned())
}

/// The command the guest runs for `plan` (an upload's remote command reads standard input, a
/// download's writes standard output).
pub fn remote_command(plan: &Plan) -> Result<String, String> {
    let local_name = |local: &Path| -> Result<String, String> {
        let name = local
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_os_string()))
            .or_else(|| local.file_name().map(|n| n.to_os_string()))
            .ok_or_else(|| format!("{} has no name to copy under", local.display()))?;
        name.into_string()
            .map_err(|_| format!("{} is not UTF-8", local.display()))
    };
    Ok(match plan {
        Plan::UploadFile { local, path } => format!(
            "t={}; if [ -d \"$t\" ]; then t=\"$t\"/{}; fi; cat > \"$t\"",
            quote(path)?,
            quote(&local_name(local)?)?
        ),
        Plan::UploadDir { local, path } => format!(
            "t={}; if [ -d \"$t\" ]; then t=\"$t\"/{}; fi; mkdir -p -- \"$t\" && tar -C \"$t\" -xf -",
            quote(path)?,
            quote(&local_name(local)?)?
        ),
        Plan::DownloadFile { path, .. } => format!("cat -- {}", quote(path)?),
        Plan::DownloadDir { path, .. } => format!("cd -- {} && tar -cf - .", quote(path)?),
    })
}

/// Where a download lands: `local`, or `local/<name>` when `local` is a directory.
fn download_target(local: &Path, remote: &str) -> Result<PathBuf, String> {
    if local.is_dir() {
        let name = base_name(remote)
            .ok_or_else(|| format!("{remote:?} has no name to copy under: name the target"))?;
        return Ok(local.join(name));
    }
    Ok(local.to_owned())
}

/// Runs `plan` with `ssh` (a session's command, the remote command not yet added): 0 when
/// the copy is complete, 1 when anything failed (the reason on standard error).
pub fn transfer(mut ssh: Process, plan: &Plan) -> Result<(), String> {
    ssh.arg(remote_command(plan)?);
    match plan {
        Plan::UploadFile { local, .. } => {
            let file =
                std::fs::File::open(local).map_err(|e| format!("{}: {e}", local.display()))?;
            ssh.stdin(file);
            succeeded(ssh.status(), "ssh")
        }
        Plan::UploadDir { local, .. } => {
            let mut tar = Process::new("tar")
                .arg("-C")
                .arg(local)
                .args(["-cf", "-", "."])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot run tar: {e}"))?;
            let stdout = tar.stdout.take().ok_or("tar has no output")?;
            ssh.stdin(stdout);
            let sent = succeeded(ssh.status(), "ssh");
            let packed = succeeded(tar.wait(), "tar");
            sent.and(packed)
        }
        Plan::DownloadFile { path, local } => {
            let target = download_target(local, path)?;
            let partial = partial_name(&target);
            let file = std::fs::File::create(&partial)
                .map_err(|e| format!("{}: {e}", partial.display()))?;
            ssh.stdin(Stdio::null()).stdout(file);
            let fetched = succeeded(ssh.status(), "ssh");
            if fetched.is_err() {
                let _ = std::fs::remove_file(&partial);
                return fetched;
            }
            std::fs::rename(&partial, &target).map_err(|e| {
                let _ = std::fs::remove_file(&partial);
                format!("{}: {e}", target.display())
            })
        }
        Plan::DownloadDir { path, local } => {
            let target = match local.exists() {
                true => download_target(local, path)?,
                false => local.clone(),
            };
            std::fs::create_dir_all(&target).map_err(|e| format!("{}: {e}", target.display()))?;
            ssh.stdin(Stdio::null()).stdout(Stdio::piped());
            let mut ssh = ssh.spawn().map_err(|e| format!("cannot run ssh: {e}"))?;
            let stdout = ssh.stdout.take().ok_or("ssh has no output")?;
            let unpacked = Process::new("tar")
                .arg("-C")
                .arg(&target)
                .args(["--no-same-owner", "--no-same-permissions", "-xf", "-"])
                .stdin(stdout)
                .status();
            let fetched = succeeded(ssh.wait(), "ssh");
            fetched.and(succeeded(unpacked, "tar"))
        }
    }
}

/// `target` with `.vps-partial-<pid>` added to its name, in the same directory.
fn partial_name(target: &Path) -> PathBuf {
    let mut name = target.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".vps-partial-{}", std::process::id()));
    target.with_file_name(name)
}

fn succeeded(status: std::io::Result<std::process::ExitStatus>, what: &str) -> Result<(), String> {
    match status {
        Ok(s) if s.success() => Ok(()),
        // The guest (or ssh) said why on standard error already.
        Ok(_) => Err(String::new()),
        Err(e) => Err(format!("cannot run {what}: {e}")),
    }
}

/// Runs it; answers 0, 1 (the copy failed, or an API error) or 2 (a usage error).
pub async fn run(client: &Client, m: &ArgMatches) -> i32 {
    let get = |name: &str| m.get_one::<String>(name).map_or("", String::as_str);
    let (sandbox, plan) = match plan(get("source"), get("target"), m.get_flag("recursive")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return 2;
        }
    };
    let (dir, ssh) = match session_or_exit(client, get("tenantId"), &sandbox, None).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let done = tokio::task::spawn_blocking(move || transfer(ssh, &plan)).await;
    // The key and certificate go with the directory.
    drop(dir);
    match done {
        Ok(Ok(())) => 0,
        Ok(Err(why)) => {
            if !why.is_empty() {
                eprintln!("error: {why}");
            }
            1
        }
        Err(e) => {
            eprintln!("error: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sbx() -> String {
        format!("sbx_{}", "a".repeat(vps_domain::ids::DERIVED_ID_LEN))
    }

    #[test]
    fn sides_are_told_apart_by_a_sandbox_id() {
        let remote = format!("{}:/tmp/x", sbx());
        assert_eq!(
            endpoint(&remote),
            Endpoint::Remote {
                sandbox: sbx(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(endpoint("a:b"), Endpoint::Local("a:b".into()));
        assert_eq!(endpoint("/tmp/x"), Endpoint::Local("/tmp/x".into()));
        assert!(plan(&remote, &remote, false).is_err());
        assert!(plan("/tmp", "/tmp", false).is_err());
        assert!(plan("/tmp", &remote, false).unwrap_err().contains("-r"));
        assert!(plan(&format!("{}:", sbx()), "/tmp/y", false).is_err());
    }

    #[test]
    fn remote_commands_quote_every_path() {
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("it's $(id).txt");
        std::fs::write(&local, b"x").unwrap();
        let command = remote_command(&Plan::UploadFile {
            local: local.clone(),
            path: "/tmp/a b;reboot".into(),
        })
        .unwrap();
        assert!(command.starts_with("t='/tmp/a b;reboot'; "), "{command}");
        let name = shlex::try_quote("it's $(id).txt").unwrap().into_owned();
        assert!(command.contains(&format!("t=\"$t\"/{name};")), "{command}");
        let command = remote_command(&Plan::DownloadFile {
            path: "-n $(reboot)".into(),
            local: local.clone(),
        })
        .unwrap();
        assert_eq!(command, "cat -- '-n $(reboot)'");
    }

    #[test]
    fn a_download_into_a_directory_takes_the_remote_name() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            download_target(dir.path(), "/etc/hostname").unwrap(),
            dir.path().join("hostname")
        );
        assert!(download_target(dir.path(), "/").is_err());
        let file = dir.path().join("f");
        assert_eq!(download_target(&file, "/etc/hostname").unwrap(), file);
    }
}
