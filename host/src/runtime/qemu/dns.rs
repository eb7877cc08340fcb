//! The resolver that serves the domains of `network.allow`: one per runtime (so per agent
//! process), listening on UDP and TCP port 53 of each bridge gateway a guest with domain
//! entries sits behind. That guest's own `inet` table DNATs its DNS (UDP and TCP port 53, to
//! any address) there (see `policy`), so asking another server directly reaches this one all
//! the same; its config drive names the gateway as its nameserver ([`guest_nameserver`]).
//!
//! A query is answered by the allow-list of the guest whose address sent it:
//! - from an address that is no such guest: no answer at all (dropped);
//! - malformed (not a query of one question, class IN): dropped;
//! - a name the list does not allow: NXDOMAIN, so the guest's lookup fails at once as "no such
//!   name" (REFUSED would send a stub resolver on to its next server);
//! - an allowed name: forwarded to the upstream (host config `dns_upstream`, default the first
//!   `nameserver` of /etc/resolv.conf). The A records of its answer go into the guest's
//!   [`RESOLVED_SET`](super::policy::RESOLVED_SET) for their TTL, clamped to
//!   [`MIN_TTL`]..=[`MAX_TTL`] seconds, *before* the answer is passed on, so a connection right
//!   after the lookup works. Addresses in [`PRIVATE_RANGES`] are not added (a public name
//!   must not open the host's neighbourhood; a CIDR entry can). No answer within
//!   [`UPSTREAM_TIMEOUT`], or one that does not answer this query: SERVFAIL.
//!
//! Over TCP (a stub resolver's retry after a truncated answer, or a client that only speaks
//! TCP) each message carries its 2-byte length in front (RFC 1035 §4.2.2), and the same rules
//! answer it; an allowed name is still asked of the upstream over UDP, and again over TCP when
//! that answer is truncated. A connection is bounded: [`MAX_TCP_QUERY`] bytes a query (longer,
//! or malformed: closed), [`TCP_IDLE`] between queries and for writing an answer, and at most
//! [`MAX_TCP_CONNECTIONS`] open at once over all guests (past it a new one is closed at once).
//! A connection outlives neither its guest's registration (each query looks the guest up
//! again) nor, for long, its listener (it ends when idle).
//!
//! Which entries are names, and what they match: `allow`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{DNSClass, RData};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::allow::{allows, DomainPattern};
use super::policy::{PRIVATE_RANGES, RESOLVED_SET};
use crate::runtime::{NetworkMode, NetworkPolicy, RuntimeError};

/// The port the resolver listens on (on each gateway address).
pub const PORT: u16 = super::allow::DNS_PORT;
/// The least time an answered address stays allowed: a connection right after the lookup
/// works even when the record's TTL is 0.
pub const MIN_TTL: u32 = 30;
/// The most: a record that claims more keeps its address allowed this long.
pub const MAX_TTL: u32 = 86_400;
/// How long the upstream has to answer before the guest gets SERVFAIL.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// Queries forwarded at once, over all guests; past it a query is dropped (the guest retries).
const MAX_IN_FLIGHT: usize = 256;
/// The longest query taken over TCP, in bytes (a question is far shorter).
pub const MAX_TCP_QUERY: usize = 4096;
/// How long a TCP connection may wait for its next query, or for its answer to be taken.
pub const TCP_IDLE: Duration = Duration::from_secs(10);
/// TCP connections open at once, over all guests.
pub const MAX_TCP_CONNECTIONS: usize = 64;

/// How a query reached the resolver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

/// The `nft -f` script that allows `answers` (address, TTL) in table `table`'s
/// [`RESOLVED_SET`], each for its TTL clamped to `MIN_TTL..=MAX_TTL`. An address already there
/// takes the new timeout (add, delete, add: one transaction, so it is never absent).
pub fn set_elements(table: &str, answers: &[(Ipv4Addr, u32)]) -> String {
    let mut longest: Vec<(Ipv4Addr, u32)> = Vec::new();
    for &(address, ttl) in answers {
        if is_private(address) {
            continue;
        }
        let ttl = ttl.clamp(MIN_TTL, MAX_TTL);
        match longest.iter_mut().find(|(a, _)| *a == address) {
            Some((_, t)) => *t = (*t).max(ttl),
            None => longest.push((address, ttl)),
        }
    }
    let mut s = String::new();
    for (address, ttl) in longest {
        let element = format!("bridge {table} {RESOLVED_SET} {{ {address}");
        let _ = writeln!(s, "add element {element} timeout {ttl}s }}");
        let _ = writeln!(s, "delete element {element} }}");
        let _ = writeln!(s, "add element {element} timeout {ttl}s }}");
    }
    s
}

