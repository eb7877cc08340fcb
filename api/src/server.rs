//! The `vps serve` process: the HTTP API plus every background part (chainer, reactors,
//! publishers), sharing one pool and one wake-up notifier.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use vps_events::Notifier;

use crate::config::Config;
pub use crate::state::AppState;

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
            "/api/compute/{group}/{method}",
            axum::routing::post(crate::rpc::dispatch),
        )
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
    crate::telemetry::metrics_handle();
    let listen = config.listen_addr()?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("http.listen: cannot bind {listen}: {e}"))?;
    let addr = listener.local_addr()?;
    let notifier = Notifier::start(pool.clone());
    let state = AppState {
        pool: pool.clone(),
        notifier: notifier.clone(),
        secrets: secret_key(&config),
        config: Arc::new(config),
        admitter: vps_commands::instances::Admitter::start(),
    };
    let (stop, mut stopped) = watch::channel(false);
    let mut tasks = Vec::new();
    {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        tasks.push(supervise("chainer", move || {
            vps_events::chain::run_chainer(pool.clone(), notifier.clone())
        }));
    }
    tasks.extend(start_reactors(&state));
    let router = app(state.clone());
    tasks.push(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "http server stopped");
        }
    }));
    tracing::info!(%addr, "vps listening");
    Ok(RunningServer {
        addr,
        state,
        stop,
        tasks,
    })
}

/// Runs a background part forever, restarting it with a capped backoff when it fails.
pub fn supervise<F, Fut, E>(name: &'static str, part: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    tokio::spawn(async move {
        let mut backoff = Duration::from_millis(200);
        loop {
            match part().await {
                Ok(()) => return,
                Err(e) => {
                    metrics::counter!("vps_background_failures_total", "part" => name).increment(1);
                    tracing::warn!(part = name, error = %e, retry_in = ?backoff, "background part failed");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
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

/// The configured sealing key, or a random one for this process (sealed data then does not
/// survive a restart, which is fine for dev and tests and warned about).
fn secret_key(config: &Config) -> vps_commands::secrets::SecretKey {
    use base64::Engine;
    let configured = config
        .secrets
        .key
        .as_ref()
        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok())
        .and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok());
    let bytes = configured.unwrap_or_else(|| {
        tracing::warn!(
            "no [secrets] key configured: sealing user data with a key for this process only"
        );
        rand::random()
    });
    vps_commands::secrets::SecretKey::new(bytes)
}

/// A context for background parts acting as `reactor:<name>`.
pub fn reactor_ctx(state: &AppState, name: &str) -> vps_commands::Ctx {
    vps_commands::Ctx {
        pool: state.pool.clone(),
        notifier: state.notifier.clone(),
        secrets: state.secrets.clone(),
        actor: vps_commands::Actor {
            identity: format!("reactor:{name}"),
            tenant: None,
            operator: true,
        },
        request_id: None,
    }
}

/// The reactor delays from `[timings]`.
pub fn timings(config: &Config) -> vps_reactors::timings::Timings {
    let t = &config.timings;
    let s = Duration::from_secs_f64;
    vps_reactors::timings::Timings {
        unschedulable_retry: s(t.unschedulable_retry),
        transitional_look: s(t.transitional_look),
        provider_poll: s(t.provider_poll),
        provider_retry: s(t.provider_retry),
        lost_look: s(t.lost_look),
        replacement_wait: s(t.replacement_wait),
        refusing_node_exclusion: s(t.refusing_node_exclusion),
        liveness_check: s(t.liveness_check),
    }
}

/// The metering windows of `[timings] usage_window` (validated at load).
pub fn usage_windows(config: &Config) -> vps_domain::usage::Windows {
    vps_domain::usage::Windows::from_seconds(config.timings.usage_window)
        .unwrap_or_else(|| vps_domain::usage::Windows::new(300_000_000).expect("positive"))
}

/// Starts the waker, the instance reconciler, node liveness and the publishers.
fn start_reactors(state: &AppState) -> Vec<JoinHandle<()>> {
    let timings = timings(&state.config);
    let mut tasks = Vec::new();
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    tasks.push(supervise("instance-waker", move || {
        vps_reactors::waker::run(pool.clone(), notifier.clone())
    }));
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    tasks.push(supervise("node-specs", move || {
        vps_projections::node_specs::run(pool.clone(), notifier.clone())
    }));
    let (ctx, t) = (reactor_ctx(state, "instances"), timings.clone());
    tasks.push(supervise("instance-reconciler", move || {
        vps_reactors::instances::run(ctx.clone(), t.clone(), 8)
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
        tasks.push(tokio::spawn(vps_reactors::nats::run_publisher(
            pool, notifier, config,
        )));
    }
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    tasks.push(tokio::spawn(vps_reactors::webhooks::run_webhook_delivery(
        pool,
        notifier,
        vps_reactors::webhooks::WebhookConfig::default(),
    )));
    tasks
}
