//! The exec tunnel endpoint (SPEC §3.7, §3.11): the same first-line ticket protocol as the
//! emulated host, then an SSH session that the host itself terminates and relays to the
//! guest's own `sshd`.
//!
//! A client connects and sends its ticket and a newline. The host redeems it once
//! (`nodes.redeemTicket`), which names the instance, the principal of the client's certificate,
//! the CA that signed it and when it ends. The tunnel is refused, and no connection to any guest
//! is opened, when the ticket is unknown or used, the certificate has ended, the instance is not
//! running on this host, or the principal is not the one that instance's `sshd` admits.
//!
//! Else the rest of the stream is an SSH session with the host ([`russh`]). It admits only the
//! user `sandbox` with a user certificate from that CA naming that principal, inside its
//! validity and the ticket's ([`vps_seam::exec_auth`], the emulated host's check). Only then
//! does the host open its own SSH session to the guest's `sshd`, logging in with the host's key
//! ([`crate::guest_key`], which the guest admits through its config drive), and relay each
//! channel both ways: `exec`, `shell`, `pty-req`, `env`, `subsystem`, window changes, signals,
//! data, EOF, close and the exit status or signal. A certificate the host refuses never reaches
//! the guest: its `sshd` sees only connections the host has already let in.
//!
//! A preview URL's ticket (`sandboxes.expose`) also names a guest port: the host checks that
//! the URL has not ended and the guest runs here, then connects the rest of the stream to that
//! port of the guest as plain TCP. No SSH session is involved; the server's proxy speaks HTTP
//! over it.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use russh::server::{Auth, ChannelOpenHandle, Msg, Session};
use russh::{Channel, ChannelId, ChannelMsg, ChannelWriteHalf, MethodKind, MethodSet, Pty, Sig};
use ssh_key::{Algorithm, Certificate, PrivateKey};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;
use vps_clock::Clock;
use vps_seam::exec_auth::{CertificateCheck, ACCOUNT};
use vps_seam::{NodeApi, Redeemed};

use crate::runtime::Runtime;

/// How long the guest's `sshd` may take to accept the connection and the host's login.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the guest's `sshd` may take to answer a channel request (`exec`, `pty-req`, …).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Client data queued for one guest channel before the client is made to wait: the queue lets
/// the session go on reading the client while the guest is slow to take its input.
const QUEUED_CHUNKS: usize = 64;

/// The guests a tunnel may reach now: each running guest and the principal its `sshd` admits.
/// The agent's loop writes it after every look at the guests.
#[derive(Default)]
pub struct Targets(Mutex<HashMap<String, String>>);

impl Targets {
    /// Replaces the set.
    pub fn set(&self, targets: HashMap<String, String>) {
        *self.lock() = targets;
    }

