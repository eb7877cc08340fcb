//! `vps host`: the real host agent. It speaks the host seam (SPEC §3.7) to the server exactly
//! as the emulated hosts do, through the same `vps-seam` types, and runs each instance as a
//! QEMU virtual machine (SPEC §3.11).
//!
//! Modules:
//! - [`config`]: `host.toml`'s `[host]` table ([`load_config`]);
//! - [`agent`]: the loop (long-poll the NodeSpec, converge, report) and, in
//!   [`agent::converge`], the pure decision of what each guest needs;
//! - [`runtime`]: the [`runtime::Runtime`] seam and its `qemu` implementation;
//! - [`tunnel`]: the exec tunnel endpoint (ticket line, redeem, the SSH session the host
//!   terminates and relays to the guest's `sshd`), and [`guest_key`], the key it logs in with;
//! - [`metrics`]: the agent's Prometheus metrics.
//!
//! The agent never touches the database or the server's internals: only the node calls. It
//! never holds a guest's life: guests run apart from it and outlive its restarts.

pub mod agent;
pub mod config;
pub mod disk;
pub mod doctor;
pub mod guest_key;
pub mod metrics;
pub mod runtime;
pub mod tunnel;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinHandle;

pub use config::{load_config, AgentTimings, ConfigError, HostConfig, RuntimeKind};

use agent::converge::HostLimits;
use runtime::Runtime;

/// Runs the agent with the runtime `config` names until SIGINT or SIGTERM. Guests keep
/// running after it returns; the next start re-adopts them.
pub async fn run(config: HostConfig) -> anyhow::Result<()> {
    if let Some(address) = config.metrics_listen {
        // Installed before anything records, so no early sample is lost.
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(address)
            .install()
            .with_context(|| format!("serving metrics on {address}"))?;
        tracing::info!(%address, "metrics served at /metrics");
    }
    let runtime = match config.runtime {
        RuntimeKind::Qemu => {
            let mut qemu =
                runtime::qemu::Qemu::new(&config.state_dir, &config.image_dir, config.accel)
                    .context("the qemu runtime")?;
            qemu.dns_upstream = config.dns_upstream;
            if let Some(max) = config.image_cache_max_bytes {
                qemu.image_cache_max_bytes = max;
            }
            if let Some(slots) = config.restore_slots {
                qemu.restore_slots = slots;
            }
            qemu
        }
    };
    let chosen = runtime.chosen_accel().await;
    tracing::info!(accel = chosen.as_str(), cpu_model = %runtime.cpu_model(), "qemu runtime ready");
    let host = start(config, runtime).await?;
    tracing::info!(tunnel_url = host.tunnel_url(), "host agent running");
    shutdown_signal().await;
    tracing::info!("host agent stops; its guests keep running");
    host.stop().await;
    Ok(())
}

/// Starts the agent's loop and its tunnel endpoint with `runtime`, on the current tokio
/// runtime. They run until the handle is stopped or dropped.
pub async fn start<R: Runtime>(config: HostConfig, runtime: R) -> anyhow::Result<HostHandle> {
    let listener = tokio::net::TcpListener::bind(&config.tunnel_listen)
        .await
        .with_context(|| format!("the tunnel endpoint on {}", config.tunnel_listen))?;
    let local = listener
        .local_addr()
        .context("the tunnel endpoint's address")?;
    let tunnel_url = tunnel_url(local);
    let api = vps_seam::NodeApi::new(vps_seam::NodeApiOptions {
        base_url: config.server_url.clone(),
        node_id: config.node_id.clone(),
        token: config.node_token.clone(),
        tunnel_url: Some(tunnel_url.clone()),
        idle_timeout: config.timings.report_interval * 2,
        facts: Some(vps_seam::HostFacts {
            cpu_model: runtime.cpu_model(),
            runtimes: vec![runtime.name().to_string()],
        }),
    });
    let limits = HostLimits {
        runtime: runtime.name(),
        vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        memory_mib: memory_mib().context("the host's memory (/proc/meminfo)")?,
    };
    metrics::info(limits.runtime, accel_name(&runtime), &runtime.cpu_model());
    tracing::info!(
        node_id = %config.node_id,
        runtime = limits.runtime,
        cpu_model = %runtime.cpu_model(),
        vcpus = limits.vcpus,
        memory_mib = limits.memory_mib,
        "host agent starts"
    );
    let guest_key = guest_key::load_or_create(&config.state_dir).map_err(anyhow::Error::msg)?;
    let guest_public_key = guest_key::public_line(&guest_key).map_err(anyhow::Error::msg)?;
    let proxy =
        tunnel::Proxy::new(guest_key, vps_clock::Clock::system()).map_err(anyhow::Error::msg)?;
    let runtime = Arc::new(runtime);
    let targets = Arc::new(tunnel::Targets::default());
    let tunnel = tokio::spawn(tunnel::serve(
        listener,
        runtime.clone(),
        api.clone(),
        targets.clone(),
        Arc::new(proxy),
    ));
    let parts = agent::AgentParts {
        api,
        timings: config.timings.clone(),
        limits,
        bridge: config.bridge.clone(),
        targets,
        snapshot_dir: config.state_dir.join("snapshots"),
        guest_public_key,
    };
    let task = tokio::spawn(agent::run(runtime, parts));
    Ok(HostHandle {
        task: Some(task),
        tunnel: Some(tunnel),
        tunnel_url,
    })
}

/// A running agent; dropping it stops the loop and the tunnel (never the guests).
pub struct HostHandle {
    task: Option<JoinHandle<()>>,
    tunnel: Option<JoinHandle<()>>,
    tunnel_url: String,
}

impl HostHandle {
    /// Where the agent accepts exec tunnels, as its reports state it (`tcp://HOST:PORT`).
    pub fn tunnel_url(&self) -> &str {
        &self.tunnel_url
    }

    /// Stops the agent, abruptly as a `kill -9` would (nothing is cleaned up, no guest is
    /// touched), and waits until nothing more is sent.
    pub async fn stop(mut self) {
        for task in [self.tunnel.take(), self.task.take()].into_iter().flatten() {
            task.abort();
            // The task ends cancelled; that is the expected outcome, not an error.
            let _ = task.await;
        }
    }
}

impl Drop for HostHandle {
    fn drop(&mut self) {
        for task in [self.tunnel.take(), self.task.take()].into_iter().flatten() {
            task.abort();
        }
    }
}

/// `tcp://HOST:PORT` for the bound endpoint. An unspecified address (`0.0.0.0`) names no host a
/// client can reach, so the machine's host name stands in for it.
fn tunnel_url(local: SocketAddr) -> String {
    if local.ip().is_unspecified() {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|n| n.trim().to_owned())
            .unwrap_or_default();
        if !name.is_empty() {
            return format!("tcp://{name}:{}", local.port());
        }
    }
    format!("tcp://{local}")
}

fn accel_name<R: Runtime>(runtime: &R) -> &'static str {
    let model = runtime.cpu_model();
    if model.starts_with("kvm") {
        "kvm"
    } else if model.starts_with("tcg") {
        "tcg"
    } else {
        "unknown"
    }
}

/// `MemTotal` of `/proc/meminfo`, in MiB.
fn memory_mib() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    let kib = text
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .context("no MemTotal line")?;
    Ok(kib / 1024)
}

async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            // Without a SIGTERM handler, Ctrl-C still stops the agent.
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