/// Whether `address` is in one of [`PRIVATE_RANGES`].
pub fn is_private(address: Ipv4Addr) -> bool {
    PRIVATE_RANGES.iter().any(|range| contains(range, address))
}

/// Whether `network` (`10.0.0.0/8`, or one address) holds `address`.
fn contains(network: &str, address: Ipv4Addr) -> bool {
    let (network, prefix) = network.split_once('/').unwrap_or((network, "32"));
    let (Ok(network), Ok(prefix)) = (network.parse::<Ipv4Addr>(), prefix.parse::<u32>()) else {
        return false;
    };
    if prefix > 32 {
        return false;
    }
    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
    u32::from(address) & mask == u32::from(network) & mask
}

/// The DNS server a guest is told of (its config drive's nameserver, its `/etc/resolv.conf`),
/// by its network `policy`, the `gateway` of its first NIC and the resolver's `upstream`:
/// - `egress` whose list names a domain: the gateway, where this resolver answers it (its DNS
///   to any server comes here all the same);
/// - `egress` otherwise, or no policy: the upstream itself, when the guest may reach it (IPv4,
///   port 53, not loopback; under a list, on it; under no list, not in [`PRIVATE_RANGES`],
///   which `egress` never reaches), else none;
/// - `private` and `none`: none, as no DNS leaves the guest's pool and nothing in it answers.
pub fn guest_nameserver(
    policy: Option<&NetworkPolicy>,
    gateway: Option<Ipv4Addr>,
    upstream: Option<SocketAddr>,
) -> Option<Ipv4Addr> {
    if let Some(policy) = policy {
        if super::policy::resolving(policy) {
            return gateway;
        }
        if policy.mode != NetworkMode::Egress {
            return None;
        }
    }
    let upstream = match upstream? {
        SocketAddr::V4(a) if a.port() == PORT && !a.ip().is_loopback() => *a.ip(),
        _ => return None,
    };
    let reachable = match policy {
        Some(policy) if !policy.allow.is_empty() => {
            let (networks, _) = super::policy::allowed_networks(&policy.allow);
            networks.iter().any(|n| contains(n, upstream))
        }
        Some(_) => !is_private(upstream),
        None => true,
    };
    reachable.then_some(upstream)
}

/// The first `nameserver` of /etc/resolv.conf, port 53: the upstream when the host config
/// names none.
pub fn system_upstream() -> Option<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").ok()?;
    first_nameserver(&text)
}

fn first_nameserver(resolv_conf: &str) -> Option<SocketAddr> {
    resolv_conf.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            return None;
        }
        let address: std::net::IpAddr = words.next()?.parse().ok()?;
        Some(SocketAddr::new(address, 53))
    })
}

/// One guest address the resolver answers, and how.
#[derive(Clone, Debug)]
struct Client {
    /// `inst_…`.
    id: String,
    /// Its tables' name (`policy::table_name`).
    table: String,
    /// The gateway its queries arrive at.
    gateway: Ipv4Addr,
    patterns: Arc<[DomainPattern]>,
    upstream: Option<SocketAddr>,
    /// Until when each address is in the guest's set (as far as this registration made it),
    /// so a name looked up again and again costs one `nft` call per half TTL, not one per
    /// query. Shared by the guest's NICs; new with each registration, as the sets are.
    allowed_until: Arc<Mutex<HashMap<Ipv4Addr, Instant>>>,
}

#[derive(Default)]
struct Clients {
    by_address: HashMap<Ipv4Addr, Client>,
    listeners: HashMap<Ipv4Addr, JoinHandle<()>>,
}

/// The resolver: the guests it answers, by address, and a listener per gateway.
pub struct Resolver {
    clients: Arc<Mutex<Clients>>,
    in_flight: Arc<Semaphore>,
    connections: Arc<Semaphore>,
}

