//! The `vps serve` process: the HTTP API plus every background part (chainer, reactors,
//! publishers), sharing one pool and one wake-up notifier.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::get;
use axum::Router;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use vps_events::Notifier;

use crate::config::Config;
pub use crate::state::AppState;
pub use crate::supervisor::{supervise, supervise_infallible};

/// The HTTP routes, without any background part (handlers can be driven with `oneshot`).
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(crate::health::healthz))
        .route("/readyz", get(crate::health::readyz))
        .route("/metrics", get(crate::health::metrics))
        .route(
            "/api/compute/events/stream",
            get(crate::methods::events::stream),
        )
        .route("/api/compute/openapi.json", get(crate::openapi::serve))
        .route(
            "/snapshots/{*key}",
            get(crate::snapshot_objects::get).put(crate::snapshot_objects::put),
        )
        .route(
            "/preview/{token}",
            axum::routing::any(crate::preview::proxy),
        )
        .route(
            "/preview/{token}/",
            axum::routing::any(crate::preview::proxy),
        )
        .route(
            "/preview/{token}/{*rest}",
            axum::routing::any(crate::preview::proxy),
        )
        .route(
            "/api/compute/{group}/{method}",
            axum::routing::post(crate::rpc::dispatch),
        )
        .merge(crate::console::routes())
        // `rpc::dispatch` enforces its own limit and answers INVALID_INPUT.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// A server running in this process.
pub struct RunningServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The state its handlers share.
    pub state: AppState,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningServer {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the listener and every background part.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.abort();
            let _ = task.await;
        }
    }
}

/// Binds the listener and starts the API and the background parts on `pool`.
pub async fn start(config: Config, pool: PgPool) -> anyhow::Result<RunningServer> {
    start_with_clock(config, pool, vps_clock::Clock::system()).await
}

/// [`start`] on `clock` (a test's manual clock).
pub async fn start_with_clock(
    config: Config,
    pool: PgPool,
    clock: vps_clock::Clock,
) -> anyhow::Result<RunningServer> {
    crate::telemetry::metrics_handle();
    let listen = config.listen_addr()?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("http.listen: cannot bind {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let notifier = Notifier::start(pool.clone()).with_tail(pool.clone());
    let authz = Arc::new(crate::authz::Authorizer::new(
        &crate::registry::actions(crate::methods::registry().methods()),
        config.policies.dir.as_deref(),
    )?);
    authz.refresh(&pool).await?;
    let sandbox_ca = config
        .sandbox_exec
        .load_ca()
        .map_err(|e| anyhow::anyhow!("[sandbox_exec] ca_key: {e}"))?
        .map(Arc::new);
    let state = AppState {
        pool: pool.clone(),
        notifier: notifier.clone(),
        secrets: secret_key(&config)?,
        guards: crate::guards::Guards::new(&config.limits),
        watched: Default::default(),
        config: Arc::new(config.clone()),
        admitter: vps_commands::instances::Admitter::start(),
        authz: authz.clone(),
        snapshots: config.snapshot_store(&config.secret_bytes()?, addr, clock.clone())?,
        sandbox_ca,
        preview_url: config.preview_url(addr).into(),
        specs: Arc::default(),
        spec_signals: Arc::default(),
        readiness: Arc::default(),
        clock,
        wakeups: Default::default(),
        reports: Arc::default(),
    };
    let (stop, mut stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        tasks.push(supervise("chainer", move || {
            vps_events::chain::run_chainer(pool.clone(), notifier.clone())
        }));
    }
    {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        tasks.push(supervise("policies", move || {
            authz.clone().follow(pool.clone(), notifier.clone())
        }));
    }
    {
        let (pool, signals) = (pool.clone(), state.spec_signals.clone());
        tasks.push(supervise_infallible("spec-signals", move || {
            vps_projections::spec_signals::listen(pool.clone(), signals.clone())
        }));
    }
    {
        let (pool, wakeups) = (pool.clone(), state.wakeups.clone());
        tasks.push(supervise_infallible("work-signals", move || {
            vps_reactors::work_queue::listen(pool.clone(), wakeups.clone())
        }));
    }
    tasks.extend(start_reactors(&state));
    let router = app(state.clone());
    tasks.push(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        crate::http::serve(listener, router, crate::http::IDLE_CONNECTION, shutdown).await;
    }));
    tracing::info!(%addr, "vps listening");
    Ok(RunningServer {
        addr,
        state,
        stop,
        tasks,
    })
}

