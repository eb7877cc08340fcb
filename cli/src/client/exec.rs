//! `vps sandboxes exec <sbx_…> [-- command …]`: a shell (or one command) in a sandbox through
//! the system's OpenSSH client. It makes an ephemeral key pair, asks `sandboxes.exec` for a
//! certificate and a tunnel ticket, runs `ssh` with the certificate and `vps tunnel` as its
//! proxy, and removes the key afterwards.

use std::path::Path;
use std::process::Stdio;

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::json;

use super::Client;
use crate::tools::tunnel::TicketFile;

/// The command's arguments.
pub fn command() -> Command {
    Command::new("exec")
        .about("Runs a shell or a command in a sandbox over SSH (needs the system's ssh).")
        .arg(Arg::new("sandboxId").required(true).help("sbx_…"))
        .arg(tenant_arg())
        .arg(
            Arg::new("ttl")
                .long("ttl")
                .default_value("5m")
                .help("How long the certificate lives (at most 15m)"),
        )
        .arg(
            Arg::new("command")
                .num_args(0..)
                .last(true)
                .action(ArgAction::Append)
                .help("The command (after --); none: a shell"),
        )
}

/// `--tenant` (or `VPS_TENANT`), which exec and cp both require.
pub fn tenant_arg() -> Arg {
    Arg::new("tenantId")
        .long("tenant")
        .env("VPS_TENANT")
        .required(true)
        .help("The tenant")
}

/// Why an exec session could not be prepared.
#[derive(Debug)]
pub enum SessionError {
    /// `sandboxes.exec` refused (or the server did not answer).
    Api(super::ApiFailure),
    /// Something on this machine: no temporary directory, no `ssh-keygen`, …
    Local(String),
}

/// Prepares an exec session into `sandbox`: an ephemeral ed25519 key pair in a temporary
/// directory, a `sandboxes.exec` certificate for it, and the `ssh` command that connects
/// through `vps tunnel` (the remote command is for the caller to add). The key and
/// certificate are removed with the directory, so keep it until ssh ends.
pub async fn session(
    client: &Client,
    tenant: &str,
    sandbox: &str,
    ttl_seconds: Option<i64>,
) -> Result<(tempfile::TempDir, std::process::Command), SessionError> {
    let local = |e: &str| SessionError::Local(e.to_string());
    let dir = tempfile::tempdir().map_err(|e| local(&format!("no temporary directory: {e}")))?;
    let key = dir.path().join("id_ed25519");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "vps-exec", "-f"])
        .arg(&key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status();
    if !made.is_ok_and(|s| s.success()) {
        return Err(local("ssh-keygen failed (is OpenSSH installed?)"));
    }
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap_or_default();
    let mut body = json!({ "tenantId": tenant, "sandboxId": sandbox, "publicKey": public.trim() });
    if let Some(ttl) = ttl_seconds {
        body["ttlSeconds"] = ttl.into();
    }
    let grant = grant_once_identity_is_own(client, &body).await?;
    let me = std::env::current_exe().unwrap_or_else(|_| "vps".into());
    let ssh = ssh_command(&grant, dir.path(), &key, &me).map_err(SessionError::Local)?;
    Ok((dir, ssh))
}

/// How long an exec waits for a fresh memory restore to take an identity of its own.
const IDENTITY_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// `sandboxes.exec`, asked again while the refusal is `restore-shares-identity`: a memory
/// restore is `ready` as soon as its guest runs, and its host gives it an SSH identity of its
/// own a moment later. A restore whose host never does is refused after [`IDENTITY_WAIT`].
async fn grant_once_identity_is_own(
    client: &Client,
    body: &serde_json::Value,
) -> Result<serde_json::Value, SessionError> {
    let deadline = std::time::Instant::now() + IDENTITY_WAIT;
    loop {
        match client.request("sandboxes.exec", body).await {
            Err(failure) if shares_identity(&failure) && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            }
            answer => return answer.map_err(SessionError::Api),
        }
    }
}

fn shares_identity(failure: &super::ApiFailure) -> bool {
    failure
        .details
        .as_ref()
        .is_some_and(|d| d["reason"] == "restore-shares-identity")
}

/// [`session`] for a command line: a refusal or local failure is printed, and the exit code (1)
/// is the error.
pub async fn session_or_exit(
    client: &Client,
    tenant: &str,
    sandbox: &str,
    ttl_seconds: Option<i64>,
) -> Result<(tempfile::TempDir, std::process::Command), i32> {
    session(client, tenant, sandbox, ttl_seconds)
        .await
        .map_err(|e| match e {
            SessionError::Api(failure) => {
                super::report(&failure);
                failure.exit_code()
            }
            SessionError::Local(e) => {
                eprintln!("error: {e}");
                1
            }
        })
}