/// A guest as the resolver serves it.
pub struct Registration<'a> {
    pub id: &'a str,
    pub table: String,
    /// Each NIC's address and the gateway its queries are DNATed to.
    pub nics: Vec<(Ipv4Addr, Ipv4Addr)>,
    pub patterns: Vec<DomainPattern>,
    /// `None`: [`system_upstream`].
    pub upstream: Option<SocketAddr>,
}

impl Default for Resolver {
    fn default() -> Self {
        Resolver {
            clients: Arc::default(),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            connections: Arc::new(Semaphore::new(MAX_TCP_CONNECTIONS)),
        }
    }
}

impl Resolver {
    /// Answers guest `r.id` from now on (replacing what it had), listening on each of its
    /// gateways (UDP and TCP port 53) unless already. A guest whose list has no domain is forgotten.
    /// Must run inside the tokio runtime (in the guests' network namespace).
    pub fn register(&self, r: Registration<'_>) -> Result<(), RuntimeError> {
        self.forget(r.id);
        if r.patterns.is_empty() || r.nics.is_empty() {
            return Ok(());
        }
        let upstream = r.upstream.or_else(system_upstream);
        if upstream.is_none() {
            tracing::warn!(guest = %r.id,
                "no dns_upstream and no nameserver in /etc/resolv.conf: allowed names get SERVFAIL");
        }
        let patterns: Arc<[DomainPattern]> = r.patterns.into();
        let allowed_until = Arc::default();
        let mut clients = lock(&self.clients);
        for &(address, gateway) in &r.nics {
            if !clients.listeners.contains_key(&gateway) {
                let listener = self.listen(gateway).map_err(|e| {
                    RuntimeError(format!(
                        "network policy: the DNS resolver cannot listen on {gateway}:{PORT}: {e}"
                    ))
                });
                let listener = match listener {
                    Ok(listener) => listener,
                    Err(e) => {
                        drop(clients);
                        self.forget(r.id);
                        return Err(e);
                    }
                };
                clients.listeners.insert(gateway, listener);
            }
            clients.by_address.insert(
                address,
                Client {
                    id: r.id.to_owned(),
                    table: r.table.clone(),
                    gateway,
                    patterns: patterns.clone(),
                    upstream,
                    allowed_until: Arc::clone(&allowed_until),
                },
            );
        }
        Ok(())
    }

    /// No longer answers guest `id`; a gateway no guest is served at any more stops listening.
    pub fn forget(&self, id: &str) {
        let mut clients = lock(&self.clients);
        clients.by_address.retain(|_, c| c.id != id);
        let used: Vec<Ipv4Addr> = clients.by_address.values().map(|c| c.gateway).collect();
        clients.listeners.retain(|gateway, listener| {
            let keep = used.contains(gateway);
            if !keep {
                listener.abort();
            }
            keep
        });
    }

    /// Whether guest `id` is answered (for tests).
    pub fn serves(&self, id: &str) -> bool {
        lock(&self.clients).by_address.values().any(|c| c.id == id)
    }

    /// One task serving `gateway` over UDP and TCP: aborting it closes both sockets.
    fn listen(&self, gateway: Ipv4Addr) -> std::io::Result<JoinHandle<()>> {
        let address = SocketAddrV4::new(gateway, PORT);
        let socket = std::net::UdpSocket::bind(address)?;
        socket.set_nonblocking(true)?;
        let socket = Arc::new(UdpSocket::from_std(socket)?);
        // std sets SO_REUSEADDR: a restarted agent binds again past old connections' TIME_WAIT.
        let listener = std::net::TcpListener::bind(address)?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        tracing::info!(%gateway, port = PORT, "DNS resolver listening for guests' allow-lists");
        let udp = serve(socket, self.clients.clone(), self.in_flight.clone());
        let tcp = serve_tcp(listener, self.clients.clone(), self.connections.clone());
        Ok(tokio::spawn(async move {
            tokio::join!(udp, tcp);
        }))
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        for listener in lock(&self.clients).listeners.values() {
            listener.abort();
        }
    }
}

