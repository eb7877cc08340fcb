//! The first line of an exec tunnel (SPEC §3.7): a client connects over TCP and sends its
//! ticket and a newline; everything after it is the SSH stream the host passes on. Both hosts
//! read the line and answer refusals the same way.

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The next tunnel connection. A failed accept (too many open files, a reset before accept)
/// is logged and retried after a moment, never the end of the endpoint.
pub async fn accept(
    listener: &tokio::net::TcpListener,
) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(error) => {
                tracing::warn!(%error, "tunnel accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The longest first line (the ticket) accepted.
pub const MAX_TICKET_LINE: usize = 512;
/// How long a client may take to send its ticket.
pub const TICKET_TIMEOUT: Duration = Duration::from_secs(10);

/// Reads the ticket line within [`TICKET_TIMEOUT`], a byte at a time so nothing of the SSH
/// stream behind it is consumed. The error says why there is no ticket.
pub async fn read_ticket<R: AsyncRead + Unpin>(stream: &mut R) -> Result<String, String> {
    tokio::time::timeout(TICKET_TIMEOUT, first_line(stream))
        .await
        .map_err(|_| "no ticket line in time".to_string())?
}

async fn first_line<R: AsyncRead + Unpin>(stream: &mut R) -> Result<String, String> {
    let mut line = Vec::new();
    loop {
        let byte = stream
            .read_u8()
            .await
            .map_err(|_| "the connection ended before the ticket line".to_string())?;
        match byte {
            b'\n' => break,
            _ if line.len() >= MAX_TICKET_LINE => return Err("the ticket line is too long".into()),
            _ => line.push(byte),
        }
    }
    let text = String::from_utf8(line).map_err(|_| "the ticket line is not text".to_string())?;
    Ok(text.trim_end_matches('\r').to_string())
}

/// Tells the client why its tunnel is refused, then closes the stream. Lines before the SSH
/// version are allowed (RFC 4253 §4.2): clients show or skip this one.
pub async fn refuse<W: AsyncWrite + Unpin>(stream: &mut W, refusal: &str) {
    let line = format!("vps: tunnel refused: {refusal}\r\n");
    // The client may be gone already: there is no one left to tell.
    let _ = stream.write_all(line.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_ticket_line_is_read_and_the_stream_behind_it_is_left() {
        let (mut client, mut host) = tokio::io::duplex(64);
        client.write_all(b"xt_abc\r\nSSH-2.0-x").await.unwrap();
        assert_eq!(read_ticket(&mut host).await.unwrap(), "xt_abc");
        let mut rest = [0u8; 9];
        host.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"SSH-2.0-x");
    }

    #[tokio::test]
    async fn a_line_too_long_or_cut_short_is_no_ticket() {
        let (mut client, mut host) = tokio::io::duplex(4096);
        client.write_all(&[b'a'; 600]).await.unwrap();
        assert_eq!(
            read_ticket(&mut host).await.unwrap_err(),
            "the ticket line is too long"
        );
        let (mut client, mut host) = tokio::io::duplex(64);
        client.write_all(b"xt_").await.unwrap();
        drop(client);
        assert!(read_ticket(&mut host).await.unwrap_err().contains("ended"));
    }
}
