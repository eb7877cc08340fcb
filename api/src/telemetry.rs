//! Logs (tracing) and metrics (Prometheus).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Installs the log subscriber once (`RUST_LOG` filters; default `info`). `VPS_LOG_SPANS=1`
/// also logs every span as it closes, with its busy and idle time: where a command or a
/// reactor pass spent its time.
pub fn init_logging() {
    use tracing_subscriber::fmt::format::FmtSpan;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    let spans = match std::env::var("VPS_LOG_SPANS").as_deref() {
        Ok("1") => FmtSpan::CLOSE,
        _ => FmtSpan::NONE,
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(spans)
        .with_writer(std::io::stderr)
        .try_init();
}

/// The process's Prometheus recorder, installed on first use.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .install_recorder()
                .expect("no other metrics recorder is installed")
        })
        .clone()
}
