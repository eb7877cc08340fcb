//! The host's tunnel endpoint for `sandboxes.exec` (SPEC §3.7), and the SSH server each
//! tunnel reaches.
//!
//! A client connects over TCP and sends its ticket as the first line. The host redeems it
//! (`nodes.redeemTicket`, with its node token), which names the instance, the principal the
//! certificate must carry and the CA that must have signed it. The rest of the connection is
//! an SSH session (`russh`) with that instance's "guest": it admits only the user `sandbox`
//! with an OpenSSH user certificate from that CA, naming that principal, inside its validity
//! window. An `exec` request runs `sh -c <command>`, a `shell` request runs `sh`, in a
//! scratch directory of the session's own; the client gets stdout, stderr and the exit status.
//!
//! A preview URL's ticket also names a port: the rest of the connection goes to the emulated
//! guest's service on that port ([`super::service`]), with no SSH session.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use russh::server::{Auth, ChannelOpenHandle, Msg, Session};
use russh::{Channel, ChannelId, MethodKind, MethodSet};
use ssh_key::{Algorithm, Certificate, PrivateKey};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::Instrument;

use super::{DomainState, Shared};
use vps_clock::Clock;
use vps_seam::exec_auth::CertificateCheck;
use vps_seam::{NodeApi, Redeemed};

/// The one account a guest admits (the reference's `sandboxExec.account` default).
pub const ACCOUNT: &str = vps_seam::exec_auth::ACCOUNT;
/// The largest chunk of a command's output sent at once.
const CHUNK: usize = 32 * 1024;

/// Accepts tunnels until the host stops.
/// Certificates are checked on `clock`.
pub(super) async fn serve(listener: TcpListener, shared: Arc<Shared>, api: NodeApi, clock: Clock) {
    let config = Arc::new(ssh_config());
    loop {
        let (stream, peer) = vps_seam::tunnel::accept(&listener).await;
        let (shared, api, config) = (shared.clone(), api.clone(), config.clone());
        let span = tracing::debug_span!("tunnel", %peer);
        let clock = clock.clone();
        tokio::spawn(connection(stream, shared, api, config, clock).instrument(span));
    }
}

/// The SSH server of every guest of this host: a fresh host key (clients reach guests only
/// through tickets, so nothing pins it), public-key authentication only.
fn ssh_config() -> russh::server::Config {
    let mut rng = ssh_key::rand_core::UnwrapErr(ssh_key::getrandom::SysRng);
    let host_key =
        PrivateKey::random(&mut rng, Algorithm::Ed25519).expect("an ed25519 key generates");
    russh::server::Config {
        keys: vec![host_key],
        methods: MethodSet::from(&[MethodKind::PublicKey][..]),
        auth_rejection_time: Duration::from_millis(100),
        auth_rejection_time_initial: Some(Duration::ZERO),
        inactivity_timeout: Some(Duration::from_secs(600)),
        nodelay: true,
        ..Default::default()
    }
}

/// One tunnel: the ticket line, its redeem, then the SSH session (or, for a preview URL's
/// ticket, the guest's emulated service on its port).
async fn connection(
    mut stream: TcpStream,
    shared: Arc<Shared>,
    api: NodeApi,
    config: Arc<russh::server::Config>,
    clock: Clock,
) {
    let guest = match admit(&mut stream, &shared, &api, clock).await {
        Ok(Admitted::Ssh(guest)) => *guest,
        Ok(Admitted::Port(instance, port)) => {
            super::service::serve(stream, &instance, port).await;
            return;
        }
        Err(refusal) => {
            tracing::info!(%refusal, "tunnel refused");
            vps_seam::tunnel::refuse(&mut stream, &refusal).await;
            return;
        }
    };
    let ended = match russh::server::run_stream(config, stream, guest).await {
        Ok(session) => session.await,
        Err(e) => Err(e),
    };
    // A client hanging up ends the session with an EOF error: nothing to act on.
    if let Err(error) = ended {
        tracing::debug!(%error, "ssh session ended");
    }
}

/// What a redeemed ticket opens.
enum Admitted {
    /// An exec tunnel: an SSH session with the guest.
    Ssh(Box<Guest>),
    /// A preview URL's tunnel: the instance's port.
    Port(String, u16),
}

/// Reads and redeems the ticket, and checks that the instance it names runs here.
async fn admit(
    stream: &mut TcpStream,
    shared: &Shared,
    api: &NodeApi,
    clock: Clock,
) -> Result<Admitted, String> {
    let ticket = vps_seam::tunnel::read_ticket(stream).await?;
    let redeemed = api
        .redeem_ticket(&ticket)
        .await
        .map_err(|e| format!("ticket: {e}"))?;
    let running = shared
        .domains()
        .snapshot()
        .get(&redeemed.instance_id)
        .is_some_and(|d| d.state == DomainState::Running);
    if !running {
        return Err(format!(
            "instance {} is not running here",
            redeemed.instance_id
        ));
    }
    if let Some(port) = redeemed.port {
        // As the real host: the preview URL's end is the ticket's certificate end.
        if redeemed.valid_before.is_none_or(|end| end <= clock.now()) {
            return Err("the preview URL has ended".into());
        }
        return Ok(Admitted::Port(redeemed.instance_id, port));
    }
    Guest::new(redeemed, clock).map(|g| Admitted::Ssh(Box::new(g)))
}

/// One SSH session with an instance's guest.
struct Guest {
    instance_id: String,
    /// What the certificate must be: the redeemed principal, the sandbox CA's signature.
    check: CertificateCheck,
    /// The session's working directory (removed when the session ends).
    workdir: PathBuf,
    /// Standard input of the command running on each channel.
    stdin: HashMap<ChannelId, mpsc::UnboundedSender<Vec<u8>>>,
    /// The commands running, stopped (and their processes killed) when the session ends.
    commands: Vec<JoinHandle<()>>,
    /// What time certificates are checked at.
    clock: Clock,
}