/// Resolves when the process is asked to stop (Ctrl-C or SIGTERM).
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The configured sealing key. There is no default: a key of the process's own would seal
/// data no restart or other replica can open (`vps dev` generates one and keeps it).
fn secret_key(config: &Config) -> anyhow::Result<vps_commands::secrets::SecretKey> {
    Ok(vps_commands::secrets::SecretKey::new(
        config.secret_bytes()?,
    ))
}

/// Kept here for callers that start a server and act beside it.
pub use crate::state::reactor_ctx;

/// The reactor delays from `[timings]`.
pub fn timings(config: &Config) -> vps_reactors::timings::Timings {
    config.timings.clone()
}

/// The metering windows of `[timings] usage_window` (validated at load).
pub fn usage_windows(config: &Config) -> vps_domain::usage::Windows {
    vps_domain::usage::Windows::from_seconds(config.timings.usage_window)
        .unwrap_or_else(|| vps_domain::usage::Windows::new(300_000_000).expect("positive"))
}

/// Starts the waker, the instance reconciler, node liveness, the publishers and the
/// `vps_doctor_findings` gauges.
fn start_reactors(state: &AppState) -> Vec<JoinHandle<()>> {
    let timings = timings(&state.config);
    let mut tasks = Vec::new();
    let (ctx, waker_timings) = (reactor_ctx(state, "waker"), timings.clone());
    tasks.push(supervise("instance-waker", move || {
        vps_reactors::waker::run(ctx.clone(), waker_timings.clone())
    }));
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    let signals = state.spec_signals.clone();
    tasks.push(supervise("node-specs", move || {
        vps_projections::node_specs::run(pool.clone(), notifier.clone(), signals.clone())
    }));
    let (ctx, t) = (reactor_ctx(state, "instances"), timings.clone());
    tasks.push(supervise("instance-reconciler", move || {
        vps_reactors::instances::run(ctx.clone(), t.clone(), 8)
    }));
    let (ctx, t) = (reactor_ctx(state, "sandboxes"), timings.clone());
    let store = state.snapshots.clone();
    tasks.push(supervise("sandbox-reconciler", move || {
        vps_reactors::sandboxes::run(ctx.clone(), t.clone(), store.clone())
    }));
    let (ctx, t) = (reactor_ctx(state, "teardown"), timings.clone());
    tasks.push(supervise("tenant-teardown", move || {
        vps_reactors::teardown::run(ctx.clone(), t.clone())
    }));
    let windows = usage_windows(&state.config);
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    tasks.push(supervise("usage-metering", move || {
        vps_reactors::usage::run(pool.clone(), notifier.clone(), windows)
    }));
    let (ctx, t) = (reactor_ctx(state, "liveness"), timings);
    tasks.push(supervise("node-liveness", move || {
        vps_reactors::liveness::run(ctx.clone(), t.clone())
    }));
    if let Some(nats) = &state.config.nats {
        let config = vps_reactors::nats::NatsPublisherConfig {
            url: nats.url.clone(),
            subject_prefix: nats.subject_prefix.clone(),
            ..Default::default()
        };
        let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
        tasks.push(supervise_infallible("nats-publisher", move || {
            vps_reactors::nats::run_publisher(pool.clone(), notifier.clone(), config.clone())
        }));
    }
    let ctx = reactor_ctx(state, "webhooks");
    let webhooks = vps_reactors::webhooks::WebhookConfig {
        allow_private: state.config.webhooks.allowed_networks(),
        ..Default::default()
    };
    tasks.push(supervise_infallible("webhook-delivery", move || {
        vps_reactors::webhooks::run_webhook_delivery(ctx.clone(), webhooks.clone())
    }));
    let (pool, config) = (state.pool.clone(), state.config.clone());
    tasks.push(supervise_infallible("doctor-gauges", move || {
        crate::doctor::gauges::run(pool.clone(), config.clone())
    }));
    tasks
}
