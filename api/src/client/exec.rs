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
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: no temporary directory: {e}");
            return 1;
        }
    };
    let key = dir.path().join("id_ed25519");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "vps-exec", "-f"])
        .arg(&key)
        .stdout(Stdio::null())
        .status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("error: ssh-keygen failed (is OpenSSH installed?)");
        return 1;
    }
    let public = std::fs::read_to_string(key.with_extension("pub")).unwrap_or_default();
    let body = json!({ "tenantId": m.get_one::<String>("tenantId"), "sandboxId": sandbox,
                       "publicKey": public.trim(), "ttlSeconds": ttl });
    let grant = match client.call("sandboxes.exec", &body).await {
        Ok(g) => g,
        Err(code) => return code,
    };
    let certificate = dir.path().join("id_ed25519-cert.pub");
    if std::fs::write(&certificate, grant["certificate"].as_str().unwrap_or("")).is_err() {
        eprintln!("error: cannot write the certificate");
        return 1;
    }
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