impl Guest {
    fn new(redeemed: Redeemed, clock: Clock) -> Result<Guest, String> {
        // The emulated guest holds a session to its certificate, not to the ticket's grant.
        let check = CertificateCheck::new(&redeemed, false)?;
        let workdir = std::env::temp_dir().join(format!(
            "vps-guest-{}-{}",
            redeemed.instance_id,
            hex_nonce()
        ));
        std::fs::create_dir_all(&workdir).map_err(|e| format!("scratch directory: {e}"))?;
        Ok(Guest {
            instance_id: redeemed.instance_id,
            check,
            workdir,
            stdin: HashMap::new(),
            commands: Vec::new(),
            clock,
        })
    }

    /// Runs `sh -c command` (or `sh`) on `channel`, streaming its output back.
    fn start(&mut self, channel: ChannelId, command: Option<String>, session: &mut Session) {
        let (stdin, input) = mpsc::unbounded_channel();
        self.stdin.insert(channel, stdin);
        let handle = session.handle();
        let workdir = self.workdir.clone();
        self.commands.push(tokio::spawn(async move {
            let status = run(&handle, channel, command, workdir, input).await;
            let _ = handle.exit_status_request(channel, status).await;
            let _ = handle.eof(channel).await;
            let _ = handle.close(channel).await;
        }));
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        for command in &self.commands {
            command.abort();
        }
        let _ = std::fs::remove_dir_all(&self.workdir);
    }
}

impl russh::server::Handler for Guest {
    type Error = russh::Error;

    async fn auth_openssh_certificate(
        &mut self,
        user: &str,
        certificate: &Certificate,
    ) -> Result<Auth, Self::Error> {
        match self.check.admits(user, certificate, self.clock.now()) {
            Ok(()) => {
                tracing::info!(instance = %self.instance_id, key_id = certificate.key_id(), "certificate admitted");
                Ok(Auth::Accept)
            }
            Err(why) => {
                tracing::info!(instance = %self.instance_id, key_id = certificate.key_id(), why, "certificate refused");
                Ok(Auth::reject())
            }
        }
    }

    async fn channel_open_session(
        &mut self,
        _channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        // The channel's messages come to this handler's methods; the stream half is not used.
        reply.accept().await;
        Ok(())
    }

    async fn pty_request(
        &mut self,
        channel: ChannelId,
        _term: &str,
        _col_width: u32,
        _row_height: u32,
        _pix_width: u32,
        _pix_height: u32,
        _modes: &[(russh::Pty, u32)],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        // No terminal in this guest: commands and `sh` run on pipes.
        session.channel_failure(channel)?;
        Ok(())
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let command = String::from_utf8_lossy(data).into_owned();
        session.channel_success(channel)?;
        self.start(channel, Some(command), session);
        Ok(())
    }

    async fn shell_request(
        &mut self,
        channel: ChannelId,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)?;
        self.start(channel, None, session);
        Ok(())
    }

    async fn data(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        if let Some(stdin) = self.stdin.get(&channel) {
            let _ = stdin.send(data.to_vec());
        }
        Ok(())
    }

    async fn channel_eof(
        &mut self,
        channel: ChannelId,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        // Dropping the sender closes the command's standard input.
        self.stdin.remove(&channel);
        Ok(())
    }
}

/// Runs the command to its end; answers its exit status (127 when it could not start).
async fn run(
    handle: &russh::server::Handle,
    channel: ChannelId,
    command: Option<String>,
    workdir: PathBuf,
    mut input: mpsc::UnboundedReceiver<Vec<u8>>,
) -> u32 {
    let mut sh = tokio::process::Command::new("sh");
    if let Some(command) = &command {
        sh.arg("-c").arg(command);
    }
    // A guest's environment, not the emulator's.
    sh.current_dir(&workdir)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &workdir)
        .env("USER", ACCOUNT)
        .env("LOGNAME", ACCOUNT)
        .env("SHELL", "/bin/sh")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = match sh.spawn() {
        Ok(child) => child,
        Err(error) => {
            let message = format!("sh: {error}\n");
            let _ = handle.extended_data(channel, 1, message.into_bytes()).await;
            return 127;
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        tokio::spawn(async move {
            while let Some(chunk) = input.recv().await {
                if stdin.write_all(&chunk).await.is_err() {
                    break;
                }
            }
        });
    }
    let stdout = pump(child.stdout.take(), handle, channel, None);
    let stderr = pump(child.stderr.take(), handle, channel, Some(1));
    tokio::join!(stdout, stderr);
    match child.wait().await {
        Ok(status) => status.code().map_or(255, |c| c as u32),
        Err(_) => 255,
    }
}

/// Copies one output of a command to the channel (`ext` 1: stderr) until it ends.
async fn pump<R: AsyncRead + Unpin>(
    output: Option<R>,
    handle: &russh::server::Handle,
    channel: ChannelId,
    ext: Option<u32>,
) {
    let Some(mut output) = output else { return };
    let mut buffer = vec![0u8; CHUNK];
    loop {
        let n = match output.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let chunk = buffer[..n].to_vec();
        let sent = match ext {
            Some(ext) => handle.extended_data(channel, ext, chunk).await,
            None => handle.data(channel, chunk).await,
        };
        if sent.is_err() {
            return;
        }
    }
}

fn hex_nonce() -> String {
    format!("{:016x}", rand::random::<u64>())
}
