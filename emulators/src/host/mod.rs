//! An emulated host: the part a real host agent plays, over the same HTTP API.
//!
//! `vps dev --sim N` and the tests run these in-process instead of real hosts. Each one is a
//! tokio task that long-polls `nodes.spec` for its node, converges local "domains" toward the
//! spec's desired states, and answers with complete `nodes.report`s. It never touches the
//! database or the server's internals, so whatever it makes happen a real host could make happen
//! too (SPEC §3.7).
//!
//! How a domain follows its `InstanceSpec.desiredState`:
//! - `running`: a new domain fetches its user data once (`nodes.secret`), then is booting
//!   (reported `UNSPECIFIED`, which the server skips) for the boot delay, then `RUNNING`;
//!   a paused one resumes at once; a stopped one boots again;
//! - `stopped`: `STOPPED`; `paused`: booted if need be, then `PAUSED` (a `containerd` domain
//!   cannot pause and is `ERROR` "pause unsupported");
//! - `deleted`, or missing from the spec: the domain is destroyed, except stray domains.
//!
//! With [`HostConfig::tunnel_listen`], the host also accepts `sandboxes.exec` tunnels there
//! (see [`tunnel`]) and states the endpoint in its reports (`tunnelUrl`); a preview URL's
//! tunnel reaches the guest's emulated service (`service`).
//!
//! The [`HostHandle`] injects what tests need: failures, refused starts, strays, silence.

mod agent;
mod domains;
mod service;
mod snapshots;
pub mod tunnel;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use domains::Domains;
pub use vps_seam::VolumeSpec;

/// Where an emulated host finds its server and how fast it behaves.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The server's root, e.g. `http://127.0.0.1:8080` (calls go to `/api/compute/nodes/*`).
    pub base_url: String,
    /// The node this host is (`node_…`), as `nodes.register` answered it.
    pub node_id: String,
    /// The node token `nodes.register` answered, sent as a bearer token.
    pub token: String,
    /// How long a domain boots before it is `RUNNING`.
    pub boot_delay: Duration,
    /// The longest time between two reports, changed or not (reports also mark the node alive).
    pub report_interval: Duration,
    /// How long the server may hold a `nodes.spec` long poll (`waitMs`, at most 30 s).
    pub poll_wait: Duration,
    /// How big a snapshot object this host uploads.
    pub snapshot_bytes: usize,
    /// The CPU model a memory snapshot records (as `nodes.register`'s `cpuModel`).
    pub cpu_model: Option<String>,
    /// Where to accept exec tunnels (`127.0.0.1:0` picks a port); `None`: no tunnels.
    pub tunnel_listen: Option<String>,
    /// What time it is where certificates are checked (a test's server and its hosts share
    /// one clock).
    pub clock: vps_clock::Clock,
}

impl HostConfig {
    /// A config with the pace of a real host: reports about once a second (as the reference's
    /// hosts do), a half-second boot and five-second long polls.
    pub fn new(
        base_url: impl Into<String>,
        node_id: impl Into<String>,
        token: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            node_id: node_id.into(),
            token: token.into(),
            boot_delay: Duration::from_millis(500),
            report_interval: Duration::from_secs(1),
            poll_wait: Duration::from_secs(5),
            snapshot_bytes: 1 << 20,
            cpu_model: Some("emulated".into()),
            tunnel_listen: None,
            clock: vps_clock::Clock::system(),
        }
    }
}

/// What a domain is doing, as a test sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DomainState {
    /// Started, not yet up: reported `UNSPECIFIED`.
    Booting,
    Running,
    Stopped,
    Paused,
    /// Failed (injected, user data not available, or a state the runtime cannot reach).
    Error,
}

/// One domain the host holds, as a test sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Domain {
    pub state: DomainState,
    /// The status message it is reported with (errors, `ResourcesExhausted: …`).
    pub message: Option<String>,
    /// The addresses it is reported with (its NICs' addresses once it runs).
    pub addresses: Vec<String>,
    /// The user data it booted with, once fetched (empty when the spec named none).
    pub user_data: Option<String>,
    /// A restore: the snapshot it booted from (downloaded, digest checked).
    pub restored_from: Option<String>,
}

