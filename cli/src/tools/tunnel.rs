//! `vps tunnel --ticket-file FILE` (or `--url tcp://host:port --ticket xt_…`): the client half
//! of a `sandboxes.exec` tunnel, for OpenSSH's `ProxyCommand`. It connects to the node's tunnel
//! endpoint, sends the ticket as the first line, then pipes standard input to the node and the
//! node to standard output, so the SSH session runs end to end between the client and the guest.
//!
//! `vps sandboxes exec` passes a ticket file, so nothing the server answered is ever part of the
//! shell command OpenSSH runs; the URL is checked again here before any connect.

use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use vps_domain::tunnel_url::{self, TunnelAddress};

/// The `tunnel` object of a `sandboxes.exec` answer, checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TicketFile {
    /// `tcp://HOST:PORT`.
    pub url: String,
    /// `xt_…`, single use.
    pub ticket: String,
}

impl TicketFile {
    /// Takes `tunnel.url` and `tunnel.ticket` from a grant, refusing any other shape.
    pub fn from_grant(grant: &serde_json::Value) -> Result<TicketFile, String> {
        let file = TicketFile {
            url: grant["tunnel"]["url"].as_str().unwrap_or("").to_string(),
            ticket: grant["tunnel"]["ticket"].as_str().unwrap_or("").to_string(),
        };
        file.check()
            .map_err(|e| format!("the server answered a bad tunnel: {e}"))?;
        Ok(file)
    }

    /// Reads and checks a ticket file.
    pub fn read(path: &Path) -> anyhow::Result<TicketFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let file: TicketFile = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a ticket file", path.display()))?;
        file.check()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(file)
    }

    /// Writes it, readable by its owner only (the ticket opens a session).
    pub fn write(&self, path: &Path) -> Result<(), String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let text = serde_json::to_vec(self).map_err(|e| e.to_string())?;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .and_then(|mut f| f.write_all(&text))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }

    /// The endpoint, once the URL and the ticket have their one allowed shape.
    fn check(&self) -> Result<TunnelAddress, String> {
        let address = tunnel_url::parse("tunnel.url", &self.url).map_err(|e| e.to_string())?;
        let plain_ticket = self
            .ticket
            .strip_prefix("xt_")
            .is_some_and(|hex| !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()));
        if !plain_ticket {
            return Err("tunnel.ticket: expected xt_ and hex digits".into());
        }
        Ok(address)
    }
}

/// Connects and pipes until the node closes the connection.
pub async fn run(tunnel: &TicketFile) -> anyhow::Result<()> {
    let address = tunnel.check().map_err(anyhow::Error::msg)?.to_string();
    let stream = TcpStream::connect(&address)
        .await
        .with_context(|| format!("cannot connect to {address}"))?;
    stream.set_nodelay(true)?;
    let (mut from_node, mut to_node) = stream.into_split();
    to_node
        .write_all(format!("{}\n", tunnel.ticket).as_bytes())
        .await?;
    // Standard input ending (the client is done sending) only half-closes the connection: the
    // node's answer still comes back until it closes.
    let upload = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut tokio::io::stdin(), &mut to_node).await;
        let _ = to_node.shutdown().await;
    });
    let mut stdout = BufWriter::new(tokio::io::stdout());
    let copied =
        tokio::io::copy_buf(&mut tokio::io::BufReader::new(&mut from_node), &mut stdout).await;
    stdout.flush().await?;
    upload.abort();
    copied.context("the tunnel broke")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn grant(url: &str) -> serde_json::Value {
        json!({ "tunnel": { "url": url, "ticket": format!("xt_{}", "ab".repeat(32)) } })
    }

    #[test]
    fn a_grant_names_a_host_and_port() {
        let t = TicketFile::from_grant(&grant("tcp://127.0.0.1:2222")).unwrap();
        assert_eq!(t.check().unwrap().to_string(), "127.0.0.1:2222");
        let t = TicketFile::from_grant(&grant("tcp://[::1]:22")).unwrap();
        assert_eq!(t.check().unwrap().to_string(), "[::1]:22");
        assert!(TicketFile::from_grant(&grant("http://127.0.0.1:2222")).is_err());
        assert!(TicketFile::from_grant(&grant("tcp://127.0.0.1")).is_err());
        assert!(TicketFile::from_grant(&grant("tcp://$(id):22")).is_err());
        let mut bad_ticket = grant("tcp://127.0.0.1:22");
        bad_ticket["tunnel"]["ticket"] = "xt_1;id".into();
        assert!(TicketFile::from_grant(&bad_ticket).is_err());
    }

    #[test]
    fn a_ticket_file_is_read_back_and_checked_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let t = TicketFile::from_grant(&grant("tcp://node-1.example:22")).unwrap();
        t.write(&path).unwrap();
        assert_eq!(TicketFile::read(&path).unwrap(), t);
        // A file whose URL was tampered with is refused before any connect.
        let hostile = dir.path().join("h.json");
        std::fs::write(&hostile, r#"{"url":"tcp://`id`:22","ticket":"xt_ab"}"#).unwrap();
        assert!(TicketFile::read(&hostile).is_err());
    }
}