/// One gateway's loop: each query is answered on a task of its own, so a slow upstream
/// never holds up the next query.
async fn serve(socket: Arc<UdpSocket>, clients: Arc<Mutex<Clients>>, in_flight: Arc<Semaphore>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                tracing::warn!(error = %e, "DNS resolver: receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer) = peer else {
            continue;
        };
        let Some(client) = lock(&clients).by_address.get(peer.ip()).cloned() else {
            continue;
        };
        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
            crate::metrics::dns_query("dropped");
            continue;
        };
        let query = buf[..n].to_vec();
        let socket = socket.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(reply) = answer(&client, &query, Transport::Udp).await {
                let _ = socket.send_to(&reply, peer).await;
            }
        });
    }
}

/// One gateway's TCP listener: a task per connection, from a guest's address only, at most
/// [`MAX_TCP_CONNECTIONS`] over all gateways.
async fn serve_tcp(
    listener: TcpListener,
    clients: Arc<Mutex<Clients>>,
    connections: Arc<Semaphore>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(got) => got,
            Err(e) => {
                tracing::warn!(error = %e, "DNS resolver: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let SocketAddr::V4(peer) = peer else {
            continue;
        };
        if !lock(&clients).by_address.contains_key(peer.ip()) {
            continue;
        }
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            crate::metrics::dns_query("dropped");
            continue;
        };
        let clients = clients.clone();
        tokio::spawn(async move {
            let _permit = permit;
            serve_connection(stream, *peer.ip(), &clients).await;
        });
    }
}

/// Answers the queries of one TCP connection in turn, until it ends, idles past [`TCP_IDLE`],
/// sends what is not a query, or its guest is no longer served.
async fn serve_connection(mut stream: TcpStream, peer: Ipv4Addr, clients: &Mutex<Clients>) {
    loop {
        let query =
            match tokio::time::timeout(TCP_IDLE, read_frame(&mut stream, MAX_TCP_QUERY)).await {
                Ok(Ok(Some(query))) => query,
                _ => return,
            };
        let Some(client) = lock(clients).by_address.get(&peer).cloned() else {
            return;
        };
        let Some(reply) = answer(&client, &query, Transport::Tcp).await else {
            return;
        };
        let written = tokio::time::timeout(TCP_IDLE, write_frame(&mut stream, &reply)).await;
        if !matches!(written, Ok(Ok(()))) {
            return;
        }
    }
}

/// Reads one message with its 2-byte big-endian length in front (RFC 1035 §4.2.2); `None`
/// when the stream ends before a length. A length of 0 or over `max` is an error.
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> std::io::Result<Option<Vec<u8>>> {
    let mut length = [0u8; 2];
    match reader.read_exact(&mut length).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let length = usize::from(u16::from_be_bytes(length));
    if length == 0 || length > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a DNS message of {length} bytes (1..={max} taken)"),
        ));
    }
    let mut message = vec![0u8; length];
    reader.read_exact(&mut message).await?;
    Ok(Some(message))
}

/// Writes `message` with its 2-byte length in front, in one write.
async fn write_frame<W: AsyncWrite + Unpin>(writer: &mut W, message: &[u8]) -> std::io::Result<()> {
    let length = u16::try_from(message.len()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a DNS message over 65535 bytes",
        )
    })?;
    let mut framed = Vec::with_capacity(message.len() + 2);
    framed.extend_from_slice(&length.to_be_bytes());
    framed.extend_from_slice(message);
    writer.write_all(&framed).await?;
    writer.flush().await
}

/// The reply to `raw` from `client`, or `None` to drop it.
async fn answer(client: &Client, raw: &[u8], transport: Transport) -> Option<Vec<u8>> {
    let query = Message::from_vec(raw).ok()?;
    let well_formed = query.metadata.message_type == MessageType::Query
        && query.metadata.op_code == OpCode::Query
        && query.queries.len() == 1
        && query.queries[0].query_class() == DNSClass::IN;
    if !well_formed {
        return None;
    }
    let name = query.queries[0].name().to_ascii();
    if !allows(&client.patterns, &name) {
        crate::metrics::dns_query("refused");
        tracing::debug!(guest = %client.id, %name, "DNS: not on the allow-list");
        return error_reply(&query, ResponseCode::NXDomain);
    }
    match forward(client, &query, raw, transport).await {
        Ok(reply) => {
            crate::metrics::dns_query("answered");
            Some(reply)
        }
        Err(why) => {
            crate::metrics::dns_query("failed");
            tracing::warn!(guest = %client.id, %name, %why, "DNS: SERVFAIL");
            error_reply(&query, ResponseCode::ServFail)
        }
    }
}

