//! `vps bench api`: `instances.create` (placed, quota charged, address leased) from 16
//! concurrent clients over HTTP on loopback, against single-event appends by 16 writers in the
//! same run (the baseline: what the log alone sustains).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use vps_events::Notifier;

use super::log::single_appends;
use super::{percentile, Scratch};
use crate::config::{Config, IdentityConfig};

const TOKEN: &str = "bench-tenant-token";

/// Knobs.
#[derive(Debug, Clone)]
pub struct ApiBench {
    /// Concurrent HTTP clients.
    pub clients: usize,
    /// How long each phase runs.
    pub seconds: f64,
}

/// Runs both phases and prints the figures, JSON line last.
pub async fn run(server_url: &str, options: &ApiBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(server_url, options.clients as u32 + 8).await?;
    let result = phases(&scratch, options).await;
    scratch.drop_database().await?;
    println!("{}", serde_json::to_string(&result?)?);
    Ok(())
}

async fn phases(scratch: &Scratch, o: &ApiBench) -> anyhow::Result<serde_json::Value> {
    let duration = Duration::from_secs_f64(o.seconds);
    let notifier = Notifier::start(scratch.pool.clone());
    let baseline = single_appends(&scratch.pool, &notifier, o.clients, duration).await?;
    let append_tps = baseline.per_second();
    println!(
        "single-event appends ({} writers): {append_tps:>8.0} /s",
        o.clients
    );

    let mut config = Config::default();
    config.http.listen = "127.0.0.1:0".into();
    config.identities = vec![
        IdentityConfig {
            token: "bench-operator-token".into(),
            identity: "id_bench_op".into(),
            operator: true,
            tenant: None,
        },
        IdentityConfig {
            token: TOKEN.into(),
            identity: "id_bench".into(),
            operator: false,
            tenant: Some("bench".into()),
        },
    ];
    let server = crate::server::start(config, scratch.pool.clone()).await?;
    let ctx = crate::server::reactor_ctx(&server.state, "bench");
    let spec = super::BenchPool {
        nodes: 64,
        node_size: 256,
        quota: 1_000_000,
    };
    let (pool_id, _nodes) = super::setup_hosted_pool(&ctx, &spec).await?;

    let http = reqwest::Client::new();
    let url = format!("{}/api/compute/instances/create", server.url());
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let started = Instant::now();
    let deadline = started + duration;
    let mut clients = Vec::new();
    for c in 0..o.clients {
        let (http, url, pool_id, latencies) = (
            http.clone(),
            url.clone(),
            pool_id.clone(),
            latencies.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                let body = json!({ "tenantId": super::TENANT, "poolId": pool_id, "flavor": super::FLAVOR, "imageId": super::IMAGE,
                                   "idempotencyKey": format!("bench-{c}-{n}") });
                let t0 = Instant::now();
                let response = http.post(&url).bearer_auth(TOKEN).json(&body).send().await?;
                let status = response.status();
                let _ = response.bytes().await?;
                anyhow::ensure!(status.is_success(), "instances.create answered {status}");
                latencies.lock().expect("not poisoned").push(t0.elapsed().as_secs_f64() * 1000.0);
                n += 1;
            }
            anyhow::Ok(())
        }));
    }
    for c in clients {
        c.await??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    server.shutdown().await;
    let mut samples = latencies.lock().expect("not poisoned").clone();
    samples.sort_by(f64::total_cmp);
    let creates = samples.len() as f64 / elapsed;
    let (p50, p99) = (percentile(&samples, 0.5), percentile(&samples, 0.99));
    println!(
        "instances.create ({} clients):     {creates:>8.0} /s  p50 {p50:.2} ms  p99 {p99:.2} ms",
        o.clients
    );
    let ratio = creates / append_tps;
    println!("ratio creates/appends: {ratio:.2}");
    Ok(json!({
        "creates_per_s": creates.round(),
        "p50_ms": (p50 * 100.0).round() / 100.0,
        "p99_ms": (p99 * 100.0).round() / 100.0,
        "append_tps": append_tps.round(),
        "ratio": (ratio * 1000.0).round() / 1000.0,
        "creates": samples.len(),
        "clients": o.clients,
    }))
}