/// The `ssh` command for a `sandboxes.exec` grant. Nothing the server answered reaches a shell:
/// the tunnel's URL and ticket are checked, then written to a file in `dir` that
/// `vps tunnel --ticket-file` reads, so OpenSSH's `ProxyCommand` (run by `/bin/sh -c`) holds
/// only this binary's path and that file's, both quoted.
fn ssh_command(
    grant: &serde_json::Value,
    dir: &Path,
    key: &Path,
    me: &Path,
) -> Result<std::process::Command, String> {
    let tunnel = TicketFile::from_grant(grant)?;
    let instance = grant["instanceId"].as_str().unwrap_or("");
    if !vps_domain::ids::is_valid_id("inst", instance) {
        return Err(format!("the server answered a bad instanceId {instance:?}"));
    }
    let account = grant["account"].as_str().unwrap_or("sandbox");
    let plain_account = !account.is_empty()
        && account.len() <= 32
        && account
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
        && !account.starts_with('-');
    if !plain_account {
        return Err(format!("the server answered a bad account {account:?}"));
    }
    let certificate = dir.join("id_ed25519-cert.pub");
    std::fs::write(&certificate, grant["certificate"].as_str().unwrap_or(""))
        .map_err(|e| format!("cannot write the certificate: {e}"))?;
    let ticket_file = dir.join("tunnel.json");
    tunnel.write(&ticket_file)?;
    let proxy = proxy_command(me, &ticket_file)?;
    let mut ssh = std::process::Command::new("ssh");
    ssh.arg("-i")
        .arg(key)
        .arg("-o")
        .arg(format!("CertificateFile={}", certificate.display()))
        .args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
        ])
        .args(["-o", "LogLevel=ERROR", "-o", "IdentitiesOnly=yes"])
        .arg("-o")
        .arg(format!("ProxyCommand={proxy}"))
        .arg(format!("{account}@{instance}"));
    Ok(ssh)
}

/// `'<me>' tunnel --ticket-file '<file>'`: each path quoted for `/bin/sh`, and `%` doubled
/// because OpenSSH expands `%` tokens in a `ProxyCommand` before the shell sees it.
fn proxy_command(me: &Path, ticket_file: &Path) -> Result<String, String> {
    let quote = |p: &Path| {
        let text = p
            .to_str()
            .ok_or_else(|| format!("{} is not UTF-8", p.display()))?;
        shlex::try_quote(text)
            .map(|q| q.replace('%', "%%"))
            .map_err(|_| format!("{text:?} cannot be quoted for a shell"))
    };
    Ok(format!(
        "{} tunnel --ticket-file {}",
        quote(me)?,
        quote(ticket_file)?
    ))
}

/// Runs it; answers ssh's exit code (2 for a usage error, 1 for an API error).
pub async fn run(client: &Client, m: &ArgMatches) -> i32 {
    let sandbox = m
        .get_one::<String>("sandboxId")
        .cloned()
        .unwrap_or_default();
    if !vps_domain::ids::is_valid_id("sbx", &sandbox) {
        eprintln!("error: {sandbox:?} is not a sbx_… id");
        return 2;
    }
    let ttl = match super::args::seconds(m.get_one::<String>("ttl").map_or("5m", String::as_str)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --ttl: {e}");
            return 2;
        }
    };
    let tenant = m.get_one::<String>("tenantId").map_or("", String::as_str);
    let (dir, mut ssh) = match session_or_exit(client, tenant, &sandbox, Some(ttl)).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    if let Some(command) = m.get_many::<String>("command") {
        ssh.args(command);
    }
    let status = ssh.status();
    // The key and certificate go with the directory.
    drop(dir);
    match status {
        Ok(s) => s.code().unwrap_or(1),
        Err(e) => {
            eprintln!("error: cannot run ssh: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(url: &str) -> serde_json::Value {
        json!({
            "instanceId": format!("inst_{}", "a".repeat(vps_domain::ids::DERIVED_ID_LEN)),
            "account": "sandbox",
            "certificate": "ssh-ed25519-cert-v01@openssh.com AAAA",
            "tunnel": { "url": url, "ticket": format!("xt_{}", "0f".repeat(32)) },
        })
    }

    fn proxy_of(ssh: &std::process::Command) -> String {
        ssh.get_args()
            .filter_map(|a| a.to_str())
            .find_map(|a| a.strip_prefix("ProxyCommand="))
            .expect("a ProxyCommand")
            .to_string()
    }

    #[test]
    fn a_hostile_tunnel_url_is_refused_and_runs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let marker = dir.path().join("pwned");
        let me = Path::new("/usr/bin/vps");
        for url in [
            format!("tcp://$(touch {}):22", marker.display()),
            format!("tcp://`touch {}`:22", marker.display()),
            format!("tcp://x;touch {};:22", marker.display()),
        ] {
            let err =
                ssh_command(&grant(&url), dir.path(), &dir.path().join("k"), me).expect_err(&url);
            assert!(err.contains("tunnel.url"), "{err}");
        }
        assert!(!marker.exists());
        // Nothing was written for the refused grants.
        assert!(!dir.path().join("tunnel.json").exists());
    }

    #[test]
    fn the_proxy_command_holds_no_server_data() {
        let dir = tempfile::tempdir().unwrap();
        let me = Path::new("/opt/my tools/vps");
        let g = grant("tcp://node-1.example:2222");
        let ssh = ssh_command(&g, dir.path(), &dir.path().join("k"), me).unwrap();
        let proxy = proxy_of(&ssh);
        assert!(!proxy.contains("node-1.example"), "{proxy}");
        assert!(!proxy.contains("xt_"), "{proxy}");
        let words = shlex::split(&proxy).unwrap();
        let file = dir.path().join("tunnel.json");
        assert_eq!(
            words,
            [
                "/opt/my tools/vps",
                "tunnel",
                "--ticket-file",
                file.to_str().unwrap()
            ]
        );
        assert_eq!(
            TicketFile::read(&file).unwrap().url,
            "tcp://node-1.example:2222"
        );
    }

    #[test]
    fn a_bad_instance_or_account_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k");
        let me = Path::new("vps");
        let mut g = grant("tcp://127.0.0.1:22");
        g["instanceId"] = "-oProxyCommand=id".into();
        assert!(ssh_command(&g, dir.path(), &key, me).is_err());
        let mut g = grant("tcp://127.0.0.1:22");
        g["account"] = "root;id".into();
        assert!(ssh_command(&g, dir.path(), &key, me).is_err());
    }
}