fn error_reply(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut reply = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.add_queries(query.queries.clone());
    reply.to_vec().ok()
}

/// Asks the upstream (a socket of its own, a fresh id) over UDP, and over TCP too when the
/// guest asked over TCP and the UDP answer is truncated; allows the answered addresses, and
/// gives the answer back under the guest's id.
async fn forward(
    client: &Client,
    query: &Message,
    raw: &[u8],
    transport: Transport,
) -> Result<Vec<u8>, String> {
    let upstream = client.upstream.ok_or("no upstream resolver")?;
    let id: u16 = rand::random();
    let mut out = raw.to_vec();
    out[..2].copy_from_slice(&id.to_be_bytes());
    let mut reply = ask_udp(upstream, &out, id, query).await?;
    if transport == Transport::Tcp && reply.1.metadata.truncation {
        reply = ask_tcp(upstream, &out, id, query).await?;
    }
    let (mut bytes, reply) = reply;
    let addresses: Vec<(Ipv4Addr, u32)> = reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some((a.0, r.ttl)),
            _ => None,
        })
        .collect();
    allow(client, &addresses).await?;
    bytes[..2].copy_from_slice(&query.metadata.id.to_be_bytes());
    Ok(bytes)
}

/// Whether `reply` answers `query` sent under `id`.
fn answers(reply: &Message, id: u16, query: &Message) -> bool {
    reply.metadata.id == id
        && reply.metadata.message_type == MessageType::Response
        && reply.queries == query.queries
}

/// `out` (the query under `id`) asked of `upstream` over UDP: the answer, raw and parsed.
async fn ask_udp(
    upstream: SocketAddr,
    out: &[u8],
    id: u16,
    query: &Message,
) -> Result<(Vec<u8>, Message), String> {
    let local: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).await.map_err(|e| e.to_string())?;
    socket.connect(upstream).await.map_err(|e| e.to_string())?;
    socket.send(out).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 65_535];
    let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
    loop {
        let n = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .map_err(|_| format!("{upstream} did not answer in {UPSTREAM_TIMEOUT:?}"))?
            .map_err(|e| format!("{upstream}: {e}"))?;
        // Anything but the answer to this query (a late or forged datagram) is ignored.
        match Message::from_vec(&buf[..n]) {
            Ok(reply) if answers(&reply, id, query) => return Ok((buf[..n].to_vec(), reply)),
            _ => continue,
        }
    }
}

/// `out` asked of `upstream` over TCP (one connection, one query), within
/// [`UPSTREAM_TIMEOUT`].
async fn ask_tcp(
    upstream: SocketAddr,
    out: &[u8],
    id: u16,
    query: &Message,
) -> Result<(Vec<u8>, Message), String> {
    let exchange = async {
        let mut stream = TcpStream::connect(upstream)
            .await
            .map_err(|e| format!("{upstream} over TCP: {e}"))?;
        write_frame(&mut stream, out)
            .await
            .map_err(|e| format!("{upstream} over TCP: {e}"))?;
        let bytes = read_frame(&mut stream, usize::from(u16::MAX))
            .await
            .map_err(|e| format!("{upstream} over TCP: {e}"))?
            .ok_or_else(|| format!("{upstream} closed the TCP connection unanswered"))?;
        match Message::from_vec(&bytes) {
            Ok(reply) if answers(&reply, id, query) => Ok((bytes, reply)),
            _ => Err(format!("{upstream} over TCP: not an answer to the query")),
        }
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("{upstream} did not answer over TCP in {UPSTREAM_TIMEOUT:?}"))?
}