/// Starts emulated hosts.
pub struct EmulatedHost;

impl EmulatedHost {
    /// Spawns the host's loop on the current tokio runtime; it runs until the handle is dropped
    /// or [`HostHandle::stop`] is awaited.
    pub fn start(config: HostConfig) -> HostHandle {
        let shared = Arc::new(Shared {
            domains: Mutex::new(Domains::default()),
            reporting: AtomicBool::new(true),
            wake: Notify::new(),
            orphans: Mutex::new(Vec::new()),
            reports_sent: AtomicU64::new(0),
            commands: Mutex::new(snapshots::Commands::default()),
            corrupt_uploads: AtomicBool::new(false),
            hold_commands: AtomicBool::new(false),
            report_cpu: AtomicBool::new(true),
            refuse_snapshots: AtomicBool::new(false),
        });
        let node_id = config.node_id.clone();
        let listener = config.tunnel_listen.as_deref().and_then(|at| {
            bind(at)
                .inspect_err(|e| tracing::error!(node_id, error = %e, "no exec tunnels"))
                .ok()
        });
        let tunnel_url = listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
            .map(|addr| format!("tcp://{addr}"));
        let api = vps_seam::NodeApi::new(vps_seam::NodeApiOptions {
            base_url: config.base_url.clone(),
            node_id: config.node_id.clone(),
            token: config.token.clone(),
            tunnel_url: tunnel_url.clone(),
            idle_timeout: config.report_interval * 2,
            facts: None,
        });
        let tunnel = listener.map(|l| {
            tokio::spawn(tunnel::serve(
                l,
                shared.clone(),
                api.clone(),
                config.clock.clone(),
            ))
        });
        let task = tokio::spawn(agent::run(shared.clone(), config, api));
        HostHandle {
            node_id,
            shared,
            task: Some(task),
            tunnel,
            tunnel_url,
        }
    }
}

/// A listening socket on `at`, for the current tokio runtime.
fn bind(at: &str) -> std::io::Result<tokio::net::TcpListener> {
    let listener = std::net::TcpListener::bind(at)?;
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

/// State the loop and the handle share.
pub(crate) struct Shared {
    domains: Mutex<Domains>,
    /// False while the host plays dead.
    reporting: AtomicBool,
    /// Knobs poke the loop so a change is reported now, not at the next interval.
    wake: Notify,
    orphans: Mutex<Vec<String>>,
    reports_sent: AtomicU64,
    /// Snapshot commands in flight and finished.
    commands: Mutex<snapshots::Commands>,
    /// Uploads declare a wrong digest, so the store refuses them.
    corrupt_uploads: AtomicBool,
    /// Snapshot commands are never run (the server's timeout fails them).
    hold_commands: AtomicBool,
    /// Reports carry each guest's CPU seconds (false: an older host that sends none).
    report_cpu: AtomicBool,
    /// Snapshot commands fail at once, without an upload.
    refuse_snapshots: AtomicBool,
}

impl Shared {
    fn domains(&self) -> MutexGuard<'_, Domains> {
        self.domains
            .lock()
            .expect("the host's domains are never poisoned")
    }

    fn commands(&self) -> MutexGuard<'_, snapshots::Commands> {
        self.commands
            .lock()
            .expect("the host's commands are never poisoned")
    }
}

/// Controls a running emulated host; dropping it stops the host.
pub struct HostHandle {
    node_id: String,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
    tunnel: Option<JoinHandle<()>>,
    tunnel_url: Option<String>,
}

impl HostHandle {
    /// The node this host reports as.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Where the host accepts exec tunnels (`tcp://127.0.0.1:port`), when it does.
    pub fn tunnel_url(&self) -> Option<&str> {
        self.tunnel_url.as_deref()
    }

    /// Every domain the host holds and its state.
    pub fn domains(&self) -> BTreeMap<String, DomainState> {
        self.shared
            .domains()
            .snapshot()
            .into_iter()
            .map(|(id, domain)| (id, domain.state))
            .collect()
    }

