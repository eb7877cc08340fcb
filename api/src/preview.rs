//! Preview URLs: `<public url>/preview/<token>/<path>` proxies HTTP/1.1 (WebSocket upgrades
//! included) to a port of a sandbox's guest.
//!
//! The token names the sandbox, the port and the URL's end, signed like a list cursor (a key
//! derived from the sealing key for this one purpose), so it cannot be made or edited without
//! the server's key. A signature alone is not enough: each request also finds the port's
//! exposure, still current, in the sandbox's projection, so `sandboxes.unexpose` (or a new
//! `expose` of the port) revokes the URL at once. Anything that does not open a guest port
//! (a forged, edited, expired, revoked or replaced token, a sandbox no longer ready) is the
//! same 404.
//!
//! A request that passes gets a single-use tunnel ticket to the sandbox's node that also names
//! the port (`vps_commands::sandboxes::preview::open`); the host connects the tunnel to
//! `guest:port` and the proxy speaks HTTP/1.1 over it, one tunnel per request.

use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use vps_commands::secrets::SecretKey;
use vps_commands::Ctx;

use crate::state::AppState;

/// The path every preview URL starts with.
pub const PREFIX: &str = "/preview/";
/// How long the proxy waits for a node's tunnel endpoint to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The purpose a token's signing key derives from.
const PURPOSE: &str = "vps preview url v1";

/// What a token claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// `sbx_…`.
    pub sandbox_id: String,
    /// The guest's port.
    pub port: u16,
    /// When the URL ends (unix seconds).
    pub expires_at: i64,
}

/// The signed token for `claim`: its payload in hex, a dot, and 128 bits of its MAC.
pub fn sign(secrets: &SecretKey, claim: &Claim) -> String {
    let payload = serde_json::json!([claim.sandbox_id, claim.port, claim.expires_at]).to_string();
    let mac = secrets.digest(PURPOSE, payload.as_bytes());
    format!(
        "{}.{}",
        data_encoding::HEXLOWER.encode(payload.as_bytes()),
        mac.get(..32).unwrap_or(&mac)
    )
}

/// The claim of a token [`sign`] made with this key; `None` for anything else. Constant time
/// in the MAC.
pub fn open(secrets: &SecretKey, token: &str) -> Option<Claim> {
    let (payload, mac) = token.split_once('.')?;
    let payload = data_encoding::HEXLOWER.decode(payload.as_bytes()).ok()?;
    let expected = secrets.digest(PURPOSE, &payload);
    let expected = expected.get(..32).unwrap_or(&expected);
    if !bool::from(subtle::ConstantTimeEq::ct_eq(
        expected.as_bytes(),
        mac.as_bytes(),
    )) {
        return None;
    }
    let (sandbox_id, port, expires_at): (String, u16, i64) =
        serde_json::from_slice(&payload).ok()?;
    Some(Claim {
        sandbox_id,
        port,
        expires_at,
    })
}

/// The preview URL of `claim` under `base` (the server's public URL).
pub fn url(base: &str, secrets: &SecretKey, claim: &Claim) -> String {
    format!(
        "{}{PREFIX}{}/",
        base.trim_end_matches('/'),
        sign(secrets, claim)
    )
}

/// `ANY /preview/<token>/<path>`: the request, proxied to the guest's port.
pub async fn proxy(State(state): State<AppState>, request: Request) -> Response {
    let Some((token, path)) = split(request.uri()) else {
        return not_found();
    };
    let now = state.clock.now();
    let Some(claim) = open(&state.secrets, &token).filter(|c| c.expires_at > now.timestamp())
    else {
        return not_found();
    };
    let ctx = ctx(&state);
    let template = state.config.sandbox_exec.tunnel_url.as_deref();
    let opened = vps_commands::sandboxes::preview::open(
        &ctx,
        template,
        &claim.sandbox_id,
        claim.port,
        claim.expires_at,
    )
    .await;
    let tunnel = match opened {
        Ok(Some(tunnel)) => tunnel,
        Ok(None) => return not_found(),
        Err(error) => {
            tracing::warn!(%error, sandbox = %claim.sandbox_id, "preview tunnel not issued");
            return (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n").into_response();
        }
    };
    match forward(&tunnel, path, request).await {
        Ok(response) => response,
        Err(why) => {
            tracing::info!(sandbox = %claim.sandbox_id, port = claim.port, %why, "preview proxy failed");
            let body = format!("the sandbox's port {} does not answer\n", claim.port);
            (StatusCode::BAD_GATEWAY, body).into_response()
        }
    }
}

/// The token and the rest of the path (with the query) of a preview request.
fn split(uri: &Uri) -> Option<(String, String)> {
    let rest = uri.path().strip_prefix(PREFIX)?;
    let (token, path) = match rest.split_once('/') {
        Some((token, path)) => (token, format!("/{path}")),
        None => (rest, "/".to_string()),
    };
    let path = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    Some((token.to_string(), path))
}

fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "no such preview\n").into_response()
}

