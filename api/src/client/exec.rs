//! `vps sandboxes exec <sbx_…> [-- command …]`: a shell (or one command) in a sandbox through
//! the system's OpenSSH client. It makes an ephemeral key pair, asks `sandboxes.exec` for a
//! certificate and a tunnel ticket, runs `ssh` with the certificate and `vps tunnel` as its
//! proxy, and removes the key afterwards.

use std::process::Stdio;

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::json;

use super::Client;

/// The command's arguments.
pub fn command() -> Command {
    Command::new("exec")
        .about("Runs a shell or a command in a sandbox over SSH (needs the system's ssh).")
        .arg(Arg::new("sandboxId").required(true).help("sbx_…"))
        .arg(
            Arg::new("tenantId")
                .long("tenant")
                .env("VPS_TENANT")
                .required(true)
                .help("The tenant"),
        )
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
    let grant = client
        .request("sandboxes.exec", &body)
        .await
        .map_err(SessionError::Api)?;
    let certificate = dir.path().join("id_ed25519-cert.pub");
    std::fs::write(&certificate, grant["certificate"].as_str().unwrap_or(""))
        .map_err(|_| local("cannot write the certificate"))?;
    let me = std::env::current_exe().unwrap_or_else(|_| "vps".into());
    let proxy = format!(
        "{} tunnel --url {} --ticket {}",
        me.display(),
        grant["tunnel"]["url"].as_str().unwrap_or(""),
        grant["tunnel"]["ticket"].as_str().unwrap_or("")
    );
    let account = grant["account"].as_str().unwrap_or("sandbox");
    let target = format!("{account}@{}", grant["instanceId"].as_str().unwrap_or(""));
    let mut ssh = std::process::Command::new("ssh");
    ssh.arg("-i")
        .arg(&key)
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
        .arg(target);
    Ok((dir, ssh))
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
    let (dir, mut ssh) = match session(client, tenant, &sandbox, Some(ttl)).await {
        Ok(s) => s,
        Err(SessionError::Api(failure)) => {
            super::report(&failure);
            return 1;
        }
        Err(SessionError::Local(e)) => {
            eprintln!("error: {e}");
            return 1;
        }
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
