//! `vps tunnel --url tcp://host:port --ticket xt_…`: the client half of a `sandboxes.exec`
//! tunnel, for OpenSSH's `ProxyCommand`. It connects to the node's tunnel endpoint, sends the
//! ticket as the first line, then pipes standard input to the node and the node to standard
//! output, so the SSH session runs end to end between the client and the guest.

use anyhow::Context;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;

/// Connects and pipes until the node closes the connection.
pub async fn run(url: &str, ticket: &str) -> anyhow::Result<()> {
    let address = address(url)?;
    anyhow::ensure!(
        !ticket.is_empty() && !ticket.contains(['\n', '\r']),
        "--ticket: one line, as sandboxes.exec answered it"
    );
    let stream = TcpStream::connect(&address)
        .await
        .with_context(|| format!("cannot connect to {address}"))?;
    stream.set_nodelay(true)?;
    let (mut from_node, mut to_node) = stream.into_split();
    to_node.write_all(format!("{ticket}\n").as_bytes()).await?;
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

/// `host:port` of a `tcp://host:port` URL.
fn address(url: &str) -> anyhow::Result<String> {
    let parsed = url::Url::parse(url).with_context(|| format!("--url {url:?}"))?;
    let (Some(host), Some(port)) = (parsed.host_str(), parsed.port()) else {
        anyhow::bail!("--url {url:?}: expected tcp://host:port");
    };
    anyhow::ensure!(
        parsed.scheme() == "tcp",
        "--url {url:?}: expected tcp://host:port"
    );
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tunnel_url_names_a_host_and_port() {
        assert_eq!(address("tcp://127.0.0.1:2222").unwrap(), "127.0.0.1:2222");
        assert_eq!(address("tcp://[::1]:22").unwrap(), "[::1]:22");
        assert!(address("http://127.0.0.1:2222").is_err());
        assert!(address("tcp://127.0.0.1").is_err());
    }
}