/// A command context for the proxy: it records nothing, so its actor is the proxy itself
/// (not an operator).
fn ctx(state: &AppState) -> Ctx {
    let mut ctx = crate::state::reactor_ctx(state, "preview-proxy");
    ctx.actor.identity = "preview-proxy".into();
    ctx.actor.operator = false;
    ctx.request_id = Some(vps_commands::record::new_id("req"));
    ctx
}

/// Opens the tunnel, sends `request` over it as HTTP/1.1 for `path`, and answers the guest's
/// response. A `101 Switching Protocols` joins both upgraded connections, byte for byte.
async fn forward(
    tunnel: &vps_commands::sandboxes::preview::PreviewTunnel,
    path: String,
    mut request: Request,
) -> Result<Response, String> {
    let address = tunnel
        .url
        .strip_prefix("tcp://")
        .unwrap_or(&tunnel.url)
        .trim_end_matches('/');
    let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
        .await
        .map_err(|_| format!("the tunnel endpoint {address} does not answer in time"))?
        .map_err(|e| format!("the tunnel endpoint {address}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .write_all(format!("{}\n", tunnel.ticket).as_bytes())
        .await
        .map_err(|e| format!("sending the ticket: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP over the tunnel: {e}"))?;
    tokio::spawn(async move {
        // The guest hanging up ends it: its response (or its absence) says the rest.
        let _ = connection.with_upgrades().await;
    });
    let client_upgrade = hyper::upgrade::on(&mut request);
    let (mut parts, body) = request.into_parts();
    parts.uri = path
        .parse()
        .map_err(|e| format!("the path {path:?}: {e}"))?;
    parts.version = axum::http::Version::HTTP_11;
    if let Some(host) = parts.headers.get(axum::http::header::HOST).cloned() {
        parts.headers.insert("x-forwarded-host", host.clone());
    }
    parts
        .headers
        .insert("x-forwarded-proto", HeaderValue::from_static("http"));
    let upstream = axum::http::Request::from_parts(parts, body);
    let mut response = sender
        .send_request(upstream)
        .await
        .map_err(|e| format!("the guest's answer: {e}"))?;
    if response.status() == StatusCode::SWITCHING_PROTOCOLS {
        let guest_upgrade = hyper::upgrade::on(&mut response);
        tokio::spawn(async move {
            let (client, guest) = match tokio::join!(client_upgrade, guest_upgrade) {
                (Ok(client), Ok(guest)) => (client, guest),
                (client, guest) => {
                    tracing::debug!(
                        client = client.is_ok(),
                        guest = guest.is_ok(),
                        "preview upgrade failed"
                    );
                    return;
                }
            };
            let (mut client, mut guest) = (TokioIo::new(client), TokioIo::new(guest));
            let _ = tokio::io::copy_bidirectional(&mut client, &mut guest).await;
        });
        let (parts, _) = response.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (parts, body) = response.into_parts();
    Ok(Response::from_parts(parts, Body::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_opens_only_with_its_key_and_unedited() {
        let key = SecretKey::new([7; 32]);
        let claim = Claim {
            sandbox_id: "sbx_a".into(),
            port: 8080,
            expires_at: 1_800_000_000,
        };
        let token = sign(&key, &claim);
        assert_eq!(open(&key, &token), Some(claim.clone()));
        assert_eq!(open(&SecretKey::new([8; 32]), &token), None);
        let other = sign(
            &key,
            &Claim {
                port: 8081,
                ..claim.clone()
            },
        );
        let (payload, _) = other.split_once('.').unwrap();
        let (_, mac) = token.split_once('.').unwrap();
        assert_eq!(open(&key, &format!("{payload}.{mac}")), None);
        assert_eq!(open(&key, "nothing"), None);
        assert_eq!(
            split(&"/preview/t/a/b?c=d".parse().unwrap()),
            Some(("t".into(), "/a/b?c=d".into()))
        );
        assert_eq!(
            split(&"/preview/t".parse().unwrap()),
            Some(("t".into(), "/".into()))
        );
    }
}
