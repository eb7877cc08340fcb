//! What an emulated guest serves on any port a preview URL reaches: HTTP/1.1, answering every
//! request with a short page that names the instance, the port, the method and the path, and
//! echoing every byte back once a request asks to switch protocols (a WebSocket handshake, or
//! any `Upgrade`). A real guest serves whatever its own processes serve; this is enough for a
//! proxy's tests to see which guest and port answered and that bytes pass both ways.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The longest request head read.
const MAX_HEAD: usize = 64 * 1024;

/// Serves HTTP/1.1 on `stream` for `instance`'s `port` until the client hangs up.
pub async fn serve<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, instance: &str, port: u16) {
    let mut buffer = Vec::new();
    loop {
        let Some((head, rest)) = read_head(&mut stream, buffer).await else {
            return;
        };
        let request = Request::parse(&head);
        if let Some(protocol) = &request.upgrade {
            let answer = format!(
                "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n"
            );
            if stream.write_all(answer.as_bytes()).await.is_err() {
                return;
            }
            echo(stream, rest).await;
            return;
        }
        // A body is read and dropped: the page does not depend on it.
        let mut rest = rest;
        while rest.len() < request.content_length {
            let mut chunk = [0u8; 8192];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => rest.extend_from_slice(&chunk[..n]),
            }
        }
        buffer = rest.split_off(request.content_length.min(rest.len()));
        let body = format!(
            "emulated guest {instance} port {port}: {} {}\n",
            request.method, request.target
        );
        let answer = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        if stream.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The request line and headers this service looks at.
struct Request {
    method: String,
    target: String,
    content_length: usize,
    upgrade: Option<String>,
}

impl Request {
    fn parse(head: &str) -> Request {
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or("").split(' ');
        let method = first.next().unwrap_or("").to_string();
        let target = first.next().unwrap_or("").to_string();
        let mut content_length = 0;
        let mut upgrade = None;
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.parse().unwrap_or(0);
            } else if name.eq_ignore_ascii_case("upgrade") && !value.is_empty() {
                upgrade = Some(value.to_string());
            }
        }
        Request {
            method,
            target,
            content_length,
            upgrade,
        }
    }
}

/// Reads up to the end of a request head; answers the head and what came after it.
async fn read_head<S: AsyncRead + Unpin>(
    stream: &mut S,
    mut buffer: Vec<u8>,
) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buffer.split_off(end + 4);
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            return Some((head, rest));
        }
        if buffer.len() > MAX_HEAD {
            return None;
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Sends back every byte the client sends, until it hangs up.
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, first: Vec<u8>) {
    if !first.is_empty() && stream.write_all(&first).await.is_err() {
        return;
    }
    let mut chunk = [0u8; 8192];
    loop {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if stream.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_gets_a_page_naming_the_guest_and_an_upgrade_echoes() {
        let (mut client, host) = tokio::io::duplex(4096);
        tokio::spawn(async move { serve(host, "inst_a", 8080).await });
        client
            .write_all(b"GET /x?y HTTP/1.1\r\nHost: h\r\n\r\n")
            .await
            .unwrap();
        let mut got = vec![0u8; 4096];
        let n = client.read(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got[..n]).into_owned();
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(
            text.ends_with("emulated guest inst_a port 8080: GET /x?y\n"),
            "{text}"
        );
        client
            .write_all(b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\nhi")
            .await
            .unwrap();
        let mut seen = Vec::new();
        while !seen.ends_with(b"hi") {
            let n = client.read(&mut got).await.unwrap();
            seen.extend_from_slice(&got[..n]);
        }
        let text = String::from_utf8_lossy(&seen).into_owned();
        assert!(text.starts_with("HTTP/1.1 101"), "{text}");
    }
}
