//! `vps bench sandbox`: `sandboxes.create` with `wait`, from the call to `ready`, over HTTP on
//! loopback against in-process emulated hosts. Warm creates claim a paused instance of a
//! template whose pool holds one for every warm sample (the hosts resume at once); cold
//! creates use a template without a warm pool, so they are placed, booted and reported. The
//! baseline of the same run: one writer's single-event append latency on the same database.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_events::Notifier;

use super::{percentile, round, single_appends, HostedServer, Scratch, FLAVOR, IMAGE, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct SandboxBench {
    /// Warm creates measured (the warm pool holds this many).
    pub warm: usize,
    /// Cold creates measured.
    pub cold: usize,
    /// The emulated hosts' boot delay (what a cold create waits for).
    pub boot: Duration,
}

/// Runs the baseline and both phases and prints the figures, JSON line last.
pub async fn run(server_url: &str, options: &SandboxBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(server_url, 40).await?;
    let result = phases(&scratch, options).await;
    scratch.drop_database().await?;
    println!("{}", serde_json::to_string(&result?)?);
    Ok(())
}

async fn phases(scratch: &Scratch, o: &SandboxBench) -> anyhow::Result<Value> {
    let baseline = scratch
        .beside(4, async |base| {
            let notifier = Notifier::start(base.pool.clone());
            single_appends(&base.pool, &notifier, 1, Duration::from_secs(2), "single").await
        })
        .await?;
    let append_ms = 1000.0 / baseline.per_second();
    println!("single-event append (1 writer): {append_ms:.2} ms each");

    let (mut config, token) = super::server_config();
    config.timings.sandbox_pass = 2.0;
    config.timings.transitional_look = 0.5;
    let spec = super::BenchPool {
        nodes: 4,
        node_size: 256,
        quota: 1_000_000,
    };
    let hosted = HostedServer::start(&scratch.pool, config, &spec).await?;
    let hosts = hosted.hosts(|c| c.boot_delay = o.boot);
    let result = measure(&hosted, &token, o).await;
    for h in hosts {
        h.stop().await;
    }
    hosted.server.shutdown().await;
    let (warm, cold) = result?;
    let warm_p50 = percentile(&warm, 0.5);
    println!(
        "warm claim to ready: p50 {warm_p50:.2} ms  p99 {:.2} ms ({} creates; ratio to one append {:.1})",
        percentile(&warm, 0.99),
        warm.len(),
        warm_p50 / append_ms
    );
    println!(
        "cold create to ready: p50 {:.2} ms  p99 {:.2} ms ({} creates, boot {} ms)",
        percentile(&cold, 0.5),
        percentile(&cold, 0.99),
        cold.len(),
        o.boot.as_millis()
    );
    Ok(json!({
        "warm_p50_ms": round(warm_p50, 2),
        "warm_p99_ms": round(percentile(&warm, 0.99), 2),
        "cold_p50_ms": round(percentile(&cold, 0.5), 2),
        "cold_p99_ms": round(percentile(&cold, 0.99), 2),
        "append_ms": round(append_ms, 3),
        "warm_ratio_to_append": round(warm_p50 / append_ms, 1),
        "warm_creates": warm.len(),
        "cold_creates": cold.len(),
        "boot_ms": o.boot.as_millis() as u64,
    }))
}

/// The warm samples, then the cold ones (milliseconds, sorted).
async fn measure(
    hosted: &HostedServer,
    token: &str,
    o: &SandboxBench,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let client = Client {
        http: reqwest::Client::new(),
        url: hosted.server.url(),
        token: token.to_string(),
    };
    let warm = client
        .template(&hosted.pool_id, "warm", Some(o.warm))
        .await?;
    let cold = client.template(&hosted.pool_id, "cold", None).await?;
    client
        .await_warm(&hosted.server.state.pool, &warm, o.warm)
        .await?;
    let warm_samples = client.creates(&warm, "w", o.warm, true).await?;
    let cold_samples = client.creates(&cold, "c", o.cold, false).await?;
    Ok((warm_samples, cold_samples))
}

/// A tenant's HTTP client of the bench server.
pub(super) struct Client {
    pub(super) http: reqwest::Client,
    pub(super) url: String,
    pub(super) token: String,
}

impl Client {
    pub(super) async fn call(&self, method: &str, body: Value) -> anyhow::Result<Value> {
        let (group, name) = method.split_once('.').unwrap_or_default();
        let response = self
            .http
            .post(format!("{}/api/compute/{group}/{name}", self.url))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await?;
        let status = response.status();
        let answer: Value = response.json().await?;
        anyhow::ensure!(status.is_success(), "{method} answered {status}: {answer}");
        Ok(answer)
    }

    pub(super) async fn template(
        &self,
        pool: &str,
        name: &str,
        warm: Option<usize>,
    ) -> anyhow::Result<String> {
        let mut body = json!({ "tenantId": TENANT, "name": name, "poolId": pool,
                               "flavor": FLAVOR, "imageId": IMAGE });
        if let Some(n) = warm {
            body["warm"] = json!({ "min": n, "max": n });
        }
        let t = self.call("sandboxTemplates.create", body).await?;
        Ok(t["id"].as_str().unwrap_or_default().to_string())
    }

    /// Waits until the warm pool holds `n` paused instances.
    async fn await_warm(&self, db: &sqlx::PgPool, template: &str, n: usize) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let paused = vps_projections::instances::reads::warm_paused(db, template).await?;
            if paused as usize >= n {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the warm pool holds {paused} of {n}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `n` creates one after another, each waiting for `ready`; all must come from the
    /// expected path.
    async fn creates(
        &self,
        template: &str,
        tag: &str,
        n: usize,
        warm: bool,
    ) -> anyhow::Result<Vec<f64>> {
        let mut samples = Vec::with_capacity(n);
        for i in 0..n {
            let body = json!({ "tenantId": TENANT, "templateId": template, "ttlSeconds": 600,
                               "idempotencyKey": format!("{tag}-{i}"), "wait": { "timeoutMs": 30000 } });
            let t0 = Instant::now();
            let s = self.call("sandboxes.create", body).await?;
            let ms = t0.elapsed().as_secs_f64() * 1000.0;
            anyhow::ensure!(
                s["state"] == "ready",
                "sandbox {} is {}",
                s["id"],
                s["state"]
            );
            anyhow::ensure!(
                s["warm"] == warm,
                "sandbox {} warm is {}",
                s["id"],
                s["warm"]
            );
            samples.push(ms);
        }
        samples.sort_by(f64::total_cmp);
        Ok(samples)
    }
}