    /// One domain in full, if the host holds it.
    pub fn domain(&self, id: &str) -> Option<Domain> {
        self.shared.domains().snapshot().remove(id)
    }

    /// Fails the domain of `id` (creating it if need be): it is `ERROR` with `message` until the
    /// spec deletes the instance.
    pub fn fail_instance(&self, id: &str, message: &str) {
        self.shared.domains().fail(id, message);
        self.shared.wake.notify_one();
    }

    /// While `Some(text)`, the host's admission refuses to boot new instances: they stay
    /// `STOPPED` with the message `ResourcesExhausted: <text>`, and boot once it is `None`.
    pub fn refuse_new(&self, reason: Option<String>) {
        self.shared.domains().refuse_new(reason);
        self.shared.wake.notify_one();
    }

    /// Adds a running domain no spec asked for (a leak); the host keeps and reports it until
    /// [`HostHandle::remove_domain`].
    pub fn add_stray_domain(&self, id: &str) {
        self.shared.domains().add_stray(id);
        self.shared.wake.notify_one();
    }

    /// Destroys a domain at once, whatever the spec says (a spec that still wants it boots it
    /// again).
    pub fn remove_domain(&self, id: &str) {
        self.shared.domains().remove(id);
        self.shared.wake.notify_one();
    }

    /// `false` makes the host silent, as if lost: no spec polls, no reports (its domains keep
    /// running). `true` resumes, with a report at once.
    pub fn set_reporting(&self, on: bool) {
        self.shared.reporting.store(on, Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// While `true`, snapshot uploads declare a wrong SHA-256, so the store refuses them and
    /// the host reports the snapshot failed.
    pub fn corrupt_uploads(&self, on: bool) {
        self.shared.corrupt_uploads.store(on, Ordering::SeqCst);
    }

    /// While `true`, the host never runs snapshot commands (they time out on the server).
    pub fn hold_commands(&self, on: bool) {
        self.shared.hold_commands.store(on, Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// Sets how many CPU seconds per second of the host's clock the domain `id` uses while
    /// it runs (`None`: every domain without a rate of its own; the default is 0, an idle
    /// guest). Reports carry the seconds accrued (`cpuSeconds`).
    pub fn set_cpu_rate(&self, id: Option<&str>, rate: f64) {
        self.shared.domains().set_cpu_rate(id, rate);
        self.shared.wake.notify_one();
    }

    /// `false` makes the host report no `cpuSeconds`, as a host from before them does.
    pub fn report_cpu(&self, on: bool) {
        self.shared.report_cpu.store(on, Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// While `true`, the host refuses snapshot commands: each fails at once, reported with the
    /// reason `snapshots refused by this host` (a host out of snapshot space, or one that
    /// cannot capture its guests).
    pub fn refuse_snapshots(&self, on: bool) {
        self.shared.refuse_snapshots.store(on, Ordering::SeqCst);
        self.shared.wake.notify_one();
    }

    /// The `orphans` of the last report the server answered.
    pub fn last_orphans(&self) -> Vec<String> {
        self.shared
            .orphans
            .lock()
            .expect("the orphan list is never poisoned")
            .clone()
    }

    /// The generation of the last spec the host converged to.
    pub fn applied_generation(&self) -> Option<u64> {
        self.shared.domains().applied_generation()
    }

    /// The volumes the host keeps: those of the last spec it converged to.
    pub fn volumes(&self) -> Vec<VolumeSpec> {
        self.shared.domains().volumes()
    }

    /// How many reports the server has accepted.
    pub fn reports_sent(&self) -> u64 {
        self.shared.reports_sent.load(Ordering::SeqCst)
    }

    /// Stops the host and waits until its loop has ended: nothing is sent after this returns.
    pub async fn stop(mut self) {
        if let Some(tunnel) = self.tunnel.take() {
            tunnel.abort();
        }
        if let Some(task) = self.task.take() {
            task.abort();
            // The loop ends cancelled; that is the expected outcome, not an error.
            let _ = task.await;
        }
    }
}

impl Drop for HostHandle {
    fn drop(&mut self) {
        if let Some(tunnel) = self.tunnel.take() {
            tunnel.abort();
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
