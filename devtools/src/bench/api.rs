//! `vps bench api`: `instances.create` (placed, quota charged, address leased) over HTTP on
//! loopback, one run per client count (`--clients 1,16`: one client alone, then 16 at once),
//! each against single-event appends by as many writers in the same run (the baseline: what
//! the log alone sustains, and at one writer, how long one durable append takes). The
//! baseline appends to a database of its own, so the server under test never reads its events.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_events::Notifier;

use super::{percentile, round, single_appends, Creates, HostedServer, Scratch};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ApiBench {
    /// Concurrent HTTP clients of each run, in order.
    pub clients: Vec<usize>,
    /// How long the baseline and each run last.
    pub seconds: f64,
}

impl ApiBench {
    fn most_clients(&self) -> usize {
        self.clients.iter().copied().max().unwrap_or(1)
    }
}

/// Runs the baseline and every run and prints the figures, JSON line last.
pub async fn run(server_url: &str, options: &ApiBench) -> anyhow::Result<()> {
    // The server under test gets the pool a serving process opens (more with more clients).
    let connections = (options.most_clients() as u32 + 8).max(vps_api::database::SERVE_CONNECTIONS);
    let scratch = Scratch::create(server_url, connections).await?;
    let result = phases(&scratch, options).await;
    scratch.drop_database().await?;
    println!("{}", serde_json::to_string(&result?)?);
    Ok(())
}

async fn phases(scratch: &Scratch, o: &ApiBench) -> anyhow::Result<Value> {
    let duration = Duration::from_secs_f64(o.seconds);
    let most = o.most_clients() as u32 + 4;
    let baselines = scratch
        .beside(most, async |base| baselines(base, o, duration).await)
        .await?;

    let (config, token) = super::server_config();
    let spec = super::BenchPool {
        nodes: 64,
        node_size: 256,
        quota: 1_000_000,
    };
    let hosted = HostedServer::start(&scratch.pool, config, &spec).await?;
    let creates = Creates::new(
        reqwest::Client::new(),
        &hosted.server.url(),
        &token,
        &hosted.pool_id,
    );
    let mut runs = Vec::new();
    let mut ratio_16 = None;
    for (i, (&clients, &(append_per_s, append_mean_ms))) in
        o.clients.iter().zip(&baselines).enumerate()
    {
        let r = match create_run(&creates, i, clients, duration).await {
            Ok(r) => r,
            Err(e) => {
                hosted.server.shutdown().await;
                return Err(e);
            }
        };
        let ratio = r.per_second / append_per_s;
        println!(
            "instances.create ({clients:>2} clients): {:>8.0} /s  p50 {:.2} ms  p99 {:.2} ms  \
             ({} creates; ratio to appends {ratio:.3})",
            r.per_second, r.p50_ms, r.p99_ms, r.count
        );
        if clients == 16 {
            ratio_16 = Some(round(ratio, 3));
        }
        runs.push(json!({
            "clients": clients,
            "p50_ms": round(r.p50_ms, 2),
            "p99_ms": round(r.p99_ms, 2),
            "creates_per_s": round(r.per_second, 0),
            "creates": r.count,
            "ratio": round(ratio, 3),
            "append_per_s": round(append_per_s, 0),
            "append_mean_ms": round(append_mean_ms, 2),
        }));
    }
    hosted.server.shutdown().await;
    // The figure earlier readers of the JSON line know: appends by the most writers.
    let most = o.most_clients();
    let most_per_s = o
        .clients
        .iter()
        .position(|&c| c == most)
        .map_or(0.0, |i| baselines[i].0);
    Ok(json!({
        "runs": runs,
        "append_tps": round(most_per_s, 0),
        "append_writers": most,
        "ratio_16": ratio_16,
        "seconds_per_run": o.seconds,
    }))
}

/// Single-event appends by as many writers as each run has clients: `(per second, mean ms)`.
async fn baselines(
    base: &Scratch,
    o: &ApiBench,
    duration: Duration,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let notifier = Notifier::start(base.pool.clone());
    let mut baselines = Vec::new();
    for (i, &writers) in o.clients.iter().enumerate() {
        // Streams of their own: a count given twice starts on fresh streams again.
        let prefix = format!("single-{i}");
        let rate = single_appends(&base.pool, &notifier, writers, duration, &prefix).await?;
        let per_s = rate.per_second();
        // Each writer waits on one append at a time: its mean latency is writers / rate.
        let mean_ms = writers as f64 * 1000.0 / per_s;
        println!(
            "single-event appends ({writers:>2} writers): {per_s:>8.0} /s  mean {mean_ms:.2} ms"
        );
        baselines.push((per_s, mean_ms));
    }
    Ok(baselines)
}

/// What one run measured.
struct CreateRun {
    count: usize,
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Run `run` of the benchmark: `clients` clients each creating one instance after another
/// for `duration`; any answer but success fails it.
async fn create_run(
    creates: &Creates,
    run: usize,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<CreateRun> {
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::new();
    for c in 0..clients {
        let creates = creates.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies_ms = Vec::new();
            while Instant::now() < deadline {
                let key = format!("bench-{run}-{c}-{}", latencies_ms.len());
                let t0 = Instant::now();
                let response = creates.send(&key).await?;
                let status = response.status();
                let _ = response.bytes().await?;
                anyhow::ensure!(status.is_success(), "instances.create answered {status}");
                latencies_ms.push(t0.elapsed().as_secs_f64() * 1000.0);
            }
            anyhow::Ok(latencies_ms)
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    samples.sort_by(f64::total_cmp);
    Ok(CreateRun {
        count: samples.len(),
        per_second: samples.len() as f64 / elapsed,
        p50_ms: percentile(&samples, 0.5),
        p99_ms: percentile(&samples, 0.99),
    })
}