    /// The principal `id`'s `sshd` admits, when it runs here.
    pub fn principal(&self, id: &str) -> Option<String> {
        self.lock().get(id).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        // A panic elsewhere cannot leave the map half-written: take it as it is.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What every tunnel's SSH session shares: the host's SSH server settings and the key it logs
/// in to guests with.
pub struct Proxy {
    server: Arc<russh::server::Config>,
    client: Arc<russh::client::Config>,
    guest_key: Arc<PrivateKey>,
    clock: Clock,
}

impl Proxy {
    /// The proxy that logs in to guests with `guest_key` and checks certificates on `clock`.
    /// Its SSH host key is fresh: clients reach it only through tickets, so nothing pins it.
    pub fn new(guest_key: PrivateKey, clock: Clock) -> Result<Proxy, String> {
        let mut rng = ssh_key::rand_core::UnwrapErr(ssh_key::getrandom::SysRng);
        let host_key = PrivateKey::random(&mut rng, Algorithm::Ed25519)
            .map_err(|e| format!("the tunnel's host key: {e}"))?;
        let server = russh::server::Config {
            keys: vec![host_key],
            methods: MethodSet::from(&[MethodKind::PublicKey][..]),
            auth_rejection_time: Duration::from_millis(100),
            auth_rejection_time_initial: Some(Duration::ZERO),
            inactivity_timeout: Some(Duration::from_secs(600)),
            nodelay: true,
            ..Default::default()
        };
        let client = russh::client::Config {
            nodelay: true,
            ..Default::default()
        };
        Ok(Proxy {
            server: Arc::new(server),
            client: Arc::new(client),
            guest_key: Arc::new(guest_key),
            clock,
        })
    }
}

/// Accepts tunnels until the task is aborted.
pub async fn serve<R: Runtime>(
    listener: TcpListener,
    runtime: Arc<R>,
    api: NodeApi,
    targets: Arc<Targets>,
    proxy: Arc<Proxy>,
) {
    loop {
        let (stream, peer) = vps_seam::tunnel::accept(&listener).await;
        let (runtime, api, targets, proxy) =
            (runtime.clone(), api.clone(), targets.clone(), proxy.clone());
        let span = tracing::info_span!("tunnel", %peer);
        tokio::spawn(connection(stream, runtime, api, targets, proxy).instrument(span));
    }
}

/// One tunnel: the ticket line, its redeem and checks, then the SSH session (or, for a
/// preview URL's ticket, the guest's port).
async fn connection<R: Runtime>(
    mut stream: TcpStream,
    runtime: Arc<R>,
    api: NodeApi,
    targets: Arc<Targets>,
    proxy: Arc<Proxy>,
) {
    let admitted = admit(&mut stream, runtime.as_ref(), &api, &targets, &proxy).await;
    let relay = match admitted {
        Ok(Admitted::Ssh(relay)) => *relay,
        Ok(Admitted::Port { instance, target }) => {
            forward(stream, &instance, target).await;
            return;
        }
        Err(refusal) => {
            tracing::info!(%refusal, "tunnel refused");
            crate::metrics::tunnel(false);
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
    };
    let instance = relay.instance.clone();
    tracing::info!(%instance, guest = %relay.guest, "tunnel admitted: SSH session");
    let _ = stream.set_nodelay(true);
    let ended = match russh::server::run_stream(proxy.server.clone(), stream, relay).await {
        Ok(session) => session.await,
        Err(e) => Err(e),
    };
    // A client hanging up ends the session with an EOF error: nothing to act on.
    match ended {
        Ok(()) => tracing::info!(%instance, "tunnel closed"),
        Err(error) => tracing::debug!(%instance, %error, "tunnel ended"),
    }
}

/// What a redeemed ticket opens.
enum Admitted {
    /// An exec tunnel: the host's SSH session, relayed to the guest's `sshd`.
    Ssh(Box<Relay>),
    /// A preview URL's tunnel: the stream, as it is, to a port of the guest.
    Port {
        instance: String,
        target: SocketAddr,
    },
}

/// Connects a preview URL's tunnel to the guest's port and copies bytes both ways until either
/// side ends. What the guest serves is its own business: the server's proxy speaks HTTP.
async fn forward(mut stream: TcpStream, instance: &str, target: SocketAddr) {
    let connected = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await;
    let mut guest = match connected {
        Ok(Ok(guest)) => guest,
        Ok(Err(e)) => {
            let refusal = format!("port {} of {instance} does not answer: {e}", target.port());
            tracing::info!(%refusal, "tunnel refused");
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
        Err(_) => {
            let refusal = format!(
                "port {} of {instance} does not answer in time",
                target.port()
            );
            tracing::info!(%refusal, "tunnel refused");
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
    };
    crate::metrics::tunnel(true);
    tracing::info!(%instance, %target, "tunnel admitted: guest port");
    let _ = stream.set_nodelay(true);
    let _ = guest.set_nodelay(true);
    match tokio::io::copy_bidirectional(&mut stream, &mut guest).await {
        Ok((up, down)) => tracing::debug!(%instance, up, down, "port tunnel closed"),
        Err(error) => tracing::debug!(%instance, %error, "port tunnel ended"),
    }
}

/// Reads and redeems the ticket, and answers the session for its guest.
async fn admit<R: Runtime>(
    stream: &mut TcpStream,
    runtime: &R,
    api: &NodeApi,
    targets: &Targets,
    proxy: &Proxy,
) -> Result<Admitted, String> {
    let ticket = vps_seam::tunnel::read_ticket(stream).await?;
    let redeemed = api
        .redeem_ticket(&ticket)
        .await
        .map_err(|e| format!("ticket: {e}"))?;
    let admits = targets.principal(&redeemed.instance_id);
    let address = runtime.ssh_address(&redeemed.instance_id);
    if let Some(port) = redeemed.port {
        let running = admits.is_some();
        let target = check_port(&redeemed, running, address, port, proxy.clock.now())?;
        return Ok(Admitted::Port {
            instance: redeemed.instance_id,
            target,
        });
    }
    let guest = check(&redeemed, admits.as_deref(), address, proxy.clock.now())?;
    let certificate = CertificateCheck::new(&redeemed, true)?;
    Ok(Admitted::Ssh(Box::new(Relay {
        instance: redeemed.instance_id,
        guest,
        certificate,
        clock: proxy.clock.clone(),
        client: proxy.client.clone(),
        guest_key: proxy.guest_key.clone(),
        upstream: None,
        permit_pty: false,
        channels: HashMap::new(),
    })))
}

/// Whether a preview URL's redeemed ticket opens `port` of its guest: the URL has not ended,
/// the guest runs here (`running`) and has an address (`address`, where its `sshd` listens).
pub fn check_port(
    redeemed: &Redeemed,
    running: bool,
    address: Option<(IpAddr, u16)>,
    port: u16,
    now: DateTime<Utc>,
) -> Result<SocketAddr, String> {
    let instance = &redeemed.instance_id;
    match redeemed.valid_before {
        Some(end) if end > now => {}
        Some(end) => return Err(format!("the preview URL ended at {end}")),
        None => return Err("the server named no end for the preview URL".into()),
    }
    if !running {
        return Err(format!("instance {instance} is not running here"));
    }
    let Some((ip, _)) = address else {
        return Err(format!("instance {instance} has no address to reach"));
    };
    Ok(SocketAddr::new(ip, port))
}

/// Whether a redeemed ticket opens a tunnel: `admits` is the principal the instance's `sshd`
/// admits when it runs here, `address` where that `sshd` listens.
pub fn check(
    redeemed: &Redeemed,
    admits: Option<&str>,
    address: Option<(IpAddr, u16)>,
    now: DateTime<Utc>,
) -> Result<SocketAddr, String> {
    let instance = &redeemed.instance_id;
    match redeemed.valid_before {
        Some(end) if end > now => {}
        Some(end) => return Err(format!("the certificate ended at {end}")),
        None => return Err("the server named no end for the certificate".into()),
    }
    let Some(admits) = admits else {
        return Err(format!("instance {instance} is not running here"));
    };
    if redeemed.principal != admits {
        return Err(format!(
            "the certificate's principal {:?} is not the one instance {instance} admits",
            redeemed.principal
        ));
    }
    let Some((ip, port)) = address else {
        return Err(format!("instance {instance} has no address to reach"));
    };
    Ok(SocketAddr::new(ip, port))
}

/// One client's SSH session with the host, relayed to one guest's `sshd` once the client's
/// certificate is admitted.
struct Relay {
    instance: String,
    /// Where the guest's `sshd` listens.
    guest: SocketAddr,
    /// What the client's certificate must be.
    certificate: CertificateCheck,
    clock: Clock,
    client: Arc<russh::client::Config>,
    guest_key: Arc<PrivateKey>,
    /// The host's own session with the guest's `sshd`, opened once the client is admitted.
    upstream: Option<russh::client::Handle<GuestSshd>>,
    /// Whether the admitted certificate carries `permit-pty`. The host logs in to the guest
    /// with its own key, which the guest's `sshd` lets do anything, so the host enforces what
    /// the certificate permits: a terminal only with `permit-pty`, and no forwarding of any
    /// kind (only session channels are relayed; agent and X11 requests are refused).
    permit_pty: bool,
    /// The guest's side of each of the client's channels.
    channels: HashMap<ChannelId, Upstream>,
}

/// The guest's side of one channel.
struct Upstream {
    write: Arc<ChannelWriteHalf<russh::client::Msg>>,
    /// The client's data, EOF and close, in order, to the task that writes them to the guest.
    input: mpsc::Sender<Input>,
    /// The guest's answers to the requests relayed on this channel, in order.
    replies: mpsc::UnboundedReceiver<bool>,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Upstream {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// What the client sends on a channel besides requests.
enum Input {
    Data(Vec<u8>),
    Extended(u32, Vec<u8>),
    Eof,
    Close,
}

impl Relay {
    /// Opens the host's session with the guest's `sshd` and logs in as `sandbox` with the
    /// host's key.
    async fn connect(&self) -> Result<russh::client::Handle<GuestSshd>, String> {
        let login = async {
            let stream = TcpStream::connect(self.guest)
                .await
                .map_err(|e| format!("the sshd of {} does not answer: {e}", self.instance))?;
            let mut handle = russh::client::connect_stream(self.client.clone(), stream, GuestSshd)
                .await
                .map_err(|e| format!("SSH with the sshd of {}: {e}", self.instance))?;
            let key = russh::keys::PrivateKeyWithHashAlg::new(self.guest_key.clone(), None);
            let auth = handle
                .authenticate_publickey(ACCOUNT, key)
                .await
                .map_err(|e| format!("logging in to {}: {e}", self.instance))?;
            if !auth.success() {
                return Err(format!(
                    "the sshd of {} refuses the host's key (a guest booted without it?)",
                    self.instance
                ));
            }
            Ok(handle)
        };
        tokio::time::timeout(CONNECT_TIMEOUT, login)
            .await
            .map_err(|_| format!("the sshd of {} does not answer in time", self.instance))?
    }

    /// Waits for the guest's answer to the request just relayed on `channel`, and gives it to
    /// the client (which hears it only if it asked for one).
    async fn answer(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), russh::Error> {
        let Some(upstream) = self.channels.get_mut(&channel) else {
            return session.channel_failure(channel);
        };
        let ok = tokio::time::timeout(REQUEST_TIMEOUT, upstream.replies.recv())
            .await
            .ok()
            .flatten()
            .unwrap_or(false);
        if ok {
            session.channel_success(channel)
        } else {
            session.channel_failure(channel)
        }
    }

    fn write(&self, channel: ChannelId) -> Option<Arc<ChannelWriteHalf<russh::client::Msg>>> {
        self.channels.get(&channel).map(|u| u.write.clone())
    }

    /// Queues client input for the guest; a channel the guest has closed drops it.
    async fn input(&mut self, channel: ChannelId, input: Input) {
        if let Some(upstream) = self.channels.get(&channel) {
            let _ = upstream.input.send(input).await;
        }
    }
}

impl russh::server::Handler for Relay {
    type Error = russh::Error;

    async fn auth_openssh_certificate(
        &mut self,
        user: &str,
        certificate: &Certificate,
    ) -> Result<Auth, Self::Error> {
        let key_id = certificate.key_id();
        if let Err(why) = self.certificate.admits(user, certificate, self.clock.now()) {
            tracing::info!(instance = %self.instance, key_id, why, "certificate refused");
            crate::metrics::tunnel(false);
            return Ok(Auth::reject());
        }
        if self.upstream.is_none() {
            match self.connect().await {
                Ok(handle) => self.upstream = Some(handle),
                Err(why) => {
                    tracing::warn!(instance = %self.instance, key_id, %why, "guest unreachable");
                    crate::metrics::tunnel(false);
                    return Ok(Auth::reject());
                }
            }
        }
        self.permit_pty = certificate.extensions().contains_key("permit-pty");
        tracing::info!(instance = %self.instance, key_id, "certificate admitted");
        crate::metrics::tunnel(true);
        Ok(Auth::Accept)
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // The channel's messages come to this handler's methods; the stream half is dropped so
        // that nothing waits on it.
        let id = channel.id();
        drop(channel);
        let Some(upstream) = &self.upstream else {
            return Ok(());
        };
        let opened = match upstream.channel_open_session().await {
            Ok(opened) => opened,
            Err(error) => {
                tracing::info!(instance = %self.instance, %error, "the guest refused a channel");
                // Dropping the reply refuses the channel.
                return Ok(());
            }
        };
        let (read, write) = opened.split();
        let write = Arc::new(write);
        let (replies_tx, replies) = mpsc::unbounded_channel();
        let (input, queue) = mpsc::channel(QUEUED_CHUNKS);
        let down = tokio::spawn(to_client(read, session.handle(), id, replies_tx));
        let up = tokio::spawn(to_guest(queue, write.clone()));
        self.channels.insert(
            id,
            Upstream {
                write,
                input,
                replies,
                tasks: [down, up],
            },
        );
        reply.accept().await;
        Ok(())
    }

    async fn pty_request(
        &mut self,
        channel: ChannelId,
        term: &str,
        col_width: u32,
        row_height: u32,
        pix_width: u32,
        pix_height: u32,
        modes: &[(Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(write) = self.write(channel).filter(|_| self.permit_pty) else {
            return session.channel_failure(channel);
        };
        write
            .request_pty(
                true, term, col_width, row_height, pix_width, pix_height, modes,
            )
            .await?;
        self.answer(channel, session).await
    }

    async fn x11_request(
        &mut self,
        channel: ChannelId,
        _single_connection: bool,
        _protocol: &str,
        _cookie: &str,
        _screen: u32,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // No certificate permits X11 forwarding (`permit-pty` is the one extension signed).
        session.channel_failure(channel)
    }

    async fn env_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        value: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(write) = self.write(channel) else {
            return session.channel_failure(channel);
        };
        write.set_env(true, name, value).await?;
        self.answer(channel, session).await
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(write) = self.write(channel) else {
            return session.channel_failure(channel);
        };
        write.request_shell(true).await?;
        self.answer(channel, session).await
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(write) = self.write(channel) else {
            return session.channel_failure(channel);
        };
        write.exec(true, data.to_vec()).await?;
        self.answer(channel, session).await
    }

    async fn subsystem_request(
        &mut self,
        channel: ChannelId,
        name: &str,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(write) = self.write(channel) else {
            return session.channel_failure(channel);
        };
        write.request_subsystem(true, name).await?;
        self.answer(channel, session).await
    }

    async fn window_change_request(
        &mut self,
        channel: ChannelId,
        col_width: u32,
        row_height: u32,
        pix_width: u32,
        pix_height: u32,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if let Some(write) = self.write(channel) {
            write
                .window_change(col_width, row_height, pix_width, pix_height)
                .await?;
        }
        Ok(())
    }

    async fn signal(
        &mut self,
        channel: ChannelId,
        signal: Sig,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if let Some(write) = self.write(channel) {
            write.signal(signal).await?;
        }
        Ok(())
    }

    async fn data(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.input(channel, Input::Data(data.to_vec())).await;
        Ok(())
    }

    async fn extended_data(
        &mut self,
        channel: ChannelId,
        code: u32,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.input(channel, Input::Extended(code, data.to_vec()))
            .await;
        Ok(())
    }

    async fn channel_eof(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        self.input(channel, Input::Eof).await;
        Ok(())
    }

    async fn channel_close(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if let Some(upstream) = self.channels.remove(&channel) {
            // The queued input and the close go out before the channel's tasks end.
            let _ = upstream.input.send(Input::Close).await;
            let Upstream { tasks, .. } = &upstream;
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, wait_finished(&tasks[1])).await;
        }
        Ok(())
    }
}

/// Waits until `task` has ended, without taking it.
async fn wait_finished(task: &JoinHandle<()>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Writes the client's input to the guest's channel, in order, until the client closes it.
async fn to_guest(
    mut queue: mpsc::Receiver<Input>,
    write: Arc<ChannelWriteHalf<russh::client::Msg>>,
) {
    while let Some(input) = queue.recv().await {
        let sent = match input {
            Input::Data(data) => write.data_bytes(data).await,
            Input::Extended(code, data) => write.extended_data_bytes(code, data).await,
            Input::Eof => write.eof().await,
            Input::Close => {
                let _ = write.close().await;
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Relays what the guest sends on one channel to the client, and the guest's answers to
/// requests to the handler waiting for them, until the guest closes the channel.
async fn to_client(
    mut read: russh::ChannelReadHalf,
    client: russh::server::Handle,
    id: ChannelId,
    replies: mpsc::UnboundedSender<bool>,
) {
    while let Some(message) = read.wait().await {
        let relayed = match message {
            ChannelMsg::Data { data } => client.data(id, data).await.map_err(|_| ()),
            ChannelMsg::ExtendedData { data, ext } => {
                client.extended_data(id, ext, data).await.map_err(|_| ())
            }
            ChannelMsg::Eof => client.eof(id).await,
            ChannelMsg::Close => break,
            ChannelMsg::ExitStatus { exit_status } => {
                client.exit_status_request(id, exit_status).await
            }
            ChannelMsg::ExitSignal {
                signal_name,
                core_dumped,
                error_message,
                lang_tag,
            } => {
                client
                    .exit_signal_request(id, signal_name, core_dumped, error_message, lang_tag)
                    .await
            }
            ChannelMsg::Success => replies.send(true).map_err(|_| ()),
            ChannelMsg::Failure => replies.send(false).map_err(|_| ()),
            // Window adjustments and the like are each side's own business.
            _ => Ok(()),
        };
        if relayed.is_err() {
            return;
        }
    }
    // The guest closed the channel (or the session with it ended): so does the client's.
    let _ = client.close(id).await;
}

/// The host's SSH client side with a guest's `sshd`. The guest is reached over the host's own
/// bridge at the address the host gave it, and its host key is the guest's own, made at its
/// first boot: there is nothing to check it against, and nobody else holds that address.
struct GuestSshd;

impl russh::client::Handler for GuestSshd {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        _key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use chrono::TimeDelta;

    use super::*;

    fn redeemed(principal: &str, ends_in: i64, now: DateTime<Utc>) -> Redeemed {
        Redeemed {
            instance_id: "inst_a".into(),
            principal: principal.into(),
            valid_before: Some(now + TimeDelta::seconds(ends_in)),
            ca_public_key: None,
            port: None,
        }
    }

    const SSHD: Option<(IpAddr, u16)> =
        Some((IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2)), 22));

    #[test]
    fn a_valid_ticket_for_a_running_guest_reaches_its_sshd() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let at = check(&redeemed("inst_a", 60, now), Some("inst_a"), SSHD, now).unwrap();
        assert_eq!(at.to_string(), "10.0.0.2:22");
    }

    #[test]
    fn an_ended_certificate_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_a", -1, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("ended"), "{e}");
        let e = check(&redeemed("inst_a", 0, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("ended"), "{e}");
        let mut no_end = redeemed("inst_a", 60, now);
        no_end.valid_before = None;
        assert!(check(&no_end, Some("inst_a"), SSHD, now).is_err());
    }

    #[test]
    fn a_guest_not_running_here_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_a", 60, now), None, SSHD, now).unwrap_err();
        assert!(e.contains("not running here"), "{e}");
        let e = check(&redeemed("inst_a", 60, now), Some("inst_a"), None, now).unwrap_err();
        assert!(e.contains("no address"), "{e}");
    }

    #[test]
    fn a_preview_ticket_reaches_its_port_on_the_guest_address_while_it_lasts() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let mut r = redeemed("inst_a", 60, now);
        r.port = Some(8080);
        let at = check_port(&r, true, SSHD, 8080, now).unwrap();
        assert_eq!(at.to_string(), "10.0.0.2:8080");
        assert!(check_port(&r, false, SSHD, 8080, now).is_err());
        assert!(check_port(&r, true, None, 8080, now).is_err());
        let ended = redeemed("inst_a", 0, now);
        assert!(check_port(&ended, true, SSHD, 8080, now).is_err());
    }

    #[test]
    fn a_principal_the_guest_does_not_admit_is_refused() {
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let e = check(&redeemed("inst_b", 60, now), Some("inst_a"), SSHD, now).unwrap_err();
        assert!(e.contains("\"inst_b\""), "{e}");
    }
}