/// Puts `addresses` (address, TTL) in the guest's set, but those already there for at least
/// half their (clamped) TTL.
async fn allow(client: &Client, addresses: &[(Ipv4Addr, u32)]) -> Result<(), String> {
    let now = Instant::now();
    let lasting = |ttl: u32| Duration::from_secs(u64::from(ttl.clamp(MIN_TTL, MAX_TTL)));
    let stale: Vec<(Ipv4Addr, u32)> = {
        let known = lock(&client.allowed_until);
        addresses
            .iter()
            .copied()
            .filter(|(a, ttl)| {
                known
                    .get(a)
                    .is_none_or(|until| *until < now + lasting(*ttl) / 2)
            })
            .collect()
    };
    let script = set_elements(&client.table, &stale);
    if script.is_empty() {
        return Ok(());
    }
    super::policy::nft(&script).await.map_err(|e| e.0)?;
    let mut known = lock(&client.allowed_until);
    known.retain(|_, until| *until > now);
    for (address, ttl) in stale {
        known.insert(address, now + lasting(ttl));
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The data is whole between statements: a panic elsewhere cannot leave it half-written.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_become_set_elements_for_their_clamped_ttl() {
        let script = set_elements(
            "vps_abc",
            &[
                (Ipv4Addr::new(198, 51, 100, 1), 5),
                (Ipv4Addr::new(198, 51, 100, 2), 300),
                (Ipv4Addr::new(198, 51, 100, 2), 600),
                (Ipv4Addr::new(203, 0, 113, 9), u32::MAX),
                (Ipv4Addr::new(10, 0, 0, 1), 300),
                (Ipv4Addr::new(169, 254, 169, 254), 300),
            ],
        );
        assert_eq!(
            script,
            "add element bridge vps_abc resolved { 198.51.100.1 timeout 30s }\n\
             delete element bridge vps_abc resolved { 198.51.100.1 }\n\
             add element bridge vps_abc resolved { 198.51.100.1 timeout 30s }\n\
             add element bridge vps_abc resolved { 198.51.100.2 timeout 600s }\n\
             delete element bridge vps_abc resolved { 198.51.100.2 }\n\
             add element bridge vps_abc resolved { 198.51.100.2 timeout 600s }\n\
             add element bridge vps_abc resolved { 203.0.113.9 timeout 86400s }\n\
             delete element bridge vps_abc resolved { 203.0.113.9 }\n\
             add element bridge vps_abc resolved { 203.0.113.9 timeout 86400s }\n"
        );
        assert_eq!(set_elements("vps_abc", &[]), "");
    }

    #[test]
    fn a_guest_is_told_of_the_resolver_or_the_upstream_it_can_reach() {
        let gateway = Some(Ipv4Addr::new(10, 83, 0, 1));
        let public: Option<SocketAddr> = Some("203.0.113.1:53".parse().unwrap());
        let policy = |mode, allow: &[&str]| NetworkPolicy {
            allow: allow.iter().map(|a| a.to_string()).collect(),
            ..NetworkPolicy::new(mode)
        };
        let egress = |allow| policy(NetworkMode::Egress, allow);
        let told = |p: Option<&NetworkPolicy>, upstream| guest_nameserver(p, gateway, upstream);
        // Names on the list: the resolver on the gateway, whatever the upstream.
        assert_eq!(told(Some(&egress(&["allowed.test"])), public), gateway);
        assert_eq!(told(Some(&egress(&["*.example.com"])), None), gateway);
        // No names: the upstream, where the guest may reach it.
        let upstream = Ipv4Addr::new(203, 0, 113, 1);
        assert_eq!(told(Some(&egress(&[])), public), Some(upstream));
        assert_eq!(told(None, public), Some(upstream));
        assert_eq!(
            told(Some(&egress(&["203.0.113.0/24"])), public),
            Some(upstream)
        );
        assert_eq!(told(Some(&egress(&["198.51.100.0/24"])), public), None);
        let private = Some("10.1.2.3:53".parse().unwrap());
        assert_eq!(told(Some(&egress(&[])), private), None);
        assert_eq!(
            told(Some(&egress(&["10.1.2.3"])), private),
            Some(Ipv4Addr::new(10, 1, 2, 3))
        );
        for unusable in ["127.0.0.53:53", "203.0.113.1:5353", "[2001:db8::1]:53"] {
            assert_eq!(
                told(None, Some(unusable.parse().unwrap())),
                None,
                "{unusable}"
            );
        }
        assert_eq!(told(Some(&egress(&[])), None), None);
        // No DNS leaves `private` or `none`.
        for mode in [NetworkMode::Private, NetworkMode::None] {
            assert_eq!(told(Some(&policy(mode, &[])), public), None);
        }
    }

    #[test]
    fn the_upstream_defaults_to_the_first_nameserver() {
        let conf = "# comment\nsearch example\nnameserver 192.0.2.53\nnameserver 192.0.2.54\n";
        assert_eq!(
            first_nameserver(conf),
            Some("192.0.2.53:53".parse().unwrap())
        );
        assert_eq!(first_nameserver("search example\n"), None);
    }

    fn client(upstream: Option<SocketAddr>) -> Client {
        Client {
            id: "inst_a".into(),
            table: "vps_a".into(),
            gateway: Ipv4Addr::new(10, 0, 0, 1),
            patterns: super::super::allow::domains(&["allowed.test".to_string()]).into(),
            upstream,
            allowed_until: Arc::default(),
        }
    }

    fn query(name: &str) -> Vec<u8> {
        let mut q = Message::query();
        q.metadata.id = 0x1234;
        q.metadata.recursion_desired = true;
        q.add_query(hickory_proto::op::Query::query(
            name.parse().unwrap(),
            hickory_proto::rr::RecordType::A,
        ));
        q.to_vec().unwrap()
    }

    #[tokio::test]
    async fn a_denied_name_is_nxdomain_and_malformed_queries_get_nothing() {
        let reply = answer(&client(None), &query("denied.test."), Transport::Udp)
            .await
            .unwrap();
        let reply = Message::from_vec(&reply).unwrap();
        assert_eq!(reply.metadata.id, 0x1234);
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
        assert_eq!(reply.queries[0].name().to_ascii(), "denied.test.");
        assert!(answer(&client(None), b"\x12\x34garbage", Transport::Udp)
            .await
            .is_none());
        let mut response = Message::from_vec(&query("allowed.test.")).unwrap();
        response.metadata.message_type = MessageType::Response;
        assert!(
            answer(&client(None), &response.to_vec().unwrap(), Transport::Udp)
                .await
                .is_none()
        );
    }

    #[test]
    fn a_guest_without_names_is_not_served() {
        let resolver = Resolver::default();
        let registration = |patterns| Registration {
            id: "inst_a",
            table: "vps_a".into(),
            nics: vec![(Ipv4Addr::new(10, 0, 0, 7), Ipv4Addr::new(10, 0, 0, 1))],
            patterns,
            upstream: None,
        };
        resolver.register(registration(Vec::new())).unwrap();
        assert!(!resolver.serves("inst_a"));
        assert!(lock(&resolver.clients).listeners.is_empty());
    }

    #[tokio::test]
    async fn an_address_already_allowed_long_enough_costs_no_nft_call() {
        let client = client(None);
        let address = Ipv4Addr::new(198, 51, 100, 1);
        let until = Instant::now() + Duration::from_secs(3600);
        lock(&client.allowed_until).insert(address, until);
        allow(&client, &[(address, 60)])
            .await
            .expect("nothing to do");
        // Past half its TTL it is refreshed: `nft` runs (and fails: there is no such table).
        lock(&client.allowed_until).insert(address, Instant::now() + Duration::from_secs(10));
        allow(&client, &[(address, 60)])
            .await
            .expect_err("nft was asked");
    }

    #[tokio::test]
    async fn a_silent_upstream_is_servfail_in_bounded_time() {
        // A bound socket that never answers.
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let upstream = silent.local_addr().unwrap();
        let started = std::time::Instant::now();
        let reply = answer(
            &client(Some(upstream)),
            &query("allowed.test."),
            Transport::Udp,
        )
        .await
        .unwrap();
        assert!(started.elapsed() < UPSTREAM_TIMEOUT + Duration::from_secs(2));
        let reply = Message::from_vec(&reply).unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::ServFail);
        let reply = answer(&client(None), &query("allowed.test."), Transport::Udp)
            .await
            .unwrap();
        assert_eq!(
            Message::from_vec(&reply).unwrap().metadata.response_code,
            ResponseCode::ServFail
        );
    }

    #[tokio::test]
    async fn tcp_messages_carry_their_length_in_front() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        write_frame(&mut a, b"hello").await.unwrap();
        let mut raw = [0u8; 7];
        b.read_exact(&mut raw).await.unwrap();
        assert_eq!(&raw, b"\x00\x05hello");

        // Two messages back to back, then a clean end.
        a.write_all(b"\x00\x03abc\x00\x01z").await.unwrap();
        drop(a);
        assert_eq!(read_frame(&mut b, 16).await.unwrap().unwrap(), b"abc");
        assert_eq!(read_frame(&mut b, 16).await.unwrap().unwrap(), b"z");
        assert_eq!(read_frame(&mut b, 16).await.unwrap(), None);

        // A length of 0, one over the bound, a message cut short: errors.
        for bytes in [&b"\x00\x00"[..], b"\x00\x11", b"\x00\x05abc"] {
            let (mut a, mut b) = tokio::io::duplex(1024);
            a.write_all(bytes).await.unwrap();
            drop(a);
            read_frame(&mut b, 16).await.expect_err("refused");
        }
        let (mut a, _b) = tokio::io::duplex(1024);
        write_frame(&mut a, &vec![0u8; 65_536])
            .await
            .expect_err("too long for the prefix");
    }

    /// A guest at 127.0.0.1 served by `client`, one TCP connection to it.
    async fn connection(client: Client) -> TcpStream {
        let clients = Arc::new(Mutex::new(Clients::default()));
        lock(&clients)
            .by_address
            .insert(Ipv4Addr::LOCALHOST, client);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            serve_connection(stream, Ipv4Addr::LOCALHOST, &clients).await;
        });
        TcpStream::connect(address).await.unwrap()
    }

    #[tokio::test]
    async fn a_tcp_connection_is_answered_query_after_query_until_it_breaks_the_rules() {
        let mut stream = connection(client(None)).await;
        for name in ["denied.test.", "other.test."] {
            write_frame(&mut stream, &query(name)).await.unwrap();
            let reply = read_frame(&mut stream, 65_535).await.unwrap().unwrap();
            let reply = Message::from_vec(&reply).unwrap();
            assert_eq!(reply.metadata.id, 0x1234);
            assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain);
            assert_eq!(reply.queries[0].name().to_ascii(), name);
        }
        // A query longer than taken: the connection is closed, unanswered.
        stream.write_all(&[0x20, 0x00]).await.unwrap();
        // (Written or not: the resolver may have closed already.)
        let _ = stream.write_all(&[0u8; 0x2000]).await;
        assert_eq!(read_frame(&mut stream, 65_535).await.ok().flatten(), None);

        // What is not a query: closed too.
        let mut stream = connection(client(None)).await;
        write_frame(&mut stream, b"\x12\x34garbage").await.unwrap();
        assert_eq!(read_frame(&mut stream, 65_535).await.ok().flatten(), None);
    }

    #[tokio::test]
    async fn a_truncated_upstream_answer_is_asked_again_over_tcp_for_a_tcp_query() {
        // An upstream whose UDP answers are truncated and whose TCP answers are whole: one A
        // record in a private range (never put in a set, so no `nft` runs).
        let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let upstream = udp.local_addr().unwrap();
        let tcp = TcpListener::bind(upstream).await.unwrap();
        let reply_to = |raw: &[u8], truncated: bool| {
            let mut reply = Message::from_vec(raw).unwrap();
            reply.metadata.message_type = MessageType::Response;
            reply.metadata.truncation = truncated;
            if !truncated {
                let name = reply.queries[0].name().clone();
                reply.add_answer(hickory_proto::rr::Record::from_rdata(
                    name,
                    60,
                    RData::A(hickory_proto::rr::rdata::A(Ipv4Addr::new(10, 9, 8, 7))),
                ));
            }
            reply.to_vec().unwrap()
        };
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let (n, peer) = udp.recv_from(&mut buf).await.unwrap();
                udp.send_to(&reply_to(&buf[..n], true), peer).await.unwrap();
            }
        });
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = tcp.accept().await.unwrap();
                let raw = read_frame(&mut stream, 512).await.unwrap().unwrap();
                write_frame(&mut stream, &reply_to(&raw, false))
                    .await
                    .unwrap();
            }
        });
        let client = client(Some(upstream));

        let reply = answer(&client, &query("allowed.test."), Transport::Udp)
            .await
            .unwrap();
        let reply = Message::from_vec(&reply).unwrap();
        assert!(
            reply.metadata.truncation,
            "over UDP the guest retries itself"
        );
        assert!(reply.answers.is_empty());

        let reply = answer(&client, &query("allowed.test."), Transport::Tcp)
            .await
            .unwrap();
        let reply = Message::from_vec(&reply).unwrap();
        assert_eq!(reply.metadata.id, 0x1234);
        assert!(!reply.metadata.truncation);
        assert_eq!(reply.answers.len(), 1, "{reply:?}");
    }
}
